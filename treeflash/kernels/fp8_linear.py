"""Products with block-scaled FP8 weights (Triton, CUDA only).

An FP8 checkpoint's weight is e4m3 bytes and one float32 scale per block of (rows,
columns), 128 x 128 in DeepSeek-V3 and Qwen3-FP8. A decode step streams the weights,
so reading one byte per weight instead of two is the gain; nothing is dequantized
through memory. The activations stay in the model's dtype (weight-only: transformers'
dequantized reading of these checkpoints; vLLM also quantizes the activations, which
measured slower here at verify sizes, BENCHMARKS.md section 11). One row goes through
the GEMV (`treeflash.kernels.gemv`, which sums each scale block's products, then
scales). More rows (verify, draft, prefill) go through the tiled product below: each
tile of weights is converted to the activations' dtype in registers, multiplied on the
tensor cores, and each K step's partial product is scaled by its block's scales.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous
from treeflash.kernels.gemv import gemv


@triton.jit
def _fp8_matmul_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, KS, stride_x, stride_y, K_STEPS,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, QBN: tl.constexpr, QBK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr = False):
    """One [BLOCK_M, BLOCK_N] tile of x @ (W * scales)^T over this program's K_STEPS steps
    of BLOCK_K (program_id 2: which share of K, with SPLIT > 1: its float32 partial
    sums go to y [SPLIT, M, N], summed by `_sum_splits_kernel`). BLOCK_K divides QBK, so
    each step lies in one scale block; the weight tile is converted to x's dtype in
    registers (exact: e4m3 values are bfloat16 and float16 values). SWAP: the tile is
    computed as W x^T [BLOCK_N, BLOCK_M], the weights being the tensor cores' first
    operand, which they read from registers (faster from 32 rows on, slower at 16)."""
    start_after_previous(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], tl.float32)
    for step in range(split * K_STEPS, tl.minimum((split + 1) * K_STEPS, tl.cdiv(K, BLOCK_K))):
        k0 = step * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        scale = tl.load(s_ptr + (rn // QBN) * KS + k0 // QBK, mask=n_ok, other=0.0)
        if SWAP:  # a: W [BLOCK_N, BLOCK_K], b: x^T [BLOCK_K, BLOCK_M]
            b = tl.load(x_ptr + rm[None, :].to(tl.int64) * stride_x + rk[:, None],
                        mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            a = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0, eviction_policy="evict_first").to(b.dtype)
        else:  # a: x [BLOCK_M, BLOCK_K], b: W^T [BLOCK_K, BLOCK_N]
            a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=n_ok[None, :] & k_ok[:, None],
                        other=0.0, eviction_policy="evict_first").to(a.dtype)
        if IEEE:
            part = tl.dot(a, b, input_precision="ieee")
        else:
            part = tl.dot(a, b)
        if SWAP:
            acc += part * scale[:, None]
        else:
            acc += part * scale[None, :]
    base = y_ptr + split.to(tl.int64) * M * N
    if SWAP:  # acc is [BLOCK_N, BLOCK_M]: stored through transposed addresses (a tl.trans would
        out = base + rm[None, :].to(tl.int64) * stride_y + rn[:, None]  # re-lay the whole loop's tiles)
        ok = m_ok[None, :] & n_ok[:, None]
        if HAS_BIAS and SPLIT == 1:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    else:
        out = base + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        if HAS_BIAS and SPLIT == 1:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if SPLIT == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.store(out, acc, mask=ok)


@triton.jit
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, MN, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y = the SPLIT partial sums [SPLIT, M, N] added in order (+ bias), in y's dtype."""
    start_after_previous(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.load(p_ptr + i, mask=ok, other=0.0)
    for s in range(1, SPLIT):
        acc += tl.load(p_ptr + s * MN + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _config(M: int, N: int, K: int) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, split of K, warps, stages, SWAP) from H200 sweeps on Qwen3-8B's
    projections at 16, 32 and 64 rows (BENCHMARKS.md section 11): the fewest padded
    rows; at 16 rows narrow column tiles, K split 8 ways where it is much longer than N
    (the down projection); from 32 rows the swapped product, 64 weight rows per
    program, K split 4 ways unless the grid is already wide (the tall gate/up)."""
    if M > 64:
        return 128, 128, 1, 8, 3, True
    if M <= 16:
        return 16, 32 if N <= 8192 else 64, 8 if K >= 2 * N else 1, 4, 4, False
    return max(16, triton.next_power_of_2(M)), 64, 1 if N >= 16384 else 4, 4, 3 if N >= 16384 else 4, True


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight * block scales, bias) for an FP8 weight [N, K] (contiguous)
    and scales [ceil(N / rows), ceil(K / cols)] (`Fp8Weight.fits_kernels`: cols a power
    of two, at least 16)."""
    N, K = weight.shape
    if x.numel() == K:
        return gemv(x, weight, bias, scale=scale, block=block)
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    bm, bn, split, warps, stages, swap = _config(M, N, K)
    bk = min(block[1], 128)
    steps = triton.cdiv(triton.cdiv(K, bk), split)
    split = triton.cdiv(triton.cdiv(K, bk), steps)  # no empty shares
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    _fp8_matmul_kernel[grid](rows, weight, scale, bias if bias is not None else scale, out, M, N, K, scale.shape[1],
                             rows.stride(0), N, steps, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                             QBN=block[0], QBK=block[1], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, SWAP=swap,
                             num_warps=warps, num_stages=stages, **chained(rows.device))
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](out, bias if bias is not None else out, y, M * N, N,
                                                        HAS_BIAS=bias is not None, SPLIT=split, BLOCK=1024,
                                                        **chained(out.device))
    return y.view(*x.shape[:-1], N)
