"""Prefix caching (`LLM(enable_prefix_caching=True)`): a chat's next turn prefills only
what the caches do not hold yet, and its tokens are those of an engine that prefills
the whole prompt (float64, every method, greedy and sampled, batched, with TP)."""
from __future__ import annotations

import gc
import re
import weakref

import pytest

import treeflash.engine.graphs as graphs_module
from cpu_graphs import cpu_graphs
from treeflash import LLM, SamplingParams, StructuredOutputs
from treeflash.engine.options import builtin_paths
from treeflash.engine.round import BatchState
from treeflash.engine.sampling import SamplingBatch
from treeflash.engine.states import GRAPHED_PREFILL_MAX, common_prefix, state_key, suffix_chunks
from treeflash.errors import UsageError

GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=1.0, top_p=0.9, seed=4)


@pytest.fixture(scope="module")
def engines():
    """engines(method, caching) -> LLM on the built-in pair (float64, CPU), built once."""
    built: dict = {}

    def get(method: str, caching: bool) -> LLM:
        if (method, caching) not in built:
            built[method, caching] = LLM(method=method, device="cpu", dtype="float64",
                                         enable_prefix_caching=caching)
        return built[method, caching]
    return get


def _turns(llm: LLM, params: SamplingParams):
    """A first turn, then the next one: the conversation so far (prompt and answer) and a
    new question, as a chat template renders it."""
    first = llm.encode("def fib(n):")
    answer = llm.generate(first, params)[0]
    return first, answer, first + answer.token_ids + llm.encode("\n\ndef add(a, b):", special=False)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_next_turn_prefills_only_the_new_tokens(engines, method, params):
    llm, fresh = engines(method, True), engines(method, False)
    first, answer, turn = _turns(llm, params)
    assert answer.stats["cached_tokens"] == 0 or answer.stats["cached_tokens"] < len(first)
    got = llm.generate(turn, params)[0]
    # everything but the answer's last token (never run through the target) was held
    assert got.stats["cached_tokens"] == got.num_cached_tokens == len(first) + len(answer.token_ids) - 1
    assert got.token_ids == fresh.generate(turn, params)[0].token_ids
    assert "cached_tokens" not in fresh.generate(turn, params)[0].stats


def test_shared_part_of_a_prompt_is_reused(engines):
    """The same prompt again reuses all but its last token; a prompt that parts from the
    last one after k tokens reuses k; one with nothing in common, none."""
    llm, fresh = engines("ddtree", True), engines("ddtree", False)
    base = llm.encode("class Stack:\n    def push(self, x):\n        self.items.append(x)")
    llm.generate(base, GREEDY)
    for prompt, cached in [(base, len(base) - 1), (base[:9] + llm.encode(" pop", special=False), 9),
                           ([7] + base, 0)]:
        got = llm.generate(prompt, GREEDY)[0]
        assert got.stats["cached_tokens"] == cached, (prompt, cached)
        assert got.token_ids == fresh.generate(prompt, GREEDY)[0].token_ids


def test_batches_reuse_row_by_row(engines):
    """Request b of a batch runs on row b of the batch before: each reuses what it shares
    with that row's conversation, whatever the other requests share."""
    llm, fresh = engines("ddtree", True), engines("ddtree", False)
    firsts = [llm.encode("def fib(n):"), llm.encode("import os\nimport sys")]
    params = [GREEDY, SAMPLED]
    answers = llm.generate(firsts, params)
    turns = [firsts[0] + answers[0].token_ids + [11, 12],  # the next turn of row 0
             llm.encode("x = 1")]                          # a new conversation on row 1
    got = llm.generate(turns, params)
    assert [o.stats["cached_tokens"] for o in got] == [len(firsts[0]) + len(answers[0].token_ids) - 1, 0]
    assert [o.token_ids for o in got] == [o.token_ids for o in fresh.generate(turns, params)]


def test_conversations_past_max_batch_still_reuse(engines, monkeypatch):
    """With prefix caching a call's prompts are one batch, however many: max_batch
    chunks would each replace the caches the chunk before them left."""
    llm = engines("ar", True)
    monkeypatch.setattr(llm, "max_batch", 2)
    firsts = [llm.encode(t) for t in ("def fib(n):", "import os", "class A:")]
    answers = llm.generate(firsts, GREEDY)
    turns = [f + a.token_ids + [11, 12] for f, a in zip(firsts, answers)]
    got = llm.generate(turns, GREEDY)
    assert len(answers) == len(got) == len(firsts)  # every prompt answered, past max_batch too
    assert [o.stats["cached_tokens"] for o in got] == [len(f) + len(a.token_ids) - 1 for f, a in zip(firsts, answers)]


def test_logprobs_and_prompt_logprobs(engines):
    """A reused prefix gives the same logprobs; prompt logprobs need every position's
    logits, so a request that asks for them prefills its whole prompt."""
    llm, fresh = engines("dflash", True), engines("dflash", False)
    _, _, turn = _turns(llm, GREEDY)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3)
    got, want = llm.generate(turn, params)[0], fresh.generate(turn, params)[0]
    assert got.stats["cached_tokens"] > 0 and got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-9)
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
    scoring = SamplingParams(max_new_tokens=4, ignore_eos=True, prompt_logprobs=2)
    got, want = llm.generate(turn, scoring)[0], fresh.generate(turn, scoring)[0]
    assert got.stats["cached_tokens"] == 0 and got.token_ids == want.token_ids
    assert [x.logprob for x in got.prompt_logprobs[1:]] == pytest.approx([x.logprob for x in want.prompt_logprobs[1:]])


def test_graphed_states_reuse_only_in_a_captured_mode(monkeypatch):
    """On a graphed engine a next turn reuses the kept state only in a sampling mode
    already captured there: capturing a new one runs warm-up rounds on the state from
    slot 0, over the conversation it holds (a 560-token one here). Tokens equal an
    engine's without prefix caching."""
    llm = cpu_graphs(monkeypatch, LLM(method="dflash", device="cpu", dtype="float64", enable_prefix_caching=True))
    fresh = LLM(method="dflash", device="cpu", dtype="float64")
    first = llm.encode("def fib(n):\n" * 150)[:560]
    answer = llm.generate(first, GREEDY)[0]
    turn = first + answer.token_ids + [11, 12]
    logprobs = SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=2)
    for params, cached in [(SAMPLED, 0), (logprobs, 0), (GREEDY, len(turn) - 1), (SAMPLED, len(turn) - 1)]:
        got = llm.generate(turn, params)[0]  # new modes: captured, nothing reused; then reused
        assert got.stats["cached_tokens"] == cached, (params, cached)
        assert got.token_ids == fresh.generate(turn, params)[0].token_ids, (params, cached)
        short = llm.generate([5, 6, 7], params)[0]  # nothing in common: a whole prefill (graphed)
        assert short.stats["cached_tokens"] == 0
        llm.generate(turn, params)  # the state holds this turn again
    modes = {SamplingBatch.mode_of([p]) for p in (SAMPLED, logprobs)}
    assert set(llm.states.graphed[state_key(1, 1024)].rounds) >= modes


def test_a_smaller_structured_output_reuses_a_graphed_state_captured_on_a_larger_table(monkeypatch):
    """A next turn whose structured output needs fewer table rows than the kept state
    holds runs on that table, in the mode captured there already: it reuses the
    conversation's caches (no new capture), with the tokens of an engine without prefix
    caching."""
    llm = cpu_graphs(monkeypatch, LLM(method="ar", device="cpu", dtype="float64", enable_prefix_caching=True))
    fresh = LLM(method="ar", device="cpu", dtype="float64")
    first = llm.encode("def fib(n):")
    large = SamplingParams(max_new_tokens=24, structured_outputs=StructuredOutputs(regex=r"[a-z]{20}"))
    small = SamplingParams(max_new_tokens=8, structured_outputs=StructuredOutputs(regex=r"[a-z]{3}"))
    answer = llm.generate(first, large)[0]
    captures = llm.graph_captures
    turn = first + answer.token_ids + llm.encode("\n\ndef add(a, b):", special=False)
    got = llm.generate(turn, small)[0]
    assert got.stats["cached_tokens"] == len(first) + len(answer.token_ids) - 1
    assert got.token_ids == fresh.generate(turn, small)[0].token_ids and re.fullmatch(r"[a-z]{3}", got.text)
    assert llm.graph_captures - captures <= 1  # the rest's prefill graph at most: no round captured


def test_graphed_engines_replay_suffix_prefills(monkeypatch):
    """On a graphed engine a short next turn (its rest within 512 padded tokens) runs a
    prefill graph over the kept caches, captured once per shape and then replayed: for
    a batch whose rows reuse different lengths too. Tokens equal an engine's without
    prefix caching."""
    llm = cpu_graphs(monkeypatch, LLM(method="ddtree", budget=16, device="cpu", dtype="float64",
                                       enable_prefix_caching=True))
    fresh = LLM(method="ddtree", budget=16, device="cpu", dtype="float64")
    firsts = [llm.encode("def fib(n):"), llm.encode("import os\nimport sys\n\nclass Point:")]
    params = [GREEDY, GREEDY]
    answers = llm.generate(firsts, params)
    captures = []
    for question in ([11, 12], [13, 14, 15]):
        turns = [f + a.token_ids + question for f, a in zip(firsts, answers)]
        got = llm.generate(turns, params)
        captures.append(llm.graph_captures)
        assert [o.stats["cached_tokens"] for o in got] == [len(f) + len(a.token_ids) - 1
                                                          for f, a in zip(firsts, answers)]
        assert [o.token_ids for o in got] == [o.token_ids for o in fresh.generate(turns, params)]
        firsts, answers = turns, got
    assert captures[1] == captures[0]  # the second suffix prefill of that shape replayed
    suffix_graphs = [k for k in llm.states.graphed[state_key(2, 1024)].prefills if k[-3]]
    assert len(suffix_graphs) == 1


def test_prefills_of_up_to_512_padded_tokens_replay_a_graph(spec_target, monkeypatch):
    """A graphed engine captures a batch's prefill of up to GRAPHED_PREFILL_MAX padded
    tokens (a whole chunk of a long cached rest) once per shape, counting the capture,
    and replays it; a longer one runs eagerly."""
    llm = cpu_graphs(monkeypatch, LLM(spec_target("qwen3", "plain"), method="ar", device="cpu", dtype="float64"))
    for extra in (0, 1, 0):
        llm.generate([5] * (GRAPHED_PREFILL_MAX + extra), GREEDY)
    [g] = llm.states.graphed.values()
    assert [k[-2:] for k in g.prefills] == [(1, GRAPHED_PREFILL_MAX)]
    assert llm.graph_captures == len(g.rounds) + len(g.prefills) == 2  # the greedy round, the prefill


def test_rests_prefill_in_chunks_of_at_most_512_tokens():
    """The uncached rest runs in chunks a prefill graph covers (512 padded tokens of the
    batch); a row whose rest ended runs its last token again, so every chunk has every
    row; rows too far apart for a chunk's padded columns to fit the cache: no reuse."""
    p, q = list(range(1200)), list(range(300))
    assert suffix_chunks([p], [100], room=2048) == [([p[100:612]], [100]), ([p[612:1124]], [612]),
                                                    ([p[1124:]], [1124])]
    assert suffix_chunks([p, q], [1000, 10], room=2048) == [([p[1000:], q[10:266]], [1000, 10]),
                                                            ([p[1199:], q[266:]], [1199, 266])]
    assert suffix_chunks([p, q], [1000, 10], room=1216) is None  # 256 columns from slot 1000
    assert suffix_chunks([p], [1199], room=1216) == [([p[1199:]], [1199])]


def test_a_long_rest_gives_the_same_tokens(spec_target, spec_drafter):
    """A next turn that adds more than a chunk (a pasted file) prefills it chunk by chunk,
    in a batch whose other row adds a few tokens: the tokens equal an engine's without
    prefix caching (a random pair with a 2048-token context, float64)."""
    kw = dict(draft_model=spec_drafter("qwen3", "warm"), method="ddtree", budget=16, device="cpu", dtype="float64")
    llm = LLM(spec_target("qwen3", "warm"), enable_prefix_caching=True, **kw)
    fresh = LLM(spec_target("qwen3", "warm"), **kw)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=s) for s in (1, 2)]
    firsts = [[3 + i % 250 for i in range(1100)], [9, 8, 7] * 300]
    answers = llm.generate(firsts, params)
    turns = [firsts[0] + answers[0].token_ids + [5 + i % 200 for i in range(600)],
             firsts[1] + answers[1].token_ids + [11, 12]]
    got = llm.generate(turns, params)
    assert [o.stats["cached_tokens"] for o in got] == [len(f) + len(a.token_ids) - 1 for f, a in zip(firsts, answers)]
    assert [o.token_ids for o in got] == [o.token_ids for o in fresh.generate(turns, params)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphed"])
def test_a_conversation_moves_with_its_cache_bucket(graphs, monkeypatch):
    """A turn that asks for more room than the conversation's cache bucket (1024 slots)
    runs on a larger state, with the conversation's K/V copied over: it prefills only its
    new tokens; the next short turn comes back to a 1024-slot state the same way (on a
    graphed engine: the kept one, whose own record is older)."""
    engine = LLM(method="ddtree", budget=16, device="cpu", dtype="float64", enable_prefix_caching=True)
    llm = cpu_graphs(monkeypatch, engine) if graphs else engine
    fresh = LLM(method="ddtree", budget=16, device="cpu", dtype="float64")
    newline = llm.encode("\n", special=False)
    roomy = SamplingParams(max_new_tokens=1000, stop_token_ids=newline)  # room past 1024 slots
    first, answer, turn = _turns(llm, GREEDY)
    for params, bucket in [(roomy, 2048), (GREEDY, 1024)]:
        got = llm.generate(turn, params)[0]
        assert got.stats["cached_tokens"] == len(first) + len(answer.token_ids) - 1
        assert got.token_ids == fresh.generate(turn, params)[0].token_ids
        held = llm.states.graphed if graphs else {state_key(1, llm.states.kept.cache.max_len): llm.states.kept}
        assert state_key(1, bucket) in held
        first, answer = turn, got
        turn = turn + got.token_ids + llm.encode("\n\ndef sub(a, b):", special=False)


def test_a_failed_batch_leaves_nothing_to_reuse(engines):
    """A batch that ends in an error leaves its caches in no known state: the next
    request prefills its whole prompt."""
    llm, fresh = engines("ddtree", True), engines("ddtree", False)
    first, answer, turn = _turns(llm, GREEDY)

    def broken(i, ids):
        raise RuntimeError("client code failed")
    with pytest.raises(RuntimeError):
        llm.generate(turn, GREEDY, on_tokens=broken)
    got = llm.generate(turn, GREEDY)[0]
    assert got.stats["cached_tokens"] == 0
    assert got.token_ids == fresh.generate(turn, GREEDY)[0].token_ids


def test_a_failed_capture_leaves_nothing_to_reuse(monkeypatch):
    """Capturing a new sampling mode's round runs warm-up rounds over the state's caches
    first: if the capture then fails (out of memory on a GPU), the conversation those
    caches held is gone, and the next turn prefills whole."""
    llm = cpu_graphs(monkeypatch, LLM(method="dflash", device="cpu", dtype="float64", enable_prefix_caching=True))
    fresh = LLM(method="dflash", device="cpu", dtype="float64")
    first, answer, turn = _turns(llm, GREEDY)
    working = graphs_module.capture

    def failing(fn, warmup, pool=None):
        for _ in range(warmup):
            fn()
        raise RuntimeError("CUDA out of memory (simulated)")
    monkeypatch.setattr(graphs_module, "capture", failing)
    with pytest.raises(RuntimeError, match="out of memory"):
        llm.generate([5, 6, 7], SAMPLED)  # a mode new to the state
    monkeypatch.setattr(graphs_module, "capture", working)
    got = llm.generate(turn, GREEDY)[0]
    assert got.stats["cached_tokens"] == 0
    assert got.token_ids == fresh.generate(turn, GREEDY)[0].token_ids


def test_off_by_default_and_checked():
    target, _ = builtin_paths()
    with pytest.raises(UsageError, match="enable_prefix_caching must be true or false"):
        LLM(target, method="ar", device="cpu", enable_prefix_caching="yes")


def test_tensor_parallel_ranks_reuse_alike(engines):
    """At TP = 2 (gloo) the driver decides what is reused and every rank prefills the
    same suffix on its slice: TP = 1's tokens, without prefix caching."""
    fresh = engines("ddtree", False)
    with LLM(method="ddtree", device="cpu", dtype="float64", tp=2, enable_prefix_caching=True) as llm:
        _, answer, turn = _turns(llm, SAMPLED)
        got = llm.generate(turn, SAMPLED)[0]
        assert got.stats["cached_tokens"] > 0
        assert got.token_ids == fresh.generate(turn, SAMPLED)[0].token_ids


def test_a_rest_that_ends_on_a_chunk_boundary_runs_its_last_token_again():
    """A row whose rest ends exactly at the end of a chunk runs its last token again in
    the next chunk (never an empty piece: its first new token comes from that chunk)."""
    p, q = list(range(266)), list(range(600))  # two rows: 256-token chunks; p's rest ends with the first
    chunks = suffix_chunks([p, q], [10, 0], room=2048)
    assert chunks == [([p[10:], q[:256]], [10, 0]), ([p[265:], q[256:512]], [265, 256]),
                      ([p[265:], q[512:]], [265, 512])]
    assert all(piece for pieces, _ in chunks for piece in pieces)


def test_graphed_states_kept_are_the_most_recently_used(monkeypatch):
    """A graphed engine keeps the states of its last GRAPH_STATES batch shapes with their
    graphs, dropping the least recently used first (a shape used again is recent), and
    fewer when the memory budget says so; dropping graphs never lowers the count of
    captures (a /metrics counter)."""
    from treeflash.engine.states import GRAPH_STATES
    llm = cpu_graphs(monkeypatch, LLM(method="ar", device="cpu", dtype="float64"))
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for batch in (1, 2, 3, 4, 1, 5):
        llm.generate([[5, 6, 7]] * batch, params)
    assert GRAPH_STATES == 4 and list(llm.states.graphed) == [state_key(b, 1024) for b in (3, 4, 1, 5)]
    captures = llm.graph_captures
    llm.drop_graphs()
    assert not llm.states.graphed and llm.graph_captures == captures
    llm.states.memory_budget = 0  # room for one state at a time: each new shape drops the others
    for batch in (1, 2):
        llm.generate([[5, 6, 7]] * batch, params)
    assert list(llm.states.graphed) == [state_key(2, 1024)]


def test_a_state_dropped_for_room_is_not_reused(monkeypatch):
    """A next turn that needs a larger cache bucket, where the conversation's state is
    dropped to make room for it (here: one graphed state at most), prefills its whole
    prompt: the tokens of an engine without prefix caching, not a failure."""
    import treeflash.engine.states as states_module
    monkeypatch.setattr(states_module, "GRAPH_STATES", 1)
    llm = cpu_graphs(monkeypatch, LLM(method="ddtree", budget=16, device="cpu", dtype="float64",
                                       enable_prefix_caching=True))
    fresh = LLM(method="ddtree", budget=16, device="cpu", dtype="float64")
    roomy = SamplingParams(max_new_tokens=1000, stop_token_ids=llm.encode("\n", special=False))  # 2048 slots
    _, _, turn = _turns(llm, GREEDY)
    got = llm.generate(turn, roomy)[0]
    assert got.stats["cached_tokens"] == 0 and list(llm.states.graphed) == [state_key(1, 2048)]
    assert got.token_ids == fresh.generate(turn, roomy)[0].token_ids


def test_a_tie_between_kept_states_reuses_the_batchs_own(monkeypatch):
    """Two graphed states that hold as much of a prompt: the batch reuses the one it
    runs on (its cache bucket), with no copy of the prefix from the other."""
    llm = cpu_graphs(monkeypatch, LLM(method="ar", device="cpu", dtype="float64", enable_prefix_caching=True))
    prompt, params = [5, 6, 7, 8], SamplingParams(max_new_tokens=3, ignore_eos=True)
    first = llm.generate(prompt, params)[0].token_ids  # a 1024-slot state: prompt + 2 tokens
    roomy = SamplingParams(max_new_tokens=1100, stop_token_ids=first[:1])  # 2048 slots, ends at once
    assert llm.generate(prompt, roomy)[0].token_ids == first[:1]  # a 2048-slot state: the prompt
    assert list(llm.states.graphed) == [state_key(1, 1024), state_key(1, 2048)]
    turn = prompt + [first[0] + 1]  # parts from both after the prompt's 4 tokens
    copies = []
    monkeypatch.setattr(BatchState, "copy_prefix", lambda st, src, n: copies.append(n))
    assert llm.states.prefix_to_reuse(64, [turn], [params], []) == (state_key(1, 1024), [4])
    got = llm.generate(turn, params)[0]
    assert got.stats["cached_tokens"] == 4 and copies == []


def test_a_short_rest_at_the_end_of_its_cache_bucket(engines):
    """A next turn whose few new tokens sit near the end of the conversation's 1024-slot
    state: their prefill's padded columns are cut to the slots left past the cached
    prefix (PREFILL_ALIGN columns from slot 1001 would run past the cache)."""
    llm, fresh = engines("ar", True), engines("ar", False)
    first = [3 + i % 200 for i in range(1000)]
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    answer = llm.generate(first, params)[0]
    turn = first + answer.token_ids + [5, 6, 7, 8]
    got = llm.generate(turn, params)[0]
    assert state_key(1, llm.states.kept.cache.max_len) == state_key(1, 1024)
    assert got.stats["cached_tokens"] == len(first) + 1
    assert got.token_ids == fresh.generate(turn, params)[0].token_ids


def test_a_short_rest_at_the_end_of_its_cache_bucket_beside_a_short_conversation(engines):
    """In a batch, the padded columns of the rests' prefill are cut to the slots left
    past the row whose cached prefix is longest (not the shortest's): a conversation
    near the end of the 1024-slot state beside one near its start."""
    llm, fresh = engines("ar", True), engines("ar", False)
    firsts = [[3 + i % 200 for i in range(1000)], [5, 6, 7, 8, 9]]
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    answers = llm.generate(firsts, params)
    turns = [firsts[0] + answers[0].token_ids + [5, 6, 7, 8], firsts[1] + answers[1].token_ids + [10, 11]]
    got = llm.generate(turns, params)
    assert state_key(2, llm.states.kept.cache.max_len) == state_key(2, 1024)
    assert [o.stats["cached_tokens"] for o in got] == [len(firsts[0]) + 1, len(firsts[1]) + 1]
    assert [o.token_ids for o in got] == [o.token_ids for o in fresh.generate(turns, params)]


def test_a_kept_state_starts_every_request_afresh(engines):
    """The state a batch is kept on ends with its early finishers marked inactive; the
    next batch on it runs every request from its first round: the tokens, and the rounds
    and tau, of an engine that makes a new state."""
    llm, fresh = engines("ar", True), engines("ar", False)
    llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 12)])
    prompts = [[40, 41], [50, 51, 52]]  # new conversations: nothing to reuse, the same state
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (10, 4)]
    got, want = llm.generate(prompts, params), fresh.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [(o.stats["rounds"], o.stats["tau"]) for o in got] == [(10, 1.0), (4, 1.0)]


def test_a_kept_state_starts_every_structured_output_afresh(engines):
    """A request on a kept state's row that finished early in the batch before (so is
    marked inactive) moves its structured-output state past its first token as a new
    state does: the next tokens follow the constraint after it, and the output matches
    the pattern and is that of an engine that makes a new state."""
    llm, fresh = engines("ar", True), engines("ar", False)
    llm.generate([[5, 6, 7], [8, 9]], [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (2, 12)])
    prompts = [[40, 41], [50, 51, 52]]  # new conversations: nothing to reuse, the same state
    pattern = r"[a-z]{3}[0-9]{3}"
    params = [SamplingParams(max_new_tokens=16, structured_outputs=StructuredOutputs(regex=pattern))] * 2
    got, want = llm.generate(prompts, params), fresh.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert all(re.fullmatch(pattern, o.text) for o in got)


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_a_reused_prefix_drafts_as_a_full_prefill(engines, method):
    """The rest's prefill puts its drafter context after the cached prefix's (not over
    it): the drafts, so the rounds and tau, of the next turn are those of an engine that
    prefills the whole prompt, not only its tokens."""
    llm, fresh = engines(method, True), engines(method, False)
    _, _, turn = _turns(llm, GREEDY)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    got, want = llm.generate(turn, params)[0], fresh.generate(turn, params)[0]
    assert got.stats["cached_tokens"] > 0 and got.token_ids == want.token_ids
    assert (got.stats["rounds"], got.stats["tau"]) == (want.stats["rounds"], want.stats["tau"])
    assert got.stats["tau"] > 1.5  # the drafter is right often: a misplaced context would show


def test_the_shared_prefix_is_counted_token_by_token():
    """`common_prefix` compares long conversations a chunk at a time, yet counts exactly:
    a difference anywhere in a chunk (first token, last, in between) ends the prefix there."""
    a = list(range(1000))
    for k in (0, 1, 100, 255, 256, 257, 300, 511, 512, 999):
        assert common_prefix(a, a[:k] + [-1] + a[k + 1:]) == k, k
    assert common_prefix(a, a) == 1000 and common_prefix(a, a[:600]) == common_prefix(a[:600], a) == 600
    assert common_prefix([], a) == 0


def test_the_kept_state_is_counted_and_freed_on_close():
    """The state kept for the next turn holds caches: `rank_stats` counts them between
    batches, and `close` lets them go (a closed engine the caller still references keeps
    no KV caches)."""
    llm = LLM(method="ar", device="cpu", dtype="float64", enable_prefix_caching=True)
    llm.generate([[5, 6, 7]], GREEDY)
    kept = llm.states.kept
    assert kept is not None and llm.rank_stats()[0]["cache_bytes"] == kept.cache_bytes > 0
    llm.close()
    assert llm.states.held() == []


def test_a_graphed_engine_frees_every_state_on_close(monkeypatch):
    """`close` lets a graphed engine's states go, the last batch's too (it stays the
    batch in flight until the next one starts): a closed engine the caller still
    references keeps no KV caches."""
    llm = cpu_graphs(monkeypatch, LLM(method="ar", device="cpu", dtype="float64"))
    llm.generate([[5, 6, 7]], GREEDY)
    held = [weakref.ref(st) for st in llm.states.held()]
    llm.close()
    gc.collect()
    assert held and all(st() is None for st in held)


def test_a_kept_shape_runs_on_its_graphs_with_every_state_kept(monkeypatch):
    """A batch of a shape already kept replays its graphs: nothing is dropped or
    captured again, even with GRAPH_STATES states kept."""
    llm = cpu_graphs(monkeypatch, LLM(method="ar", device="cpu", dtype="float64"))
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for batch in (1, 2, 3, 4):
        llm.generate([[5, 6, 7]] * batch, params)
    captures = llm.graph_captures
    for batch in (1, 3, 2, 4, 1):
        llm.generate([[8, 9]] * batch, params)
    assert llm.graph_captures == captures
    assert list(llm.states.graphed) == [state_key(b, 1024) for b in (3, 2, 4, 1)]
