"""Pipelined generation: `LLM.generate` keeps one round in flight (`_step` launches
round r and returns round r-1's tokens), so a request that finishes at round r-1 still
runs, ignored, in round r. Outputs, finish reasons and round / tau stats must be those
of the synchronous loop (one round, read back, then the next); the cache must hold the
extra round; eager attention reads (`max_n`) must cover the round in flight.
"""
from __future__ import annotations

import pytest
import torch
from conftest import ENGINE_PROMPTS, SPEC_PROMPTS
from cpu_graphs import cpu_graphs

from treeflash import LLM, SamplingParams
from treeflash.engine.pipeline import RoundPipeline
from treeflash.engine.sampling import SamplingBatch


@pytest.fixture(scope="module")
def engines(spec_target, spec_drafter):
    """AR, DDTree and DFlash engines (float64: no near-ties between batch shapes) on a
    peaked random target whose rounds commit several tokens. Their EOS (read by the
    host alone) is set to a token that first appears mid-stream for ENGINE_PROMPTS[0]."""
    target, drafter = spec_target("qwen3", "peaked"), spec_drafter("qwen3", "peaked", 8)
    kw = dict(device="cpu", dtype="float64")
    engines = {"ar": LLM(target, method="ar", **kw),
               "ddtree": LLM(target, draft_model=drafter, method="ddtree", budget=16, **kw),
               "dflash": LLM(target, draft_model=drafter, method="dflash", **kw)}
    full = engines["ar"].generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    step = next(i for i in range(9, 40) if full.token_ids[i] not in full.token_ids[:i])
    for llm in engines.values():
        llm.rules.eos_token_ids = [full.token_ids[step]]
    engines["eos_stream"] = full.token_ids[:step + 1]
    return engines


def sync_generate(llm: LLM, prompts, params: list[SamplingParams]):
    """The synchronous loop the engine ran before pipelining, on `SpeculativeDecoder.round`
    directly: run a round, read it back, process it, then launch the next.
    Returns (token ids, finish reasons, rounds) per request."""
    dec = llm.decoder
    ids = [llm.encode(p) for p in prompts]
    limits = [min(p.max_new_tokens, llm.max_model_len - len(i)) for p, i in zip(params, ids)]
    max_len = max(len(i) + m for i, m in zip(ids, limits)) + 2 * dec.tree_slots + 2
    st = dec.new_state(len(ids), max_len, SamplingBatch.from_params(params, llm.device))
    dec.prefill(st, ids)
    outs, rounds = [[] for _ in ids], [1] * len(ids)
    done, reasons = [False] * len(ids), ["length"] * len(ids)
    new, counts = [[t] for t in st.anchor.tolist()], [1] * len(ids)
    while True:
        for b in range(len(ids)):
            if done[b] or counts[b] == 0:
                continue
            before = len(outs[b])
            stop = llm.rules.append_until_end(new[b][:counts[b]], outs[b], params[b], limits[b])
            if params[b].stop and llm.rules.cut_at_stop_string(outs[b], before, params[b], ids[b]):
                stop = "stop"
            if stop:
                done[b], reasons[b] = True, stop
        if all(done):
            break
        st.active.copy_(torch.tensor([not d for d in done]))
        new_t, counts_t, _ = dec.round(st, max(len(i) + len(o) for i, o in zip(ids, outs)))
        new, counts = new_t.tolist(), counts_t.tolist()
        for b in range(len(ids)):
            rounds[b] += not done[b]
    return outs, reasons, rounds


def mixed_params(ar: LLM, prompts) -> list[SamplingParams]:
    """Requests that finish at different rounds: short and long limits, an EOS (a token
    that first appears mid-stream is made the EOS of the test engines), a stop string,
    a sampled request."""
    full = ar.generate(prompts[1], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    text = full.text
    start = len(ar.tokenizer.decode(full.token_ids[:12]))
    stop = next(text[i:i + 2] for i in range(start, len(text) - 2)
                if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    return [SamplingParams(max_new_tokens=3, ignore_eos=True),
            SamplingParams(max_new_tokens=40, ignore_eos=True, stop=[stop]),
            SamplingParams(max_new_tokens=40),  # ends at the test EOS
            SamplingParams(max_new_tokens=33, ignore_eos=True),
            SamplingParams(max_new_tokens=17, temperature=1.0, seed=5, ignore_eos=True),
            SamplingParams(max_new_tokens=1, ignore_eos=True)]


def test_the_test_eos_ends_a_stream_mid_way(engines):
    out = engines["ar"].generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=40))[0]
    assert out.finish_reason == "stop" and out.token_ids == engines["eos_stream"]


PROMPTS = [ENGINE_PROMPTS[2], ENGINE_PROMPTS[1], ENGINE_PROMPTS[0], SPEC_PROMPTS[6], SPEC_PROMPTS[9], [5, 6]]


@pytest.mark.parametrize("method", ["ar", "ddtree", "dflash"])
def test_mixed_batch_equals_alone_and_ar_and_the_synchronous_loop(engines, method):
    ar, llm = engines["ar"], engines[method]
    params = mixed_params(ar, PROMPTS)
    seen = {b: [] for b in range(len(PROMPTS))}
    outs = llm.generate(PROMPTS, params, on_tokens=lambda b, ids: seen[b].extend(ids))
    reasons = [o.finish_reason for o in outs]
    assert reasons[0] == "length" and reasons[1] == "stop" and reasons[2] == "stop" and reasons[5] == "length"
    assert [len(outs[b].token_ids) for b in (0, 3, 4, 5)] == [3, 33, 17, 1]
    # streaming saw every token once, in order
    assert seen == {b: o.token_ids for b, o in enumerate(outs)}
    for prompt, p, out in zip(PROMPTS, params, outs):
        alone = llm.generate([prompt], [p])[0]
        auto = ar.generate([prompt], [p])[0]
        assert out.token_ids == alone.token_ids == auto.token_ids
        assert out.text == alone.text == auto.text
        assert out.finish_reason == alone.finish_reason == auto.finish_reason
    # rounds and tau: those of the synchronous loop, request by request
    ref_outs, ref_reasons, ref_rounds = sync_generate(llm, PROMPTS, params)
    assert [o.token_ids for o in outs] == ref_outs and reasons == ref_reasons
    assert [o.stats["rounds"] for o in outs] == ref_rounds
    assert [o.stats["tau"] for o in outs] == [round(len(t) / r, 4) for t, r in zip(ref_outs, ref_rounds)]
    if method != "ar":
        assert max(o.stats["tau"] for o in outs) > 1.1  # speculating: some rounds commit several tokens
    if method == "ar":
        assert all(o.stats["rounds"] == len(o.token_ids) for o in outs)


def test_consecutive_calls_give_the_same_results(engines):
    llm = engines["ddtree"]
    params = mixed_params(engines["ar"], PROMPTS)
    first = llm.generate(PROMPTS, params)
    other = llm.generate(PROMPTS[3:], SamplingParams(max_new_tokens=9, ignore_eos=True))  # a round left in flight
    again = llm.generate(PROMPTS, params)
    assert [(o.token_ids, o.finish_reason, o.stats["rounds"]) for o in again] \
        == [(o.token_ids, o.finish_reason, o.stats["rounds"]) for o in first]
    assert [o.token_ids for o in other] == [o.token_ids for o in llm.generate(PROMPTS[3:], SamplingParams(
        max_new_tokens=9, ignore_eos=True))]


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 4), ("ddtree", 12), ("ar", None)])
def test_cache_holds_the_round_in_flight_and_max_n_covers_it(constant_pair, method, budget):
    """Worst case for the cache: a perfect drafter (every round commits depth + 1), the
    request with the largest prompt + limit finishing at its first round (overshooting
    its limit by depth, then running one more round as active) while another request
    goes on. Before every round, `max_n` >= each request's n and the reads and the
    round's writes fit the cache."""
    target, perfect, _ = constant_pair(8)
    llm = LLM(target, draft_model=None if method == "ar" else perfect, method=method, budget=budget,
              device="cpu", dtype="float32")
    dec, checked = llm.decoder, []
    plain = dec.round

    def round_checked(st, max_n):
        n = st.n.tolist()
        assert max_n >= max(n)
        assert max(n) + dec.tree_slots <= st.cache.max_len and max_n + dec.tree_slots <= st.cache.max_len
        checked.append(n)
        return plain(st, max_n)

    dec.round = round_checked
    prompts = [list(range(3, 43)), [5]]
    params = [SamplingParams(max_new_tokens=2, ignore_eos=True), SamplingParams(max_new_tokens=40, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [2, 40]
    assert len(checked) >= 4
    per_round = dec.depth + 1
    # request 0 committed as much in the round in flight as in its one useful round
    assert checked[-1][0] == 40 + 2 * (checked[1][0] - 40)
    if method != "ar":
        assert outs[1].stats["tau"] > 4
        if budget is None or budget >= dec.depth:
            assert checked[-1][0] == 40 + 2 * per_round  # depth + 1 each: the worst case
    assert outs[0].stats["rounds"] == 2  # prefill + the one round it used


def test_a_capture_on_a_state_left_at_its_cache_end_fits_the_cache(constant_pair, monkeypatch):
    """Capturing a new sampling mode's round on a kept graphed state runs warm-up rounds
    on it, which the batch before may have left at the end of its cache (a perfect
    drafter: every round commits depth + 1, a prompt + limit that fills the bucket).
    They start from n = 0: every round, warm-ups included, fits the cache."""

    from treeflash.engine.states import state_key
    target, perfect, _ = constant_pair(8)
    llm = cpu_graphs(monkeypatch, LLM(target, draft_model=perfect, method="dflash", device="cpu", dtype="float32"))
    dec, plain = llm.decoder, llm.decoder.round

    def round_checked(st, max_n=None):
        assert int(st.n.max()) + dec.tree_slots <= st.cache.max_len
        return plain(st, max_n)

    monkeypatch.setattr(dec, "round", round_checked)
    limit, bucket = 8, state_key(1, 1)[1]  # the smallest bucket
    prompt = [5] * (bucket - dec.tree_slots - 2 * (dec.depth + 1) - limit)  # its cache headroom, to the slot
    greedy = SamplingParams(max_new_tokens=limit, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=limit, ignore_eos=True, temperature=1.0, seed=0)
    assert len(llm.generate(prompt, greedy)[0].token_ids) == limit
    assert list(llm.states.graphed) == [state_key(1, bucket)]
    assert len(llm.generate([5], sampled)[0].token_ids) == limit  # a new mode on that state: captured


def test_prompt_logprobs_on_a_graphed_engine_are_the_eager_engines(spec_target, monkeypatch):
    """A request asking for prompt_logprobs in a batch of a graphed engine gets them
    (its prefill runs eagerly: a prefill graph scores no prompt), as an eager engine
    gives them, and its batch's tokens are the same; the request that did not ask gets None."""
    target = spec_target("qwen3", "peaked")
    eager = LLM(target, method="ar", device="cpu", dtype="float64")
    graphed = cpu_graphs(monkeypatch, LLM(target, method="ar", device="cpu", dtype="float64"))
    params = [SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_new_tokens=4, ignore_eos=True)]
    want, got = eager.generate(ENGINE_PROMPTS[:2], params), graphed.generate(ENGINE_PROMPTS[:2], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want] and got[1].prompt_logprobs is None
    assert len(got[0].prompt_logprobs) == len(eager.encode(ENGINE_PROMPTS[0])) > 1
    assert [e.logprob for e in got[0].prompt_logprobs[1:]] == \
        pytest.approx([e.logprob for e in want[0].prompt_logprobs[1:]], abs=1e-9)


def test_round_pipeline_returns_the_previous_round_from_its_own_copy():
    """The outputs of a graph are static buffers, overwritten by the next replay: the
    pipeline copies them at push time and hands back round r-1 when round r is pushed."""
    pipe = RoundPipeline()
    new, counts = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long)
    got = []
    for r in range(5):
        new.fill_(r)
        counts.fill_(10 + r)
        got.append(pipe.push(new, counts))
    assert got[0] is None
    for r in range(1, 5):
        assert got[r] == ([[r - 1] * 3] * 2, [10 + r - 1] * 2)
    assert pipe.finish() == ([[4] * 3] * 2, [14] * 2)
    assert pipe.finish() is None


# ---------------------------------------------------------------------------
# GPU (skipped without CUDA): pinned buffers, events, graphs
# ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_round_pipeline_on_a_busy_gpu():
    """Round r's copy is queued behind a slow kernel; round r-1 is read meanwhile. A
    CUDA graph writes the same output buffers every replay."""
    x = torch.randn(4096, 4096, device="cuda")
    step = torch.zeros((), dtype=torch.long, device="cuda")
    new, counts = torch.zeros(4, 8, dtype=torch.long, device="cuda"), torch.zeros(4, dtype=torch.long, device="cuda")

    def body():
        y = x @ x  # slow enough that the host runs ahead
        step.add_(1)
        new.copy_(step.expand(4, 8) + (y[0, 0] * 0).long())
        counts.copy_(step.expand(4) * 2)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    step.zero_()
    pipe, got = RoundPipeline(), []
    for _ in range(20):
        graph.replay()
        got.append(pipe.push(new, counts))
    got.append(pipe.finish())
    assert got[0] is None
    for r in range(1, 21):
        assert got[r] == ([[r] * 8] * 4, [2 * r] * 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_mixed_batch_on_the_gpu(spec_target, spec_drafter, graphs):
    target, drafter = spec_target("qwen3", "peaked"), spec_drafter("qwen3", "peaked", 8)
    llm = LLM(target, draft_model=drafter, method="ddtree", budget=16, device="cuda", dtype="float32",
              cuda_graphs=graphs)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=t, seed=i)
              for i, (n, t) in enumerate([(3, 0.0), (40, 0.0), (17, 1.0), (1, 0.0), (29, 0.0)])]
    prompts = PROMPTS[:5]
    outs = llm.generate(prompts, params)
    again = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]
    assert [o.stats["rounds"] for o in outs] == [o.stats["rounds"] for o in again]
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == llm.generate([prompt], [p])[0].token_ids
    assert [len(o.token_ids) for o in outs] == [3, 40, 17, 1, 29]


def test_tree_slots_cover_the_drafters_block(spec_target, spec_drafter):
    """`tree_slots` (the cache slots a round needs past the committed prefix, which the
    engine's headroom and `bench --shape`'s tight capacity count on) covers the
    drafter's block as well as the tree: a DDTree of fewer nodes than the block still
    writes the whole block into the drafter's cache. A state of exactly n + tree_slots
    slots runs its round."""
    from treeflash.engine.sampling import SamplingBatch
    target, drafter = spec_target("qwen3", "peaked"), spec_drafter("qwen3", "peaked", 8)
    llm = LLM(target, draft_model=drafter, method="ddtree", budget=3, device="cpu", dtype="float64")
    dec, prompt = llm.decoder, SPEC_PROMPTS[2]
    assert dec.tree_slots == 8  # the block (8), not the tree (3 + 1)
    st = dec.new_state(1, len(prompt) + dec.tree_slots, SamplingBatch.from_params([SamplingParams()], "cpu"))
    dec.prefill(st, [prompt])
    new, counts, _ = dec.round(st, len(prompt))
    assert 1 <= int(counts[0]) <= 4
