"""What sampling one request's rows costs on the GPU, by filter, at the verify widths of
the 8B shape (a 152K vocabulary; rows = 1 for AR, N + 1 for a verify of N nodes): the
`sample()` call a round makes, replayed as a CUDA graph; "sorted" rows time the same
filters with `filter_width` 0 (every row sorted, then the same floor kernels: a top-p
without top-k still searches), "flat" rows logits of a tenth the scale (a nucleus of
~120K tokens), and "peaked" rows of four times (a nucleus within the 16 largest, as a
trained model's mostly is: such a row takes its cut from the window and skips the
search). Then how many floors equal those from the sorted rows on bf16 logits
(ties included): a top-k row's from its window against the whole sorted row; a top-p row
without top-k searches on both sides (tests/test_fused_ops.py checks it against a sort).

    python scripts/sampling_cost.py        # needs a CUDA GPU
"""
from __future__ import annotations

from dataclasses import replace

import torch

from treeflash.engine.sampling import SamplingBatch, filter_floor, sample
from treeflash.kernels.bench_tree_attention import graph_time
from treeflash.sampling_params import SamplingParams

V = 151936
ROWS = (1, 16, 64, 256)
FILTERS = {
    "greedy": SamplingParams(temperature=0.0),
    "T=0.7": SamplingParams(temperature=0.7, seed=1),
    "T=0.6 top-k 20 top-p 0.95": SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=1),
    "T=0.7 top-k 50": SamplingParams(temperature=0.7, top_k=50, seed=1),
    "T=0.7 min-p 0.05": SamplingParams(temperature=0.7, min_p=0.05, seed=1),
    "T=0.7 top-p 0.9": SamplingParams(temperature=0.7, top_p=0.9, seed=1),
}
EXTRA = {  # name: (filters, sorted, logit scale)
    "T=0.6 top-k 20 top-p 0.95, sorted": ("T=0.6 top-k 20 top-p 0.95", True, 3.0),
    "T=0.7 top-p 0.9, sorted": ("T=0.7 top-p 0.9", True, 3.0),
    "T=0.7 top-p 0.9, flat": ("T=0.7 top-p 0.9", False, 0.3),
    "T=0.7 top-p 0.9, peaked": ("T=0.7 top-p 0.9", False, 12.0),
}


@torch.inference_mode()  # as the engine runs: the fused kernels are on
def main() -> None:
    print("| filters | " + " | ".join(f"{r} rows µs" for r in ROWS) + " |")
    print("| --- |" + " --- |" * len(ROWS))
    cases = {name: (name, False, 3.0) for name in FILTERS} | EXTRA
    for name, (filters, whole, scale) in cases.items():
        sb = SamplingBatch.from_params([FILTERS[filters]], "cuda")
        if whole:
            sb = replace(sb, filter_width=0)
        times = []
        for rows in ROWS:
            logits = torch.randn(1, rows, V, device="cuda", dtype=torch.bfloat16) * scale
            positions = torch.arange(rows, device="cuda")[None] + 100
            times.append(graph_time(lambda: sample(logits, positions, sb)) * 1e6)
        print(f"| {name} | " + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    same = total = 0
    for scale in (0.3, 1.0, 3.0, 8.0, 12.0):
        logits = (torch.randn(7, 64, V, device="cuda", generator=gen) * scale).to(torch.bfloat16)
        params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1)
                  for t, k, p, m in ((0.6, 20, 0.95, 0.0), (1.0, 5, 1.0, 0.0), (0.7, 40, 0.8, 0.05), (1.2, 1, 1.0, 0.0),
                                     (0.7, 0, 0.9, 0.0), (1.0, -1, 0.95, 0.02), (1.5, 0, 0.5, 0.0))]
        sb = SamplingBatch.from_params(params, "cuda")
        a, b = filter_floor(logits, sb), filter_floor(logits, replace(sb, filter_width=0))
        same, total = same + int((a == b).sum()), total + a.numel()
    print(f"floors equal to those from the sorted rows: {same} of {total} rows (bf16 logits, ties included)")


if __name__ == "__main__":
    main()
