"""What recapturing CUDA graphs would cost a server: requests on the built-in pair
(ddtree-32, graphs on, 64 new tokens) that alternate between greedy and sampled, then
between batch sizes 1 and 3. The engine keeps each sampling mode's graphs and the
states of recent batch sizes; dropping them before every request (what one kept
graph meant) shows what a switch would cost.

    python scripts/graph_reuse.py          # needs a CUDA GPU
"""
from __future__ import annotations

import time

import torch

from treeflash import LLM, SamplingParams

PROMPT = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n"


def median_ms(llm: LLM, requests: list, drop: bool, repeats: int = 12) -> tuple[float, int]:
    """Median request time over `repeats` requests cycling through `requests`
    ((prompts, params) pairs), and the graphs captured meanwhile."""
    captures, times = llm.graph_captures, []
    for i in range(repeats):
        if drop:
            llm.drop_graphs()
        prompts, params = requests[i % len(requests)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2], llm.graph_captures - captures


def main() -> None:
    llm = LLM(method="ddtree", budget=32)
    greedy = SamplingParams(max_new_tokens=64, seed=1, ignore_eos=True)
    sampled = SamplingParams(max_new_tokens=64, seed=1, temperature=0.8, ignore_eos=True)
    cases = {"greedy / sampled": [([PROMPT], greedy), ([PROMPT], sampled)],
             "batch 1 / 3": [([PROMPT], greedy), ([PROMPT, "import os\n", "class A:\n"], greedy)]}
    print("| requests alternating | graphs kept: ms | captures | recaptured each time: ms | captures | a switch costs |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, requests in cases.items():
        for prompts, params in requests:  # warm-up: kernels compiled, graphs captured
            llm.generate(prompts, params)
        kept, kept_captures = median_ms(llm, requests, drop=False)
        dropped, dropped_captures = median_ms(llm, requests, drop=True)
        print(f"| {name} | {kept:.1f} | {kept_captures} | {dropped:.1f} | {dropped_captures} | "
              f"{dropped - kept:.1f} ms |")


if __name__ == "__main__":
    main()
