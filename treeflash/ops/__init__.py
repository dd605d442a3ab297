"""Fused GPU versions (Triton) of engine steps whose torch reference lives elsewhere."""
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401  (only whether it imports)
        return True
    except ImportError:
        return False


def fused_enabled(x: torch.Tensor) -> bool:
    """Use the fused kernels for this tensor: CUDA inference (they have no backward, and
    under autocast the torch path keeps the training numerics)."""
    return (x.is_cuda and not torch.is_grad_enabled() and not torch.is_autocast_enabled("cuda")
            and triton_available())
