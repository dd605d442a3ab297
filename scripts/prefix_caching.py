"""What prefix caching saves a chat: the time to a next turn's first token, with and
without `enable_prefix_caching`, on the built-in pair (ddtree). A first turn of N prompt
tokens gets a 32-token answer; the next turn is the conversation so far plus a new line.
Each timing is the median of 5; "same" says whether the first tokens were equal (in
bf16 a near-tie may flip: the rest attends to the cached prefix through another kernel).

    python scripts/prefix_caching.py                 # CPU, float32
    python scripts/prefix_caching.py --device cuda   # CUDA graphs on
    python scripts/prefix_caching.py --model T --draft-model D --device cuda --dtype bfloat16 \
        --lengths 1024,4096                          # any pair
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from treeflash import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", default="128,384,768")
    ap.add_argument("--model", help="target folder (default: the built-in pair)")
    ap.add_argument("--draft-model", help="drafter folder")
    ap.add_argument("--method", default="ddtree")
    args = ap.parse_args()
    pair = dict(model=args.model, draft_model=args.draft_model, method=args.method, device=args.device,
                dtype=args.dtype)
    on = LLM(**pair, enable_prefix_caching=True)
    off = LLM(**pair)
    answer, first_token = SamplingParams(max_new_tokens=32, ignore_eos=True), SamplingParams(max_new_tokens=1)
    print("| conversation tokens | next turn's prompt | cached | first token, no caching (ms) "
          "| with caching (ms) | ratio | same |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in map(int, args.lengths.split(",")):
        first = (on.encode("def fib(n):\n    return n\n") * n)[:n]
        with_cache, without, same = [], [], True
        for _ in range(5):
            turn = first + on.generate(first, answer)[0].token_ids + on.encode("\n\ndef add(a, b):", special=False)
            if on.device.type == "cuda":  # the answer's last round (discarded, still running) ends
                torch.cuda.synchronize()  # before the timer starts, as in a chat's think time
            start = time.perf_counter()
            got = on.generate(turn, first_token)[0]
            with_cache.append(time.perf_counter() - start)
            start = time.perf_counter()
            want = off.generate(turn, first_token)[0]
            without.append(time.perf_counter() - start)
            same &= got.token_ids == want.token_ids
        a, b = statistics.median(without) * 1e3, statistics.median(with_cache) * 1e3
        print(f"| {n} | {len(turn)} | {got.stats['cached_tokens']} | {a:.1f} | {b:.1f} | {a / b:.1f}x "
              f"| {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
