"""Products of a few rows: a verify round's or a draft block's 2-64 tokens (Triton,
CUDA only).

At these sizes a product still streams its weight once (64 rows do 64 multiply-adds per
weight, far from the tensor cores' limit), so the kernel is laid out for bandwidth:
each program takes a strip of 64 weight rows through a deep pipeline of K steps, the
weights as the tensor cores' first operand (`SWAP`), and K is split where the strips
alone would leave SMs idle (an even spread of all K steps over one program per SM,
stream-K, was slower: BENCHMARKS.md section 29). Against cuBLAS on Qwen3-8B's
projections (H200, 36 layers' weights in one graph) it is 0.75-0.98x the time at 16
rows and 0.88-1.06x at 64; being a Triton kernel it also joins the round's chain of
dependent launches (`treeflash.kernels.chained`), which cuBLAS's kernels break
(BENCHMARKS.md section 14).
One row goes through the GEMV (`treeflash.kernels.gemv`); more than 64 rows, where
the product becomes compute-bound, through cuBLAS. With `gated` the MLP's [gate; up]
product stores silu(gate) * up: one launch and half the output where there were a
product and `silu_mul` (a third of the 8B shape's verify(63) gain). Where K is split,
a second kernel adds the float32 partial sums, or, for the o and down projections of a
decoder layer, the RMSNorm that follows them (`SplitSums`: 8B verify(63) 0.7% faster).

Block-scaled FP8 weights (DeepSeek-V3, Qwen3-FP8: e4m3 bytes and one float32 scale per
block of (rows, columns)) go through the same kernel with `SCALED`: each weight tile is
converted to the activations' dtype in registers (exact: e4m3 values are bfloat16 and
float16 values) and each K step's partial product is scaled by its block's scales, so
nothing is dequantized through memory. The activations stay in the model's dtype
(weight-only, as transformers reads these checkpoints; vLLM also quantizes the
activations, which measured slower here at verify sizes, BENCHMARKS.md section 11).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous
from treeflash.kernels.gemv import gemv
from treeflash.ops import SplitSums

MAX_ROWS = 64  # past this cuBLAS (compute-bound products)
# The MLP's gated product stays here to 128 rows, where its fused gating still wins: on an
# H100 at 128 rows of Qwen3-8B 81.2 us against cuBLAS's 91.7 and a `silu_mul` (BENCHMARKS.md 42).
GATED_MAX_ROWS = 128


@triton.jit
def _weight_tile(w_ptr, rows, rk, n_ok, k_ok, K, dtype, SWAP: tl.constexpr):
    """W's [rows, BLOCK_K] tile (SWAP), else its [BLOCK_K, rows] transpose, streamed past
    the caches and converted to the activations' dtype."""
    if SWAP:
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptr + rows[None, :].to(tl.int64) * K + rk[:, None], mask=n_ok[None, :] & k_ok[:, None],
                    other=0.0, eviction_policy="evict_first")
    return w.to(dtype)


@triton.jit
def _product(x, w, scale, IEEE: tl.constexpr, SCALED: tl.constexpr, SWAP: tl.constexpr):
    """One K step: W x^T [rows, BLOCK_M] (SWAP) or x W^T [BLOCK_M, rows], each weight
    row's products times its scale block's scale (SCALED)."""
    a, b = (w, x) if SWAP else (x, w)
    if IEEE:
        part = tl.dot(a, b, input_precision="ieee")
    else:
        part = tl.dot(a, b)
    if SCALED:
        part = part * (scale[:, None] if SWAP else scale[None, :])
    return part


@triton.jit
def _plus_bias(acc, b_ptr, rows, n_ok, HAS_BIAS: tl.constexpr, SWAP: tl.constexpr):
    if HAS_BIAS:
        b = tl.load(b_ptr + rows, mask=n_ok, other=0.0).to(tl.float32)
        acc += b[:, None] if SWAP else b[None, :]
    return acc


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, KS, stride_x, stride_y, K_STEPS,
                   HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SCALED: tl.constexpr, GATED: tl.constexpr,
                   QBN: tl.constexpr, QBK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, SWAP: tl.constexpr, PDL: tl.constexpr = False):
    """One [BLOCK_M, BLOCK_N] tile of x @ W^T (W * scales with SCALED) over this
    program's K_STEPS steps of BLOCK_K. GATED: W is [gate; up], N rows each, and the
    tile is silu(x gate^T) * (x up^T), both products rounded to y's dtype first (as
    the unfused product stores them). SPLIT > 1 (program_id 2: which share of K): the
    float32 partial sums go to y [SPLIT, M, N] ([SPLIT, M, 2N] with GATED), summed (and
    gated) by `_sum_splits_kernel`. SCALED: BLOCK_K divides QBK, so each step lies in
    one scale block. SWAP: the tile is computed as W x^T [BLOCK_N, BLOCK_M], the
    weights being the tensor cores' first operand."""
    start_after_previous(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], tl.float32)  # GATED only
    for step in range(split * K_STEPS, tl.minimum((split + 1) * K_STEPS, tl.cdiv(K, BLOCK_K))):
        k0 = step * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        if SCALED:
            scale = tl.load(s_ptr + (rn // QBN) * KS + k0 // QBK, mask=n_ok, other=0.0)
            scale_up = tl.load(s_ptr + ((rn + N) // QBN) * KS + k0 // QBK, mask=n_ok, other=0.0) if GATED else scale
        else:
            scale = 1.0
            scale_up = 1.0
        if SWAP:  # x^T [BLOCK_K, BLOCK_M]
            x = tl.load(x_ptr + rm[None, :].to(tl.int64) * stride_x + rk[:, None],
                        mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        else:  # x [BLOCK_M, BLOCK_K]
            x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = _weight_tile(w_ptr, rn, rk, n_ok, k_ok, K, x.dtype, SWAP)
        acc += _product(x, w, scale, IEEE, SCALED, SWAP)
        if GATED:
            w_up = _weight_tile(w_ptr, rn + N, rk, n_ok, k_ok, K, x.dtype, SWAP)
            acc_up += _product(x, w_up, scale_up, IEEE, SCALED, SWAP)
    base = y_ptr + split.to(tl.int64) * M * stride_y
    if SWAP:  # acc is [BLOCK_N, BLOCK_M]: stored through transposed addresses (a tl.trans would
        out = base + rm[None, :].to(tl.int64) * stride_y + rn[:, None]  # re-lay the whole loop's tiles)
        ok = m_ok[None, :] & n_ok[:, None]
    else:
        out = base + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT > 1:
        tl.store(out, acc, mask=ok)
        if GATED:
            tl.store(out + N, acc_up, mask=ok)
    else:
        dtype = y_ptr.dtype.element_ty
        acc = _plus_bias(acc, b_ptr, rn, n_ok, HAS_BIAS, SWAP)
        if GATED:
            gate = acc.to(dtype).to(tl.float32)
            up = _plus_bias(acc_up, b_ptr, rn + N, n_ok, HAS_BIAS, SWAP).to(dtype).to(tl.float32)
            acc = gate * tl.sigmoid(gate) * up
        tl.store(out, acc.to(dtype), mask=ok)


@triton.jit
def _sum_splits_kernel(p_ptr, b_ptr, y_ptr, MN, N, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                       SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """y [M, N] = the SPLIT partial sums [SPLIT, M, N] added in order (+ bias), in y's
    dtype; GATED: of [SPLIT, M, 2N] = [gate | up], y = silu(gate) * up, as
    `_matmul_kernel` computes it."""
    start_after_previous(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    col = i % N
    src = (i // N) * 2 * N + col if GATED else i
    size = 2 * MN if GATED else MN
    acc = tl.zeros([BLOCK], tl.float32)
    up = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT):
        acc += tl.load(p_ptr + s * size + src, mask=ok, other=0.0)
        if GATED:
            up += tl.load(p_ptr + s * size + src + N, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + col, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            up += tl.load(b_ptr + N + col, mask=ok, other=0.0).to(tl.float32)
    dtype = y_ptr.dtype.element_ty
    if GATED:
        gate = acc.to(dtype).to(tl.float32)
        acc = gate * tl.sigmoid(gate) * up.to(dtype).to(tl.float32)
    tl.store(y_ptr + i, acc.to(dtype), mask=ok)


def _fp8_config(M: int, N: int, K: int) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, split of K, warps, stages, SWAP) for FP8 weights, from H200
    sweeps on Qwen3-8B's projections at 16, 32 and 64 rows (BENCHMARKS.md section 11):
    the fewest padded rows; at 16 rows narrow column tiles, K split 8 ways where it is
    much longer than N (the down projection); from 32 rows the swapped product, 64 weight
    rows per program, K split 4 ways unless the grid is already wide (the tall gate/up).
    FP8 weights take every row count (prefill too): nothing else reads them undequantized."""
    if M > 64:
        return 128, 128, 1, 8, 3, True
    if M <= 16:
        return 16, 32 if N <= 8192 else 64, 8 if K >= 2 * N else 1, 4, 4, False
    return max(16, triton.next_power_of_2(M)), 64, 1 if N >= 16384 else 4, 4, 3 if N >= 16384 else 4, True


@functools.cache
def _config(M: int, N: int, K: int, itemsize: int, sms: int, gated: bool) -> tuple[int, int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, split of K, warps, stages, SWAP) for 16-bit weights,
    from an H200 sweep on Qwen3-8B's projections at 16 and 64 rows (BENCHMARKS.md section
    14): swapped, strips of 64 weight rows (two with `gated`), 128-column steps 5 deep
    (4 with `gated`, for shared memory; 3 past four waves of strips: the LM head), K
    split so that strips x shares fill the SMs about once (the 4096-row o and down
    projections: 2 shares; more shares cost more in float32 partial sums than they
    gain), each share at least two steps (on small matrices, one-step shares lose more in
    the sums than they gain: the built-in pair's chain and 16-32-node rounds 8-13% shorter, section
    36). Up to 16 rows an ungated step is 20 KB, not 32, and 7 fit: the qkv product
    (96 strips, so 96 busy SMs) takes 15.9 us a layer at 16 rows, not 18.2 (section 19).
    float32 (tests) takes 32-column steps 3 deep. Past 64 rows (gated only) the tile is
    128 x 128, unswapped, 64-column steps 4 deep, K whole: the best of nine tilings at
    128 rows (BENCHMARKS.md 42)."""
    strips, wide = triton.cdiv(N, 64), itemsize <= 2
    if M > MAX_ROWS:
        return 128, 128, 64 if wide else 32, 1, 8, 4 if wide else 2, False
    bk = 128 if wide else 32
    split = max(1, min(triton.cdiv(K, bk) // 2, sms // strips))
    stages = (4 if gated else 7 if M <= 16 else 5) if wide and strips <= 4 * sms else 3
    return max(16, triton.next_power_of_2(M)), 64, bk, split, 4, stages, True


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sum_shares(parts: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None,
               gated: bool = False) -> torch.Tensor:
    """[M, N] in `dtype`: the float32 partial sums [shares, M, N] added in order (+ bias);
    `gated`: of [shares, M, 2N] = [gate | up], silu(gate) * up."""
    shares, M, width = parts.shape
    N = width // 2 if gated else width
    y = torch.empty(M, N, dtype=dtype, device=parts.device)
    _sum_splits_kernel[(triton.cdiv(M * N, 1024),)](parts, bias if bias is not None else parts, y, M * N, N,
                                                    HAS_BIAS=bias is not None, GATED=gated, SPLIT=shares,
                                                    BLOCK=1024, **chained(parts.device))
    return y


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, block: tuple[int, int] = (1, 1), gated: bool = False,
           add_shares: bool = True) -> "torch.Tensor | SplitSums":
    """F.linear(x, weight, bias) for weight [N, K] (contiguous) in x's dtype and x
    [..., K] of at most MAX_ROWS rows (GATED_MAX_ROWS gated; one: the GEMV); or, with `scale`, for an FP8
    weight scaled per `block` (scales [ceil(N / rows), ceil(K / cols)], cols a power of two of 16 or more:
    `Fp8Weight.fits_kernels`), any number of rows. `gated`: weight (and bias) is
    [gate; up] and the result silu(x gate^T) * (x up^T), [..., N / 2] (FP8: the halves
    start on a scale block). `add_shares=False`: where K is split in shares and there is
    no bias or gating, the partial sums come back unadded (`SplitSums`) for the next
    kernel to add (the fused RMSNorm), one launch fewer."""
    N, K = weight.shape
    if x.numel() == K and not gated:
        return gemv(x, weight, bias, scale=scale, block=block)
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    M = rows.shape[0]
    if M == 0:
        return x.new_empty(*x.shape[:-1], N // 2 if gated else N)
    if scale is None:
        assert M <= (GATED_MAX_ROWS if gated else MAX_ROWS) and weight.dtype == x.dtype
        sms = _sm_count(x.device.index) if x.is_cuda else 132
        bm, bn, bk, split, warps, stages, swap = _config(M, N // 2 if gated else N, K, x.element_size(), sms, gated)
    else:
        bm, bn, split, warps, stages, swap = _fp8_config(M, N, K)
        bk = min(block[1], 128)
    if gated:
        N //= 2
    steps = triton.cdiv(triton.cdiv(K, bk), split)
    split = triton.cdiv(triton.cdiv(K, bk), steps)  # no empty shares
    width = 2 * N if gated else N  # of a partial sum's row
    out = torch.empty(M, N, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.empty(split, M, width, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    dummy = weight if scale is None else scale
    _matmul_kernel[grid](rows, weight, dummy, bias if bias is not None else dummy, out, M, N, K,
                         1 if scale is None else scale.shape[1], rows.stride(0), N if split == 1 else width, steps,
                         HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, SCALED=scale is not None,
                         GATED=gated, QBN=block[0], QBK=block[1], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                         SWAP=swap, num_warps=warps, num_stages=stages, **chained(rows.device))
    if split > 1 and not add_shares and bias is None and not gated:
        return SplitSums(out, x.dtype, (*x.shape[:-1], N))
    y = out if split == 1 else sum_shares(out, x.dtype, bias, gated)
    return y.view(*x.shape[:-1], N)
