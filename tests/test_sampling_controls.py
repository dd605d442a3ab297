"""logit_bias, allowed_token_ids, min_tokens and the penalties are part of the
target's law, applied to the raw logits before the temperature and the filters (vLLM's
order), so that every method samples them exactly as AR does:

- `sample` draws from the law that transformers' processors give (chi-square), and
  never a token they remove; greedy decoding takes the biased argmax;
- min_tokens holds back EOS and stop tokens (not before the min_tokens-th new token)
  and stop strings that the first min_tokens tokens' text holds, in the engine's text
  and in a stream's;
- presence, frequency and repetition penalties: AR equals a reference decoding loop over
  transformers' model, and each tree node gets its own path's history;
- DFlash and DDTree give AR's tokens with each of them, greedy and sampled, filtered,
  alone and in a batch with requests that set none of them;
- bad values get a one-line error.
"""
from __future__ import annotations

import json
import pytest
import torch
from conftest import ENGINE_PROMPTS, SPEC_PROMPTS
from cpu_graphs import cpu_graphs
from test_sampling import LOGITS, P_MIN, V, chi2_pvalue

from treeflash import LLM, SamplingParams, StructuredOutputs, UsageError
from treeflash.engine.options import builtin_paths
from treeflash.engine.sampling import SamplingBatch, sample
from treeflash.tokenizer import TextStream

METHODS = [("dflash", None), ("ddtree", 4), ("ddtree", 32), ("ddtree", 256)]
PROMPTS = [SPEC_PROMPTS[0], SPEC_PROMPTS[5]]
SEEDS, POSITIONS = 40, 200
STOP_IDS = {0, 7}  # EOS and a stop token: what min_tokens holds back in the draws below


def oracle(temperature: float, bias: dict[int, float], allowed: list[int] | None, held: bool) -> torch.Tensor:
    """softmax of transformers' processors over LOGITS: the bias, the allowed tokens,
    min_tokens' ban of STOP_IDS (`held`: a token before the min_tokens-th), the temperature."""
    from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor,
                                                        PrefixConstrainedLogitsProcessor,
                                                        SequenceBiasLogitsProcessor, TemperatureLogitsWarper)
    ids = torch.zeros(1, 3, dtype=torch.long)  # 3 tokens so far, all prompt: 0 new ones
    scores = LOGITS[None].clone()
    if bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(ids, scores)
    if allowed is not None:
        scores = PrefixConstrainedLogitsProcessor(lambda batch, sent: allowed, 1)(ids, scores)
    scores = MinNewTokensLengthLogitsProcessor(3, 1 if held else 0, sorted(STOP_IDS))(ids, scores)
    return torch.softmax(TemperatureLogitsWarper(temperature)(ids, scores)[0], -1)


LAWS = [({1: -2.5, 4: 3.0, 9: 1.0}, None), ({}, [0, 2, 3, 7, 10]), ({6: -100.0, 2: 1.5}, [1, 2, 6, 8, 11])]


@pytest.mark.parametrize("bias,allowed", LAWS, ids=["logit_bias", "allowed", "both"])
@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_samples_follow_the_biased_softmax(bias, allowed, temperature):
    """Positions before prompt + min_tokens (here 100 of 200) never take a stop token;
    the others may. Both halves fit the oracle's law."""
    params = [SamplingParams(temperature=temperature, seed=s, logit_bias=bias or None, allowed_token_ids=allowed,
                             min_tokens=100, max_new_tokens=POSITIONS) for s in range(SEEDS)]
    sb = SamplingBatch.from_params(params, "cpu", V, [[]] * SEEDS, [STOP_IDS] * SEEDS)
    positions = torch.arange(POSITIONS).expand(SEEDS, POSITIONS)
    tokens = sample(LOGITS.float().expand(SEEDS, POSITIONS, -1).clone(), positions, sb)
    for half, held in ((tokens[:, :100], True), (tokens[:, 100:], False)):
        probs = oracle(temperature, bias, allowed, held)
        counts = torch.bincount(half.flatten(), minlength=V).double()
        assert counts[probs == 0].sum() == 0, f"removed tokens sampled: {counts.tolist()}"
        assert chi2_pvalue(counts, probs) > P_MIN
        assert held or allowed is not None and not STOP_IDS & set(allowed) or counts[sorted(STOP_IDS)].sum() > 0


def test_greedy_takes_the_biased_argmax():
    top = int(LOGITS.argmax())
    cases = [({}, None, top), ({top: -100.0}, None, int(LOGITS.topk(2).indices[1])), ({4: 100.0}, None, 4),
             ({}, [2, 9], 2), ({2: -1.5}, [2, 9], 9),
             # a bias does not bring back a token that allowed_token_ids left out
             ({4: 100.0, 2: 5.0}, [2, 9], 2),
             # vLLM's own SamplingParams takes any bias (code bans tokens with -1e9 or -inf)
             ({top: float("-inf")}, None, int(LOGITS.topk(2).indices[1])), ({top: -1e9}, None,
                                                                           int(LOGITS.topk(2).indices[1])),
             ({4: 1e4}, None, 4), ({2: float("-inf")}, [2, 9], 9)]
    for bias, allowed, want in cases:
        params = [SamplingParams(logit_bias=bias or None, allowed_token_ids=allowed)]
        sb = SamplingBatch.from_params(params, "cpu", V, [[0] * 5], [set()])
        assert sample(LOGITS.float()[None, None], torch.tensor([[5]]), sb).item() == want, (bias, allowed)


def test_two_tokens_given_the_largest_bias_are_sampled_by_their_own_logits():
    """The largest positive bias SamplingParams takes still leaves the sampler's noise
    its say: two tokens given it split the draws as softmax of their logits would."""
    a, b = LOGITS.topk(V).indices[[3, 4]].tolist()  # close, not the top ones
    params = [SamplingParams(temperature=1.0, seed=s, logit_bias={a: 1e4, b: 1e4}) for s in range(SEEDS)]
    sb = SamplingBatch.from_params(params, "cpu", V, [[]] * SEEDS, [set()] * SEEDS)
    positions = torch.arange(POSITIONS).expand(SEEDS, POSITIONS)
    tokens = sample(LOGITS.float().expand(SEEDS, POSITIONS, -1).clone(), positions, sb).flatten()
    assert set(tokens.tolist()) == {a, b}
    share = (tokens == a).double().mean().item()
    want = torch.softmax(LOGITS.double()[[a, b]], 0)[0].item()
    assert abs(share - want) < 0.05, (share, want)


@pytest.mark.parametrize("min_tokens", [1, 3])
def test_min_tokens_holds_back_exactly_the_first_min_tokens_positions(min_tokens):
    """The held-back tokens are masked at the positions of the first min_tokens new tokens
    (prompt length .. + min_tokens - 1) and at no later one: min_tokens = 1 holds back the
    very first token. Greedy, with the held-back token the argmax: the runner-up comes there."""
    top, second = LOGITS.topk(2).indices.tolist()
    prompt = [0] * 5
    sb = SamplingBatch.from_params([SamplingParams(min_tokens=min_tokens, max_new_tokens=8)], "cpu", V, [prompt],
                                   [{top}])
    positions = torch.arange(len(prompt), len(prompt) + min_tokens + 2)[None]
    got = sample(LOGITS.float().expand(1, positions.shape[1], -1).clone(), positions, sb)
    assert got[0].tolist() == [second] * min_tokens + [top] * 2


def test_the_bias_comes_before_the_repetition_penalty():
    """vLLM's order: logit_bias, then the penalties on the biased logits. A seen token whose
    raw logit is negative and biased one positive is divided by the repetition penalty, one
    whose raw logit is positive and biased one negative is multiplied (the oracle:
    transformers' bias and repetition processors, in that order)."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    from treeflash.engine.sampling import apply_controls
    raw = torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    bias, prompt = {1: 2.0, 2: -2.0}, [1, 2, 3]
    sb = SamplingBatch.from_params([SamplingParams(repetition_penalty=2.0, logit_bias=bias)], "cpu", 4, [prompt],
                                   [set()])
    got = apply_controls(raw[None, None], torch.tensor([[len(prompt)]]), sb, 0)[0, 0]
    ids = torch.tensor([prompt])
    biased = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    penalized = RepetitionPenaltyLogitsProcessor(2.0)
    want = penalized(ids, biased(ids, raw[None].clone()))[0]
    assert not torch.equal(want, biased(ids, penalized(ids, raw[None].clone()))[0]), "the order matters here"
    assert torch.equal(got, want)


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    """vLLM's (and CTRL's) rule: a token seen in the prompt or output becomes less likely
    either way; the greedy reference below cannot see the negative side (a penalized
    negative logit never wins)."""
    from treeflash.engine.sampling import apply_controls
    sb = SamplingBatch.from_params([SamplingParams(repetition_penalty=2.0)], "cpu", 4, [[1, 2]], [set()])
    got = apply_controls(torch.tensor([[[1.0, 3.0, -3.0, -1.0]]]), torch.tensor([[2]]), sb, 0)[0, 0]
    assert got.tolist() == [1.0, 1.5, -6.0, -1.0]


def test_min_tokens_lets_the_stop_token_come_right_after(eos_checkpoint):
    """min_tokens = k holds EOS back for the first k tokens only: greedy decoding that
    ends at token k + 1 still ends there (the boundary of the mask)."""
    llm = LLM(eos_checkpoint.path, device="cpu", dtype="float32")
    k = eos_checkpoint.step
    for min_tokens, want in ((k, eos_checkpoint.full[:k + 1]), (k + 1, None)):
        out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=k + 8, min_tokens=min_tokens))[0]
        if want is not None:
            assert out.token_ids == want and out.finish_reason == "stop"
        else:  # held back at k: another token there
            assert out.token_ids[:k] == eos_checkpoint.full[:k] and out.token_ids[k] != eos_checkpoint.eos


def spec_llm(target, drafter, method, budget=None):
    return LLM(target, draft_model=drafter, method=method, budget=budget, device="cpu", dtype="float64")


@pytest.mark.parametrize("kind", ["warm", "plain"])
def test_biased_streams_equal_ar(kind, spec_target, spec_drafter, ar_reference):
    """Greedy, sampled and filtered requests with logit_bias and allowed_token_ids: every
    method gives AR's tokens, which the bias changed, and which stay among the allowed."""
    target, drafter = spec_target("qwen3", kind), spec_drafter("qwen3", kind, 8)
    plain = [SamplingParams(max_new_tokens=24, ignore_eos=True),
             SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=41)]
    free = [ar_reference(target, p, sp).token_ids for p, sp in zip(PROMPTS, plain)]
    allowed = sorted(set(range(0, 259, 3)) | set(free[1][:4]))
    bias = {free[0][2]: float("-inf"), free[0][5]: -3.0, 200: 2.5}  # -inf: a ban, as vLLM's code writes it
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, logit_bias=bias),
              SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=41,
                             allowed_token_ids=allowed, logit_bias={allowed[1]: 1.0})]
    refs = [ar_reference(target, p, sp).token_ids for p, sp in zip(PROMPTS, params)]
    assert refs[0] != free[0] and free[0][2] not in refs[0][2:3], "the bias changed nothing"
    assert refs[1] != free[1] and set(refs[1]) <= set(allowed)
    for method, budget in METHODS:
        outs = spec_llm(target, drafter, method, budget).generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == refs, f"{kind}: {method} N={budget} differs from AR"


def test_allowed_token_ids_are_a_set_and_a_reseeded_copy_keeps_every_control():
    """A long allowed_token_ids with repeats is its distinct ids (in order); a copy with
    another seed (a server's n choices) keeps every other field, and the original its seed."""
    p = SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[9, 4, 9] * 100_000, logit_bias={4: 2.0},
                       stop=["x"], bad_words=["y"])
    assert p.allowed_token_ids == [9, 4]
    q = p.with_seed(7)
    assert (q.seed, p.seed) == (7, 3)
    assert {**vars(q), "seed": 3} == vars(p)


def test_min_tokens_holds_back_stop_tokens(spec_target, spec_drafter, ar_reference):
    """A stop token that AR meets early is held back until min_tokens new tokens came,
    greedy and sampled; every method gives AR's tokens, and drafts get accepted."""
    prompt = SPEC_PROMPTS[5]
    for kind, extra in (("peaked", dict()), ("warm", dict(temperature=0.7, seed=5))):
        target, drafter = spec_target("qwen3", kind), spec_drafter("qwen3", kind, 8)
        free = ar_reference(target, prompt, SamplingParams(max_new_tokens=32, ignore_eos=True, **extra)).token_ids
        stop = free[2]
        early = ar_reference(target, prompt, SamplingParams(max_new_tokens=32, ignore_eos=True,
                                                            stop_token_ids=[stop], **extra))
        assert early.finish_reason == "stop" and len(early.token_ids) == free.index(stop) + 1
        params = SamplingParams(max_new_tokens=32, ignore_eos=True, stop_token_ids=[stop], min_tokens=12, **extra)
        ref = ar_reference(target, prompt, params)
        assert stop not in ref.token_ids[:12] and len(ref.token_ids) > 12
        assert ref.finish_reason == "length" or ref.token_ids[-1] == stop
        taus = []
        for method, budget in METHODS:
            out = spec_llm(target, drafter, method, budget).generate(prompt, params)[0]
            assert out.token_ids == ref.token_ids, f"{method} N={budget} {extra} differs from AR"
            taus.append(out.stats["tau"])
        assert min(taus) > 1, f"{kind}: no draft accepted ({taus})"


def test_min_tokens_holds_back_eos(eos_checkpoint):
    """The checkpoint's greedy stream ends with EOS at `step`: with min_tokens past it,
    EOS's tie goes to the other token and the stream runs on."""
    llm = LLM(eos_checkpoint.path, device="cpu", dtype="float32")
    k = eos_checkpoint.step
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=k + 8, min_tokens=k + 3))[0]
    assert out.token_ids[:k] == eos_checkpoint.full[:k] and eos_checkpoint.eos not in out.token_ids[:k + 3]
    assert len(out.token_ids) > k + 3 or out.finish_reason == "length"


def test_mixed_batch_with_and_without_bias(spec_target, spec_drafter, ar_reference):
    target, drafter = spec_target("llama", "warm"), spec_drafter("llama", "warm", 8)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True),
              SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=3, logit_bias={9: 2.0}),
              SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=1.0, top_k=20, seed=4,
                             allowed_token_ids=list(range(3, 200))),
              SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.5, seed=6)]
    prompts = [SPEC_PROMPTS[i] for i in (1, 2, 3, 4)]
    outs = spec_llm(target, drafter, "ddtree", 32).generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == ar_reference(target, prompt, p).token_ids


def test_stop_strings_wait_for_min_tokens():
    """A stop string in the first min_tokens tokens' text does not end the request (nor
    cut its text); the next one past them does, in the engine's text and in a stream's."""
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32")
    prompt, stop = "def f(x):", "return"
    context = llm.encode(prompt)
    full = llm.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    pieces = [llm.tokenizer.decode_continuation(full.token_ids[:k + 1], context) for k in range(len(full.token_ids))]
    done = next(k for k, t in enumerate(pieces) if stop in t)  # the token that completes the first one
    assert pieces[-1].count(stop) >= 3
    plain = llm.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop]))[0]
    assert len(plain.token_ids) == done + 1 and plain.text == pieces[-1][:pieces[-1].index(stop)]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop], min_tokens=done + 2)
    late = llm.generate(prompt, params)[0]
    second = pieces[-1].index(stop, len(pieces[done + 1]) - len(stop) + 1)  # ends past min_tokens' text
    assert late.finish_reason == "stop" and late.text == pieces[-1][:second]
    assert late.token_ids == full.token_ids[:len(late.token_ids)] and len(late.token_ids) > done + 2
    stream = TextStream(llm.tokenizer, [stop], llm.eos_token_ids, context=context, min_tokens=params.min_tokens)
    text = "".join(stream.push(late.token_ids[i:i + 3]) for i in range(0, len(late.token_ids), 3))
    assert text + stream.finish(late.text) == late.text
    assert len(text) > pieces[-1].index(stop), "the stream stopped at the first stop string"


@pytest.mark.parametrize("kw,message", [
    (dict(logit_bias={5: 1e5}), "logit_bias values must be in"),  # past 1e4 the noise would drown
    (dict(logit_bias={5: -1e31}), "logit_bias values must be in"),
    (dict(logit_bias={5: float("inf")}), "logit_bias values must be in"),
    (dict(logit_bias={5: float("-inf")}, allowed_token_ids=[5]), "bans \\(-inf\\) every token of allowed_token_ids"),
    (dict(logit_bias={5: float("nan")}), "logit_bias values must be in"),
    (dict(logit_bias={5: 10 ** 400}), "logit_bias values must be in"),
    (dict(logit_bias={-1: 1.0}), "logit_bias must map token ids"),
    (dict(logit_bias=[5, 1.0]), "logit_bias must map token ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[1, True]), "allowed_token_ids must be a non-empty list"),
    (dict(min_tokens=-1), "min_tokens must be an integer in"),
    (dict(min_tokens=9, max_new_tokens=8), "min_tokens must be an integer in"),
    # integers too long to print (Python refuses past 4300 digits) still get the message
    (dict(logit_bias={10 ** 5000: 1.0}), "logit_bias must map token ids"),
    (dict(allowed_token_ids=[-10 ** 5000]), "allowed_token_ids must be a non-empty list"),
    (dict(stop_token_ids=[10 ** 5000]), "stop_token_ids must be a list of token ids"),
    (dict(max_new_tokens=-10 ** 5000), "max_new_tokens must be an integer"),
])
def test_bad_values_are_refused(kw, message):
    with pytest.raises(UsageError, match=message) as e:
        SamplingParams(**kw)
    assert len(str(e.value)) < 200 and "\n" not in str(e.value)


@pytest.mark.parametrize("mapping,message", [
    ({"1" * 5000: 1}, "keys must be token ids"),
    ({"5": 1, "05": 2}, "token id 5 twice"),
    ({"²": 1}, "keys must be token ids"),
    ({5: 1}, "keys must be token ids"),
    ([["5", 1]], "must be an object"),
])
def test_logit_bias_as_json_gives_it(mapping, message):
    """OpenAI's logit_bias (the server's and --logit-bias's): string keys of digits."""
    from treeflash.sampling_params import token_bias
    assert token_bias({"7": 2, "0": -1.5}) == {7: 2, 0: -1.5}
    # 19 digits hold every int64 id: the largest is a token id (the vocabulary refuses it later)
    assert token_bias({str(2 ** 63 - 1): 1}) == {2 ** 63 - 1: 1}
    with pytest.raises(UsageError, match=message):
        token_bias(mapping)


def test_ids_outside_the_vocabulary_and_impossible_requests(hf_checkpoint):
    llm = LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float32")
    vocab = llm.config.vocab_size
    for kw in (dict(logit_bias={vocab: 1.0}), dict(allowed_token_ids=[3, vocab])):
        with pytest.raises(UsageError, match="outside the vocabulary"):
            llm.generate("x", SamplingParams(**kw))
    eos = llm.eos_token_ids[0]
    with pytest.raises(UsageError, match="min_tokens holds back every one of allowed_token_ids"):
        llm.generate("x", SamplingParams(allowed_token_ids=[eos], min_tokens=2))
    assert llm.generate("x", SamplingParams(allowed_token_ids=[eos, 5], min_tokens=2, max_new_tokens=3))[0] \
        .token_ids[:2] == [5, 5]
    # stop tokens that are the whole vocabulary: min_tokens leaves nothing to sample (it took EOS at once)
    with pytest.raises(UsageError, match="min_tokens holds back every token"):
        llm.generate("x", SamplingParams(stop_token_ids=list(range(vocab)), min_tokens=2))
    with pytest.raises(UsageError, match=r"min_tokens holds back every one of allowed_token_ids \(EOS and stop "
                                         r"tokens, with logit_bias -inf\)"):
        llm.generate("x", SamplingParams(allowed_token_ids=[eos, 5], logit_bias={5: float("-inf")}, min_tokens=2))
    # a -inf bias bans its token as a one-token bad word would, for every check of a way on
    with pytest.raises(UsageError, match="bad_words and logit_bias -inf ban every one of allowed_token_ids after"):
        llm.generate("x", SamplingParams(allowed_token_ids=[5, 7], logit_bias={7: float("-inf")},
                                         bad_words=[llm.tokenizer.decode([5, 5])]))
    with pytest.raises(UsageError, match="logit_bias -inf bans every way to finish the structured output") as e:
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputs(choice=["5"]), logit_bias={
            t: float("-inf") for t in range(vocab) if llm.tokenizer.decode([t]).lstrip().startswith("5")}))
    assert e.value.param == "logit_bias"  # the request has no bad_words
    # bans of the whole vocabulary between logit_bias and a bad word: the sampler had no token
    # left and took token 0 (banned) without a word
    word = llm.tokenizer.decode([5])
    last = {s[0] for s in llm.rules.bad_sequences(SamplingParams(bad_words=[word])) if len(s) == 1}
    for extra in ({}, {"min_tokens": 2}, {"ignore_eos": True}):
        with pytest.raises(UsageError, match="bad_words and logit_bias -inf ban every token of the vocabulary"):
            llm.generate("x", SamplingParams(bad_words=[word], **extra, logit_bias={
                t: float("-inf") for t in range(vocab) if t not in last}))
    assert len(llm.generate("x", SamplingParams(bad_words=[word], max_new_tokens=3, ignore_eos=True, logit_bias={
        t: float("-inf") for t in range(vocab) if t not in last | {7}}))[0].token_ids) == 3
    with pytest.raises(UsageError, match="logit_bias bans \\(-inf\\) every token of the vocabulary"):
        llm.generate("x", SamplingParams(logit_bias={t: float("-inf") for t in range(vocab)}))
    others = [t for t in range(vocab) if t != 5]  # one token left: min_tokens' tokens are it
    assert llm.generate("x", SamplingParams(stop_token_ids=others, min_tokens=2, max_new_tokens=2))[0] \
        .token_ids == [5, 5]
    # bad words of one token that ban every allowed token leave nothing to sample
    word = llm.tokenizer.decode([5])
    one = [s for s in llm.rules.bad_sequences(SamplingParams(bad_words=[word])) if len(s) == 1]
    allowed = sorted({s[0] for s in one})
    with pytest.raises(UsageError, match="bad_words ban every one of allowed_token_ids") as e:
        llm.generate("x", SamplingParams(allowed_token_ids=allowed, bad_words=[word]))
    assert e.value.param == "bad_words"
    assert len(llm.generate("x", SamplingParams(allowed_token_ids=allowed + [7], bad_words=[word],
                                                max_new_tokens=2))[0].token_ids) == 2
    with pytest.raises(UsageError, match="cannot be combined with min_tokens") as e:
        SamplingParams(min_tokens=1, structured_outputs=StructuredOutputs(regex="a"))
    assert e.value.param == "min_tokens"


def test_bad_words_that_leave_no_token_are_refused():
    """One-token bad words that, with min_tokens holding back EOS, ban every allowed
    token, or that let a structured output reach a point it can no longer be finished
    from (where the sampler would have no token and the output would break it), are the
    request's error; bad words the constraint can live with are not."""
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32")
    eos = llm.eos_token_ids[0]
    [hash_id] = llm.encode("#", special=False)  # one token
    refused = [dict(allowed_token_ids=[hash_id, eos], bad_words=["#"], min_tokens=3),
               dict(structured_outputs=StructuredOutputs(choice=["#"]), bad_words=["#"]),
               dict(structured_outputs=StructuredOutputs(regex="[#$]"), bad_words=["#", "$"])]
    for kw in refused:
        with pytest.raises(UsageError, match="bad_words ban every") as e:
            llm.generate("def f", SamplingParams(max_new_tokens=4, **kw))
        assert e.value.param == "bad_words"
    out = llm.generate("def f", SamplingParams(max_new_tokens=4, structured_outputs=StructuredOutputs(regex="[#$]"),
                                               bad_words=["#"]))[0]
    assert out.text == "$"
    # a word of two tokens bans its second only after its first: "q" then no way on
    assert len(llm.encode("q#", special=False)) == 2
    with pytest.raises(UsageError, match="bad_words ban every") as e:
        llm.generate("def f", SamplingParams(max_new_tokens=4, structured_outputs=StructuredOutputs(choice=["q#"]),
                                             bad_words=["q#"]))
    out = llm.generate("def f", SamplingParams(max_new_tokens=4, structured_outputs=StructuredOutputs(
        choice=["q#", "q$"]), bad_words=["q#"]))[0]
    assert out.text == "q$"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    out = llm.generate("def f", SamplingParams(max_new_tokens=24, structured_outputs=StructuredOutputs(json=schema),
                                               bad_words=["zebra"]))[0]
    assert json.loads(out.text).keys() == {"n"}
    # a stop token that is also text is text no longer: with it, "$" banned leaves "[#$]" no way
    dollar = llm.encode("$", special=False)
    regex = StructuredOutputs(regex="[#$]")
    with pytest.raises(UsageError, match="bad_words ban every") as e:
        llm.generate("def f", SamplingParams(max_new_tokens=4, structured_outputs=regex, bad_words=["$"],
                                             stop_token_ids=[hash_id]))
    assert llm.generate("def f", SamplingParams(max_new_tokens=4, structured_outputs=regex,
                                                stop_token_ids=[hash_id]))[0].token_ids[0] == dollar[0]


def test_bad_words_of_several_tokens_that_leave_allowed_tokens_no_way_on_are_refused():
    """allowed_token_ids "@" and "~" with bad words "@@" and "@~": after an "@" no allowed
    token is left, and the sampler took token 0 (EOS, not allowed: with ignore_eos the
    text went on past it, bad word and all). Refused, naming that output; bad words that
    leave a way on, or whose dead end no allowed output reaches, are not."""
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32", method="ar")
    at, tilde = (llm.encode(c, special=False)[0] for c in "@~")
    assert llm.encode("@@", special=False) == [at, at] and llm.encode("@~", special=False) == [at, tilde]
    with pytest.raises(UsageError, match="bad_words ban every one of allowed_token_ids after '@'") as e:
        llm.generate("x", SamplingParams(max_new_tokens=8, allowed_token_ids=[at, tilde], bad_words=["@@", "@~"],
                                         ignore_eos=True))
    assert e.value.param == "bad_words"
    for bad in (["@@"], ["@", "~@@", "~@~"]):  # a way on; "~@" unreachable, "@" being banned
        out = llm.generate("x", SamplingParams(max_new_tokens=8, allowed_token_ids=[at, tilde], bad_words=bad,
                                               ignore_eos=True))[0]
        assert len(out.token_ids) == 8 and set(out.token_ids) <= {at, tilde} and "@@" not in out.text


def test_a_cached_prefix_keeps_min_tokens_counted_from_the_whole_prompt():
    """With prefix caching a next turn prefills only its new tokens; min_tokens still
    counts from the end of the whole prompt, and the tokens equal an engine's without."""
    target, drafter = builtin_paths()
    cached = LLM(target, draft_model=drafter, method="ddtree", budget=16, device="cpu", dtype="float32",
                 enable_prefix_caching=True)
    fresh = LLM(target, draft_model=drafter, method="ddtree", budget=16, device="cpu", dtype="float32")
    first = cached.encode("def fib(n):")
    answer = cached.generate(first, SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    turn = first + answer.token_ids + cached.encode("\n\ndef")
    free = fresh.generate(turn, SamplingParams(max_new_tokens=16, ignore_eos=True))[0].token_ids
    params = SamplingParams(max_new_tokens=16, stop_token_ids=[free[1]], min_tokens=6, logit_bias={free[4]: -100.0})
    got = cached.generate(turn, params)[0]
    assert got.stats["cached_tokens"] > 0 and got.token_ids == fresh.generate(turn, params)[0].token_ids
    assert free[1] not in got.token_ids[:6] and got.token_ids[:1] == free[:1]


def reference_with_penalties(model, prompt: list[int], n: int, presence: float, frequency: float,
                             repetition: float) -> list[int]:
    """Greedy decoding with transformers' model and repetition processor (prompt and
    output tokens), and OpenAI's presence / frequency penalties over the output."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    ids, out = torch.tensor([prompt]), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(ids).logits[:, -1].double()
        logits = RepetitionPenaltyLogitsProcessor(repetition)(ids, logits)[0]
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).double()
        logits = logits - frequency * counts - presence * (counts > 0).double()
        out.append(int(logits.argmax()))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


@pytest.mark.parametrize("presence,frequency,repetition", [(1.5, 0.0, 1.0), (0.0, 1.2, 1.0), (0.0, 0.0, 1.5),
                                                           (0.5, 0.7, 1.3), (-1.0, -0.5, 0.8)])
def test_penalties_match_a_reference_loop(presence, frequency, repetition, hf_checkpoint, hf_model64):
    model = hf_model64("qwen3")
    llm = LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float64")
    prompt = ENGINE_PROMPTS[0]
    ids = llm.encode(prompt)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency, repetition_penalty=repetition)
    got = llm.generate(prompt, params)[0].token_ids
    assert got == reference_with_penalties(model, ids, 24, presence, frequency, repetition)
    plain = llm.generate(prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))[0].token_ids
    assert got != plain, "the penalties changed nothing"


def test_each_tree_node_gets_its_own_history():
    """Two siblings under one parent: the penalty of a token depends on the path above
    each node (its ancestors but the root, and itself), not on other branches."""
    V = 6
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=2.0)]
    sb = SamplingBatch.from_params(params, "cpu", V, [[5]], [set()])
    sb.extend_history(torch.tensor([[1]]), torch.tensor([1]))  # the output so far: token 1
    # root (anchor 1) -> a (token 2) -> c (token 2); root -> b (token 3)
    tokens = torch.tensor([[1, 2, 3, 2]])
    ancestors = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], dtype=torch.bool)
    logits = torch.full((1, 4, V), 1.0)
    from treeflash.engine.sampling import apply_controls
    got = apply_controls(logits, torch.arange(4)[None], sb, 0, (tokens, ancestors))[0]
    # counts per row (output 1 + the path): root {1}, a {1, 2}, b {1, 3}, c {1, 2, 2}; prompt {5}
    want = torch.full((4, V), 1.0)
    for row, counts in enumerate(({1: 1}, {1: 1, 2: 1}, {1: 1, 3: 1}, {1: 1, 2: 2})):
        want[row, 5] = 0.5
        for t, n in counts.items():
            want[row, t] = 1.0 / 2.0 - 0.5 * n - 1.0
    assert torch.allclose(got, want), got


def test_a_vocabulary_slice_gets_the_same_bias_and_penalties():
    """Under tensor parallelism each rank holds ids start..start + V': its slice of the
    biased, penalized logits (tree paths included) equals that slice of the whole."""
    from treeflash.engine.sampling import apply_controls
    gen = torch.Generator().manual_seed(0)
    B, T = 2, 5
    params = [SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.6,
                             logit_bias={2: 1.0, 9: -2.0}, min_tokens=2, max_new_tokens=8),
              SamplingParams(repetition_penalty=0.7, allowed_token_ids=[1, 4, 5, 8, 11])]
    sb = SamplingBatch.from_params(params, "cpu", V, [[3, 9, 9], [0, 11]], [{7}, {0}])
    sb.extend_history(torch.tensor([[4, 9, 4], [5, 6, 0]]), torch.tensor([3, 2]))
    tokens = torch.randint(0, V, (B, T), generator=gen)
    parents = torch.tensor([[0, 0, 1, 1, 3], [0, 0, 0, 2, 3]])
    ancestors = torch.eye(T, dtype=torch.bool).expand(B, T, T).clone()
    for b in range(B):
        for n in range(T):
            a = n
            while a:
                a = int(parents[b, a])
                ancestors[b, n, a] = True
    logits = torch.randn(B, T, V, generator=gen)
    positions = torch.tensor([[4, 5, 6, 6, 7], [2, 3, 3, 4, 5]])
    def law(x, start):
        return apply_controls(x, positions, sb, start, (tokens, ancestors))
    whole = law(logits, 0)
    for start in (0, 4, 8):
        assert torch.equal(law(logits[..., start:start + 4], start), whole[..., start:start + 4]), start
    assert torch.isinf(whole[1][:, [0, 2, 3]]).all() and not torch.isinf(whole[0]).all()


def test_a_vocabulary_slice_bans_the_same_bad_words():
    """Under tensor parallelism each rank bans only the bad words' last tokens in its own
    slice: its slice of the checked logits (tree paths included) equals that slice of the
    whole, also where a word ends in the first token of the next rank's slice."""
    from treeflash.engine.sampling import apply_controls
    params = [SamplingParams(bad_words=["x"]), SamplingParams(bad_words=["y"])]
    sb = SamplingBatch.from_params(params, "cpu", V, bad_sequences=[[[4], [6, 8]], [[3, 8], [11]]])
    sb.extend_history(torch.tensor([[6], [3]]), torch.tensor([1, 1]))
    tokens = torch.tensor([[6, 5, 6], [3, 8, 3]])  # the root (the last committed token), then two children
    ancestors = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(2, 3, 3)
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(0))
    positions = torch.tensor([[4, 5, 5], [4, 5, 5]])
    whole = apply_controls(logits, positions, sb, 0, (tokens, ancestors))
    for start in (0, 4, 8):
        part = apply_controls(logits[..., start:start + 4], positions, sb, start, (tokens, ancestors))
        assert torch.equal(part, whole[..., start:start + 4]), start
    assert torch.isinf(whole[0, :, 4]).all() and torch.isinf(whole[0, [0, 2], 8]).all() and whole[0, 1, 8] > -1e9
    assert torch.isinf(whole[1, [0, 2], 8]).all() and whole[1, 1, 8] > -1e9 and torch.isinf(whole[1, :, 11]).all()


def test_a_one_node_tree_gets_its_own_history():
    """The smallest tree (the root and one node: DDTree of budget 1, DFlash with blocks of 2):
    the node's row is penalized and bad-word-checked with its own token in the output,
    exactly as AR's next step after committing that token."""
    from treeflash.engine.sampling import apply_controls
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=2.0, bad_words=["x"])]
    sb, ar = (SamplingBatch.from_params(params, "cpu", V, [[5]], [set()], bad_sequences=[[[2, 3]]]) for _ in range(2))
    for batch in (sb, ar):
        batch.extend_history(torch.tensor([[1]]), torch.tensor([1]))  # the output so far: token 1 (the anchor)
    logits = torch.randn(1, 2, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens, ancestors = torch.tensor([[1, 2]]), torch.tensor([[[1, 0], [1, 1]]], dtype=torch.bool)
    got = apply_controls(logits, torch.tensor([[3, 4]]), sb, 0, (tokens, ancestors))
    assert torch.equal(got[:, :1], apply_controls(logits[:, :1], torch.tensor([[3]]), ar, 0))
    ar.extend_history(torch.tensor([[2]]), torch.tensor([1]))  # AR commits the node's token 2
    assert torch.equal(got[:, 1:], apply_controls(logits[:, 1:], torch.tensor([[4]]), ar, 0))
    assert got[0, 1, 3] == float("-inf") and got[0, 0, 3] > float("-inf")  # "2 3" would complete below the node


def test_min_tokens_holds_back_a_stop_token_that_a_tree_node_holds():
    """A node may hold a stop token (the draft takes it where min_tokens no longer holds it
    back): with penalties, the columns of the round's tokens are recomputed with each node's
    history, and min_tokens still holds that column back at every node whose sample comes
    before prompt + min_tokens. Each row is AR's step after committing the node's path."""
    from treeflash.engine.sampling import apply_controls
    stop, prompt = 7, [5]
    params = [SamplingParams(presence_penalty=1.0, repetition_penalty=2.0, min_tokens=3, max_new_tokens=8)]
    sb, ar = (SamplingBatch.from_params(params, "cpu", V, [prompt], [{stop}]) for _ in range(2))
    for batch in (sb, ar):
        batch.extend_history(torch.tensor([[1]]), torch.tensor([1]))  # the first new token: the anchor 1
    # a chain: root (anchor 1) -> stop -> 2, sampling the tokens at positions 2, 3, 4
    tokens, ancestors = torch.tensor([[1, stop, 2]]), torch.ones(1, 3, 3, dtype=torch.bool).tril()
    positions = torch.arange(2, 5)[None]
    logits = torch.randn(1, 3, V, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got = apply_controls(logits, positions, sb, 0, (tokens, ancestors))
    held = positions[0] < len(prompt) + params[0].min_tokens
    assert held.tolist() == [True, True, False] and torch.equal(torch.isinf(got[0, :, stop]), held)
    for row in range(3):
        assert torch.equal(got[:, row], apply_controls(logits[:, row:row + 1], positions[:, row:row + 1], ar, 0)[:, 0])
        ar.extend_history(tokens[:, row + 1:row + 2], torch.tensor([1]))  # AR commits the next node's token


@pytest.mark.parametrize("kind", ["warm", "plain"])
def test_penalized_streams_equal_ar(kind, spec_target, spec_drafter, ar_reference):
    """Greedy, sampled and filtered requests with penalties (and one with a bias too):
    every method gives AR's tokens, which the penalties changed."""
    target, drafter = spec_target("llama", kind), spec_drafter("llama", kind, 8)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.4),
              SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, top_k=30, seed=43,
                             repetition_penalty=1.4, logit_bias={9: 1.0})]
    plain = [SamplingParams(max_new_tokens=24, ignore_eos=True),
             SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, top_k=30, seed=43)]
    refs = [ar_reference(target, p, sp).token_ids for p, sp in zip(PROMPTS, params)]
    assert refs != [ar_reference(target, p, sp).token_ids for p, sp in zip(PROMPTS, plain)]
    taus = []
    for method, budget in METHODS:
        outs = spec_llm(target, drafter, method, budget).generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == refs, f"{kind}: {method} N={budget} differs from AR"
        taus.append(max(o.stats["tau"] for o in outs))
    assert kind == "plain" or min(taus) > 1.1, f"no draft accepted: {taus}"


@pytest.mark.parametrize("kw,message", [
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),  # the value named
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be in"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be in"),
    # past float32's range it would be inf there: 0 * inf is NaN, and NaN wins an argmax
    (dict(repetition_penalty=1e39), "repetition_penalty must be in"),
    (dict(repetition_penalty=1e-39), "repetition_penalty must be in"),
])
def test_bad_penalties_are_refused(kw, message):
    with pytest.raises(UsageError, match=message):
        SamplingParams(**kw)


def test_a_kept_state_starts_each_request_with_an_empty_history(monkeypatch):
    """A graphed engine keeps its batch state (and the output counts in it) from request
    to request: each request's first token must see an empty output, not the last one's."""
    target, drafter = builtin_paths()
    llm = cpu_graphs(monkeypatch, LLM(target, draft_model=drafter, method="ddtree", budget=16, device="cpu",
                                       dtype="float32", enable_prefix_caching=True))
    fresh = LLM(target, method="ar", device="cpu", dtype="float32")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0,
                            repetition_penalty=2.0)
    for prompt in ("def fib(n):", "class Stack:", " return x"):
        assert llm.generate(prompt, params)[0].token_ids == fresh.generate(prompt, params)[0].token_ids, prompt
    assert llm.graph_captures > 0


def test_a_prefill_checks_bad_words_against_an_empty_output():
    """A prefill in pieces (a prefix-cached prompt's long rest) samples a token after each
    piece: the request's first token is then checked against no output, not against the
    token an earlier piece sampled (which would ban a word's last token wrongly)."""
    from treeflash.engine.sampling import apply_controls
    sb = SamplingBatch.from_params([SamplingParams(bad_words=["x"])], "cpu", V, bad_sequences=[[[3, 4]]])
    sb.extend_history(torch.tensor([[3]]), torch.tensor([1]))  # an earlier piece's sampled token
    logits = torch.zeros(1, 1, V)
    assert apply_controls(logits, torch.tensor([[9]]), sb, 0)[0, 0, 4] == float("-inf")
    sb.clear_history()
    assert torch.equal(apply_controls(logits, torch.tensor([[9]]), sb, 0), logits)


@pytest.mark.parametrize("min_tokens,want", [(0, [130, 105]), (1, [130, 105]), (2, [130, 105] * 2),
                                             (3, [130, 105] * 2)])
def test_a_stop_string_whose_bytes_span_tokens(min_tokens, want):
    """"é" is two byte tokens (130, 105): a stop string that the token after min_tokens
    completes counts, even when the first of its bytes came before; one that the first
    min_tokens tokens complete does not. The stream agrees with the engine's text."""
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32")
    assert llm.tokenizer.decode([130, 105]) == "é"
    params = SamplingParams(max_new_tokens=24, allowed_token_ids=[130, 105], temperature=1.0, seed=1, stop=["é"],
                            min_tokens=min_tokens)
    out = llm.generate("x", params)[0]
    assert out.token_ids == want and out.finish_reason == "stop" and out.text == "é" * (len(want) // 2 - 1)
    stream = TextStream(llm.tokenizer, ["é"], llm.eos_token_ids, context=llm.encode("x"), min_tokens=min_tokens)
    assert "".join(stream.push([t]) for t in out.token_ids) + stream.finish(out.text) == out.text


def test_a_stop_string_is_matched_against_whole_characters_only():
    """U+FFFD as a stop string does not fire on the first byte of "é" (the next token
    completes it), and a round decodes a window of the text, not the whole output once
    per stop string: the decoded tokens grow with the output, not with its square."""
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32", method="ar")
    params = SamplingParams(max_new_tokens=4, allowed_token_ids=[130, 105], temperature=1.0, seed=1)
    out = llm.generate("x", params)[0]
    assert out.token_ids == [130, 105, 130, 105] and out.text == "éé"
    cut = llm.generate("x", SamplingParams(**{**params.__dict__, "stop": ["\ufffd"]}))[0]
    assert cut.token_ids == out.token_ids and cut.text == out.text and cut.finish_reason == "length"

    real, decoded = llm.tokenizer.decode, []
    llm.tokenizer.decode = lambda ids, *a, **kw: decoded.append(len(ids)) or real(ids, *a, **kw)
    for n in (100, 200):
        decoded.clear()
        stops = [f"never{i:02d}" for i in range(64)]
        out = llm.generate("def f(x):", SamplingParams(max_new_tokens=n, ignore_eos=True, stop=stops))[0]
        assert len(out.token_ids) == n
        work = sum(decoded)
        assert work < 200 * n, (n, work)  # the whole text once per stop string: ~64 n^2 / 2 tokens


def test_stop_strings_cut_where_the_whole_text_first_holds_one():
    """The engine looks for stop strings in a window of each round's text; over random
    rounds it cuts after the first token whose text (whole characters, past min_tokens')
    holds one, as a search of the whole text at every token would."""
    import random
    from treeflash.tokenizer import stop_cut
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32", method="ar")
    tok = llm.tokenizer
    pieces = [[819], [223], [201], [130, 105], [444, 249, 225], [90], [339], [857, 11], [130], [249]]
    rng = random.Random(0)
    cuts = 0
    for trial in range(300):
        ids = [t for _ in range(rng.randint(1, 14)) for t in rng.choice(pieces)]
        prompt = [t for _ in range(rng.randint(1, 3)) for t in rng.choice(pieces)]
        text = tok.decode_continuation(ids, prompt)
        if not text:  # all of it part of one character
            continue
        stops = []
        for _ in range(rng.randint(1, 3)):
            i = rng.randrange(len(text))
            stops.append(text[i:i + rng.randint(1, 6)] if rng.random() < 0.8 else "zz")
        p = SamplingParams(stop=stops, min_tokens=rng.choice([0, 0, 1, 3]))

        def whole(k):  # less a character the k tokens only begin
            return tok.decode_continuation(ids[:k], prompt)
        floor = tok.min_tokens_floor(ids, p.min_tokens, prompt)
        want = next((k for k in range(p.min_tokens + 1, len(ids) + 1)
                     if stop_cut(whole(k), stops, False, ends_after=floor)), len(ids))
        out, pos = [], 0
        while pos < len(ids):
            n = rng.randint(1, 5)
            before = len(out)
            out += ids[pos:pos + n]
            pos += n
            if llm.rules.cut_at_stop_string(out, before, p, prompt):
                break
        assert out == ids[:want], (trial, ids, prompt, stops, p.min_tokens)
        cuts += want < len(ids)
    assert cuts > 100


def test_a_long_stop_string_of_wide_characters_is_found_however_far_back_it_begins():
    """A round that completes a stop string cuts there however far back the stop string
    begins: the window of text searched reaches past the broken character it may start
    in ("你" and "😀" as their byte tokens here, up to 3 of them orphans at its start)."""
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32", method="ar")
    wide, a, x = {"你": [163, 124, 257], "😀": [175, 256, 249, 225]}, llm.encode("a"), llm.encode("x")
    assert all(llm.tokenizer.decode(ids) == c for c, ids in wide.items())
    for c, n, lead, stop in (("你", 6, 2, "你" * 5 + "aax"), ("你", 11, 0, "你" * 11 + "x"),
                             ("😀", 4, 1, "😀" * 4 + "ax")):
        out = a * 40 + wide[c] * n + a * lead + x
        assert llm.tokenizer.decode(out).endswith(stop)
        assert llm.rules.cut_at_stop_string(out, len(out) - 1, SamplingParams(stop=[stop]), llm.encode("q")), stop


def test_the_bad_words_check_of_a_structured_output_matches_a_walk_of_its_texts():
    """`check` against a brute-force walk of small random automata: every token sequence
    the constraint, the end tokens (no longer text; they end the text where it matches)
    and the bad words allow, up to where the state and the output's last tokens repeat,
    and whether each can still be finished."""
    import numpy as np
    from treeflash.structured.grammar import TokenAutomaton
    rng = np.random.default_rng(0)
    refused = 0
    for trial in range(400):
        S, V = int(rng.integers(2, 6)), int(rng.integers(2, 6))
        nxt = np.where(rng.random((S, V)) < 0.5, rng.integers(0, S, (S, V)), -1).astype(np.int32)
        accepting = rng.random(S) < 0.4
        words = [tuple(int(t) for t in rng.integers(0, V, int(rng.integers(1, 4)))) for _ in range(int(rng.integers(1, 4)))]
        ends = [int(t) for t in rng.choice(V, int(rng.integers(0, 3)), replace=False)] if trial % 2 else []
        K = max(map(len, words)) - 1

        def pruned(table):  # never into a state that cannot finish (as token_automaton and with_ends)
            live = accepting.copy()
            while grown := {a for a in range(S) for t in range(V) if not live[a] and live[table[a, t]] and
                            table[a, t] >= 0}:
                live[list(grown)] = True
            table[(table >= 0) & ~live[np.maximum(table, 0)]] = -1
            return table, live
        nxt, live = pruned(nxt)
        if not live[0]:
            continue
        table = nxt.copy()  # the request's: an end token stays put where the text matches
        table[:, ends] = np.where(accepting, np.arange(S), -1)[:, None]
        table, live = pruned(table)

        def moves(node):
            s, tail = node
            for t in range(V):
                if table[s, t] >= 0 and not any(w[-1] == t and (tail + (t,))[-len(w):] == w
                                                and len(tail) + 1 >= len(w) for w in words):
                    yield int(table[s, t]), (tail + (t,))[-K:] if K else ()
        seen, todo, edges = {(0, ())}, [(0, ())], set()
        while todo:
            node = todo.pop()
            for n in moves(node):
                edges.add((node, n))
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        finishing = {n for n in seen if accepting[n[0]]}
        while grown := {a for a, b in edges if b in finishing and a not in finishing}:
            finishing |= grown
        stuck = not live[0] or finishing != seen
        try:
            TokenAutomaton(nxt, accepting).check(ends, [list(w) for w in words])
            assert not stuck, (trial, nxt, accepting, words, ends)
        except UsageError:
            assert stuck, (trial, nxt, accepting, words, ends)
            refused += 1
    assert 40 < refused < 360  # both answers are exercised


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_a_replacement_character_stop_string_inside_min_tokens_text_does_not_count(method):
    """Bytes no token can finish decode to U+FFFD for good; a stop string "\\ufffd" in the
    text of the first min_tokens tokens does not count, in the check while generating and
    in the final text alike (the final text was cut to "" while the request ran to its
    length: the two read the min_tokens floor differently)."""
    target, drafter = builtin_paths()
    llm = LLM(target, draft_model=drafter if method != "ar" else None, device="cpu", dtype="float32",
              method=method)
    lead = next(i for i in range(llm.config.vocab_size) if llm.tokenizer.token_bytes(i) == b"\xf3")
    out = llm.generate("x = ", SamplingParams(max_new_tokens=8, stop=["\ufffd"], allowed_token_ids=[lead],
                                              min_tokens=8))[0]
    assert out.token_ids == [lead] * 8 and out.finish_reason == "length" and out.stop_reason is None
    assert out.text == "\ufffd" * 7  # the last lead byte, which the length cut left unfinished, is left out
    out = llm.generate("x = ", SamplingParams(max_new_tokens=8, stop=["\ufffd"], allowed_token_ids=[lead],
                                              min_tokens=2))[0]
    # the second character is whole once the third byte came: the stop string ends there, past the floor
    assert out.token_ids == [lead] * 3 and out.finish_reason == "stop" and out.stop_reason == "\ufffd"
    assert out.text == "\ufffd"


def test_a_skipped_special_token_inside_a_character_leaves_it_whole_in_the_text_and_the_stream():
    """With skip_special_tokens a special token between the bytes of "é" adds none: the
    bytes around it make "é", in the engine's text as in the stream (which leaves special
    tokens out), even where a stray byte before puts the text on the token-by-token path."""
    from treeflash.tokenizer import Tokenizer
    tok = Tokenizer(builtin_paths()[0])
    stray = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"\x80")
    special = min(tok.special_ids - set(tok.eos_token_ids))
    ids = [stray, 130, special, 105]  # 130, 105: the two bytes of "é"
    assert tok.decode_continuation(ids) == "\ufffdé"
    stream = TextStream(tok)
    assert "".join(stream.push([t]) for t in ids) == "\ufffdé"


def test_a_continuation_after_a_prompt_that_ends_in_part_of_a_character_keeps_its_whole_characters(tmp_path):
    """A prompt that ends in the first byte of "你" (a byte-fallback run the output does not
    finish): the output's "好" is whole, in its text and its stream, not turned into U+FFFD
    by the run of bytes it would join were the prompt's last token decoded with it."""
    from conftest import write_sentencepiece_tokenizer

    from treeflash.tokenizer import Tokenizer
    write_sentencepiece_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    prompt = tok.encode(" ab", False) + tok.encode("你", False)[1:2]
    hao = tok.encode("好", False)[1:]  # its three byte tokens, without the leading space
    assert len(hao) == 3 and tok.decode(hao) == "好"
    assert tok.decode_continuation(hao, prompt) == "好"
    stream = TextStream(tok, context=prompt)
    assert "".join(stream.push([t]) for t in hao) == "好"


def _straddling_tokenizer(folder):
    """A byte-level BPE whose tokens cross characters, as real vocabularies' do in CJK text:
    "こ" (e3 81 93) and "ん" (e3 82 93) written as [e3 81] [93 e3 82] [93]. Returns the
    Tokenizer and those three ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from treeflash.tokenizer import Tokenizer as TreeflashTokenizer
    from treeflash.tokenizer import _byte_level_chars
    spell = {b: c for c, b in _byte_level_chars().items()}
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    pieces = ["".join(spell[b] for b in raw) for raw in (b"\xe3\x81", b"\x93\xe3\x82", b"\x93")]
    vocab.update({p: len(vocab) + i for i, p in enumerate(pieces[:2])})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return TreeflashTokenizer(folder), [vocab[p] for p in pieces]


def test_a_token_that_ends_one_character_and_begins_the_next_gives_the_first_whole(tmp_path):
    """Byte-level BPE merges bytes across characters: the token [93 e3 82] ends "こ" and
    begins "ん". The text up to it is "こ" (the stream's delta, and the final text of an
    output cut there), not U+FFFD for both; the next token adds "ん", and a stop string
    across them is found."""
    tok, (head, straddle, tail) = _straddling_tokenizer(tmp_path)
    ids = [head, straddle, straddle, tail]
    assert tok.decode(ids) == "こんん"
    stream = TextStream(tok)
    assert [stream.push([t]) for t in ids] == ["", "こ", "ん", "ん"]
    assert tok.decode_continuation(ids[:2]) == "こ" and tok.decode_continuation(ids[:3]) == "こん"
    assert tok.decode_continuation(ids + [head]) == "こんん"  # an unfinished character at the end is left out
    assert tok.decode_continuation([tail] + ids[:3]) == "\ufffdこん"  # a stray byte stays U+FFFD
    stopped = TextStream(tok, stop=["んん"])
    assert "".join(stopped.push([t]) for t in ids) == "こ"


def test_a_non_special_added_token_is_streamed_with_skip_special_tokens(tmp_path):
    """Added tokens that tokenizer_config.json declares not special (Qwen3's <think>,
    <tool_call>) stay in the text with skip_special_tokens, in the stream as in the
    engine's text; only special ones are left out of both."""
    from treeflash.checkpoints import write_tiny_tokenizer
    from treeflash.tokenizer import Tokenizer
    size = write_tiny_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {str(size): {"content": "<think>", "special": False}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(tmp_path)
    ids = tok.encode("<think>def f<|pad|>", special=False)
    assert size in ids and tok.decode_continuation(ids) == "<think>def f"
    stream = TextStream(tok)
    assert "".join(stream.push([t]) for t in ids) == "<think>def f"
