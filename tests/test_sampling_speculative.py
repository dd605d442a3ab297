"""Sampling without loss (issue 5, CPU part): with the same seed, DFlash and DDTree
produce exactly the token stream that AR sampling produces (float64 on CPU), for
every temperature / top-k / top-p / min-p combination, alone and in batches that mix greedy
and sampled requests with different parameters."""
from __future__ import annotations

import itertools

import pytest
import torch

from conftest import SPEC_PROMPTS
from treeflash import LLM, SamplingParams

COMBOS = list(itertools.product((0.3, 0.7, 1.0, 1.5), (0, 20), (1.0, 0.9)))
METHODS = [("dflash", None), ("ddtree", 4), ("ddtree", 32), ("ddtree", 256)]
PROMPTS = [SPEC_PROMPTS[0], SPEC_PROMPTS[5]]  # lengths 1 and 8


def spec_llm(target, drafter, method, budget=None, **kw):
    return LLM(target, draft_model=drafter, method=method, budget=budget, device="cpu", dtype="float64", **kw)


class Counter:
    """Counts committed tokens and request-rounds (τ = their ratio) by wrapping the decoder's round."""

    def __init__(self, llm):
        self.committed = self.rounds = 0
        inner = llm.decoder.round

        def round_(st, max_n):
            new, counts, logprobs = inner(st, max_n)
            self.committed += int(counts.sum())
            self.rounds += int((counts > 0).sum())
            return new, counts, logprobs

        llm.decoder.round = round_


@pytest.mark.parametrize("temperature,top_k,top_p", COMBOS)
def test_sampled_stream_equals_ar(temperature, top_k, top_p, spec_target, spec_drafter, ar_reference):
    """Every method x every (T, top-k, top-p): a batch of two requests (lengths 1 and
    8, different seeds) and a single request give exactly AR's tokens for the same
    seeds, on a target where drafts get accepted ('warm'); and on a target with broad
    distributions ('plain'), where the filters really remove tokens, DDTree still
    gives AR's filtered stream."""
    index = COMBOS.index((temperature, top_k, top_p))
    arch = "qwen3" if index % 2 == 0 else "llama"
    params = [SamplingParams(max_new_tokens=32, temperature=temperature, top_k=top_k, top_p=top_p, seed=s)
              for s in (11, 12)]
    target, drafter = spec_target(arch, "warm"), spec_drafter(arch, "warm", 8)
    refs = [ar_reference(target, p, sp).token_ids for p, sp in zip(PROMPTS, params)]
    for i, (method, budget) in enumerate(METHODS):
        llm = spec_llm(target, drafter, method, budget)
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == refs, f"{method} N={budget} batched differs from AR"
        if (index + i) % 2 == 0:  # single requests: every method on half of the combinations
            out = llm.generate(PROMPTS[1], params[1])[0]
            assert out.token_ids == refs[1], f"{method} N={budget} alone differs from AR"

    target, drafter = spec_target(arch, "plain"), spec_drafter(arch, "plain", 8)
    refs = [ar_reference(target, p, sp).token_ids for p, sp in zip(PROMPTS, params)]
    greedy = [ar_reference(target, p, SamplingParams(max_new_tokens=32)).token_ids for p in PROMPTS]
    assert refs[0] != greedy[0] and refs[1] != greedy[1], "sampling had no effect: nothing would be proven"
    if top_k or top_p < 1:
        unfiltered = [ar_reference(target, p, SamplingParams(max_new_tokens=32, temperature=temperature,
                                                             seed=sp.seed)).token_ids
                      for p, sp in zip(PROMPTS, params)]
        assert refs != unfiltered, "the filters removed nothing: nothing would be proven"
    outs = spec_llm(target, drafter, "ddtree", 32).generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == refs


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(1.5, 0, 1.0, 0.5), (1.0, 20, 0.9, 0.3)])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_min_p_stream_equals_ar(arch, temperature, top_k, top_p, min_p, spec_target, spec_drafter, ar_reference):
    """min-p (alone, and with top-k and top-p) keeps every method on AR's stream: where
    drafts get accepted ('warm') and where min-p really removes tokens ('plain')."""
    params = [SamplingParams(max_new_tokens=32, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             seed=s) for s in (21, 22)]
    for kind in ("warm", "plain"):
        target, drafter = spec_target(arch, kind), spec_drafter(arch, kind, 8)
        refs = [ar_reference(target, p, sp).token_ids for p, sp in zip(PROMPTS, params)]
        if kind == "plain":
            without = [ar_reference(target, p, SamplingParams(max_new_tokens=32, temperature=temperature,
                                                              top_k=top_k, top_p=top_p, seed=sp.seed)).token_ids
                       for p, sp in zip(PROMPTS, params)]
            assert refs != without, "min-p removed nothing: nothing would be proven"
        for method, budget in METHODS:
            outs = spec_llm(target, drafter, method, budget).generate(PROMPTS, params)
            assert [o.token_ids for o in outs] == refs, f"{kind}: {method} N={budget} differs from AR"


MIXED = [SamplingParams(max_new_tokens=32),                                            # greedy
         SamplingParams(max_new_tokens=32, temperature=0.7, top_k=20, seed=1),
         SamplingParams(max_new_tokens=32, temperature=1.5, top_p=0.9, seed=2),
         SamplingParams(max_new_tokens=32, temperature=0.3, top_k=20, top_p=0.9, seed=3),
         SamplingParams(max_new_tokens=32, temperature=1.0, seed=4),
         SamplingParams(max_new_tokens=32, temperature=1.2, min_p=0.1, seed=5)]
MIXED_PROMPTS = [SPEC_PROMPTS[i] for i in (4, 3, 6, 1, 7, 0)]  # lengths 1, 3, 21, 5, 2, 1


@pytest.mark.parametrize("method,budget,mode", [("dflash", None, "scaled"), ("ddtree", 4, "scaled"),
                                                ("ddtree", 32, "scaled"), ("ddtree", 256, "scaled"),
                                                ("ddtree", 32, "coupled"), ("dflash", None, "coupled")])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_mixed_batch_equals_ar(arch, method, budget, mode, spec_target, spec_drafter, ar_reference):
    """Greedy and sampled requests with different temperatures, filters and seeds side
    by side in one batch: each gets exactly the stream it gets alone with AR."""
    target = spec_target(arch, "warm")
    llm = spec_llm(target, spec_drafter(arch, "warm", 16), method, budget, draft_mode=mode)
    outs = llm.generate(MIXED_PROMPTS, MIXED)
    for prompt, params, out in zip(MIXED_PROMPTS, MIXED, outs):
        assert out.token_ids == ar_reference(target, prompt, params).token_ids


def test_seed_decides_the_stream(spec_target, spec_drafter, ar_reference):
    """Same seed, same stream (run twice, and batched vs alone); another seed, another
    stream; top-k = 1 is greedy at any temperature."""
    target, drafter = spec_target("qwen3", "warm"), spec_drafter("qwen3", "warm", 8)
    llm = spec_llm(target, drafter, "ddtree", 32)
    p = lambda seed, **kw: SamplingParams(max_new_tokens=32, temperature=1.0, seed=seed, **kw)  # noqa: E731
    a = llm.generate(SPEC_PROMPTS[2], p(5))[0].token_ids
    assert llm.generate(SPEC_PROMPTS[2], p(5))[0].token_ids == a
    both = llm.generate([SPEC_PROMPTS[2], SPEC_PROMPTS[2]], [p(5), p(6)])
    assert both[0].token_ids == a and both[1].token_ids != a
    assert both[1].token_ids == ar_reference(target, SPEC_PROMPTS[2], p(6)).token_ids
    greedy = ar_reference(target, SPEC_PROMPTS[2], SamplingParams(max_new_tokens=32)).token_ids
    assert llm.generate(SPEC_PROMPTS[2], p(7, top_k=1))[0].token_ids == greedy


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 64)])
def test_sampling_accepts_draft_tokens(method, budget, spec_target, spec_drafter, ar_reference):
    """At low temperature the drafter's tokens are still accepted (τ > 1): the sampled
    accept/commit path is exercised, not just the one-token fallback."""
    target = spec_target("llama", "warm")
    llm = spec_llm(target, spec_drafter("llama", "warm", 8), method, budget)
    count = Counter(llm)
    params = [SamplingParams(max_new_tokens=48, temperature=0.3, seed=s) for s in range(4)]
    prompts = SPEC_PROMPTS[10:14]
    outs = llm.generate(prompts, params)
    for prompt, sp, out in zip(prompts, params, outs):
        assert out.token_ids == ar_reference(target, prompt, sp).token_ids
    tau = count.committed / count.rounds
    print(f"sampled T=0.3 {method} N={budget}: tau {tau:.3f}")
    assert tau > 1.02


def _trees_at(llm, prompt, temperatures):
    """The DDTree each temperature's request (seed 1) drafts after prefilling `prompt`."""
    from treeflash.engine.sampling import SamplingBatch
    dec, trees = llm.decoder, []
    for t in temperatures:
        st = dec.new_state(1, 128, SamplingBatch.from_params([SamplingParams(temperature=t, seed=1)], "cpu"))
        dec.prefill(st, [prompt])
        trees.append(dec.build(st))
    return trees


def test_a_tiny_temperature_drafts_the_greedy_tree(spec_target, spec_drafter, ar_reference):
    """The coupled draft scores are logits + T g: at T = 1e-40 the tree is the greedy
    request's tree, and tokens are still accepted. As logits / T + g they overflowed to
    inf, the tree's log-probabilities were NaN, and every round committed one token."""
    target = spec_target("llama", "warm")
    llm = spec_llm(target, spec_drafter("llama", "warm", 8), "ddtree", 64)
    prompt = SPEC_PROMPTS[10]
    greedy, tiny = _trees_at(llm, prompt, (0.0, 1e-40))
    assert torch.equal(tiny.tokens, greedy.tokens) and torch.equal(tiny.valid, greedy.valid)
    taus = []
    for t in (0.0, 1e-40):
        count = Counter(llm)
        sp = SamplingParams(max_new_tokens=48, temperature=t, seed=3)
        assert llm.generate(prompt, sp)[0].token_ids == ar_reference(target, prompt, sp).token_ids
        taus.append(count.committed / count.rounds)
    print(f"tau greedy {taus[0]:.3f}, T = 1e-40 {taus[1]:.3f}")
    assert taus[1] > 1.2 and taus[1] > 0.8 * taus[0]


@pytest.mark.parametrize("top_k,top_p", [(0, 0.5), (5, 1.0)])
def test_filters_do_not_cut_the_draft_tree(top_k, top_p, spec_target, spec_drafter):
    """top-k/top-p filter the target's law, not the draft: the tree of a filtered request
    is the tree of the same request unfiltered (a draft cut to its own nucleus would turn
    most of the budget into dead padding nodes, and τ towards 1)."""
    from treeflash.engine.sampling import SamplingBatch
    target = spec_target("llama", "warm")
    llm = spec_llm(target, spec_drafter("llama", "warm", 8), "ddtree", 64)
    dec, prompt = llm.decoder, SPEC_PROMPTS[10]
    trees = []
    for k, p in ((0, 1.0), (top_k, top_p)):
        sb = SamplingBatch.from_params([SamplingParams(temperature=0.7, top_k=k, top_p=p, seed=1)], "cpu")
        st = dec.new_state(1, 128, sb)
        dec.prefill(st, [prompt])
        trees.append(dec.build(st))
    assert int(trees[0].valid.sum()) == 65
    assert torch.equal(trees[1].tokens, trees[0].tokens) and torch.equal(trees[1].valid, trees[0].valid)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_coupled_draft_picks_the_targets_own_sample(temperature, spec_target, spec_drafter):
    """'coupled' draft scores rank the tokens of each depth as logits / T + g does (the
    drafter's logits, the target's own noise g(seed, position)): their best is the very
    sample the target draws where the drafter is right (logits + T g up to T = 1, the
    same order; logits / T + g past it)."""
    from treeflash.engine.sampling import SamplingBatch, gumbel_noise
    target = spec_target("llama", "warm")
    llm = spec_llm(target, spec_drafter("llama", "warm", 8), "ddtree", 16)
    dec, prompt = llm.decoder, SPEC_PROMPTS[10]
    sb = SamplingBatch.from_params([SamplingParams(temperature=temperature, seed=3)], "cpu")
    st = dec.new_state(1, 128, sb)
    dec.prefill(st, [prompt])
    with torch.inference_mode():
        scores = dec.draft_logits(st)
        st.sampling = SamplingBatch.from_params([SamplingParams()], "cpu")  # greedy: the drafter's own logits
        logits = dec.draft_logits(st)
    positions = st.n[:, None] + torch.arange(1, dec.drafter.block_size)
    noise = gumbel_noise(sb.seed, positions, 0, logits.shape[-1])
    want = (logits / temperature + noise).topk(8, dim=-1).indices
    assert torch.equal(scores.topk(8, dim=-1).indices, want)


def test_scaled_draft_scores_are_the_drafters_logits_over_the_temperature(spec_target, spec_drafter):
    """'scaled' draft scores are the drafter's logits / T for a sampled request, and the
    drafter's own logits for a greedy one beside it: the trees come from the
    temperature-scaled draft distributions, each request's at its own temperature."""
    from treeflash.engine.sampling import SamplingBatch
    llm = spec_llm(spec_target("llama", "warm"), spec_drafter("llama", "warm", 8), "ddtree", 16, draft_mode="scaled")
    dec, T = llm.decoder, 2.0
    st = dec.new_state(2, 128, SamplingBatch.from_params([SamplingParams(), SamplingParams(temperature=T, seed=3)],
                                                         "cpu"))
    dec.prefill(st, [SPEC_PROMPTS[10], SPEC_PROMPTS[11]])
    with torch.inference_mode():
        scores = dec.draft_logits(st)
        st.sampling = SamplingBatch.from_params([SamplingParams()] * 2, "cpu")  # greedy: the drafter's own logits
        logits = dec.draft_logits(st)
    assert torch.equal(scores[0], logits[0]) and torch.equal(scores[1], logits[1] / T)


def test_a_tiny_temperature_drafts_the_greedy_tree_in_scaled_mode(spec_target, spec_drafter):
    """'scaled' draft scores divide by T at least MIN_TEMPERATURE, as the target's
    sampler does: at T = 1e-40 the tree is the greedy request's (logits / 1e-40
    overflowed to inf, and the tree's log-probabilities were NaN)."""
    llm = spec_llm(spec_target("llama", "warm"), spec_drafter("llama", "warm", 8), "ddtree", 64, draft_mode="scaled")
    greedy, tiny = _trees_at(llm, SPEC_PROMPTS[10], (0.0, 1e-40))
    assert int(tiny.valid.sum()) == 65
    assert torch.equal(tiny.tokens, greedy.tokens) and torch.equal(tiny.valid, greedy.valid)


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 16)])
def test_drafts_take_only_tokens_the_target_may_take(method, budget, spec_target, spec_drafter, ar_reference):
    """allowed_token_ids (and logit_bias) act on the draft too: every drafted token is
    one the target may sample, rather than the drafter's favourites that it may not."""
    target = spec_target("qwen3", "peaked")
    llm = spec_llm(target, spec_drafter("qwen3", "peaked", 8), method, budget)
    dec, drafted = llm.decoder, set()
    build = dec.build

    def recorded(st, max_n=None):
        tree = build(st, max_n)
        drafted.update(tree.tokens[:, 1:][tree.valid[:, 1:]].tolist())
        return tree

    dec.build = recorded
    allowed = list(range(20, 121))  # not the peaked target's (and its drafter's) favourites, 3..10
    params = SamplingParams(max_new_tokens=24, allowed_token_ids=allowed)
    outs = llm.generate(SPEC_PROMPTS[:3], params)
    assert drafted and drafted <= set(allowed)
    assert [o.token_ids for o in outs] == [ar_reference(target, p, params).token_ids for p in SPEC_PROMPTS[:3]]


def test_min_tokens_holds_back_the_draft_at_the_targets_positions(spec_target, spec_drafter):
    """The draft token at depth d sits at position n + d, where the target samples it:
    min_tokens holds the stop tokens back on the draft at exactly the positions where it
    holds them back on the target (before prompt + min_tokens), and nowhere past them."""
    from treeflash.engine.sampling import SamplingBatch
    llm = spec_llm(spec_target("qwen3", "peaked"), spec_drafter("qwen3", "peaked", 8), "ddtree", 16)
    dec, prompt, held = llm.decoder, SPEC_PROMPTS[5], [0, 5]
    min_tokens = 4  # new tokens at positions L .. L + 3: the prefill's, then depths 1 .. 3 of the first draft
    params = SamplingParams(max_new_tokens=16, min_tokens=min_tokens, stop_token_ids=held[1:])
    st = dec.new_state(1, 128, SamplingBatch.from_params([params], "cpu", llm.config.vocab_size, [prompt],
                                                         [set(held)]))
    dec.prefill(st, [prompt])
    with torch.inference_mode():
        scores = dec.draft_logits(st)[0, :, held]                  # [depths 1 .. 7, held tokens]
    positions = len(prompt) + torch.arange(1, scores.shape[0] + 1)
    assert torch.equal(torch.isinf(scores).all(-1), positions < len(prompt) + min_tokens)
    assert torch.isfinite(scores[positions >= len(prompt) + min_tokens]).all()
