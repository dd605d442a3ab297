"""Logprobs: each generated token's log-probability under the target (log-softmax of the
raw logits, as vLLM reports them) and its most likely alternatives.

Speculative rounds read them from the verify forward at the accepted path's nodes:
they must equal what the target computes over the final token sequence in one
forward (float64), for AR, DFlash and DDTree, greedy and sampled, and asking for
them must not change a single token.
"""
from __future__ import annotations

import pytest
import torch

from treeflash import LLM, SamplingParams, UsageError
from treeflash.engine.options import builtin_paths
from treeflash.sampling_params import MAX_LOGPROBS
from treeflash.layers.attention import AttentionInputs

METHODS = [("ar", None), ("dflash", None), ("ddtree", 8)]
PROMPTS = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n    "]


@pytest.fixture(scope="module")
def pair():
    """The built-in pair: a drafter that gets most of its block accepted."""
    return builtin_paths()


@pytest.fixture(scope="module")
def oracle(pair):
    """oracle(prompt, tokens) -> the target's log-softmax [len(tokens), V] at the
    positions that produced `tokens`: one causal forward over the final sequence
    (float64), not the rounds that generated it. (The target itself equals transformers'
    model elsewhere in the suite; transformers is not the oracle here because it
    computes RoPE's angles in float32, off by ~1e-4 on these peaked logits.)"""
    llm = LLM(pair[0], method="ar", device="cpu", dtype="float64")
    model = llm.target

    def get(prompt, tokens):
        prompt = llm.encode(prompt)
        ids = prompt + list(tokens)
        positions = torch.arange(len(ids))[None]
        cache = model.new_cache(1, len(ids), torch.device("cpu"))
        with torch.inference_mode():
            h, _ = model(torch.tensor([ids]), AttentionInputs.causal(positions, kv_len=len(ids)), cache, [])
            return torch.log_softmax(model.logits(h)[0, len(prompt) - 1:-1], -1)

    return get


def check_against_oracle(out, prompt, k, oracle):
    want = oracle(prompt, out.token_ids)
    assert len(out.logprobs) == len(out.token_ids)
    for i, (t, e) in enumerate(zip(out.token_ids, out.logprobs)):
        assert e.token_id == t
        assert e.logprob == pytest.approx(want[i, t].item(), abs=1e-7)
        top_vals, top_ids = want[i].topk(k)
        assert [tid for tid, _ in e.top] == top_ids.tolist()
        assert [lp for _, lp in e.top] == pytest.approx(top_vals.tolist(), abs=1e-7)
        assert e.rank == int((want[i] >= want[i, t]).sum())  # its place in the vocabulary (vLLM's rank)


@pytest.mark.parametrize("method,budget", METHODS)
def test_logprobs_are_the_targets_and_change_no_token(pair, oracle, method, budget):
    """A batch mixing a greedy and a filtered sampled request (different k, one without
    logprobs): the tokens are those without logprobs, and each reported value is the
    target's log-softmax at that position."""
    target, drafter = pair
    llm = LLM(target, draft_model=None if method == "ar" else drafter, method=method, budget=budget,
              device="cpu", dtype="float64")
    base = [SamplingParams(max_new_tokens=24, ignore_eos=True),
            SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=0.9, top_k=20, top_p=0.9, seed=3)]
    want = llm.generate(PROMPTS, base)
    asked = [SamplingParams(**{**base[0].__dict__, "logprobs": 5}), SamplingParams(**{**base[1].__dict__,
                                                                                     "logprobs": 2})]
    outs = llm.generate(PROMPTS, asked)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    for prompt, out, p in zip(PROMPTS, outs, asked):
        check_against_oracle(out, prompt, p.logprobs, oracle)
    assert any(e.rank > 1 for e in outs[1].logprobs), "the sampled request took only argmaxes: ranks not tested"
    if method != "ar":
        assert outs[0].stats["tau"] > 1.5 and outs[1].stats["tau"] > 1  # multi-token rounds
    mixed = llm.generate(PROMPTS, [asked[0], base[1]])
    assert mixed[0].logprobs == outs[0].logprobs and mixed[1].logprobs is None
    assert mixed[1].token_ids == want[1].token_ids


def test_logprobs_follow_the_tokens_kept_and_stream_with_them(pair, oracle):
    """A stop string or the token limit cuts the tokens mid-round: the logprobs are cut
    alike. Streaming hands each token's logprob with the token; k = 0 gives the
    chosen token's only."""
    target, drafter = pair
    llm = LLM(target, draft_model=drafter, method="ddtree", budget=8, device="cpu", dtype="float64")
    full = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=0))[0]
    assert all(e.top == [] for e in full.logprobs)
    check_against_oracle(full, PROMPTS[0], 0, oracle)
    stop = llm.tokenizer.decode(full.token_ids[5:7])
    for p in (SamplingParams(max_new_tokens=30, ignore_eos=True, logprobs=1, stop=[stop]),
              SamplingParams(max_new_tokens=11, ignore_eos=True, logprobs=1)):
        seen_ids, seen = [], []
        out = llm.generate(PROMPTS[0], p, on_tokens=lambda _, ids, lps: (seen_ids.extend(ids), seen.extend(lps)))[0]
        assert len(out.token_ids) < 30 and out.token_ids == full.token_ids[:len(out.token_ids)]
        assert out.logprobs == seen and seen_ids == out.token_ids
        assert [e.logprob for e in out.logprobs] == [e.logprob for e in full.logprobs[:len(out.token_ids)]]
    # a stop token (as EOS) ends it in the middle of a round; its logprob is the last one
    end = full.token_ids[9]
    first = full.token_ids.index(end)
    out = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=30, logprobs=1, stop_token_ids=[end]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:first + 1]
    assert [e.token_id for e in out.logprobs] == out.token_ids
    # a callback written for two arguments still gets (i, ids)
    seen_ids = []
    out = llm.generate(PROMPTS[0], SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=2),
                       on_tokens=lambda i, ids: seen_ids.extend(ids))[0]
    assert seen_ids == out.token_ids and len(out.logprobs) == 5


def test_prompt_logprobs_are_the_targets(pair, oracle, monkeypatch):
    """prompt_logprobs: each prompt token's log-probability given the ones before it
    (None for the first), its rank and the k most likely alternatives (none for k = 0),
    for the requests that ask only, computed a few positions at a time (3 here: chunks
    cross from one request's prompt to the next); a one-token prompt has only its None;
    the generated tokens do not change."""
    import treeflash.engine.round as round_module
    monkeypatch.setattr(round_module, "PROMPT_LOGPROB_ROWS", 3)
    target, drafter = pair
    llm = LLM(target, draft_model=drafter, method="ddtree", budget=8, device="cpu", dtype="float64")
    prompts, ks = [PROMPTS[1], "x", PROMPTS[0], PROMPTS[1], PROMPTS[0]], [3, 2, 1, None, 0]
    base = SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = llm.generate(prompts, base)
    outs = llm.generate(prompts, [SamplingParams(**{**base.__dict__, "prompt_logprobs": k}) for k in ks])
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    for prompt, out, k in zip(prompts, outs, ks):
        if k is None:
            continue
        ids = llm.encode(prompt)
        got = out.prompt_logprobs
        assert got[0] is None and [e.token_id for e in got[1:]] == ids[1:]  # nothing predicts the first, as vLLM
        ref = oracle(llm.tokenizer.decode(ids[:1]), ids[1:])  # position i predicts ids[i + 1]
        for i, e in enumerate(got[1:]):
            assert e.logprob == pytest.approx(ref[i, ids[i + 1]].item(), abs=1e-7)
            assert e.rank == int((ref[i] >= ref[i, ids[i + 1]]).sum())  # its place in the vocabulary
            top = ref[i].topk(k)
            assert [t for t, _ in e.top] == top.indices.tolist()
            assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-7)
    assert len(outs[0].prompt_logprobs) > 7 and len(outs[1].prompt_logprobs) == 1
    assert len(outs[2].prompt_logprobs) > 2 and outs[3].prompt_logprobs is None
    assert len(outs[4].prompt_logprobs) > 2 and all(e.top == [] for e in outs[4].prompt_logprobs[1:])


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, True, 2.0, "3"])
def test_bad_logprobs_are_refused(bad):
    with pytest.raises(UsageError, match="logprobs must be an integer"):
        SamplingParams(logprobs=bad).validate()
