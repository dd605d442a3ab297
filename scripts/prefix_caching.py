"""What prefix caching saves a chat: the time to a next turn's first token, with and
without `enable_prefix_caching`, on the built-in pair (ddtree). A first turn of N prompt
tokens gets a 32-token answer; the next turn is the conversation so far plus a new line.
Each timing is the median of 5; the tokens are checked equal.

    python scripts/prefix_caching.py                 # CPU, float32
    python scripts/prefix_caching.py --device cuda   # graphs on: only turns past 512 tokens reuse
"""
from __future__ import annotations

import argparse
import statistics
import time

from treeflash import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--lengths", default="128,384,768")
    args = ap.parse_args()
    on = LLM(device=args.device, dtype=args.dtype, enable_prefix_caching=True)
    off = LLM(device=args.device, dtype=args.dtype)
    answer, first_token = SamplingParams(max_new_tokens=32, ignore_eos=True), SamplingParams(max_new_tokens=1)
    print("| conversation tokens | next turn's prompt | cached | first token, no caching (ms) "
          "| with caching (ms) | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in map(int, args.lengths.split(",")):
        first = on.encode("def fib(n):\n    return n\n" * 100)[:n]
        with_cache, without = [], []
        for _ in range(5):
            turn = first + on.generate(first, answer)[0].token_ids + on.encode("\n\ndef add(a, b):", special=False)
            start = time.perf_counter()
            got = on.generate(turn, first_token)[0]
            with_cache.append(time.perf_counter() - start)
            start = time.perf_counter()
            want = off.generate(turn, first_token)[0]
            without.append(time.perf_counter() - start)
            assert got.token_ids == want.token_ids
        a, b = statistics.median(without) * 1e3, statistics.median(with_cache) * 1e3
        print(f"| {n} | {len(turn)} | {got.stats['cached_tokens']} | {a:.1f} | {b:.1f} | {a / b:.1f}x |")


if __name__ == "__main__":
    main()
