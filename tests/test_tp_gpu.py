"""Tensor parallelism on GPUs (issue 9): TP = 2 over NCCL, with CUDA graphs on and off.
Skipped unless two GPUs are visible; the CPU side (gloo) is tests/test_tp.py, whose
request sets and driver script are reused here.

- `LLM(..., tp=2)` (the engine starts its worker on cuda:1) gives exactly the TP = 1
  tokens, in the same rounds, for ar, dflash and ddtree (budget 64), greedy, sampled and
  filtered requests (test_tp's CONFIGS), single and batched: on the built-in pair and on
  a random target with Qwen3-8B's widths (2 layers) and a random 1-layer drafter. All in
  float32, where a different reduction order cannot flip a near-tie as bf16 can.
- Logprobs (gathered over the vocabulary shards) equal TP = 1's.
- Prefix caching reuses the conversation on both ranks, with TP = 1's tokens.
- A batch too large for the GPUs fails with one line and the engine goes on.
- Closing an engine whose rounds ran as CUDA graphs returns at once.
- A worker killed mid-generation ends the driver promptly with one line naming the rank
  (graphs on: the NCCL kernels waiting on the dead peer sit inside a replayed graph),
  and no worker outlives it.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings

import pytest
import torch

from treeflash import LLM
from treeflash.checkpoints import write_random_drafter, write_random_target, write_tiny_tokenizer
from treeflash.engine.options import builtin_paths
from treeflash.engine.tp import ABORT_S

from test_tp import BATCH, CONFIGS, DRIVER, REPO, _gone, _run, exit_after_kill  # pytest puts tests/ on sys.path

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

QWEN3_8B_WIDTHS = dict(hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288,
                       vocab_size=151936)
PAIRS = ["builtin", "qwen3-8b-widths"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """name -> (target, drafter). The random target's peaked LM-head rows make its
    choices clear-cut and let the random drafter (which shares the head) get accepted."""
    root = tmp_path_factory.mktemp("tp-gpu")
    write_tiny_tokenizer(root / "target")  # decodes ids below 259; prompts are token ids
    target = write_random_target(root / "target", num_layers=2, peaked_tokens=8, **QWEN3_8B_WIDTHS)
    drafter = write_random_drafter(target, root / "drafter", num_layers=1, block_size=8)
    return {"builtin": builtin_paths(), "qwen3-8b-widths": (target, drafter)}


@pytest.fixture(scope="module")
def engines(pairs):
    """engines(pair, method, tp, graphs, caching=False) -> LLM (float32, budget 64 for
    ddtree; prefix caching if asked), built once; all TP = 2 engines share one worker."""
    built: dict = {}

    def get(pair: str, method: str, tp: int, graphs: bool, caching: bool = False) -> LLM:
        key = (pair, method, tp, graphs, caching)
        if key not in built:
            target, drafter = pairs[pair]
            built[key] = LLM(target, draft_model=None if method == "ar" else drafter, method=method,
                             budget=64 if method == "ddtree" else None, device="cuda", dtype="float32", tp=tp,
                             cuda_graphs=graphs, enable_prefix_caching=caching)
        return built[key]

    yield get
    for llm in built.values():
        llm.close()


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize("pair", PAIRS)
def test_tp2_tokens_equal_tp1(pair, method, graphs, engines):
    tp1, tp2 = engines(pair, method, 1, graphs), engines(pair, method, 2, graphs)
    for config in CONFIGS:
        (want, want_rounds), (got, rounds) = _run(tp1, config), _run(tp2, config)
        assert got == want, f"{pair} {method} graphs={graphs} {config}: tokens differ from tp=1"
        assert rounds == want_rounds, f"{pair} {method} graphs={graphs} {config}: other trees than tp=1"
    assert bool(tp2.states.graphed) == graphs  # the rounds ran as captured graphs (or not)


def test_comparisons_are_not_vacuous(engines):
    """Sampling changes the built-in pair's stream, and drafts get accepted at TP = 2."""
    ar = engines("builtin", "ar", 1, True)
    assert _run(ar, "greedy")[0] != _run(ar, "sampled")[0]
    for pair in PAIRS:
        out = engines(pair, "ddtree", 2, True).generate(BATCH, CONFIGS["greedy"])
        assert max(o.stats["tau"] for o in out) > 1.2, f"{pair}: no draft accepted"


@pytest.mark.parametrize("pair", PAIRS)
def test_tp2_logprobs_equal_tp1(pair, engines):
    """Logprobs over NCCL, from graphed rounds: TP = 1's tokens, values and alternatives.
    In float32 the sharded LM head and all-reduces round differently from one GEMM, so
    values agree to 1e-4 relative (the 8B-width pair's peaked logits reach the hundreds)
    and two alternatives that close may trade places; a value from a wrong row or shard
    would be off by whole units."""
    from treeflash import SamplingParams
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True, logprobs=4),
              SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=1.0, top_p=0.9, seed=5, logprobs=1)]
    want = engines(pair, "ddtree", 1, True).generate(BATCH[:2], params)
    got = engines(pair, "ddtree", 2, True).generate(BATCH[:2], params)
    close = dict(rel=1e-4, abs=1e-3)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(g.token_ids)
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, **close), (a, b)
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], **close), (a, b)
            for (i, v), (j, u) in zip(a.top, b.top):
                assert i == j or (v == pytest.approx(u, **close) and j in dict(a.top)), (a, b)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_prefix_caching_under_tp(graphs, engines):
    """A next turn on a TP = 2 engine with prefix caching prefills only its new tokens on
    both ranks (a suffix prefill graph, or eagerly), in rows that reuse different
    lengths, and gives TP = 1's tokens without caching."""
    from treeflash import SamplingParams
    tp2, tp1 = engines("qwen3-8b-widths", "ddtree", 2, graphs, True), engines("qwen3-8b-widths", "ddtree", 1, graphs)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True),
              SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=3)]
    firsts = [[5, 6, 7] * 40, [9, 10]]
    answers = tp2.generate(firsts, params)
    turns = [f + a.token_ids + [11, 12, 13] for f, a in zip(firsts, answers)]
    got = tp2.generate(turns, params)
    assert [o.stats["cached_tokens"] for o in got] == [len(f) + len(a.token_ids) - 1 for f, a in zip(firsts, answers)]
    assert [o.token_ids for o in got] == [o.token_ids for o in tp1.generate(turns, params)]


def test_dropped_graphs_are_captured_anew_on_every_rank(engines):
    """`drop_graphs` frees the graphed states on both ranks, so the next batch captures
    anew on each, in step, and gives the same tokens (the driver's alone going had it
    run a capture's collectives against the worker's replays)."""
    from treeflash import SamplingParams
    llm = engines("qwen3-8b-widths", "ddtree", 2, True)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=5)
    first = llm.generate([[5, 6, 7, 8]], params)[0].token_ids
    captures = llm.graph_captures
    llm.drop_graphs()
    assert llm.generate([[5, 6, 7, 8]], params)[0].token_ids == first
    assert llm.graph_captures > captures


def test_a_batch_too_large_for_the_gpus_leaves_the_engine_working(engines, monkeypatch):
    """Caches that do not fit the GPUs fail with one line on both ranks at the same
    point (an all-reduce of who failed, before any collective of the batch): the engine,
    graphed, serves the next request with TP = 1's tokens."""
    from treeflash import SamplingParams
    from treeflash.errors import TreeflashError
    tp2, tp1 = engines("qwen3-8b-widths", "ddtree", 2, True), engines("qwen3-8b-widths", "ddtree", 1, True)
    per_request = 2 * 2 * 4 * 2048 * 128 * 4  # K and V, 2 layers, 4 KV heads per rank, 2048 slots, D 128, fp32
    batch = 4 * torch.cuda.mem_get_info(0)[0] // per_request
    monkeypatch.setattr(tp2, "max_batch", batch)  # one batch, not max_batch prompts at a time
    with pytest.raises(TreeflashError, match="not enough cuda memory for a KVCache"):
        tp2.generate([[5, 6, 7]] * batch, SamplingParams(max_new_tokens=2000, ignore_eos=True))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    assert tp2.generate(BATCH, params)[0].token_ids == tp1.generate(BATCH, params)[0].token_ids


# test_tp's driver script on the GPU: argv[6] turns CUDA graphs on or off
GPU_DRIVER = DRIVER.replace('device="cpu"', 'device="cuda", cuda_graphs=sys.argv[6] == "on"')


@pytest.mark.parametrize("graphs", ["on", "off"])
def test_worker_killed_mid_generation(graphs):
    assert GPU_DRIVER.count('device="cuda"') == 1
    target, drafter = builtin_paths()
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", GPU_DRIVER, str(target), str(drafter), "kill", "2", "1", graphs],
                          capture_output=True, text=True, timeout=150, cwd=REPO, start_new_session=True)
    seconds = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1] == "treeflash: error: tensor-parallel worker rank 1 was killed by signal SIGKILL", proc.stderr
    assert "Traceback" not in proc.stderr and "finished" not in proc.stdout, proc.stderr
    if len(lines) > 1:  # torch's C++ logging of the aborted communicator, if any: shown, not failed
        warnings.warn(f"graphs {graphs}: driver stderr had {len(lines) - 1} more lines: {lines[:-1]}")
    pids = json.loads(proc.stdout.splitlines()[0])
    assert all(_gone(p) for p in pids), "a worker outlived the driver"
    assert seconds < 90, f"took {seconds:.0f} s"
    # Eager: the peer all-reduce's abort flag, set first, lets NCCL's abort finish: the
    # driver raises at once. Graphed: NCCL's abort of a communicator that CUDA graphs
    # captured collectives on never returns (torch 2.11), and the monitor ends the
    # driver once the abort has hung for ABORT_S, not after the whole GRACE_S.
    assert exit_after_kill(proc) < (20 if graphs == "off" else ABORT_S + 10), proc.stdout


CLOSE_DRIVER = """
import json, sys, time
from treeflash import LLM, SamplingParams
llm = LLM(sys.argv[1], draft_model=sys.argv[2], method="ddtree", budget=32, device="cuda", dtype="float32", tp=2)
pids = [s["pid"] for s in llm.rank_stats()]
out = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=40, ignore_eos=True))
start = time.monotonic()
llm.close()
print(json.dumps({"pids": pids, "tokens": len(out[0].token_ids), "close_s": time.monotonic() - start}), flush=True)
"""


def test_close_after_graphed_rounds_is_prompt():
    """Closing the last TP engine after its rounds ran as CUDA graphs returns at once and
    the process exits cleanly: an NCCL abort of a communicator that graphs had captured
    collectives on blocked for good (torch 2.11, H200), so a finished one is parked."""
    target, drafter = builtin_paths()
    proc = subprocess.run([sys.executable, "-c", CLOSE_DRIVER, str(target), str(drafter)],
                          capture_output=True, text=True, timeout=150, cwd=REPO, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    assert "terminate called" not in proc.stderr, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    assert report["tokens"] == 40 and report["close_s"] < 5, report
    assert all(_gone(p) for p in report["pids"]), "a worker outlived the engine"
