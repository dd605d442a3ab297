"""`treeflash bench`: how fast is a round, and how close is it to the hardware?

Two modes, one command:

* **Model pair** (default): a real target + drafter generate a set of prompts with
  every (method, budget, batch size, CUDA graphs, temperature). Reports tokens/s,
  tau (mean tokens committed per round), time per round and the speedup over AR on
  the same engine. This is the number a user sees.

* **Shape** (`--shape qwen3-8b`): random weights of a published model shape, built
  directly on the device, with a KV cache that holds C tokens. Times the pieces of
  a round (AR step, verify of N+1 tokens, draft step, tree build, whole round) as
  CUDA graphs and compares each to its *memory floor*: the bytes it must read
  (weights + KV of the prefix) over the measured copy bandwidth. This is the number
  that says whether the engine or the hardware is the limit (BENCHMARKS.md section 2).
  With `--tp N` the command re-runs itself as N processes under torchrun (one per GPU;
  gloo on CPU); each builds its own shard and runs the same timing loop (NCCL
  all-reduces captured in the graphs), floors are per rank, and rank 0 reports.

Both print an aligned table and can write one JSON object per row (`--out`) and a
PNG plot (`--plot`, when matplotlib is importable).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from treeflash.cli import add_structured_args, read_prompts, structured_from
from treeflash.config import FP8_BLOCK, DraftConfig, ModelConfig, default_target_layer_ids
from treeflash.distributed import TPGroup
from treeflash.engine.llm import LLM, attention_backend, builtin_paths, resolve_device, resolve_dtype
from treeflash.engine.graphs import capture
from treeflash.engine.pipeline import RoundPipeline
from treeflash.engine.round import DRAFT_MODES, METHODS, SpeculativeDecoder
from treeflash.engine.sampling import SamplingBatch
from treeflash.engine.tp import COMM_HINTS, check_devices, check_shardable, join_group, torchrun_env
from treeflash.engine.tree import empty_tree
from treeflash.errors import TreeflashError, UsageError
from treeflash.models.dflash import DFlashDraftModel
from treeflash.models.loader import build_on
from treeflash.models.moe import KIMI_K2_4L, weight_bytes_read
from treeflash.models.transformer import CausalLM
from treeflash.sampling_params import SamplingParams
from treeflash.tokenizer import Tokenizer

PAIR_BUDGETS = "16,32,64,128,256"
SHAPE_BUDGETS = "0,15,31,63,127,255"
PAIR_METHODS = ",".join(METHODS)
PAIR_NEW_TOKENS = 128
SHAPE_CONTEXTS = "1024,4096,16384"
SHAPE_DRAFT_LAYERS = 5
SHAPE_ITERS = 50
BLOCK_SIZE = 16          # drafter block of the shape mode (the published DFlash drafters)
FP8_DEFAULT = "x".join(map(str, FP8_BLOCK))    # --fp8: the blocks of the published FP8 checkpoints
WARMUP = 3               # eager calls (or side-stream calls before a capture) before timing
ALLREDUCE_RUN = 16       # all-reduces per timed call when measuring one's latency

# A few Python-code prompts: the built-in model is a Python-code model, and code is
# where block drafters shine, so this is the honest default workload.
PYTHON_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):\n",
    "def read_json(path):\n    with open(path) as f:\n",
    "def quicksort(items):\n    if len(items) <= 1:\n        return items\n",
    "for i in range(10):\n    if i % 2 == 0:\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n",
    "def merge(a, b):\n    \"\"\"Merge two sorted lists.\"\"\"\n    result = []\n",
    "import argparse\n\nparser = argparse.ArgumentParser()\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
]


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="benchmark a model pair (tokens/s, tau, speedup) or a model shape (round costs vs memory floor)",
        description="Model-pair mode (default) times generation with a real target + drafter; "
                    "--shape times the pieces of a round on random weights of a model shape.")
    p.add_argument("--model", help="target checkpoint folder (default: the built-in model)")
    p.add_argument("--draft-model", help="DFlash drafter folder (default with the built-in model: its drafter)")
    p.add_argument("--prompt-file", help="one prompt per line, or JSONL with a 'prompt' field")
    p.add_argument("--corpus", help="tokenized corpus folder (treeflash train corpus): prompts from its held-out split")
    p.add_argument("--num-prompts", type=int, help="how many prompts to use (default: all of the file, else 8)")
    p.add_argument("--methods", default=PAIR_METHODS, help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--budgets", help=f"DDTree budgets N (default {PAIR_BUDGETS}; --shape: {SHAPE_BUDGETS})")
    p.add_argument("--max-budget", type=int, default=512,
                   help="the largest budget accepted (default 512, as for generate: a round verifies N + 1 "
                        "tokens at once, under an (N + 1)^2 mask)")
    p.add_argument("--batch-sizes", help="comma list (default 1,2,4; --shape: 1)")
    p.add_argument("--graphs", help="on, off or on,off: CUDA graphs (default on,off; --shape: on on CUDA)")
    p.add_argument("--max-new-tokens", type=int, default=PAIR_NEW_TOKENS)
    p.add_argument("--temperatures", help="comma list, 0 = greedy (default 0,0.7,1.0; --shape: 0)")
    p.add_argument("--top-k", type=int, default=0, help="top-k of every sampled request (0 or -1: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of every sampled request (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p of every sampled request (0: off)")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed S + i")
    p.add_argument("--logprobs", type=int, metavar="K", help="requests also return logprobs with K alternatives "
                                                             "(model-pair mode; default: none)")
    p.add_argument("--eos", action="store_true", help="stop requests at EOS (default: always generate "
                                                      "--max-new-tokens, so every method does the same work)")
    p.add_argument("--draft-mode", default="coupled", choices=DRAFT_MODES,
                   help="how trees are drafted at T > 0 (see SpeculativeDecoder)")
    add_structured_args(p)  # every request of model-pair mode constrained alike
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", help="auto (checkpoint dtype; --shape: bfloat16 on CUDA, "
                                                   "float32 on CPU), float32, bfloat16, float16")
    p.add_argument("--quantization", choices=["fp8"], help="model-pair mode: the target's layers quantized to FP8 "
                                                           "blocks while loading (--shape: --fp8)")
    p.add_argument("--out", help="write one JSON object per row to this file")
    p.add_argument("--plot", help="write a PNG plot to this file (needs matplotlib)")
    s = p.add_argument_group("shape mode")
    s.add_argument("--shape", help=f"random-weight model shape: {', '.join(SHAPES)}")
    s.add_argument("--fp8", nargs="?", const=FP8_DEFAULT, metavar="ROWSxCOLS",
                   help="the target's linear layers in block-scaled FP8, one scale per block of ROWS x COLS "
                        "(default 128x128, as Qwen3-FP8 and DeepSeek-V3 publish them)")
    s.add_argument("--contexts", default=SHAPE_CONTEXTS, help="committed tokens C per request")
    s.add_argument("--draft-layers", type=int, default=SHAPE_DRAFT_LAYERS)
    s.add_argument("--iters", type=int, default=SHAPE_ITERS, help="timed calls per op (median)")
    s.add_argument("--attention", default="auto", choices=["auto", "sdpa", "triton"],
                   help="attention backend (auto: triton on CUDA when installed)")
    s.add_argument("--copy-mib", type=int, help="size of the bandwidth copy (default 2048 on CUDA, 256 on CPU)")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel size: N ranks under torchrun, one per GPU "
                                                     "(gloo on CPU); floors are per rank")
    p.set_defaults(func=cmd_bench)
    return p


def cmd_bench(args) -> int:
    return bench_shape(args) if args.shape is not None else bench_pairs(args)


def check_seed(seed: int, requests: int) -> None:
    """Request i samples with seed S + i, and every seed must lie in [0, 2^63): say so
    before a model loads."""
    if not 0 <= seed <= 2 ** 63 - requests:
        raise UsageError(f"--seed must be in [0, 2^63 - {requests}] for {requests} requests, got {seed}")


MAX_BENCH_BATCH = 4096     # a timed batch's requests at most (--batch-sizes 10^9 built 10^9 indices)
MAX_BENCH_PROMPTS = 65536  # --num-prompts at most (the built-in prompts are cycled up to it)


def parse_list(text: str, kind, what: str, minimum=None, maximum=None) -> list:
    """'1,2,4' -> [1, 2, 4], with a one-line UsageError for anything else."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise UsageError(f"empty {what} list")
    out = []
    for t in items:
        try:
            v = kind(t)
            if kind is float and not math.isfinite(v):
                raise ValueError(t)
        except ValueError:
            raise UsageError(f"bad {what} '{t}' (expected a comma-separated list of "
                             f"{'integers' if kind is int else 'numbers'})") from None
        if minimum is not None and v < minimum:
            raise UsageError(f"{what} must be >= {minimum}, got {t}")
        if maximum is not None and v > maximum:
            raise UsageError(f"{what} must be <= {maximum}, got {t}")
        out.append(v)
    return list(dict.fromkeys(out))


def parse_budgets(args, minimum: int) -> list[int]:
    """--budgets, each at most --max-budget: a budget of 100000 asked for a 10 GB mask per
    request and was killed for memory."""
    budgets = parse_list(args.budgets or (SHAPE_BUDGETS if args.shape is not None else PAIR_BUDGETS), int, "budget",
                         minimum=minimum)
    if args.max_budget < 1:
        raise UsageError(f"--max-budget must be >= 1, got {args.max_budget}")
    if max(budgets) > args.max_budget:
        raise UsageError(f"budget {max(budgets)} exceeds --max-budget {args.max_budget} (raise it with --max-budget)")
    return budgets


def parse_graphs(text: str) -> list[bool]:
    words = parse_list(text, str, "graphs")
    bad = [w for w in words if w not in ("on", "off")]
    if bad:
        raise UsageError(f"--graphs takes on, off or on,off, got '{bad[0]}'")
    return [w == "on" for w in words]


def usable_graphs(graphs: list[bool], device: torch.device) -> list[bool]:
    """CUDA graphs need CUDA: drop 'on' elsewhere, with a note (an error if nothing is left)."""
    if device.type == "cuda" or True not in graphs:
        return graphs
    if False not in graphs:
        raise UsageError("--graphs on needs a CUDA device (use --graphs off)")
    print(f"note: graphs 'on' skipped: CUDA graphs need a CUDA device (running on {device.type})",
          file=sys.stderr)
    return [False]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------
# Model-pair mode
# ---------------------------------------------------------------------------

def corpus_prompts(folder: str, k: int, length: int = 64) -> list[list[int]]:
    """k token-id prompts from the held-out split of a tokenized training corpus: code
    the drafter never trained on, so tau is not flattered."""
    from treeflash.train.corpus import load_corpus
    from treeflash.train.drafter import held_prompts
    heldout = load_corpus(folder).heldout
    if heldout.size < 2:
        raise UsageError(f"the corpus in {folder} has no held-out split to take prompts from (made with "
                         f"--heldout-fraction 0?): give --prompt-file, or a corpus with one")
    return held_prompts(heldout, k, length)


def load_prompts(args) -> list:
    """--prompt-file, else --corpus (held-out split), else the built-in Python prompts
    (cycled up to --num-prompts)."""
    k = args.num_prompts
    if k is not None and not 1 <= k <= MAX_BENCH_PROMPTS:
        raise UsageError(f"--num-prompts must be from 1 to {MAX_BENCH_PROMPTS}, got {k}")
    if args.prompt_file and args.corpus:
        raise UsageError("give --prompt-file or --corpus, not both")
    if args.prompt_file:
        prompts = read_prompts(argparse.Namespace(prompt=None, prompt_file=args.prompt_file))
        if k and len(prompts) < k:
            raise UsageError(f"--num-prompts {k}, but {args.prompt_file} holds {len(prompts)} prompt(s)")
        return prompts[:k] if k else prompts
    if args.corpus:
        return corpus_prompts(args.corpus, k or 8)
    return [PYTHON_PROMPTS[i % len(PYTHON_PROMPTS)] for i in range(k or 8)]


def pair_configs(methods: list[str], budgets: list[int]) -> list[tuple[str, int | None]]:
    """(method, budget) in run order: AR first, so every later row knows its speedup."""
    out = []
    for m in sorted(methods, key=METHODS.index):
        out += [(m, n) for n in budgets] if m == "ddtree" else [(m, None)]
    return out


def batch_indices(n: int, bs: int) -> list[list[int]]:
    """Prompt indices in batches of exactly `bs` (the last one wraps around): a short
    last batch would be a new graph shape, captured inside the timed region."""
    batches = -(-n // bs)
    return [[(b * bs + i) % n for i in range(bs)] for b in range(batches)]


def filters(args) -> dict:
    """The sampling filters every sampled request gets (--top-k, --top-p, --min-p),
    checked as `SamplingParams` checks them."""
    given = {"top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p}
    SamplingParams(temperature=1.0, **given).validate()
    return given


def filters_note(args) -> str:
    off = {"top_k": (0, -1), "top_p": (1.0,), "min_p": (0.0,)}
    on = [f"{name.replace('_', '-')} {value:g}" for name, value in filters(args).items() if value not in off[name]]
    return f"; sampled requests with {', '.join(on)}" if on else ""


def measure_pair(llm, prompts: list[str], bs: int, temperature: float, args) -> dict:
    """Warm up (with CUDA graphs on every batch once: prompts of another padded length
    capture their prefill graph then, not while timed; else on the first), then time
    all batches."""
    def params(i):
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature,
                              seed=args.seed + i, ignore_eos=not args.eos, logprobs=args.logprobs,
                              structured_outputs=structured_from(args), **filters(args))

    def generate(batch):
        return llm.generate([prompts[i] for i in batch], [params(i) for i in batch])

    batches = batch_indices(len(prompts), bs)
    for batch in batches if llm.cuda_graphs else batches[:1]:
        generate(batch)
    captures = llm.graph_captures
    outs, steps = [], 0
    sync(llm.device)
    start = time.perf_counter()
    for batch in batches:
        got = generate(batch)
        outs += got
        steps += max(o.stats["rounds"] for o in got)  # rounds the batch ran (prefill counts as one)
    sync(llm.device)
    recaptures = llm.graph_captures - captures  # captured while timed (none expected)
    seconds = time.perf_counter() - start
    tokens = sum(o.stats["new_tokens"] for o in outs)
    request_rounds = sum(o.stats["rounds"] for o in outs)
    return {"requests": len(outs), "new_tokens": tokens, "rounds": steps, "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 2), "tau": round(tokens / request_rounds, 4),
            "ms_per_round": round(1e3 * seconds / steps, 4), "recaptures": recaptures,
            "token_ids": [o.token_ids for o in outs]}


def bench_pairs(args) -> int:
    shape_only = [flag for flag, given in (("--tp", args.tp != 1), ("--contexts", args.contexts != SHAPE_CONTEXTS),
                                           ("--draft-layers", args.draft_layers != SHAPE_DRAFT_LAYERS),
                                           ("--iters", args.iters != SHAPE_ITERS),
                                           ("--attention", args.attention != "auto"),
                                           ("--copy-mib", args.copy_mib is not None), ("--fp8", args.fp8 is not None))
                  if given]
    if shape_only:
        raise UsageError(f"{shape_only[0]} applies to --shape only (model-pair mode times whole requests "
                         f"on a real model pair, in one process)")
    methods = parse_list(args.methods, str, "method")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise UsageError(f"unknown method '{bad[0]}' (choose from {', '.join(METHODS)})")
    budgets = parse_budgets(args, minimum=None)
    if "ddtree" in methods and min(budgets) < 1:
        raise UsageError(f"ddtree budget must be >= 1, got {min(budgets)}")
    batch_sizes = parse_list(args.batch_sizes or "1,2,4", int, "batch size", minimum=1, maximum=MAX_BENCH_BATCH)
    temperatures = parse_list(args.temperatures or "0,0.7,1.0", float, "temperature", minimum=0.0)
    filters(args)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    SamplingParams(logprobs=args.logprobs).validate()
    if structured_from(args) is not None and not args.eos:  # past its end a text could only repeat EOS
        raise UsageError("--json-schema, --regex, --choice, --grammar and --json-object need --eos: a constrained "
                         "text ends at its end token")
    graphs = parse_graphs(args.graphs or "on,off")
    prompts = load_prompts(args)
    check_seed(args.seed, len(prompts))
    model_dir = Path(args.model or builtin_paths()[0])
    if args.corpus and (model_dir / "tokenizer.json").exists() and \
            not Tokenizer(args.corpus).same_vocabulary(Tokenizer(model_dir)):  # before the model loads
        raise UsageError(f"the corpus in {args.corpus} was tokenized with another tokenizer than the model's: "
                         f"its prompts would be other text to it")
    check_plot_path(args.plot)
    graphs_list = usable_graphs(graphs, resolve_device(args.device))
    inputs = [args.prompt_file, args.corpus, model_dir, args.draft_model or builtin_paths()[1]]
    out = open_out(args.out, inputs=[i for i in inputs if i])

    # A speculative method, if any is asked for, so that the built-in model brings its drafter.
    base = LLM(args.model, draft_model=args.draft_model, method=next((m for m in methods if m != "ar"), "ar"),
               device=args.device, dtype=args.dtype, max_budget=args.max_budget, cuda_graphs=False,
               max_batch=max(batch_sizes), quantization=args.quantization)  # each timed batch: one engine batch
    if base.drafter is None and set(methods) - {"ar"}:
        raise UsageError(f"methods {', '.join(m for m in methods if m != 'ar')} need a drafter (--draft-model)")
    print(f"bench: {len(prompts)} prompts, {args.max_new_tokens} new tokens each, on {base.device} "
          f"({str(base.dtype).replace('torch.', '')}){filters_note(args)}")
    short = sum(len(base.encode(p)) + args.max_new_tokens > base.max_model_len for p in prompts)
    if short:  # their requests stop at the context: fewer tokens, and rounds of another length
        print(f"note: {short} of {len(prompts)} prompts leave less than --max-new-tokens {args.max_new_tokens} "
              f"of the context of {base.max_model_len} tokens: their requests stop there (the new_tokens column "
              f"counts what was made)", file=sys.stderr)

    rows, ar = [], {}  # ar: (batch size, temperature, graphs) -> (tokens/s, token ids)
    for method, budget in pair_configs(methods, budgets):
        for graphs in graphs_list:
            llm = base.with_method(method, budget, graphs, args.draft_mode)
            for bs in batch_sizes:
                for temperature in temperatures:
                    m = measure_pair(llm, prompts, bs, temperature, args)
                    key = (bs, temperature, graphs)
                    if method == "ar":
                        ar[key] = (m["tokens_per_s"], m["token_ids"])
                    row = pair_row(llm, budget, key, m, ar.get(key), args)
                    rows.append(row)
                    emit(out, row)
                    print(f"  {row['label']:<12} graphs {'on ' if graphs else 'off'} bs {bs} T {temperature:g}: "
                          f"{row['tokens_per_s']:.1f} tok/s, tau {row['tau']:.2f}", file=sys.stderr)
            llm.drop_graphs()  # free the captured graphs and their state before the next config
            del llm
            if base.device.type == "cuda":
                torch.cuda.empty_cache()
    close_out(out, args.out)
    print(format_table(rows, PAIR_COLUMNS))
    if any(r["recaptures"] for r in rows):
        print("note: some rows captured a CUDA graph while timed")
    if args.plot:
        plot_pairs(rows, args.plot)
    return 0


def pair_row(llm, budget: int | None, key: tuple, m: dict, ar: tuple | None, args) -> dict:
    """One JSONL row. speedup: tokens/s over AR's at the same (batch size, temperature,
    graphs); same_as_ar: fraction of requests whose tokens equal AR's (lossless: 1.0, up
    to floating-point near-ties between batched and single-token logits)."""
    bs, temperature, graphs = key
    m = dict(m)
    ids = m.pop("token_ids")
    return {"mode": "pair", "method": llm.method, "budget": llm.decoder.budget,
            "label": llm.method + (f"-{budget}" if llm.method == "ddtree" else "")
                     + (f" lp{args.logprobs}" if args.logprobs is not None else ""),
            "logprobs": args.logprobs,
            "batch_size": bs, "graphs": graphs, "temperature": temperature, **filters(args), **m,
            "speedup": round(m["tokens_per_s"] / ar[0], 3) if ar else None,
            "same_as_ar": (round(sum(a == b for a, b in zip(ids, ar[1])) / len(ids), 3)
                           if ar and llm.method != "ar" else None),
            "device": str(llm.device), "dtype": str(llm.dtype).replace("torch.", ""),
            "model": str(args.model or "built-in"), "draft_model": args.draft_model}


PAIR_COLUMNS = [("method", "label", "{}"), ("graphs", "graphs", "onoff"), ("bs", "batch_size", "{}"),
                ("T", "temperature", "{:g}"), ("tok/s", "tokens_per_s", "{:.1f}"), ("tau", "tau", "{:.2f}"),
                ("ms/round", "ms_per_round", "{:.2f}"), ("speedup", "speedup", "{:.2f}x"),
                ("same as AR", "same_as_ar", "{:.2f}")]


# ---------------------------------------------------------------------------
# Shape mode
# ---------------------------------------------------------------------------

GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

# Published shapes (random weights: only the shapes matter; Qwen3-30B-A3B: 128 experts, 8 per token, in
# every layer; gpt-oss-20b: 32 experts, 4 per token, a 128-token window in every other layer), a Kimi-K2-like
# MoE cut to 4 layers
# (one dense, three of 384 experts; GQA in place of MLA: see treeflash.models.moe), and one for CPU tests.
SHAPES = {
    "qwen3-8b": ModelConfig("qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            rope_theta=1e6, max_position_embeddings=40960),
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
                               rope_theta=150000.0, rope_scaling=GPT_OSS_ROPE, max_position_embeddings=131072,
                               attention_bias=True, num_experts=32, num_experts_per_tok=4,
                               moe_intermediate_size=2880, norm_topk_prob=True, sliding_window=128,
                               sliding_layers=tuple(range(0, 24, 2)), attention_sinks=True, expert_bias=True,
                               swiglu_limit=7.0),
    "tiny": ModelConfig("qwen3", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=16),
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
                                                  sliding_layers=(), attention_sinks=False, attention_bias=False),
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


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


def _bytes(model, skip=()) -> int:
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name not in skip)


def op_bytes(kind: str, target, drafter, context: int, batch: int, tokens: int) -> int | None:
    """Bytes an op over `tokens` target tokens must read from memory at least, on this
    rank: the weights it multiplies by (the rank's shards; of an MoE layer's experts, the
    expected number of distinct ones the tokens pick) and the KV of the C committed tokens
    of every request (the rank's KV heads). Embedding rows, activations and the few KV
    slots written are negligible. A round reads the LM head twice (draft, then verify:
    dependent, so they cannot share one read). None: no memory floor."""
    elem = target.lm_head.weight.element_size()
    head = _bytes(target.lm_head)
    body = weight_bytes_read(target, tokens)
    kv_t = batch * _kv_values(target.model.layers, context) * elem
    draft = _bytes(drafter, skip={"fc.weight"})
    kv_d = batch * _kv_values(drafter.layers, context) * elem
    return {"ar": body + head + kv_t, "verify": body + head + kv_t, "draft": draft + head + kv_d,
            "round": body + 2 * head + kv_t + draft + _bytes(drafter.fc) + kv_d}.get(kind)


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
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    us = time_device(lambda: dst.copy_(src), lambda: None, 10 if device.type == "cuda" else 5, device)
    return 2 * n / (us * 1e-6)


def round_ops(target, drafter, st, budgets: list[int], backend: str, draft_mode: str):
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
    ar_state = dataclasses.replace(st, draft_cache=None)  # same buffers, no drafter context
    ddtree = {n: decoder("ddtree", n) for n in budgets if n}
    logits = dflash.draft_logits(st)  # a fixed draft: trees for verify and tree-build ops

    def verify(tree):
        """Target forward over root + N nodes with the tree mask, and the LM head."""
        return lambda: dflash.verify(st, tree)[0]

    def tree_for(n):
        """The DDTree of N nodes over the fixed draft, as the round builds it."""
        return ddtree[n].tree_from_logits(logits, st.anchor) if n else empty_tree(st.anchor)

    D = drafter.block_size - 1
    ops = [("ar", 0, "ar", lambda: ar.round(ar_state), True)]
    ops += [("verify", n, "verify", verify(tree_for(n)), False) for n in budgets]
    ops += [("draft", D, "draft", lambda: dflash.draft_logits(st), False)]
    ops += [("tree", n, None, (lambda n=n: tree_for(n)), False) for n in budgets if n]
    ops += [("round-dflash", D, "round", lambda: dflash.round(st), True)]
    ops += [("round", n, "round", (lambda d=ddtree[n]: d.round(st)), True) for n in budgets if n]
    return ops


def new_shape_state(target, drafter, context: int, batch: int, temperature: float, budgets: list[int],
                    graphs: bool, seed: int, filters: dict | None = None):
    """A batch state as if every request had committed `context` tokens. The caches
    hold zeros: attention reads them all the same."""
    dev = target.lm_head.weight.device
    dec = SpeculativeDecoder(target, drafter, "ddtree", max(budgets))  # the round that needs the most slots
    capacity = -(-(context + dec.tree_slots) // 256) * 256  # tight: graph kernels size their work by capacity
    params = [SamplingParams(temperature=temperature, seed=seed + i, **(filters or {})) for i in range(batch)]
    st = dec.new_state(batch, capacity, SamplingBatch.from_params(params, dev))
    st.n.fill_(context)
    st.anchor.random_(0, target.config.vocab_size - 1)
    st.max_n = None if graphs else context  # as the engine: graphs read the whole cache
    return st


def bench_shape(args) -> int:
    if args.model or args.draft_model or args.prompt_file or args.corpus:
        raise UsageError("--shape uses random weights: it takes no --model, --draft-model, --prompt-file or --corpus")
    if args.logprobs is not None:
        raise UsageError("--logprobs applies to model-pair mode (--shape times rounds without them)")
    pair_only = [flag for flag, given in (("--methods", args.methods != PAIR_METHODS),
                                          ("--num-prompts", args.num_prompts is not None),
                                          ("--max-new-tokens", args.max_new_tokens != PAIR_NEW_TOKENS),
                                          ("--eos", args.eos), ("--quantization", args.quantization is not None),
                                          ("--json-schema, --regex, --choice, --grammar or --json-object",
                                           structured_from(args) is not None))
                 if given]
    if pair_only:
        raise UsageError(f"{pair_only[0]} applies to model-pair mode (--shape times AR steps, drafts and "
                         f"verify rounds of every budget)")
    if args.copy_mib is not None and args.copy_mib < 1:
        raise UsageError(f"--copy-mib must be >= 1, got {args.copy_mib}")
    check_plot_path(args.plot)
    if args.shape not in SHAPES:
        raise UsageError(f"unknown shape '{args.shape}' (choose from {', '.join(SHAPES)})")
    contexts = parse_list(args.contexts, int, "context", minimum=1)
    budgets = parse_budgets(args, minimum=0)
    batch_sizes = parse_list(args.batch_sizes or "1", int, "batch size", minimum=1, maximum=MAX_BENCH_BATCH)
    temperatures = parse_list(args.temperatures or "0", float, "temperature", minimum=0.0)
    filters(args)
    if args.draft_layers < 1:
        raise UsageError(f"--draft-layers must be >= 1, got {args.draft_layers}")
    if args.iters < 1:
        raise UsageError(f"--iters must be >= 1, got {args.iters}")
    if args.tp < 1:
        raise UsageError(f"--tp must be >= 1, got {args.tp}")
    check_seed(args.seed, max(batch_sizes))
    device = resolve_device(args.device)
    graphs_list = usable_graphs(parse_graphs(args.graphs or ("on" if device.type == "cuda" else "off")), device)
    dtype = resolve_dtype(args.dtype, "bfloat16", device)  # auto: bf16 on CUDA, float32 on CPU
    backend = args.attention
    available = attention_backend(device, [SHAPES[args.shape].head_dim])
    if backend == "auto":
        backend = available
    if backend == "triton" and available != "triton":
        raise UsageError("--attention triton needs a CUDA device, the triton package and head_dim 64 or 128")
    cfg = dataclasses.replace(SHAPES[args.shape], fp8_block=None if args.fp8 is None else fp8_block(args.fp8))
    dcfg = draft_config(cfg, args.draft_layers)

    rt = None
    if args.tp > 1 or torchrun_env() is not None:
        check_shardable(cfg, dcfg, args.tp)
        if torchrun_env() is None:
            check_devices(args.tp, device)
            if args.out:
                open_out(args.out).close()  # a bad path fails here, once
            return relaunch(args, device, graphs_list)
        rt = join_group(args.tp, device)
    with one_line_errors(rt.rank if rt is not None else None):
        group, device = (rt.group, rt.device) if rt is not None else (TPGroup(), device)
        lead = group.rank == 0  # rank 0 prints and writes; every rank times
        out = open_out(args.out) if lead else None

        target, drafter = random_models(cfg, dcfg, device, dtype, group)
        mib = args.copy_mib if args.copy_mib is not None else 2048 if device.type == "cuda" else 256
        bandwidth = copy_bandwidth(device, mib)
        allreduce = allreduce_timer(group, cfg.hidden_size, dtype, device, args.iters) if group.size > 1 else None
        if lead:
            ranks = f" per rank of tp {group.size}" if group.size > 1 else ""
            print(f"bench: shape {args.shape}{f' fp8 {args.fp8}' if args.fp8 else ''} ({_size(_bytes(target))} target, "
                  f"{_size(_bytes(drafter))} "
                  f"drafter of {args.draft_layers} layers{ranks}), {str(dtype).replace('torch.', '')} on {device}, "
                  f"attention {backend}; copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write, {mib} MiB)"
                  f"{filters_note(args)}")

        rows = []
        with torch.inference_mode():
            for context in contexts:
                for bs in batch_sizes:
                    for temperature in temperatures:
                        for graphs in graphs_list:
                            rows += shape_rows(args, target, drafter, context, bs, temperature, graphs, budgets,
                                               backend, bandwidth, device, dtype, out, allreduce, lead)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
        if lead:
            close_out(out, args.out)
            print(format_table(rows, SHAPE_COLUMNS + (TP_COLUMNS if group.size > 1 else [])))
            print_ratios(rows)
            if args.plot:
                plot_shape(rows, args.plot)
        if rt is not None:
            rt.leave()
    return 0


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
    """`args` as `treeflash bench` options again (option --x-y holds args.x_y)."""
    argv = ["bench"]
    for key, value in vars(args).items():
        if key in ("command", "func") or value is None or value is False:
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
    root = str(Path(__file__).resolve().parent.parent)  # the ranks import this checkout
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


def shape_rows(args, target, drafter, context, bs, temperature, graphs, budgets, backend, bandwidth,
               device, dtype, out, allreduce=None, lead: bool = True) -> list[dict]:
    """Time every op of `round_ops` on one state; one row each. Whole rounds on CUDA
    also get wall_us, the wall time per round of back-to-back rounds pipelined as the
    engine runs them (`time_wall`), and host_us = wall_us - the GPU-busy time of those
    same rounds: the host time per round that the GPU waits for. With tensor parallelism
    (`allreduce`: see `allreduce_timer`) a row also has the latency of one hidden-state
    all-reduce at the op's (first) token count and the all-reduce share of the op: an
    estimate, count x latency / op time, from all-reduces timed alone (in the op they
    may overlap other work, or wait for a slower rank)."""
    st = new_shape_state(target, drafter, context, bs, temperature, budgets, graphs, args.seed, filters(args))
    n0 = st.n.clone()

    def reset():
        st.n.copy_(n0)

    rows, ar_us = [], None
    for op, n, kind, fn, is_round in round_ops(target, drafter, st, budgets, backend, args.draft_mode):
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
               "ratio": round(us / floor, 3) if floor else None, "vs_ar": round(us / ar_us, 3),
               "wall_us": round(wall[0], 2) if wall is not None else None,
               "host_us": round(wall[0] - wall[1], 2) if wall is not None else None,
               "bytes": need, "bandwidth_gbs": round(bandwidth / 1e9, 1), "attention": backend,
               "device": str(device), "dtype": str(dtype).replace("torch.", ""), "draft_layers": args.draft_layers,
               "tp": target.tp.size,
               "allreduce_us": round(allreduce(plan[0][1], graphs), 2) if plan else None,
               "allreduces": sum(count for count, _ in plan) if plan else None,
               "allreduce_share": round(reduce_us / us, 3) if plan else None}
        rows.append(row)
        emit(out, row)
        if lead:
            print(f"  C={context} bs {bs} T {temperature:g} graphs {'on ' if graphs else 'off'} {op:<12} N={n:<3}: "
                  f"{us:10.1f} us" + (f"  (floor {floor:.1f})" if floor else ""), file=sys.stderr)
    return rows


SHAPE_COLUMNS = [("context", "context", "{}"), ("bs", "batch_size", "{}"), ("T", "temperature", "{:g}"),
                 ("graphs", "graphs", "onoff"), ("op", "op", "{}"), ("N", "N", "{}"),
                 ("time us", "time_us", "{:.1f}"), ("floor us", "floor_us", "{:.1f}"),
                 ("ratio", "ratio", "{:.2f}"), ("x AR", "vs_ar", "{:.2f}"), ("host us", "host_us", "{:.1f}")]
TP_COLUMNS = [("allred us", "allreduce_us", "{:.1f}"), ("allred", "allreduce_share", "{:.0%}")]


SHAPE_SETTING = ("context", "batch_size", "temperature", "graphs")  # the rows of one state


def print_ratios(rows: list[dict]) -> None:
    """verify(N)/AR and round(N)/AR per setting: the cost of verifying a bigger tree."""
    for (c, bs, t, g), sel in grouped(rows, SHAPE_SETTING).items():
        for op in ("verify", "round"):
            pairs = "  ".join(f"N={r['N']}: {r['vs_ar']:.2f}" for r in sel if r["op"] == op)
            if pairs:
                print(f"{op}(N)/AR  C={c} bs={bs} T={t:g} graphs {'on' if g else 'off'}:  {pairs}")


# ---------------------------------------------------------------------------
# Output: table, JSONL, plots
# ---------------------------------------------------------------------------

def grouped(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    """The rows by their values of `keys`, groups in the order they first appear."""
    groups = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "onoff":
        return "on" if value else "off"
    return fmt.format(value)


def format_table(rows: list[dict], columns) -> str:
    """Aligned text table: text columns left-aligned, numbers right-aligned, None as '-'."""
    cells = [[_cell(r.get(key), fmt) for _, key, fmt in columns] for r in rows]
    widths = [max([len(title)] + [len(c[i]) for c in cells]) for i, (title, _, _) in enumerate(columns)]
    left = [fmt == "onoff" or any(isinstance(r.get(key), str) for r in rows) for _, key, fmt in columns]

    def line(values):
        return "  ".join(v.ljust(w) if lft else v.rjust(w) for v, w, lft in zip(values, widths, left)).rstrip()

    return "\n".join([line([t for t, _, _ in columns]), line(["-" * w for w in widths])] + [line(c) for c in cells])


PLOT_FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")  # matplotlib's


def check_plot_path(path: str | None) -> None:
    """Refuse a --plot path that cannot be written before the run, not after it: a
    folder, a name matplotlib would add .png to or cannot write, an unwritable folder."""
    if not path:
        return
    if Path(path).is_dir():
        raise UsageError(f"--plot {path} is a folder: give a file name ending in .png, .svg or .pdf")
    if Path(path).suffix.lower() not in PLOT_FORMATS:
        raise UsageError(f"--plot {path}: the name must end in .png, .svg or .pdf (or {', '.join(PLOT_FORMATS[3:])})")
    folder = Path(path).resolve().parent
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise UsageError(f"cannot write the plot {path}: {folder} is not a writable folder")


def open_out(path: str | None, inputs=()):
    """Open --out before the (long) run, so a bad path fails at once; rows are written
    as they are measured, so an interrupted GPU run keeps what it measured. Refused if
    it is one of the run's `inputs` (files, or folders it lies in): opening it empties it,
    and a model's config.json or the prompt file was lost that way."""
    if not path:
        return None
    target = Path(path).resolve()
    for given in inputs:
        source = Path(given).resolve()
        if target == source or source in target.parents:
            raise UsageError(f"--out {path} is {'an input' if target == source else f'inside {given}'}, "
                             f"which this run reads: choose another path")
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as e:
        raise TreeflashError(f"cannot write {path}: {e.strerror}") from None


def emit(out, row: dict) -> None:
    if out is not None:
        out.write(json.dumps(row) + "\n")
        out.flush()


def close_out(out, path: str | None) -> None:
    if out is not None:
        out.close()
        print(f"wrote {path}", file=sys.stderr)


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed: no plot written (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def plot_pairs(rows: list[dict], path: str) -> None:
    """tokens/s per method/budget, one line per (batch size, temperature, graphs)."""
    plt = _pyplot()
    if plt is None or not rows:
        return
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 * len(labels) + 2), 4.5))
    for (bs, t, g), sel in grouped(rows, ("batch_size", "temperature", "graphs")).items():
        pts = {r["label"]: r["tokens_per_s"] for r in sel}
        xs = [i for i, lab in enumerate(labels) if lab in pts]
        ax.plot(xs, [pts[labels[i]] for i in xs], marker="o",
                label=f"bs {bs}, T {t:g}, graphs {'on' if g else 'off'}")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_ylabel("tokens/s")
    ax.set_title("treeflash bench: tokens/s by method")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, plt, path)


def plot_shape(rows: list[dict], path: str) -> None:
    """verify(N) and round(N) time against N, one color per setting, with the AR step
    as a dotted line: where tree size stops being free."""
    plt = _pyplot()
    if plt is None or not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (key, sel) in enumerate(grouped(rows, SHAPE_SETTING).items()):
        tag = f"C={key[0]} bs {key[1]}" + (f" T {key[2]:g}" if key[2] else "") + ("" if key[3] else " eager")
        color = f"C{i % 10}"
        for op, style in (("verify", "-o"), ("round", "--s")):
            pts = [(r["N"] + 1, r["time_us"]) for r in sel if r["op"] == op]
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=f"{op} {tag}")
        ar = [r["time_us"] for r in sel if r["op"] == "ar"]
        if ar:
            ax.axhline(ar[0], ls=":", lw=1, color=color)
    ticks = sorted({r["N"] + 1 for r in rows if r["op"] in ("verify", "round")})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks])
    ax.set_xlabel("tokens verified per round (N + 1)")
    ax.set_ylabel("time (us)")
    ax.set_title(f"treeflash bench --shape {rows[0]['shape']} (dotted: AR step)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, plt, path)


def _save(fig, plt, path: str) -> None:
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise TreeflashError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
    print(f"wrote {Path(path)}", file=sys.stderr)
