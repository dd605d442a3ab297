"""The engine's elementwise and small steps, each with its fused GPU version (Triton)
and its torch reference side by side, and FP8 block quantization."""
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

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


@dataclass(frozen=True)
class SplitSums:
    """A few-row product whose K shares are not added yet: float32 partial sums
    [shares, rows, N], to be added in order and rounded to `dtype` by the kernel that
    reads them next (the fused RMSNorm after a row-parallel projection), not by a
    launch of their own. `shape`: the summed output's."""

    parts: torch.Tensor
    dtype: torch.dtype
    shape: tuple[int, ...]

    def sum(self) -> torch.Tensor:
        """The product, as the unfused path returns it."""
        from treeflash.kernels.matmul import sum_shares
        return sum_shares(self.parts, self.dtype).view(self.shape)


def summed(x: "torch.Tensor | SplitSums") -> torch.Tensor:
    """x, with its K shares added if it still has them."""
    return x.sum() if isinstance(x, SplitSums) else x


class Fp8Weight(NamedTuple):
    """The scales of an FP8 weight [N, K]: scale [ceil(N / rows), ceil(K / cols)] float32,
    one per block of `block` = (rows, cols); the weight is fp8 * scale."""

    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def fits_kernels(self) -> bool:
        return fp8_kernels_fit(self.block)


def fp8_kernels_fit(block: tuple[int, int]) -> bool:
    """The Triton kernels take scale blocks a power of two of 16 columns or more."""
    cols = block[1]
    return cols >= 16 and cols & (cols - 1) == 0


FP8_MAX = 448.0  # the largest float8 e4m3fn value


def fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] as block-scaled FP8 (DeepSeek-V3's format): (float8 e4m3 [N, K],
    float32 scales [ceil(N / rows), ceil(K / cols)]), each block's scale its largest
    magnitude over FP8_MAX, so that fp8 * scale is the weight, rounded."""
    (bn, bk), (N, K) = block, weight.shape
    w = torch.nn.functional.pad(weight.float(), (0, -K % bk, 0, -N % bn))
    blocks = w.view(w.shape[0] // bn, bn, w.shape[1] // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(w.shape)[:N, :K]
    return q.contiguous(), scale


def dequantized(weight: torch.Tensor, fp8: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 weight as `dtype` values (fp8 * its block's scale, in float32)."""
    (bn, bk), (N, K) = fp8.block, weight.shape
    scale = fp8.scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return (weight.float() * scale).to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fp8: Fp8Weight | None = None, add_shares: bool = True) -> "torch.Tensor | SplitSums":
    """F.linear (of the dequantized weight, with `fp8`: the activations stay in their
    dtype); on the fused path a single row goes through the Triton GEMV, up to 64 rows
    (a round's verify or draft) through the Triton few-row product, and FP8 weights
    through those kernels at any row count, read as they are. `add_shares=False`: a
    bias-free product split over K may come back as `SplitSums`."""
    if fused_enabled(x) and weight.is_contiguous():
        from treeflash.kernels.matmul import MAX_ROWS, matmul
        if fp8 is not None and fp8.fits_kernels:
            return matmul(x, weight, bias, fp8.scale, fp8.block, add_shares=add_shares)
        if fp8 is None and x.dtype == weight.dtype and x.numel() <= MAX_ROWS * x.shape[-1]:
            return matmul(x, weight, bias, add_shares=add_shares)
    if fp8 is not None:
        weight = dequantized(weight, fp8, x.dtype)
    # Rows flattened first: F.linear of a [B, T, K] whose rows are not evenly strided
    # (the draft's h[:, 1:]) is B products that each read the whole weight (the LM
    # head 8 times over for 8 requests: 2.3 ms of an 8B shape's draft step).
    return F.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def swiglu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           fp8: Fp8Weight | None = None) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) for the MLP's merged weight [gate; up] ([..., I]).
    On the fused path, up to 128 rows (64 with FP8; a round's verify or draft) in one
    launch, the gating in the product's epilogue; else the product, then `silu_mul` (GPU) or torch."""
    if fused_enabled(x) and weight.is_contiguous() and (fp8 is None or fp8.fits_kernels):
        from treeflash.kernels.matmul import GATED_MAX_ROWS, MAX_ROWS, matmul
        # FP8 keeps 64 gated rows (its product, then `silu_mul`, past them): its gated tiles past 64 untimed
        most = GATED_MAX_ROWS if fp8 is None else MAX_ROWS
        if x.numel() <= most * x.shape[-1] and (fp8 is not None or x.dtype == weight.dtype):
            if fp8 is None:
                return matmul(x, weight, bias, gated=True)
            return matmul(x, weight, bias, fp8.scale, fp8.block, gated=True)
    gate_up = linear(x, weight, bias, fp8)
    if fused_enabled(x):
        from treeflash.ops.fused import silu_mul
        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gated_linear(gate_up: torch.Tensor, weight: torch.Tensor, fp8: Fp8Weight | None = None) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight) of one row [..., 2I] = [gate | up] in one
    launch (fused path, single row: see `treeflash.kernels.gemv`)."""
    if fp8 is not None and not fp8.fits_kernels:
        gate, up = gate_up.chunk(2, dim=-1)
        return linear(F.silu(gate) * up, weight, None, fp8)
    from treeflash.kernels.gemv import gemv
    if fp8 is not None:
        return gemv(gate_up, weight, gated=True, scale=fp8.scale, block=fp8.block)
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


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k)` over the last dim; on the fused path `topk_logsumexp`'s launch where it
    is faster (a 152K vocabulary at k <= 64: the filters' largest logits, structured
    outputs' candidates)."""
    if fused_enabled(x):
        from treeflash.kernels.vocab_topk import fits, topk_logsumexp as fused
        if fits(x.shape[-1], k):
            return fused(x, k)[:2]
    return x.topk(k, dim=-1)


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
