"""Fused elementwise steps of a decoder layer (Triton, CUDA only).

At batch 1 a decode step is a long chain of tiny kernels; inside a CUDA graph each
still costs a couple of microseconds. These kernels replace the multi-kernel torch
versions of RMSNorm (with the residual add), q/k-norm + RoPE, RoPE's cos/sin and SiLU-gating
with one launch each. The torch code in `treeflash.layers` stays the reference (CPU, tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous, wait_then_start_next
from treeflash.ops import SplitSums


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, H, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SHARES: tl.constexpr = 0,
                         PDL: tl.constexpr = False):
    """Row (token) of x [M, H], or with SHARES of x's float32 K shares [SHARES, M, H],
    added in order and rounded to the output dtype as `sum_shares` stores them."""
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    if SHARES:
        acc = tl.zeros([BLOCK], tl.float32)
        for s in tl.static_range(SHARES):
            acc += tl.load(x_ptr + (s * tl.num_programs(0) + row) * H + cols, mask=ok, other=0.0)
        x = acc.to(out_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * H + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * H + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = (xf * inv).to(out_ptr.dtype.element_ty) * w
    tl.store(out_ptr + row * H + cols, y, mask=ok)


def add_rms_norm(x: torch.Tensor | SplitSums, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """norm(x) or, with `residual`, (s, norm(s)) where s = x + residual; x may be a
    product's unadded K shares (`SplitSums`), which this launch adds first."""
    shares = x.parts.shape[0] if isinstance(x, SplitSums) else 0
    shape, dtype = x.shape, x.dtype
    H = shape[-1]
    if shares:
        xs = x.parts  # [shares, M, H] float32, contiguous
    else:
        xs = x.reshape(-1, H)
        if xs.stride(0) != H:
            xs = xs.contiguous()
    M = xs.shape[-2]
    out = torch.empty(M, H, dtype=dtype, device=xs.device)
    total = torch.empty_like(out) if residual is not None else out
    rs = residual.reshape(-1, H).contiguous() if residual is not None else xs
    # One program per row (token): a decode step's norm is a single program, a verify's
    # at most 64, so each reads its row with many loads in flight: 8 elements a thread,
    # up to 16 warps (8B shape, 4096 wide: verify(63) 0.8% and the AR step 0.2% faster
    # than with 4 warps).
    block = triton.next_power_of_2(H)
    _add_rms_norm_kernel[(M,)](xs, rs, weight, out, total, H, eps, HAS_RESIDUAL=residual is not None,
                               BLOCK=block, SHARES=shares, num_warps=max(4, min(16, block // 256)),
                               **chained(xs.device))
    out = out.view(shape)
    return (total.view(shape), out) if residual is not None else out


@triton.jit
def _cos_sin_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, scale, D: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = False):
    """Row (token): cos and sin of position * inv_freq, the D/2 frequencies twice, times scale."""
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ok = j < D
    freq = tl.load(pos_ptr + row).to(tl.float32) * tl.load(inv_ptr + j % (D // 2), mask=ok, other=0.0)
    tl.store(cos_ptr + row * D + j, (tl.cos(freq) * scale).to(cos_ptr.dtype.element_ty), mask=ok)
    tl.store(sin_ptr + row * D + j, (tl.sin(freq) * scale).to(sin_ptr.dtype.element_ty), mask=ok)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """`RotaryEmbedding.cos_sin` (the same float32 products; tl.cos/tl.sin compile to
    libdevice's cosf/sinf, as torch's CUDA kernels do) in one launch instead of six."""
    D = 2 * inv_freq.numel()
    cos = torch.empty(*positions.shape, D, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if positions.numel():  # (no tokens: nothing to launch)
        _cos_sin_kernel[(positions.numel(),)](positions.contiguous(), inv_freq, cos, sin, float(scale), D=D,
                                              BLOCK=2 * half_tile(D), **chained(positions.device))
    return cos, sin


@triton.jit
def _gather_rows_kernel(w_ptr, ids_ptr, out_ptr, H, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    src = tl.load(ids_ptr + row).to(tl.int64)  # int32 ids: src * H may pass 2^31
    tl.store(out_ptr + row * H + cols, tl.load(w_ptr + src * H + cols, mask=cols < H), mask=cols < H)


def gather_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight[ids] for a contiguous [rows, H] table: [*ids.shape, H]."""
    H = weight.shape[1]
    out = torch.empty(*ids.shape, H, dtype=weight.dtype, device=weight.device)
    BLOCK = min(triton.next_power_of_2(H), 4096)
    if ids.numel():  # (no tokens: nothing to launch)
        _gather_rows_kernel[(ids.numel(), triton.cdiv(H, BLOCK))](weight, ids.contiguous(), out, H, BLOCK=BLOCK,
                                                                  **chained(weight.device))
    return out


def half_tile(head_dim: int) -> int:
    """The RoPE kernels' tile of half a head: a power of two (Triton's ranges are), the
    lanes past head_dim / 2 masked (head sizes such as 80 or 96)."""
    return triton.next_power_of_2(head_dim // 2)


def heads_per_program(tokens: int) -> tuple[int, int]:
    """(heads, warps) per program of both RoPE kernels, from the number of tokens only, so
    that the two make the same tiles (the same sums, the same bits) for the same tokens.
    Up to 16 tokens one warp per head (AR on the 8B shape: 48 programs, 1.2 us a layer;
    1.6 us with 8 heads a program); past that 8 heads per program (a 256-token verify:
    12K programs, 9.3 us a layer -> 1.5K programs, 3.3 us; 64 tokens: 3.4 -> 2.4 us)."""
    return (1, 1) if tokens <= 16 else (8, 2)


@triton.jit
def _norm_rotate(a, b, wa, wb, c1, c2, s1, s2, eps, HAS_NORM: tl.constexpr, D: tl.constexpr, dt: tl.constexpr):
    """RoPE(RMSNorm(x)) of a tile of heads given as halves a, b [heads, D/2] (fp32),
    norm weights wa, wb and cos/sin halves broadcast to them. Both RoPE kernels call it
    on the same tile shape and warps, so they sum in the same order: the same bits."""
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D + eps)
        a = ((a * inv[:, None]).to(dt) * wa).to(tl.float32)
        b = ((b * inv[:, None]).to(dt) * wb).to(tl.float32)
    return a * c1 - b * s1, b * c2 + a * s2


@triton.jit
def _norm_rope_kernel(x_ptr, sx_b, sx_t, sx_head, T, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, eps,
                      HAS_NORM: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr,
                      PDL: tl.constexpr = False):
    start_after_previous(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HB + tl.arange(0, HB)
    half = tl.arange(0, HALF)[None, :]
    in_half = half < D // 2
    ok = (head < heads)[:, None] & in_half
    base = x_ptr + (tok // T) * sx_b + (tok % T) * sx_t + head[:, None] * sx_head
    a = tl.load(base + half, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(base + D // 2 + half, mask=ok, other=0.0).to(tl.float32)
    wa, wb = a, b
    if HAS_NORM:
        wa, wb = tl.load(w_ptr + half, mask=in_half), tl.load(w_ptr + D // 2 + half, mask=in_half)
    c1, c2 = tl.load(cos_ptr + tok * D + half, mask=in_half), tl.load(cos_ptr + tok * D + D // 2 + half, mask=in_half)
    s1, s2 = tl.load(sin_ptr + tok * D + half, mask=in_half), tl.load(sin_ptr + tok * D + D // 2 + half, mask=in_half)
    lo, hi = _norm_rotate(a, b, wa, wb, c1.to(tl.float32), c2.to(tl.float32), s1.to(tl.float32),
                          s2.to(tl.float32), eps, HAS_NORM, D, out_ptr.dtype.element_ty)
    o = out_ptr + (tok * heads + head[:, None]) * D
    tl.store(o + half, lo.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(o + D // 2 + half, hi.to(out_ptr.dtype.element_ty), mask=ok)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE(RMSNorm(x)) per head (norm skipped when weight is None): x [B, T, H, D]
    (any token/head strides, unit stride in D), cos/sin [B, T, D] -> contiguous [B, T, H, D]."""
    B, T, H, D = x.shape
    assert x.stride(3) == 1
    out = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    HB, warps = heads_per_program(B * T)
    _norm_rope_kernel[(B * T, triton.cdiv(H, HB))](
        x, x.stride(0), x.stride(1), x.stride(2), T, weight if weight is not None else x, cos, sin, out, H, eps,
        HAS_NORM=weight is not None, D=D, HALF=half_tile(D), HB=HB, num_warps=warps, **chained(x.device))
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu_ptr + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2I] = [gate | up] -> [..., I]."""
    I2 = gate_up.shape[-1]
    rows = gate_up.reshape(-1, I2).contiguous()
    out = torch.empty(rows.shape[0], I2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(I2 // 2, BLOCK))](rows, out, I2 // 2, BLOCK=BLOCK,
                                                                   **chained(rows.device))
    return out.view(*gate_up.shape[:-1], I2 // 2)


@triton.jit
def _rope_into_cache_kernel(x_ptr, sx_tok, T, H, HKV, head0, qw_ptr, kw_ptr, eps, cos_ptr, sin_ptr,
                            q_ptr, k_ptr, v_ptr, sc_b, sc_h, sc_s, prefix_ptr,
                            HAS_NORM: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HB: tl.constexpr,
                            PDL: tl.constexpr = False):
    """Program (token, block of HB heads) of the merged [q | k | v] heads: q heads are
    normed, rotated and stored to q; k heads normed, rotated and stored into the cache
    at slot prefix_lens[b] + t; v heads copied into the cache there."""
    wait_then_start_next(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = head0 + tl.program_id(1) * HB + tl.arange(0, HB)
    b = tok // T
    ok = head < H + 2 * HKV
    is_q, is_k = head < H, (head >= H) & (head < H + HKV)
    is_v = ok & (head >= H + HKV)
    half = tl.arange(0, HALF)[None, :]
    in_half = half < D // 2
    base = x_ptr + tok * sx_tok + (head - head0)[:, None] * D
    a = tl.load(base + half, mask=ok[:, None] & in_half, other=0.0)
    bb = tl.load(base + D // 2 + half, mask=ok[:, None] & in_half, other=0.0)
    slot = tl.load(prefix_ptr + b) + tok % T
    wa, wb = a, bb
    if HAS_NORM:
        wa = tl.where(is_q[:, None], tl.load(qw_ptr + half, mask=in_half), tl.load(kw_ptr + half, mask=in_half))
        wb = tl.where(is_q[:, None], tl.load(qw_ptr + D // 2 + half, mask=in_half),
                      tl.load(kw_ptr + D // 2 + half, mask=in_half))
    c1, c2 = tl.load(cos_ptr + tok * D + half, mask=in_half), tl.load(cos_ptr + tok * D + D // 2 + half, mask=in_half)
    s1, s2 = tl.load(sin_ptr + tok * D + half, mask=in_half), tl.load(sin_ptr + tok * D + D // 2 + half, mask=in_half)
    lo, hi = _norm_rotate(a.to(tl.float32), bb.to(tl.float32), wa, wb, c1.to(tl.float32), c2.to(tl.float32),
                          s1.to(tl.float32), s2.to(tl.float32), eps, HAS_NORM, D, q_ptr.dtype.element_ty)
    lo, hi = lo.to(q_ptr.dtype.element_ty), hi.to(q_ptr.dtype.element_ty)
    q_out = q_ptr + (tok * H + head[:, None]) * D
    tl.store(q_out + half, lo, mask=is_q[:, None] & in_half)
    tl.store(q_out + D // 2 + half, hi, mask=is_q[:, None] & in_half)
    cache = b * sc_b + slot * sc_s
    kv_head = (head - H).to(tl.int64)[:, None]  # x S x D passes 2^31 with ~128 KV heads at 128K
    k_out = k_ptr + cache + kv_head * sc_h
    tl.store(k_out + half, lo, mask=is_k[:, None] & in_half)
    tl.store(k_out + D // 2 + half, hi, mask=is_k[:, None] & in_half)
    v_out = v_ptr + cache + (kv_head - HKV) * sc_h
    tl.store(v_out + half, a, mask=is_v[:, None] & in_half)
    tl.store(v_out + D // 2 + half, bb, mask=is_v[:, None] & in_half)


def rope_into_cache(qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor | None,
                    k_weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, prefix_lens: torch.Tensor,
                    with_q: bool = True) -> torch.Tensor | None:
    """The attention input step in one launch: qkv [B, T, (heads + 2 kv_heads) * D] (the
    merged projection) -> RoPE(norm(q)) [B, T, heads, D] returned, RoPE(norm(k)) and v
    written into the caches [B, kv_heads, S, D] at slots prefix_lens[b] + 0..T-1. Without
    q (`with_q=False`: the drafter projecting context) qkv holds only [k | v] and only
    the cache is written."""
    B, T, W = qkv.shape
    D = cos.shape[-1]
    assert W == ((heads if with_q else 0) + 2 * kv_heads) * D
    assert qkv.stride(2) == 1 and qkv.stride(0) == T * qkv.stride(1)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    q = torch.empty(B, T, heads, D, dtype=qkv.dtype, device=qkv.device) if with_q else qkv
    cos, sin = cos.contiguous(), sin.contiguous()
    head0 = 0 if with_q else heads
    has_norm = q_weight is not None
    HB, warps = heads_per_program(B * T)
    _rope_into_cache_kernel[(B * T, triton.cdiv(heads + 2 * kv_heads - head0, HB))](
        qkv, qkv.stride(1), T, heads, kv_heads, head0, q_weight if has_norm else qkv,
        k_weight if has_norm else qkv, eps, cos, sin, q, k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), prefix_lens, HAS_NORM=has_norm, D=D,
        HALF=half_tile(D), HB=HB,
        num_warps=warps, **chained(qkv.device))
    return q if with_q else None
