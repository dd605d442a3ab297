"""Reusable, tensor-parallel-aware building blocks shared by targets and drafters, and
the static KV caches their attention writes."""
