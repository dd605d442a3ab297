"""The DDTree builder (`engine.tree.build_tree`) as ONE Triton launch.

The torch builder is ~100 tiny kernels (a top-k per depth, then sort / scatter /
gather and the ancestor matrix); under a CUDA graph that is still ~1 ms, more than a
small model's whole round. Here one program per request does it all:

1. Best-first search. A prefix's score is its parent's plus its token's log-probability
   at its depth, and each depth's candidates come sorted, so the next best prefix is
   always on a frontier that holds, per tree node, its best child not yet taken, and,
   per taken prefix, its next sibling. N times: take the frontier's best entry as the
   next node, put its next sibling in its place and its first child in a new slot.
   The frontier lives in registers as int64 keys, the float score's order-preserving
   int32 above (depth, parent, column), so a max-reduction (carrying the parent's
   score along) finds the entry and says everything about it. Ties go to the shallower
   depth, then the earlier parent, then the better column: the torch builder's order
   (its stable sort over depth-major beams), so a parent always precedes its children.
   Depth 1 runs on past the K columns with -inf scores: when fewer than N prefixes are
   finite, the padding nodes (valid=False) are those, as in the torch builder.
   A pop's time is its cross-warp reduction (the loads it makes are 5%: kernels/NOTES.md),
   so one reduction yields two nodes: it keeps the best two keys, and after the first is
   taken the second node is the better of the runner-up and the first's two new
   entries (its sibling and its child), which are all the frontier's changes (H100,
   D = 15, N = 16 / 64 / 256 / 512: 6.1 / 22.9 / 166 / 465 us -> 5.4 / 20.1 / 150 / 409;
   a third pop per reduction was no faster). 4 warps, 8 past N = 256, where the keys per
   thread outweigh the cross-warp step. Each pop is a few hundred cycles of latency,
   against D sequential bitonic top-ks of ~N ln N candidates in the beam-per-depth
   kernel this replaced (H200: N = 256 in 137 us instead of 239; kernels/NOTES.md).
2. Ancestors without a [N+1, N+1] register tile: A[i, k] = the ancestor of node i
   at depth k, written by walking each node's parent chain (D+1 steps); then
   ancestors[i, j] = depth[j] <= depth[i] and A[i, depth[j]] == j, in row x column
   tiles.

Static shapes, no host sync, nothing to prepare: the launch is CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.engine.tree import DraftTree, ancestor_buffer
from treeflash.kernels.chained import chained, start_after_previous
from treeflash.kernels.vocab_topk import _key_score, _score_key

MAX_BUDGET = 1023  # parents and columns take 10 bits of a frontier key
MAX_DEPTH = 63     # depths take 6
_EMPTY = tl.constexpr(-0x7FFFFFFF << 32)  # an empty frontier slot: below every entry, -inf included
_ROW_TILE, _COL_TILE = 32, 128  # ancestor matrix tile


def fits(budget: int, depth: int) -> bool:
    """Whether `build_tree_fused` takes trees of `budget` nodes `depth` deep."""
    return 1 <= budget <= MAX_BUDGET and 1 <= depth <= MAX_DEPTH


@triton.jit
def _entry(score, depth, parent, col):
    """A frontier key: descending order is (score descending, depth, parent, column ascending)."""
    low = ((63 - depth) << 20) | ((1023 - parent) << 10) | (1023 - col)
    return (_score_key(score).to(tl.int64) << 32) | low.to(tl.int64)


@triton.jit
def _fields(key):
    """(depth, parent, column) of frontier keys."""
    low = (key & 0x7FFFFFFF).to(tl.int32)
    return 63 - (low >> 20), 1023 - ((low >> 10) & 1023), 1023 - (low & 1023)


@triton.jit
def _top_two(key1, ps1, next1, next_ps1, key2, ps2, next2, next_ps2):
    """The best two frontier keys (and their parents' scores) of two halves."""
    first = key1 > key2
    best, best_ps = tl.where(first, key1, key2), tl.where(first, ps1, ps2)
    loser, loser_ps = tl.where(first, key2, key1), tl.where(first, ps2, ps1)
    runner, runner_ps = tl.where(first, next1, next2), tl.where(first, next_ps1, next_ps2)
    take = loser > runner
    return best, best_ps, tl.where(take, loser, runner), tl.where(take, loser_ps, runner_ps)


@triton.jit
def _pop(frontier, parent_score, best, ps, k, slot, vals, taken, sv_d, sv_k, K,
         N: tl.constexpr, D: tl.constexpr, M: tl.constexpr):
    """Take frontier key `best` (its parent scores `ps`) as node k: its next sibling
    takes its slot, its first child slot k. Returns the frontier, its parents' scores,
    the two new keys (the sibling's parent also scores `ps`) and the node's score."""
    score = _key_score((best >> 32).to(tl.int32))
    d, p, j = _fields(best)
    tl.store(taken + k, best, mask=k < M)
    sibling = j + 1 < tl.where(d == 1, N, K)      # past K: -inf (depth 1's padding)
    y = tl.load(vals + (d - 1) * sv_d + (j + 1) * sv_k, mask=sibling & (j + 1 < K), other=float("-inf"))
    sib = tl.where(sibling, _entry(ps + y, d, p, j + 1), _EMPTY)
    frontier = tl.where(frontier == best, sib, frontier)
    y = tl.load(vals + d * sv_d, mask=d < D, other=float("-inf"))
    child = tl.where(d < D, _entry(score + y, d + 1, k, 0), _EMPTY)
    frontier = tl.where(slot == k, child, frontier)
    parent_score = tl.where(slot == k, score, parent_score)
    return frontier, parent_score, sib, child, score


@triton.jit
def _build_tree_kernel(
    vals_ptr, ids_ptr, anchor_ptr, taken_ptr, chain_ptr,
    tok_ptr, par_ptr, dep_ptr, valid_ptr, anc_ptr,
    sv_b, sv_d, sv_k, si_b, si_d, si_k, sa_b, sa_r, K,
    N: tl.constexpr, D: tl.constexpr, MP: tl.constexpr, DP: tl.constexpr,
    RT: tl.constexpr, CT: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program b builds request b's tree. Scratch (per request): taken [MP], node k's
    frontier key; chain [MP*DP], the ancestor-at-depth table."""
    start_after_previous(PDL)
    M: tl.constexpr = N + 1
    b = tl.program_id(0).to(tl.int64)
    vals = vals_ptr + b * sv_b
    ids = ids_ptr + b * si_b
    taken = taken_ptr + b * MP
    chain = chain_ptr + b * (MP * DP)
    tok_out = tok_ptr + b * M
    par_out = par_ptr + b * M
    dep_out = dep_ptr + b * M
    valid_out = valid_ptr + b * M

    # 1. best-first: slot k (k >= 1) holds node k's next child, slot 0 the root's;
    # two pops per reduction (the second is the better of the first's two new entries
    # and the runner-up), the last one past M when N is odd (not stored)
    slot = tl.arange(0, MP)
    frontier = tl.where(slot == 0, _entry(tl.load(vals), 1, 0, 0), _EMPTY)
    parent_score = tl.zeros([MP], dtype=tl.float32)  # the root scores 0
    for k in range(1, M, 2):
        best, ps, second, second_ps = tl.reduce((frontier, parent_score, tl.full([MP], _EMPTY, tl.int64),
                                                 parent_score), 0, _top_two)
        frontier, parent_score, sib, child, score = _pop(
            frontier, parent_score, best, ps, k, slot, vals, taken, sv_d, sv_k, K, N, D, M)
        new, new_ps = tl.where(sib > child, sib, child), tl.where(sib > child, ps, score)
        best, ps = tl.where(new > second, new, second), tl.where(new > second, new_ps, second_ps)
        frontier, parent_score, _, _, _ = _pop(
            frontier, parent_score, best, ps, k + 1, slot, vals, taken, sv_d, sv_k, K, N, D, M)

    tl.debug_barrier()                    # every node's key stored
    node = slot
    root, live = node == 0, node < M
    key = tl.load(taken + node, mask=live & ~root, other=0)
    d, p, j = _fields(key)
    valid = root | (_key_score((key >> 32).to(tl.int32)) > float("-inf"))
    tok = tl.load(ids + (d - 1) * si_d + j * si_k, mask=live & ~root & (j < K), other=0)
    tl.store(tok_out + node, tl.where(root, tl.load(anchor_ptr + b), tok), mask=live)
    tl.store(par_out + node, tl.where(root, 0, p), mask=live)
    tl.store(dep_out + node, tl.where(root, 0, d), mask=live)
    tl.store(valid_out + node, valid.to(tl.uint8), mask=live)

    # 2. ancestors: chain[i, depth of a] = a for every a on i's path to the root
    tl.debug_barrier()                    # parents and depths stored
    a = node
    for _ in range(D + 1):
        tl.store(chain + node * DP + tl.load(dep_out + a, mask=live, other=0), a, mask=live)
        a = tl.load(par_out + a, mask=live, other=0).to(tl.int32)
    tl.debug_barrier()
    anc = anc_ptr + b * sa_b
    for r0 in range(0, M, RT):
        rows = r0 + tl.arange(0, RT)
        row_ok = rows < M
        row_dep = tl.load(dep_out + rows, mask=row_ok, other=0)
        for c0 in range(0, M, CT):
            cols = c0 + tl.arange(0, CT)
            col_ok = cols < M
            col_dep = tl.load(dep_out + cols, mask=col_ok, other=0)
            ok = row_ok[:, None] & col_ok[None, :]
            up = ok & (col_dep[None, :] <= row_dep[:, None])
            at = tl.load(chain + rows[:, None] * DP + col_dep[None, :], mask=up, other=-1)
            tl.store(anc + rows[:, None] * sa_r + cols[None, :], (up & (at == cols[None, :])).to(tl.uint8), mask=ok)


def build_tree_fused(top_vals: torch.Tensor, top_ids: torch.Tensor, anchor: torch.Tensor,
                     budget: int) -> DraftTree:
    """`engine.tree.build_tree` in one launch: same arguments (top_vals [B, D, K]
    descending log-probabilities, top_ids [B, D, K], K >= min(budget, V), anchor [B]),
    same tree (equal scores: see the module's docstring). Within `fits`."""
    B, D, K = top_vals.shape
    N = budget
    if not fits(N, D):
        raise ValueError(f"build_tree_fused: budget {N} x depth {D} is past the kernel's limits "
                         f"(budget <= {MAX_BUDGET}, depth <= {MAX_DEPTH})")
    dev = top_vals.device
    M = N + 1
    MP = triton.next_power_of_2(M)
    DP = triton.next_power_of_2(D + 1)
    tokens = torch.empty(B, M, dtype=torch.long, device=dev)
    parents = torch.empty(B, M, dtype=torch.long, device=dev)
    depths = torch.empty(B, M, dtype=torch.long, device=dev)
    valid = torch.empty(B, M, dtype=torch.bool, device=dev)
    ancestors = ancestor_buffer(B, M, dev)
    taken = torch.empty(B, MP, dtype=torch.int64, device=dev)
    chain = torch.empty(B, MP * DP, dtype=torch.int32, device=dev)
    top_vals = top_vals.float()
    _build_tree_kernel[(B,)](
        top_vals, top_ids, anchor, taken, chain, tokens, parents, depths, valid.view(torch.uint8),
        ancestors.view(torch.uint8), *top_vals.stride(), *top_ids.stride(), *ancestors.stride()[:2], min(N, K),
        N=N, D=D, MP=MP, DP=DP, RT=_ROW_TILE, CT=_COL_TILE, num_warps=8 if N > 256 else 4, **chained(dev))
    return DraftTree(tokens, parents, depths, ancestors, valid)
