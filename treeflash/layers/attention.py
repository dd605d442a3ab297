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

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionInputs:
    """Per-forward metadata, shared by all layers."""

    positions: torch.Tensor     # [B, T] RoPE positions of the block tokens
    prefix_lens: torch.Tensor   # [B] committed (cached) tokens before the block
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

    def block_only_mask(self, window: int | None) -> torch.Tensor | None:
        """The mask of a forward whose keys are exactly its block (prefill, training):
        the block mask (None: causal), within `window` positions if given."""
        if window is None:
            return None if self.is_prefill else self.block_mask
        T = self.positions.shape[1]
        mask = self.block_mask if self.block_mask is not None else \
            torch.ones(T, T, dtype=torch.bool, device=self.positions.device).tril()
        return mask & within_window(self.positions, self.positions, window)


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


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """No cache (prefill, training): q [B, T, H, D], k/v [B, S, Hkv, D], mask [B, T, S]
    (None: causal)."""
    return _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, scale, sinks).transpose(1, 2)


def _attention(q, k, v, mask, scale, sinks):
    """q [B, H, T, D], k/v [B, Hkv, S, D], mask [B, T, S] or None (causal) -> [B, H, T, D]."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None],
                                              is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    # SDPA has no sinks: the softmax by hand, over query chunks of at most 2^26 scores
    B, H, T, D = q.shape
    S = k.shape[2]
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T).expand(B, T, S)
    k, v = k.repeat_interleave(H // k.shape[1], 1), v.repeat_interleave(H // v.shape[1], 1)
    acc = torch.promote_types(q.dtype, torch.float32)
    step = max(1, 2 ** 26 // max(1, B * H * S))
    outs = []
    for t0 in range(0, T, step):
        s = (q[:, :, t0:t0 + step].to(acc) @ k.transpose(-1, -2).to(acc)) * scale
        s = s.masked_fill(~mask[:, None, t0:t0 + step], float("-inf"))
        sink = sinks.to(acc)[None, :, None, None].expand(B, H, s.shape[2], 1)
        p = torch.cat([s, sink], -1).softmax(-1)[..., :-1]
        outs.append((p @ v.to(acc)).to(q.dtype))
    return torch.cat(outs, 2)


def attention_kernel(backend: str):
    """The cached-attention implementation for `backend`: 'sdpa' or 'triton' (both take
    q, k_cache, v_cache, inputs, scale, sinks=, window=)."""
    if backend == "triton":
        from treeflash.kernels.tree_attention import tree_attention
        return tree_attention
    return sdpa_attention
