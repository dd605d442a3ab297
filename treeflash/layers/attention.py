"""Attention over a KV cache for a block of new tokens.

Every forward in treeflash has the same shape: each request `b` has a committed
prefix of `prefix_lens[b]` cached tokens, and a block of `T` new tokens whose K/V
are written at cache slots `prefix_lens[b] + 0..T-1`. A query sees the whole prefix
(no mask) and the block tokens that `block_mask[b, i, j]` allows: causal for a
prefill, the ancestor matrix for a verified tree, all-true for a drafter block.
This split is what lets a kernel read the prefix once for all tree queries; the
plain SDPA version below is the reference every faster kernel is tested against.

Two gpt-oss additions, both per layer: a sliding `window` (a query at position p sees
only keys at positions > p - window; a committed slot's position is its index) and
attention `sinks` (one learned logit per head that joins every softmax's denominator
and adds nothing to the output).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionInputs:
    """Per-forward metadata, shared by all layers."""

    positions: torch.Tensor     # [B, T] RoPE positions of the block tokens
    prefix_lens: torch.Tensor | None  # [B] committed (cached) tokens before the block (None: dense path)
    block_mask: torch.Tensor | None  # [B, T, T] bool: block query i may see block key j
                                     # (dense/training path: [B, T, S] or None for causal)
    kv_len: int | None = None   # cache slots a reference kernel needs to read (None: all)
    backend: str = "sdpa"       # "sdpa" (reference) or "triton" (GPU kernel)
    is_prefill: bool = False    # empty prefix, causal block: plain causal attention suffices

    @classmethod
    def causal(cls, positions: torch.Tensor, prefix_lens: torch.Tensor | None = None,
               kv_len: int | None = None, backend: str = "sdpa") -> "AttentionInputs":
        B, T = positions.shape
        mask = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
        prefill = prefix_lens is None
        if prefill:
            prefix_lens = torch.zeros(B, dtype=torch.long, device=positions.device)
        return cls(positions, prefix_lens, mask.expand(B, T, T), kv_len, backend, is_prefill=prefill)

    def block_slots(self) -> torch.Tensor:
        """[B, T] cache slots of the block tokens."""
        T = self.positions.shape[1]
        return self.prefix_lens[:, None] + torch.arange(T, device=self.prefix_lens.device)

    def full_mask(self, S: int, window: int | None = None) -> torch.Tensor:
        """[B, T, S] bool mask over cache slots 0..S-1 (prefix | allowed block keys),
        within `window` positions of each query if given."""
        B, T = self.positions.shape
        slots = torch.arange(S, device=self.prefix_lens.device)
        rel = slots[None, :] - self.prefix_lens[:, None]                    # [B, S]
        in_block = (rel >= 0) & (rel < T)
        idx = rel.clamp(0, T - 1)
        allowed = self.block_mask.gather(2, idx[:, None, :].expand(B, T, S)) & in_block[:, None, :]
        allowed = allowed | (rel < 0)[:, None, :]
        if window is None:
            return allowed
        key_pos = torch.where(rel < 0, slots[None, :], self.positions.gather(1, idx))  # [B, S]
        return allowed & within_window(self.positions, key_pos, window)


def within_window(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B, T, S] bool: key at key_pos[b, s] is within `window` positions of query_pos[b, t]."""
    return key_pos[:, None, :] > query_pos[:, :, None] - window


def write_block(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    """cache [B, Hkv, S, D] <- new [B, T, Hkv, D] at per-request slots [B, T]."""
    B, T, H, D = new.shape
    index = slots[:, None, :, None].expand(B, H, T, D)
    cache.scatter_(2, index, new.transpose(1, 2).to(cache.dtype))


def sdpa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   inputs: AttentionInputs, scale: float, sinks: torch.Tensor | None = None,
                   window: int | None = None) -> torch.Tensor:
    """Reference: q [B, T, H, D] against cache [B, Hkv, S, D] -> [B, T, H, D]."""
    S = inputs.kv_len or k_cache.shape[2]
    mask = inputs.full_mask(S, window)
    return _attention(q.transpose(1, 2), k_cache[:, :, :S], v_cache[:, :, :S], mask, scale, sinks).transpose(1, 2)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """No cache (prefill, training): q [B, T, H, D], k/v [B, S, Hkv, D], mask [B, T, S],
    or None: causal over S == T keys (a prompt), within `window` tokens if given."""
    if window is not None and mask is not None:
        raise ValueError("a window applies to causal attention only (put it in the mask)")
    return _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale, sinks,
                      window).transpose(1, 2)


def _attention(q, k, v, mask, scale, sinks, window=None):
    """q [B, H, T, D], k/v [B, Hkv, S, D], mask [B, T, S] or None (causal, S == T, within
    `window`) -> [B, H, T, D]."""
    if sinks is not None:
        return _sink_attention(q, k, v, mask, scale, sinks, window)
    if window is not None:
        T = q.shape[2]
        mask = _causal_window(0, T, 0, T, window, q.device).expand(q.shape[0], T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                          is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _causal_window(t0: int, t1: int, lo: int, hi: int, window: int | None, device) -> torch.Tensor:
    """[t1 - t0, hi - lo] bool: key j sees query i iff j <= i (and j > i - window)."""
    i, j = torch.arange(t0, t1, device=device)[:, None], torch.arange(lo, hi, device=device)[None, :]
    return (j <= i) & (j > i - window) if window is not None else j <= i


SCORES_PER_CHUNK = 2 ** 26


def _sink_attention(q, k, v, mask, scale, sinks, window):
    """`_attention` with sinks, which SDPA lacks: the softmax by hand, over query chunks
    of about SCORES_PER_CHUNK scores, each against the keys it can see (causal: the keys
    up to its last query; with a window, from its first query's window on), and each KV
    head against its G query heads at once (no copy of K and V per query head)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    acc = torch.promote_types(q.dtype, torch.float32)
    sink = sinks.to(acc).view(1, Hkv, G, 1, 1)
    out = torch.empty_like(q)
    t0 = 0
    while t0 < T:
        budget = SCORES_PER_CHUNK // (B * H)   # query rows x keys per chunk
        if mask is not None:
            step = budget // S
        elif window is not None:   # keys: step + window - 1
            step = min(512, budget // (512 + window))
        else:                      # keys: t0 + step, so step (t0 + step) <= budget
            step = (math.isqrt(t0 * t0 + 4 * budget) - t0) // 2
        t1 = min(T, t0 + max(1, step))
        lo = 0 if mask is not None or window is None else max(0, t0 - window + 1)
        hi = S if mask is not None else t1
        rows = G * (t1 - t0)
        s = (q[:, :, t0:t1].reshape(B, Hkv, rows, D) @ k[:, :, lo:hi].transpose(-1, -2)).to(acc) * scale
        s = s.view(B, Hkv, G, t1 - t0, hi - lo)
        seen = mask[:, None, None, t0:t1] if mask is not None else _causal_window(t0, t1, lo, hi, window, q.device)
        s = s.masked_fill(~seen, float("-inf"))
        p = torch.cat([s, sink.expand(B, Hkv, G, t1 - t0, 1)], -1).softmax(-1)[..., :-1]
        o = p.to(v.dtype).view(B, Hkv, rows, hi - lo) @ v[:, :, lo:hi]
        out[:, :, t0:t1] = o.view(B, H, t1 - t0, D)
        t0 = t1
    return out


def attention_kernel(backend: str):
    """The cached-attention implementation for `backend`: 'sdpa' or 'triton' (both take
    q, k_cache, v_cache, inputs, scale, sinks=, window=)."""
    if backend == "triton":
        from treeflash.kernels.tree_attention import tree_attention
        return tree_attention
    return sdpa_attention
