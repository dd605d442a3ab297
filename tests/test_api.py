"""Issue 2, point 4: the Python API.

`LLM(model, device="cpu", dtype=...)` and `generate(prompts, SamplingParams(...))`
return text, token_ids and stats; max_new_tokens, EOS, stop strings and the context
limit end generation; a list of SamplingParams gives each prompt its own; bad
arguments raise `UsageError` before any work.
"""
from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ENGINE_PROMPTS

from treeflash import LLM, ContextLengthError, GenerationOutput, SamplingParams, TreeflashError, UsageError
from treeflash.checkpoints import write_random_target
from treeflash.engine.options import builtin_paths

STATS_KEYS = {"method", "new_tokens", "rounds", "tau", "seconds", "tokens_per_s"}


@pytest.fixture(scope="module")
def llm(hf_checkpoint):
    return LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float32")


def test_generate_returns_text_token_ids_and_stats(llm):
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert len(outs) == len(ENGINE_PROMPTS)
    for out in outs:
        assert isinstance(out, GenerationOutput)
        assert len(out.token_ids) == 10 and all(isinstance(t, int) for t in out.token_ids)
        assert out.text == llm.tokenizer.decode(out.token_ids)
        assert out.finish_reason == "length"
        assert STATS_KEYS <= set(out.stats)
        s = out.stats
        assert s["method"] == "ar" and s["new_tokens"] == 10
        assert s["rounds"] == 10 and s["tau"] == pytest.approx(1.0)   # AR: one token per round
        assert s["seconds"] > 0 and s["tokens_per_s"] > 0
    # the batch gives each prompt what it gets alone
    for prompt, out in zip(ENGINE_PROMPTS, outs):
        assert llm.generate(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))[0].token_ids \
            == out.token_ids


def test_a_single_prompt_and_token_id_prompts(llm):
    p = SamplingParams(max_new_tokens=6, ignore_eos=True)
    by_text = llm.generate(ENGINE_PROMPTS[2], p)
    assert len(by_text) == 1
    ids = llm.tokenizer.encode(ENGINE_PROMPTS[2])
    assert llm.generate(ids, p)[0].token_ids == by_text[0].token_ids        # one prompt as ids
    assert llm.generate([ids, ids], p)[1].token_ids == by_text[0].token_ids  # a batch of id lists
    assert llm.generate([], p) == []
    as_numpy = [np.int64(t) for t in ids]  # as a NumPy tokenizer gives them, alone or in a batch
    assert [o.token_ids for o in llm.generate(as_numpy, p)] == [by_text[0].token_ids]
    assert llm.generate([as_numpy], p)[0].token_ids == by_text[0].token_ids


def test_numpy_numbers_are_sampling_parameters_as_pythons():
    """vLLM takes NumPy scalars where it takes numbers (values read from an array or a
    sweep): they become Python's, so checks, copies and TP workers see plain values;
    a NumPy boolean or a string is still no number."""
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(20), top_p=np.float64(0.9), seed=np.int64(3),
                       max_tokens=np.int32(7), stop_token_ids=[np.int64(5)], logit_bias={np.int64(4): np.float32(1)},
                       logprobs=np.int8(2), allowed_token_ids=[np.uint16(9), 4])
    assert p == SamplingParams(temperature=0.5, top_k=20, top_p=float(np.float64(0.9)), seed=3, max_tokens=7,
                               stop_token_ids=[5], logit_bias={4: 1.0}, logprobs=2, allowed_token_ids=[9, 4])
    assert [type(v) for v in (p.temperature, p.top_k, p.seed, p.max_new_tokens, p.stop_token_ids[0])] == \
        [float, int, int, int, int]
    for bad in (dict(temperature=np.bool_(True)), dict(top_k="20"), dict(seed=np.float64(3.0))):
        with pytest.raises(UsageError, match="invalid sampling parameters"):
            SamplingParams(**bad)


@pytest.mark.parametrize("n", [1, 7])
def test_max_new_tokens_is_respected(llm, n):
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
    assert len(out.token_ids) == n and out.stats["new_tokens"] == n and out.finish_reason == "length"
    # vLLM's name for it: code written for vLLM runs as it is
    assert llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_tokens=n, ignore_eos=True))[0].token_ids == out.token_ids
    with pytest.raises(UsageError, match="max_tokens or max_new_tokens, not both"):
        SamplingParams(max_tokens=n, max_new_tokens=n + 1)
    for bad in (None, 0):  # named as given (vLLM's None, "as many as fit", is not taken)
        with pytest.raises(UsageError, match="max_tokens must be an integer >= 1"):
            SamplingParams(max_tokens=bad)


def test_vllm_prompt_dicts_and_n_1_are_taken(llm):
    """vLLM's scripts pass {"prompt": text} / {"prompt_token_ids": ids} (its TextPrompt and
    TokensPrompt) and often spell out n=1: the same requests here. n > 1 and dicts with
    other keys (multi-modal data) are refused in one line, not dropped."""
    p = SamplingParams(n=1, max_new_tokens=4, ignore_eos=True)
    ids = llm.encode(ENGINE_PROMPTS[0])
    want = llm.generate(ENGINE_PROMPTS[0], p)[0].token_ids
    got = llm.generate([{"prompt": ENGINE_PROMPTS[0]}, {"prompt_token_ids": ids}], p)
    assert [o.token_ids for o in got] == [want, want]
    assert llm.generate({"prompt_token_ids": ids}, p)[0].token_ids == want
    for bad in ({"prompt": "a", "multi_modal_data": {}}, {}, {"text": "a"}):
        with pytest.raises(UsageError, match="a prompt dict holds one key"):
            llm.generate([bad], p)
    for bad in ({"prompt": ids}, {"prompt_token_ids": ENGINE_PROMPTS[0]}):  # each key's own kind, as vLLM's
        with pytest.raises(UsageError, match="'prompt' is text and its 'prompt_token_ids' a list of token ids"):
            llm.generate(bad, p)
    for n in (2, 0, True, "1"):
        with pytest.raises(UsageError, match="n must be 1, one output per prompt"):
            SamplingParams(n=n)


def test_choices_that_differ_only_in_seed_are_checked_once(llm, monkeypatch):
    """The server's n choices are one request's parameters with seeds seed + j: checked
    (bad words tokenized, a long allowed_token_ids walked) once, not n times on the
    engine's thread; parameters that differ otherwise are each checked."""
    checked = []
    real = llm.check_sampling
    monkeypatch.setattr(llm, "check_sampling", lambda p: checked.append(p) or real(p))
    p = SamplingParams(temperature=1.0, seed=5, bad_words=["if"], allowed_token_ids=list(range(200)),
                       max_new_tokens=2)
    llm.generate(["a"] * 8, [p.with_seed(5 + j) for j in range(8)])
    assert len(checked) == 1
    checked.clear()
    llm.generate(["a"] * 3, [p, SamplingParams(**{**p.__dict__, "bad_words": ["else"]}), p.with_seed(9)])
    assert len(checked) == 3


def test_each_requests_parameters_are_checked_against_the_model_whatever_comes_before(llm):
    """Parameters that differ from the request before by more than the seed are checked
    on their own: a logit bias for a token past the vocabulary in a later request is
    refused (UsageError, before any work), though the first request is fine."""
    vocab = llm.config.vocab_size
    p = SamplingParams(temperature=1.0, seed=5, max_new_tokens=2, logit_bias={3: 1.0})
    for bad in (replace(p, logit_bias={vocab: 1.0}), replace(p, seed=6, logit_bias={vocab: 1.0})):
        with pytest.raises(UsageError, match=f"{vocab}"):
            llm.generate(["a", "a"], [p, bad])
    assert llm.rank_stats()[0]["cache_bytes"] == 0 and len(llm.generate(["a", "a"], [p, p])) == 2


def test_a_seed_set_after_construction_is_checked_in_a_list_too(llm):
    """Parameters that differ from the ones checked before only in their seed skip the
    full check, not the seed's: a seed set since construction is refused in one line
    (it was a torch error, or a 2^70 overflow), and -1 is vLLM's "no seed" (it was taken as
    the seed -1, so unseeded requests sampled alike)."""
    p = SamplingParams(temperature=1.0, seed=1, max_new_tokens=6, ignore_eos=True)
    for bad in (2 ** 70, "x", -5, 1.5, True):
        q = copy.copy(p)
        q.seed = bad
        with pytest.raises(UsageError, match="seed must be an integer in"):
            llm.generate(["a", "a"], [p, q])
    unseeded = []
    for _ in range(2):
        q = copy.copy(p)
        q.seed = -1
        unseeded.append(q)
    outs = llm.generate(["a"] * 3, [p, *unseeded])
    assert unseeded[0].seed is None and outs[1].token_ids != outs[2].token_ids


def test_an_engine_seed_repeats_unseeded_sampling(hf_checkpoint):
    """vLLM's LLM(seed=...): sampled requests that give no seed draw theirs from it, so a
    script's runs repeat; without it each run draws fresh ones."""
    path = hf_checkpoint("qwen3").path
    p = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    runs = [LLM(path, device="cpu", dtype="float32", seed=7).generate(ENGINE_PROMPTS, p) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    other = LLM(path, device="cpu", dtype="float32", seed=8).generate(ENGINE_PROMPTS, p)
    assert [o.token_ids for o in other] != [o.token_ids for o in runs[0]]
    for bad in (-1, 1.5, True, "7"):
        with pytest.raises(UsageError, match="seed must be an integer >= 0"):
            LLM(path, device="cpu", dtype="float32", seed=bad)


def test_unseeded_sampled_requests_of_one_batch_draw_their_own_seeds(llm):
    """The same prompt sent several times in one call, sampled without a seed (n
    samples, as a script asks for them), gives independent samples: each request
    draws its own seed, whether the call gives one SamplingParams or one per prompt."""
    p = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    for params in (p, [replace(p) for _ in range(4)]):
        outs = llm.generate([ENGINE_PROMPTS[0]] * 4, params)
        assert len({tuple(o.token_ids) for o in outs}) == 4, params


def test_a_seed_of_zero_is_a_seed(llm):
    """seed=0 fixes a sampled request's tokens as any other seed does (it is not "no
    seed"): the same request repeats across calls and within a batch."""
    p = SamplingParams(temperature=1.0, seed=0, max_new_tokens=12, ignore_eos=True)
    runs = [o.token_ids for _ in range(2) for o in llm.generate([ENGINE_PROMPTS[0]] * 2, p)]
    assert all(r == runs[0] for r in runs)


def test_vllm_engine_argument_names_are_taken(hf_checkpoint, monkeypatch):
    """LLM(tensor_parallel_size=, enforce_eager=, max_num_seqs=) as vLLM's scripts write
    them are tp, not cuda_graphs and max_batch; given beside ours with another value,
    refused before anything loads. trust_remote_code and the model's own tokenizer are
    taken; vLLM's other arguments are refused in words (a bare TypeError before)."""
    import treeflash.engine.llm as llm_module
    built = []
    real = llm_module.tp_attach
    monkeypatch.setattr(llm_module, "tp_attach", lambda tp, device, args, *a, **k: (built.append(args),
                                                                                    real(tp, device, args, *a, **k))[1])
    path = hf_checkpoint("qwen3").path
    llm = LLM(path, device="cpu", tensor_parallel_size=1, enforce_eager=True, max_num_seqs=3)
    assert llm.max_batch == 3 and built[-1]["tp"] == 1 and built[-1]["cuda_graphs"] is False
    LLM(path, device="cpu", enforce_eager=False, tp=1, max_batch=3, max_num_seqs=3)
    assert built[-1]["cuda_graphs"] is True
    LLM(path, device="cpu", trust_remote_code=True, tokenizer=str(path))  # no code is run; its own tokenizer
    for kwargs, what in ((dict(tp=2, tensor_parallel_size=4), "give tp or vLLM's tensor_parallel_size"),
                         (dict(cuda_graphs=False, enforce_eager=False), "give cuda_graphs or vLLM's enforce_eager"),
                         (dict(max_batch=8, max_num_seqs=4), "give max_batch or vLLM's max_num_seqs"),
                         (dict(tensor_parallel_size=0), "tensor_parallel_size"),
                         (dict(enforce_eager="yes"), "enforce_eager must be true or false"),
                         (dict(max_num_seqs=0), "max_num_seqs"),
                         (dict(trust_remote_code="yes"), "trust_remote_code must be true or false"),
                         (dict(tokenizer=builtin_paths()[0]), "tokenizer must be None or the model's own folder"),
                         (dict(gpu_memory_utilization=0.9), "no argument 'gpu_memory_utilization' \\(vLLM's; not "
                                                            "supported: caches are allocated per batch"),
                         (dict(max_modle_len=64), "LLM has no argument 'max_modle_len'$")):
        n = len(built)
        with pytest.raises(UsageError, match=what):
            LLM(path, device="cpu", **kwargs)
        assert len(built) == n  # nothing loaded


def test_engine_counts_may_be_numpy_integers():
    """A script's counts often come from NumPy (an array's element, a sweep's np.arange):
    the engine takes them as SamplingParams does, as plain ints (a TP worker unpickles
    plain values only), and still refuses a bool or a float."""
    llm = LLM(device="cpu", budget=np.int64(8), max_budget=np.int64(32), max_model_len=np.int64(256),
              seed=np.int64(3), max_batch=np.int32(2), tp=np.int8(1))
    assert (llm.decoder.budget, llm.max_budget, llm.max_model_len, llm.max_batch) == (8, 32, 256, 2)
    assert all(type(v) is int for v in (llm.decoder.budget, llm.max_budget, llm.max_model_len, llm.max_batch))
    assert llm.with_method("ddtree", budget=np.int64(4)).decoder.budget == 4
    for kwargs in (dict(max_batch=np.bool_(True)), dict(max_batch=2.0), dict(seed=np.float64(3))):
        with pytest.raises(UsageError, match="must be an integer"):
            LLM(device="cpu", **kwargs)


def test_max_tokens_reads_and_sets_as_in_vllm(llm):
    """vLLM's code reads and sets `params.max_tokens`: it is max_new_tokens, and a copy
    made with `dataclasses.replace` (as `generate` makes one to draw a seed) keeps it.
    Before, it was an init-only value: read back as Ellipsis, a later assignment was
    ignored with a seed, taken without one (through generate's copy), and refused as
    'not both' after max_tokens=5."""
    import dataclasses
    p = SamplingParams(max_tokens=5, ignore_eos=True)
    assert p.max_tokens == p.max_new_tokens == 5
    for seed in (1, None):
        q = SamplingParams(seed=seed, temperature=0.8, ignore_eos=True)
        q.max_tokens = 3
        assert len(llm.generate(ENGINE_PROMPTS[0], q)[0].token_ids) == 3
    p.max_tokens = 4
    assert len(llm.generate(ENGINE_PROMPTS[0], p)[0].token_ids) == 4
    assert dataclasses.replace(p, max_new_tokens=9).max_tokens == 9
    assert dataclasses.replace(p, seed=2).max_tokens == 4
    with pytest.raises(UsageError, match="replace a copy's max_new_tokens"):  # replace passes max_new_tokens too
        dataclasses.replace(p, max_tokens=9)
    with pytest.raises(UsageError, match="not both"):  # 128, the default, given as well
        SamplingParams(max_tokens=7, max_new_tokens=128)
    with pytest.raises(UsageError, match="not both"):  # max_new_tokens, the first field, given by position
        SamplingParams(5, max_tokens=7)


def test_filters_or_a_seed_without_a_temperature_warn():
    """vLLM's default temperature is 1, this one's 0 (greedy): code written for vLLM that
    sets top_p or a seed alone would be greedy without a word. A warning says so; off
    values (vLLM's top_k -1) and a given temperature say nothing."""
    import warnings
    for kw in (dict(top_p=0.9), dict(top_k=20), dict(min_p=0.1), dict(seed=0)):
        with pytest.warns(UserWarning, match="without a temperature is greedy"):
            SamplingParams(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SamplingParams(top_k=-1, top_p=1.0, max_tokens=3)
        SamplingParams(temperature=0, top_p=0.5, seed=1)
        SamplingParams(temperature=0.7, top_k=20)
        SamplingParams(8, 0.7, top_k=20)  # the temperature given by position
        assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    with pytest.raises(UsageError, match="seed must be"):
        SamplingParams(temperature=1.0, seed=-2)


def test_default_dtype_and_explicit_dtypes(hf_checkpoint):
    path = hf_checkpoint("qwen3").path
    assert LLM(path, device="cpu").target.lm_head.weight.dtype == torch.float32  # float32 checkpoint
    assert LLM(path, device="cpu", dtype=torch.float64).target.lm_head.weight.dtype == torch.float64
    assert LLM(path, device="cpu", dtype="bf16").target.lm_head.weight.dtype == torch.bfloat16


def test_auto_dtype_without_a_config_dtype_is_the_weights(tmp_path):
    """A config.json without torch_dtype: "auto" is the dtype the weights are stored in
    (as in transformers), not float32."""
    from treeflash.engine.options import resolve_dtype
    from treeflash.models.loader import weights_dtype
    for dtype in (torch.float64, torch.bfloat16):
        path = write_random_target(tmp_path / str(dtype), hidden_size=32, num_layers=1, num_heads=2,
                                   num_kv_heads=1, head_dim=16, intermediate_size=64, dtype=dtype)
        config = json.loads((path / "config.json").read_text())
        config.pop("torch_dtype"), config.pop("dtype", None)
        (path / "config.json").write_text(json.dumps(config))
        assert weights_dtype(path) == str(dtype).replace("torch.", "")
    assert LLM(tmp_path / str(torch.float64), device="cpu").target.lm_head.weight.dtype == torch.float64
    assert resolve_dtype("auto", weights_dtype(path), torch.device("cuda")) == torch.bfloat16  # not float32
    # a torch_dtype that names no float dtype says nothing either (it was read as float32)
    folder = tmp_path / str(torch.float64)
    for said in ("int8", [1]):
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": said}))
        assert LLM(folder, device="cpu").target.lm_head.weight.dtype == torch.float64

    # both keys: transformers 5 reads `dtype` (torch_dtype is its old name, kept for readers)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32", "dtype": "float64"}))
    assert LLM(folder, device="cpu").target.lm_head.weight.dtype == torch.float64


def test_one_sampling_params_per_prompt(llm):
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True),
              SamplingParams(max_new_tokens=9, temperature=1.0, seed=5, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=0.7, top_k=3, seed=6, ignore_eos=True)]
    outs = llm.generate(ENGINE_PROMPTS, params)
    assert [len(o.token_ids) for o in outs] == [3, 9, 5]
    for prompt, p, out in zip(ENGINE_PROMPTS, params, outs):
        assert llm.generate(prompt, p)[0].token_ids == out.token_ids
    with pytest.raises(UsageError, match="3 prompts but 2"):
        llm.generate(ENGINE_PROMPTS, params[:2])


def test_on_tokens_can_end_one_request_and_on_done_reports_each(llm):
    """A streaming consumer can end request 1 (its client left): it finishes "abort"
    and the others give exactly their tokens; on_done sees every output as it finishes."""
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    want = llm.generate(ENGINE_PROMPTS, params)
    done = {}
    outs = llm.generate(ENGINE_PROMPTS, params, on_tokens=lambda i, ids: i == 1,
                        on_done=lambda i, out: done.setdefault(i, out))
    assert outs[1].finish_reason == "abort" and len(outs[1].token_ids) < 12
    assert [outs[0].token_ids, outs[2].token_ids] == [want[0].token_ids, want[2].token_ids]
    assert all(done[i] is out for i, out in enumerate(outs))


def test_on_done_tells_a_request_that_finishes_early_while_its_batch_goes_on(llm):
    """on_done is called as soon as a request has finished (a server answers a short
    request there), not when the whole batch has: the longer request of its batch has
    streamed only part of its tokens by then, and each request's finish reason is its own."""
    params = [SamplingParams(max_new_tokens=2, ignore_eos=True), SamplingParams(max_new_tokens=12, ignore_eos=True)]
    streamed, at_done = [], {}
    outs = llm.generate(ENGINE_PROMPTS[:2], params, on_tokens=lambda i, ids: streamed.extend([i] * len(ids)),
                        on_done=lambda i, out: at_done.setdefault(i, streamed.count(1)))
    assert [(len(o.token_ids), o.finish_reason) for o in outs] == [(2, "length"), (12, "length")]
    assert at_done[0] < 12 and at_done[1] == 12


def test_on_done_sees_the_prompt_the_output_is_returned_with(llm, monkeypatch):
    """on_done gets the output `generate` returns, its `prompt` (vLLM's: the text given,
    None for token ids) already set: a streaming consumer logs it there; across
    max_batch chunks too."""
    monkeypatch.setattr(llm, "max_batch", 2)
    prompts = [ENGINE_PROMPTS[0], {"prompt": ENGINE_PROMPTS[1]}, llm.tokenizer.encode(ENGINE_PROMPTS[2])]
    seen = {}
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=2, ignore_eos=True),
                        on_done=lambda i, out: seen.setdefault(i, out.prompt))
    assert seen == {0: ENGINE_PROMPTS[0], 1: ENGINE_PROMPTS[1], 2: None}
    assert [o.prompt for o in outs] == [ENGINE_PROMPTS[0], ENGINE_PROMPTS[1], None]


def test_outputs_read_as_vllm_request_outputs(llm):
    """vLLM scripts read `out.outputs[0].text` and `out.prompt_token_ids`: the one
    completion is the output itself, and the prompt's ids are the ones the model read
    (after truncate_prompt_tokens); `request_id`, `num_cached_tokens` and `metrics` are
    there too."""
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    outs = llm.generate(ENGINE_PROMPTS, params)
    for prompt, out in zip(ENGINE_PROMPTS, outs):
        assert out.outputs == [out] and out.outputs[0].text == out.text
        assert out.prompt_token_ids == llm.encode(prompt)
    cut = llm.generate(ENGINE_PROMPTS[0], replace(params, truncate_prompt_tokens=2))[0]
    assert cut.prompt_token_ids == llm.encode(ENGINE_PROMPTS[0])[-2:]
    # request ids number the engine's requests in order, as vLLM's (scripts sort by them)
    ids = [int(o.request_id) for o in outs + [cut]]
    assert ids == list(range(ids[0], ids[0] + len(ids)))
    assert all(o.num_cached_tokens == 0 and o.metrics is None for o in outs)


def test_more_of_vllms_output_fields_and_logprobs_read_as_in_vllm(llm):
    """vLLM's examples print `out.prompt`, and read `finished`, `outputs[0].index`,
    `cumulative_logprob`, and each token's logprobs as {token id: Logprob} (`lp[id].logprob`,
    `.rank`, `.decoded_token`; the chosen token first, as `next(iter(lp))` reads it): all
    there, with the values of this output's own fields."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2)
    text, ids = llm.generate([ENGINE_PROMPTS[0], llm.encode(ENGINE_PROMPTS[1])], params)
    assert (text.prompt, ids.prompt) == (ENGINE_PROMPTS[0], None)
    assert text.finished and text.outputs[0].index == 0
    assert text.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in text.logprobs))
    assert llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=2))[0].cumulative_logprob is None
    sampled = llm.generate(ENGINE_PROMPTS[0], replace(params, temperature=1.0, seed=5, max_new_tokens=12))[0]
    assert any(lp.rank > 1 for lp in sampled.logprobs)  # a token that is not the most likely
    for token, lp in zip(text.token_ids + sampled.token_ids, text.logprobs + sampled.logprobs):
        assert lp[token].logprob == lp.logprob and lp[token].rank == lp.rank and token in lp
        assert next(iter(lp)) == token  # vLLM's dicts hold the chosen token first, its alternatives after
        assert [(t, v.logprob, v.rank) for t, v in lp.items() if t != token] == \
            [(t, v, r) for r, (t, v) in enumerate(lp.top, 1) if t != token]
        assert all(v.decoded_token == llm.tokenizer.token_text(t) for t, v in lp.items())


def test_vllm_keywords_in_the_constructor_are_taken_at_this_engines_values():
    """vLLM scripts spell out `best_of=1` or `detokenize=True`: taken, as they ask for
    what this engine does; other values, and vLLM keywords with no counterpart, are
    refused in words (a bare TypeError before). from_optional takes a JSON logit_bias as
    vLLM's does: string keys, values clamped to [-100, 100]."""
    assert SamplingParams(best_of=1, detokenize=True, spaces_between_special_tokens=True, logits_processors=None,
                          max_tokens=3) == SamplingParams(max_new_tokens=3)
    for kw, words in (({"best_of": 2}, "takes vLLM's 'best_of' only as None or 1 .*got 2"),
                      ({"detokenize": False}, "'detokenize' only as True"),
                      ({"output_kind": 1}, "no field 'output_kind' \\(vLLM's; not supported\\)"),
                      ({"temprature": 0.5}, "no field 'temprature'$")):
        with pytest.raises(UsageError, match=words):
            SamplingParams(**kw)
    assert SamplingParams.from_optional(logit_bias={"5": 150.0, 7: -3}).logit_bias == {5: 100.0, 7: -3.0}
    for bad in ({"x": 1.0}, {"5": True}, {"5": "2"}):
        with pytest.raises(UsageError, match="logit_bias must map token ids"):
            SamplingParams.from_optional(logit_bias=bad)
    with pytest.raises(UsageError, match="logit_bias values must be in"):  # a NaN is not clamped to a ban
        SamplingParams.from_optional(logit_bias={"5": float("nan")})


def test_vllm_fields_set_after_construction_are_not_dropped(llm):
    """A vLLM script may set a field on its SamplingParams (`p.n = 4`, `p.logits_processors =
    [...]`): one this engine has not is refused, not ignored; vLLM's clone() and
    from_optional() work."""
    p = SamplingParams(temperature=0.5, seed=3, max_new_tokens=3)
    with pytest.raises(UsageError, match="n must be 1"):
        p.n = 4
    p.n = 1
    for name, value in (("logits_processors", [print]), ("best_of", 2), ("detokenize", False)):
        with pytest.raises(UsageError, match=f"SamplingParams takes vLLM's '{name}' only as"):
            setattr(p, name, value)
    with pytest.raises(UsageError, match="SamplingParams has no field 'output_kind' \\(vLLM's; not supported\\)"):
        p.output_kind = 1
    p.best_of = 1  # what this engine does, as the constructor takes it
    with pytest.raises(UsageError, match="has no field 'temprature'"):
        p.temprature = 1.0
    copy = p.clone()
    assert copy == p and copy is not p and copy.stop is not p.stop
    assert SamplingParams.from_optional(temperature=0.7, top_p=0.5, seed=None, stop=None) == \
        SamplingParams(temperature=0.7, top_p=0.5)
    assert llm.get_default_sampling_params() == llm.default_sampling_params()


def test_get_tokenizer_answers_as_a_transformers_tokenizer(tmp_path):
    """vLLM's get_tokenizer() is a transformers tokenizer, and scripts call
    apply_chat_template(..., tokenize=False, add_generation_prompt=True), encode, decode
    and read eos_token_id on it: the same calls, with transformers' defaults, give what
    transformers gives for the model's folder (they raised AttributeError or TypeError)."""
    from transformers import AutoTokenizer
    folder = tmp_path / "chat"
    shutil.copytree(builtin_paths()[0], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = ("{% for m in messages %}### {{ m.role }}:\n{{ m.content }}{{ eos_token }}\n{% endfor %}"
                "{% if add_generation_prompt %}### assistant:\n{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    ours = LLM(folder, device="cpu", method="ar").get_tokenizer()
    hf = AutoTokenizer.from_pretrained(str(folder))
    talk = [{"role": "user", "content": "def fib(n):"}]
    for generation in (False, True):
        assert ours.apply_chat_template(talk, tokenize=False, add_generation_prompt=generation) == \
            hf.apply_chat_template(talk, tokenize=False, add_generation_prompt=generation)
    ids = ours.apply_chat_template(talk, add_generation_prompt=True)
    assert ids == hf(hf.apply_chat_template(talk, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == hf.decode(ids) and "<|endoftext|>" in ours.decode(ids)  # kept unless asked
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    text = "x = [1, 2]  # é"
    assert ours.encode(text) == hf.encode(text) and ours(text)["input_ids"] == hf(text)["input_ids"]
    assert ours([text, "y"])["input_ids"] == hf([text, "y"])["input_ids"]
    assert ours.batch_decode([ids, ids[:3]]) == hf.batch_decode([ids, ids[:3]])
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.convert_tokens_to_ids(hf.convert_ids_to_tokens(ids)) == ids
    assert (ours.eos_token_id, ours.eos_token, ours.bos_token_id) == (hf.eos_token_id, hf.eos_token, hf.bos_token_id)
    assert (len(ours), ours.vocab_size, ours.get_vocab()) == (len(hf), hf.vocab_size, hf.get_vocab())
    assert ours.all_special_ids == sorted(hf.all_special_ids)
    with pytest.raises(UsageError, match="encode takes a text"):
        ours.encode(5)
    assert ours.decode([]) == hf.decode([]) == "" and ours.decode(torch.tensor(ids)) == hf.decode(torch.tensor(ids))
    assert ours.decode(list(np.array(ids))) == hf.decode(ids)  # NumPy integers, as transformers takes them
    with pytest.raises(UsageError, match="decode takes token ids"):
        ours.decode([2 ** 70])
    # ids as decode takes them, one id as one spelling; bad ones a clear error (None and -1 raised
    # TypeError and OverflowError from the tokenizers library)
    assert ours.convert_ids_to_tokens(np.int64(ids[0])) == hf.convert_ids_to_tokens(ids[0])
    assert ours.convert_ids_to_tokens(torch.tensor(ids)) == hf.convert_ids_to_tokens(ids)
    assert ours.convert_tokens_to_ids(tuple(hf.convert_ids_to_tokens(ids[:2]))) == ids[:2]
    for bad in (None, -1, [None], "5"):
        with pytest.raises(UsageError, match="takes token ids"):
            ours.convert_ids_to_tokens(bad)
    with pytest.raises(UsageError, match="decode takes token ids"):
        ours.decode(None)
    for bad in (5, [None], None):
        with pytest.raises(UsageError, match="takes a token's spelling"):
            ours.convert_tokens_to_ids(bad)
    with pytest.raises(UsageError, match="return_tensors not supported"):  # not a template variable
        ours.apply_chat_template(talk, return_tensors="pt")


def test_chat_takes_a_template_of_its_own_as_vllms_does(llm):
    """LLM.chat(chat_template=...): a model without a template (the built-in pair) chats
    with the one given, its special tokens the model's (tokenizer_config.json's
    <|endoftext|>); chat_template_content_format chooses how a message's parts reach it
    (auto: as the template reads them)."""
    talk = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)

    def prompt(template, content_format="auto"):
        out = llm.chat(talk, params, chat_template=template, chat_template_content_format=content_format)[0]
        assert out.prompt == llm.tokenizer.decode(out.prompt_token_ids, skip_special=False)  # vLLM's: the rendered text
        return out.prompt
    joined = "{% for m in messages %}# {{ m.content }}\n{% endfor %}{{ eos_token }}def "
    looped = "{% for m in messages %}# {% for p in m.content %}{{ p.text }}{% endfor %}\n{% endfor %}def "
    assert prompt(joined) == "# a\nb\n<|endoftext|>def "
    assert prompt(looped) == "# abdef "  # (the newline after a block tag is trimmed, as transformers does)
    assert prompt(joined, "openai") == "# [{'type': 'text', 'text': 'a'}, {'type': 'text', 'text': 'b'}]\n<|endoftext|>def "
    assert prompt(looped, "string") == "# def "  # a string's characters have no text
    with pytest.raises(UsageError, match="chat_template_content_format must be one of auto, string, openai"):
        prompt(joined, "text")
    with pytest.raises(UsageError, match="malformed chat template"):
        prompt("{% for m in messages %}")
    with pytest.raises(UsageError, match="or give LLM.chat a chat_template"):
        llm.chat(talk, params)


def test_use_tqdm_counts_finished_prompts_as_vllm_does(llm, capsys, monkeypatch):
    """vLLM scripts pass use_tqdm: False shows nothing, True counts finished prompts on
    stderr, a tqdm-like class is made with the total and advanced once per prompt (on_done
    still sees every output); other values are refused before anything runs."""
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    want = [o.token_ids for o in llm.generate(ENGINE_PROMPTS, params, use_tqdm=False)]
    assert capsys.readouterr().err == ""
    assert [o.token_ids for o in llm.generate(ENGINE_PROMPTS, params, use_tqdm=True)] == want
    n = len(ENGINE_PROMPTS)
    assert capsys.readouterr().err == "".join(f"\rProcessed prompts: {i}/{n}" for i in range(1, n + 1)) + "\n"

    class Bar:
        made = []

        def __init__(self, total, desc):
            self.total, self.count, self.closed = total, 0, False
            Bar.made.append(self)

        def update(self, k):
            self.count += k

        def close(self):
            self.closed = True

    from treeflash.chat import ChatTemplate
    monkeypatch.setattr(llm, "chat_template", ChatTemplate("{{ messages[0].content }}"))
    done = {}
    llm.chat([[{"role": "user", "content": "hi"}]] * 2, params, on_done=lambda i, out: done.setdefault(i, out),
             use_tqdm=Bar)
    assert [(b.total, b.count, b.closed) for b in Bar.made] == [(2, 2, True)] and len(done) == 2
    for value, what in (("yes", "use_tqdm must be true, false or a tqdm-like class, got str"),
                        (lambda total, desc: object(), "use_tqdm made a object, which has no update")):
        with pytest.raises(UsageError, match=what):
            llm.generate(ENGINE_PROMPTS, params, use_tqdm=value)


def test_a_request_that_ends_where_on_tokens_ends_it_keeps_its_own_finish_reason(llm):
    """on_tokens returning True for the tokens that end a request anyway (its token
    limit here) changes nothing: it finished by length; a request it cuts short is the
    one that ends "abort"."""
    params = [SamplingParams(max_new_tokens=1, ignore_eos=True), SamplingParams(max_new_tokens=3, ignore_eos=True)]
    outs = llm.generate(ENGINE_PROMPTS[:2], params, on_tokens=lambda i, ids: True)
    assert [(len(o.token_ids), o.finish_reason) for o in outs] == [(1, "length"), (1, "abort")]


def test_more_prompts_than_max_batch_run_in_batches_in_order(llm, hf_checkpoint):
    """Thousands of prompts are not one batch (its caches and logits would not fit):
    they run max_batch at a time, each prompt getting what it gets alone, and the
    callbacks name each request by its index in the call."""
    small = LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float32", max_batch=2)
    prompts = ENGINE_PROMPTS + ENGINE_PROMPTS[:2]
    params = [SamplingParams(max_new_tokens=4 + i, ignore_eos=True) for i in range(len(prompts))]
    want = llm.generate(prompts, params)
    seen, done = {i: [] for i in range(5)}, {}

    def on_tokens(i, ids):
        seen[i].extend(ids)
        return i == 3  # ends a request of the second batch

    outs = small.generate(prompts, params, on_tokens=on_tokens, on_done=lambda i, out: done.setdefault(i, out))
    assert [o.token_ids for i, o in enumerate(outs) if i != 3] == [w.token_ids for i, w in enumerate(want) if i != 3]
    assert outs[3].finish_reason == "abort" and outs[3].token_ids == want[3].token_ids[:len(outs[3].token_ids)]
    assert seen == {i: o.token_ids for i, o in enumerate(outs)}
    assert all(done[i] is out for i, out in enumerate(outs))


def test_a_top_k_past_the_vocabulary_or_of_minus_one_keeps_every_token(llm):
    """top_k >= vocabulary = no top-k at all, also for integers past 64 bits; -1 is off,
    as vLLM's code writes it."""
    plain = SamplingParams(max_new_tokens=6, temperature=1.0, seed=2, ignore_eos=True)
    want = llm.generate(ENGINE_PROMPTS[0], plain)[0].token_ids
    assert llm.generate(ENGINE_PROMPTS[0], SamplingParams(**{**plain.__dict__, "top_k": 3}))[0].token_ids != want
    for k in (llm.config.vocab_size, 10 ** 30, -1):
        assert llm.generate(ENGINE_PROMPTS[0], SamplingParams(**{**plain.__dict__, "top_k": k}))[0].token_ids == want


def test_generate_without_parameters_takes_the_models_generation_config(llm, hf_checkpoint, tmp_path):
    """As vLLM's `LLM`: no sampling parameters means the values the model's
    generation_config.json asks for over `SamplingParams`' defaults; given parameters
    are used as they are; a value the engine refuses fails the load, naming the file."""
    import shutil
    folder = shutil.copytree(hf_checkpoint("qwen3").path, tmp_path / "model")
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "max_new_tokens": 4, "repetition_penalty": 1.3, "top_k": -1}))
    configured = LLM(folder, device="cpu", dtype="float32")
    asked = SamplingParams(max_new_tokens=4, repetition_penalty=1.3)
    assert configured.default_sampling_params() == asked
    assert configured.generate(ENGINE_PROMPTS[1])[0].token_ids == llm.generate(ENGINE_PROMPTS[1], asked)[0].token_ids
    chat = [{"role": "user", "content": "hi"}]
    if configured.chat_template is not None:
        assert configured.chat(chat)[0].token_ids == configured.chat(chat, asked)[0].token_ids
    given = SamplingParams(max_new_tokens=6, ignore_eos=True)
    assert configured.generate(ENGINE_PROMPTS[1], given)[0].token_ids == llm.generate(ENGINE_PROMPTS[1], given)[0].token_ids
    path.write_text(json.dumps({**config, "top_p": 0}))
    with pytest.raises(UsageError, match="generation_config.json: invalid sampling parameters: top_p"):
        LLM(folder, device="cpu", dtype="float32")
    # "none" (vLLM's "vllm") reads none of the file's sampling values: a bad one does not stop the load
    assert LLM(folder, device="cpu", dtype="float32", generation_config="none").default_sampling_params() == \
        SamplingParams()
    assert LLM(folder, device="cpu", dtype="float32", generation_config="vllm").default_sampling_params() == \
        SamplingParams()
    # a folder's generation_config.json (vLLM's third form); a folder without one is refused
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(UsageError, match="generation_config must be 'auto', 'none' .* or a folder with a generation_config.json"):
        LLM(folder, device="cpu", dtype="float32", generation_config=str(elsewhere))
    (elsewhere / "generation_config.json").write_text(json.dumps({"max_new_tokens": 3, "top_k": 5}))
    assert LLM(folder, device="cpu", dtype="float32", generation_config=str(elsewhere)).default_sampling_params() \
        == SamplingParams(max_new_tokens=3, top_k=5, temperature=1.0)
    # filters without a temperature are for transformers' (and vLLM's) 1, unless do_sample is false
    path.write_text(json.dumps({**config, "top_k": 20}))
    assert LLM(folder, device="cpu", dtype="float32").default_sampling_params() == \
        SamplingParams(temperature=1.0, top_k=20)
    path.write_text(json.dumps({**config, "top_k": 20, "do_sample": False}))
    assert LLM(folder, device="cpu", dtype="float32").default_sampling_params() == \
        SamplingParams(temperature=0.0, top_k=20)
    # do_sample false is greedy whatever temperature the file gives, as transformers decodes it
    path.write_text(json.dumps({**config, "temperature": 0.6, "top_p": 0.9, "do_sample": False}))
    assert LLM(folder, device="cpu", dtype="float32").default_sampling_params() == \
        SamplingParams(temperature=0.0, top_p=0.9)
    path.write_text(json.dumps({**config, "do_sample": False}))  # alone: greedy too (the server's default is 1)
    from treeflash.sampling_params import generation_defaults
    assert generation_defaults(folder)["temperature"] == 0.0
    path.write_text(json.dumps({**config, "top_k": 20, "do_sample": "false"}))  # not a boolean: not read as true
    with pytest.raises(UsageError, match="generation_config.json: 'do_sample' must be true or false, got 'false'"):
        LLM(folder, device="cpu", dtype="float32")


def test_null_values_in_generation_config_are_left_out(tmp_path):
    """generation_config.json may write a value as null (not set): it is left out, as if
    not written (not refused: the model would not load), and the file's other values are
    read (a filter without a temperature samples at 1)."""
    from treeflash.sampling_params import generation_defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": None, "top_p": 0.8, "top_k": None, "max_new_tokens": None, "repetition_penalty": None}))
    assert generation_defaults(tmp_path) == {"top_p": 0.8, "temperature": 1.0}


def test_streaming_callback_sees_every_token_once(llm):
    seen: dict[int, list[int]] = {0: [], 1: []}
    outs = llm.generate(ENGINE_PROMPTS[:2], SamplingParams(max_new_tokens=8, ignore_eos=True),
                        on_tokens=lambda i, ids: seen[i].extend(ids))
    assert seen == {0: outs[0].token_ids, 1: outs[1].token_ids}


def test_eos_stops_generation(eos_checkpoint):
    llm = LLM(eos_checkpoint.path, device="cpu", dtype="float32")
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=48))[0]
    k = eos_checkpoint.step
    assert out.finish_reason == "stop"
    assert out.token_ids == eos_checkpoint.full[:k + 1] and out.token_ids[-1] == eos_checkpoint.eos
    assert out.text == llm.tokenizer.decode(eos_checkpoint.full[:k])   # EOS is not text
    assert out.stats["new_tokens"] == k + 1
    # ignore_eos runs through it
    on = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=48, ignore_eos=True))[0]
    assert on.finish_reason == "length" and on.token_ids == eos_checkpoint.full
    # EOS as the last token the limit allows ends the request as EOS does, not by length
    last = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=k + 1))[0]
    assert last.token_ids == out.token_ids and (last.finish_reason, last.stop_reason) == ("stop", None)
    assert last.text == out.text


def test_an_end_token_other_than_the_tokenizers_eos_is_the_stop_reason(eos_checkpoint, tmp_path):
    """As vLLM: an end id that generation_config.json lists beside the tokenizer's own
    EOS ends a request as a stop token id does, and is its stop_reason; ending on the
    tokenizer's EOS has none."""
    folder = Path(shutil.copytree(eos_checkpoint.path, tmp_path / "ckpt"))
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": "<|pad|>"}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, eos_checkpoint.eos]}))
    llm = LLM(folder, device="cpu", dtype="float32")
    k = eos_checkpoint.step
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=48))[0]
    assert out.token_ids == eos_checkpoint.full[:k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", eos_checkpoint.eos)
    assert out.text == llm.tokenizer.decode(eos_checkpoint.full[:k])
    pad = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=4, logit_bias={1: 100.0}))[0]
    assert (pad.token_ids, pad.finish_reason, pad.stop_reason) == ([1], "stop", None)


def test_an_eos_token_written_as_an_added_token_object_is_the_tokenizers_eos(tmp_path):
    """Older tokenizer_config.json files (Llama 2's) write eos_token as an AddedToken object
    ({"content": "</s>", ...}): its content is still the tokenizer's own EOS, which ends a
    request (with no stop_reason) where no config.json or generation_config.json names it."""
    from treeflash.checkpoints import write_tiny_tokenizer
    from treeflash.tokenizer import Tokenizer
    write_tiny_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"__type": "AddedToken", "content": "<|pad|>", "lstrip": False, "normalized": False,
                        "rstrip": False, "single_word": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(tmp_path)
    pad = tok.tok.token_to_id("<|pad|>")
    assert (tok.eos_token_id, tok.eos_token_ids, tok.eos_sources) == (pad, [pad], {pad: "tokenizer_config.json"})


def test_a_request_stopping_early_does_not_disturb_its_batch(eos_checkpoint):
    """In one batch, the request that hits EOS stops there; the others run on to their
    own limits and get what they get alone."""
    llm = LLM(eos_checkpoint.path, device="cpu", dtype="float32")
    params = [SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=30, ignore_eos=True),
              SamplingParams(max_new_tokens=20, temperature=1.0, seed=4, ignore_eos=True)]
    outs = llm.generate(ENGINE_PROMPTS, params)
    assert outs[0].finish_reason == "stop" and outs[0].token_ids == eos_checkpoint.full[:eos_checkpoint.step + 1]
    assert [len(o.token_ids) for o in outs[1:]] == [30, 20]
    for prompt, p, out in zip(ENGINE_PROMPTS[1:], params[1:], outs[1:]):
        assert out.token_ids == llm.generate(prompt, p)[0].token_ids


def test_stop_strings_end_generation_at_their_first_occurrence(llm):
    full = llm.generate(ENGINE_PROMPTS[1], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
    text = full.text
    # a stop string that first appears well inside the output
    start = len(llm.tokenizer.decode(full.token_ids[:10]))
    stop = next(text[i:i + 2] for i in range(start, len(text) - 2)
                if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    cut = text.find(stop)
    out = llm.generate(ENGINE_PROMPTS[1], SamplingParams(max_new_tokens=32, ignore_eos=True,
                                                         stop=["never appears \u2603", stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert len(out.token_ids) < 32
    assert out.token_ids == full.token_ids[:len(out.token_ids)]
    # it stopped at the token that completed the stop string, not later
    assert stop in llm.tokenizer.decode(out.token_ids)
    assert stop not in llm.tokenizer.decode(out.token_ids[:-1])
    # include_stop_str_in_output: the same tokens, the text up to the stop string's end
    kept = llm.generate(ENGINE_PROMPTS[1], SamplingParams(max_new_tokens=32, ignore_eos=True, stop=[stop],
                                                          include_stop_str_in_output=True))[0]
    assert kept.token_ids == out.token_ids and kept.text == text[:cut + len(stop)]
    # completed by the last token the limit allows: the stop string ends it (as EOS there does)
    last = llm.generate(ENGINE_PROMPTS[1], SamplingParams(max_new_tokens=len(out.token_ids), ignore_eos=True,
                                                          stop=[stop]))[0]
    assert (last.token_ids, last.text, last.finish_reason, last.stop_reason) == (out.token_ids, out.text, "stop", stop)


def test_added_tokens_decoder_marks_tokens_special(tmp_path):
    """A token that tokenizer.json adds as plain text and tokenizer_config.json's
    added_tokens_decoder marks special is special, as transformers loads it: decoding
    with skip_special_tokens leaves it out (before, only tokenizer.json's flag counted)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import AutoTokenizer

    from treeflash.checkpoints import write_tiny_tokenizer
    from treeflash.tokenizer import Tokenizer
    write_tiny_tokenizer(tmp_path)
    raw = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.add_tokens([AddedToken("<tool_call>", special=False), AddedToken("<plain>", special=False)])
    raw.save(str(tmp_path / "tokenizer.json"))
    call, plain = raw.token_to_id("<tool_call>"), raw.token_to_id("<plain>")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(i): {"content": c, "special": s, "lstrip": False, "rstrip": False,
                                               "normalized": False, "single_word": False}
                                      for i, c, s in ((call, "<tool_call>", True), (plain, "<plain>", False))}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    text = "def f<tool_call>x<plain>y"
    ids = ours.encode(text, False)
    assert ids == hf.encode(text, add_special_tokens=False) and call in ids and plain in ids
    for skip in (True, False):
        assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids) == "def fx<plain>y" and call in ours.special_ids


def test_special_tokens_that_only_the_vocabulary_holds_are_added_tokens(tmp_path):
    """tokenizer_config.json declares special tokens (added_tokens_decoder, eos_token)
    that tokenizer.json's model vocabulary holds but its added tokens do not: as
    transformers loads them, they are special added tokens, so a rendered chat's
    "<|im_start|>" is that one token (it was split into its characters' pieces) and
    skip_special_tokens leaves them out."""
    from transformers import AutoTokenizer

    from treeflash.checkpoints import write_tiny_tokenizer
    from treeflash.tokenizer import Tokenizer
    write_tiny_tokenizer(tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    start, end = len(vocab), len(vocab) + 1
    vocab |= {"<|im_start|>": start, "<|im_end|>": end}
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|endoftext|>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    entry = {"special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}
    config["added_tokens_decoder"] = {str(i): {"content": c, **entry}
                                      for i, c in ((start, "<|im_start|>"), (end, "<|im_end|>"))}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, hf = Tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    text = "<|im_start|>user\ndef f<|im_end|><|endoftext|>"
    ids = ours.encode(text, False)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ids[0] == start and end in ids and ours.eos_token_id in ids
    for skip in (True, False):
        assert ours.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    assert ours.decode(ids) == "user\ndef f"


def test_special_tokens_in_the_text_on_request(eos_checkpoint):
    """skip_special_tokens=False: a special token generated mid-text (EOS, ignored)
    shows in the text; the token that ends a request never does."""
    llm = LLM(eos_checkpoint.path, device="cpu", dtype="float32")
    k, eos_text = eos_checkpoint.step, llm.tokenizer.token_text(eos_checkpoint.eos)
    p = SamplingParams(max_new_tokens=k + 3, ignore_eos=True)
    plain = llm.generate(ENGINE_PROMPTS[0], p)[0]
    shown = llm.generate(ENGINE_PROMPTS[0], SamplingParams(**{**p.__dict__, "skip_special_tokens": False}))[0]
    assert shown.token_ids == plain.token_ids and eos_text not in plain.text
    assert shown.text == llm.tokenizer.decode(plain.token_ids, skip_special=False) and eos_text in shown.text
    ended = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=k + 3, skip_special_tokens=False))[0]
    assert ended.finish_reason == "stop" and eos_text not in ended.text
    with pytest.raises(UsageError, match="skip_special_tokens must be true or false"):
        llm.generate(ENGINE_PROMPTS[0], SamplingParams(skip_special_tokens="no"))


@pytest.fixture(scope="module")
def speculative_pair(tmp_path_factory):
    """A peaked random target (repetitive text) with a random DFlash drafter: DDTree
    commits several tokens in some rounds."""
    from treeflash.checkpoints import write_random_drafter, write_random_target
    root = tmp_path_factory.mktemp("spec")
    target = write_random_target(root / "target", peaked_tokens=6, num_layers=2)
    drafter = write_random_drafter(target, root / "drafter", num_layers=1, block_size=8)
    return (LLM(target, device="cpu", dtype="float32", method="ar"),
            LLM(target, draft_model=drafter, device="cpu", dtype="float32", method="ddtree", budget=16))


def test_stop_strings_give_the_same_tokens_with_speculative_decoding(speculative_pair):
    ar, ddtree = speculative_pair
    p = SamplingParams(max_new_tokens=40, ignore_eos=True)
    full = ar.generate(ENGINE_PROMPTS[0], p)[0]
    spec = ddtree.generate(ENGINE_PROMPTS[0], p)[0]
    assert spec.token_ids == full.token_ids and spec.stats["tau"] > 1   # lossless, and speculating
    stops = sorted({full.text[i:i + 2] for i in range(2, len(full.text) - 2)
                    if full.text[i:i + 2].strip() and "\ufffd" not in full.text[i:i + 2]})
    assert stops
    for stop in stops:
        ps = SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop])
        a, d = ar.generate(ENGINE_PROMPTS[0], ps)[0], ddtree.generate(ENGINE_PROMPTS[0], ps)[0]
        assert (d.text, d.finish_reason) == (a.text, a.finish_reason), stop
        assert d.token_ids == a.token_ids, stop


def test_a_round_larger_than_free_memory_is_refused(speculative_pair, monkeypatch):
    """A budget far past the default asks every round for (N+1)^2 masks and N+1 rows of
    logits per request (a budget of 100000 was killed by the OS): checked with the
    batch's caches against free memory, a clear error, and the engine still serves."""
    from treeflash.engine import round as round_module
    _, ddtree = speculative_pair
    monkeypatch.setattr(round_module, "available_bytes", lambda device: 1000)
    with pytest.raises(TreeflashError, match=r"not enough cpu memory for a round of 17 tokens per request "
                                             r"\(budget 16\) over 1 requests"):
        ddtree.generate(["a"], SamplingParams(max_new_tokens=2))
    monkeypatch.undo()
    assert ddtree.generate(["a"], SamplingParams(max_new_tokens=2))[0].token_ids


def test_a_sampled_round_counts_the_samplers_copies(speculative_pair, monkeypatch):
    """On the CPU a sampled round holds copies of its logits beside them (the noisy
    logits, the noise): memory that fits a greedy round refuses a sampled one, clearly."""
    from treeflash.engine import round as round_module
    _, ddtree = speculative_pair
    dec, cpu = ddtree.decoder, torch.device("cpu")
    lengths, counted = [], dec.round_bytes  # the cache length the engine gives this request
    monkeypatch.setattr(dec, "round_bytes", lambda b, n, *rest: lengths.append(n) or counted(b, n, *rest))
    ddtree.generate(["a"], SamplingParams(max_new_tokens=2))
    greedy = counted(1, lengths[-1], cpu, False)
    assert counted(1, lengths[-1], cpu, True) > greedy
    monkeypatch.setattr(round_module, "available_bytes", lambda device: greedy)
    assert ddtree.generate(["a"], SamplingParams(max_new_tokens=2))[0].token_ids
    with pytest.raises(TreeflashError, match=r"not enough cpu memory for a round of 17 tokens"):
        ddtree.generate(["a"], SamplingParams(max_new_tokens=2, temperature=1.0, seed=0))


def test_generation_stops_at_the_context_limit(hf_checkpoint):
    llm = LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float32", max_model_len=16)
    ids = llm.tokenizer.encode(ENGINE_PROMPTS[0])
    assert len(ids) < 16
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=48, ignore_eos=True))[0]
    assert len(ids) + len(out.token_ids) == 16 and out.finish_reason == "length"
    # the longest prompt that fits leaves room for one new token; one token more does not fit
    longest = [5] * (llm.max_model_len - 1)
    out = llm.generate(longest, SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert (len(out.token_ids), out.finish_reason) == (1, "length")
    with pytest.raises(UsageError, match=f"length is {llm.max_model_len} tokens: a prompt of {llm.max_model_len} tokens does not fit"):
        llm.generate(longest + [5], SamplingParams(max_new_tokens=4))
    with pytest.raises(ContextLengthError, match="maximum context length"):
        llm.generate(ENGINE_PROMPTS[1] * 3, SamplingParams(max_new_tokens=4))


@pytest.mark.parametrize("kwargs,what", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    # inf as float32: masked logits (-inf / inf) turned NaN and the first (banned) token won
    ({"temperature": 1e39}, "temperature must be at most"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"seed": -3}, "seed"),
    ({"seed": 2 ** 63}, "seed must be an integer in"),  # past int64: the batch's seed tensor overflowed
    ({"seed": True}, "seed must be an integer in"),     # a flag, not seed 1
    ({"min_p": -0.1}, "min_p must be in"),              # log of a negative: a NaN floor
    ({"stop": [""]}, "stop"),
    ({"temperature": True}, "temperature"),
    ({"top_p": True}, "top_p"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"include_stop_str_in_output": "no"}, "include_stop_str_in_output must be true or false"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 7}, "stop_token_ids"),
    ({"stop_token_ids": [10_000]}, "outside the vocabulary"),
])
def test_bad_sampling_params_raise_usage_error(llm, kwargs, what):
    """Where the caller makes them, as in vLLM; token ids against the vocabulary once a
    model is known (generate)."""
    if what != "outside the vocabulary":
        with pytest.raises(UsageError, match=what):
            SamplingParams(**kwargs)
        return
    params = SamplingParams(**kwargs)
    with pytest.raises(UsageError, match=what):
        llm.generate(ENGINE_PROMPTS[0], params)


def test_a_single_stop_string_is_a_list_of_one():
    """As in vLLM, stop may be one string: it is that stop string (not refused, nor its
    characters each a stop string)."""
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]


def test_sampling_parameter_bounds_are_inclusive():
    """Each bound the messages give ("at most", "in [lo, hi]") is taken: float32's largest
    temperature, repetition penalties of 1e30 and 1e-30, the penalties' +-2, logprobs 0
    and 20 (vLLM's and OpenAI's most: 21 is refused), the last int64 seed, min_p 1."""
    from treeflash.sampling_params import FLOAT32_MAX
    for kw in (dict(temperature=FLOAT32_MAX), dict(repetition_penalty=1e30), dict(repetition_penalty=1e-30),
               dict(presence_penalty=2.0), dict(frequency_penalty=-2.0), dict(logprobs=0), dict(logprobs=20),
               dict(prompt_logprobs=20), dict(seed=2 ** 63 - 1), dict(min_p=1.0)):
        assert SamplingParams(temperature=kw.pop("temperature", 1.0), **kw)
    for kw in (dict(logprobs=21), dict(prompt_logprobs=21)):
        with pytest.raises(UsageError, match=r"logprobs must be an integer in \[0, 20\]"):
            SamplingParams(**kw)


def test_a_stop_token_id_at_the_vocabulary_size_is_outside_it(llm):
    """Token ids run from 0 to vocab_size - 1: a stop token id of vocab_size is refused
    (UsageError naming it, before any work), the last id is taken."""
    vocab = llm.config.vocab_size
    with pytest.raises(UsageError, match=f"stop token id {vocab} is outside the vocabulary of {vocab}"):
        llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=2, stop_token_ids=[vocab]))
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=2, stop_token_ids=[vocab - 1]))[0]
    assert 1 <= len(out.token_ids) <= 2


def test_strings_of_a_str_subclass_are_plain_strings():
    """Stop strings and bad words given as a subclass of str (NumPy's str_, read from an
    array, or the caller's own class) are kept as plain str, as numbers are kept as plain
    int and float: a tensor-parallel worker unpickles plain values only."""
    class Word(str):
        pass
    p = SamplingParams(stop=[np.str_("\n"), Word("end")], bad_words=[Word("if")])
    assert p.stop == ["\n", "end"] and p.bad_words == ["if"]
    assert [type(s) for s in p.stop + p.bad_words] == [str, str, str]


@pytest.mark.parametrize("prompts,what", [("", "empty prompt"), ([[]], "empty prompt"),
                                          ([5, 10_000], "outside the vocabulary"),
                                          ([[5, -1]], "outside the vocabulary"),
                                          ([3.5], "string or a list of token ids"),
                                          ([[1, "a"]], "string or a list of token ids"),
                                          ([[True, False]], "string or a list of token ids"),
                                          (None, "prompts must be"), (5, "prompts must be"),
                                          ({"prompt": "a", "images": []}, "a prompt dict holds one key"),
                                          (["a\udcff"], "valid Unicode")])
def test_bad_prompts_raise_usage_error(llm, prompts, what):
    with pytest.raises(UsageError, match=what):
        llm.generate(prompts, SamplingParams(max_new_tokens=2))


def test_a_prompts_token_ids_end_below_the_vocabulary_size(llm):
    """A prompt's token ids run from 0 to vocab_size - 1: the id vocab_size is the
    caller's mistake (a UsageError naming it), not the tokenizer's."""
    vocab = llm.config.vocab_size
    assert llm.generate([5, vocab - 1], SamplingParams(max_new_tokens=1))[0].token_ids
    with pytest.raises(UsageError, match=f"token id {vocab} is outside the vocabulary of {vocab}"):
        llm.generate([5, vocab], SamplingParams(max_new_tokens=1))


def test_max_model_len_may_be_the_models_whole_context(llm, hf_checkpoint):
    """max_model_len up to max_position_embeddings is taken (the model was trained on
    those positions); one more is refused."""
    most = llm.config.max_position_embeddings
    assert LLM(hf_checkpoint("qwen3").path, device="cpu", max_model_len=most).max_model_len == most
    with pytest.raises(UsageError, match=f"max_model_len {most + 1} exceeds the model's context of {most} positions "
                                         f"\\(max_position_embeddings\\)"):
        LLM(hf_checkpoint("qwen3").path, device="cpu", max_model_len=most + 1)


@pytest.mark.parametrize("params", [[], ()])
def test_an_empty_list_of_sampling_parameters_is_not_the_default(llm, params):
    with pytest.raises(UsageError, match="2 prompts but 0 sampling parameter sets"):
        llm.generate(["a", "b"], params)


def test_prompts_and_sampling_parameter_lists_of_other_lengths_are_refused(llm):
    """An empty prompt list with parameters for one prompt was an empty answer."""
    with pytest.raises(UsageError, match="^0 prompts but 1 sampling parameter set$"):
        llm.generate([], [SamplingParams()])
    with pytest.raises(UsageError, match="^1 prompt but 3 sampling parameter sets$"):
        llm.generate(["a"], [SamplingParams()] * 3)
    assert llm.generate([]) == [] and llm.generate([], []) == []


@pytest.mark.parametrize("callback", ["on_tokens", "on_done"])
def test_a_callback_that_calls_generate_again_is_refused(llm, callback):
    """The engine is decoding the call's batch while its callbacks run: a nested call
    on the same engine is refused with a clear error (it would take over that batch's
    state), and the engine then serves as before; another engine made from it by
    `with_method` has states of its own and may be called."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = llm.generate(ENGINE_PROMPTS[0], params)[0].token_ids
    with pytest.raises(UsageError, match="generate was called from its own on_tokens or on_done callback"):
        llm.generate(ENGINE_PROMPTS[:2], params, **{callback: lambda i, *rest: llm.generate(ENGINE_PROMPTS[0], params)})
    assert llm.generate(ENGINE_PROMPTS[0], params)[0].token_ids == want
    other, nested = llm.with_method("ar"), []
    llm.generate(ENGINE_PROMPTS[:2], params,
                 on_done=lambda i, out: nested.append(other.generate(ENGINE_PROMPTS[0], params)[0].token_ids))
    assert nested == [want, want]
    # also one the callback makes, while this engine decodes
    llm.generate(ENGINE_PROMPTS[:1], params,
                 on_done=lambda i, out: nested.append(llm.with_method("ar").generate(ENGINE_PROMPTS[0], params)[0]))
    assert nested[-1].token_ids == want


def test_close_from_another_thread_mid_batch_ends_it_as_closed(hf_checkpoint, monkeypatch):
    """`close()` does not wait for a generating thread: if it ends the batch in flight
    just after that thread's check, the thread's next round raises EngineDeadError (not
    an AttributeError from inside the engine)."""
    from treeflash.errors import EngineDeadError
    llm = LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float32")
    real, steps = llm._tp.call, []

    def call(obj, name, args=(), collect=False):
        if name == "_step":
            steps.append(1)
            if len(steps) == 3:  # the other thread's close, as far as ending the batch
                llm._finish_run()
        return real(obj, name, args, collect)

    monkeypatch.setattr(llm._tp, "call", call)
    with pytest.raises(EngineDeadError, match="closed"):
        llm.generate(ENGINE_PROMPTS[:2], SamplingParams(max_new_tokens=12, ignore_eos=True))


@pytest.mark.parametrize("callback", ["on_tokens", "on_done"])
def test_callbacks_must_be_functions(llm, callback):
    with pytest.raises(UsageError, match=f"{callback} must be a function, got int"):
        llm.generate(["a"], SamplingParams(max_new_tokens=2), **{callback: 5})


TOKEN_FORMS = r"\(i, new_ids, new_logprobs\) or \(i, new_ids\)"


@pytest.mark.parametrize("callback,bad,form", [("on_tokens", lambda: None, TOKEN_FORMS + r", got on_tokens\(\)"),
                                               ("on_tokens", lambda i, ids, lps, extra: None,
                                                TOKEN_FORMS + r", got on_tokens\(i, ids, lps, extra\)"),
                                               ("on_done", lambda i: None, r"\(i, output\), got on_done\(i\)")])
def test_callbacks_that_take_other_arguments_are_refused_before_generating(llm, callback, bad, form):
    """A callback that cannot take the arguments generate passes is refused in one line
    before any prompt runs (not a TypeError from inside the batch, its caches held)."""
    with pytest.raises(UsageError, match=f"{callback} must take the arguments {form}"):
        llm.generate(["a"], SamplingParams(max_new_tokens=2), **{callback: bad})
    assert llm.rank_stats()[0]["cache_bytes"] == 0


def test_callbacks_whose_signature_cannot_be_read_are_called_as_documented(llm):
    """A callable whose signature inspect cannot read (a C function, a wrapper) is not
    refused: on_tokens gets (i, new_ids, new_logprobs), on_done (i, output)."""
    class Opaque:
        __signature__ = "unreadable"  # inspect.signature raises TypeError

        def __init__(self):
            self.calls = []

        def __call__(self, *args):
            self.calls.append(args)

    tokens, done = Opaque(), Opaque()
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=1),
                       on_tokens=tokens, on_done=done)[0]
    assert all(len(c) == 3 and c[0] == 0 for c in tokens.calls)
    assert [t for c in tokens.calls for t in c[1]] == out.token_ids
    assert [e for c in tokens.calls for e in c[2]] == out.logprobs
    assert done.calls == [(0, out)]


@pytest.mark.parametrize("params", ["greedy", [None], {"temperature": 0}])
def test_sampling_parameters_of_the_wrong_type(llm, params):
    with pytest.raises(UsageError, match="must be SamplingParams"):
        llm.generate(["a"], params)
    for check in (llm.check_sampling, llm.would_compile):  # (an AttributeError, before)
        with pytest.raises(UsageError, match="must be SamplingParams"):
            check(params)


def test_a_cache_larger_than_free_memory_is_refused(llm, monkeypatch):
    """The KV cache is checked against free memory before it is allocated: a clear
    error, not an allocation failure or the OS killing the process, that names what to
    lower (with prefix caching a call's prompts are one batch, whatever max_batch says)."""
    from treeflash.layers import kv_cache
    monkeypatch.setattr(kv_cache, "available_bytes", lambda device: 1000)
    with pytest.raises(TreeflashError, match=r"not enough cpu memory for a KVCache .*: lower max_model_len, or batch "
                                             r"fewer requests \(max_batch; with prefix caching, a call's prompts"):
        llm.generate(["a"], SamplingParams(max_new_tokens=2))
    monkeypatch.undo()
    assert llm.generate(["a"], SamplingParams(max_new_tokens=2))[0].token_ids  # still serves


def test_an_eager_engine_holds_no_caches_between_calls(llm):
    """Without CUDA graphs or prefix caching a batch's KV caches go as it ends, and as
    it fails (a callback raising): `rank_stats` counts them during the batch, none after."""
    during = []
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    llm.generate(["a"], params, on_tokens=lambda i, ids: during.append(llm.rank_stats()[0]["cache_bytes"]))
    assert during[0] > 0 and llm.rank_stats()[0]["cache_bytes"] == 0

    def failing(i, ids):
        raise RuntimeError("the client went away")

    with pytest.raises(RuntimeError, match="the client went away"):
        llm.generate(["a"], params, on_tokens=failing)
    assert llm.rank_stats()[0]["cache_bytes"] == 0


def test_bad_constructor_arguments(hf_checkpoint):
    path = hf_checkpoint("qwen3").path
    with pytest.raises(UsageError, match="dtype"):
        LLM(path, device="cpu", dtype="float8")
    with pytest.raises(UsageError, match="device"):
        LLM(path, device="tpu")
    if not torch.cuda.is_available():  # the device as asked for
        with pytest.raises(UsageError, match="device 'cuda:0' requested but no CUDA GPU is available"):
            LLM(path, device="cuda:0")
    with pytest.raises(UsageError, match="draft model"):
        LLM(path, device="cpu", method="ddtree")
    with pytest.raises(TreeflashError, match="not found"):
        LLM(path / "nope", device="cpu")
    with pytest.raises(UsageError, match="draft mode"):  # found before anything is read
        LLM(path / "nope", device="cpu", draft_mode="fast")
    with pytest.raises(UsageError, match="max_position_embeddings"):
        LLM(path, device="cpu", max_model_len=10 ** 9)
    for kwargs, what in ((dict(device=None), "device"), (dict(device=0), "device"), (dict(max_budget="x"), "max_budget"),
                         (dict(dtype=torch.int8), "dtype"), (dict(draft_model=5), "draft_model"),
                         (dict(max_batch=0), "max_batch"), (dict(max_batch=2.0), "max_batch"),
                         # falsy values once fell back to the default method, "false" would turn graphs on
                         (dict(method=""), "method"), (dict(method=0), "method"), (dict(method=False), "method"),
                         (dict(method="AR"), "method"), (dict(cuda_graphs="false"), "cuda_graphs"),
                         (dict(cuda_graphs=None), "cuda_graphs"), (dict(cuda_graphs=0), "cuda_graphs"),
                         (dict(draft_mode="fast"), "draft mode"), (dict(draft_mode=""), "draft mode"),
                         # AR drafts nothing (no drafter here: the method is ar), as a budget
                         (dict(draft_mode="scaled"), r"a draft mode applies to methods dflash and ddtree \(method is ar\)"),
                         (dict(draft_mode="coupled", method="ar"), "a draft mode applies")):
        with pytest.raises(UsageError, match=what):
            LLM(path, **{"device": "cpu", **kwargs})



def test_budget_is_for_ddtree_only(tmp_path):
    from treeflash.checkpoints import write_random_drafter, write_random_target
    target = write_random_target(tmp_path / "t", num_layers=1)
    drafter = write_random_drafter(target, tmp_path / "d", num_layers=1, block_size=4)
    for method, draft in (("ar", None), ("dflash", drafter)):
        with pytest.raises(UsageError, match="ddtree"):
            LLM(target, draft_model=draft, method=method, budget=8, device="cpu")


def test_the_default_budget_is_the_devices():
    """A ddtree budget left out is 63 nodes on a GPU (with the root, the 64 rows the
    few-row products take: a 65th sends them to cuBLAS at 127 nodes' cost), and 16 on a
    CPU, where a verify costs in proportion to its nodes (BENCHMARKS.md 4); a max_budget
    below the default lowers it rather than refusing a budget nobody gave."""
    from treeflash.engine.options import tree_budget
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert (tree_budget("ddtree", None, 512, cuda), tree_budget("ddtree", None, 512, cpu)) == (63, 16)
    assert (tree_budget("ddtree", None, 32, cuda), tree_budget("ddtree", None, 8, cpu)) == (32, 8)
    assert tree_budget("ddtree", 100, 512, cpu) == 100 and tree_budget("dflash", None, 512, cuda) is None
    with pytest.raises(UsageError, match="exceeds max_budget 32"):
        tree_budget("ddtree", 64, 32, cuda)
    matmul = pytest.importorskip("treeflash.kernels.matmul")
    assert tree_budget("ddtree", None, 512, cuda) + 1 == matmul.MAX_ROWS


def test_with_method_decodes_another_way_on_the_same_weights(tmp_path):
    """`with_method` (what `treeflash bench` runs every method with): the same weights
    decoding with another method or budget give the tokens an engine built that way
    gives, and the engine it came from still decodes its own way; bad choices are one
    line, as at construction."""
    from treeflash.checkpoints import write_random_drafter, write_random_target
    target = write_random_target(tmp_path / "t", num_layers=2, peaked_tokens=8, std=0.2)
    drafter = write_random_drafter(target, tmp_path / "d", num_layers=1, block_size=4)
    base = LLM(target, draft_model=drafter, method="dflash", device="cpu", dtype="float64")
    params = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    want = LLM(target, method="ar", device="cpu", dtype="float64").generate(ENGINE_PROMPTS, params)
    for method, budget in (("ar", None), ("ddtree", 6)):
        other = base.with_method(method, budget)
        assert (other.method, other.decoder.budget) == (method, budget or 0) and other.target is base.target
        outs = other.generate(ENGINE_PROMPTS, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in want]
        assert {o.stats["method"] for o in outs} == {method}
        assert {o.stats.get("nodes_per_round") for o in outs} == {budget}  # ddtree's stat alone
    stats = base.generate(ENGINE_PROMPTS[:1], params)[0].stats
    assert stats["method"] == "dflash" and "nodes_per_round" not in stats
    assert base.with_method("ddtree").decoder.budget == 16  # the constructor's default on a CPU
    # a draft mode left out is the engine's
    scaled = base.with_method("dflash", draft_mode="scaled")
    assert (scaled.with_method("ddtree").decoder.draft_mode, base.with_method("ddtree").decoder.draft_mode) == \
        ("scaled", "coupled")
    for args, what in ((("beam",), "unknown method"), (("ddtree", 0), "budget"),
                       (("dflash", 4), "ddtree only"), (("ar", None, "yes"), "cuda_graphs"),
                       (("ddtree", 10 ** 6), "exceeds max_budget 512"),
                       (("ar", None, None, "scaled"), "a draft mode applies to methods dflash and ddtree")):
        with pytest.raises(UsageError, match=what):
            base.with_method(*args)
    with pytest.raises(UsageError, match="needs a draft model"):
        LLM(target, method="ar", device="cpu").with_method("dflash")
    for method in ("dflash", "ddtree"):  # a target of one's own brings no drafter, even the built-in one's folder
        with pytest.raises(UsageError, match=f"method '{method}' needs a draft model .*only the built-in model"):
            LLM(target, method=method, device="cpu")


def test_a_with_method_engine_outlives_the_engine_it_was_made_from(hf_checkpoint, llm):
    """`ar = LLM(...).with_method("ar")` keeps only the copy: collecting the engine it
    was made from (which closes that engine) must not close the copy in use."""
    import gc
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    ar = LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float32").with_method("ar")
    gc.collect()
    assert ar.generate(ENGINE_PROMPTS[0], params)[0].token_ids == llm.generate(ENGINE_PROMPTS[0], params)[0].token_ids
    ar.close()  # still one lifetime: closing the copy closes both


def test_sentencepiece_continuations_keep_their_first_space(tmp_path):
    """With a SentencePiece tokenizer (Llama 2, Mistral) a generated text starts with the
    space its first token carries (decoded alone, the decoder would strip it): in the
    whole text, in a stop-string cut, and streamed (TextStream after the prompt)."""
    from conftest import write_sentencepiece_model

    from treeflash.tokenizer import TextStream
    folder = write_sentencepiece_model(tmp_path / "sp", spaced=True)
    llm = LLM(folder, device="cpu", dtype="float32")
    prompt = llm.encode("ab ab", special=False)
    out = llm.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert llm.tokenizer.tok.id_to_token(out.token_ids[0]).startswith("\u2581")
    assert out.text.startswith(" ") and out.text == llm.tokenizer.decode(prompt + out.token_ids)[len("ab ab"):]
    stream = TextStream(llm.tokenizer, context=prompt)
    assert "".join(stream.push([t]) for t in out.token_ids) + stream.finish(out.text) == out.text
    assert stream.finish(out.text) == ""
    j = len(out.text) - len(out.text.lstrip(" "))  # cut at the first letter: the spaces before it stay
    cut = llm.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True, stop=[out.text[j]]))[0]
    assert 0 < j < len(out.text) and cut.text == out.text[:j]


def test_a_stream_never_sends_the_start_of_a_stop_string():
    """A stop string that arrives over several pushes is held back whole: the deltas add
    up to the text before it, never its first characters (the final text cuts them, so a
    stream that sent them would no longer add up to it)."""
    from treeflash.tokenizer import TextStream, Tokenizer
    tok = Tokenizer(builtin_paths()[0])
    stream = TextStream(tok, stop=[" world"])
    deltas = [stream.push(tok.encode(piece, special=False)) for piece in ["Hello", " worl", "d", "!"]]
    assert "".join(deltas) == "Hello"


def test_byte_fallback_text_keeps_whole_characters_as_streamed(tmp_path):
    """A byte-fallback decoder turns a whole run of byte tokens into U+FFFD when the run
    ends in part of a character ("你" then half of "好": five of them). The text keeps the
    whole characters, as a stream shows them as they come, however it is pushed, and
    leaves out the part of a character at its end (no token finishes it any more)."""
    from conftest import write_sentencepiece_tokenizer

    from treeflash.tokenizer import TextStream, Tokenizer
    write_sentencepiece_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    ni_hao, ab = tok.encode("你好", False), tok.encode(" ab", False)
    assert tok.decode(ni_hao[:-1]) == "\ufffd" * 5
    for ids, want in ((ni_hao[:-1], "你"),                         # cut by max_tokens in "好"
                      (ni_hao[:-1] + ab, "你\ufffd\ufffd  ab"),     # a run left unfinished
                      (ni_hao[:5] + ab + ni_hao, "你\ufffd  ab 你好"),
                      (ni_hao + ab, "你好  ab")):
        assert tok.decode_continuation(ids) == want
        for size in (1, 2, 3, len(ids)):
            stream = TextStream(tok)
            streamed = "".join(stream.push(ids[i:i + size]) for i in range(0, len(ids), size))
            assert want.startswith(streamed) and streamed + stream.finish(want) == want


@pytest.mark.parametrize("byte", [0x80, 0xF3])
def test_bytes_no_token_can_finish_are_text_at_once_and_cost_linear_work(byte):
    """A run of stray UTF-8 continuation bytes, or of lead bytes each cut off by the next
    (a client's logit_bias can ask for either), decodes to U+FFFD for good: a stream hands
    each out once the next byte shows it cannot be finished, and neither the stream nor
    the stop-string check decodes the output again at every token (they waited for a
    character that could never finish: 1000 tokens with a stop string took minutes on the
    thread that drives every request)."""
    from treeflash.tokenizer import TextStream
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32", method="ar")
    tok = llm.tokenizer
    token = next(i for i in range(llm.config.vocab_size) if tok.token_bytes(i) == bytes([byte]))
    lead = byte >= 0xC0  # itself unfinished until the next byte comes
    assert (tok.unfinished_from([token]) == 0) == lead and tok.unfinished_from([token, token]) == (1 if lead else None)
    decoded = []
    decode = tok.decode
    tok.decode = lambda ids, skip_special=True: decoded.append(len(ids)) or decode(ids, skip_special)
    try:
        n, stream, out, params = 400, TextStream(tok, stop=["z"]), [], SamplingParams(stop=["z"])
        for i in range(n):
            assert stream.push([token]) == ("" if lead and i == 0 else "\ufffd")
            out.append(token)
            assert not llm.rules.cut_at_stop_string(out, len(out) - 1, params)
    finally:
        tok.decode = decode
    assert sum(decoded) < 600 * n, sum(decoded)  # linear (~350 n); was ~n^3 / 6 tokens decoded
    assert tok.decode_continuation(out) == "\ufffd" * (n - lead)


def test_a_continuation_after_a_context_that_begins_inside_a_character_keeps_its_space(tmp_path):
    """SentencePiece with byte fallback: the prompt's last 4 tokens began inside "你"'s
    bytes, the decoder turned that run into U+FFFD, and the continuation was decoded
    without context: " ab" became "ab", in the text and the stream."""
    from conftest import write_sentencepiece_tokenizer

    from treeflash.tokenizer import TextStream, Tokenizer
    write_sentencepiece_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    prompt = tok.encode("你好", special=False)
    gen = tok.encode("你好 ab", special=False)[len(prompt):]
    assert len(prompt) > 4 and tok.decode(prompt + gen) == "你好 ab"
    assert tok.decode_continuation(gen, prompt) == " ab"
    stream = TextStream(tok, context=prompt)
    assert "".join(stream.push([t]) for t in gen) + stream.finish(" ab") == " ab"


def test_a_stop_string_is_found_when_the_checked_window_starts_inside_a_character(tmp_path):
    """Byte fallback, one token a round: the stop-string check decodes a window of the
    output whose first tokens may finish a character begun before it. Those bytes
    decoded without their start turned the window's whole run of byte tokens into
    U+FFFD, and stop strings of CJK text were missed (the request ran to max_tokens)."""
    from conftest import write_sentencepiece_tokenizer

    from treeflash.engine.requests import RequestRules
    from treeflash.tokenizer import Tokenizer
    write_sentencepiece_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    rules = RequestRules(tok, tok.vocab_size, eos_token_ids=[])
    answer = "日本語のテキストです。" * 3
    prompt, gen = tok.encode("ab", special=False), tok.encode(answer, special=False)
    checked = 0
    for a in range(len(answer) - 12):
        for b in range(a + 2, a + 6):
            stop = answer[a:b]
            params = SamplingParams(stop=[stop], max_new_tokens=len(gen), ignore_eos=True)
            out = []
            for t in gen:
                out.append(t)
                if rules.cut_at_stop_string(out, len(out) - 1, params, prompt):
                    break
            first = next(k for k in range(1, len(gen) + 1) if stop in tok.decode(gen[:k]))
            assert len(out) == first, (stop, len(out), first)
            checked += 1
    assert checked == 4 * (len(answer) - 12)


def test_a_continuation_finishes_the_character_its_prompt_ends_inside(tmp_path):
    """A prompt of token ids may end inside a character (a generation cut off there,
    continued): the output's first tokens finish it, and its text starts with that
    character, as vLLM streams it; it lost the character (U+FFFD for byte-level BPE,
    and with byte fallback the whole next character too)."""
    from conftest import write_sentencepiece_tokenizer

    from treeflash.tokenizer import TextStream, Tokenizer
    write_sentencepiece_tokenizer(tmp_path / "sp")
    for tok in (Tokenizer(tmp_path / "sp"), Tokenizer(builtin_paths()[0])):
        ids = tok.encode("ab 日本語 ab", special=False)
        cuts = [k for k in range(1, len(ids)) if tok.unfinished_from(ids[:k]) is not None]
        assert cuts
        for k in cuts:
            head = tok.decode(ids[:tok.unfinished_from(ids[:k])])
            want = tok.decode(ids)[len(head):]
            assert tok.decode_continuation(ids[k:], ids[:k]) == want, (k, want)
            stream = TextStream(tok, context=ids[:k])
            assert "".join(stream.push([t]) for t in ids[k:]) + stream.finish(want) == want
            # output that only goes on with that character has no text yet (it was U+FFFD)
            more = next(n for n in range(k + 1, len(ids) + 1) if tok.unfinished_from(ids[:n]) is None)
            assert all(tok.decode_continuation(ids[k:n], ids[:k]) == "" for n in range(k, more))
    # a context that ends in a token holding a whole character and a lead byte, then
    # output that begins another character: the stray byte is left out, not U+FFFD
    tok = Tokenizer(builtin_paths()[0])
    mixed = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b" \xe2")
    context, out = tok.encode("x = a", special=False) + [mixed], tok.encode("b = 1", special=False)
    assert tok.decode_continuation(out, context) == "b = 1"
    stream = TextStream(tok, context=context)
    assert "".join(stream.push([t]) for t in out) == "b = 1"


def test_a_byte_level_decoder_inside_a_sequence_streams_whole_characters(tmp_path):
    """Some tokenizer.json files wrap the ByteLevel decoder in a Sequence: a token that
    holds part of a character is still those bytes, so the stream waits for the rest
    (it sent U+FFFD for every split character while the final text was right)."""
    from treeflash.tokenizer import TextStream, Tokenizer
    spec = json.loads((builtin_paths()[0] / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "Sequence", "decoders": [spec["decoder"]]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = Tokenizer(tmp_path)
    text = "Hi 😀 日本語 ok"
    ids = tok.encode(text, special=False)
    assert any(tok.unfinished_from(ids[:k]) is not None for k in range(len(ids)))
    stream = TextStream(tok)
    deltas = [stream.push([t]) for t in ids]
    assert "".join(deltas) == text and all("\ufffd" not in d for d in deltas)
    cut = next(k for k in range(len(ids), 0, -1) if tok.unfinished_from(ids[:k]) is not None)
    assert tok.decode_continuation(ids[:cut]) == tok.decode(ids[:tok.unfinished_from(ids[:cut])])


def test_truncate_prompt_tokens_keeps_the_last_tokens(hf_checkpoint):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens, whatever its length
    (-1: as many as fit), so an over-long prompt is read, not refused."""
    llm = LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float32", max_model_len=48)
    ids = [(7 * i) % 50 + 3 for i in range(llm.max_model_len + 20)]
    params = SamplingParams(max_new_tokens=5)
    for k, kept in ((12, 12), (-1, llm.max_model_len - 1)):
        got = llm.generate(ids, replace(params, max_new_tokens=1 if k == -1 else 5, truncate_prompt_tokens=k))[0]
        want = llm.generate(ids[-kept:], replace(params, max_new_tokens=1 if k == -1 else 5))[0]
        assert got.token_ids == want.token_ids and len(got.token_ids) >= 1
    with pytest.raises(ContextLengthError, match="maximum context length is 48 tokens: a prompt of 68 tokens"):
        llm.generate(ids, params)
    # a text too long to fit whatever its tokens is refused before it is tokenized (the
    # tokenizer is not called), unless it is to be truncated
    longest = llm.tokenizer.longest_token_bytes
    text = "ab " * (llm.max_model_len * longest)
    calls = []
    real = llm.tokenizer.encode
    llm.tokenizer.encode = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    with pytest.raises(UsageError, match=f"maximum context length is 48 tokens: a prompt of {len(text)} characters does not fit"):
        llm.generate(text, params)
    assert not calls
    got = llm.generate(text, replace(params, truncate_prompt_tokens=12))[0]
    assert calls and len(got.token_ids) == 5
    for k in (48, 5000):  # past the context (vLLM refuses it too), whether or not the prompt would fit
        with pytest.raises(UsageError, match=f"truncate_prompt_tokens {k} does not fit the context limit of 48 "
                                             r"tokens \(at most 47"):
            llm.generate(ids[:5], replace(params, truncate_prompt_tokens=k))
    assert llm.encode(ids, truncate=47) == ids[-47:]
    for k in (0, -2, 1.5, True):
        with pytest.raises(UsageError, match="truncate_prompt_tokens must be"):
            SamplingParams(truncate_prompt_tokens=k)
        with pytest.raises(UsageError, match="truncate must be an integer >= 1, or -1"):  # 0 kept all, -2 cut 2
            llm.encode("ab ab", truncate=k)
    with pytest.raises(UsageError, match="special must be true or false"):
        llm.encode("ab", special="no")
    # so is a conversation whose rendered text cannot fit (it took the tokenizer 26 s at 20 MB)
    from treeflash.chat import ChatTemplate
    llm.chat_template = ChatTemplate("{{ messages[0].content }}")
    calls.clear()
    with pytest.raises(UsageError, match=f"a prompt of {len(text)} characters does not fit"):
        llm.chat([{"role": "user", "content": text}], params)
    assert not calls
    got = llm.chat([{"role": "user", "content": text}], replace(params, truncate_prompt_tokens=12))[0]
    assert calls and got.token_ids == llm.generate(llm.token_ids(text, special=False)[-12:], params)[0].token_ids


def test_stop_reason_of_an_end_token_also_listed_in_stop_token_ids(llm):
    """EOS ends a request with stop_reason None even where stop_token_ids lists it too
    (as vLLM, and as the README says); with ignore_eos it is only a stop token, and its
    id is the reason."""
    eos = llm.eos_token_ids[0]
    forced = dict(max_new_tokens=4, logit_bias={eos: 100.0}, stop_token_ids=[eos])
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(**forced))[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", None)
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(**forced, ignore_eos=True))[0]
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([eos], "stop", eos)


def test_a_stop_token_that_holds_a_stop_string_ends_the_request_as_a_stop_token(llm):
    """A stop token id whose text holds one of the stop strings ends the request as a stop
    token, include_stop_str_in_output or not (as vLLM checks stop tokens first): stop_reason
    is its id, and the text keeps the token whole or leaves it out. Before, with
    include_stop_str_in_output the stop string was looked for in the token's text, and
    became the stop_reason (a longer token's text was cut after it too)."""
    token = next(t for t in range(3, llm.config.vocab_size) if llm.tokenizer.decode([t]).strip())
    text = llm.tokenizer.decode([token])
    for include in (False, True):
        out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=4, allowed_token_ids=[token],
                                                             stop_token_ids=[token], stop=[text.strip()],
                                                             include_stop_str_in_output=include))[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([token], "stop", token)
        assert out.text == (text if include else "")


def test_allowed_token_ids_that_all_end_the_request_are_taken_without_min_tokens(llm):
    """A request that may only pick one of a few label tokens, each of which ends it
    (allowed_token_ids = stop_token_ids), is served: one label, stop_reason naming it;
    only min_tokens holding every allowed token back is refused."""
    labels = [5, 7]
    out = llm.generate(ENGINE_PROMPTS[0], SamplingParams(allowed_token_ids=labels, stop_token_ids=labels,
                                                         max_new_tokens=4))[0]
    assert len(out.token_ids) == 1 and out.token_ids[0] in labels
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", out.token_ids[0], "")


def test_the_auto_device_is_the_gpu_where_there_is_one(monkeypatch):
    """device="auto", LLM's and the command line's default, runs on the GPU where there is
    one and on the CPU where there is none (not failing there)."""
    from treeflash.engine.options import resolve_device
    for available, want in ((False, "cpu"), (True, "cuda")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        assert resolve_device("auto") == torch.device(want)


def test_structured_outputs_on_a_model_without_an_end_token_need_a_stop_token(llm):
    """A model with no EOS could never end a structured output: refused in one line, unless
    stop_token_ids gives the token that ends it."""
    from treeflash import StructuredOutputs
    from treeflash.engine.requests import RequestRules
    rules = RequestRules(llm.tokenizer, llm.config.vocab_size, eos_token_ids=[])
    choice = StructuredOutputs(choice=["ab"])
    with pytest.raises(UsageError, match="structured outputs need an end token: this model has no EOS, "
                                         "give stop_token_ids"):
        rules.check(SamplingParams(structured_outputs=choice))
    rules.check(SamplingParams(structured_outputs=choice, stop_token_ids=[llm.eos_token_ids[0]]))


def test_bad_words_at_their_limits_are_taken(llm):
    """The bad-word limits are "at most": a word of BAD_WORD_TOKENS tokens, and words that
    make MAX_BAD_SEQUENCES token sequences, are taken; one more is refused, saying so."""
    from treeflash.sampling_params import BAD_WORD_TOKENS, MAX_BAD_SEQUENCES
    rules = llm.rules
    word = "abcdefghijklmnop"[:BAD_WORD_TOKENS]
    assert len(llm.encode(word, special=False)) == BAD_WORD_TOKENS  # one token a letter
    assert rules.bad_sequences(SamplingParams(bad_words=[word])) == [llm.encode(word, special=False)]
    with pytest.raises(UsageError, match=f"is {BAD_WORD_TOKENS + 1} tokens \\(at most {BAD_WORD_TOKENS}\\)"):
        rules.bad_sequences(SamplingParams(bad_words=[word + "q"]))
    words = ["x="] * MAX_BAD_SEQUENCES  # one token sequence each (the spaced spelling is a token longer)
    assert len(rules.bad_sequences(SamplingParams(bad_words=words))) == MAX_BAD_SEQUENCES
    with pytest.raises(UsageError, match=f"make {MAX_BAD_SEQUENCES + 1} token sequences "
                                         f"\\(at most {MAX_BAD_SEQUENCES}\\)"):
        rules.bad_sequences(SamplingParams(bad_words=words + ["x="]))


def test_a_bad_word_with_leading_blanks_is_the_word(llm):
    """Blanks before a bad word do not change what it bans: the word as written and after
    a space, as vLLM strips it (not a word spelled with those blanks)."""
    rules = llm.rules
    assert rules.bad_sequences(SamplingParams(bad_words=["  x="])) == \
        rules.bad_sequences(SamplingParams(bad_words=["x="])) == [llm.encode("x=", special=False)]


def test_the_tree_attention_kernel_is_taken_only_where_every_head_size_fits():
    """On CUDA a model pair runs on the Triton tree-attention kernel only if it has tiles
    for each of their head sizes (a drafter's may differ from its target's); else on the
    SDPA reference, as on the CPU."""
    pytest.importorskip("triton")
    from treeflash.engine.options import attention_backend
    from treeflash.kernels.tree_attention import supports
    cuda, odd = torch.device("cuda", 0), 96  # a head size without tiles
    assert supports(64) and supports(128) and not supports(odd)
    assert attention_backend(cuda, [128, 64]) == "triton"
    assert attention_backend(cuda, [128, odd]) == attention_backend(cuda, [odd, 128]) == "sdpa"
    assert attention_backend(torch.device("cpu"), [128]) == "sdpa"


def test_a_bad_words_spelling_after_a_space_counts_only_with_as_many_tokens():
    """As vLLM: a bad word is banned as written, and after a space only where that spelling
    is as many tokens ("hello", " hello": 3 each); " Python" (one token, "Python" two) is
    not banned, so the engine bans what vLLM bans, no more."""
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32", method="ar")
    encode = llm.tokenizer.encode
    assert len(encode("Python", special=False)) == 2 and len(encode(" Python", special=False)) == 1
    assert llm.rules.bad_sequences(SamplingParams(bad_words=["Python", "hello"])) == \
        [encode("Python", special=False), encode("hello", special=False), encode(" hello", special=False)]


def test_an_engine_closed_by_a_callback_runs_no_further_batch(hf_checkpoint, monkeypatch):
    """`close()` from a callback ends the call: the next command on the closed engine (the
    batch's release, the next max_batch chunk) raises EngineDeadError rather than
    running on an engine whose caches and graphs are gone."""
    from treeflash.errors import EngineDeadError
    llm = LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float32")
    monkeypatch.setattr(llm, "max_batch", 1)
    done = []

    def on_done(i, out):
        done.append(i)
        llm.close()

    with pytest.raises(EngineDeadError, match="closed"):
        llm.generate(ENGINE_PROMPTS[:2], SamplingParams(max_new_tokens=4), on_done=on_done)
    assert done == [0]


def test_a_sentencepiece_continuation_after_skipped_special_tokens_keeps_its_first_space(tmp_path):
    """A prompt that ends in special tokens (skip_special_tokens leaves them out of every
    decode): the continuation keeps the space its first piece carries, in the text and
    the stream, however many there are. The context window counted them: past four, it
    held no text, and " ab" was decoded as a text's start ("ab")."""
    from conftest import write_sentencepiece_tokenizer

    from treeflash.tokenizer import CONTEXT_TOKENS, TextStream, Tokenizer
    write_sentencepiece_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"additional_special_tokens": ["<sep>"]}))
    tok = Tokenizer(tmp_path)
    sep, gen = tok.tok.token_to_id("<sep>"), tok.encode(" ab", special=False)
    assert sep in tok.special_ids
    for k in range(CONTEXT_TOKENS + 2):
        prompt = tok.encode("ab ab", special=False) + [sep] * k
        want = tok.decode(prompt + gen)[len(tok.decode(prompt)):]
        assert want == "  ab" and tok.decode_continuation(gen, prompt) == want, k
        stream = TextStream(tok, context=prompt)
        assert "".join(stream.push([t]) for t in gen) == want, k


def test_an_added_token_spelled_outside_the_byte_level_alphabet_is_its_text():
    """An added token whose text holds characters byte-level BPE's alphabet has none for
    (DeepSeek's "<｜end▁of▁sentence｜>"): the decoder leaves it as written, so its bytes
    are its text's UTF-8, and a continuation after it decodes (it raised KeyError)."""
    from treeflash.tokenizer import TextStream, Tokenizer
    path = builtin_paths()[0]
    tok = Tokenizer(path)
    token = "<\uff5cend\u2581of\u2581sentence\uff5c>"
    tok.tok.add_tokens([token])
    ids = tok.encode(f"def f{token}x = 1", special=False)
    added = tok.tok.token_to_id(token)
    assert added in ids and tok.token_bytes(added) == token.encode() and tok.token_text(added) == token
    cut = ids.index(added) + 1
    whole = tok.decode(ids)[len(tok.decode(ids[:cut])):]
    assert tok.decode_continuation(ids[cut:], ids[:cut]) == whole == "x = 1"
    stream = TextStream(tok, context=ids[:cut])
    assert "".join(stream.push([t]) for t in ids[cut:]) == whole


def test_a_stream_hands_out_all_text_no_stop_string_can_still_claim():
    """Without stop strings each push hands out its whole text at once; with them, all but
    the last len(longest stop) - 1 characters, which could still begin one."""
    from treeflash.tokenizer import TextStream, Tokenizer
    tok = Tokenizer(builtin_paths()[0])
    pieces = ["Hello", " there", ", friend"]
    stream = TextStream(tok)
    assert [stream.push(tok.encode(p, special=False)) for p in pieces] == pieces
    stop = " world"
    stream = TextStream(tok, stop=[stop])
    text = "".join(pieces)
    assert "".join(stream.push(tok.encode(p, special=False)) for p in pieces) == text[:len(text) - (len(stop) - 1)]
    assert stream.finish(text) == text[len(text) - (len(stop) - 1):]


def test_auto_dtype_reads_torch_prefixed_names_and_runs_half_checkpoints_in_float32_on_the_cpu():
    """dtype "auto": a config's "torch.bfloat16" (older transformers' spelling, which the
    engine accepts) is bfloat16 on a GPU, not float32; a float16 checkpoint runs in
    float32 on the CPU as a bfloat16 one does (CPU half-precision matmuls are slow)."""
    from treeflash.engine.options import resolve_dtype
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_dtype("auto", "torch.bfloat16", cuda) == torch.bfloat16
    assert resolve_dtype("auto", "torch.float16", cuda) == torch.float16
    for stored in ("float16", "torch.float16", "bfloat16"):
        assert resolve_dtype("auto", stored, cpu) == torch.float32, stored
    assert resolve_dtype("float16", "float32", cpu) == torch.float16  # asked for: as asked


def test_a_budget_of_exactly_max_budget_is_taken_and_one_more_refused():
    """max_budget is the largest tree a ddtree engine verifies: a budget equal to it is
    taken, one node more is refused."""
    from treeflash.engine.options import tree_budget
    cpu = torch.device("cpu")
    assert tree_budget("ddtree", 32, 32, cpu) == 32
    with pytest.raises(UsageError, match="ddtree budget 33 exceeds max_budget 32"):
        tree_budget("ddtree", 33, 32, cpu)
