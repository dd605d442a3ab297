"""Per-rank memory of tensor-parallel loading on CPU (gloo).

Writes a random Qwen3-shaped target of about 200 MB float32 (vocab 32000, hidden 512,
6 layers), then loads it with tp = 1, 2, 4 (each in a fresh driver process) and prints,
per rank, the parameter bytes it holds and its RSS growth while loading (peak RSS
during the load minus RSS before it; Linux /proc).

    python scripts/tp_memory.py [--sizes 1,2,4] [--dir DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 2 ** 20


def write_model(folder: Path) -> None:
    from treeflash.checkpoints import write_random_target, write_tiny_tokenizer
    write_tiny_tokenizer(folder)
    write_random_target(folder, hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64,
                        intermediate_size=1536, vocab_size=32000)


def measure(folder: Path, tp: int) -> list[dict]:
    from treeflash import LLM
    llm = LLM(folder, method="ar", device="cpu", dtype="float32", tp=tp)
    stats = llm.rank_stats()
    llm.close()
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--dir", help="where to write the model (default: a temporary folder)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: measure one size, print JSON
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(Path(args.dir), args.one)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.dir or tmp) / "target-200mb"
        if not (folder / "model.safetensors").exists():
            write_model(folder)
        size = (folder / "model.safetensors").stat().st_size
        print(f"target: {folder} ({size / MB:.1f} MiB of float32 weights)")
        print(f"{'tp':>3} {'rank':>4} {'params MiB':>11} {'x total':>8} {'RSS growth MiB':>15}")
        for tp in [int(x) for x in args.sizes.split(",")]:
            out = subprocess.run([sys.executable, __file__, "--one", str(tp), "--dir", str(folder)],
                                 capture_output=True, text=True, check=True)
            for s in json.loads(out.stdout.strip().splitlines()[-1]):
                rss = "?" if s["rss_growth_bytes"] is None else f"{s['rss_growth_bytes'] / MB:.1f}"
                print(f"{tp:>3} {s['rank']:>4} {s['param_bytes'] / MB:>11.1f} "
                      f"{s['param_bytes'] / size:>8.3f} {rss:>15}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
