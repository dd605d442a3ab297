"""Tensor parallelism (issue 8), CPU part, over gloo.

- TP = 2 and 4 give exactly the TP = 1 tokens for ar, dflash and ddtree, greedy and
  seeded sampling (with and without top-k / top-p), Qwen3 and Llama targets (float64),
  single and batched requests; a biased Llama and a Qwen2 with a sliding window too.
  Worker processes are started once per TP size for the module: all engines of one
  size share them.
- Vocabulary-sharded decisions (argmax with ties, Gumbel sampling, filtered sampling,
  draft top-k with the log-softmax normalizer, the tree built from it) equal the
  whole-vocabulary ones, on ranks simulated by threads.
- Each rank holds ~1/N of the parameter bytes.
- A worker killed mid-generation (SIGKILL), a worker failing (fault hook, via the CLI)
  and Ctrl-C all end the driver promptly with one line naming the rank, and leave no
  worker behind; `--tp` in the CLI gives the TP = 1 tokens.
- Heads / vocabulary not divisible by N, and N beyond the visible GPUs, fail clearly.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from treeflash import LLM, EngineDeadError, SamplingParams, TreeflashError, UsageError
from treeflash.distributed import TPGroup
from treeflash.engine.sampling import SamplingBatch, sample
from tree_oracle import tree_of_logprobs
from treeflash.engine.tree import build_tree

REPO = Path(__file__).resolve().parent.parent
VOCAB = 260  # the tiny tokenizer's 259 ids, padded to a multiple of 4
N_NEW = 20
SINGLE = [[5, 17, 42, 9]]
BATCH = [[7], [12, 30, 31, 40, 41, 8], [100, 3, 4, 5, 6, 7, 8, 9, 10, 11, 60]]


def _configs() -> dict[str, list[SamplingParams]]:
    """name -> params for BATCH (the single prompt uses the last one)."""
    p = lambda **kw: SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, **kw)  # noqa: E731
    return {
        "greedy": [p(), p(), p()],
        "sampled": [p(temperature=0.9, seed=11), p(temperature=1.0, seed=12), p(temperature=0.7, seed=13)],
        # a mixed batch: greedy, unfiltered and filtered requests together
        "filtered": [p(), p(temperature=0.8, seed=22), p(temperature=1.0, top_k=6, top_p=0.9, min_p=0.05, seed=23)],
        # logit_bias, allowed tokens in every rank's vocabulary slice, penalties (each tree
        # node's history, sliced by rank)
        "controls": [p(logit_bias={**dict.fromkeys(range(5, 11), -100.0), 140: 3.0}),
                     p(temperature=0.9, seed=31, presence_penalty=0.6, frequency_penalty=0.4),
                     p(temperature=1.0, top_p=0.9, seed=32, allowed_token_ids=list(range(1, 260, 3)),
                       logit_bias={64: 1.5}, repetition_penalty=1.3)],
    }


CONFIGS = _configs()


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    """arch -> (target, drafter): hidden 64, 4 heads, 4 KV heads, intermediate 128, vocab
    260 (all divisible by 4), 2 layers; 'warm' LM head (drafts get accepted, sampling
    at T ~ 1 changes the stream); a 1-layer drafter with block size 6 tapping both layers."""
    from safetensors.torch import load_file, save_file

    from treeflash.checkpoints import write_random_drafter, write_random_target, write_tiny_tokenizer
    out = {}
    for arch in ("qwen3", "llama"):
        root = tmp_path_factory.mktemp(f"tp-{arch}")
        write_tiny_tokenizer(root / "target")
        target = write_random_target(root / "target", arch=arch, num_layers=2, num_heads=4, num_kv_heads=4,
                                     vocab_size=VOCAB, peaked_tokens=8, std=0.2, seed=3 if arch == "llama" else 2)
        w = load_file(str(target / "model.safetensors"))
        w["lm_head.weight"][3:11] /= 5
        w["lm_head.weight"] *= 0.5
        save_file(w, str(target / "model.safetensors"))
        drafter = write_random_drafter(target, root / "drafter", num_layers=1, block_size=6,
                                       target_layer_ids=[0, 1], seed=4)
        out[arch] = (target, drafter)
    return out


@pytest.fixture(scope="module")
def engines(tp_models):
    """engines(arch, method, tp, draft_mode) -> LLM (float64, budget 12 for ddtree), built once."""
    built: dict = {}

    def get(arch: str, method: str, tp: int, draft_mode: str = "scaled") -> LLM:
        key = (arch, method, tp, draft_mode)
        if key not in built:
            target, drafter = tp_models[arch]
            built[key] = LLM(target, draft_model=None if method == "ar" else drafter, method=method,
                             budget=12 if method == "ddtree" else None, device="cpu", dtype="float64", tp=tp,
                             draft_mode=None if method == "ar" else draft_mode)
        return built[key]

    get.built = built
    yield get
    for llm in built.values():
        llm.close()


@pytest.fixture(scope="module")
def reference(engines):
    """reference(arch, method, config, draft_mode) -> _run(...) at TP = 1 (memoized)."""
    memo: dict = {}

    def get(arch: str, method: str, config: str, draft_mode: str = "scaled"):
        key = (arch, method, config, draft_mode)
        if key not in memo:
            memo[key] = _run(engines(arch, method, 1, draft_mode), config)
        return memo[key]

    return get


def _run(llm: LLM, config: str):
    """(single, batch) token ids, and the rounds each request took: equal rounds mean the
    ranks built the same trees as TP = 1 (acceptance decides how many tokens a round commits)."""
    params = CONFIGS[config]
    single = llm.generate(SINGLE, [params[-1]])
    batch = llm.generate(BATCH, params)
    tokens = (single[0].token_ids, [o.token_ids for o in batch])
    return tokens, [o.stats["rounds"] for o in single + batch]


# ----------------------------------------------------------------------------- end to end

@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tp_tokens_equal_tp1(arch, method, tp, engines, reference):
    llm = engines(arch, method, tp)
    for config in CONFIGS:
        (want, want_rounds), (got, rounds) = reference(arch, method, config), _run(llm, config)
        assert got == want, f"{arch} {method} tp={tp} {config}: tokens differ from tp=1"
        assert rounds == want_rounds, f"{arch} {method} tp={tp} {config}: other trees than tp=1"


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_coupled_drafts_equal_tp1(tp, engines, reference):
    """Coupled draft mode: each rank noises its vocabulary slice with the global ids' noise."""
    llm = engines("qwen3", "ddtree", tp, "coupled")
    for config in ("sampled", "filtered", "controls"):
        assert _run(llm, config) == reference("qwen3", "ddtree", config, "coupled"), config


def test_references_exercise_sampling_filters_and_drafts(engines, reference):
    """The comparisons above are not vacuous: sampling changes the stream, the filters
    change it again, and drafts get accepted (τ > 1) on both architectures."""
    for arch in ("qwen3", "llama"):
        greedy, sampled, filtered, controls = (reference(arch, "ar", c)[0]
                                               for c in ("greedy", "sampled", "filtered", "controls"))
        assert sampled[1] != greedy[1]
        assert filtered[0] != sampled[0]
        assert controls[1][0] != greedy[1][0] and set(controls[0]) <= set(range(1, 260, 3))
        for method in ("dflash", "ddtree"):
            out = engines(arch, method, 2).generate(BATCH, CONFIGS["greedy"])
            assert max(o.stats["tau"] for o in out) > 1.2, f"{arch} {method}: no draft accepted"


def test_param_bytes_per_rank(engines):
    for tp in (2, 4):
        stats = engines("qwen3", "ddtree", tp).rank_stats()
        total = engines("qwen3", "ddtree", 1).rank_stats()[0]["param_bytes"]
        assert [s["rank"] for s in stats] == list(range(tp))
        assert len({s["pid"] for s in stats}) == tp
        for s in stats:
            # everything but the (replicated) norm weights is sharded
            assert abs(s["param_bytes"] - total / tp) < 0.02 * total / tp, (tp, s, total)
            # measured, not asserted positive: a rank whose allocator reuses freed memory grows by 0
            assert s["rss_growth_bytes"] is None or s["rss_growth_bytes"] >= 0


def test_an_eager_engine_frees_its_caches_on_every_rank(engines):
    """Without CUDA graphs a batch's KV caches are freed when it is done, on the workers
    too (they kept them until the next batch); while it runs, each rank holds its share."""
    for tp in (1, 2):
        llm = engines("qwen3", "ddtree", tp)
        during = []
        llm.generate(BATCH, CONFIGS["greedy"], on_tokens=lambda i, ids: during or during.append(llm.rank_stats()))
        assert len(during[0]) == tp and len({s["cache_bytes"] for s in during[0]}) == 1
        assert during[0][0]["cache_bytes"] > 0
        assert [s["cache_bytes"] for s in llm.rank_stats()] == [0] * tp


class CallbackFailed(Exception):
    pass


def test_an_eager_engine_frees_a_failed_batchs_caches(engines):
    """A callback that raises mid-batch ends `generate` with its error, and the batch's
    caches go with it on every rank (they stayed until the next call); the engine then
    generates as before."""
    for tp in (1, 2):
        llm = engines("qwen3", "ddtree", tp)
        expected = llm.generate(BATCH, CONFIGS["greedy"])

        def fail(i, ids):
            raise CallbackFailed(f"request {i}")

        for callbacks in ({"on_tokens": fail}, {"on_done": lambda i, out: fail(i, out)}):
            with pytest.raises(CallbackFailed):
                llm.generate(BATCH, CONFIGS["greedy"], **callbacks)
            assert [s["cache_bytes"] for s in llm.rank_stats()] == [0] * tp, callbacks
        assert [o.token_ids for o in llm.generate(BATCH, CONFIGS["greedy"])] == [o.token_ids for o in expected]


def test_sharding_errors(tp_models, spec_target, clone_checkpoint):
    target, drafter = tp_models["qwen3"]
    start = time.monotonic()
    with pytest.raises(TreeflashError, match=r"vocab_size \(260\) is not divisible by the tensor-parallel size 3"):
        LLM(target, device="cpu", tp=3)
    six_heads = clone_checkpoint(target, num_attention_heads=6, num_key_value_heads=6)
    with pytest.raises(TreeflashError, match=r"num_attention_heads \(6\) is not divisible .* size 4"):
        LLM(six_heads, device="cpu", tp=4)
    with pytest.raises(TreeflashError, match=r"vocab_size \(259\) is not divisible by the tensor-parallel size 2"):
        LLM(spec_target("qwen3", "plain"), device="cpu", tp=2)   # 4 heads, 2 KV heads, vocab 259
    two_kv_heads = clone_checkpoint(target, num_key_value_heads=2)
    with pytest.raises(TreeflashError, match=r"num_key_value_heads \(2\) is not divisible .* size 4"):
        LLM(two_kv_heads, device="cpu", tp=4)
    odd = json.loads((target / "config.json").read_text())["intermediate_size"] + 2  # even, not a multiple of 4
    with pytest.raises(TreeflashError, match=rf"intermediate_size \({odd}\) is not divisible .* size 4"):
        LLM(clone_checkpoint(target, intermediate_size=odd), device="cpu", tp=4)  # heads and vocabulary divide
    assert time.monotonic() - start < 5  # refused before any worker is started
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(UsageError, match="tp must be an integer >= 1"):
            LLM(target, device="cpu", tp=bad)


def test_more_ranks_than_gpus(monkeypatch):
    from treeflash.engine import tp as tp_mod
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    with pytest.raises(TreeflashError, match="tp=4 needs 4 GPUs but 2 are visible"):
        tp_mod.start(4, torch.device("cuda"))
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES"):
        tp_mod.start(2, torch.device("cuda", 1))
    assert os.environ.get("NCCL_NVLS_ENABLE") == "0"  # NVLink multicast stays off for the NCCL ranks


# ----------------------------------------------------------------------------- decisions on threads

class _Done:
    """A finished c10d Work (the simulated ranks' collectives complete in the call)."""

    def is_completed(self):
        return True

    def wait(self):
        return None


class _Shared:
    def __init__(self, n: int):
        self.n, self.slots = n, [None] * n
        self.barrier = threading.Barrier(n, timeout=30)


class _Rank:
    """One rank's view of an in-process group: the ranks are threads meeting at a barrier."""

    def __init__(self, shared: _Shared, rank: int):
        self.shared, self.rank = shared, rank

    def _allgather_base(self, out, x):
        s = self.shared
        s.slots[self.rank] = x.clone()
        s.barrier.wait()
        out.copy_(torch.cat(s.slots, 0))
        s.barrier.wait()
        return _Done()

    def allreduce(self, xs):
        s = self.shared
        s.slots[self.rank] = xs[0].clone()
        s.barrier.wait()
        total = s.slots[0].clone()
        for t in s.slots[1:]:
            total += t
        s.barrier.wait()
        xs[0].copy_(total)
        return _Done()


def on_ranks(n: int, fn):
    """[fn(TPGroup(r, n, ...)) for every rank r], the ranks running concurrently."""
    shared, out, errors = _Shared(n), [None] * n, []

    def run(r):
        try:
            out[r] = fn(TPGroup(r, n, _Rank(shared, r)))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
            shared.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def _shard(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    v = x.shape[-1] // tp.size
    return x[..., tp.rank * v:(tp.rank + 1) * v]


@pytest.mark.parametrize("n", [2, 4])
def test_sharded_argmax_ties_go_to_the_lowest_id(n):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (5, 7, 24), generator=gen).double()   # many ties, across shards too
    logits[0, 0] = 2.0                                                  # all tied: id 0
    logits[0, 1, :] = 0.0
    logits[0, 1, [7, 13, 20]] = 1.0                                    # tie across ranks: id 7
    want = logits.argmax(-1)
    for got in on_ranks(n, lambda tp: tp.argmax(_shard(logits, tp), tp.rank * (24 // n))):
        assert torch.equal(got, want)


@pytest.mark.parametrize("n", [2, 4])
def test_sharded_sampling_equals_whole_vocabulary(n):
    gen = torch.Generator().manual_seed(1)
    B, T = 4, 5
    positions = torch.arange(T).expand(B, T) + 17
    for V, params in ((64, [SamplingParams(temperature=t, seed=s) for t, s in ((0.0, 1), (0.7, 2), (1.0, 3), (1.6, 4))]),
                      (64, [SamplingParams(temperature=1.0, top_k=5, seed=5), SamplingParams(temperature=0.9, seed=6),
                            SamplingParams(), SamplingParams(temperature=1.2, top_p=0.8, seed=7)]),
                      # only top-k rows: the ranks share their 64 largest logits (of slices of
                      # 256-512), not whole rows
                      (1024, [SamplingParams(temperature=1.0, top_k=5, min_p=0.05, seed=8),
                              SamplingParams(temperature=0.9, seed=9),
                              SamplingParams(temperature=1.1, top_k=20, top_p=0.6, seed=10),
                              SamplingParams(temperature=0.5, min_p=0.3, seed=11)])):
        logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
        logits[1, 2, 40:64] = logits[1, 2, :24]   # duplicated values: noise breaks those ties per id
        sb = SamplingBatch.from_params(params, "cpu")
        assert sb.filter_width == (64 if V == 1024 else 16 if sb.any_filtered else 0)
        want = sample(logits, positions, sb)
        for got in on_ranks(n, lambda tp: sample(_shard(logits, tp), positions, sb, tp)):
            assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sharded floor's kernels need a CUDA GPU")
@pytest.mark.parametrize("n", [2, 4])
def test_sharded_filter_floor_kernels(n):
    """On the GPU, the filters' floor of a vocabulary sharded over ranks (each rank's
    mass and search bins summed over the ranks, its window from every rank): a valid
    cut in every row, and mostly the logit one GPU's whole rows give."""
    from sampling_oracle import floor_is_valid
    from treeflash.engine.sampling import filter_floor
    filters = [(0.7, 0, 0.9, 0.0), (1.5, -1, 0.5, 0.02), (0.6, 20, 0.95, 0.0), (1.0, 0, 0.99, 0.0)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1) for t, k, p, m in filters]
    gen = torch.Generator().manual_seed(n)
    x = (torch.randn(4, 3, 16384, generator=gen) * torch.tensor([3.0, 0.3, 2.0, 0.5])[:, None, None]).cuda()
    sb = SamplingBatch.from_params(params, "cuda")
    with torch.inference_mode():
        want = filter_floor(x, sb)
        got = on_ranks(n, lambda tp: filter_floor(_shard(x, tp), sb, tp))
    for floor in got:
        assert torch.equal(floor, got[0])
        for b, (t, k, p, m) in enumerate(filters):
            for r in range(3):
                assert floor_is_valid(x[b, r].cpu(), floor[b, r].item(), t, k, p, m), (n, b, r)
    assert (got[0] == want).sum() >= 10


@pytest.mark.parametrize("budget", [10, 40])  # 40: more candidates than a rank's slice holds
@pytest.mark.parametrize("n", [2, 4])
def test_sharded_draft_topk_and_tree(n, budget):
    gen = torch.Generator().manual_seed(2)
    B, D, V = 3, 5, 48
    logits = torch.randn(B, D, V, generator=gen) * 3
    # -inf outside the top 4
    logits[2] = logits[2].masked_fill(logits[2] < logits[2].topk(4).values[..., -1:], float("-inf"))
    logprobs = torch.log_softmax(logits, -1)
    want_vals, want_ids = logprobs.topk(budget, -1)
    anchor = torch.tensor([1, 2, 3])
    want = tree_of_logprobs(logprobs, anchor, budget)

    def ranked(tp):
        vals, ids = tp.topk(_shard(logits, tp), budget, tp.rank * (V // n), log_softmax=True)
        return vals, ids, build_tree(vals, ids, anchor, budget)

    results = on_ranks(n, ranked)
    for vals, ids, tree in results:
        finite = torch.isfinite(want_vals)
        assert torch.equal(torch.isfinite(vals), finite)
        torch.testing.assert_close(vals[finite], want_vals[finite], rtol=0, atol=1e-5)
        assert torch.equal(ids[finite], want_ids[finite])
        for name in ("tokens", "parents", "depths", "valid", "ancestors"):
            assert torch.equal(getattr(tree, name), getattr(want, name)), name
    for vals, ids, tree in results[1:]:  # every rank: bit-identical candidates
        assert torch.equal(vals, results[0][0]) and torch.equal(ids, results[0][1])


@pytest.mark.parametrize("n", [2, 4])
def test_sharded_logprobs_equal_whole_vocabulary(n):
    """Logprobs and vocabulary ranks of given tokens (on any rank's slice) and the top k,
    over the whole vocabulary, bit-identical on every rank."""
    gen = torch.Generator().manual_seed(3)
    B, T, V, k = 3, 4, 40, 6
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
    tokens = torch.randint(0, V, (B, T), generator=gen)
    # a tie on the first and last ranks' slices (below the top k): ranked after every id it ties with
    logits[0, 0, [0, 1, V - 2, V - 1]] = logits[0, 0].min() - 1
    tokens[0, 0] = 0
    whole = torch.log_softmax(logits, -1)
    want_vals, want_ids = whole.topk(k, -1)
    results = on_ranks(n, lambda tp: tp.logprobs(_shard(logits, tp), tokens, k, tp.rank * (V // n)))
    want_ranks = (logits >= logits.gather(-1, tokens[..., None])).sum(-1)
    assert want_ranks[0, 0] == V and want_ranks.max() > k  # ranks past the top k too
    for chosen, vals, ids, ranks in results:
        torch.testing.assert_close(chosen, whole.gather(-1, tokens[..., None])[..., 0], rtol=0, atol=1e-12)
        torch.testing.assert_close(vals, want_vals, rtol=0, atol=1e-12)
        assert torch.equal(ids, want_ids) and torch.equal(ranks, want_ranks)
    for got in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, results[0]))


@pytest.mark.parametrize("n,kv_heads", [(2, 2), (4, 4)])
def test_sharded_drafter_context_equals_tp1(n, kv_heads, tp_models, clone_checkpoint, tmp_path):
    """Each rank's drafter, loaded from the checkpoint, projects the (replicated) target
    features into its own KV heads' context: rank r's k and v are TP = 1's heads of that
    rank (the fc slices the features by rank, all-reduces, then each rank keeps its heads;
    GQA at n = 2). End to end the random drafter's context barely moves its drafts, so a
    wrong slice there passes the token tests."""
    from treeflash.checkpoints import write_random_drafter
    from treeflash.config import DraftConfig
    from treeflash.models.dflash import DFlashDraftModel
    from treeflash.models.loader import load_weights
    target = clone_checkpoint(tp_models["qwen3"][0], num_key_value_heads=kv_heads)
    folder = write_random_drafter(target, tmp_path / "drafter", num_layers=1, target_layer_ids=[0, 1], seed=5)
    cfg = DraftConfig.from_pretrained(folder)
    gen = torch.Generator().manual_seed(4)
    features = torch.randn(2, 5, 2 * cfg.layers.hidden_size, generator=gen, dtype=torch.float64)
    positions = torch.arange(5).expand(2, 5) + 3

    def context(tp):
        drafter = DFlashDraftModel(cfg, tp)
        load_weights(drafter, folder)
        return drafter.double().context_kv(features, positions)

    whole, = on_ranks(1, context)
    h = kv_heads // n
    for r, layers in enumerate(on_ranks(n, context)):
        for (k, v), (k1, v1) in zip(layers, whole):
            assert k.shape[2] == v.shape[2] == h
            torch.testing.assert_close(k, k1[:, :, r * h:(r + 1) * h], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(v, v1[:, :, r * h:(r + 1) * h], rtol=1e-12, atol=1e-12)


def test_tp_logprobs_equal_tp1(engines):
    """End to end over gloo: the same tokens and logprobs as TP = 1."""
    params = [SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_new_tokens=N_NEW, ignore_eos=True, temperature=1.0, top_k=6, seed=5, logprobs=0)]
    want = engines("qwen3", "ddtree", 1).generate(BATCH[1:3], params)
    got = engines("qwen3", "ddtree", 2).generate(BATCH[1:3], params)
    assert len(got[0].prompt_logprobs) == len(BATCH[1]) and got[1].prompt_logprobs is None
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.token_ids)
        for a, b in zip(g.logprobs + (g.prompt_logprobs or [])[1:], w.logprobs + (w.prompt_logprobs or [])[1:]):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-12)
            assert [i for i, _ in a.top] == [i for i, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-12)


def test_tp_structured_outputs_equal_tp1(engines):
    """Every rank compiles the constraint itself and masks its own vocabulary slice (the
    drafter's too): TP = 2 gives TP = 1's tokens, which keep to the constraint."""
    from treeflash import StructuredOutputs
    from treeflash.structured.regex import compile_regex
    so = StructuredOutputs(regex=r"(?:[a-z]+ ){2,5}[0-9]+")
    params = [SamplingParams(max_new_tokens=N_NEW, structured_outputs=so),
              SamplingParams(max_new_tokens=N_NEW, temperature=1.0, seed=3, structured_outputs=so)]
    dfa = compile_regex(so.regex)
    for method in ("ar", "ddtree"):
        want = engines("qwen3", method, 1).generate(BATCH[1:3], params)
        got = engines("qwen3", method, 2).generate(BATCH[1:3], params)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], method
    for o in want:
        state = 0
        for byte in o.text.encode():
            state = int(dfa.trans[state, byte])
            assert state >= 0, o.text
        assert o.finish_reason == "length" or dfa.accepting[state]

def test_tp_fp8_tokens_equal_tp1(tp_models, tmp_path):
    """An FP8 target: each rank reads its slice of the weights and of their block scales
    (16 x 16 blocks: whole blocks per rank at TP = 2 and 4)."""
    from treeflash.checkpoints import write_fp8_copy
    target = write_fp8_copy(tp_models["qwen3"][0], tmp_path / "fp8", block=(16, 16))
    params = CONFIGS["filtered"]
    outs = {}
    for tp in (1, 2, 4):
        llm = LLM(target, draft_model=tp_models["qwen3"][1], method="ddtree", budget=12, device="cpu",
                  dtype="float64", tp=tp)
        try:
            assert llm.target.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
            outs[tp] = [o.token_ids for o in llm.generate(BATCH, params)]
        finally:
            llm.close()
    assert outs[2] == outs[1] and outs[4] == outs[1]
    uneven = write_fp8_copy(tp_models["qwen3"][0], tmp_path / "fp8-32", block=(32, 16))
    with pytest.raises(TreeflashError, match="block size 32 does not divide its 16 output features per rank"):
        LLM(uneven, device="cpu", dtype="float64", tp=4)  # 64 query features over 4 ranks
    wide = write_fp8_copy(tp_models["qwen3"][0], tmp_path / "fp8-16x32", block=(16, 32))
    with pytest.raises(TreeflashError, match="o_proj: FP8 block size 32 does not divide its 16 input features per"):
        LLM(wide, device="cpu", dtype="float64", tp=4)  # o_proj's 64 input features over 4 ranks


def _biased_copy(model: Path, folder: Path, weights, **config) -> Path:
    """A copy of checkpoint `model` in `folder` with random biases beside the layers' weights
    whose names end with `weights`, and `config` over its config.json."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(model, folder)
    w = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name in [k for k in w if k.endswith(weights) and ".layers." in k]:
        w[name.replace(".weight", ".bias")] = 0.3 * torch.randn(w[name].shape[0], generator=gen)
    save_file(w, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def test_tp_biased_llama_tokens_equal_tp1(tp_models, tmp_path):
    """A Llama with attention_bias and mlp_bias: column-parallel layers slice their bias,
    row-parallel ones (o_proj, down_proj) add theirs once after the all-reduce, not once
    per rank, so TP = 2 decodes TP = 1's tokens (and the biases do change them)."""
    folder = _biased_copy(tp_models["llama"][0], tmp_path / "biased", "_proj.weight",
                          attention_bias=True, mlp_bias=True)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = {}
    for tp, model in ((1, folder), (2, folder), (0, tp_models["llama"][0])):
        llm = LLM(model, method="ar", device="cpu", dtype="float64", tp=max(tp, 1))
        try:
            outs[tp] = [o.token_ids for o in llm.generate(BATCH, params)]
        finally:
            llm.close()
    assert outs[2] == outs[1] != outs[0]


def test_tp_qwen2_tokens_equal_tp1(tp_models, tmp_path):
    """A Qwen2 target (the Llama one with q/k/v biases, a window of 4 tokens in layer 1):
    each rank reads its heads' slice of the q/k/v biases, and no o_proj bias exists, so
    TP = 2 and 4 draft, verify and sample TP = 1's tokens through the windowed layer (and
    the biases and window do change them)."""
    base, drafter = tp_models["llama"]
    folder = _biased_copy(base, tmp_path / "qwen2", ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
                          architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True,
                          sliding_window=4, max_window_layers=1)
    params = CONFIGS["filtered"]
    outs = {}
    for tp, model in ((1, folder), (2, folder), (4, folder), (0, base)):
        llm = LLM(model, draft_model=drafter, method="ddtree", budget=12, device="cpu", dtype="float64",
                  tp=max(tp, 1))
        try:
            if tp:
                assert llm.config.sliding_layers == (1,) and llm.target.model.layers[0].self_attn.o_proj.bias is None
            outs[tp] = [o.token_ids for o in llm.generate(BATCH, params)]
        finally:
            llm.close()
    assert outs[2] == outs[1] and outs[4] == outs[1] and outs[1] != outs[0]


def test_tp1_topk_is_the_plain_topk():
    x = torch.randn(2, 3, 50)
    vals, ids = TPGroup().topk(x, 7, log_softmax=True)
    want_vals, want_ids = torch.log_softmax(x, -1).topk(7, -1)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(vals, want_vals, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- processes

DRIVER = textwrap.dedent("""
    import json, os, signal, sys, threading, time
    from treeflash import LLM, SamplingParams, TreeflashError
    # as in a terminal, even when the test runner was started in the background
    # (non-interactive shells start background jobs with SIGINT ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    target, drafter, mode, tp, victim = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    llm = LLM(target, draft_model=drafter, method="dflash", device="cpu", dtype="float32", tp=tp)
    pids = [s["pid"] for s in llm.rank_stats()]
    print(json.dumps(pids), flush=True)
    seen = []
    def on_tokens(i, ids):
        seen.extend(ids)
        if len(seen) >= 8:
            if mode == "kill" and len(seen) - len(ids) < 8:
                print(json.dumps({"killed_at": time.time()}), flush=True)
                os.kill(pids[victim], signal.SIGKILL)
            elif mode == "sigint":  # Ctrl-C: the terminal signals the whole process group
                os.killpg(os.getpgid(0), signal.SIGINT)
            elif mode == "hang" and len(seen) - len(ids) < 8:  # a worker stuck in a collective, then Ctrl-C
                os.kill(pids[victim], signal.SIGSTOP)
                threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        llm.generate([5, 6, 7], SamplingParams(max_new_tokens=400, ignore_eos=True), on_tokens=on_tokens)
    except TreeflashError as e:
        print(f"treeflash: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("treeflash: interrupted", file=sys.stderr)
        sys.exit(130)
    print("finished", flush=True)
""")


def _gone(pid: int, within: float = 15.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True  # exited, not yet reaped
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def _driver(tp_models, mode: str, tp: int, victim: int = 1):
    target, drafter = tp_models["qwen3"]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(target), str(drafter), mode, str(tp), str(victim)],
                          capture_output=True, text=True, timeout=180, cwd=REPO, start_new_session=True)
    pids = json.loads(proc.stdout.splitlines()[0])
    return proc, pids, time.monotonic() - start


@pytest.mark.parametrize("tp,victim", [(2, 1), (4, 2)])
def test_worker_killed_mid_generation(tp_models, tp, victim):
    proc, pids, seconds = _driver(tp_models, "kill", tp, victim)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert lines == [f"treeflash: error: tensor-parallel worker rank {victim} was killed by signal SIGKILL"], \
        proc.stderr
    assert "finished" not in proc.stdout
    assert all(_gone(p) for p in pids), "a worker outlived the driver"
    assert seconds < 90 and exit_after_kill(proc) < 20  # not held until the monitor's GRACE_S (30 s)


def exit_after_kill(proc) -> float:
    """Seconds from the driver's kill of a worker to the driver's exit."""
    killed = [json.loads(line)["killed_at"] for line in proc.stdout.splitlines() if "killed_at" in line]
    assert len(killed) == 1, proc.stdout
    return time.time() - killed[0]


def test_ctrl_c_stops_driver_and_workers(tp_models):
    proc, pids, _ = _driver(tp_models, "sigint", 2)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["treeflash: interrupted"], proc.stderr
    assert all(_gone(p) for p in pids), "a worker outlived the driver"


def test_ctrl_c_while_a_worker_hangs(tp_models):
    """Ctrl-C reaches the driver while it waits in a collective on a stuck worker (not
    only after the collective timeout of 10 minutes), and no worker is left."""
    proc, pids, seconds = _driver(tp_models, "hang", 2)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == ["treeflash: interrupted"], proc.stderr
    assert all(_gone(p) for p in pids), "a worker outlived the driver"
    assert seconds < 60


def test_cli_tp_equals_tp1_and_reports_a_failing_worker(tp_models, engines):
    target, drafter = tp_models["llama"]
    base = [sys.executable, "-m", "treeflash", "generate", "--model", str(target), "--draft-model", str(drafter),
            "--method", "ddtree", "--budget", "12", "--device", "cpu", "--dtype", "float64", "--json",
            "--max-new-tokens", str(N_NEW), "--ignore-eos", "--temperature", "0.9", "--seed", "11", "--tp", "2"]
    prompt = "def fib(n):"
    env = {k: v for k, v in os.environ.items() if k != "TREEFLASH_TP_FAULT"}
    ok = subprocess.run(base + [prompt], capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert ok.returncode == 0, ok.stderr
    got = json.loads(ok.stdout.strip().splitlines()[-1])["token_ids"]
    want = engines("llama", "ddtree", 1).generate(prompt, SamplingParams(
        max_new_tokens=N_NEW, ignore_eos=True, temperature=0.9, seed=11))[0].token_ids
    assert got == want
    # commands: 1 build, 2 start (prefill), 3.. rounds: rank 1 fails in its second round
    env["TREEFLASH_TP_FAULT"] = "1:4"
    bad = subprocess.run(base + [prompt], capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines() == [
        "treeflash: error: tensor-parallel worker rank 1 failed: RuntimeError: fault injected by "
        "TREEFLASH_TP_FAULT=1:4"], bad.stderr


TORCHRUN_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from treeflash import LLM, SamplingParams
    llm = LLM(sys.argv[1], draft_model=sys.argv[2], method="ddtree", budget=12, device="cpu", dtype="float64", tp=2)
    assert os.environ["RANK"] == "0"  # the other rank serves inside LLM() and exits with the driver
    params = SamplingParams(max_new_tokens=int(sys.argv[3]), ignore_eos=True, temperature=0.9, seed=11)
    print(json.dumps(llm.generate([[5, 17, 42, 9]], params)[0].token_ids), flush=True)
    llm.close()  # the other rank has left: a next engine could only wait for it
    try:
        LLM(sys.argv[1], device="cpu", dtype="float64", tp=2)
    except Exception as e:
        print(f"{type(e).__name__}: {e}", flush=True)
""")


def test_torchrun_launch(tp_models, engines, tmp_path):
    """RANK / WORLD_SIZE / LOCAL_RANK set by torchrun: every process constructs the LLM
    alike, rank 0 drives, the other serves; both exit cleanly. An LLM built after the
    last one closed (the other rank has exited) is refused in one line: it failed with
    gloo's connection errors against the first group's stale addresses."""
    target, drafter = tp_models["qwen3"]
    script = tmp_path / "run.py"
    script.write_text(TORCHRUN_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(target), str(drafter), str(N_NEW)],
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *_, tokens, refused = proc.stdout.strip().splitlines()
    assert refused.startswith("UsageError: under torchrun the other ranks exit when the last LLM on them closes")
    got = json.loads(tokens)
    want = engines("qwen3", "ddtree", 1).generate(SINGLE, SamplingParams(
        max_new_tokens=N_NEW, ignore_eos=True, temperature=0.9, seed=11))[0].token_ids
    assert got == want


@pytest.mark.parametrize("value", ["10m", "0", "-5", "nan"])
def test_a_bad_tp_timeout_is_one_line_before_any_worker_starts(tp_models, value):
    """TREEFLASH_TP_TIMEOUT was read unchecked: '10m' an internal ValueError, 0 a worker's
    C++ stack dump and then an internal error."""
    target, _ = tp_models["qwen3"]
    env = {**os.environ, "TREEFLASH_TP_TIMEOUT": value}
    proc = subprocess.run([sys.executable, "-m", "treeflash", "generate", "--model", str(target), "--device", "cpu",
                           "--tp", "2", "--max-new-tokens", "2", "x"], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"treeflash: error: TREEFLASH_TP_TIMEOUT must be a number of seconds > 0, got '{value}'"], proc.stderr


@pytest.mark.parametrize("env,words", [
    ({"WORLD_SIZE": "abc", "RANK": "0"}, ["WORLD_SIZE='abc' is not an integer", "unset RANK and WORLD_SIZE"]),
    # a port in use answered with c10d's own error as an "internal error"; peers that never come with
    # a C++ stack dump after the whole TREEFLASH_TP_TIMEOUT
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "PORT_IN_USE"},
     ["rank 0 of 2 could not meet the other ranks at 127.0.0.1:", "EADDRINUSE", "unset RANK and WORLD_SIZE"]),
    ({"WORLD_SIZE": "2", "RANK": "1", "MASTER_PORT": "FREE_PORT", "TREEFLASH_TP_TIMEOUT": "2"},
     ["rank 1 of 2 could not meet the other ranks", "DistNetworkError", "unset RANK and WORLD_SIZE"]),
])
def test_launch_variables_left_set_are_one_line(tp_models, env, words):
    """RANK and WORLD_SIZE in the environment mean a torchrun (or bare) launch: left set by
    mistake, the run waited for ranks that never came, then failed with an internal error."""
    import socket
    target, _ = tp_models["qwen3"]
    with socket.socket() as busy, socket.socket() as free:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        free.bind(("127.0.0.1", 0))
        ports = {"PORT_IN_USE": str(busy.getsockname()[1]), "FREE_PORT": str(free.getsockname()[1])}
        env = {k: ports.get(v, v) for k, v in env.items()}
        free.close()
        proc = subprocess.run([sys.executable, "-m", "treeflash", "generate", "--model", str(target), "--device",
                               "cpu", "--tp", "2", "--max-new-tokens", "2", "x"], capture_output=True, text=True,
                              timeout=120, cwd=REPO, env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", **env})
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode in (1, 2) and len(errors) == 1 and errors[0].startswith("treeflash: error: "), proc.stderr
    assert all(w in errors[0] for w in words), errors[0]


def test_dropping_graphs_is_a_command_of_every_rank(engines):
    """`drop_graphs` frees the kept graphed states on every rank: the driver's alone going
    would have it capture anew (with its collectives) while the workers replayed."""
    llm = engines("qwen3", "ar", 2)
    rt = llm._tp.rt
    before = rt.seq
    llm.drop_graphs()
    assert rt.seq == before + 1  # one command posted to the workers, and run by them in step:
    assert llm.generate(SINGLE, SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids  # still in step


@pytest.mark.parametrize("size", [2, 3])
def test_driver_may_run_commands_ahead_of_the_workers(size):
    """Pipelined rounds return before the workers have read their command, so the driver
    can post several commands while a worker is still busy: none may be gone when a slow
    worker gets to it (a worker then waited on the store while the driver's collectives
    waited on the worker: the TP = 2 hang on two H200s), and each is deleted once every
    worker has read it and moved on."""
    from treeflash.engine.tp import Runtime

    store = _store(wait_s=3)
    driver = Runtime(size, "cpu", 0, 0, store)
    workers = [Runtime(size, "cpu", r, 0, type(store)("127.0.0.1", store.port, is_master=False, timeout=store.timeout))
               for r in range(1, size)]
    sent = [("_step", (i,)) for i in range(3)]
    for payload in sent:
        driver.post("call", 0, payload)
    for i, w in enumerate(workers):
        assert [w.next_command()[2] for _ in sent] == sent
        last_reader = i == len(workers) - 1
        assert store.check(["cmd/1"]) != last_reader and store.check(["cmd/2"]) != last_reader
        assert store.check(["cmd/3"])  # still running on the workers
    assert not any(store.check([f"read/{seq}"]) for seq in (1, 2))  # nor are the counts of readers kept



def test_a_sampling_params_subclass_reaches_the_workers(engines, reference):
    """A SamplingParams subclass the workers cannot import (defined in the user's script)
    is sent as plain SamplingParams: it used to kill the workers while unpickled."""
    class Mine(SamplingParams):
        pass

    llm = engines("qwen3", "ar", 2)
    got = llm.generate(BATCH, [Mine(**vars(p)) for p in CONFIGS["sampled"]])
    assert [o.token_ids for o in got] == reference("qwen3", "ar", "sampled")[0][1]
    assert _run(llm, "greedy") == reference("qwen3", "ar", "greedy")
    # so are the values in it: an IntEnum seed killed the workers for good
    import enum

    class Seeds(enum.IntEnum):
        FIRST = CONFIGS["sampled"][0].seed

    first = replace(CONFIGS["sampled"][0], seed=Seeds.FIRST)
    assert llm.generate(BATCH[:1], first)[0].token_ids == reference("qwen3", "ar", "sampled")[0][1][0]
    assert _run(llm, "greedy") == reference("qwen3", "ar", "greedy")


def test_values_of_the_scripts_own_classes_reach_the_workers(engines, monkeypatch):
    """A value whose class the user's script defines (its `__main__`, which the workers
    do not run) reaches them as the built-in type it derives from: a str enum member as a
    choice, or a dict subclass as a JSON schema, killed every worker (they could not
    unpickle it) and the engine for good, where TP = 1 answered. An object of another
    such class is refused in one line before anything is sent, and the engine goes on."""
    import __main__
    import enum

    from treeflash import StructuredOutputs

    class Color(str, enum.Enum):
        RED = "red"
        BLUE = "blue"

    class Schema(dict):
        pass

    class Other:
        pass

    for cls in (Color, Schema, Other):  # as a script's own classes are
        cls.__module__, cls.__qualname__ = "__main__", cls.__name__
        monkeypatch.setattr(__main__, cls.__name__, cls, raising=False)
    schema = Schema(type="object", properties={"a": {"type": "integer"}}, required=["a"])
    params = [SamplingParams(max_new_tokens=6, structured_outputs=StructuredOutputs(choice=[Color.RED, Color.BLUE])),
              SamplingParams(max_new_tokens=12, temperature=1.0, seed=4,
                             structured_outputs=StructuredOutputs(json=schema))]
    want = [o.token_ids for o in engines("qwen3", "ar", 1).generate(BATCH[:2], params)]
    llm = engines("qwen3", "ar", 2)
    assert [o.token_ids for o in llm.generate(BATCH[:2], params)] == want
    with pytest.raises(UsageError, match=r"^Other objects cannot be sent to the tensor-parallel workers: the class "
                                         r"is defined in the script \(__main__\)"):
        llm._tp.call(llm, "__eq__", (Other(),), collect=True)
    assert [o.token_ids for o in llm.generate(BATCH[:2], params)] == want


def test_values_of_classes_from_a_module_beside_the_script_reach_the_workers(tp_models, tmp_path, monkeypatch):
    """A str enum from the script's own module folder (its sys.path[0], which a worker
    started elsewhere did not have): the workers import that module to read the value
    (they died of a ModuleNotFoundError, and the engine with them)."""
    from treeflash import StructuredOutputs
    (tmp_path / "tf_labels_beside.py").write_text("import enum\n\n\nclass Label(str, enum.Enum):\n"
                                                 "    YES = 'yes'\n    NO = 'no'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from tf_labels_beside import Label
    params = SamplingParams(max_new_tokens=4, structured_outputs=StructuredOutputs(choice=[Label.YES, Label.NO]))
    llm = LLM(tp_models["qwen3"][0], method="ar", device="cpu", dtype="float64", tp=2)
    try:
        assert llm.generate(SINGLE, params)[0].text in ("yes", "no")
    finally:
        llm.close()


def test_an_engine_closed_during_another_threads_command_is_freed(tp_models, engines, monkeypatch):
    """close() from another thread while a command is being posted: the workers are
    still told to drop that engine (the drop was lost between pickling the pending
    drops and clearing them, and the workers kept its weights)."""
    import treeflash.engine.tp as tp
    a = engines("qwen3", "ar", 2)
    b = LLM(tp_models["qwen3"][0], method="ar", device="cpu", dtype="float64", tp=2)
    sent, armed, command_bytes = [], [True], tp.command_bytes

    def dumps(command):
        data = command_bytes(command)
        sent.extend(command[4])  # the drops this command carries
        if armed[0] and command[0] == "call":
            armed[0] = False
            closer = threading.Thread(target=b.close)
            closer.start()
            closer.join()
        return data

    monkeypatch.setattr(tp, "command_bytes", dumps)
    for _ in range(2):
        a.generate(SINGLE, SamplingParams(max_new_tokens=2))
    assert sent.count(b._tp.eid) == 1  # once: resent, it had every worker run gc.collect() each round


def test_engines_sharing_workers_from_two_threads(engines, reference):
    """Two engines on the same workers, called from two threads at once, give their own
    tokens: commands (and their collectives) go one at a time (interleaved, they broke
    gloo's collectives and aborted the process)."""
    runs = [("qwen3", "ar", "greedy"), ("qwen3", "ddtree", "sampled")]
    for arch, method, _ in runs:
        engines(arch, method, 2)  # built before the threads start
    got = {}

    def run(arch, method, config):
        got[method] = [_run(engines(arch, method, 2), config) for _ in range(3)]

    threads = [threading.Thread(target=run, args=r) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for arch, method, config in runs:
        assert got[method] == [reference(arch, method, config)] * 3


SERVER_AFTER_DEATH = textwrap.dedent("""
    import json, os, signal, sys, time
    from starlette.testclient import TestClient
    from treeflash import LLM
    from treeflash.server.app import build_app
    llm = LLM(sys.argv[1], method="ar", device="cpu", dtype="float32", tp=2)
    body = {"prompt": [5, 6, 7], "max_tokens": 3}
    with TestClient(build_app(llm, "m", None)) as c:
        codes = [c.get("/health").status_code, c.post("/v1/completions", json=body).status_code]
        os.kill(llm.rank_stats()[1]["pid"], signal.SIGKILL)
        time.sleep(2)
        health = c.get("/health")
        answer = c.post("/v1/completions", json=body)
        codes += [health.status_code, answer.status_code, c.post("/v1/completions", json=body).status_code]
        print(json.dumps({"codes": codes, "health": health.json(), "answer": answer.json()}), flush=True)
""")


def test_a_server_whose_worker_died_says_so(tp_models):
    """After a worker dies the server answers 503 (its fault, not the client's), and
    /health says 503 too, so that a supervisor restarts it; before, it answered 400
    "invalid_request_error" to every request while /health said ok."""
    pytest.importorskip("starlette")
    proc = subprocess.run([sys.executable, "-c", SERVER_AFTER_DEATH, str(tp_models["qwen3"][0])],
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["codes"] == [200, 200, 503, 503, 503], got
    # the server's log says it in a line, without a traceback (a known failure)
    assert "generation failed: tensor-parallel worker rank 1 was killed" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for body in (got["health"], got["answer"]):
        assert body["error"]["type"] == "server_error"
        assert "worker rank 1 was killed by signal SIGKILL" in body["error"]["message"]


def test_a_closed_engine_leaves_the_others_working(tp_models, engines, reference):
    """An engine called after its close() raises for itself alone: the workers, shared
    with the other engines, go on (they used to be sent a command for an engine they had
    dropped, and died of it). At TP = 1 it raises the same (it used to go on serving)."""
    for tp in (2, 1):
        other = engines("qwen3", "ar", tp)
        closed = LLM(tp_models["qwen3"][0], method="ar", device="cpu", dtype="float64", tp=tp)
        closed.close()
        for call in (lambda: closed.generate(SINGLE, SamplingParams(max_new_tokens=2)), closed.rank_stats,
                     closed.check_healthy):  # unhealthy: a server's /health says so
            with pytest.raises(EngineDeadError, match="this LLM has been closed"):
                call()
        assert _run(other, "greedy") == reference("qwen3", "ar", "greedy")


def test_a_batch_too_large_for_memory_leaves_the_engine_working(engines, reference, monkeypatch):
    """Caches that do not fit fail with one line on every rank at the same point (before
    any collective of the batch): the ranks stay in step and the next request runs, at
    TP = 2 as at TP = 1 (a request must not end a tensor-parallel server)."""
    from treeflash.memory import available_bytes
    per_request = 2 * 2 * 4 * 2048 * 16 * 8  # K and V, 2 layers, 4 KV heads, 2048+ slots, D 16, float64
    batch = 8 * available_bytes(torch.device("cpu")) // per_request  # 4x what is free on each of 2 ranks
    for tp in (1, 2):
        llm = engines("qwen3", "ddtree", tp)
        monkeypatch.setattr(llm, "max_batch", batch)  # one batch, not max_batch prompts at a time
        with pytest.raises(TreeflashError, match="not enough cpu memory for a KVCache"):
            llm.generate([[5, 6, 7]] * batch, SamplingParams(max_new_tokens=2040, ignore_eos=True))
        assert _run(llm, "greedy") == reference("qwen3", "ddtree", "greedy")


def test_commands_larger_than_a_store_message_reach_every_rank(engines, reference):
    """A command over the TCP store's 8 MiB message limit (a batch of long prompts)
    travels in parts: the store used to drop the driver's connection, which ended the
    engine (a batch of 200K short prompts did it on a machine with 128 GB free)."""
    from treeflash.engine.tp import PART_BYTES, delete_keys, put_value, read_value
    llm = engines("qwen3", "ar", 2)
    store = llm._tp.rt.store  # shared with the engine's ranks: other keys come and go meanwhile
    data = os.urandom(2 * PART_BYTES + 5)
    put_value(store, "test/big", data)
    got, keys = read_value(store, "test/big")
    assert got == data and len(keys) == 3 and store.check(keys)
    delete_keys(store, keys)
    assert not any(store.check([k]) for k in keys)
    # through the command loop: every rank runs a method every object has, on 20 MB
    assert llm._tp.call(llm, "__eq__", (os.urandom(5 * PART_BYTES),), collect=True) == [NotImplemented] * 2
    assert _run(llm, "greedy") == reference("qwen3", "ar", "greedy")


def test_relative_model_paths_load_the_same_files_on_every_rank(tp_models, engines, reference, monkeypatch):
    """A relative model path means the driver's folder on every rank, also when the
    workers were started from another one (they used to load whatever that path named
    in their own folder, or fail)."""
    engines("qwen3", "ar", 2)  # the workers start here, in the test's folder
    target, drafter = tp_models["qwen3"]
    monkeypatch.chdir(target.parent)
    llm = LLM(target.name, draft_model=drafter.name, method="dflash", device="cpu", dtype="float64", tp=2,
              draft_mode="scaled")
    try:
        assert _run(llm, "greedy") == reference("qwen3", "dflash", "greedy")
    finally:
        llm.close()


CLOSE_AFTER_DEATH = textwrap.dedent("""
    import json, os, signal, sys, time
    from treeflash import LLM
    llm = LLM(sys.argv[1], method="ar", device="cpu", dtype="float32", tp=2)
    pids = [s["pid"] for s in llm.rank_stats()]
    os.kill(pids[1], signal.SIGKILL)
    time.sleep(0.05)  # before the monitor has looked
    start = time.monotonic()
    llm.close()
    print(json.dumps({"close_s": time.monotonic() - start}), flush=True)
""")


def test_close_right_after_a_worker_died_is_prompt(tp_models):
    """close() does not wait out the grace period for a worker that is already dead (it
    took 30 s when the death came just before it)."""
    proc = subprocess.run([sys.executable, "-c", CLOSE_AFTER_DEATH, str(tp_models["qwen3"][0])],
                          capture_output=True, text=True, timeout=120, cwd=REPO, start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["close_s"] < 5


def test_close_stops_the_workers(engines):
    """Last in the module: closing every engine of a size stops its workers."""
    engines("qwen3", "ar", 2)  # at least one, also when run alone
    tp2 = [llm for key, llm in engines.built.items() if key[2] == 2]
    pids = [s["pid"] for s in tp2[0].rank_stats()][1:]
    procs = tp2[0]._tp.rt.procs
    for llm in tp2:
        assert not _gone(pids[0], within=0.2), "workers stopped before the last engine was closed"
        llm.close()
    assert pids and all(_gone(p) for p in pids)
    assert [p.returncode for p in procs.values()] == [0] * len(pids)  # told to stop, not killed
    with pytest.raises(TreeflashError, match="shut down"):
        tp2[0].generate(SINGLE, SamplingParams(max_new_tokens=2))


# ----------------------------------------------------------------------------- launches and build errors (cases a mutation review found untested)

def test_a_one_process_launch_is_not_a_torchrun_group(monkeypatch):
    """RANK=0 and WORLD_SIZE=1 (`torchrun --nproc-per-node 1`, or variables left set) is no
    group to join: an LLM with tp=N starts its own workers, as without them."""
    from treeflash.engine.tp import torchrun_env
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert torchrun_env() is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert torchrun_env()["world"] == 2


WORKER_CANNOT_LOAD = textwrap.dedent("""
    import json, os
    info = os.environ.get("TREEFLASH_TP_WORKER")
    if info and json.loads(info)["rank"] == 1:
        import treeflash.models.loader as loader
        from treeflash.errors import TreeflashError
        def fail(*args, **kwargs):
            raise TreeflashError("no room for the shard")
        loader.load_weights = fail
""")


def test_a_worker_that_cannot_build_its_shard_is_named_in_one_line(tp_models, tmp_path):
    """The driver reports the rank whose build failed, by its rank (1 here, of 2), with
    that worker's own one-line error."""
    (tmp_path / "sitecustomize.py").write_text(WORKER_CANNOT_LOAD)  # rank 1 only: the driver loads
    env = {k: v for k, v in os.environ.items() if k != "TREEFLASH_TP_FAULT"} | {"PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "treeflash", "generate", "--model", str(tp_models["qwen3"][0]),
                           "--method", "ar", "--device", "cpu", "--dtype", "float64", "--max-new-tokens", "2",
                           "--tp", "2", "def f(x):"], capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "treeflash: error: tensor-parallel worker rank 1 could not build the model: no room for the shard"], proc.stderr


def test_a_bare_launch_places_each_rank_by_its_rank(monkeypatch):
    """Without LOCAL_RANK (a bare launch of one process per GPU on one host) rank r
    takes cuda:r, not every rank cuda:0; MASTER_ADDR / MASTER_PORT default as torch's."""
    from treeflash.engine.tp import torchrun_env
    for name in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert torchrun_env() == {"rank": 1, "world": 2, "local_rank": 1, "addr": "127.0.0.1", "port": 29500}
    monkeypatch.setenv("LOCAL_RANK", "0")  # torchrun's own, across hosts
    assert torchrun_env()["local_rank"] == 0


class _Exited:
    def __init__(self, rc):
        self.rc = rc

    def poll(self):
        return self.rc


class _Reports:
    """The store as the monitor's client sees it: err/<rank> keys the workers left."""

    def __init__(self, errors: dict[int, tuple[str, bool]]):
        self.values = {f"err/{r}": json.dumps({"error": e, "comm": c}) for r, (e, c) in errors.items()}

    def check(self, keys):
        return all(k in self.values for k in keys)

    def get(self, key):
        return self.values[key]


def test_the_driver_names_the_root_cause_among_dead_workers():
    """Of several dead workers the driver names the one that caused it: a worker's own
    error or a signal before a peer's broken collective (which only followed it), and
    of those the lowest rank; a worker still running is no cause."""
    from treeflash.engine.tp import Runtime
    rt = Runtime(5, "cpu", 0, 0, None, {1: _Exited(1), 2: _Exited(1), 3: _Exited(-9), 4: _Exited(None)})
    reports = _Reports({1: ("RuntimeError: gloo connection closed by peer", True),
                        2: ("RuntimeError: CUDA error: an illegal memory access", False)})
    assert rt._diagnose(reports) == ("tensor-parallel worker rank 2 failed: "
                                     "RuntimeError: CUDA error: an illegal memory access")
    reports = _Reports({1: ("RuntimeError: gloo connection closed by peer", True)})
    assert rt._diagnose(reports) == "tensor-parallel worker rank 2 exited unexpectedly with code 1"
    rt.procs = {1: _Exited(1), 3: _Exited(-9)}
    assert rt._diagnose(reports) == "tensor-parallel worker rank 3 was killed by signal SIGKILL"
    assert rt._diagnose(None) == "tensor-parallel worker rank 1 exited unexpectedly with code 1"


def test_a_workers_error_is_reported_in_one_line():
    """What a worker leaves the driver (its build error, why it stopped) is the first
    line of its error: a treeflash error as it reads, any other after its type's name,
    at most 400 characters."""
    from treeflash.engine.tp import one_line
    assert one_line(TreeflashError("no room for the shard\nmore")) == "no room for the shard"
    assert one_line(RuntimeError("  gloo: connection closed\ntraceback")) == "RuntimeError: gloo: connection closed"
    assert one_line(KeyboardInterrupt()) == "KeyboardInterrupt"
    assert one_line(TreeflashError("x" * 1000)) == "x" * 400
    assert one_line(ValueError("y" * 1000)) == ("ValueError: " + "y" * 1000)[:400]


@pytest.mark.parametrize("n,short", [(2, 1), (4, 2)])
def test_a_rank_short_of_memory_for_the_caches_is_named_on_every_rank(n, short):
    """Batch caches that do not fit on one rank make every rank raise InStepError at the
    same point (the ranks stay in step): that rank with its own error, the others naming it."""
    from treeflash.engine.states import KeptStates
    from treeflash.errors import InStepError

    def make_on(tp):
        if tp.rank == short:
            raise TreeflashError(f"not enough cpu memory for a KVCache on rank {tp.rank}\nmore")
        return "state"

    def run(tp):
        states = KeptStates(None, torch.device("cpu"), graphs=False, prefix_caching=False, group=tp)
        with pytest.raises(InStepError) as e:
            states.allocated(lambda: make_on(tp))
        fine = states.allocated(lambda: "state")  # and the next batch goes on
        return str(e.value), fine

    got = on_ranks(n, run)
    assert [g[1] for g in got] == ["state"] * n
    assert [g[0] for g in got] == [f"not enough cpu memory for a KVCache on rank {short}" if r == short else
                                   f"tensor-parallel rank {short} has not enough memory for this batch's caches"
                                   for r in range(n)]


# ----------------------------------------------------------------------------- driver and worker loop (second review)

def _store(wait_s: float = 30):
    """A driver's store on a free local port, whose waits end after `wait_s` seconds."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=wait_s), wait_for_workers=False)


def test_a_dead_worker_ends_every_wait_of_the_driver():
    """A worker's death reaches the driver wherever it is, as one EngineDeadError naming
    the rank: in a command that returned normally meanwhile (its collectives were cut
    short: on GPUs the peer all-reduce lets the driver go with garbage), waiting for the
    workers' answers (a build, rank_stats) once the monitor sees the process gone, and,
    under torchrun (no processes to watch), by the worker's report in the store. The waits
    are bounded here by the grace the driver gets, so that a regression fails, not hangs."""
    import types

    from treeflash.engine.tp import GRACE_S, Runtime
    killed = "tensor-parallel worker rank 1 was killed by signal SIGKILL"
    rt = Runtime(2, "cpu", 0, 0, _store())
    rt.engines.add(0)

    def step():
        rt.failure = killed  # as the monitor records it while the command runs
        return "garbage"

    with pytest.raises(EngineDeadError, match=f"^{killed}$"):
        rt.call(0, types.SimpleNamespace(step=step), "step", (), False)
    rt = Runtime(2, "cpu", 0, 0, _store(), {1: _Exited(-9)})
    rt.start_monitor()
    with pytest.raises(EngineDeadError, match=f"^{killed}$"):
        rt.wait_keys(["res/1/1"], "answer", GRACE_S)
    rt = Runtime(2, "cpu", 0, 0, _store())
    rt.store.set("err/1", json.dumps({"error": "RuntimeError: CUDA error: an illegal memory access", "comm": False}))
    with pytest.raises(EngineDeadError, match="^tensor-parallel worker rank 1 failed: RuntimeError: CUDA error: an "
                                              "illegal memory access$"):
        rt.wait_keys(["res/1/1"], "answer", GRACE_S)


def test_a_driver_error_inside_a_command_ends_the_workers():
    """An error the driver alone raises inside a command (Ctrl-C in a notebook, a bug)
    leaves the workers in that command, out of step for good: they are shut down, the
    error is raised as it is, and the next call says in one line to build a new LLM
    (it would have met workers still in the last command: a hang, or garbage)."""
    import types

    from treeflash.engine.tp import Runtime
    rt = Runtime(2, "cpu", 0, 0, _store())
    rt.engines.add(0)

    def step():
        raise KeyboardInterrupt

    engine = types.SimpleNamespace(step=step, ping=lambda: "pong")
    with pytest.raises(KeyboardInterrupt):
        rt.call(0, engine, "step", (), False)
    with pytest.raises(EngineDeadError, match="^the tensor-parallel workers have been shut down; create a new LLM$"):
        rt.call(0, engine, "ping", (), False)


def test_an_llm_built_after_a_worker_died_starts_new_workers(tp_models, monkeypatch):
    """Workers whose rank died while their engines were idle (the monitor recorded it,
    nothing was called since) are not reused: the next LLM starts workers of its own
    instead of failing with the dead rank's error."""
    import treeflash.engine.tp as tp
    from treeflash.config import ModelConfig
    dead, fresh = tp.Runtime(2, "cpu", 0, 0, None), tp.Runtime(2, "cpu", 0, 0, None)
    dead.failure = "tensor-parallel worker rank 1 was killed by signal SIGKILL"
    monkeypatch.setitem(tp._RUNTIMES, (2, "cpu"), dead)
    monkeypatch.setattr(tp, "_started_any", tp._started_any)  # restored after the test
    monkeypatch.setattr(tp, "start", lambda size, device: fresh)
    monkeypatch.setattr(tp.Runtime, "new_engine", lambda self, kwargs: (self, kwargs))
    config = ModelConfig.from_pretrained(tp_models["qwen3"][0])
    assert tp.attach(2, torch.device("cpu"), {"model": "m"}, config, None) == (fresh, {"model": "m"})
    assert tp._RUNTIMES[(2, "cpu")] is fresh


def test_the_worker_loop_frees_dropped_engines_and_leaves_no_answer_behind(monkeypatch):
    """A worker's command loop (a thread here, stand-in engines): a closed engine is
    released on the worker with the next command, also when the command before it could
    not be sent (an argument that does not pickle fails that call alone, and the engine
    goes on); a call whose result the driver does not collect, and the build of an
    engine whose own load failed on the driver, leave no answer in the store (a server's
    store grew by a round's result every round)."""
    import weakref

    import treeflash.engine.llm as llm_module
    from treeflash.engine.tp import Runtime
    built = []

    class Stub:
        def __init__(self, _worker, fail=False):
            if fail:
                raise TreeflashError("no room for the shard")
            built.append(weakref.ref(self))

        def ping(self, *args):
            return "pong"

    monkeypatch.setattr(llm_module, "LLM", Stub)
    store = _store()
    driver = Runtime(2, "cpu", 0, 0, store)
    worker = Runtime(2, "cpu", 1, 0, type(store)("127.0.0.1", store.port, is_master=False))
    serving = threading.Thread(target=worker.serve_main)
    serving.start()
    here = Stub(None)  # the driver's own engine
    try:
        a, b = driver.new_engine({}), driver.new_engine({})
        a.built()
        b.built()
        b.close()  # its drop goes with the next command sent
        with pytest.raises(Exception, match="pickle"):
            a.call(here, "ping", (lambda: None,))
        a.call(here, "ping", ())
        uncollected = driver.seq
        assert a.call(here, "ping", (), collect=True) == ["pong", "pong"]  # the worker ran the commands before
        assert [ref() is not None for ref in built] == [True, True, False]  # here, a; not b
        assert not store.check([f"res/{uncollected}/1"])
        failed = driver.new_engine({"fail": True})
        failed.close()  # as LLM() does when the driver's own load failed
        assert a.call(here, "ping", (), collect=True) == ["pong", "pong"]
        assert not store.check([f"res/{failed.build_seq}/1"])
    finally:
        driver.shutdown()
        serving.join()
