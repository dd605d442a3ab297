"""Model-pair mode of `treeflash bench`: a real target + drafter generate a set of
prompts with every (method, budget, CUDA graphs, batch size, temperature). Reports
tokens/s, tau (mean tokens committed per round), time per round and the speedups over
AR and over DFlash's chain on the same engine: the numbers a user sees."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

from treeflash.bench.options import (MAX_BENCH_BATCH, STRUCTURED, check_sampled_options, check_seed, filters,
                                     filters_note, parse_budgets, parse_graphs, parse_list, usable_graphs)
from treeflash.bench.report import check_plot_path, close_out, emit, format_table, open_out, plot_pairs
from treeflash.cli import check_prompt_format, read_placed_prompts, structured_from, target_folder
from treeflash.engine.llm import LLM
from treeflash.engine.options import builtin_paths, resolve_device
from treeflash.engine.round import METHODS
from treeflash.errors import UsageError
from treeflash.sampling_params import SamplingParams
from treeflash.tokenizer import Tokenizer

CORPUS_PROMPT_TOKENS = 64  # --corpus: each prompt is this many held-out tokens, fewer where the context is short
MAX_BENCH_PROMPTS = 65536  # --num-prompts at most (the built-in prompts are cycled up to it)

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


def corpus_prompts(folder: str, k: int, length: int = CORPUS_PROMPT_TOKENS) -> list[list[int]]:
    """k token-id prompts from the held-out split of a tokenized training corpus: code
    the drafter never trained on, so tau is not flattered."""
    from treeflash.train.corpus import load_corpus
    from treeflash.train.drafter import held_prompts
    heldout = load_corpus(folder).heldout
    if heldout.size < 2:
        raise UsageError(f"the corpus in {folder} has no held-out split to take prompts from (made with "
                         f"--heldout-fraction 0?): give --prompt-file, or a corpus with one")
    return held_prompts(heldout, k, length)


def fit_corpus_prompts(prompts: list[list[int]], context: int, new_tokens: int) -> list[list[int]]:
    """--corpus's prompts cut to their last tokens where the model's context is short (a
    target trained with --seq-len 64): room for `new_tokens` after them, else half the
    context; a 64-token prompt did not fit a 64-token context at all."""
    keep = max(1, min(CORPUS_PROMPT_TOKENS, max(context - new_tokens, context // 2)))
    return [p[-keep:] for p in prompts]


def load_prompts(args) -> list[tuple[str | list[int], str | None]]:
    """--prompt-file, else --corpus (held-out split), else the built-in Python prompts
    (cycled up to --num-prompts); each with its place in the file ("FILE:LINE") for
    errors, or None."""
    k = args.num_prompts
    if k is not None and not 1 <= k <= MAX_BENCH_PROMPTS:
        raise UsageError(f"--num-prompts must be from 1 to {MAX_BENCH_PROMPTS}, got {k}")
    if args.prompt_file and args.corpus:
        raise UsageError("give --prompt-file or --corpus, not both")
    check_prompt_format(args.prompt_file, args.prompt_format)
    if args.prompt_file:
        prompts = read_placed_prompts(None, args.prompt_file, args.prompt_format)
        if k and len(prompts) < k:
            raise UsageError(f"--num-prompts {k}, but {args.prompt_file} holds {len(prompts)} prompt(s)")
        return prompts[:k] if k else prompts
    if args.corpus:
        return [(p, None) for p in corpus_prompts(args.corpus, k or 8)]
    return [(PYTHON_PROMPTS[i % len(PYTHON_PROMPTS)], None) for i in range(k or 8)]


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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_pair(llm, prompts: list[str], bs: int, temperature: float, args) -> dict:
    """Warm up, then time all batches. On CUDA every batch runs once first: prompts of
    another padded length capture their prefill graph, or compile kernels for their
    shapes without graphs, then and not while timed; on a CPU the first batch.

    batch_rounds: the rounds the batches ran (each batch's longest request's; the
    prefill counts as one), which ms_per_round divides the time by; request_rounds: the
    requests' own, which tau divides their new tokens by. A batch's time also holds the
    one round the pipelined engine runs past its last tokens and drops (`LLM._step`),
    which no count holds."""
    def params(i):
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=temperature,
                              seed=args.seed + i, ignore_eos=not args.eos, logprobs=args.logprobs,
                              structured_outputs=structured_from(args), **filters(args))

    def generate(batch):
        return llm.generate([prompts[i] for i in batch], [params(i) for i in batch])

    batches = batch_indices(len(prompts), bs)
    for batch in batches if llm.device.type == "cuda" else batches[:1]:
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
    return {"requests": len(outs), "new_tokens": tokens, "batch_rounds": steps, "request_rounds": request_rounds,
            "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 2), "tau": round(tokens / request_rounds, 4),
            "ms_per_round": round(1e3 * seconds / steps, 4), "recaptures": recaptures,
            "token_ids": [o.token_ids for o in outs]}


def pair_row(llm, budget: int | None, key: tuple, m: dict, ar: tuple | None, args,
             dflash: float | None = None) -> dict:
    """One JSONL row, with every option that changes what it measures. speedup: tokens/s
    over AR's at the same (batch size, temperature, graphs); vs_dflash: over dflash's
    tokens/s there (`dflash`; what a tree adds to the chain); same_as_ar: fraction of
    requests whose tokens equal AR's (lossless: 1.0, up to floating-point near-ties
    between batched and single-token logits)."""
    bs, temperature, graphs = key
    m = dict(m)
    ids = m.pop("token_ids")
    return {"mode": "pair", "method": llm.method, "budget": llm.decoder.budget,
            "label": llm.method + (f"-{budget}" if llm.method == "ddtree" else "")
                     + (f" lp{args.logprobs}" if args.logprobs is not None else ""),
            "logprobs": args.logprobs,
            "batch_size": bs, "graphs": graphs, "temperature": temperature, **filters(args), **m,
            "speedup": round(m["tokens_per_s"] / ar[0], 3) if ar else None,
            "vs_dflash": round(m["tokens_per_s"] / dflash, 3) if dflash else None,
            "same_as_ar": (round(sum(a == b for a, b in zip(ids, ar[1])) / len(ids), 3)
                           if ar and llm.method != "ar" else None),
            "device": str(llm.device), "dtype": str(llm.dtype).replace("torch.", ""),
            "quantization": args.quantization, "model": str(args.model or "built-in"),
            "draft_model": args.draft_model or ("built-in" if llm.drafter is not None else None),
            "draft_mode": llm.decoder.draft_mode if llm.method != "ar" else None,
            "max_new_tokens": args.max_new_tokens, "eos": args.eos, "seed": args.seed,
            "constraint": next((name for name in STRUCTURED if getattr(args, name) not in (None, False)), None)}


PAIR_COLUMNS = [("method", "label", "{}"), ("graphs", "graphs", "onoff"), ("bs", "batch_size", "{}"),
                ("T", "temperature", "{:g}"), ("tok/s", "tokens_per_s", "{:.1f}"), ("tau", "tau", "{:.2f}"),
                ("ms/round", "ms_per_round", "{:.2f}"), ("speedup", "speedup", "{:.2f}x"),
                ("vs dflash", "vs_dflash", "{:.2f}x"), ("same as AR", "same_as_ar", "{:.2f}")]


@dataclasses.dataclass
class PairPlan:
    """What a model-pair run times: each (method, budget) of `pair_configs` with each
    CUDA graphs setting, batch size and temperature, over `prompts`."""
    methods: list[str]
    budgets: list[int]
    batch_sizes: list[int]
    temperatures: list[float]
    graphs: list[bool]
    prompts: list  # (prompt, its place in --prompt-file or None): `load_prompts`
    model_dir: Path
    draft_mode: str


def _pair_plan(args) -> PairPlan:
    """The run `args` ask for, every option checked (a one-line UsageError) before the
    models load."""
    methods = parse_list(args.methods, str, "method")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        raise UsageError(f"unknown method '{bad[0]}' (choose from {', '.join(METHODS)})")
    if "ddtree" in methods:
        budgets = parse_budgets(args, minimum=1)
    elif args.budgets is not None:  # only ddtree builds trees: refused, as other options a run would ignore
        raise UsageError("--budgets sets ddtree's tree sizes: add ddtree to --methods or leave --budgets out")
    else:
        budgets = []
    drafted = methods != ["ar"]  # (parse_list drops repeats)
    if args.draft_model is not None and not drafted:  # it would load, and draft nothing
        raise UsageError("--draft-model drafts for dflash and ddtree: add one to --methods or leave --draft-model out")
    batch_sizes = parse_list(args.batch_sizes or "1,2,4", int, "batch size", minimum=1, maximum=MAX_BENCH_BATCH)
    temperatures = parse_list(args.temperatures or "0,0.7,1.0", float, "temperature", minimum=0.0)
    draft_mode = check_sampled_options(args, temperatures, drafted)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    SamplingParams(logprobs=args.logprobs).validate()
    constraint = structured_from(args)
    if constraint is not None:
        if not args.eos:  # past its end a text could only repeat EOS
            raise UsageError("--json-schema, --regex, --choice, --grammar and --json-object need --eos: a "
                             "constrained text ends at its end token")
        constraint.validate().automaton()  # its mistakes before the models load
    graphs = parse_graphs(args.graphs or "on,off")
    prompts = load_prompts(args)
    check_seed(args.seed, len(prompts))
    model_dir = target_folder(args)
    if args.corpus and (model_dir / "tokenizer.json").exists() and \
            not Tokenizer(args.corpus).same_vocabulary(Tokenizer(model_dir)):  # before the model loads
        raise UsageError(f"the corpus in {args.corpus} was tokenized with another tokenizer than the model's: "
                         f"its prompts would be other text to it")
    check_plot_path(args.plot, args.out, run_inputs(args, model_dir))
    graphs = usable_graphs(graphs, resolve_device(args.device))
    return PairPlan(methods, budgets, batch_sizes, temperatures, graphs, prompts, model_dir, draft_mode)


def run_inputs(args, model_dir) -> list:
    """The files and folders a model-pair run reads, which --out and --plot must not replace."""
    return [i for i in (args.prompt_file, args.corpus, model_dir, args.draft_model or builtin_paths()[1]) if i]


def bench_pairs(args) -> int:
    plan = _pair_plan(args)
    prompts, methods = [p for p, _ in plan.prompts], plan.methods
    out = open_out(args.out, inputs=run_inputs(args, plan.model_dir))

    # A speculative method, if any is asked for, so that the built-in model brings its drafter.
    base = LLM(args.model, draft_model=args.draft_model, method=next((m for m in methods if m != "ar"), "ar"),
               device=args.device, dtype=args.dtype, max_budget=args.max_budget, cuda_graphs=False,
               max_batch=max(plan.batch_sizes), quantization=args.quantization)  # each timed batch: one engine batch
    if args.corpus:
        prompts = fit_corpus_prompts(prompts, base.max_model_len, args.max_new_tokens)
        plan.prompts = [(p, None) for p in prompts]
    lengths = []
    for prompt, place in plan.prompts:  # each checked before the run starts, named by its place in the file
        try:
            lengths.append(len(base.encode(prompt)))
        except UsageError as e:
            raise UsageError(f"{place}: {e}" if place else str(e)) from None
    quantized = f", {args.quantization} weights" if args.quantization else ""
    print(f"bench: {len(prompts)} prompt{'s' if len(prompts) > 1 else ''}, {args.max_new_tokens} new tokens each, "
          f"on {base.device} ({str(base.dtype).replace('torch.', '')}{quantized}){filters_note(args)}")
    short = sum(n + args.max_new_tokens > base.max_model_len for n in lengths)
    if short:  # their requests stop at the context: fewer tokens, and rounds of another length
        print(f"note: {short} of {len(prompts)} prompts leave less than --max-new-tokens {args.max_new_tokens} "
              f"of the context of {base.max_model_len} tokens: their requests stop there (tok/s and tau count "
              f"what was made; --out's rows have new_tokens)", file=sys.stderr)

    rows, ar, dflash = [], {}, {}  # (batch size, temperature, graphs) -> AR's (tokens/s, token ids), dflash's tokens/s
    for method, budget in pair_configs(methods, plan.budgets):
        for graphs in plan.graphs:
            llm = base.with_method(method, budget, graphs, None if method == "ar" else plan.draft_mode)
            for bs in plan.batch_sizes:
                for temperature in plan.temperatures:
                    m = measure_pair(llm, prompts, bs, temperature, args)
                    key = (bs, temperature, graphs)
                    if method == "ar":
                        ar[key] = (m["tokens_per_s"], m["token_ids"])
                    elif method == "dflash":
                        dflash[key] = m["tokens_per_s"]
                    row = pair_row(llm, budget, key, m, ar.get(key), args, dflash.get(key))
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
