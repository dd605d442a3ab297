"""The DDTree builders' oracle (design section 3): the heap that a host implementation
would use, one request at a time. Kept out of the engine, which builds trees on the
device."""
from __future__ import annotations

import heapq

import numpy as np
import torch

from treeflash.engine.tree import DraftTree, build_chain, build_tree


def tree_of_logprobs(logprobs: torch.Tensor, anchor: torch.Tensor, budget: int) -> DraftTree:
    """`build_tree` of whole per-depth distributions logprobs [B, D, V] (the engine feeds
    it each depth's top-k)."""
    top_vals, top_ids = logprobs.float().topk(min(budget, logprobs.shape[-1]), dim=-1)
    return build_tree(top_vals, top_ids, anchor, budget)


def chain_of_scores(scores: torch.Tensor, anchor: torch.Tensor) -> DraftTree:
    """DFlash-linear's chain: the top-1 token of scores [B, D, V] at every depth."""
    return build_chain(scores.argmax(-1), anchor)


def best_prefixes_heap(logprobs, budget: int) -> list[tuple[int, ...]]:
    """The design's host reference: best-first search over (depth, rank-at-depth) for the
    `budget` most probable prefixes of per-depth distributions logprobs [D, V]."""
    lp = np.asarray(logprobs, dtype=np.float64)
    D = lp.shape[0]
    order = np.argsort(-lp, axis=1, kind="stable")
    sorted_lp = np.take_along_axis(lp, order, axis=1)
    # heap item: (-score, prefix of ranks)
    heap = [(-sorted_lp[0, 0], (0,))]
    out = []
    while heap and len(out) < budget:
        neg, ranks = heapq.heappop(heap)
        d = len(ranks) - 1
        out.append(tuple(int(order[i, r]) for i, r in enumerate(ranks)))
        if ranks[-1] + 1 < lp.shape[1]:  # next sibling
            sib = ranks[:-1] + (ranks[-1] + 1,)
            heapq.heappush(heap, (neg + sorted_lp[d, ranks[-1]] - sorted_lp[d, ranks[-1] + 1], sib))
        if d + 1 < D:  # first child
            heapq.heappush(heap, (neg - sorted_lp[d + 1, 0], ranks + (0,)))
    return out
