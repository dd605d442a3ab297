"""`treeflash bench`: how fast is a round, and how close is it to the hardware?

Two modes, one command:

* **Model pair** (default, `pairs.py`): a real target + drafter generate a set of
  prompts with every (method, budget, batch size, CUDA graphs, temperature). Reports
  tokens/s, tau (mean tokens committed per round), time per round and the speedup over
  AR on the same engine. This is the number a user sees.

* **Shape** (`--shape qwen3-8b`, `shape.py`): random weights of a published model
  shape, built directly on the device, with a KV cache that holds C tokens. Times the
  pieces of a round (AR step, verify of N+1 tokens, draft step, tree build, whole round)
  as CUDA graphs and compares each to its *memory floor*: the bytes it must read
  (weights + KV of the prefix) over the measured copy bandwidth. This is the number
  that says whether the engine or the hardware is the limit (BENCHMARKS.md section 2).
  With `--tp N` the command re-runs itself as N processes under torchrun (one per GPU;
  gloo on CPU); each builds its own shard and runs the same timing loop (NCCL
  all-reduces captured in the graphs), floors are per rank, and rank 0 reports.

Both print an aligned table and can write one JSON object per row (`--out`) and a
PNG plot (`--plot`, which needs matplotlib): `report.py`. The option values
both modes read are parsed in `options.py`; this module holds the command line.
"""
from __future__ import annotations

import argparse

from treeflash.bench.options import DRAFT_LAYERS, DRAFT_MODE, PAIR_BUDGETS, SHAPE_BUDGETS, STRUCTURED
from treeflash.bench.pairs import bench_pairs
from treeflash.bench.shape import SHAPES, bench_shape
from treeflash.cli import PROMPT_FILE_HELP, PROMPT_FORMAT_HELP, PROMPT_FORMATS, add_structured_args
from treeflash.config import FP8_BLOCK
from treeflash.engine.round import DRAFT_MODES, METHODS
from treeflash.errors import UsageError

FP8_DEFAULT = "x".join(map(str, FP8_BLOCK))    # --fp8: the blocks of the published FP8 checkpoints
PAIR, SHAPE = "pair", "shape"

# The options one mode alone reads, with their defaults (given to those left out after the
# check), in the order they are checked: the other mode refuses one given at all, rather
# than ignore it.
MODE_ONLY = {
    "tp": (SHAPE, 1),
    "contexts": (SHAPE, "1024,4096,16384"),
    "draft_layers": (SHAPE, DRAFT_LAYERS),
    "iters": (SHAPE, 50),
    "attention": (SHAPE, "auto"),
    "copy_mib": (SHAPE, None),
    "fp8": (SHAPE, None),
    "model": (PAIR, None),
    "draft_model": (PAIR, None),
    "prompt_file": (PAIR, None),
    "prompt_format": (PAIR, "auto"),
    "corpus": (PAIR, None),
    "logprobs": (PAIR, None),
    "methods": (PAIR, ",".join(METHODS)),
    "num_prompts": (PAIR, None),
    "max_new_tokens": (PAIR, 128),
    "eos": (PAIR, False),
    "quantization": (PAIR, None),
    "json_schema": (PAIR, None),
    "regex": (PAIR, None),
    "choice": (PAIR, None),
    "grammar": (PAIR, None),
    "json_object": (PAIR, False),
}


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="benchmark a model pair (tokens/s, tau, speedup) or a model shape (round costs vs memory floor)",
        description="Model-pair mode (default) times generation with a real target + drafter; "
                    "--shape times the pieces of a round on random weights of a model shape.")
    p.add_argument("--model", help="target checkpoint folder (default: the built-in model)")
    p.add_argument("--draft-model", help="DFlash drafter folder (default with the built-in model: its drafter)")
    p.add_argument("--prompt-file", help=PROMPT_FILE_HELP)
    p.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="auto", help=PROMPT_FORMAT_HELP)
    p.add_argument("--corpus", help="tokenized corpus folder (treeflash train corpus): prompts from its held-out split")
    p.add_argument("--num-prompts", type=int, help="how many prompts to use (default: all of the file, else 8)")
    p.add_argument("--methods", help=f"comma list of {', '.join(METHODS)} (default: all)")
    p.add_argument("--budgets", help=f"DDTree budgets N (default {PAIR_BUDGETS}; --shape: {SHAPE_BUDGETS})")
    p.add_argument("--max-budget", type=int, default=512,
                   help="the largest budget accepted (default 512, as for generate: a round verifies N + 1 "
                        "tokens at once, under an (N + 1)^2 mask)")
    p.add_argument("--batch-sizes", help="comma list (default 1,2,4; --shape: 1)")
    p.add_argument("--graphs", help="on, off or on,off: CUDA graphs (default on,off; --shape: on on CUDA)")
    p.add_argument("--max-new-tokens", type=int, help="new tokens per request (default 128)")
    p.add_argument("--temperatures", help="comma list, 0 = greedy (default 0,0.7,1.0; --shape: 0)")
    p.add_argument("--top-k", type=int, default=0, help="top-k of every sampled request (0 or -1: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of every sampled request (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p of every sampled request (0: off)")
    p.add_argument("--seed", type=int, default=0, help="request i samples with seed S + i")
    p.add_argument("--logprobs", type=int, metavar="K", help="requests also return logprobs with K alternatives "
                                                             "(model-pair mode; default: none)")
    p.add_argument("--eos", action="store_true", help="stop requests at EOS (default: always generate "
                                                      "--max-new-tokens, so every method does the same work)")
    p.add_argument("--draft-mode", choices=DRAFT_MODES,
                   help=f"how dflash and ddtree draft at T > 0: coupled to the target's noise, or "
                        f"temperature-scaled (default {DRAFT_MODE})")
    add_structured_args(p)  # every request of model-pair mode constrained alike
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's, float32 for a 16-bit one on "
                                                   "a CPU; --shape: bfloat16 on CUDA, float32 on CPU), float32, "
                                                   "bfloat16, float16")
    p.add_argument("--quantization", choices=["fp8"], help="model-pair mode: the target's layers quantized to FP8 "
                                                           "blocks while loading (--shape: --fp8)")
    p.add_argument("--out", help="write one JSON object per row to this file")
    p.add_argument("--plot", help="write a PNG plot to this file (needs matplotlib)")
    s = p.add_argument_group("shape mode")
    s.add_argument("--shape", help=f"random-weight model shape: {', '.join(SHAPES)}")
    s.add_argument("--fp8", nargs="?", const=FP8_DEFAULT, metavar="ROWSxCOLS",
                   help="the target's linear layers in block-scaled FP8, one scale per block of ROWS x COLS "
                        "(default 128x128, as Qwen3-FP8 and DeepSeek-V3 publish them)")
    s.add_argument("--contexts", help="comma list of committed tokens C per request (default 1024,4096,16384)")
    s.add_argument("--draft-layers", type=int, help=f"layers of the shape's drafter (default {DRAFT_LAYERS}; more "
                                                    f"only up to the target's layers)")
    s.add_argument("--iters", type=int, help="timed calls per op, their median reported (default 50)")
    s.add_argument("--attention", choices=["auto", "sdpa", "triton"],
                   help="attention backend (auto: triton on CUDA when installed)")
    s.add_argument("--copy-mib", type=int, help="size of the bandwidth copy (default 2048 on CUDA, 256 on CPU)")
    s.add_argument("--tp", type=int, help="tensor-parallel size: N ranks under torchrun, one per GPU "
                                          "(gloo on CPU); floors are per rank")
    for action in p._actions:  # left out, absent from the namespace: given at all is told apart from the default
        if action.dest in MODE_ONLY:
            action.default = argparse.SUPPRESS
    p.set_defaults(func=cmd_bench)
    return p


NONEMPTY = ("prompt_file", "corpus", "budgets", "batch_sizes", "graphs", "temperatures", "out", "plot")


def cmd_bench(args) -> int:
    for dest in NONEMPTY:  # an empty value was taken as the option left out: its default, or no file
        value = getattr(args, dest, None)
        if isinstance(value, str) and not value.strip():
            raise UsageError(f"--{dest.replace('_', '-')} is empty: give a value, or leave the option out")
    settle_mode_options(args)
    return bench_shape(args) if args.shape is not None else bench_pairs(args)


def settle_mode_options(args) -> None:
    """Refuse an option of the other mode (`MODE_ONLY`) given at all, its default value
    too: this mode would ignore it. Then give each one left out its default."""
    mode = SHAPE if args.shape is not None else PAIR
    given = [dest for dest, (only, _) in MODE_ONLY.items() if only != mode and hasattr(args, dest)]
    for dest, (_, default) in MODE_ONLY.items():
        if not hasattr(args, dest):
            setattr(args, dest, default)
    if not given:
        return
    dest = given[0]
    flag = ("--json-schema, --regex, --choice, --grammar or --json-object" if dest in STRUCTURED
            else "--" + dest.replace("_", "-"))
    if mode == PAIR:
        raise UsageError(f"{flag} applies to --shape only (model-pair mode times whole requests on a real model "
                         f"pair, in one process)")
    if dest in ("model", "draft_model", "prompt_file", "corpus"):
        raise UsageError("--shape uses random weights: it takes no --model, --draft-model, --prompt-file or --corpus")
    if dest == "logprobs":
        raise UsageError("--logprobs applies to model-pair mode (--shape times rounds without them)")
    raise UsageError(f"{flag} applies to model-pair mode (--shape times AR steps, drafts and verify rounds of "
                     f"every budget)")
