"""The one-launch walk and cache compaction (kernels/walk.py) against the torch walk
and `KVCache.compact`: on CUDA, or on CPU in the Triton interpreter (a CPU-only test
re-runs this file's kernel tests there, in a subprocess)."""
from __future__ import annotations

import pytest
import torch
from interpreter import DEV, kernel, run_interpreted, spawns_interpreter
from test_tree import PARENTS, TOKENS, make_tree, random_logprobs
from tree_oracle import chain_of_scores, tree_of_logprobs

from treeflash.engine.tree import ancestor_buffer, empty_tree, walk
from treeflash.layers.kv_cache import KVCache

pytest.importorskip("triton")
from treeflash.kernels.walk import compact_fused, walk_fused  # noqa: E402

FIELDS = ("best", "accepted", "path", "bonus", "new")


def check_walk(tree, target, depth):
    """walk_fused on DEV equals the torch walk on the CPU, field for field. The ancestors
    go in the builders' layout (rows padded to `ancestor_buffer`'s alignment)."""
    ref = walk(tree, target, depth)
    anc = ancestor_buffer(*tree.ancestors.shape[:2], DEV, tree.ancestors)
    got = walk_fused(*(t.to(DEV) for t in (tree.tokens, tree.parents, tree.depths, tree.valid)), anc,
                     target.to(DEV), depth)
    for name, g in zip(FIELDS, got):
        assert g.dtype == torch.long and torch.equal(g.cpu(), getattr(ref, name)), name
    return ref


def matching_target(tree, accept: float, seed: int) -> torch.Tensor:
    """Target tokens that agree with a random share of the tree's edges: the target's
    token at node i is one of i's children's tokens with probability `accept`."""
    g = torch.Generator().manual_seed(seed)
    B, M = tree.tokens.shape
    target = torch.randint(0, 10**6, (B, M), generator=g)
    for b in range(B):
        for i in range(M - 1, 0, -1):  # the first child wins: the walk's path is unique anyway
            if torch.rand(1, generator=g).item() < accept:
                target[b, tree.parents[b, i]] = tree.tokens[b, i]
    return target


@kernel
def test_walk_on_hand_built_trees():
    """The hand-built tree of test_tree (a mismatch hides its subtree; padding is never
    accepted; nothing accepted) in one batch."""
    target = torch.tensor([[6, 7, 9, 10, 0, 11, 0, 4], [5, 7, 0, 10, 0, 0, 3, 0],
                           [42, 7, 9, 10, 0, 11, 0, 0], [6, 7, 9, 10, 0, 1, 0, 0], [6, 7, 9, 10, 0, 11, 0, 4]])
    valid = [[True] * 8] * 4 + [[True, True, True, True, True, True, True, False]]
    ref = check_walk(make_tree([PARENTS] * 5, [TOKENS] * 5, valid), target, 3)
    assert ref.best.tolist() == [7, 6, 0, 5, 5]
    assert ref.new[1].tolist() == [5, 7, 10, 3]  # three accepted tokens, then the bonus


@kernel
@pytest.mark.parametrize("B,D,V,budget", [(1, 15, 300, 32), (3, 15, 50, 64), (2, 7, 1000, 256),
                                          (2, 3, 3, 64), (1, 15, 4096, 512)])
def test_walk_on_built_trees(B, D, V, budget):
    """DDTrees (padding nodes included where the vocabulary is short) against targets
    that accept nothing, some, or every edge they can."""
    tree = tree_of_logprobs(random_logprobs(B, D, V, seed=budget), torch.arange(B) + 3, budget)
    for seed, accept in enumerate([0.0, 0.3, 0.7, 1.0]):
        ref = check_walk(tree, matching_target(tree, accept, seed), D)
        if accept == 1.0:
            assert int(ref.accepted.max()) >= 1


@kernel
@pytest.mark.parametrize("D", [1, 3, 15])
def test_walk_on_chains_and_the_empty_tree(D):
    B = 3
    chain = chain_of_scores(random_logprobs(B, D, 50, seed=D), torch.tensor([1, 2, 3]))
    for seed, accept in enumerate([0.0, 0.5, 1.0]):
        check_walk(chain, matching_target(chain, accept, seed), D)
    ar = empty_tree(torch.tensor([4, 5, 6]))
    ref = check_walk(ar, torch.tensor([[7], [8], [9]]), 0)
    assert ref.new.tolist() == [[7], [8], [9]]


@kernel
def test_walk_to_late_nodes():
    """Targets that accept exactly the path to one node whose parent is past the first
    128-column tile of best's ancestor row (a flat first depth, a nearly certain second:
    each node's child right after it), for which matching_target's first children are
    all early nodes: that node is best, its whole path and tokens come out."""
    B, D, V, budget = 2, 2, 100, 160
    lp = torch.empty(B, D, V)
    lp[:, 0] = -5 - 1e-3 * torch.arange(V)[torch.randperm(V, generator=torch.Generator().manual_seed(0))]
    lp[:, 1] = -30 - 1e-2 * torch.arange(V)
    lp[:, 1, 7] = 0.0
    tree = tree_of_logprobs(lp, torch.tensor([3, 4]), budget)
    target = torch.full((B, budget + 1), -1)
    picks = []
    for b in range(B):
        i = [i for i in range(budget + 1) if int(tree.parents[b, i]) >= 128][-1 - b]
        picks.append(i)
        while i != 0:
            target[b, tree.parents[b, i]] = tree.tokens[b, i]
            i = int(tree.parents[b, i])
        target[b, picks[-1]] = 1000 + b
    ref = check_walk(tree, target, D)
    assert ref.best.tolist() == picks and (ref.path[:, 1] >= 128).all()
    assert ref.bonus.tolist() == [1000, 1001] and ref.accepted.tolist() == [2, 2]


@kernel
def test_walk_takes_the_first_of_equal_depths():
    """Two accepted nodes at the deepest depth (equal sibling tokens, hand-built): the
    first, as the torch walk's argmax takes it."""
    parents, tokens = [[0, 0, 0, 1, 2]] * 2, [[9, 5, 5, 7, 7], [9, 5, 6, 7, 7]]
    target = torch.tensor([[5, 7, 7, 1, 2], [6, 7, 7, 1, 2]])
    ref = check_walk(make_tree(parents, tokens), target, 2)
    assert ref.best.tolist() == [3, 4] and ref.new.tolist() == [[5, 7, 1], [6, 7, 2]]


@kernel
@pytest.mark.parametrize("L,B,H,S,D,P", [(2, 1, 2, 40, 64, 16), (3, 3, 1, 64, 16, 9), (1, 2, 4, 32, 128, 1)])
def test_compact_matches_torch(L, B, H, S, D, P):
    """Paths whose moves overlap (slot 2 <- 3 while slot 1 <- 2, as a second sibling's
    child makes them), past-the-path repeats, and per-request prefix lengths."""
    g = torch.Generator().manual_seed(L * 100 + P)
    ref = KVCache(L, B, H, S, D, torch.float32, "cpu")
    ref.k.copy_(torch.randn(ref.k.shape, generator=g))
    ref.v.copy_(torch.randn(ref.v.shape, generator=g))
    k, v = ref.k.to(DEV), ref.v.to(DEV)
    prefix = torch.tensor([3, 11, 0][:B])
    src = torch.zeros(B, P, dtype=torch.long)
    for b in range(B):
        path = [0, 2, 3, 7, 8][:P]
        src[b] = torch.tensor(path + [path[-1]] * (P - len(path)))
    ref.compact(prefix, src)
    compact_fused(k, v, prefix.to(DEV), src.to(DEV))
    assert torch.equal(k.cpu(), ref.k) and torch.equal(v.cpu(), ref.v)


@spawns_interpreter
def test_kernels_in_the_triton_interpreter():
    run_interpreted(__file__, "not interpreter", 14)
