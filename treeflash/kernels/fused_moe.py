"""Mixture-of-experts FFN for decode and verify (Triton, CUDA-graph capturable).

A round runs 1 to a few hundred tokens through each MoE layer and every token picks
k of E experts, so the cost is reading the weights of the experts that were picked.
At batch-1 decode the weights read per layer are few and the launches count: routing
(softmax, top-k, renormalisation: `route`) is one launch, and grouping the (token,
slot) pairs by expert (a stable counting sort on the device, no host sync, static
shapes: `group_pairs`) another, where torch took about ten. Each program then computes
one BLOCK_M x BLOCK_N tile for one expert, for up to BLOCK_M of the pairs routed to it.
At small T an expert's pairs fit in one row block, so its weights are read once.

Two launches: gate/up with SiLU(gate) * up fused (pairs x I), then down with the
routing weight applied (pairs x H, float32); torch sums each token's k rows. Sizes
are compile-time constants (one model, one compile per tile shape). The reference is
`treeflash.models.moe.experts_reference`. gpt-oss's expert biases and clamped SwiGLU
(`models.moe.swiglu`) are compile-time options of the same two kernels, applied to the
float32 accumulators.

FP8 experts (block-scaled, as DeepSeek-V3 and Qwen3-FP8 publish them) are read as
they are: each K step lies in one scale block, or spans whole narrower blocks read
one sub-step each, so each product is scaled once per output column (its block's
scale) and added up in float32. The activations stay in their dtype (weight-only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, E: tl.constexpr, K: tl.constexpr, RENORM: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """One token: softmax over its E router logits (float32), the k largest (the lowest
    expert id first among equal ones), optionally renormalised to sum to 1."""
    start_after_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * E + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)
    rank = tl.where(p != p, float("inf"), p)   # NaN ranks highest, as in torch.topk
    rank = tl.where(e < E, rank, -float("inf"))
    slot = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    for j in tl.static_range(K):
        pick = tl.min(tl.where(rank == tl.max(rank, 0), e, BLOCK_E), 0)
        vals = tl.where(slot == j, tl.sum(tl.where(e == pick, p, 0.0), 0), vals)
        ids = tl.where(slot == j, pick, ids)
        rank = tl.where(e == pick, -float("inf"), rank)   # taken; K <= E, so a pick is always an expert
    if RENORM:
        vals = vals / tl.sum(vals, 0)
    tl.store(w_ptr + t * K + slot, vals.to(w_ptr.dtype.element_ty), mask=slot < K)
    tl.store(ids_ptr + t * K + slot, ids, mask=slot < K)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]):
    what `treeflash.models.moe.Router` computes in torch, in one launch."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        _route_kernel[(T,)](logits.contiguous(), weights, ids, E, top_k, RENORM=renormalize,
                            BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
                            **chained(logits.device))
    return weights, ids


@triton.jit
def _group_kernel(ids_ptr, order_ptr, bounds_ptr, P, E: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                  PDL: tl.constexpr = False):
    """One program: count the pairs per expert, then place each pair after the earlier
    pairs of its expert (a chunk at a time: those of earlier chunks, counted as they
    pass, and those earlier in its chunk, a cumulative sum over the chunk)."""
    start_after_previous(PDL)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), 0)
    seen = tl.cumsum(counts, 0) - counts   # where each expert's pairs start; lane E: P
    tl.store(bounds_ptr + e, seen, mask=e <= E)
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        hit = (ids[:, None] == e[None, :]).to(tl.int32)
        place = tl.sum((seen[None, :] + tl.cumsum(hit, 0) - hit) * hit, 1)
        tl.store(order_ptr + place, p, mask=p < P)
        seen += tl.sum(hit, 0)


def _group_chunk(experts: int) -> tuple[int, int]:
    """(BLOCK_E, CHUNK) of the grouping program: CHUNK pairs x BLOCK_E experts per step."""
    block_e = triton.next_power_of_2(experts + 1)
    return block_e, max(1, 4096 // block_e)


def groups_in_one_launch(pairs: int, experts: int) -> bool:
    """Whether `group_pairs` runs its one program, which walks the pairs serially, 64
    chunks at most (E = 128: 1024 pairs, E = 384: 512): decode and trees. A chunk costs
    ~0.2 us on an H200 (1024 chunks, E = 128: 0.19 ms, where torch's sort took 0.11):
    a long prefill's pairs go to torch's parallel sort."""
    return pairs <= 64 * _group_chunk(experts)[1]


def group_pairs(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, bounds) of the T x k (token, slot) pairs grouped by expert: order [T k]
    lists the pairs expert by expert, each expert's in pair order (a stable sort of the
    ids: torch's `sort(stable=True)` indices), and expert e owns order[bounds[e]:bounds[e + 1]]
    (bounds [E + 1] int32: torch's `searchsorted` of 0..E in the sorted ids)."""
    P = ids.numel()
    if not groups_in_one_launch(P, experts):
        sorted_ids, order = ids.reshape(-1).sort(stable=True)
        return order, torch.searchsorted(sorted_ids, torch.arange(experts + 1, device=ids.device), out_int32=True)
    block_e, chunk = _group_chunk(experts)
    order = torch.empty(P, dtype=torch.int64, device=ids.device)
    bounds = torch.empty(experts + 1, dtype=torch.int32, device=ids.device)
    _group_kernel[(1,)](ids.contiguous(), order, bounds, P, experts, BLOCK_E=block_e, CHUNK=chunk, num_warps=8,
                        **chained(ids.device))
    return order, bounds


@triton.jit
def _row_block(bounds_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Expert of this program's row block, and the block's positions in the sorted pair
    order (and which are real). Expert e owns sorted positions bounds[e] .. bounds[e+1]
    and cdiv(count, BLOCK_M) row blocks, numbered in expert order; blocks past the last
    get expert E (nothing to do)."""
    idx = tl.arange(0, BLOCK_E)
    ok = idx < E
    lo = tl.load(bounds_ptr + idx, mask=ok, other=0)
    hi = tl.load(bounds_ptr + idx + 1, mask=ok, other=0)
    blocks = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, axis=0)
    pid = tl.program_id(0)
    e = tl.sum((ends <= pid).to(tl.int32), axis=0)
    mine = idx == e
    first_block = tl.sum(tl.where(mine, ends - blocks, 0), axis=0)
    start = tl.sum(tl.where(mine, lo, 0), axis=0)
    end = tl.sum(tl.where(mine, hi, 0), axis=0)
    rows = start + (pid - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, rows, rows < end


@triton.jit
def _k_step(acc1, acc2, x_rows, row_ok, w1, w2, s1, s2, col_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
            TWO: tl.constexpr, SCALED: tl.constexpr, SK: tl.constexpr, PRECISION: tl.constexpr):
    """One BLOCK_K step over the inputs: acc1 += x W1^T (and acc2 += x W2^T with TWO),
    where x_rows / w1, w2 point at the rows of x and the weights' columns, and s1, s2 at
    the columns' FP8 scale rows. FP8 weights are converted in registers (exact: e4m3
    values are bf16 and fp16 values), and a step over several scale blocks (where K is
    short, more bytes in flight per step) is read as one sub-step per block, each
    product scaled by its block's scales."""
    KT: tl.constexpr = SK if SCALED and BLOCK_K > SK else BLOCK_K
    for j in tl.static_range(BLOCK_K // KT):
        ks = k0 + j * KT + tl.arange(0, KT)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        b1 = tl.load(w1 + ks[:, None], mask=w_ok, other=0.0)
        if TWO:
            b2 = tl.load(w2 + ks[:, None], mask=w_ok, other=0.0)
        if SCALED:  # a sub-step past K reads no scale (it could be NaN): its product is 0
            s_ok = col_ok & (k0 + j * KT < K)
            kb = (k0 + j * KT) // SK
            acc1 += tl.dot(a, b1.to(a.dtype), input_precision=PRECISION) * \
                tl.load(s1 + kb, mask=s_ok, other=0.0)[None, :]
            if TWO:
                acc2 += tl.dot(a, b2.to(a.dtype), input_precision=PRECISION) * \
                    tl.load(s2 + kb, mask=s_ok, other=0.0)[None, :]
        else:
            acc1 = tl.dot(a, b1, acc1, input_precision=PRECISION)
            if TWO:
                acc2 = tl.dot(a, b2, acc2, input_precision=PRECISION)
    return acc1, acc2


@triton.jit
def _swiglu(g, u, alpha, limit, CLAMP: tl.constexpr):
    """silu(g) * u, or with CLAMP gpt-oss's form (`models.moe.swiglu`), in float32."""
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return g * tl.sigmoid(alpha * g) * (u + 1)
    return g * tl.sigmoid(g) * u


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, act_ptr, order_ptr, bounds_ptr, alpha, limit,
                    E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
                    SCALED: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                    HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, PDL: tl.constexpr = False):
    """act = silu(gate) * up of one tile; HAS_BIAS: gate and up get their bias (b [E, 2I],
    gate's then up's) first; CLAMP: gpt-oss's SwiGLU with `alpha` and `limit`."""
    start_after_previous(PDL)
    e, rows, valid = _row_block(bounds_ptr, E, BLOCK_M, BLOCK_E)
    if e >= E:
        return
    pair = tl.load(order_ptr + rows, mask=valid, other=0)
    tok = pair // TOPK
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < I
    w_gate = w_ptr + e.to(tl.int64) * 2 * I * H + cols[None, :] * H     # [E, 2I, H]: gate rows, then up
    # FP8: the scale grid [E, cdiv(2I, SN), cdiv(H, SK)]; row blocks of the gate, then the up rows
    KB: tl.constexpr = (H + SK - 1) // SK
    s_gate = s_ptr + e.to(tl.int64) * ((2 * I + SN - 1) // SN) * KB + (cols // SN) * KB
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        acc_g, acc_u = _k_step(acc_g, acc_u, x_ptr + tok[:, None] * H, valid, w_gate, w_gate + I * H,
                               s_gate, s_gate + (I // SN) * KB, col_ok, k0, H, BLOCK_K, True, SCALED, SK, PRECISION)
    if HAS_BIAS:
        b_gate = b_ptr + e.to(tl.int64) * 2 * I + cols
        acc_g += tl.load(b_gate, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_gate + I, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    act = _swiglu(acc_g, acc_u, alpha, limit, CLAMP)
    tl.store(act_ptr + pair[:, None] * I + cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, b_ptr, rw_ptr, out_ptr, order_ptr, bounds_ptr,
                 E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_E: tl.constexpr, PRECISION: tl.constexpr,
                 SCALED: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PDL: tl.constexpr = False):
    """out = routing weight * (act @ down^T (+ the expert's bias b [E, H] with HAS_BIAS))
    of one tile, in float32."""
    start_after_previous(PDL)
    e, rows, valid = _row_block(bounds_ptr, E, BLOCK_M, BLOCK_E)
    if e >= E:
        return
    pair = tl.load(order_ptr + rows, mask=valid, other=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    w = w_ptr + e.to(tl.int64) * H * I + cols[None, :] * I                # [E, H, I]
    KB: tl.constexpr = (I + SK - 1) // SK
    s_row = s_ptr + e.to(tl.int64) * ((H + SN - 1) // SN) * KB + (cols // SN) * KB  # FP8 scales
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        acc, _ = _k_step(acc, acc, act_ptr + pair[:, None] * I, valid, w, w, s_row, s_row, col_ok, k0, I, BLOCK_K,
                         False, SCALED, SK, PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * H + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    acc = acc * tl.load(rw_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair[:, None] * H + cols[None, :], acc, mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _rows_times_vector(w_rows, row_ok, x_ptr, s_rows, K, k_blocks,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr, SK: tl.constexpr):
    """[BLOCK_N] float32: the rows at w_rows (each K long) times the vector x [K]. SCALED:
    FP8 rows whose SK-column pieces are summed, then scaled by the row's scales at
    s_rows (k_blocks per row), as `kernels.gemv` does."""
    acc = tl.zeros([BLOCK_N, BLOCK_K // SK if SCALED else BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if SCALED:
            kb = k0 // SK + tl.arange(0, BLOCK_K // SK)
            scale = tl.load(s_rows + kb[None, :], mask=row_ok[:, None] & (kb < k_blocks)[None, :], other=0.0)
            acc += tl.sum(tl.reshape(w * x[None, :], [BLOCK_N, BLOCK_K // SK, SK]), 2) * scale
        else:
            acc += w * x[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _decode_gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, act_ptr, alpha, limit,
                           H: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SCALED: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr,
                           HAS_BIAS: tl.constexpr, CLAMP: tl.constexpr, PDL: tl.constexpr = False):
    """One token, program (pick j, row block): act[j, rows] of expert ids[j], as `_gate_up_kernel`."""
    start_after_previous(PDL)
    j = tl.program_id(0)
    e = tl.load(ids_ptr + j).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < I
    KB: tl.constexpr = (H + SK - 1) // SK
    w_gate = w_ptr + e * 2 * I * H + rows[:, None].to(tl.int64) * H
    s_gate = s_ptr + e * ((2 * I + SN - 1) // SN) * KB + (rows // SN)[:, None] * KB
    g = _rows_times_vector(w_gate, ok, x_ptr, s_gate, H, KB, BLOCK_N, BLOCK_K, SCALED, SK)
    u = _rows_times_vector(w_gate + I * H, ok, x_ptr, s_gate + (I // SN) * KB, H, KB, BLOCK_N, BLOCK_K, SCALED, SK)
    if HAS_BIAS:
        g += tl.load(b_ptr + e * 2 * I + rows, mask=ok, other=0.0).to(tl.float32)
        u += tl.load(b_ptr + e * 2 * I + I + rows, mask=ok, other=0.0).to(tl.float32)
    act = _swiglu(g, u, alpha, limit, CLAMP)
    tl.store(act_ptr + j * I + rows, act.to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _decode_down_kernel(act_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, rw_ptr, out_ptr,
                        H: tl.constexpr, I: tl.constexpr, TOPK: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SCALED: tl.constexpr, SN: tl.constexpr, SK: tl.constexpr, HAS_BIAS: tl.constexpr,
                        PDL: tl.constexpr = False):
    """One token, program (row block): out[rows] = sum over its k picks of routing weight x
    (down[e] act[j] (+ bias)), in float32, then cast: the token's sum needs no launch."""
    start_after_previous(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < H
    KB: tl.constexpr = (I + SK - 1) // SK
    y = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOPK):
        e = tl.load(ids_ptr + j).to(tl.int64)
        w_rows = w_ptr + e * H * I + rows[:, None].to(tl.int64) * I
        s_rows = s_ptr + e * ((H + SN - 1) // SN) * KB + (rows // SN)[:, None] * KB
        yj = _rows_times_vector(w_rows, ok, act_ptr + j * I, s_rows, I, KB, BLOCK_N, BLOCK_K, SCALED, SK)
        if HAS_BIAS:
            yj += tl.load(b_ptr + e * H + rows, mask=ok, other=0.0).to(tl.float32)
        y += tl.load(rw_ptr + j).to(tl.float32) * yj
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=ok)


def decode_tiles(H: int, I: int, fp8_cols: int | None) -> tuple[tuple[int, int], tuple[int, int]]:
    """((BLOCK_N, BLOCK_K) of gate/up, of down) for one token: rows times a vector, each
    program streaming a few rows in 1024-column steps. From an H200 sweep in CUDA graphs
    (BENCHMARKS.md section 12): gate/up 4 rows (gpt-oss-20b 63.9 us per layer, Qwen3-30B-A3B
    33.6, within 1% of the best), down 8 rows for long rows (gpt-oss, I = 2880: 54.2 against
    57-60 for 4 or 16) and 4 for short ones (Qwen3-30B-A3B, I = 768: 25.0 against 27+)."""
    bk = max(fp8_cols or 16, 1024)
    return (4, min(bk, triton.next_power_of_2(H))), (8 if I >= 2048 else 4, min(bk, triton.next_power_of_2(I)))


def _decode_experts(x, weights, ids, gate_up, down, scales, block, bias, clamp, fp8: bool):
    """fused_experts for ONE token: its k experts are distinct, so each row block of
    each is read once by a rows-times-vector program (no grouping launch, no tensor-core
    tiles of 16 rows for 1), and the down kernel adds the k picks itself."""
    H, k, I = x.shape[1], ids.shape[1], gate_up.shape[1] // 2
    alpha, limit = clamp or (0.0, 0.0)
    b_gate_up, b_down = bias or (gate_up, down)   # HAS_BIAS off: unread
    (bn1, bk1), (bn2, bk2) = decode_tiles(H, I, block[1] if fp8 else None)
    act = torch.empty(k, I, dtype=x.dtype, device=x.device)
    _decode_gate_up_kernel[(k, triton.cdiv(I, bn1))](
        x, gate_up, scales[0], b_gate_up, ids, act, alpha, limit, H, I, BLOCK_N=bn1, BLOCK_K=bk1, SCALED=fp8,
        SN=block[0], SK=block[1], HAS_BIAS=bias is not None, CLAMP=clamp is not None, num_warps=4,
        num_stages=3, **chained(x.device))
    out = torch.empty(1, H, dtype=x.dtype, device=x.device)
    _decode_down_kernel[(triton.cdiv(H, bn2),)](
        act, down, scales[1], b_down, ids, weights, out, H, I, TOPK=k, BLOCK_N=bn2, BLOCK_K=bk2, SCALED=fp8,
        SN=block[0], SK=block[1], HAS_BIAS=bias is not None, num_warps=4, num_stages=3, **chained(act.device))
    return out


def _tiles(pairs: int, experts: int, n: int, k: int, dtype: torch.dtype, fp8: bool = False,
           operands: int = 1) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages) of a launch with n output columns, k inputs,
    and `operands` weight tiles per step (gate/up: 2).

    BLOCK_M: the pairs an expert gets on average, at least 16 (tensor cores). BLOCK_N:
    the widest tile that still gives about two programs per SM of an H200 (at T = 1 only
    k experts have work). BLOCK_K: long enough that a narrow tile still keeps ~16 KB of
    weights in flight per stage, within shared memory. FP8: BLOCK_K 128, and BLOCK_N 32
    for gate/up (two weight tiles per step), 32 or 64 for down: the best of sweeps (timed
    in CUDA graphs at T = 1 and 4) at the expert sizes of Qwen3-30B-A3B and Kimi-K2, for
    T = 1 to 64 (BENCHMARKS.md section 11)."""
    avg = pairs / experts
    bm = 16 if avg <= 16 else 32 if avg <= 32 else 64
    active = min(pairs, experts)
    bn = next((b for b in (128, 64, 32) if active * triton.cdiv(n, b) >= 264), 16)
    if fp8:
        return bm, max(32, min(bn, 64 // operands)), 128, 3
    bk = max(16, min(8192 // bn, 8192 // bm, triton.next_power_of_2(k)))
    return bm, bn, bk, 3 if dtype.itemsize <= 2 else 2


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, fp8=None,
                  bias: tuple[torch.Tensor, torch.Tensor] | None = None,
                  clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = ids[t, j].

    x [T, H]; weights, ids [T, k]; gate_up [E, 2I, H] (gate rows, then up rows);
    down [E, H, I]. `fp8`: (gate_up's, down's) `Fp8Weight` for float8 weights, scales
    [E, rows / block rows, columns / block columns] float32, where the block's columns
    are a power of two of 16 or more and its rows divide I. `bias`: gate_up's [E, 2I]
    and down's [E, H], the latter added before the routing weight; `clamp`: (alpha,
    limit) of gpt-oss's SwiGLU (`models.moe.swiglu`). Returns [T, H] in x's dtype."""
    T, H = x.shape
    E, I = gate_up.shape[0], gate_up.shape[1] // 2
    k = ids.shape[1]
    P = T * k
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    if fp8 is None:
        scales, (sn, sk) = (gate_up, down), (1, 1)   # SCALED off: the pointers are never read
    else:
        scales, (sn, sk) = (fp8[0].scale.contiguous(), fp8[1].scale.contiguous()), fp8[0].block
    if T == 1:
        return _decode_experts(x, weights.contiguous(), ids.contiguous(), gate_up, down, scales, (sn, sk),
                               None if bias is None else tuple(b.contiguous() for b in bias), clamp, fp8 is not None)
    b_gate_up, b_down = (gate_up, down) if bias is None else (b.contiguous() for b in bias)  # HAS_BIAS off: unread
    alpha, limit = clamp or (0.0, 0.0)
    order, bounds = group_pairs(ids, E)
    BE = triton.next_power_of_2(E)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(P, I, dtype=x.dtype, device=x.device)
    bm, bn, bk, stages = _tiles(P, E, I, H, x.dtype, fp8 is not None, operands=2)
    blocks = P // bm + min(E, P)        # >= sum over experts of cdiv(count, bm)
    _gate_up_kernel[(blocks, triton.cdiv(I, bn))](
        x, gate_up, scales[0], b_gate_up, act, order, bounds, alpha, limit, E, H, I, TOPK=k, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=BE, PRECISION=precision, SCALED=fp8 is not None, SN=sn, SK=sk,
        HAS_BIAS=bias is not None, CLAMP=clamp is not None, num_warps=4, num_stages=stages, **chained(x.device))
    out = torch.empty(P, H, dtype=torch.float32, device=x.device)
    _, bn, bk, stages = _tiles(P, E, H, I, x.dtype, fp8 is not None)
    _down_kernel[(blocks, triton.cdiv(H, bn))](
        act, down, scales[1], b_down, weights.reshape(-1).contiguous(), out, order, bounds, E, H, I, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=BE, PRECISION=precision, SCALED=fp8 is not None, SN=sn, SK=sk,
        HAS_BIAS=bias is not None, num_warps=4, num_stages=stages, **chained(act.device))
    return out.view(T, k, H).sum(1).to(x.dtype)
