"""The engine's options as a user gives them, checked and resolved: the device, the
dtype, the attention backend, the DDTree budget, and where the built-in model is."""
from __future__ import annotations

import numbers
from pathlib import Path

import torch

from treeflash.config import DTYPES
from treeflash.errors import TreeflashError, UsageError

# On a GPU the root and 63 nodes fill the 64 rows of the few-row products (one more row
# takes cuBLAS: the 8B shape's verify 1.14 -> 1.30x AR, BENCHMARKS.md 43); a CPU verify
# costs in proportion to its nodes (BENCHMARKS.md 4).
DEFAULT_BUDGETS = {"cuda": 63, "cpu": 16}
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin"


def resolve_device(device: str) -> torch.device:
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise UsageError(f"device must be a string (auto, cpu, cuda or cuda:N), got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UsageError(f"unknown device '{device}' (choose auto, cpu, cuda or cuda:N)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"device '{device}' requested but no CUDA GPU is available")
    if device.startswith("cuda:") and int(device[5:]) >= torch.cuda.device_count():  # the form is checked above
        raise UsageError(f"unknown device '{device}' (this machine has cuda:0 to "
                         f"cuda:{torch.cuda.device_count() - 1})")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """`auto` = the checkpoint's dtype, except float32 on CPU for bf16/fp16 checkpoints
    (CPU half-precision matmuls are slow and not what a user testing on a laptop wants)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise UsageError(f"dtype {dtype} is not supported (choose float32, bfloat16, float16 or float64)")
        return dtype
    if not isinstance(dtype, str):
        raise UsageError(f"dtype must be a string or a torch dtype, got {dtype!r}")
    if dtype != "auto":
        if dtype not in DTYPES:
            raise UsageError(f"unknown dtype '{dtype}' (choose auto, {', '.join(sorted(set(DTYPES)))})")
        return DTYPES[dtype]
    chosen = DTYPES.get(str(checkpoint_dtype or "float32").replace("torch.", ""), torch.float32)
    if device.type == "cpu" and chosen in (torch.bfloat16, torch.float16):
        return torch.float32
    return chosen


def attention_backend(device: torch.device, head_dims: list[int]) -> str:
    """'triton' (the tree-attention kernel) on CUDA when it is installed and fits the
    head size, else the SDPA reference."""
    if device.type != "cuda":
        return "sdpa"
    try:
        from treeflash.kernels.tree_attention import supports
    except ImportError:
        return "sdpa"
    return "triton" if all(supports(d) for d in head_dims) else "sdpa"


def builtin_paths() -> tuple[Path, Path]:
    target, drafter = BUILTIN_DIR / "target", BUILTIN_DIR / "drafter"
    if not (target / "config.json").exists():
        raise TreeflashError("no --model given and the built-in model is not installed")
    return target, drafter


def check_int(name: str, value, least: int) -> int:
    """A count given by the user, as a plain int: an integer (a NumPy one too; True is
    not 1) of at least `least`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise UsageError(f"{name} must be an integer >= {least}, got {value!r}")
    return int(value)


def check_flag(name: str, value) -> None:
    """A switch given by the user: True or False ("false" would read as true)."""
    if not isinstance(value, bool):
        raise UsageError(f"{name} must be true or false, got {value!r}")


def tree_budget(method: str, budget: int | None, max_budget: int, device: torch.device) -> int | None:
    """The DDTree budget `method` decodes with (if not given, the device's default: 63
    nodes on a GPU, the most a 64-row verify holds, 16 on a CPU, where a verify costs in
    proportion), checked; None for the other methods, which take none."""
    if method != "ddtree":
        if budget is not None:
            raise UsageError(f"a tree budget applies to method ddtree only (method is {method})")
        return None
    if budget is None:
        budget = min(DEFAULT_BUDGETS[device.type], max_budget)
    budget = check_int("ddtree budget", budget, 1)
    if budget > max_budget:
        raise UsageError(f"ddtree budget {budget} exceeds max_budget {max_budget} "
                         f"(raise it with --max-budget / max_budget=)")
    return budget
