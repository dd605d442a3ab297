"""The one-launch tree builder (kernels/tree_build.py) against the torch builder and
the heap reference: on CUDA, or on CPU in the Triton interpreter (a CPU-only test
re-runs this file's kernel tests there, in a subprocess)."""
from __future__ import annotations

import math

import pytest
import torch
from interpreter import DEV, INTERPRET, kernel, run_interpreted, spawns_interpreter
from test_tree import check_structure, node_prefixes, random_logprobs
from tree_oracle import best_prefixes_heap

from treeflash.engine.tree import ANCESTOR_ROW_ALIGN, build_tree

pytest.importorskip("triton")
from treeflash.kernels.tree_build import MAX_BUDGET, MAX_DEPTH, build_tree_fused, fits  # noqa: E402

FIELDS = ("tokens", "parents", "depths", "valid", "ancestors")


def exact_logprobs(B, D, V, budget, seed):
    """random_logprobs on a power-of-two grid coarse enough that every path sum of the
    top-`budget` tokens is exact in float32 (the kernel, the torch builder and the
    float64 heap then see the same scores), nudged down a step where rounding made two
    tokens of a depth equal."""
    lp = random_logprobs(B, D, V, seed).double()
    worst = D * (float(lp.topk(min(budget, V), -1).values.abs().max()) + 1)
    step = 2.0 ** (math.floor(math.log2(worst)) - 22)
    q, order = torch.round(lp / step).sort(-1, descending=True)
    k = torch.arange(V, dtype=q.dtype)
    q = (q + k).cummin(-1).values - k               # strictly decreasing, at most V - 1 steps lower
    return torch.empty_like(q).scatter_(-1, order, q * step).float()


def path_scores(tree, lp, b):
    """float64 score (sum of log-probs from the root) of every node of row b."""
    toks, deps = tree.tokens[b].tolist(), tree.depths[b].tolist()
    anc = tree.ancestors[b].cpu()
    return [sum(float(lp[b, deps[j] - 1, toks[j]]) for j in anc[i].nonzero().flatten().tolist() if j)
            for i in range(len(toks))]


def both(top_vals, top_ids, anchor, budget):
    """(fused tree on DEV, moved to the CPU; torch builder's tree on the CPU)."""
    got = build_tree_fused(top_vals.to(DEV), top_ids.to(DEV), anchor.to(DEV), budget)
    assert got.ancestors.stride(1) % ANCESTOR_ROW_ALIGN == 0, "the attention kernel's mask rows are aligned"
    got = type(got)(*(getattr(got, f).cpu() for f in ("tokens", "parents", "depths", "ancestors", "valid")))
    return got, build_tree(top_vals, top_ids, anchor, budget)


ON_CUDA = pytest.mark.skipif(INTERPRET, reason="a pop per node: minutes in the interpreter")
# (B, D, V, budget, K): K columns of each depth's sorted distribution are passed (None: min(budget, V))
CASES = [
    (1, 15, 4096, 16, None),
    (1, 15, 1000, 32, None),    # the built-in pair's default budget
    (2, 15, 50, 64, None),
    (2, 15, 300, 63, None),     # budget not a power of two
    (1, 7, 8, 200, None),       # V < budget: the first beam is padded with -inf
    (2, 3, 3, 64, None),        # 39 prefixes in all: 25 invalid padding nodes
    (2, 6, 40, 16, 20),         # K > budget, columns past the budget ignored (a strided view)
    (2, 1, 10, 4, None),        # one depth
    (1, 4, 6, 1, None),         # budget 1
    pytest.param(3, 5, 1000, 512, None, marks=ON_CUDA),  # the engine's default max_budget
    pytest.param(1, 15, 2000, MAX_BUDGET, None, marks=ON_CUDA),  # the kernel's largest
]


def distinct_logprobs(B, D, V, budget, seed):
    """exact_logprobs of the first seed from `seed` on whose top budget+1 path scores are
    distinct (sums of grid values can tie: at budget 1023 most seeds have a few ties),
    with the row's best prefixes from the heap. Rows after the first are the first rolled:
    same probabilities, other tokens, so rows must not be mixed up."""
    while True:
        lp = exact_logprobs(B, D, V, budget, seed)
        lp[1:] = lp[0].roll(1, dims=-1)
        best = best_prefixes_heap(lp[0].double().numpy(), budget + 1)
        scores = [sum(float(lp[0, d, t]) for d, t in enumerate(p)) for p in best]
        if len(set(scores)) == len(scores):
            return lp
        seed += 1


@kernel
@pytest.mark.parametrize("B,D,V,budget,K", CASES)
def test_fused_matches_torch_builder(B, D, V, budget, K):
    """Distinct scores: node for node the torch builder's tree, and the heap's prefixes."""
    lp = distinct_logprobs(B, D, V, budget, seed=B * 1000 + D * 100 + budget)
    vals, ids = lp.sort(-1, descending=True)
    K = K or min(budget, V)
    vals, ids = vals[..., :K], ids[..., :K]
    anchor = torch.arange(B) + 11
    got, ref = both(vals, ids, anchor, budget)
    assert got.size == budget
    check_structure(got, D)
    for f in FIELDS:
        assert getattr(got, f).dtype == getattr(ref, f).dtype
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    for b in range(B):
        best = best_prefixes_heap(lp[b].double().numpy(), budget + 1)
        assert set(node_prefixes(got, b)) == set(best[:budget])
        assert int(got.valid[b].sum()) == 1 + min(budget, len(best))


def ties_logprobs(B, D, seed):
    """Base-2 log-probabilities 2^-2, 2^-2, 2^-3, 2^-3, 2^-4 x 4 in shuffled token order:
    exact sums, and ties everywhere (within a depth and across depths)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor([-2.0, -2, -3, -3, -4, -4, -4, -4])
    return torch.stack([torch.stack([base[torch.randperm(8, generator=g)] for _ in range(D)]) for _ in range(B)])


@kernel
@pytest.mark.parametrize("D,budget", [(4, 16), (6, 100), (15, 64)])
def test_fused_with_ties(D, budget):
    """Equal scores: a (possibly other) correct top-N tree: the same score multiset as
    the torch builder and the heap, nodes in (score, depth) order, deterministic."""
    B = 2
    lp = ties_logprobs(B, D, seed=D * budget)
    vals, ids = lp.sort(-1, descending=True)
    anchor = torch.tensor([3, 4])
    got, ref = both(vals, ids, anchor, budget)
    check_structure(got, D)
    again = build_tree_fused(vals.to(DEV), ids.to(DEV), anchor.to(DEV), budget)
    for f in FIELDS:
        assert torch.equal(getattr(again, f).cpu(), getattr(got, f)), f"{f} not deterministic"
    for b in range(B):
        s_got, s_ref = path_scores(got, lp, b)[1:], path_scores(ref, lp, b)[1:]
        heap = [sum(float(lp[b, d, t]) for d, t in enumerate(p)) for p in best_prefixes_heap(lp[b].numpy(), budget)]
        assert sorted(s_got) == sorted(s_ref) == sorted(heap)
        order = list(zip([-s for s in s_got], got.depths[b, 1:].tolist()))
        assert order == sorted(order), "nodes not in (score descending, depth ascending) order"
        assert len(set(node_prefixes(got, b))) == budget


@kernel
def test_fused_certain_and_filtered_drafts():
    """-inf inside the top K (a filtered draft) and probability-1 chains (a parent ties
    with its child): the torch builder's trees exactly."""
    V, D = 20, 7
    lp = torch.full((3, D, V), float("-inf"))
    for d in range(D):
        lp[0, d, (3 * d) % V] = 0.0
        lp[1, d, 5] = 0.0
    for d in range(D):   # (distinct path scores: the tie order of torch.topk is unspecified)
        lp[2, d, 7], lp[2, d, 9] = math.log(0.7 + 0.02 * d), math.log(0.3 - 0.02 * d)
    vals, ids = lp.topk(16, -1)
    ids[vals == float("-inf")] = 0   # torch.topk's pick among equal -inf is unspecified
    for budget in (D, 16):
        got, ref = both(vals, ids, torch.tensor([1, 1, 2]), budget)
        check_structure(got, D)
        for f in FIELDS:
            assert torch.equal(getattr(got, f), getattr(ref, f)), (budget, f)
    assert node_prefixes(got, 0)[:D] == [tuple((3 * d) % V for d in range(k)) for k in range(1, D + 1)]


@kernel
def test_fused_at_the_deepest_depth():
    """D = MAX_DEPTH (all of a key's depth bits): a certain chain to the last depth, where
    no child may be put on the frontier, then the subtrees of its best siblings: the torch
    builder's tree exactly."""
    D, V, budget = MAX_DEPTH, 6, 70
    lp = torch.full((1, D, V), -20.0) - torch.arange(V) * 0.5
    lp[0, :, 2] = 0.0
    lp[0, :, 4] = -1 - 0.01 * torch.arange(D)
    vals, ids = lp.sort(-1, descending=True)
    got, ref = both(vals, ids, torch.tensor([9]), budget)
    check_structure(got, D)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    assert int(got.depths.max()) == D and got.valid.all()


def test_limits():
    """Past its key's bits the kernel refuses (the round then takes the torch builder)."""
    assert fits(MAX_BUDGET, MAX_DEPTH) and not fits(MAX_BUDGET + 1, 15) and not fits(16, MAX_DEPTH + 1)
    vals, ids = torch.zeros(1, 2, 4), torch.zeros(1, 2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="limits"):
        build_tree_fused(vals, ids, torch.zeros(1, dtype=torch.long), MAX_BUDGET + 1)
    with pytest.raises(ValueError, match="limits"):
        build_tree_fused(torch.zeros(1, MAX_DEPTH + 1, 4), torch.zeros(1, MAX_DEPTH + 1, 4, dtype=torch.long),
                         torch.zeros(1, dtype=torch.long), 16)


# one chunk; several chunks (the last one shorter than k: 4650 = 9 x 512 + 42); k = V;
# k past 256, whose chunks merge two at a time
VOCAB_CASES = [((1, 15, 4096), 64), ((2, 3, 300), 16), ((1, 2, 4650), 64), ((1, 3, 4096), 256), ((2, 7), 7),
               ((1, 4096), 512)]


@kernel
@pytest.mark.parametrize("shape,k", VOCAB_CASES)
def test_fused_vocab_topk_matches_torch(shape, k):
    """The drafter's per-depth candidates in one launch (one chunk, and several chunks
    merged by a second launch): torch's top-k values, the ids of a stable descending
    sort (equal values: lower id first), and the log-sum-exp."""
    from treeflash.kernels.vocab_topk import fits, topk_logsumexp
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(shape, generator=gen) * 3
    x[..., 1::4] = x[..., ::4][..., :x[..., 1::4].shape[-1]]  # ties
    x[..., -1] = x[..., 0]  # and one across chunks
    assert fits(shape[-1], k)
    vals, ids, lse = (t.cpu() for t in topk_logsumexp(x.to(DEV), k))
    ref = x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(vals, ref.values[..., :k]) and torch.equal(ids, ref.indices[..., :k])
    assert torch.allclose(lse, x.logsumexp(-1, keepdim=True), atol=1e-5)


@kernel
@pytest.mark.parametrize("merge,k", [(64, 16), (32, 16), (128, 64)])
def test_fused_vocab_topk_merges_in_levels(monkeypatch, merge, k):
    """More chunk candidates than one merge program takes (a 152K vocabulary at k = 64
    is 297 chunks of 64): merged in groups, then the groups' results, as one merge would.
    10 chunks of 512 (the last one 42 entries, fewer than k = 64) in groups of 4 or 2."""
    import treeflash.kernels.vocab_topk as vt
    monkeypatch.setattr(vt, "MERGE", merge)
    gen = torch.Generator().manual_seed(merge + k)
    x = torch.randn(2, 4650, generator=gen) * 3
    x[:, 4000:] = x[:, :650]  # ties across chunks and groups
    vals, ids, lse = (t.cpu() for t in vt.topk_logsumexp(x.to(DEV), k))
    ref = x.sort(dim=-1, descending=True, stable=True)
    assert torch.equal(vals, ref.values[..., :k]) and torch.equal(ids, ref.indices[..., :k])
    assert torch.allclose(lse, x.logsumexp(-1, keepdim=True), atol=1e-5)


@kernel
@pytest.mark.parametrize("k", [2, 3, 4])
def test_fused_vocab_topk_reads_only_the_best_chunks(k):
    """With more chunks than k (a 152K vocabulary at k = 16: 297 chunks of 512), only the
    k chunks of largest maxima are searched: still torch's answer when chunk maxima tie
    (the lower chunk wins, as the lower id does), and on rows of -inf."""
    from treeflash.kernels.vocab_topk import topk_logsumexp
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(5, 4650, generator=gen) * 3  # 10 chunks of 512, the last 42 entries
    x[0, 1::4] = x[0, ::4][:x[0, 1::4].shape[-1]]
    x[1, 7::300] = 20.0  # the same max in every chunk, twice in some
    x[2] = float("-inf")
    x[2, 4100] = 1.0  # one finite entry, in a late chunk
    x[3] = float("-inf")
    x[4, 3000] = float("nan")  # torch ranks NaN first (and its log-sum-exp is NaN)
    vals, ids, lse = (t.cpu() for t in topk_logsumexp(x.to(DEV), k))
    ref = x.sort(dim=-1, descending=True, stable=True)
    torch.testing.assert_close(vals, ref.values[..., :k], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(ids, ref.indices[..., :k])
    assert torch.allclose(lse, x.logsumexp(-1, keepdim=True), atol=1e-5, equal_nan=True)


@kernel
@pytest.mark.parametrize("V,k", [(300, 4), (1500, 4)])
def test_fused_vocab_topk_signed_zeros_and_empty_chunks(V, k):
    """-0.0 and +0.0 are equal values (the lower id first, as torch's stable sort), and a
    row, or a chunk of 512 (1500: three chunks, all searched), of only -inf gives the
    log-sum-exp of the finite rest (-inf for the row), not NaN."""
    from treeflash.kernels.vocab_topk import topk_logsumexp
    gen = torch.Generator().manual_seed(V)
    x = -torch.rand(3, V, generator=gen) - 1
    x[0, [V - 9, 2, V - 3, 5]] = torch.tensor([0.0, -0.0, -0.0, 0.0])  # the top four: ids 2, 5, V - 9, V - 3
    x[1, :min(V, 1024) - 300] = float("-inf")  # 1500: the first chunk, and part of the second
    x[1, V // 2] = -0.5
    x[2] = float("-inf")
    vals, ids, lse = (t.cpu() for t in topk_logsumexp(x.to(DEV), k))
    ref = x.sort(dim=-1, descending=True, stable=True)
    assert ids[0].tolist() == [2, 5, V - 9, V - 3]
    assert torch.equal(vals, ref.values[..., :k]) and torch.equal(ids, ref.indices[..., :k])
    assert torch.allclose(lse, x.logsumexp(-1, keepdim=True), atol=1e-5) and lse[2, 0] == float("-inf")


def test_vocab_topk_limits():
    """The fused top-k takes the drafter's vocabulary at small k whatever its size (152K at
    budget 63); past k = 64 only smaller ones, where it is still faster than torch's."""
    from treeflash.kernels.vocab_topk import fits, topk_logsumexp
    assert fits(151936, 64) and fits(262144, 16) and fits(4096, 512) and fits(32768, 256)
    assert not fits(151936, 128) and not fits(65536, 256) and not fits(10, 11)
    with pytest.raises(ValueError, match="outside what it handles"):
        topk_logsumexp(torch.zeros(2, 10), 11)


@spawns_interpreter
def test_kernel_in_the_triton_interpreter():
    run_interpreted(__file__, "fused", len(CASES) - 2 + 3 + 1 + len(VOCAB_CASES) + 3 + 3 + 2 + 1)
