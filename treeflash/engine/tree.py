"""Draft trees: what the target verifies in one forward pass.

A tree has a root (the anchor token, index 0) and N nodes; node i holds a draft
token at depth `depths[i]` below the root, and its parent comes before it. AR is
the empty tree, DFlash-linear a chain of the top-1 tokens, DDTree the N most
probable prefixes under the drafter's per-depth distributions. All builders work on
a whole batch, on the device, with static shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from treeflash.ops import fused_enabled


@dataclass
class DraftTree:
    tokens: torch.Tensor     # [B, N+1] long, tokens[:, 0] = anchor
    parents: torch.Tensor    # [B, N+1] long, index of the parent (root: 0)
    depths: torch.Tensor     # [B, N+1] long, root: 0
    ancestors: torch.Tensor  # [B, N+1, N+1] bool, ancestors[b, i, j]: j is i or an ancestor of i
                             # (rows aligned: `ancestor_buffer`)
    valid: torch.Tensor      # [B, N+1] bool: False for padding nodes that must never be accepted

    @property
    def size(self) -> int:
        return self.tokens.shape[1] - 1


ANCESTOR_ROW_ALIGN = 16  # bytes


def ancestor_buffer(batch: int, nodes: int, device, fill: torch.Tensor | None = None) -> torch.Tensor:
    """A [B, M, M] bool ancestor matrix (uninitialised, or a copy of `fill`) whose rows start every
    ANCESTOR_ROW_ALIGN bytes (a view of [B, M, M rounded up]). The attention kernel
    loads it as its block mask, and Triton compiles a row stride that is not a multiple
    of 16 into unaligned loads and more registers: on an H200 the built-in pair's verify
    attention at 17 tokens (ddtree-16) took 7.2 us a layer with 17-byte rows (168
    registers) and 4.8 with 32-byte ones (127; 16 tokens: 4.8). Every reader of the
    mask takes its strides. AR's [B, 1, 1] stays as it is (a stride of 1 compiles as
    well as any)."""
    row = nodes if nodes == 1 else -(-nodes // ANCESTOR_ROW_ALIGN) * ANCESTOR_ROW_ALIGN
    anc = torch.empty(batch, nodes, row, dtype=torch.bool, device=device)[:, :, :nodes]
    return anc if fill is None else anc.copy_(fill)


def _ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    B, M = parents.shape
    anc = ancestor_buffer(B, M, parents.device, torch.eye(M, dtype=torch.bool, device=parents.device))
    cur = parents
    for _ in range(max_depth):
        anc.scatter_(2, cur[:, :, None], True)  # (a scalar, not index_put: graph-capturable)
        cur = parents.gather(1, cur)
    return anc


def empty_tree(anchor: torch.Tensor) -> DraftTree:
    """Autoregressive decoding: the root alone (a chain of no draft tokens)."""
    return build_chain(anchor.new_zeros(anchor.shape[0], 0), anchor)


def build_chain(draft: torch.Tensor, anchor: torch.Tensor) -> DraftTree:
    """The chain of draft tokens [B, D] (depths 1..D) below the anchor."""
    B, D = draft.shape
    dev = anchor.device
    tokens = torch.cat([anchor[:, None], draft], dim=1)
    idx = torch.arange(D + 1, device=dev)
    parents = (idx - 1).clamp_min(0).expand(B, D + 1)
    depths = idx.expand(B, D + 1)
    anc = ancestor_buffer(B, D + 1, dev, torch.ones(D + 1, D + 1, dtype=torch.bool, device=dev).tril())
    return DraftTree(tokens, parents.clone(), depths.clone(), anc,
                     torch.ones(B, D + 1, dtype=torch.bool, device=dev))


def build_tree(top_vals: torch.Tensor, top_ids: torch.Tensor, anchor: torch.Tensor, budget: int) -> DraftTree:
    """DDTree: the `budget` most probable prefixes (depth <= D) of the per-depth draft
    distributions, exactly, as a tree below the anchor; fed each depth's top-K
    candidates: top_vals [B, D, K] log-probabilities in descending order and top_ids
    [B, D, K] their token ids, K >= min(budget, V) (a sharded vocabulary's local top-k,
    all-gathered and reduced: see `TPGroup.topk`). Only the first min(budget, K)
    columns are used.

    Beam per depth: the top-N prefixes of depth d are among (top-N prefixes of depth
    d-1) x (top-N tokens at depth d), so one top-k over an N x K score matrix per
    depth gives each depth's beam with its parents. The tree is the top N of the
    union of the beams; a stable sort over depth-major candidates breaks ties toward
    shallower nodes, so a parent always precedes its children.
    """
    B, D, K = top_vals.shape
    N = budget
    K = min(N, K)
    top_vals, top_ids = top_vals[..., :K].float(), top_ids[..., :K]
    dev = top_vals.device
    neg = torch.full((B, N), float("-inf"), device=dev)
    beam = neg.clone()
    beam[:, :K] = top_vals[:, 0]
    beam_tok = torch.zeros(B, N, dtype=torch.long, device=dev)
    beam_tok[:, :K] = top_ids[:, 0]
    beam_par = torch.full((B, N), -1, dtype=torch.long, device=dev)
    scores, toks, pars = [beam], [beam_tok], [beam_par]
    for d in range(1, D):
        cand = (beam[:, :, None] + top_vals[:, d, None, :]).reshape(B, N * K)
        beam, flat = cand.topk(N, dim=-1)
        parent, j = flat // K, flat % K
        beam_tok = top_ids[:, d].gather(1, j)
        scores.append(beam)
        toks.append(beam_tok)
        pars.append(parent)
    all_scores = torch.stack(scores, 1).reshape(B, D * N)                    # depth-major
    order = all_scores.sort(dim=-1, descending=True, stable=True).indices[:, :N]
    # node index (1..N) of every candidate, 0 when not selected
    node_of = torch.zeros(B, D * N, dtype=torch.long, device=dev)
    node_of.scatter_(1, order, torch.arange(1, N + 1, device=dev).expand(B, N))
    depth = order // N                                                       # 0-based depth - 1
    cand_par = torch.stack(pars, 1).reshape(B, D * N).gather(1, order)        # index in beam d-1
    parent_flat = ((depth - 1).clamp_min(0) * N + cand_par.clamp_min(0))
    parents = torch.where(depth == 0, torch.zeros_like(depth), node_of.gather(1, parent_flat))
    tokens = torch.stack(toks, 1).reshape(B, D * N).gather(1, order)
    valid = all_scores.gather(1, order) > float("-inf")
    zero = torch.zeros(B, 1, dtype=torch.long, device=dev)
    parents = torch.cat([zero, parents], 1)
    depths = torch.cat([zero, depth + 1], 1)
    tokens = torch.cat([anchor[:, None], tokens], 1)
    valid = torch.cat([torch.ones(B, 1, dtype=torch.bool, device=dev), valid], 1)
    return DraftTree(tokens, parents, depths, _ancestor_matrix(parents, D), valid)


@dataclass
class WalkResult:
    best: torch.Tensor         # [B] index of the deepest accepted node
    accepted: torch.Tensor     # [B] its depth a (a draft tokens accepted)
    path: torch.Tensor         # [B, D+1] node index at depth 0..D on the path to `best` (past a: repeats)
    bonus: torch.Tensor        # [B] the target's token at `best`
    new: torch.Tensor          # [B, D+1] the round's new tokens: the a accepted draft tokens, then
                               # the bonus (past it: filler)


def walk(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int) -> WalkResult:
    """Accept every node whose edges from the root all match the target's tokens;
    keep the deepest. Static shapes: `accepted = (ancestors @ mismatch) == 0`. One
    launch on the fused path (`kernels.walk`; here ~25 small kernels)."""
    if fused_enabled(target_tokens):
        from treeflash.kernels.walk import walk_fused
        return WalkResult(*walk_fused(tree.tokens, tree.parents, tree.depths, tree.valid, tree.ancestors,
                                      target_tokens, max_depth))
    parent_token = target_tokens.gather(1, tree.parents)
    mismatch = (tree.tokens != parent_token) | ~tree.valid
    mismatch[:, 0] = False
    accepted = ~(tree.ancestors & mismatch[:, None, :]).any(-1)              # [B, M]
    score = torch.where(accepted, tree.depths, torch.full_like(tree.depths, -1))
    best = score.argmax(-1)
    depth = tree.depths.gather(1, best[:, None])[:, 0]
    # path: for each depth d, the ancestor of `best` at depth d (or best itself past its depth)
    on_path = tree.ancestors.gather(1, best[:, None, None].expand(-1, 1, tree.tokens.shape[1]))[:, 0]
    d = torch.arange(max_depth + 1, device=best.device)
    hit = on_path[:, None, :] & (tree.depths[:, None, :] == d[None, :, None])    # [B, D+1, M]
    path = torch.where(hit.any(-1), hit.float().argmax(-1), best[:, None])
    bonus = target_tokens.gather(1, best[:, None])[:, 0]
    new = torch.cat([tree.tokens.gather(1, path)[:, 1:], bonus[:, None]], dim=1)
    new.scatter_(1, depth[:, None], bonus[:, None])
    return WalkResult(best, depth, path, bonus, new)
