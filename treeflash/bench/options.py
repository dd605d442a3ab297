"""Option values that both modes of `treeflash bench` read: comma lists, budgets, CUDA
graphs, seeds and the sampling filters. Each is checked before a model loads, a bad
one refused in one line (UsageError)."""
from __future__ import annotations

import math
import sys

import torch

from treeflash.errors import UsageError
from treeflash.sampling_params import SamplingParams

DRAFT_MODE = "coupled"     # as the engine's: the higher mean tau on the built-in pair (BENCHMARKS.md)

# Budgets N whose verifies (N + 1 rows) fill 16-256 rows: a 65th row costs a large model
# what 127 nodes do (BENCHMARKS.md 43); 63 is the engine's default on a GPU.
PAIR_BUDGETS = "15,31,63,127,255"
SHAPE_BUDGETS = "0,15,31,63,127,255"
STRUCTURED = ("json_schema", "regex", "choice", "grammar", "json_object")  # add_structured_args': named as one
DRAFT_LAYERS = 5           # the shape mode's drafter (issue 7's draft step is of 5 layers)
MAX_BENCH_BATCH = 4096     # a timed batch's requests at most (--batch-sizes 10^9 built 10^9 indices)
FILTERS_OFF = {"top_k": (0, -1), "top_p": (1.0,), "min_p": (0.0,)}  # the values that filter nothing (-1: vLLM's)


def parse_list(text: str, kind, what: str, minimum=None, maximum=None) -> list:
    """'1,2,4' -> [1, 2, 4], with a one-line UsageError for anything else."""
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    if not items:
        raise UsageError(f"empty {what} list")
    out = []
    for t in items:
        try:
            v = kind(t)
            if kind is float:
                if not math.isfinite(v):
                    raise ValueError(t)
                v += 0.0  # -0 is 0 (in the table and the JSON lines)
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


def check_seed(seed: int, requests: int) -> None:
    """Request i samples with seed S + i, and every seed must lie in [0, 2^63): say so
    before a model loads."""
    if not 0 <= seed <= 2 ** 63 - requests:
        raise UsageError(f"--seed must be in [0, 2^63 - {requests}] for {requests} requests, got {seed}")


def filters(args) -> dict:
    """The sampling filters every sampled request gets (--top-k, --top-p, --min-p),
    checked as `SamplingParams` checks them."""
    given = {"top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p}
    SamplingParams(temperature=1.0, **given).validate()
    return given


def check_sampled_options(args, temperatures: list[float], drafted: bool) -> str:
    """Refuse the sampling-only options a run would ignore (as --budgets without ddtree):
    the filters and --draft-mode act on sampled requests only, --draft-mode on drafted
    ones only. Returns the draft mode (its default if not given)."""
    given = [f"--{name.replace('_', '-')}" for name, value in filters(args).items()
             if value not in FILTERS_OFF[name]]
    if args.draft_mode is not None:
        if not drafted:
            raise UsageError("--draft-mode sets how dflash and ddtree draft sampled requests: add one of them to "
                             "--methods or leave --draft-mode out")
        given.append("--draft-mode")
    if given and max(temperatures) == 0:
        raise UsageError(f"{' and '.join(given)} act{'' if len(given) > 1 else 's'} on sampled requests only: "
                         f"give a --temperatures above 0 "
                         f"or leave {'them' if len(given) > 1 else 'it'} out")
    return args.draft_mode or DRAFT_MODE


def filters_note(args) -> str:
    on = [f"{name.replace('_', '-')} {value:g}" for name, value in filters(args).items()
          if value not in FILTERS_OFF[name]]
    return f"; sampled requests with {', '.join(on)}" if on else ""
