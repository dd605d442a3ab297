"""DDTree building blocks (issue 4): the device tree builder against the heap
reference, the tree's objective against brute force, the static-shape walk, and the
KV compaction that moves an accepted path into place."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from tree_oracle import best_prefixes_heap, chain_of_scores, tree_of_logprobs

from treeflash.engine.tree import (ANCESTOR_ROW_ALIGN, DraftTree, _ancestor_matrix, build_chain, build_tree, empty_tree,
                                   walk)
from treeflash.layers.kv_cache import KVCache


# ----------------------------------------------------------------------------- helpers

def node_prefixes(tree: DraftTree, b: int) -> list[tuple[int, ...]]:
    """The token prefix (root excluded) of every valid node of row b, in node order."""
    toks, par, valid = tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.valid[b].tolist()
    out = []
    for i in range(1, len(toks)):
        if not valid[i]:
            continue
        path, j = [], i
        while j != 0:
            path.append(toks[j])
            j = par[j]
        out.append(tuple(reversed(path)))
    return out


def check_structure(tree: DraftTree, max_depth: int) -> None:
    """Invariants every verified tree must hold (the walk and the attention mask rely on them)."""
    B, M = tree.tokens.shape
    assert tree.parents.shape == tree.depths.shape == tree.valid.shape == (B, M)
    assert tree.ancestors.shape == (B, M, M)
    for b in range(B):
        par, dep = tree.parents[b].tolist(), tree.depths[b].tolist()
        valid, toks = tree.valid[b].tolist(), tree.tokens[b].tolist()
        assert dep[0] == 0 and par[0] == 0 and valid[0]
        children = {}
        for i in range(1, M):
            assert 0 <= par[i] < i, f"node {i}: parent {par[i]} does not come before it"
            assert dep[i] == dep[par[i]] + 1, f"node {i}: depth {dep[i]} but parent depth {dep[par[i]]}"
            assert 1 <= dep[i] <= max_depth
            if valid[i]:
                assert valid[par[i]], f"valid node {i} below invalid parent {par[i]}"
                children.setdefault(par[i], []).append(toks[i])
        for p, kids in children.items():
            assert len(kids) == len(set(kids)), f"node {p} has duplicate children {kids}"
        # ancestors[i, j] <=> j is i or lies on i's parent chain
        expect = torch.zeros(M, M, dtype=torch.bool)
        for i in range(M):
            j = i
            expect[i, j] = True
            while j != 0:
                j = par[j]
                expect[i, j] = True
        assert torch.equal(tree.ancestors[b], expect)


def path_value(logprobs_row: torch.Tensor, prefix: tuple[int, ...]) -> float:
    """Probability that the target follows `prefix`, under independent per-depth distributions."""
    return math.exp(sum(float(logprobs_row[d, t]) for d, t in enumerate(prefix)))


def make_tree(parents: list[list[int]], tokens: list[list[int]], valid=None) -> DraftTree:
    """A hand-built batch of trees (all rows the same size)."""
    par = torch.tensor(parents)
    tok = torch.tensor(tokens)
    B, M = par.shape
    dep = torch.zeros(B, M, dtype=torch.long)
    for b in range(B):
        for i in range(1, M):
            dep[b, i] = dep[b, par[b, i]] + 1
    v = torch.ones(B, M, dtype=torch.bool) if valid is None else torch.tensor(valid)
    return DraftTree(tok, par, dep, _ancestor_matrix(par, int(dep.max())), v)


def random_logprobs(B, D, V, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(B, D, V, generator=g, dtype=torch.float64) * scale, -1).float()


# ----------------------------------------------------------------------------- build_tree vs heap

@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
@pytest.mark.parametrize("budget", [1, 2, 7, 16, 64, 256])
@pytest.mark.parametrize("vocab", [5, 300])
def test_build_tree_matches_heap_reference(block_size, budget, vocab):
    """The device builder picks exactly the `budget` most probable prefixes, row by row."""
    D, B = block_size - 1, 3
    lp = random_logprobs(B, D, vocab, seed=block_size * 1000 + budget * 7 + vocab)
    lp[1] = lp[0].roll(1, dims=-1)  # same probabilities, other tokens: rows must not be mixed up
    anchor = torch.tensor([11, 22, 33])
    tree = tree_of_logprobs(lp, anchor, budget)
    assert tree.size == budget
    assert tree.tokens[:, 0].tolist() == anchor.tolist()
    check_structure(tree, D)
    assert tree.ancestors.stride(1) % ANCESTOR_ROW_ALIGN == 0, "the attention kernel's mask rows are aligned"
    total = sum(vocab ** d for d in range(1, D + 1))
    for b in range(B):
        ref = best_prefixes_heap(lp[b].double().numpy(), budget)
        got = node_prefixes(tree, b)
        assert len(ref) == min(budget, total)
        assert len(got) == len(set(got)) == len(ref)
        assert set(got) == set(ref), f"row {b}: {sorted(set(ref) - set(got))[:3]} missing"
    shifted = [tuple((t + 1) % vocab for t in p) for p in node_prefixes(tree, 0)]
    assert set(node_prefixes(tree, 1)) == set(shifted)


def test_build_tree_pads_when_fewer_prefixes_than_budget():
    """vocab 3, depth 3: only 39 prefixes exist; a budget of 64 gets all 39 plus 25 invalid pads."""
    lp = random_logprobs(2, 3, 3, seed=5)
    tree = tree_of_logprobs(lp, torch.tensor([1, 2]), 64)
    check_structure(tree, 3)
    every = {p for d in range(1, 4) for p in itertools.product(range(3), repeat=d)}
    for b in range(2):
        assert set(node_prefixes(tree, b)) == every
        assert int(tree.valid[b].sum()) == 1 + 39


def test_build_tree_with_filtered_draft_scores():
    """Top-k filtered drafts put -inf on most tokens: impossible prefixes are never valid
    nodes, and the possible ones are all there when the budget allows."""
    V, D = 50, 3
    lp = torch.full((1, D, V), float("-inf"))
    lp[0, :, 7], lp[0, :, 9] = math.log(0.7), math.log(0.3)
    tree = tree_of_logprobs(lp, torch.tensor([0]), 16)
    check_structure(tree, D)
    got = node_prefixes(tree, 0)
    assert set(got) == {p for d in range(1, D + 1) for p in itertools.product((7, 9), repeat=d)}
    assert len(got) == 14


def test_build_tree_certain_draft_gives_the_chain():
    """A draft that is certain (probability 1 at every depth) ties every prefix of the
    chain with its parent: the tree must still list parents first and be the chain."""
    V, D = 20, 7
    lp = torch.full((2, D, V), float("-inf"))
    for d in range(D):
        lp[0, d, (3 * d) % V] = 0.0
        lp[1, d, 5] = 0.0
    tree = tree_of_logprobs(lp, torch.tensor([1, 1]), D)
    check_structure(tree, D)
    assert node_prefixes(tree, 0) == [tuple((3 * d) % V for d in range(k)) for k in range(1, D + 1)]
    assert node_prefixes(tree, 1) == [(5,) * k for k in range(1, D + 1)]


def test_build_tree_reads_only_the_first_budget_columns():
    """A caller may pass more candidates per depth than the budget (a whole sorted
    vocabulary, a sharded top-k's union): the tree is the one the top `budget` give."""
    lp = random_logprobs(2, 3, 30, seed=21)
    anchor = torch.tensor([4, 5])
    vals, ids = lp.sort(dim=-1, descending=True)
    wide = build_tree(vals, ids, anchor, 6)
    narrow = tree_of_logprobs(lp, anchor, 6)
    for got, want in zip((wide.tokens, wide.parents, wide.depths, wide.ancestors, wide.valid),
                         (narrow.tokens, narrow.parents, narrow.depths, narrow.ancestors, narrow.valid)):
        assert torch.equal(got, want)


def test_a_chain_is_a_tree_of_one_path():
    """DFlash's chain: the drafted tokens in order below the anchor, node d at depth d
    with parent d - 1; AR's tree is the anchor alone."""
    anchor = torch.tensor([4, 5, 6])
    drafted = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(1))
    chain = build_chain(drafted, anchor)
    check_structure(chain, 7)
    assert chain.depths[0].tolist() == list(range(8)) and chain.parents[0].tolist() == [0] + list(range(7))
    assert chain.tokens.tolist() == torch.cat([anchor[:, None], drafted], 1).tolist()
    ar = empty_tree(anchor)
    assert ar.size == 0 and ar.tokens[:, 0].tolist() == [4, 5, 6]


# ----------------------------------------------------------------------------- the objective

def closed_sets(universe: list[tuple[int, ...]], size: int) -> set[frozenset]:
    """Every prefix-closed set of `size` nodes (a node's parent is in the set or is the root)."""
    sets = {frozenset()}
    for _ in range(size):
        grown = set()
        for s in sets:
            for p in universe:
                if p not in s and (len(p) == 1 or p[:-1] in s):
                    grown.add(s | {p})
        sets = grown
    return sets


@pytest.mark.parametrize("D,V", [(2, 3), (3, 3), (3, 2)])
@pytest.mark.parametrize("budget", [1, 2, 3, 4, 5])
def test_tree_maximises_expected_acceptance(D, V, budget):
    """The tree's promised expected accepted length (the sum of its nodes' path
    probabilities) beats the chain and equals the best of every possible tree of its
    size, found by brute force; and the walk really delivers that expectation when the
    target follows the draft distributions (exact enumeration of target outcomes)."""
    lp = random_logprobs(1, D, V, seed=100 * D + 10 * V + budget, scale=1.0)
    tree = tree_of_logprobs(lp, torch.tensor([0]), budget)
    check_structure(tree, D)
    nodes = node_prefixes(tree, 0)
    value = sum(path_value(lp[0], p) for p in nodes)

    universe = [p for d in range(1, D + 1) for p in itertools.product(range(V), repeat=d)]
    size = min(budget, len(universe))
    best = max(sum(path_value(lp[0], p) for p in s) for s in closed_sets(universe, size))
    assert value == pytest.approx(best, rel=1e-6)

    top1 = lp[0].argmax(-1).tolist()
    chain_value = sum(path_value(lp[0], tuple(top1[:k])) for k in range(1, min(budget, D) + 1))
    assert value >= chain_value - 1e-9

    # exact expectation of the walk: the target's token at depth d is drawn from depth d+1's distribution
    expected = 0.0
    for outcome in itertools.product(range(V), repeat=D):
        prob = math.exp(sum(float(lp[0, d, t]) for d, t in enumerate(outcome)))
        target = torch.tensor([[outcome[min(int(d), D - 1)] for d in tree.depths[0]]])
        expected += prob * int(walk(tree, target, D).accepted[0])
    assert expected == pytest.approx(value, rel=1e-6)


# ----------------------------------------------------------------------------- walk

#            root(100)
#           /         \
#        1:5           2:6
#       /    \           \
#    3:7     4:8         5:9
#     |                   |
#   6:10                7:11
PARENTS = [0, 0, 0, 1, 1, 2, 3, 5]
TOKENS = [100, 5, 6, 7, 8, 9, 10, 11]


def test_walk_rejects_subtree_of_mismatch_and_finds_deepest_path():
    # target's token at each node (what it wants next there)
    # row 0: root wants 6 -> node 1 (5) rejected, and so are 3 and 6 although they match their parents
    # row 1: root wants 5, node 1 wants 7, node 3 wants 10 -> path 0,1,3,6
    # row 2: root wants 42 -> nothing accepted
    # row 3: root wants 6, node 2 wants 9, node 5 wants 1 -> node 7 (11) rejected, best is node 5
    target = torch.tensor([
        [6, 7, 9, 10, 0, 11, 0, 4],
        [5, 7, 0, 10, 0, 0, 3, 0],
        [42, 7, 9, 10, 0, 11, 0, 0],
        [6, 7, 9, 10, 0, 1, 0, 0],
    ])
    tree = make_tree([PARENTS] * 4, [TOKENS] * 4)
    w = walk(tree, target, 3)
    assert w.best.tolist() == [7, 6, 0, 5]
    assert w.accepted.tolist() == [3, 3, 0, 2]
    assert w.bonus.tolist() == [4, 3, 42, 1]
    assert w.path[:, : 4].tolist()[0] == [0, 2, 5, 7]
    assert w.path.tolist()[1] == [0, 1, 3, 6]
    assert w.path.tolist()[2][0] == 0
    assert w.path.tolist()[3][:3] == [0, 2, 5]
    # past the accepted depth the path repeats the deepest node (harmless moves into free space)
    assert w.path.tolist()[2] == [0, 0, 0, 0] and w.path.tolist()[3][3] == 5
    # what the round commits: the accepted path's tokens, then the target's bonus token
    for b, (n, path) in enumerate(zip(w.accepted.tolist(), w.path.tolist())):
        assert w.new[b, :n + 1].tolist() == [TOKENS[i] for i in path[1:n + 1]] + [w.bonus[b].item()]


def test_walk_never_accepts_invalid_nodes():
    """Padding nodes (and everything below them) are never accepted, even when their
    tokens match the target's."""
    target = torch.tensor([[6, 7, 9, 10, 0, 11, 0, 4]] * 2)
    valid = [[True] * 8, [True, True, True, True, True, True, True, False]]
    w = walk(make_tree([PARENTS] * 2, [TOKENS] * 2, valid), target, 3)
    assert w.best.tolist() == [7, 5] and w.accepted.tolist() == [3, 2]
    valid = [[True, True, False, True, True, False, True, True]]  # node 2 invalid hides 5 and 7
    w = walk(make_tree([PARENTS], [TOKENS], valid), target[:1], 3)
    assert w.best.tolist() == [0] and w.accepted.tolist() == [0] and w.bonus.tolist() == [6]


def test_walk_on_built_tree_with_padding():
    """On a real padded tree a padding node is never accepted, even where the target
    takes its token and no valid node matches: the walk stops at the root."""
    from dataclasses import replace
    V = 3
    lp = random_logprobs(1, 2, V, seed=9)
    tree = tree_of_logprobs(lp, torch.tensor([0]), 20)  # 12 prefixes + 8 pads
    assert int((~tree.valid).sum()) == 8
    for pad in torch.nonzero(~tree.valid[0]).flatten().tolist():
        tokens = tree.tokens.clone()
        tokens[0, pad] = V  # a token no valid node holds
        padded = replace(tree, tokens=tokens)
        target = torch.full((1, 21), V + 1, dtype=torch.long)  # matches no node...
        target[0, tree.parents[0, pad]] = V                    # ...but the pad
        w = walk(padded, target, 2)
        assert w.best.tolist() == [0] and w.accepted.tolist() == [0] and w.bonus.tolist() == [V]
        # the same walk with the pad counted as valid takes it: the check above can fail
        w = walk(replace(padded, valid=torch.ones_like(tree.valid)), target, 2)
        assert w.best.tolist() == [pad]


def test_walk_chain():
    chain = chain_of_scores(torch.log_softmax(torch.randn(2, 4, 10), -1), torch.tensor([1, 2]))
    target = torch.cat([chain.tokens[:, 1:], torch.tensor([[3], [3]])], 1)  # target agrees everywhere
    target[1, 2] = (chain.tokens[1, 3] + 1) % 10                           # row 1: disagrees at depth 3
    w = walk(chain, target, 4)
    assert w.accepted.tolist() == [4, 2]
    assert w.path.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 2, 2]]
    assert w.bonus.tolist() == [3, int(target[1, 2])]


# ----------------------------------------------------------------------------- KV compaction

def test_compact_moves_exactly_the_path():
    """Slot n+i <- slot n+path[i] for the path, in every layer, k and v; the committed
    prefix and everything past the path's P slots stay untouched. A slot that is both
    a source and a destination (here slot n+2) is read before it is overwritten."""
    L, B, H, S, D = 2, 3, 2, 24, 4
    cache = KVCache(L, B, H, S, D, torch.float64, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape, dtype=torch.float64))
    cache.v.copy_(torch.randn(cache.v.shape, dtype=torch.float64))
    k0, v0 = cache.k.clone(), cache.v.clone()
    n = torch.tensor([3, 0, 7])
    path = torch.tensor([[0, 2, 5, 7], [0, 1, 2, 3], [0, 4, 4, 4]])
    cache.compact(n, path)
    for b in range(B):
        nb = int(n[b])
        for t, t0 in ((cache.k, k0), (cache.v, v0)):
            assert torch.equal(t[:, b, :, :nb], t0[:, b, :, :nb])
            for i, src in enumerate(path[b].tolist()):
                assert torch.equal(t[:, b, :, nb + i], t0[:, b, :, nb + src])
            assert torch.equal(t[:, b, :, nb + 4:], t0[:, b, :, nb + 4:])
