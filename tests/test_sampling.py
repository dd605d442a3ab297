"""Issue 2, point 2: seeded sampling.

* `sample` draws from softmax(filter(logits / T)) (chi-square goodness of fit over
  thousands of fixed-seed draws, with transformers' logits warpers as the oracle),
  never emits a filtered-out token, and draws independently across positions and seeds;
* per-request parameters are honoured inside a mixed batch;
* through the engine: the same seed gives the same tokens on every run and whatever
  the batch around the request.

The statistical tests use fixed seeds, so they are deterministic: they either pass
forever or fail forever. Each asserts a chi-square p-value > 1e-3 (a correct sampler
would fail one configuration with probability 1e-3 per seed choice; these seeds pass),
and a power check shows the same test rejects a wrong distribution with p < 1e-12.
"""
from __future__ import annotations

import math

import pytest
import torch
from conftest import ENGINE_PROMPTS

from treeflash import LLM, SamplingParams, UsageError
from treeflash.engine.sampling import SamplingBatch, gumbel_noise, sample

# A fixed, unsorted logit vector: sorting and index bookkeeping matter.
LOGITS = torch.tensor([0.3, 2.0, -0.9, 1.2, -3.0, 0.6, 1.5, -0.4, 0.0, -2.0, 1.0, -1.5], dtype=torch.float64)
V = LOGITS.numel()
SEEDS, POSITIONS = 40, 200            # 8000 draws per configuration
P_MIN = 1e-3


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit over the support of `probs`."""
    n = counts.sum()
    support = probs > 0
    expected = n * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """The oracle: transformers' temperature, min-p, top-k and top-p warpers, in that order
    (vLLM's: min-p right after the temperature)."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    scores = logits[None].clone()
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores[0], -1)


def draw(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
         seeds=range(SEEDS), positions: int = POSITIONS) -> torch.Tensor:
    """Tokens [len(seeds), positions]: one request per seed, the same logits at every position."""
    B = len(seeds)
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=s)
              for s in seeds]
    sb = SamplingBatch.from_params(params, "cpu")
    pos = torch.arange(positions).expand(B, positions)
    return sample(logits.expand(B, positions, -1).clone(), pos, sb)


# top-k=6 then top-p=0.8 over the renormalized top 6 keeps 4 tokens at T=1, fewer than
# either filter alone (6 and 5): the order and the renormalization are tested.
FILTERS = [(0, 1.0), (4, 1.0), (0, 0.7), (6, 0.8)]


# min-p = 0.1 keeps 7 tokens at T = 1 (4 at T = 0.5); top-p = 0.8 then keeps 4 of them (2),
# where top-p over the whole softmax keeps 5 (3): the order (vLLM's, min-p first) is tested.
MIN_P = [(0, 1.0, 0.1), (0, 0.8, 0.1), (3, 1.0, 0.3)]


@pytest.mark.parametrize("top_k,top_p,min_p", [(k, p, 0.0) for k, p in FILTERS] + MIN_P,
                         ids=["plain", "top-k=4", "top-p=0.7", "top-k=6+top-p=0.8", "min-p=0.1",
                              "min-p=0.1+top-p=0.8", "min-p=0.3+top-k=3"])
@pytest.mark.parametrize("temperature", [0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_samples_follow_filtered_softmax(temperature, top_k, top_p, min_p, dtype):
    probs = hf_probs(LOGITS, temperature, top_k, top_p, min_p)
    if top_p < 1:  # the fixed logits keep clear of the top-p boundary
        cum = probs[probs > 0].sort(descending=True).values.cumsum(0)
        assert (cum - top_p).abs().min() > 0.02
    if min_p:  # and of the min-p one
        ratio = torch.softmax(LOGITS / temperature, -1) / torch.softmax(LOGITS / temperature, -1).max()
        assert (ratio - min_p).abs().min() > 0.005
    tokens = draw(LOGITS.to(dtype), temperature, top_k, top_p, min_p)
    counts = torch.bincount(tokens.flatten(), minlength=V).double()
    assert counts.sum() == SEEDS * POSITIONS
    removed = probs == 0
    assert counts[removed].sum() == 0, f"filtered-out tokens sampled: {counts[removed].tolist()}"
    if top_k or top_p < 1 or min_p:
        assert removed.any()
    assert chi2_pvalue(counts, probs) > P_MIN
    # total variation, as a readable bound: E|freq_i - p_i| <= sqrt(p_i (1 - p_i) / n)
    n = counts.sum()
    tv = 0.5 * (counts / n - probs).abs().sum()
    assert tv < 2 * 0.5 * (probs * (1 - probs) / n).sqrt().sum()


def test_goodness_of_fit_test_has_power():
    """The chi-square check above would catch a sampler that ignores the temperature
    or the filters (so passing it means something)."""
    hot = draw(LOGITS, 1.0)
    counts = torch.bincount(hot.flatten(), minlength=V).double()
    assert chi2_pvalue(counts, hf_probs(LOGITS, 0.5, 0, 1.0)) < 1e-12
    assert chi2_pvalue(counts, hf_probs(LOGITS, 1.0, 0, 1.0)) > P_MIN
    top4 = torch.bincount(draw(LOGITS, 1.0, top_k=4).flatten(), minlength=V).double()
    assert chi2_pvalue(top4, hf_probs(LOGITS, 1.0, 0, 1.0)) < 1e-12


def test_draws_are_independent_across_positions_and_seeds():
    """Joint counts of neighbouring positions (same seed) and neighbouring seeds (same
    position) fit the product of the marginals: the position-keyed noise does not
    correlate the tokens of one request, nor requests with consecutive seeds."""
    logits = torch.tensor([0.4, -0.2, 0.1, -0.5], dtype=torch.float64)  # 4 tokens, 16 joint cells
    p = torch.softmax(logits, -1)
    joint_p = (p[:, None] * p[None, :]).flatten()
    tokens = draw(logits, 1.0, seeds=range(100, 160), positions=201)     # 60 x 201
    along_positions = tokens[:, 0:-1:2] * 4 + tokens[:, 1::2]            # disjoint pairs (p, p+1)
    across_seeds = tokens[0::2] * 4 + tokens[1::2]                       # seeds s, s+1 at each position
    for pairs in (along_positions, across_seeds):
        counts = torch.bincount(pairs.flatten(), minlength=16).double()
        assert counts.sum() > 5000
        assert chi2_pvalue(counts, joint_p) > P_MIN


def test_gumbel_noise_depends_only_on_seed_position_and_token():
    seed = torch.tensor([7, 7, 8])
    pos = torch.tensor([[3, 4], [3, 9], [3, 4]])
    g = gumbel_noise(seed, pos, 0, 50)
    assert torch.equal(g[0, 0], g[1, 0])                  # same (seed, position): same vector
    assert not torch.equal(g[0, 0], g[0, 1])              # another position
    assert not torch.equal(g[0, 0], g[2, 0])              # another seed
    # a vocabulary shard computes its slice of the same vector (tensor parallelism)
    assert torch.equal(gumbel_noise(seed, pos, 20, 30), g[..., 20:])
    assert torch.isfinite(g).all()


def test_greedy_and_degenerate_filters_give_the_argmax():
    logits = torch.randn(3, 64, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    argmax = logits.argmax(-1)
    pos = torch.arange(64).expand(3, 64)
    for params in ([SamplingParams(temperature=0.0, seed=s, top_k=5, top_p=0.5) for s in range(3)],
                   [SamplingParams(temperature=1.0, seed=s, top_k=1) for s in range(3)],
                   [SamplingParams(temperature=1.5, seed=s, top_p=1e-9) for s in range(3)],
                   [SamplingParams(temperature=1.5, seed=s, min_p=1.0) for s in range(3)]):
        assert torch.equal(sample(logits, pos, SamplingBatch.from_params(params, "cpu")), argmax)
    # while plain sampling at the same seeds does not always give it
    sampled = sample(logits, pos, SamplingBatch.from_params(
        [SamplingParams(temperature=1.0, seed=s) for s in range(3)], "cpu"))
    assert not torch.equal(sampled, argmax)


def test_filters_read_only_the_largest_logits():
    """Top-k (with top-p and min-p over what it keeps) is decided from a row's few
    largest logits (`filter_width_of`: twice the largest k, a power of two), and gives
    the thresholds a sort of the whole vocabulary gives; a top-k past MAX_FILTER_WIDTH / 2
    sorts the whole vocabulary (width 0). A top-p without top-k reads 16 and flags the
    batch (`any_open_top_p`): its nucleus may reach past them."""
    from dataclasses import replace
    from treeflash.engine.sampling import filter_floor, filter_width_of
    sampled = lambda **kw: SamplingParams(temperature=0.8, seed=0, **kw)
    assert filter_width_of([sampled(top_k=20, top_p=0.95)]) == 64
    assert filter_width_of([sampled(min_p=0.1), sampled(top_k=3)]) == 16
    assert filter_width_of([sampled(top_p=0.9), sampled(top_k=5)]) == 16
    assert filter_width_of([sampled(top_k=-1, top_p=0.9), sampled(top_k=40)]) == 128  # -1: top-k off, as 0
    assert SamplingBatch.from_params([sampled(top_k=-1, top_p=0.9)], "cpu").any_open_top_p
    assert not SamplingBatch.from_params([sampled(top_k=5, top_p=0.9), SamplingParams(temperature=0, top_p=0.5)], "cpu").any_open_top_p
    assert filter_width_of([sampled(top_k=3000)]) == 0
    assert filter_width_of([SamplingParams(temperature=0, top_k=5, top_p=0.5)]) == 0  # greedy: nothing to filter
    logits = torch.randn(5, 9, 3000, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    params = [sampled(top_k=20, top_p=0.95), sampled(top_k=7), sampled(top_k=40, min_p=0.2),
              sampled(top_k=30, top_p=0.5, min_p=0.01), sampled()]
    sb = SamplingBatch.from_params(params, "cpu")
    assert sb.filter_width == 128
    floor = filter_floor(logits, sb)
    assert torch.equal(floor, filter_floor(logits, replace(sb, filter_width=0)))
    kept = (logits >= floor[..., None]).sum(-1)
    assert (kept[0] <= 20).all() and (kept[1] == 7).all() and (kept[2] <= 40).all() and (kept[4] == 3000).all()
    scaled = logits[3] / 0.8  # top-p over what top-k and min-p left: the nucleus just passes 0.5
    top = scaled.topk(30).values
    top = top.masked_fill(top < top[:, :1] + torch.log(torch.tensor(0.01, dtype=torch.float64)), float("-inf"))
    mass = torch.softmax(top, -1).cumsum(-1)
    assert torch.equal(kept[3], (mass < 0.5).sum(-1) + 1)


def test_filter_floor_is_the_whole_row_definition():
    """Random rows (half of them on a coarse grid: many ties), random filters, rows in
    batches of mixed widths and alone: the floor is the one a sort of the whole row
    gives, the same whatever the batch."""
    import random
    from sampling_oracle import floor_of_sorted_row
    from treeflash.engine.sampling import filter_floor
    rng = random.Random(0)
    for it in range(60):
        B, V = rng.randint(1, 4), rng.choice([50, 300, 2000])
        x = torch.randn(B, 2, V, dtype=torch.float64, generator=torch.Generator().manual_seed(it)) * rng.choice([1, 5])
        if it % 2:
            x = (x * 2).round() / 2
        params = [SamplingParams(temperature=rng.choice([0.3, 1.0, 1.5]), top_k=rng.choice([0, -1, 1, 3, 20, 100]),
                                 top_p=rng.choice([1.0, 0.9, 0.5, 0.1]), min_p=rng.choice([0.0, 0.05, 0.3]), seed=b)
                  for b in range(B)]
        got = filter_floor(x, SamplingBatch.from_params(params, "cpu"))
        for b, p in enumerate(params):
            alone = filter_floor(x[b:b + 1], SamplingBatch.from_params([p], "cpu"))[0]
            want = torch.tensor([floor_of_sorted_row(x[b, t], p) for t in range(2)], dtype=torch.float64)
            assert torch.equal(got[b], want) and torch.equal(alone, want), (it, b, p)


def test_top_p_stops_where_the_mass_before_a_token_reaches_p():
    """As vLLM's top-p: a token is kept while the mass of the tokens before it is below p;
    at exactly p it is not (probabilities 0.5, 0.25, 0.25 with top_p 0.5 keep the first)."""
    from treeflash.engine.sampling import filter_floor
    x = torch.tensor([[[math.log(2.0), 0.0, 0.0]]], dtype=torch.float64)
    floor = filter_floor(x, SamplingBatch.from_params([SamplingParams(temperature=1.0, top_p=0.5, seed=0)], "cpu"))
    assert floor.item() == math.log(2.0)
    floor = filter_floor(x, SamplingBatch.from_params([SamplingParams(temperature=1.0, top_p=0.51, seed=0)], "cpu"))
    assert floor.item() == 0.0


def test_ties_at_the_kth_logit_are_kept():
    """As in vLLM, top-k keeps every token tied with the k-th largest logit (bf16 logits
    tie often): which of them a draw gives depends on the noise alone, not on the order
    a sort or top-k happened to return them in."""
    logits = torch.full((1, 400, 100), -4.0, dtype=torch.float64)
    logits[..., 10] = 2.0
    logits[..., [3, 50, 77, 90]] = 1.0
    pos = torch.arange(400)[None]
    got = sample(logits, pos, SamplingBatch.from_params([SamplingParams(temperature=1.0, top_k=2, seed=4)], "cpu"))
    assert set(got.flatten().tolist()) == {10, 3, 50, 77, 90}
    # 30 ties, more than the 16 largest logits a top-k of 2 reads: top-p counts their mass
    # all the same (e^2 / (e^2 + 30e) < 0.1, so the nucleus reaches them), alone or beside a
    # top-p row (whose batch sorts the whole vocabulary)
    from dataclasses import replace
    from treeflash.engine.sampling import filter_floor
    logits[..., 20:50] = 1.0
    tied = SamplingParams(temperature=1.0, top_k=2, top_p=0.1, seed=4)
    alone = SamplingBatch.from_params([tied], "cpu")
    assert alone.filter_width == 16
    floor = filter_floor(logits[:, :1], alone)
    assert floor.item() == 1.0 and torch.equal(floor, filter_floor(logits[:, :1], replace(alone, filter_width=0)))
    beside = SamplingBatch.from_params([tied, SamplingParams(temperature=1.0, top_p=0.9, seed=5)], "cpu")
    both = sample(logits.expand(2, -1, -1), pos.expand(2, -1), beside)
    assert torch.equal(both[0], sample(logits, pos, alone)[0]) and len(set(both[0].tolist())) > 20


@pytest.mark.parametrize("top_p,min_p", [(1.0, 0.0), (0.9, 0.0), (1.0, 0.3)])
def test_a_tiny_temperature_samples_as_the_smallest_one(top_p, min_p):
    """A sampled request's temperature is at least MIN_TEMPERATURE in the sampler and in
    the filters alike: at T = 1e-40 (a float32 subnormal) the draws are exactly those of
    T = MIN_TEMPERATURE, where logits a few MIN_TEMPERATURE apart still share them (dividing
    by 1e-40 overflows float32 to ties at inf; a filter at 1e-40 keeps the argmax alone)."""
    from treeflash.sampling_params import MIN_TEMPERATURE
    P = 64
    logits = torch.full((1, P, 6), -3.0)
    logits[..., :3] = 0.5 + torch.tensor([0.0, 1.0, -1.0]) * MIN_TEMPERATURE
    pos = torch.arange(P)[None]
    draws = [sample(logits, pos, SamplingBatch.from_params(
        [SamplingParams(temperature=t, top_p=top_p, min_p=min_p, seed=2)], "cpu"))[0] for t in (1e-40, MIN_TEMPERATURE)]
    assert torch.equal(draws[0], draws[1])
    assert len(set(draws[1].tolist())) > 1, "at MIN_TEMPERATURE these logits are not a plain argmax"


@pytest.mark.parametrize("top_p,min_p", [(1.0, 0.0), (0.9, 0.0), (1.0, 0.3)])
def test_small_temperatures_from_min_temperature_up_are_used_as_given(top_p, min_p):
    """Only temperatures below MIN_TEMPERATURE (1e-6) are raised to it: at 1e-6 and 3e-6
    the sampler and the filters take T as asked, each draw argmax(logits / T + g(seed, p))
    among the logits at least the floor a sort of the row gives at T (over logits a few
    1e-6 apart, where the two temperatures draw and filter differently)."""
    from sampling_oracle import floor_of_sorted_row
    P, V = 64, 6
    logits = torch.full((1, P, V), -3.0, dtype=torch.float64)
    logits[..., :3] = 0.5 + torch.tensor([0.0, 1.0, -1.0], dtype=torch.float64) * 2e-6
    pos = torch.arange(P)[None]
    draws = []
    for t in (1e-6, 3e-6):
        p = SamplingParams(temperature=t, top_p=top_p, min_p=min_p, seed=2)
        sb = SamplingBatch.from_params([p], "cpu")
        floor = floor_of_sorted_row(logits[0, 0], p)
        noisy = logits / sb.temperature.double() + gumbel_noise(sb.seed, pos, 0, V)
        want = noisy.masked_fill(logits < floor, float("-inf")).argmax(-1)
        draws.append(sample(logits, pos, sb))
        assert torch.equal(draws[-1], want), t
    assert not torch.equal(draws[0], draws[1])


def test_bf16_logits_are_sampled_and_scored_in_float32():
    """Sampling works in float32 whatever the logits' dtype (float64 stays): bf16 logits
    (a bf16 model's LM head) draw exactly the tokens their float32 values draw, filters
    included, and their log-probabilities are float32's (x / T and the noise in bf16
    would round away the differences that decide a draw)."""
    from treeflash.engine.sampling import logprobs_of
    P, V = 64, 1000
    logits = (torch.randn(2, P, V, generator=torch.Generator().manual_seed(5)) * 3).bfloat16()
    pos = torch.arange(P).expand(2, P)
    sb = SamplingBatch.from_params([SamplingParams(temperature=0.7, seed=1),
                                    SamplingParams(temperature=1.3, top_k=50, top_p=0.9, min_p=0.02, seed=2)], "cpu")
    assert torch.equal(sample(logits, pos, sb), sample(logits.float(), pos, sb))
    tokens = logits.float().argmin(-1)  # unlikely tokens, far below the top
    for got, want in zip(logprobs_of(logits, tokens), logprobs_of(logits.float(), tokens)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_mixed_batch_honours_each_requests_parameters():
    """One batch mixing greedy, top-k, top-p and plain sampling: each row samples exactly
    as it does alone, a row's filters do not leak into its neighbours."""
    gen = torch.Generator().manual_seed(1)
    P = 300
    logits = torch.randn(4, P, V, generator=gen, dtype=torch.float64) * 1.5
    pos = torch.arange(10, 10 + P).expand(4, P)
    params = [SamplingParams(temperature=1.0, top_k=2, seed=5),
              SamplingParams(temperature=1.0, seed=6),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_p=0.5, seed=7)]
    together = sample(logits, pos, SamplingBatch.from_params(params, "cpu"))
    for b, p in enumerate(params):
        alone = sample(logits[b:b + 1], pos[b:b + 1], SamplingBatch.from_params([p], "cpu"))
        assert torch.equal(together[b], alone[0]), f"row {b}"
    top2 = logits.topk(2, dim=-1).indices
    in_top2 = (together[..., None] == top2).any(-1)
    assert in_top2[0].all()                   # top-k = 2 respected
    assert not in_top2[1].all()               # the unfiltered neighbour is not cut to 2
    assert torch.equal(together[2], logits[2].argmax(-1))


def test_a_greedy_request_beside_a_sampled_one_takes_the_plain_argmax():
    """A greedy request gets the argmax of its logits whatever its neighbours: at exact ties
    (common in bf16) the lowest id, as alone, never a tie broken by the sampler's noise."""
    logits = torch.zeros(2, 64, 8, dtype=torch.float64)
    logits[..., 5] = logits[..., 2] = 1.0  # a tie at the top, at every position
    pos = torch.arange(64).expand(2, 64)
    sb = SamplingBatch.from_params([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)], "cpu")
    got = sample(logits, pos, sb)
    alone = sample(logits[:1], pos[:1], SamplingBatch.from_params([SamplingParams(temperature=0.0)], "cpu"))
    assert (got[0] == 2).all() and torch.equal(got[0], alone[0])


def test_seeds_that_differ_only_in_their_high_bits_give_other_streams():
    """A seed is any integer in [0, 2^63): two that agree in their low 32 bits still
    sample independently (a client's random 64-bit seeds must not collide)."""
    seeds = [3, 3 + 2 ** 32, 3 + 2 ** 62]
    tokens = draw(LOGITS, 1.0, seeds=seeds, positions=64)
    assert not torch.equal(tokens[0], tokens[1]) and not torch.equal(tokens[0], tokens[2])
    assert not torch.equal(tokens[1], tokens[2])


def test_a_request_without_structured_outputs_beside_a_constrained_one_samples_as_alone():
    """In a batch with a structured-output request, an unconstrained one reads the table's
    row 0, which allows every token: its draws are those it gets alone; the constrained
    one's stay within what its state allows."""
    params = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=1.0, seed=2)]
    sb = SamplingBatch.from_params(params, "cpu", V)
    sb.guided_rows = 16
    sb.grammar = torch.zeros(16, V, dtype=torch.int32)  # row 0: every token, staying in row 0
    sb.grammar[1] = -1
    sb.grammar[1, [2, 5]] = 1  # row 1 (the constrained request's state): only tokens 2 and 5
    sb.grammar_start = sb.grammar_state = torch.tensor([0, 1])
    pos = torch.arange(200).expand(2, 200)
    got = sample(LOGITS.expand(2, 200, -1).clone(), pos, sb, states=sb.grammar_state[:, None].expand(2, 200))
    alone = sample(LOGITS.expand(1, 200, -1).clone(), pos[:1], SamplingBatch.from_params(params[:1], "cpu"))
    assert torch.equal(got[0], alone[0]) and set(got[1].tolist()) == {2, 5}


def test_a_guided_draft_path_takes_the_best_candidate_its_state_allows():
    """Under structured outputs the drafter's path goes, depth by depth, through the first
    (most likely) of its candidates that the state allows (none: row 0, which allows all):
    the draft is masked by the states of the path the target is likeliest to accept."""
    sb = SamplingBatch.from_params([SamplingParams()], "cpu", 8)
    sb.guided_rows = 16
    sb.grammar = torch.full((16, 8), -1, dtype=torch.int32)
    sb.grammar[0] = 0
    sb.grammar[1, 2], sb.grammar[1, 5] = 2, 3  # state 1: token 2 -> state 2, token 5 -> state 3
    sb.grammar[2, 7] = 1
    sb.grammar[3, [0, 1]] = 1
    sb.grammar_start = sb.grammar_state = torch.tensor([1])
    candidates = torch.tensor([[[4, 5, 2], [6, 1, 0], [3, 4, 6], [0, 1, 2]]])  # best first, per depth
    assert sb.path_states(candidates).tolist() == [[1, 3, 1, 0]]


# --------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def llm64(hf_checkpoint):
    return LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float64")


def test_same_seed_same_tokens_on_every_run(hf_checkpoint, llm64):
    p = SamplingParams(max_new_tokens=24, temperature=1.0, seed=1234, ignore_eos=True)
    first = llm64.generate(ENGINE_PROMPTS[0], p)[0].token_ids
    assert llm64.generate(ENGINE_PROMPTS[0], p)[0].token_ids == first
    fresh = LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float64")
    assert fresh.generate(ENGINE_PROMPTS[0], p)[0].token_ids == first
    other = SamplingParams(max_new_tokens=24, temperature=1.0, seed=1235, ignore_eos=True)
    assert llm64.generate(ENGINE_PROMPTS[0], other)[0].token_ids != first
    greedy = llm64.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert greedy.token_ids != first  # T = 1 really samples


def test_output_does_not_depend_on_batch_neighbours(llm64):
    """A request's tokens are the same alone and in batches of 3 with other prompts,
    other seeds and other sampling parameters, at any batch index."""
    me = SamplingParams(max_new_tokens=32, temperature=0.9, top_k=40, seed=7, ignore_eos=True)
    alone = llm64.generate(ENGINE_PROMPTS[1], me)[0].token_ids
    assert len(alone) == 32
    neighbours = [SamplingParams(max_new_tokens=12, ignore_eos=True),                   # greedy, shorter
                  SamplingParams(max_new_tokens=40, temperature=1.3, top_p=0.8, seed=99, ignore_eos=True),
                  SamplingParams(max_new_tokens=32, temperature=0.9, top_k=40, seed=8, ignore_eos=True)]
    batches = [
        ([ENGINE_PROMPTS[0], ENGINE_PROMPTS[1], ENGINE_PROMPTS[2]], [neighbours[0], me, neighbours[1]], 1),
        ([ENGINE_PROMPTS[1], ENGINE_PROMPTS[2], ENGINE_PROMPTS[1]], [me, neighbours[1], neighbours[2]], 0),
        ([ENGINE_PROMPTS[2], ENGINE_PROMPTS[0], ENGINE_PROMPTS[1]], [neighbours[2], neighbours[0], me], 2),
    ]
    solo = {}
    for prompts, params, idx in batches:
        outs = llm64.generate(prompts, params)
        assert outs[idx].token_ids == alone
        # and every neighbour also got what it gets alone
        for i, (pr, pa) in enumerate(zip(prompts, params)):
            key = (pr, repr(pa))
            if key not in solo:
                solo[key] = llm64.generate(pr, pa)[0].token_ids
            assert outs[i].token_ids == solo[key]
    # same prompt, another seed, in the same batch: a different stream
    outs = llm64.generate(batches[1][0], batches[1][1])
    assert outs[2].token_ids != outs[0].token_ids


def test_noise_is_finite_at_the_extremes_of_the_hash():
    """The largest hash must not map to u = 1.0 (Gumbel noise +inf): that token would
    win every draw, even one that top-k removed (-inf + inf = nan)."""
    from treeflash.engine.sampling import uniform_from_hash
    u = uniform_from_hash(torch.tensor([0, 1, 2 ** 31, 2 ** 32 - 1]))
    assert bool(((u > 0) & (u < 1)).all())
    assert bool(torch.isfinite(-torch.log(-torch.log(u))).all())


def test_top_k_1_is_greedy_on_a_large_vocabulary():
    """A case that hit the extreme hash with 24-bit uniforms (seed 0, position 13)."""
    from treeflash.engine.sampling import SamplingBatch, sample
    logits = torch.zeros(1, 1, 151936)
    logits[0, 0, 5] = 50.0
    for temperature, top_k in ((1.0, 1), (1.0, 0)):
        sb = SamplingBatch.from_params([SamplingParams(temperature=temperature, top_k=top_k, seed=0)], "cpu")
        assert sample(logits, torch.tensor([[13]]), sb).item() == 5


def test_stop_none_means_no_stop_strings():
    assert SamplingParams(stop=None).validate().stop == []
    with pytest.raises(UsageError):
        SamplingParams(stop=5).validate()


def test_every_host_flag_of_a_batch_is_part_of_its_graph_key():
    """A captured round is looked up by `SamplingMode`: a flag that chooses code in a
    SamplingBatch but not in the key would replay a graph captured for another mode."""
    from dataclasses import fields

    from treeflash.engine.sampling import SamplingMode
    host = [f.name for f in fields(SamplingBatch) if f.type in ("bool", "int")]
    assert sorted(host) == sorted(SamplingMode._fields)


def test_a_guided_batch_on_a_larger_held_table_reads_all_of_it():
    """A kept state's structured-output table only grows: a batch whose table fits takes
    the rows it needs and its mode names the rows held, which is the mode whose graph
    `GraphedState.captured` looks for (a state reused for a prefix must replay, not
    capture: a capture's warm-up rounds write its caches from slot 0)."""
    V = 8

    def guided(rows: int) -> SamplingBatch:
        sb = SamplingBatch.from_params([SamplingParams()], torch.device("cpu"), V)
        sb.guided_rows = rows
        sb.grammar = torch.arange(rows * V, dtype=torch.int32).view(rows, V)
        sb.grammar_start = sb.grammar_state = torch.zeros(1, dtype=torch.long)
        return sb

    held = guided(10)
    table = held.grammar
    small = guided(4)
    assert small.mode.on_table(table).guided_rows == 10
    held.copy_(small)
    assert held.grammar is table and torch.equal(table[:4], small.grammar) and held.guided_rows == 10
    assert held.mode == small.mode.on_table(table)
    large = guided(12)
    assert large.mode.on_table(table) == large.mode  # a larger table: made anew, its own rows
    held.copy_(large)
    assert held.grammar is not table and held.guided_rows == 12 and held.mode == large.mode
    plain = SamplingBatch.from_params([SamplingParams()], torch.device("cpu"), V)
    assert plain.mode.on_table(held.grammar) == plain.mode
    held.copy_(plain)
    assert held.guided_rows == 0 and held.mode == plain.mode
