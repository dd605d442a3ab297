"""Fused elementwise steps of a decoder layer (Triton, CUDA only).

At batch 1 a decode step is a long chain of tiny kernels; inside a CUDA graph each
still costs a couple of microseconds. These kernels replace the multi-kernel torch
versions of RMSNorm (with the residual add), q/k-norm + RoPE and SiLU-gating with one
launch each. The torch code in `treeflash.layers` stays the reference (CPU, tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, H, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
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


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
    """norm(x) or, with `residual`, (s, norm(s)) where s = x + residual."""
    H = x.shape[-1]
    xs = x.reshape(-1, H)
    if xs.stride(0) != H:
        xs = xs.contiguous()
    out = torch.empty_like(xs)
    total = torch.empty_like(xs) if residual is not None else out
    rs = residual.reshape(-1, H).contiguous() if residual is not None else xs
    _add_rms_norm_kernel[(xs.shape[0],)](xs, rs, weight, out, total, H, eps,
                                         HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(H))
    out = out.view(x.shape)
    return (total.view(x.shape), out) if residual is not None else out


@triton.jit
def _norm_rope_kernel(x_ptr, sx_b, sx_t, sx_head, T, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, eps,
                      HAS_NORM: tl.constexpr, D: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = tl.arange(0, D // 2)
    base = x_ptr + (tok // T) * sx_b + (tok % T) * sx_t + head * sx_head
    a = tl.load(base + half).to(tl.float32)
    b = tl.load(base + D // 2 + half).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / D + eps)
        dt = out_ptr.dtype.element_ty
        a = ((a * inv).to(dt) * tl.load(w_ptr + half)).to(tl.float32)
        b = ((b * inv).to(dt) * tl.load(w_ptr + D // 2 + half)).to(tl.float32)
    c1 = tl.load(cos_ptr + tok * D + half).to(tl.float32)
    c2 = tl.load(cos_ptr + tok * D + D // 2 + half).to(tl.float32)
    s1 = tl.load(sin_ptr + tok * D + half).to(tl.float32)
    s2 = tl.load(sin_ptr + tok * D + D // 2 + half).to(tl.float32)
    o = out_ptr + (tok * heads + head) * D
    tl.store(o + half, a * c1 - b * s1)
    tl.store(o + D // 2 + half, b * c2 + a * s2)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
              cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE(RMSNorm(x)) per head (norm skipped when weight is None): x [B, T, H, D]
    (any token/head strides, unit stride in D), cos/sin [B, T, D] -> contiguous [B, T, H, D]."""
    B, T, H, D = x.shape
    assert x.stride(3) == 1
    out = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
    cos, sin = cos.contiguous(), sin.contiguous()
    _norm_rope_kernel[(B * T, H)](x, x.stride(0), x.stride(1), x.stride(2), T, weight if weight is not None else x,
                                   cos, sin, out, H, eps, HAS_NORM=weight is not None, D=D,
                                   num_warps=1)  # as rope_into_cache: the same sums, the same bits
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
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
    _silu_mul_kernel[(rows.shape[0], triton.cdiv(I2 // 2, BLOCK))](rows, out, I2 // 2, BLOCK=BLOCK)
    return out.view(*gate_up.shape[:-1], I2 // 2)


@triton.jit
def _rope_into_cache_kernel(x_ptr, sx_tok, T, H, HKV, head0, qw_ptr, kw_ptr, eps, cos_ptr, sin_ptr,
                            q_ptr, k_ptr, v_ptr, sc_b, sc_h, sc_s, prefix_ptr,
                            HAS_NORM: tl.constexpr, D: tl.constexpr):
    """Program (token, head) of the merged [q | k | v] heads: q heads are normed, rotated
    and stored to q; k heads normed, rotated and stored into the cache at slot
    prefix_lens[b] + t; v heads copied into the cache there."""
    tok = tl.program_id(0).to(tl.int64)
    head = head0 + tl.program_id(1)
    b = tok // T
    half = tl.arange(0, D // 2)
    base = x_ptr + tok * sx_tok + (head - head0) * D
    a = tl.load(base + half)
    bb = tl.load(base + D // 2 + half)
    slot = tl.load(prefix_ptr + b) + tok % T
    if head < H + HKV:
        af, bf = a.to(tl.float32), bb.to(tl.float32)
        if HAS_NORM:
            if head < H:
                wa, wb = tl.load(qw_ptr + half), tl.load(qw_ptr + D // 2 + half)
            else:
                wa, wb = tl.load(kw_ptr + half), tl.load(kw_ptr + D // 2 + half)
            inv = tl.rsqrt((tl.sum(af * af, axis=0) + tl.sum(bf * bf, axis=0)) / D + eps)
            dt = q_ptr.dtype.element_ty
            af = ((af * inv).to(dt) * wa).to(tl.float32)
            bf = ((bf * inv).to(dt) * wb).to(tl.float32)
        c1 = tl.load(cos_ptr + tok * D + half).to(tl.float32)
        c2 = tl.load(cos_ptr + tok * D + D // 2 + half).to(tl.float32)
        s1 = tl.load(sin_ptr + tok * D + half).to(tl.float32)
        s2 = tl.load(sin_ptr + tok * D + D // 2 + half).to(tl.float32)
        lo, hi = af * c1 - bf * s1, bf * c2 + af * s2
        if head < H:
            o = q_ptr + (tok * H + head) * D
        else:
            o = k_ptr + b * sc_b + (head - H) * sc_h + slot * sc_s
        tl.store(o + half, lo.to(q_ptr.dtype.element_ty))
        tl.store(o + D // 2 + half, hi.to(q_ptr.dtype.element_ty))
    else:
        o = v_ptr + b * sc_b + (head - H - HKV) * sc_h + slot * sc_s
        tl.store(o + half, a)
        tl.store(o + D // 2 + half, bb)


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
    _rope_into_cache_kernel[(B * T, heads + 2 * kv_heads - head0)](
        qkv, qkv.stride(1), T, heads, kv_heads, head0, q_weight if has_norm else qkv,
        k_weight if has_norm else qkv, eps, cos, sin, q, k_cache, v_cache,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), prefix_lens, HAS_NORM=has_norm, D=D,
        num_warps=1)  # a head is 128 values: one warp (a 256-token verify has 12K such programs)
    return q if with_q else None
