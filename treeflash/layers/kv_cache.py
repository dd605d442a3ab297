"""Static KV caches.

`KVCache` holds one [L, B, Hkv, S, D] tensor pair (every layer's K and V). A round writes its block
(tree nodes, drafter block) right after each request's committed prefix, then
`compact` moves the accepted path to the front of that free space: the prefix
itself is never copied or duplicated.
"""
from __future__ import annotations

import math

import torch

from treeflash.errors import TreeflashError
from treeflash.memory import available_bytes
from treeflash.ops import fused_enabled


class KVCache:
    def __init__(self, num_layers: int, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, batch, kv_heads, max_len, head_dim)
        device = torch.device(device)
        need = 2 * math.prod(shape) * dtype.itemsize
        have = available_bytes(device)
        if have is not None and need > have:  # refuse, rather than be killed by the OS mid-allocation
            raise TreeflashError(f"not enough {device.type} memory for a {type(self).__name__} of "
                                 f"{need / 2**30:.1f} GiB ({batch} requests x {max_len} tokens x {num_layers} "
                                 f"layers; {have / 2**30:.1f} GiB free): lower max_model_len, or batch fewer "
                                 f"requests (max_batch; with prefix caching, a call's prompts are one batch)")
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def copy_prefix(self, src: "KVCache", n: int) -> None:
        """Slots 0..n-1 of every layer and request <- src's (same model and batch size; the
        lengths may differ): prefix caching moves a conversation to another state."""
        self.k[:, :, :, :n].copy_(src.k[:, :, :, :n])
        self.v[:, :, :, :n].copy_(src.v[:, :, :, :n])

    def compact(self, prefix_lens: torch.Tensor, src: torch.Tensor) -> None:
        """Slot `prefix_lens + i` <- slot `prefix_lens + src[:, i]` for i in 0..P-1, all layers.

        Static shapes: rows past a request's accepted path are moved too, into free
        space that the next round overwrites.
        """
        L, B, H, S, D = self.k.shape
        if fused_enabled(self.k) and self.k.is_contiguous() and D & (D - 1) == 0:  # one launch, not four
            from treeflash.kernels.walk import compact_fused
            return compact_fused(self.k, self.v, prefix_lens, src)
        P = src.shape[1]
        base = prefix_lens[:, None]
        gather = (base + src)[None, :, None, :, None].expand(L, B, H, P, D)
        scatter = (base + torch.arange(P, device=src.device))[None, :, None, :, None].expand(L, B, H, P, D)
        for t in (self.k, self.v):
            t.scatter_(3, scatter, t.gather(3, gather))


class DraftContextCache(KVCache):
    """The drafter's per-layer K/V of committed positions' target features, each
    projected once, when it is committed ("load contexts once"). A KVCache; its own
    class names it in an out-of-memory refusal."""
