"""Attention over a KV cache for a block of new tokens.

Every forward in treeflash has the same shape: each request `b` has a committed
prefix of `prefix_lens[b]` cached tokens, and a block of `T` new tokens whose K/V
are written at cache slots `prefix_lens[b] + 0..T-1`. A query sees the whole prefix
(no mask) and the block tokens that `block_mask[b, i, j]` allows: causal for a
prefill, the ancestor matrix for a verified tree, all-true for a drafter block.
This split is what lets a kernel read the prefix once for all tree queries; the
plain SDPA version below is the reference every faster kernel is tested against.
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

    def full_mask(self, S: int) -> torch.Tensor:
        """[B, T, S] bool mask over cache slots 0..S-1 (prefix | allowed block keys)."""
        B, T = self.positions.shape
        slots = torch.arange(S, device=self.prefix_lens.device)
        rel = slots[None, :] - self.prefix_lens[:, None]                    # [B, S]
        in_block = (rel >= 0) & (rel < T)
        idx = rel.clamp(0, T - 1)[:, None, :].expand(B, T, S)
        allowed = self.block_mask.gather(2, idx) & in_block[:, None, :]
        return allowed | (rel < 0)[:, None, :]


def write_block(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> None:
    """cache [B, Hkv, S, D] <- new [B, T, Hkv, D] at per-request slots [B, T]."""
    B, T, H, D = new.shape
    index = slots[:, None, :, None].expand(B, H, T, D)
    cache.scatter_(2, index, new.transpose(1, 2).to(cache.dtype))


def sdpa_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   inputs: AttentionInputs, scale: float) -> torch.Tensor:
    """Reference: q [B, T, H, D] against cache [B, Hkv, S, D] -> [B, T, H, D]."""
    S = inputs.kv_len or k_cache.shape[2]
    mask = inputs.full_mask(S)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache[:, :, :S], v_cache[:, :, :S], attn_mask=mask[:, None],
        scale=scale, enable_gqa=q.shape[2] != k_cache.shape[1])
    return out.transpose(1, 2)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """No cache (training): q [B, T, H, D], k/v [B, S, Hkv, D], mask [B, T, S] (None: causal)."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=None if mask is None else mask[:, None], is_causal=mask is None,
        scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def attention_kernel(backend: str):
    """The cached-attention implementation for `backend`: 'sdpa' or 'triton'."""
    if backend == "triton":
        from treeflash.kernels.tree_attention import tree_attention
        return tree_attention
    return sdpa_attention
