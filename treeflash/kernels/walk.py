"""The end of a round in two launches instead of ~30: the walk (`engine.tree.walk`) and
the cache compaction (`layers.kv_cache.KVCache.compact`).

On a small model a graphed round is bound by its launches (built-in pair on an H200:
~200 kernels, ~2 us each), and the torch walk alone is ~25 of them: comparisons,
reductions and gathers over [B, N+1] tensors. Here one program per request does it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous

_COL_TILE = 128  # columns of best's ancestor row per step


@triton.jit
def _walk_kernel(tok_ptr, par_ptr, dep_ptr, valid_ptr, anc_ptr, tgt_ptr,
                 best_ptr, acc_ptr, path_ptr, bonus_ptr, new_ptr,
                 M, sa_b, sa_r, D: tl.constexpr, DP: tl.constexpr, MP: tl.constexpr, JUMPS: tl.constexpr,
                 CT: tl.constexpr, PDL: tl.constexpr = False):
    start_after_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    tok_ptr += b * M
    par_ptr += b * M
    dep_ptr += b * M
    valid_ptr += b * M
    tgt_ptr += b * M
    anc_ptr += b * sa_b

    # A node is accepted if it and every ancestor match: its token is the target's token at
    # its parent, and it is not padding (the root always matches). The AND along each path is
    # taken by pointer jumping in registers: after s jumps, ok[i] covers i's 2^s nearest
    # ancestors-or-self and up[i] is its 2^s-th ancestor (the root's is itself).
    node = tl.arange(0, MP)
    live = node < M
    up = tl.load(par_ptr + node, mask=live, other=0).to(tl.int32)
    want = tl.gather(tl.load(tgt_ptr + node, mask=live, other=0), up, 0)
    tok = tl.load(tok_ptr + node, mask=live, other=0)
    valid = tl.load(valid_ptr + node, mask=live, other=0)
    ok = (((tok == want) & (valid != 0)) | (node == 0)).to(tl.int32)
    for _ in tl.static_range(JUMPS):
        ok = ok & tl.gather(ok, up, 0)
        up = tl.gather(up, up, 0)
    # best: the deepest accepted node (the first on ties)
    dep = tl.load(dep_ptr + node, mask=live, other=0).to(tl.int32)
    score = tl.where(live & (ok != 0), dep, -1)
    best_depth = tl.max(score, 0)
    best = tl.min(tl.where(score == best_depth, node, MP), 0)

    # path[d]: best's ancestor at depth d (past best's depth: best); nxt[d] = path[d + 1]
    d = tl.arange(0, DP)
    path = tl.full([DP], -1, tl.int32)
    nxt = tl.full([DP], -1, tl.int32)
    for c0 in range(0, M, CT):
        cols = c0 + tl.arange(0, CT)
        col_ok = cols < M
        on = tl.load(anc_ptr + best * sa_r + cols, mask=col_ok, other=0) != 0
        col_dep = tl.load(dep_ptr + cols, mask=col_ok, other=-1).to(tl.int32)
        path = tl.maximum(path, tl.max(tl.where(on[None, :] & (col_dep[None, :] == d[:, None]), cols[None, :], -1), 1))
        nxt = tl.maximum(nxt, tl.max(tl.where(on[None, :] & (col_dep[None, :] == d[:, None] + 1), cols[None, :], -1), 1))
    path = tl.where(path >= 0, path, best)
    nxt = tl.where(nxt >= 0, nxt, best)
    bonus = tl.load(tgt_ptr + best)
    # the round's new tokens: the accepted draft tokens, the bonus at index best_depth
    new = tl.load(tok_ptr + nxt, mask=d < D, other=0)
    new = tl.where((d == best_depth) | (d == D), bonus, new)
    tl.store(best_ptr + b, best.to(tl.int64))
    tl.store(acc_ptr + b, best_depth.to(tl.int64))
    tl.store(bonus_ptr + b, bonus)
    tl.store(path_ptr + b * (D + 1) + d, path.to(tl.int64), mask=d <= D)
    tl.store(new_ptr + b * (D + 1) + d, new, mask=d <= D)


def walk_fused(tokens, parents, depths, valid, ancestors, target_tokens, max_depth: int):
    """`engine.tree.walk`'s (best, accepted, path, bonus, new tokens) in one launch."""
    B, M = tokens.shape
    dev = tokens.device
    D = max_depth
    MP = triton.next_power_of_2(M)
    best, accepted, bonus = (torch.empty(B, dtype=torch.long, device=dev) for _ in range(3))
    path = torch.empty(B, D + 1, dtype=torch.long, device=dev)
    new = torch.empty(B, D + 1, dtype=torch.long, device=dev)
    anc = ancestors if ancestors.stride(-1) == 1 else ancestors.contiguous()  # rows may be padded, not columns
    _walk_kernel[(B,)](
        tokens.contiguous(), parents.contiguous(), depths.contiguous(), valid.contiguous().view(torch.uint8),
        anc.view(torch.uint8), target_tokens.contiguous(),
        best, accepted, path, bonus, new, M, *anc.stride()[:2], D=D, DP=triton.next_power_of_2(D + 2), MP=MP,
        JUMPS=D.bit_length(), CT=min(_COL_TILE, MP),
        **chained(tokens.device))
    return best, accepted, path, bonus, new


@triton.jit
def _compact_kernel(k_ptr, v_ptr, base_ptr, src_ptr, B, H, S, P,
                    PP: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False):
    """Program (layer, request, head): its P rows of K and of V, all read, then written."""
    start_after_previous(PDL)
    pid = tl.program_id(0).to(tl.int64)
    b = (pid // H) % B
    i = tl.arange(0, PP)
    ok = i < P
    base = tl.load(base_ptr + b)
    src = tl.load(src_ptr + b * P + i, mask=ok, other=0)
    col = tl.arange(0, D)
    at = pid * S * D + (base + src)[:, None] * D + col[None, :]
    to = pid * S * D + (base + i)[:, None] * D + col[None, :]
    k = tl.load(k_ptr + at, mask=ok[:, None])
    v = tl.load(v_ptr + at, mask=ok[:, None])
    tl.debug_barrier()  # a row may be read by one thread and overwritten by another
    tl.store(k_ptr + to, k, mask=ok[:, None])
    tl.store(v_ptr + to, v, mask=ok[:, None])


def compact_fused(k: torch.Tensor, v: torch.Tensor, prefix_lens: torch.Tensor, src: torch.Tensor) -> None:
    """`KVCache.compact` of caches k, v [L, B, H, S, D] (contiguous, D a power of two) in one launch."""
    L, B, H, S, D = k.shape
    P = src.shape[1]
    _compact_kernel[(L * B * H,)](k, v, prefix_lens.contiguous(), src.contiguous(), B, H, S, P,
                                  PP=triton.next_power_of_2(P), D=D, **chained(k.device))
