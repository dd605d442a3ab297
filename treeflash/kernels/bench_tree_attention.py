"""Time `tree_attention` against the SDPA reference on an 8B-like layer.

    python -m treeflash.kernels.bench_tree_attention [--sweep]

32 q heads, 8 KV heads, D = 128, bf16, B = 1; contexts 1K/4K/16K; T = 1..256 block
tokens with a random tree mask. Each timing is a CUDA graph replaying the kernel over
enough layers' caches (>= 512 MB) that the prefix comes from HBM, not L2, as in a
real forward; the time shown is per layer. "prefix GB/s" = K+V bytes of the prefix /
kernel time, compared with a large device copy (bytes read + written / time).
--sweep also times each shape at several split counts, to tune `default_num_splits`.
"""
from __future__ import annotations

import argparse
import math

import torch

from treeflash.engine.graphs import capture
from treeflash.kernels.tree_attention import default_num_splits, default_row_programs, tree_attention
from treeflash.layers.attention import AttentionInputs, sdpa_attention

HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16
CONTEXTS = (1024, 4096, 16384)
BLOCKS = (1, 16, 64, 128, 256)
ROTATE_BYTES = 512 << 20


def graph_time(fn, reps: int = 20) -> float:
    """Median seconds of one replay of a CUDA graph of fn() (of fn() itself if it
    cannot be captured)."""
    try:
        run = capture(fn, warmup=2)[0].replay
    except RuntimeError as e:
        print(f"(no CUDA graph: {str(e).splitlines()[0]}; timing eagerly)")
        run = fn
    run()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[reps // 2]


def copy_bandwidth(reps: int = 10) -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy, eager: in a
    CUDA graph the copy becomes a copy-engine memcpy node, about 35% slower."""
    src = torch.randn(1 << 29, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        dst.copy_(src)
    b.record()
    b.synchronize()
    return 2 * src.numel() * src.element_size() * reps / (a.elapsed_time(b) / 1e3)


def random_tree(T: int, gen: torch.Generator) -> torch.Tensor:
    """[1, T, T] ancestor-or-self mask of a random tree."""
    anc = torch.zeros(T, T, dtype=torch.bool)
    anc[0, 0] = True
    for i in range(1, T):
        anc[i] = anc[int(torch.randint(0, i, (1,), generator=gen))]
        anc[i, i] = True
    return anc[None]


class Case:
    """One (context, T) shape over enough layers' caches to defeat L2."""

    def __init__(self, ctx: int, T: int, gen: torch.Generator):
        S = ctx + T
        layer_bytes = 2 * HKV * S * D * DTYPE.itemsize
        self.layers = max(2, math.ceil(ROTATE_BYTES / layer_bytes))
        self.k = torch.randn(self.layers, 1, HKV, S, D, device="cuda", dtype=DTYPE)
        self.v = torch.randn_like(self.k)
        self.q = torch.randn(1, T, HQ, D, device="cuda", dtype=DTYPE)
        lens = torch.tensor([ctx], device="cuda")
        self.inputs = AttentionInputs(lens[:, None] + torch.arange(T, device="cuda"), lens,
                                      random_tree(T, gen).cuda())
        self.prefix_bytes = 2 * HKV * ctx * D * DTYPE.itemsize
        self.flops = 4 * T * HQ * (ctx + T) * D

    def run(self, attn, **kw):
        def fn():
            for i in range(self.layers):
                attn(self.q, self.k[i], self.v[i], self.inputs, D ** -0.5, **kw)
        return graph_time(fn) / self.layers

    def error(self) -> float:
        out = tree_attention(self.q, self.k[0], self.v[0], self.inputs, D ** -0.5)
        ref = sdpa_attention(self.q.float(), self.k[0].float(), self.v[0].float(), self.inputs, D ** -0.5)
        return (out.float() - ref).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", action="store_true", help="also time several split counts per shape")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'ctx':>6} {'T':>4} {'splits':>6} {'kernel us':>10} {'sdpa us':>9} {'speedup':>8} "
          f"{'prefix TB/s':>11} {'% copy':>7} {'TFLOP/s':>8} {'max err':>8}")
    sweep = []
    for ctx in CONTEXTS:
        for T in BLOCKS:
            case = Case(ctx, T, gen)
            rows = T * HQ // HKV
            splits, _ = default_num_splits(1, HKV, rows, ctx + T, dev, default_row_programs(rows, 128),
                                           single_token=T == 1)
            t_k = case.run(tree_attention)
            t_s = case.run(sdpa_attention)
            pbw = case.prefix_bytes / t_k
            print(f"{ctx:>6} {T:>4} {splits:>6} {t_k * 1e6:>10.1f} {t_s * 1e6:>9.1f} {t_s / t_k:>8.1f} "
                  f"{pbw / 1e12:>11.2f} {100 * pbw / bw:>6.0f}% {case.flops / t_k / 1e12:>8.1f} "
                  f"{case.error():>8.1e}", flush=True)
            if args.sweep and ctx >= 4096:
                sweep.append((ctx, T, {n: case.run(tree_attention, num_splits=n) * 1e6
                                       for n in (1, 2, 3, 4, 8, 16, 24, 33, 64)}))
            del case
    for ctx, T, times in sweep:
        best = min(times, key=times.get)
        print(f"sweep ctx={ctx} T={T}: best {best} ({times[best]:.1f} us) | "
              + " ".join(f"{n}:{t:.1f}" for n, t in times.items()))


if __name__ == "__main__":
    main()
