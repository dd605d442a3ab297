"""Reusable, tensor-parallel-aware building blocks shared by targets and drafters."""
