"""Time `tree_attention` on an 8B-like layer, against the two-launch version it replaced
and the SDPA reference.

    python -m treeflash.kernels.bench_tree_attention [--out rows.jsonl] [--sweep]

32 q heads, 8 KV heads, D = 128, bf16, B = 1; contexts 4K/16K; T = 1..256 block tokens
with a random tree mask. Each timing is a CUDA graph replaying the kernel over enough
layers' caches (>= 512 MB) that the prefix comes from HBM, not L2, as in a real
forward; the time shown is per layer. "prefix TB/s" = K+V bytes of the prefix / kernel
time, and "% copy" compares it with a large device copy (bytes read + written / time).
"2-launch" is the kernel as it was before the merge moved into it (partials, then a
merge launch), kept here only to compare the two on the same device in one run.
--sweep also times each shape at several split counts, to tune `default_num_splits`.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl

from treeflash.kernels.tree_attention import (BLOCK_N, _attend, _sm_count, _split_range, default_num_splits,
                                              tree_attention)
from treeflash.layers.attention import AttentionInputs, sdpa_attention

HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16
CONTEXTS = (4096, 16384)
BLOCKS = (1, 16, 64, 256)
SWEEP_SPLITS = (8, 12, 15, 16, 20, 24, 32)
ROTATE_BYTES = 512 << 20


# --- the two-launch version (the library kernel before the merge moved into it) ---

@triton.jit
def _two_launch_partial(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, lse_ptr, prefix_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_i,
    qk_scale, num_splits,
    HKV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_N_TREE: tl.constexpr, FP32_DOT: tl.constexpr,
):
    ROWS: tl.constexpr = T * G
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    L = tl.load(prefix_ptr + b).to(tl.int32)
    is_block = split == num_splits
    if is_block:
        start = L
        end = L + T
    else:
        start, end = _split_range(L, split, num_splits, BLOCK_N)
    n_rows = (start < end).to(tl.int32) * ROWS
    offs_d = tl.arange(0, D)
    b64 = b.to(tl.int64)
    q_base = q_ptr + b64 * sq_b + kvh * G * sq_h
    k_base = k_ptr + b64 * sk_b + kvh.to(tl.int64) * sk_h
    v_base = v_ptr + b64 * sv_b + kvh.to(tl.int64) * sv_h
    mask_base = mask_ptr + b * sm_b
    part = pid_bh * (num_splits + 1) + split
    for row0 in range(0, n_rows, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < ROWS
        tok = rows // G
        q = tl.load(q_base + tok[:, None] * sq_t + (rows % G)[:, None] * sq_h + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
        if is_block:
            o, lse = _attend(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base, sm_i, L, T,
                             qk_scale, D, BLOCK_M, BLOCK_N_TREE, True, FP32_DOT)
        else:
            o, lse = _attend(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base, sm_i, start, end - start,
                             qk_scale, D, BLOCK_M, BLOCK_N, False, FP32_DOT)
        tl.store(o_ptr + (part * ROWS + rows)[:, None] * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(lse_ptr + part * ROWS + rows, lse, mask=row_ok)


@triton.jit
def _two_launch_merge(o_ptr, lse_ptr, prefix_ptr, out_ptr, num_splits,
                      HKV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
                      CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    ROWS: tl.constexpr = T * G
    pid = tl.program_id(0)
    h = pid % (HKV * G)
    t = (pid // (HKV * G)) % T
    b = pid // (HKV * G * T)
    row = t * G + h % G
    L = tl.load(prefix_ptr + b).to(tl.int32)
    part0 = (b * HKV + h // G) * (num_splits + 1)
    offs_d = tl.arange(0, D)
    m = float("-inf")
    den = 0.0
    acc = tl.zeros([D], tl.float32)
    for s0 in range(0, num_splits + 1, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        start, end = _split_range(L, s, num_splits, BLOCK_N)
        ran = ((s < num_splits) & (start < end)) | (s == num_splits)
        lse = tl.load(lse_ptr + (part0 + s) * ROWS + row, mask=ran, other=float("-inf"))
        o = tl.load(o_ptr + ((part0 + s) * ROWS + row)[:, None] * D + offs_d[None, :],
                    mask=ran[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_ref)
        alpha = tl.exp2(m - m_ref)
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        m = m_new
    tl.store(out_ptr + pid * D + offs_d, (acc / den).to(out_ptr.dtype.element_ty))


def two_launch_splits(rows: int, capacity: int, dev: torch.device) -> int:
    """Its split count: (splits + 1) programs per (b, kv head) in one wave."""
    return max(1, min(_sm_count(dev) // HKV - 1, capacity // (256 if rows <= 16 else 512)))


def two_launch_attention(q, k_cache, v_cache, inputs, scale):
    B, T, H, _ = q.shape
    S = k_cache.shape[2]
    G = H // HKV
    rows = T * G
    splits = two_launch_splits(rows, S, q.device)
    block_m = max(16, min(128, triton.next_power_of_2(rows)))
    mask = inputs.block_mask
    o_part = torch.empty(B * HKV, splits + 1, rows, D, dtype=q.dtype, device=q.device)
    lse_part = torch.empty(B * HKV, splits + 1, rows, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    _two_launch_partial[(B * HKV, splits + 1)](
        q, k_cache, v_cache, mask.view(torch.uint8), o_part, lse_part, inputs.prefix_lens,
        q.stride(0), q.stride(1), q.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3],
        mask.stride(0), mask.stride(1), scale * 1.4426950408889634, splits,
        HKV=HKV, G=G, T=T, D=D, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_N_TREE=max(16, min(BLOCK_N, triton.next_power_of_2(T))), FP32_DOT=False,
        num_warps=8 if block_m >= 128 else 4, num_stages=4 if block_m <= 64 else 3)
    _two_launch_merge[(B * T * H,)](
        o_part, lse_part, inputs.prefix_lens, out, splits, HKV=HKV, G=G, T=T, D=D,
        CHUNK=min(64, triton.next_power_of_2(splits + 1)), BLOCK_N=BLOCK_N, num_warps=4)
    return out


# --- timing ---

def graph_time(fn, reps: int = 20) -> float:
    """Median seconds of one replay of a CUDA graph of fn() (of fn() itself if it cannot
    be captured), after two eager warm-up calls (compiles, allocations, the kernel's
    arrival counters)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
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

    def run(self, attn, **kw) -> float:
        def fn():
            for i in range(self.layers):
                attn(self.q, self.k[i], self.v[i], self.inputs, D ** -0.5, **kw)
        return graph_time(fn) / self.layers

    def error(self, attn) -> float:
        out = attn(self.q, self.k[0], self.v[0], self.inputs, D ** -0.5)
        ref = sdpa_attention(self.q.float(), self.k[0].float(), self.v[0].float(), self.inputs, D ** -0.5)
        return (out.float() - ref).abs().max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="also write one JSON object per row to this file")
    ap.add_argument("--sweep", action="store_true", help="also time several split counts per shape")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    out = open(args.out, "w") if args.out else None
    print(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s (read + write)")
    print(f"{'ctx':>6} {'T':>4} {'splits':>6} {'kernel us':>9} {'prefix TB/s':>11} {'% copy':>6} "
          f"{'2-launch us':>11} {'% copy':>6} {'gain':>5} {'sdpa us':>8} {'TFLOP/s':>7} {'max err':>8} "
          f"{'2-l err':>8}")
    for ctx in CONTEXTS:
        for T in BLOCKS:
            case = Case(ctx, T, gen)
            rows = T * HQ // HKV
            row = dict(device=name, copy_tbps=bw / 1e12, ctx=ctx, T=T,
                       splits=default_num_splits(1, HKV, rows, ctx + T, dev),
                       us=case.run(tree_attention) * 1e6,
                       two_launch_splits=two_launch_splits(rows, ctx + T, dev),
                       two_launch_us=case.run(two_launch_attention) * 1e6,
                       sdpa_us=case.run(sdpa_attention) * 1e6,
                       err=case.error(tree_attention), two_launch_err=case.error(two_launch_attention))
            row["prefix_tbps"] = case.prefix_bytes / row["us"] / 1e6
            row["pct_copy"] = 100 * row["prefix_tbps"] * 1e12 / bw
            row["two_launch_pct_copy"] = 100 * case.prefix_bytes / (row["two_launch_us"] / 1e6) / bw
            row["tflops"] = case.flops / row["us"] / 1e6
            if args.sweep:
                row["sweep_us"] = {n: case.run(tree_attention, num_splits=n) * 1e6 for n in SWEEP_SPLITS}
            print(f"{ctx:>6} {T:>4} {row['splits']:>6} {row['us']:>9.1f} {row['prefix_tbps']:>11.2f} "
                  f"{row['pct_copy']:>5.0f}% {row['two_launch_us']:>11.1f} {row['two_launch_pct_copy']:>5.0f}% "
                  f"{row['two_launch_us'] / row['us']:>5.2f} {row['sdpa_us']:>8.1f} {row['tflops']:>7.1f} "
                  f"{row['err']:>8.1e} {row['two_launch_err']:>8.1e}", flush=True)
            if args.sweep:
                best = min(row["sweep_us"], key=row["sweep_us"].get)
                print(f"       sweep: best {best} splits ({row['sweep_us'][best]:.1f} us) | "
                      + " ".join(f"{n}:{t:.1f}" for n, t in row["sweep_us"].items()), flush=True)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()
            del case
    if out:
        out.close()


if __name__ == "__main__":
    main()
