"""The few-row products (`treeflash.kernels.matmul`) of a model's layer at verify and
draft widths: the shipped tiling (`_config`) against other tilings and cuBLAS, to retune
`_config`. Each cell launches the product `--launches` times in one CUDA graph (dependent
launches, as in a round), µs per product. Every launch reads the same matrix: the
built-in pair's (a few MB) stay in L2, as they do over its rounds; a larger model's partly
do, so there compare tilings with each other (`treeflash bench --shape` times whole
rounds against the memory floor). A tiling whose result differs from F.linear says
"wrong"; one that does not compile or launch, "error".

    python scripts/few_row_products.py                          # built-in target, 16/32/64 rows
    python scripts/few_row_products.py --shape qwen3-8b --rows 16,64   # needs a CUDA GPU

Section 53 of BENCHMARKS.md is why: the built-in pair's 64-row verify (ddtree-63) spent
about 25 µs a round more in these products than at 32 rows.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import treeflash.kernels.matmul as matmul_module
from treeflash.bench.shape import SHAPES
from treeflash.config import ModelConfig, read_config_json
from treeflash.engine.graphs import capture

BUILTIN = Path(__file__).resolve().parent.parent / "treeflash" / "builtin" / "target"
# (BLOCK_M or 0 for the shipped one, BLOCK_N, BLOCK_K, split of K, warps, stages, SWAP)
TILINGS = {
    "n32 k128 3": (0, 32, 128, 1, 4, 3, True),
    "n32 k64 3": (0, 32, 64, 1, 4, 3, True),
    "n16 k128 3": (0, 16, 128, 1, 4, 3, True),
    "n64 k64 3": (0, 64, 64, 1, 4, 3, True),
    "n64 k128 2": (0, 64, 128, 1, 4, 2, True),
    "n64 k128 3": (0, 64, 128, 1, 4, 3, True),
    "n32 k128 3 w2": (0, 32, 128, 1, 2, 3, True),
    "m32 n64 k128 3": (32, 64, 128, 1, 4, 3, True),
    "n64 k64 split2": (0, 64, 64, 2, 4, 3, True),
    "unswapped n32 k64": (0, 32, 64, 1, 4, 3, False),
}


def products(cfg: ModelConfig) -> list[tuple[str, int, int, bool]]:
    """(name, N, K, gated) of a decoder layer's products and the LM head."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [("qkv", q + 2 * kv, cfg.hidden_size, False), ("o", cfg.hidden_size, q, False),
            ("gate_up", 2 * cfg.intermediate_size, cfg.hidden_size, True),
            ("down", cfg.hidden_size, cfg.intermediate_size, False),
            ("lm_head", cfg.vocab_size, cfg.hidden_size, False)]


def per_launch_us(fn, launches: int, reps: int = 7) -> float:
    """Best µs per call of fn over `reps` replays of a graph of `launches` calls."""
    graph = capture(lambda: [fn() for _ in range(launches)], warmup=1)[0]
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / launches)
    return best


def reference(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    if not gated:
        return F.linear(x, w)
    gate, up = w.chunk(2)
    return F.silu(F.linear(x, gate)) * F.linear(x, up)


def tiled(tiling):
    """A `_config` stand-in that returns `tiling` (BLOCK_M 0: the rows rounded up to a power of two)."""
    def config(M, N, K, itemsize, sms, gated):
        return (tiling[0] or max(16, 1 << (M - 1).bit_length()), *tiling[1:])
    return config


def cell(x, w, gated: bool, tiling, launches: int) -> str:
    if tiling == "cublas":
        return f"{per_launch_us(lambda: reference(x, w, gated), launches):.2f}"
    shipped = matmul_module._config
    if tiling is not None:
        matmul_module._config = tiled(tiling)
    try:
        def run():
            return matmul_module.matmul(x, w, gated=gated)
        want = reference(x, w, gated).float()
        if (run().float() - want).abs().max().item() > 0.03 * want.abs().max().item():
            return "wrong"
        return f"{per_launch_us(run, launches):.2f}"
    except Exception as e:  # a tiling past the shared memory, a compile error: its cell says so
        return f"error ({type(e).__name__})"
    finally:
        matmul_module._config = shipped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    dense = [name for name, cfg in SHAPES.items() if not cfg.num_experts]  # (an MoE's MLP is its experts)
    ap.add_argument("--shape", choices=["builtin", *dense], default="builtin")
    ap.add_argument("--rows", default="16,32,64", help="rows of the products (at most 64)")
    ap.add_argument("--launches", type=int, default=40, help="launches per graph")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("few_row_products needs a CUDA GPU")
    cfg = ModelConfig.from_dict(read_config_json(BUILTIN)) if args.shape == "builtin" else SHAPES[args.shape]
    rows = [int(r) for r in args.rows.split(",")]
    if not all(1 < r <= matmul_module.MAX_ROWS for r in rows):
        raise SystemExit(f"--rows must lie in 2..{matmul_module.MAX_ROWS}, got {args.rows}")
    names = ["shipped", *TILINGS, "cublas"]
    print(f"{torch.cuda.get_device_name()}, {args.shape}, bf16, µs per product")
    print("| rows | product | " + " | ".join(names) + " |")
    print("|" + " --- |" * (len(names) + 2))
    torch.manual_seed(0)
    for M in rows:
        for name, N, K, gated in products(cfg):
            w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cells = [cell(x, w, gated, TILINGS.get(t, t if t == "cublas" else None), args.launches) for t in names]
            print(f"| {M} | {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
