"""Fused GPU versions (Triton) of engine steps whose torch reference lives elsewhere."""
