"""Shape mode of `treeflash bench` (`--shape qwen3-8b`): random weights of a published
model shape, built directly on the device, with a KV cache that holds C tokens. Times
the pieces of a round (AR step, verify of N+1 tokens, draft step, tree build, whole
round) as CUDA graphs and compares each to its *memory floor*: the bytes it must read
(weights + KV of the prefix) over the measured copy bandwidth. This is the number that
says whether the engine or the hardware is the limit (BENCHMARKS.md section 2).

With `--tp N` the command re-runs itself as N processes under torchrun (one per GPU;
gloo on CPU); each builds its own shard and runs the same timing loop (NCCL all-reduces
captured in the graphs), floors are per rank, and rank 0 reports."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from treeflash.bench.options import (DRAFT_LAYERS, MAX_BENCH_BATCH, check_sampled_options, check_seed, filters,
                                     filters_note, parse_budgets, parse_graphs, parse_list, usable_graphs)
from treeflash.bench.report import check_plot_path, close_out, emit, format_table, open_out, plot_shape, print_ratios
from treeflash.config import GPT_OSS_ROPE_SCALING, DraftConfig, ModelConfig, default_target_layer_ids
from treeflash.distributed import TPGroup
from treeflash.engine.options import attention_backend, resolve_device, resolve_dtype
from treeflash.engine.graphs import capture
from treeflash.engine.pipeline import RoundPipeline
from treeflash.engine.round import SpeculativeDecoder
from treeflash.engine.sampling import SamplingBatch
from treeflash.engine.tp import COMM_HINTS, check_devices, check_shardable, join_group, torchrun_env
from treeflash.engine.tree import empty_tree
from treeflash.errors import TreeflashError, UsageError
from treeflash.memory import available_bytes, check_weights_fit
from treeflash.models.dflash import DFlashDraftModel
from treeflash.models.loader import build_on
from treeflash.models.moe import SparseMoE
from treeflash.models.transformer import CausalLM
from treeflash.sampling_params import SamplingParams

BLOCK_SIZE = 16          # drafter block of the shape mode (the published DFlash drafters)
WARMUP = 3               # eager calls (or side-stream calls before a capture) before timing
ALLREDUCE_RUN = 16       # all-reduces per timed call when measuring one's latency


# ---------------------------------------------------------------------------
# Shapes and random weights
# ---------------------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

# Kimi-K2's shape, cut to 4 layers: the dense first layer and 3 MoE layers, 108 GB of
# bf16 weights (each MoE layer is 34 GB), so one H200 holds it with a drafter and KV.
# Kimi-K2 has MLA attention, which treeflash does not implement: this uses GQA with 64
# query heads, 8 KV heads of 128 (and Qwen3's q/k norms). Routing is Qwen3-MoE's
# (softmax, top-8, renormalized), not K2's sigmoid scores with group-limited top-k and
# a scaling factor; RoPE without K2's YaRN scaling. For timing: the bytes are K2's.
KIMI_K2_4L = ModelConfig(
    "qwen3_moe", vocab_size=163840, hidden_size=7168, intermediate_size=18432, num_layers=4,
    num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=50000.0, max_position_embeddings=131072,
    num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, norm_topk_prob=True,
    mlp_only_layers=[0], n_shared_experts=1)

# Published shapes (random weights: only the shapes matter; Qwen2.5-7B: q/k/v biases, 7 query heads per KV head;
# Qwen3-30B-A3B: 128 experts, 8 per token, in
# every layer; gpt-oss-20b: 32 experts, 4 per token, a 128-token window in every other layer), a Kimi-K2-like
# MoE cut to 4 layers
# (one dense, three of 384 experts; GQA in place of MLA: see KIMI_K2_4L), and one for CPU tests.
SHAPES = {
    "qwen3-8b": ModelConfig("qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            rope_theta=1e6, max_position_embeddings=40960),
    "qwen2.5-7b": ModelConfig("qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rope_theta=1e6,
                              max_position_embeddings=32768, attention_bias=True),
    "llama3-8b": ModelConfig("llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                             rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072),
    "qwen3-32b": ModelConfig("qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
                             num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128,
                             rope_theta=1e6, max_position_embeddings=40960),
    "qwen3-30b-a3b": ModelConfig("qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1e6,
                                 max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
                                 moe_intermediate_size=768, norm_topk_prob=True),
    "kimi-k2-4l": KIMI_K2_4L,
    "gpt-oss-20b": ModelConfig("gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                               num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
                               rope_theta=150000.0, rope_scaling=GPT_OSS_ROPE_SCALING, max_position_embeddings=131072,
                               attention_bias=True, o_proj_bias=True, num_experts=32, num_experts_per_tok=4,
                               moe_intermediate_size=2880, norm_topk_prob=True, sliding_window=128,
                               sliding_layers=tuple(range(0, 24, 2)), attention_sinks=True, expert_bias=True,
                               swiglu_limit=7.0),
    "tiny": ModelConfig("qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=32768),
}


def fp8_block(text: str) -> tuple[int, int]:
    """--fp8's ROWSxCOLS."""
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--fp8 takes ROWSxCOLS, e.g. 128x128; got {text!r}") from None
    if rows < 1 or cols < 1:
        raise UsageError(f"--fp8 block sizes must be positive, got {text!r}")
    return rows, cols


def draft_config(target, layers: int):
    """A DFlash drafter for `target` as published: Qwen3 layers of the target's width
    (full attention, no sinks or biases), block 16, default taps, mask token = last
    vocabulary id."""
    return DraftConfig(layers=dataclasses.replace(target, arch="qwen3", num_layers=layers, sliding_window=None,
                                                  sliding_layers=(), attention_sinks=False, attention_bias=False,
                                                  o_proj_bias=False),
                       block_size=BLOCK_SIZE, mask_token_id=target.vocab_size - 1,
                       target_layer_ids=default_target_layer_ids(target.num_layers, layers),
                       num_target_layers=target.num_layers)


@torch.no_grad()
def init_random_(model: torch.nn.Module) -> None:
    """normal(0, 0.02) weights (FP8 ones: normal(0, 1) times a scale of 0.02), unit
    norms: no checkpoint needed, and the values keep activations finite (the cost of a
    kernel does not depend on them)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif p.dtype == torch.float8_e4m3fn:
            for rows in p.flatten(0, -2).split(1024):  # a float32 copy of some rows at a time, not of all
                rows.copy_(torch.randn(rows.shape, device=rows.device))
        elif name.endswith("scale_inv"):
            p.fill_(0.02)
        else:
            p.normal_(0.0, 0.02)


def random_models(cfg, dcfg, device: torch.device, dtype: torch.dtype, group: TPGroup = TPGroup()):
    """Target and drafter (this rank's shards) created on the device (no host copy of
    16+ GB of weights)."""
    with build_on(device, dtype):
        target, drafter = CausalLM(cfg, group), DFlashDraftModel(dcfg, group)
    for m in (target, drafter):
        init_random_(m)
        m.eval()
    return target, drafter


# ---------------------------------------------------------------------------
# What an op must read (the memory floor) and the all-reduces it runs
# ---------------------------------------------------------------------------

def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _bytes(model, skip=()) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name not in skip)


def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts `tokens` tokens pick, each k of E uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def weight_bytes_read(model: torch.nn.Module, tokens: int) -> float:
    """Bytes of weights a forward of `model` over `tokens` tokens (all requests of the
    batch together) must read, embedding and LM head left out: every parameter, except
    that each MoE layer's routed experts count only the expected number of distinct
    experts picked under uniform routing. Under TP, this rank's bytes (its slices)."""
    skip = {"model.embed_tokens.weight", "lm_head.weight"}
    total = float(sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name not in skip))
    for m in model.modules():
        if isinstance(m, SparseMoE):
            params = list(m.experts.parameters())   # [E, ...] each: weights, and FP8 scales
            E = params[0].shape[0]
            per_expert = sum(p[0].numel() * p.element_size() for p in params)
            total -= (E - expected_experts(E, m.gate.top_k, tokens)) * per_expert
    return total


def op_bytes(kind: str, target, drafter, context: int, batch: int, tokens: int) -> int | None:
    """Bytes an op over `tokens` target tokens must read from memory at least, on this
    rank: the weights it multiplies by (the rank's shards; of an MoE layer's experts, the
    expected number of distinct ones the tokens pick) and the KV of the C committed tokens
    of every request (the rank's KV heads). Embedding rows, activations and the few KV
    slots written are negligible. A round reads the LM head twice (draft, then verify:
    dependent, so they cannot share one read), and so the k/v rows of the drafter's QKV
    weights (the block's keys, then the accepted tokens' context after the verify) and
    its fc once. None: no memory floor."""
    elem = target.lm_head.weight.element_size()
    head = _bytes(target.lm_head)
    body = weight_bytes_read(target, tokens)
    kv_t = batch * _kv_values(target.model.layers, context) * elem
    draft = _bytes(drafter, skip={"fc.weight"})
    kv_d = batch * _kv_values(drafter.layers, context) * elem
    return {"ar": body + head + kv_t, "verify": body + head + kv_t, "draft": draft + head + kv_d,
            "round": body + 2 * head + kv_t + draft + _bytes(drafter.fc) + _context_rows(drafter) + kv_d}.get(kind)


def _context_rows(drafter) -> int:
    """Bytes of the k/v rows of every drafter layer's QKV weight: what projecting the
    committed tokens' features into its context cache reads (`commit_context`)."""
    total = 0
    for layer in drafter.layers:
        w = layer.self_attn.qkv_proj.weight
        _, k, v = layer.self_attn.qkv_proj.parts
        total += (k + v) * w.shape[1] * w.element_size()
    return total


def _kv_values(layers, context: int) -> int:
    """K and V values of `context` committed tokens over `layers` (a sliding-window layer
    reads only its window), for this rank's KV heads."""
    return sum(2 * a.num_kv_heads * a.head_dim * min(context, a.window or context)
               for a in (layer.self_attn for layer in layers))


def allreduce_plan(op: str, n: int, target, drafter, batch: int) -> list[tuple[int, int]]:
    """[(count, tokens)]: the hidden-state all-reduces of an op under tensor parallelism,
    each over a [tokens, hidden] tensor. A forward does one after the embedding and two
    per layer (attention and MLP outputs); a round also projects the accepted path's
    features through the drafter's row-parallel fc. The all-gathers of a few candidates
    per row (sampling, draft top-k) are left out."""
    target_fwd = (2 * len(target.model.layers) + 1, batch * (n + 1))
    block = batch * drafter.block_size
    draft_fwd = (2 * len(drafter.layers) + 1, block)
    return {"ar": [target_fwd], "verify": [target_fwd], "draft": [draft_fwd], "tree": [],
            "round-dflash": [target_fwd, draft_fwd, (1, block)], "round": [target_fwd, draft_fwd, (1, block)]}[op]


# ---------------------------------------------------------------------------
# Timers
# ---------------------------------------------------------------------------

def time_device(run, reset, iters: int, device: torch.device) -> float:
    """Median µs of `run()`. On CUDA, events around each call, all queued before one
    sync, so the host runs ahead and the events time the GPU work alone (a sync per
    call would add the launch latency). On CPU, perf_counter."""
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            reset()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        times = [1e3 * start.elapsed_time(end) for start, end in events]
    else:
        times = []
        for _ in range(iters):
            reset()
            t0 = time.perf_counter()
            run()
            times.append(1e6 * (time.perf_counter() - t0))
    return statistics.median(times)


def time_wall(run, reset, iters: int) -> tuple[float, float | None]:
    """(mean wall µs, mean GPU-busy µs) per round of `iters` back-to-back rounds run as
    the pipelined engine runs them (`LLM._step` with `RoundPipeline`): launch round r,
    queue the non-blocking copy of its tokens to pinned host buffers, then wait for round
    r-1's copy only and read its tokens (`.tolist()`); the host reads round r-1 while
    round r runs. `reset()` (a device copy of n, queued between rounds without a sync)
    keeps every round at context C. Events around each round (with CUDA) time the GPU
    work of these same rounds, so wall minus busy is the time per round that the GPU
    sat waiting for the host, free of the spread between separate runs; the two small
    token copies after each round fall outside the events and count as host time."""
    pipe = RoundPipeline()
    reset()
    pipe.push(*run()[:2])  # new tokens and counts; the host buffers are allocated here, not while timed
    pipe.finish()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)] if torch.cuda.is_available() else []
    t0 = time.perf_counter()
    for i in range(iters):
        if events:
            events[i][0].record()
        reset()
        out = run()
        if events:
            events[i][1].record()
        pipe.push(*out[:2])
    pipe.finish()
    wall = 1e6 * (time.perf_counter() - t0) / iters
    if not events:
        return wall, None
    events[-1][1].synchronize()
    return wall, sum(1e3 * start.elapsed_time(end) for start, end in events) / iters


def measure_op(fn, reset, iters: int, graphs: bool, device: torch.device, is_round: bool):
    """(median device µs, (wall µs, GPU-busy µs) per round of back-to-back pipelined
    rounds, or None) of one op: see `time_device` and `time_wall`."""
    if graphs:
        graph, out = capture(fn, WARMUP, reset=reset)

        def run():
            graph.replay()
            return out
    else:
        for _ in range(WARMUP):
            reset()
            fn()
        run = fn
    us = time_device(run, reset, iters, device)
    wall = time_wall(run, reset, iters) if is_round and device.type == "cuda" else None
    return us, wall


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes/s of a large device-to-device copy, counting read + write: the practical
    peak that a memory-bound op can hope for."""
    n = mib * 2 ** 20
    free = available_bytes(device)
    if free is not None and 2 * n > free:
        raise UsageError(f"--copy-mib {mib} needs {2 * mib} MiB (the source and its copy) but {free >> 20} MiB "
                         f"are free: ask for less")
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    us = time_device(lambda: dst.copy_(src), lambda: None, 10 if device.type == "cuda" else 5, device)
    return 2 * n / (us * 1e-6)


def allreduce_timer(group: TPGroup, hidden: int, dtype: torch.dtype, device: torch.device, iters: int):
    """(tokens, graphs) -> µs of one all-reduce of a [tokens, hidden] tensor: a run of
    ALLREDUCE_RUN of them (one CUDA graph with graphs on), timed as an op, ÷ ALLREDUCE_RUN.
    Memoized; a collective, so every rank asks for the same sizes in the same order."""
    memo = {}

    def latency(tokens: int, graphs: bool) -> float:
        if (tokens, graphs) not in memo:
            x = torch.zeros(tokens, hidden, dtype=dtype, device=device)

            def run():
                for _ in range(ALLREDUCE_RUN):
                    group.all_reduce(x)

            us, _ = measure_op(run, lambda: None, iters, graphs, device, False)
            memo[tokens, graphs] = us / ALLREDUCE_RUN
        return memo[tokens, graphs]

    return latency


# ---------------------------------------------------------------------------
# The ops of one state, timed into rows
# ---------------------------------------------------------------------------

def round_ops(target, drafter, st, budgets: list[int], backend: str, draft_mode: str, max_n: int | None):
    """[(op, N, kind, fn, is_round)] for one state: the pieces of a round and whole rounds.

    kind names the memory floor (`op_bytes`); every fn reads `st`, whose `n` the
    caller resets to C before each call (rounds advance it). The pieces split the round
    as `SpeculativeDecoder` runs it: draft = the drafter's logits (this rank's
    vocabulary slice), tree = top-k over the slices + tree build, verify = target
    forward + LM head (the slice: sampling reads it without gathering the vocabulary)."""
    def decoder(method, budget=0):
        return SpeculativeDecoder(target, drafter if method != "ar" else None, method, budget,
                                  draft_mode=draft_mode, attention_backend=backend)

    ar, dflash = decoder("ar"), decoder("dflash")
    ar_state = dataclasses.replace(st, draft_cache=None, chain=None)  # same buffers, no drafter context
    ddtree = {n: decoder("ddtree", n) for n in budgets if n}
    logits = dflash.draft_logits(st, max_n)  # a fixed draft: trees for verify and tree-build ops

    def verify(tree):
        """Target forward over root + N nodes with the tree mask, and the LM head."""
        return lambda: dflash.verify(st, tree, max_n)[0]

    def tree_for(n):
        """The DDTree of N nodes over the fixed draft, as the round builds it."""
        return ddtree[n].tree_from_logits(logits, st) if n else empty_tree(st.anchor)

    D = drafter.block_size - 1
    ops = [("ar", 0, "ar", lambda: ar.round(ar_state, max_n), True)]
    ops += [("verify", n, "verify", verify(tree_for(n)), False) for n in budgets]
    ops += [("draft", D, "draft", lambda: dflash.draft_logits(st, max_n), False)]
    ops += [("tree", n, None, (lambda n=n: tree_for(n)), False) for n in budgets if n]
    ops += [("round-dflash", D, "round", lambda: dflash.round(st, max_n), True)]
    ops += [("round", n, "round", (lambda d=ddtree[n]: d.round(st, max_n)), True) for n in budgets if n]
    return ops


def new_shape_state(target, drafter, context: int, batch: int, temperature: float, budgets: list[int],
                    seed: int, filters: dict | None = None):
    """A batch state as if every request had committed `context` tokens. The caches
    hold zeros: attention reads them all the same."""
    dev = target.lm_head.weight.device
    dec = SpeculativeDecoder(target, drafter, "ddtree", max(budgets))  # the round that needs the most slots
    capacity = -(-(context + dec.tree_slots) // 256) * 256  # tight: graph kernels size their work by capacity
    params = [SamplingParams(temperature=temperature, seed=seed + i, **(filters or {})) for i in range(batch)]
    st = dec.new_state(batch, capacity, SamplingBatch.from_params(params, dev))
    st.n.fill_(context)
    st.anchor.random_(0, target.config.vocab_size - 1)
    return st


def shape_rows(args, target, drafter, context, bs, temperature, graphs, budgets, backend, draft_mode, bandwidth,
               device, dtype, out, allreduce=None, lead: bool = True) -> list[dict]:
    """Time every op of `round_ops` on one state; one row each. Whole rounds on CUDA
    also get wall_us, the wall time per round of back-to-back rounds pipelined as the
    engine runs them (`time_wall`), and, with graphs, host_us = wall_us - the GPU-busy
    time of those same rounds: the host time per round that the GPU waits for (without
    graphs the GPU also waits for the host inside a round, between its launches, which
    the events count as busy: no figure). With tensor parallelism
    (`allreduce`: see `allreduce_timer`) a row also has the latency of one hidden-state
    all-reduce at the op's (first) token count and the all-reduce share of the op: an
    estimate, count x latency / op time, from all-reduces timed alone (in the op they
    may overlap other work, or wait for a slower rank)."""
    st = new_shape_state(target, drafter, context, bs, temperature, budgets, args.seed, filters(args))
    n0 = st.n.clone()

    def reset():
        st.n.copy_(n0)

    rows, ar_us = [], None
    max_n = None if graphs else context  # as the engine: graphs read the whole cache
    for op, n, kind, fn, is_round in round_ops(target, drafter, st, budgets, backend, draft_mode, max_n):
        us, wall = measure_op(fn, reset, args.iters, graphs, device, is_round)
        ar_us = us if op == "ar" else ar_us
        tokens = bs * (1 if op == "ar" else n + 1)  # target tokens: root + N (draft: the round's D + 1)
        need = op_bytes(kind, target, drafter, context, bs, tokens) if kind else None
        floor = 1e6 * need / bandwidth if need else None
        plan = allreduce_plan(op, n, target, drafter, bs) if allreduce is not None else []
        reduce_us = sum(count * allreduce(width, graphs) for count, width in plan)
        row = {"mode": "shape", "shape": args.shape, "context": context, "batch_size": bs,
               "temperature": temperature, **filters(args), "graphs": graphs, "op": op, "N": n,
               "time_us": round(us, 2),
               "floor_us": round(floor, 2) if floor else None,
               # 4 decimals: the table's 2 are rounded once (1.9147 shows 1.91, not 1.915's 1.92)
               "ratio": round(us / floor, 4) if floor else None, "vs_ar": round(us / ar_us, 4),
               "wall_us": round(wall[0], 2) if wall is not None else None,
               "host_us": round(wall[0] - wall[1], 2) if wall is not None and graphs else None,
               "bytes": round(need) if need else None, "bandwidth_gbs": round(bandwidth / 1e9, 1), "attention": backend,
               "device": str(device), "dtype": str(dtype).replace("torch.", ""), "fp8": args.fp8,
               "draft_layers": args.draft_layers, "tp": target.tp.size,
               "allreduce_us": round(allreduce(plan[0][1], graphs), 2) if plan else None,
               "allreduces": sum(count for count, _ in plan) if plan else None,
               "allreduce_share": round(reduce_us / us, 4) if plan else None}
        rows.append(row)
        emit(out, row)
        if lead:
            print(f"  C={context} bs {bs} T {temperature:g} graphs {'on ' if graphs else 'off'} {op:<12} N={n:<3}: "
                  f"{row['time_us']:10.1f} us" + (f"  (floor {row['floor_us']:.1f})" if floor else ""),
                  file=sys.stderr)  # the row's rounded values: the digits the table prints
    return rows


SHAPE_COLUMNS = [("context", "context", "{}"), ("bs", "batch_size", "{}"), ("T", "temperature", "{:g}"),
                 ("graphs", "graphs", "onoff"), ("op", "op", "{}"), ("N", "N", "{}"),
                 ("time us", "time_us", "{:.1f}"), ("floor us", "floor_us", "{:.1f}"),
                 ("ratio", "ratio", "{:.2f}"), ("x AR", "vs_ar", "{:.2f}"), ("host us", "host_us", "{:.1f}")]
TP_COLUMNS = [("allred us", "allreduce_us", "{:.1f}"), ("allred", "allreduce_share", "{:.0%}")]


# ---------------------------------------------------------------------------
# The run, in this process or as --tp ranks under torchrun
# ---------------------------------------------------------------------------

@dataclasses.dataclass
class ShapePlan:
    """What a shape run times: the ops of `round_ops` at every context, batch size,
    temperature and CUDA graphs setting, on random models of `cfg` and `dcfg`."""
    cfg: ModelConfig
    dcfg: DraftConfig
    contexts: list[int]
    budgets: list[int]
    batch_sizes: list[int]
    temperatures: list[float]
    graphs: list[bool]
    device: torch.device     # as resolved here; a rank under --tp runs on its own GPU
    dtype: torch.dtype
    backend: str             # attention backend
    draft_mode: str


def _shape_plan(args) -> ShapePlan:
    """The run `args` ask for, every option checked (a one-line UsageError) before
    anything is built or launched."""
    if args.copy_mib is not None and args.copy_mib < 1:
        raise UsageError(f"--copy-mib must be >= 1, got {args.copy_mib}")
    check_plot_path(args.plot, args.out)
    if args.shape not in SHAPES:
        raise UsageError(f"unknown shape '{args.shape}' (choose from {', '.join(SHAPES)})")
    contexts = parse_list(args.contexts, int, "context", minimum=1)
    budgets = parse_budgets(args, minimum=0)
    room = SHAPES[args.shape].context_length - max(max(budgets), BLOCK_SIZE - 1) - 1
    if max(contexts) > room:  # a round's tokens sit past the context: positions the model never serves
        raise UsageError(f"context {max(contexts)} leaves no room for a round's tokens within {args.shape}'s "
                         f"{SHAPES[args.shape].context_length} positions: --contexts at most {room}")
    batch_sizes = parse_list(args.batch_sizes or "1", int, "batch size", minimum=1, maximum=MAX_BENCH_BATCH)
    temperatures = parse_list(args.temperatures or "0", float, "temperature", minimum=0.0)
    draft_mode = check_sampled_options(args, temperatures, drafted=True)  # every context times draft steps and rounds
    if args.draft_layers < 1:
        raise UsageError(f"--draft-layers must be >= 1, got {args.draft_layers}")
    most = max(SHAPES[args.shape].num_layers, DRAFT_LAYERS)  # 100000 spent minutes building before any check
    if args.draft_layers > most:
        raise UsageError(f"--draft-layers must be <= {most} (the {args.shape} target's layers, or the default "
                         f"{DRAFT_LAYERS}), got {args.draft_layers}")
    if args.iters < 1:
        raise UsageError(f"--iters must be >= 1, got {args.iters}")
    if args.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {args.tp}")
    check_seed(args.seed, max(batch_sizes))
    device = resolve_device(args.device)
    graphs = usable_graphs(parse_graphs(args.graphs or ("on" if device.type == "cuda" else "off")), device)
    dtype = resolve_dtype(args.dtype, "bfloat16", device)  # auto: bf16 on CUDA, float32 on CPU
    backend = args.attention
    available = attention_backend(device, [SHAPES[args.shape].head_dim])
    if backend == "auto":
        backend = available
    if backend == "triton" and available != "triton":
        raise UsageError("--attention triton needs a CUDA device, the triton package and head_dim 64 or 128")
    cfg = dataclasses.replace(SHAPES[args.shape], fp8_block=None if args.fp8 is None else fp8_block(args.fp8))
    dcfg = draft_config(cfg, args.draft_layers)
    with build_on("meta", torch.float32):  # sizes only
        try:
            shells = [CausalLM(cfg, TPGroup()), DFlashDraftModel(dcfg, TPGroup())]
        except TreeflashError as e:  # the shapes are ours: only the --fp8 block the user gave can misfit
            if args.fp8 is None:
                raise
            raise UsageError(f"--fp8 {args.fp8}: {e}") from None
    if torchrun_env() is None:  # the launcher checks the host once for all its ranks (they load at once)
        check_weights_fit(shells, dtype, device)
    return ShapePlan(cfg, dcfg, contexts, budgets, batch_sizes, temperatures, graphs, device, dtype, backend,
                     draft_mode)


@contextlib.contextmanager
def one_line_errors(rank: int | None):
    """A failure while timing as one line, naming the rank under --tp (`relaunch` reports
    the first rank's line); running out of device memory included (a shape, context or
    batch too large for the GPU is bad input, not a crash)."""
    where = f"rank {rank}: " if rank is not None else ""
    try:
        yield
    except torch.OutOfMemoryError:
        raise TreeflashError(f"{where}out of device memory: use fewer or shorter --contexts, smaller "
                             f"--batch-sizes or --budgets, or a larger --tp") from None
    except TreeflashError as e:
        raise type(e)(f"{where}{e}") from None


def bench_argv(args) -> list[str]:
    """`args` of shape mode as `treeflash bench` options again (option --x-y holds
    args.x_y), without model-pair mode's (their defaults: given, they are refused)."""
    from treeflash.bench import MODE_ONLY, PAIR
    argv = ["bench"]
    for key, value in vars(args).items():
        if key in ("command", "func") or value is None or value is False or MODE_ONLY.get(key, ("",))[0] == PAIR:
            continue
        argv += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return argv


def relaunch(args, device: torch.device, graphs: list[bool]) -> int:
    """Run this bench again as --tp processes under torchrun (one per GPU, gloo on CPU);
    its exit status. The ranks get the device and graphs resolved here, so they
    repeat no note."""
    args = argparse.Namespace(**{**vars(args), "device": device.type,
                                 "graphs": ",".join("on" if g else "off" for g in graphs)})
    env = dict(os.environ)  # with NO_MULTICAST on GPUs (check_devices)
    root = str(Path(__file__).resolve().parents[2])  # the ranks import this checkout
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.tp)))  # else torchrun sets 1, noisily
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.tp),
           "-m", "treeflash", *bench_argv(args)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    errors, launcher_report = [], False
    for line in proc.stderr:  # the ranks' progress, and their one-line errors
        if line.startswith("treeflash: "):
            errors.append(line.strip().removeprefix("treeflash: ").removeprefix("error: "))
        elif line.startswith("Traceback") or "distributed.elastic" in line.replace("/", "."):
            launcher_report = True  # torchrun's account of the failed rank: the ranks' own lines say it
        elif not launcher_report:
            sys.stderr.write(line)
    if proc.wait() == 0:
        return 0
    # a rank's own error before the broken collectives it left its peers
    errors.sort(key=lambda e: any(h in e.lower() for h in COMM_HINTS))
    raise TreeflashError(f"bench --tp {args.tp}: " + (errors[0] if errors else f"a rank failed (exit {proc.returncode})"))


def _time_shape(args, plan: ShapePlan, group: TPGroup, device: torch.device) -> None:
    """One rank's run: its shards of the random models, then every setting timed; rank 0
    prints and writes the rows."""
    lead = group.rank == 0  # rank 0 prints and writes; every rank times
    out = open_out(args.out) if lead else None

    target, drafter = random_models(plan.cfg, plan.dcfg, device, plan.dtype, group)
    mib = args.copy_mib if args.copy_mib is not None else 2048 if device.type == "cuda" else 256
    bandwidth = copy_bandwidth(device, mib)
    allreduce = allreduce_timer(group, plan.cfg.hidden_size, plan.dtype, device, args.iters) if group.size > 1 else None
    if lead:
        ranks = f" per rank of tp {group.size}" if group.size > 1 else ""
        print(f"bench: shape {args.shape}{f' fp8 {args.fp8}' if args.fp8 else ''} ({_size(_bytes(target))} target, "
              f"{_size(_bytes(drafter))} "
              f"drafter of {args.draft_layers} layers{ranks}), {str(plan.dtype).replace('torch.', '')} on {device}, "
              f"attention {plan.backend}; copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write, {mib} MiB)"
              f"{filters_note(args)}")

    rows = []
    with torch.inference_mode():
        for context in plan.contexts:
            for bs in plan.batch_sizes:
                for temperature in plan.temperatures:
                    for graphs in plan.graphs:
                        rows += shape_rows(args, target, drafter, context, bs, temperature, graphs, plan.budgets,
                                           plan.backend, plan.draft_mode, bandwidth, device, plan.dtype, out, allreduce,
                                           lead)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    if lead:
        close_out(out, args.out)
        print(format_table(rows, SHAPE_COLUMNS + (TP_COLUMNS if group.size > 1 else [])))
        print_ratios(rows)
        fast = [r for r in rows if r["ratio"] is not None and r["ratio"] < 1]
        if fast:  # a floor is a lower bound: the copy that measured the bandwidth was slow (a cache, a cold start)
            print(f"note: {len(fast)} ops ran faster than their memory floor, so the copy bandwidth of "
                  f"{bandwidth / 1e9:.1f} GB/s ({mib} MiB) is below what they reached: their floors and ratios "
                  f"say little (a larger --copy-mib measures it better)", file=sys.stderr)
        if args.plot:
            plot_shape(rows, args.plot)


def bench_shape(args) -> int:
    """`treeflash bench --shape`: in this process, or with --tp > 1 as that many ranks
    under torchrun (this command again, `relaunch`), each joining the group."""
    plan = _shape_plan(args)
    rt = None
    if args.tp > 1 or torchrun_env() is not None:
        check_shardable(plan.cfg, plan.dcfg, args.tp)
        if torchrun_env() is None:
            check_devices(args.tp, plan.device)
            if args.out:
                open_out(args.out).close()  # a bad path fails here, once
            return relaunch(args, plan.device, plan.graphs)
        rt = join_group(args.tp, plan.device)
    with one_line_errors(rt.rank if rt is not None else None):
        group, device = (rt.group, rt.device) if rt is not None else (TPGroup(), plan.device)
        _time_shape(args, plan, group, device)
        if rt is not None:
            rt.leave()
    return 0
