"""Fused GPU versions (Triton) of engine steps whose torch reference lives elsewhere."""
from functools import lru_cache

import torch
import torch.nn.functional as F


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


def single_row(x: torch.Tensor) -> bool:
    """One token of one request: batch-1 decoding, where a product is a weight stream."""
    return x.numel() == x.shape[-1]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; on the fused path a single row goes through the Triton GEMV."""
    if fused_enabled(x) and single_row(x) and weight.is_contiguous():
        from treeflash.kernels.gemv import gemv
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def gated_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight) of one row [..., 2I] = [gate | up] in one
    launch (fused path, single row: see `treeflash.kernels.gemv`)."""
    from treeflash.kernels.gemv import gemv
    return gemv(gate_up, weight, gated=True)


def topk_logsumexp(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, ids) of `x.topk(k)` over the last dim and `x.logsumexp(-1, keepdim=True)`:
    the drafter's per-depth candidates. One launch on the fused path (torch: ~6)."""
    if fused_enabled(x):
        from treeflash.kernels.vocab_topk import fits, topk_logsumexp as fused
        if fits(x.shape[-1], k):
            return fused(x, k)
    vals, ids = x.topk(k, dim=-1)
    return vals, ids, torch.logsumexp(x, dim=-1, keepdim=True)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(-1)` (first index among equal maxima); one Triton launch on the fused
    path, where torch's reduction took 14 us for 65 rows of 4096 (H200)."""
    if fused_enabled(x) and x.dtype != torch.float64:
        from treeflash.ops.gumbel_argmax import row_argmax
        return row_argmax(x)
    return x.argmax(-1)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.embedding(ids, weight)`; one program per token on the fused path, where torch's
    index_select gives a 384-wide table 3 blocks that walk the tokens one by one (16
    tokens: 6 us on an H200)."""
    if fused_enabled(ids) and weight.is_contiguous():
        from treeflash.ops.fused import gather_rows
        return gather_rows(weight, ids)
    return F.embedding(ids, weight)
