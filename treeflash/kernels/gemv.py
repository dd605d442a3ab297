"""Matrix-vector product for batch-1 decoding (Triton, CUDA only).

An AR step multiplies one token's activations by every weight matrix once: it is
a stream of weight bytes. cuBLAS picks split-K GEMM kernels for these shapes (plus
a reduce launch) and reaches 60-77% of the copy bandwidth on the 4096-wide
projections of an 8B model; this kernel streams each weight row block once, with
the whole reduction in one program, at 77-100% (H200, BENCHMARKS.md). With
`gated` it also applies the SwiGLU gate to its input on the fly, so the MLP's
silu(gate) * up never goes through memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, s_ptr, N, K, KS,
                 GATED: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SCALED: tl.constexpr = False, QBN: tl.constexpr = 1, QBK: tl.constexpr = 1,
                 PDL: tl.constexpr = False):
    """y[rows] = W[rows, :] @ x for one block of BLOCK_N output rows; x is [K] (or
    [gate | up] of 2K with GATED). SCALED: W is FP8 with one scale per (QBN, QBK) block
    (s [ceil(N / QBN), KS]); each QBK-column piece of a row's products is summed, then
    scaled."""
    start_after_previous(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    scaled = tl.zeros([BLOCK_N, BLOCK_K // QBK], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        if EVEN:
            w = tl.load(w_rows + cols[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                        eviction_policy="evict_first")
        if GATED:
            g = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + K + cols, mask=col_ok, other=0.0).to(tl.float32)
            x = (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty).to(tl.float32)  # as silu_mul stores it
        else:
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if SCALED:
            pieces = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], [BLOCK_N, BLOCK_K // QBK, QBK]), 2)
            kb = k0 // QBK + tl.arange(0, BLOCK_K // QBK)
            scale = tl.load(s_ptr + (rows // QBN)[:, None] * KS + kb[None, :],
                            mask=row_ok[:, None] & (kb < KS)[None, :], other=0.0)
            scaled += pieces * scale
        else:
            acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(scaled, 1) if SCALED else tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _config(N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages) from an H200 sweep on Qwen3-8B shapes: tall
    matrices (gate/up, LM head) want more rows per program, wide ones (down) longer
    rows, the rest (QKV) small tiles."""
    if N >= 4 * K:
        bn, bk, warps, stages = 32, 256, 8, 3
    elif K >= N:
        bn, bk, warps, stages = 16, 1024, 8, 2
    else:
        bn, bk, warps, stages = 8, 512, 4, 3
    return bn, min(bk, triton.next_power_of_2(K)), warps, stages


def _fp8_config(N: int, K: int, block_cols: int) -> tuple[int, int, int, int]:
    """`_config` for FP8 weights (H200 sweep, BENCHMARKS.md section 11): rows of half the
    bytes want longer steps, in whole scale blocks."""
    tall = N >= 4 * K
    return 16 if tall else 8, max(block_cols, min(2048, triton.next_power_of_2(K))), 4, 3 if tall else 2


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         gated: bool = False, scale: torch.Tensor | None = None, block: tuple[int, int] = (1, 1)) -> torch.Tensor:
    """x [..., K] holding ONE row (or [..., 2K] = [gate | up] with `gated`), weight
    [N, K] contiguous -> [..., N] = F.linear(x, weight, bias) (of silu(gate) * up).
    With `scale`: weight is FP8, scaled per `block` (rows, cols; cols a power of two)."""
    N, K = weight.shape
    assert x.numel() == (2 * K if gated else K) and weight.is_contiguous()
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = _config(N, K) if scale is None else _fp8_config(N, K, block[1])
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x, weight, bias if bias is not None else weight, y, scale if scale is not None else weight, N, K,
        1 if scale is None else scale.shape[1], GATED=gated, HAS_BIAS=bias is not None,
        EVEN=N % bn == 0 and K % bk == 0, BLOCK_N=bn, BLOCK_K=bk, SCALED=scale is not None,
        QBN=block[0], QBK=block[1], num_warps=warps, num_stages=stages, **chained(x.device))
    return y
