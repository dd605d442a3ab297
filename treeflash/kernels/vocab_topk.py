"""Top-k of each row of a vocabulary slice and the row's log-sum-exp, in one launch
(more past one chunk): the drafter's per-depth candidates for the DDTree builder.

torch does it in ~6 launches (topk, then max / sub / exp / sum / log for the
log-sum-exp) that together cost more than the tree builder at small budgets. Here
program (row, chunk) reads its chunk of the row once, keeps its max and sum of
exponentials, and selects the chunk's top k with a bitonic top-k (`_topk`) over
packed (score, index) keys (ties toward the lower index). With one chunk that is the
answer; otherwise merge launches take the top k of up to MERGE chunk candidates per
program, and combine their log-sum-exps, level by level until one program per row is
left.

With more chunks than k (a 152K vocabulary at k = 16: 297 chunks of 512), only the k
chunks of largest maxima can hold the top k, so a first pass takes every chunk's max
and sum of exponentials and only those k chunks are searched. H200, 15 rows of bf16
(BENCHMARKS.md section 15): V = 151936, k = 16 / 32 / 64: 15 / 28 / 48 us, where every
chunk was searched in 54 / 65 / 77 us (torch: 101 us); V = 4096 (8 chunks): 11-12 us
(torch 53 us).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous

CHUNK = 4096  # the most vocabulary entries per program
_PAD_KEY = tl.constexpr(-0x7FFFFFFF)  # below the key of -inf (0x807FFFFF): padding never beats a real entry


@triton.jit
def _score_key(s):
    """int32 with the order of the float32 s (-0.0 folded into 0.0: they are equal scores)."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_score(key):
    bits = key ^ ((key >> 31) & 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pack(key, index):
    """One int64 whose descending order is (key descending, index ascending)."""
    return (key.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)


@triton.jit
def _unpack(packed):
    return (packed >> 32).to(tl.int32), 0x7FFFFFFF - (packed & 0x7FFFFFFF).to(tl.int32)


@triton.jit
def _side(NDIM: tl.constexpr, j: tl.constexpr):
    """0 / 1: which half of hypercube axis j (counted from the innermost) an element is in."""
    return tl.reshape(tl.arange(0, 2), [1] * (NDIM - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_swap(h, flip, NDIM: tl.constexpr, j: tl.constexpr):
    """Order every pair across hypercube axis j: the larger value goes to side 1, or to
    side 0 where flip is 1. The partner is the pair's sum minus self (exact under
    wrap-around): a sum reduction, which the interpreter does in numpy, where
    tl.sort's xor reduction runs element by element in Python."""
    other = tl.sum(h, NDIM - 1 - j, keep_dims=True) - h
    return tl.where((h > other) != (flip ^ _side(NDIM, j)), other, h)


@triton.jit
def _bitonic_merge(h, NDIM: tl.constexpr, stage: tl.constexpr, DESCENDING: tl.constexpr):
    """Sort bitonic runs of 2^stage: descending if DESCENDING, else alternating up/down."""
    if DESCENDING:
        flip = 1
    else:
        flip = _side(NDIM, stage)
    for i in tl.static_range(stage):
        h = _compare_swap(h, flip, NDIM, stage - 1 - i)
    return h


@triton.jit
def _topk(x, LOG_N: tl.constexpr, LOG_K: tl.constexpr):
    """The 2^LOG_K largest of x [2^LOG_N], in descending order (bitonic top-k: sort runs
    of 2^LOG_K, alternately up and down; the elementwise max of an up and a down run
    holds the top half of both, as a bitonic run; merge it; repeat)."""
    h = tl.reshape(x, [2] * LOG_N)
    for stage in tl.static_range(1, LOG_K + 1):
        h = _bitonic_merge(h, LOG_N, stage, stage == LOG_N)
    for i in tl.static_range(LOG_K + 1, LOG_N + 1):
        h = tl.max(h, LOG_N - i)
        h = _bitonic_merge(h, LOG_N - i + LOG_K, LOG_K, i == LOG_N)
    return tl.reshape(h, [2 ** LOG_K])


@triton.jit
def _lse_parts(x):
    """max(x) and sum(exp(x - max)); an all -inf x gives (-inf, 0)."""
    mx = tl.max(x, 0)
    ref = tl.where(mx == float("-inf"), 0.0, mx)
    return mx, tl.sum(tl.exp(x - ref), 0)


@triton.jit
def _chunk_stats(x_ptr, max_ptr, sum_ptr, V, sx, NCH,
                 LOG_C: tl.constexpr, PER: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, group): max and sum of exponentials of chunks group * PER, ... of
    2^LOG_C entries each, for `_chunk_topk`'s choice of chunks. The max is taken in the
    top-k's key order, so a chunk holding a NaN has max NaN and is chosen first, as
    `torch.topk` ranks NaN first (a float max would skip it)."""
    start_after_previous(PDL)
    C: tl.constexpr = 2 ** LOG_C
    row = tl.program_id(0)
    offs = tl.program_id(1) * (PER * C) + tl.arange(0, PER * C)
    x = tl.load(x_ptr + row.to(tl.int64) * sx + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.reshape(x, [PER, C])
    mx = _key_score(tl.max(_score_key(x), 1))
    se = tl.sum(tl.exp(x - tl.where(mx == float("-inf"), 0.0, mx)[:, None]), 1)
    ch = tl.program_id(1) * PER + tl.arange(0, PER)
    tl.store(max_ptr + row * NCH + ch, mx, mask=ch < NCH)
    tl.store(sum_ptr + row * NCH + ch, se, mask=ch < NCH)


@triton.jit
def _chunk_topk(x_ptr, val_ptr, id_ptr, max_ptr, sum_ptr, cmax_ptr, csum_ptr, V, sx, K, NCH,
                LOG_C: tl.constexpr, LOG_K: tl.constexpr, CHUNKS: tl.constexpr,
                SELECT: tl.constexpr, LOG_NCH: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, p): the top 2^LOG_K (value, id) of one chunk and a share of the
    row's (max, sumexp), as part p of the row. Without SELECT the chunk is p and the
    share its own. With SELECT (more chunks than 2^LOG_K) the row's top 2^LOG_K lie in
    the 2^LOG_K chunks of largest maxima (each other chunk's max is at most the
    2^LOG_K-th largest of these, and ties go to the lower chunk, as to the lower id):
    the chunk is the p-th of those, its part is its rank in vocabulary order (merges
    break ties by position), and the share is chunks p, p + 2^LOG_K, ... from
    `_chunk_stats`. With one chunk, writes the row's answer (first K entries) and lse."""
    start_after_previous(PDL)
    C: tl.constexpr = 2 ** LOG_C
    KP: tl.constexpr = 2 ** LOG_K
    row = tl.program_id(0)
    p = tl.program_id(1)
    if SELECT:
        c = tl.arange(0, 2 ** LOG_NCH)
        c_ok = c < NCH
        cmax = tl.load(cmax_ptr + row * NCH + c, mask=c_ok, other=float("-inf"))
        _, chosen = _unpack(_topk(_pack(tl.where(c_ok, _score_key(cmax), _PAD_KEY), c), LOG_NCH, LOG_K))
        chunk = tl.sum(tl.where(tl.arange(0, KP) == p, chosen, 0))
        part = row * CHUNKS + tl.sum((chosen < chunk).to(tl.int32))
        share = c_ok & (c % KP == p)
        mx = tl.max(tl.where(share, cmax, float("-inf")), 0)
        csum = tl.load(csum_ptr + row * NCH + c, mask=share, other=0.0)
        se = tl.sum(tl.where(share, csum * tl.exp(cmax - tl.where(mx == float("-inf"), 0.0, mx)), 0.0), 0)
    else:
        chunk = p
        part = row * CHUNKS + p
    offs = chunk * C + tl.arange(0, C)
    ok = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * sx + offs, mask=ok, other=float("-inf")).to(tl.float32)
    if not SELECT:
        mx, se = _lse_parts(x)
    key = tl.where(ok, _score_key(x), _PAD_KEY)
    key, idx = _unpack(_topk(_pack(key, offs), LOG_C, LOG_K))
    k = tl.arange(0, KP)
    if CHUNKS == 1:
        tl.store(val_ptr + row * K + k, _key_score(key), mask=k < K)
        tl.store(id_ptr + row * K + k, idx.to(tl.int64), mask=k < K)
        tl.store(max_ptr + row, mx + tl.log(se))
    else:
        tl.store(val_ptr + part * KP + k, _key_score(key))
        tl.store(id_ptr + part * KP + k, idx.to(tl.int64))
        tl.store(max_ptr + part, mx)
        tl.store(sum_ptr + part, se)


@triton.jit
def _merge_topk(cval_ptr, cid_ptr, cmax_ptr, csum_ptr, val_ptr, id_ptr, max_ptr, sum_ptr, K, PARTS,
                LOG_K: tl.constexpr, GROUP: tl.constexpr, LOG_P: tl.constexpr, FINAL: tl.constexpr,
                PDL: tl.constexpr = False):
    """Program (row, group): the top 2^LOG_K of parts group * GROUP, ... (each part a
    sorted 2^LOG_K candidates and its (max, sumexp)) and their combined (max, sumexp),
    in the parts' own layout for the next level; FINAL (one group): the row's first K
    values and ids and its lse (into max_ptr)."""
    start_after_previous(PDL)
    KP: tl.constexpr = 2 ** LOG_K
    P: tl.constexpr = 2 ** LOG_P
    row = tl.program_id(0)
    group = tl.program_id(1)
    first = row * PARTS + group * GROUP            # the group's first part
    c = tl.arange(0, P)
    ok = (c < GROUP * KP) & (group * GROUP + c // KP < PARTS)
    v = tl.load(cval_ptr + first * KP + c, mask=ok, other=float("-inf"))
    key = tl.where(ok, _score_key(v), _PAD_KEY)
    # Parts are in vocabulary order and each sorted, so position orders equal values by id.
    key, pos = _unpack(_topk(_pack(key, c), LOG_P, LOG_K))
    ids = tl.load(cid_ptr + first * KP + pos)
    ch = tl.arange(0, 2 ** (LOG_P - LOG_K))       # >= GROUP
    ch_ok = (ch < GROUP) & (group * GROUP + ch < PARTS)
    m = tl.load(cmax_ptr + first + ch, mask=ch_ok, other=float("-inf"))
    s = tl.load(csum_ptr + first + ch, mask=ch_ok, other=0.0)
    mx = tl.max(m, 0)
    se = tl.sum(s * tl.exp(m - tl.where(mx == float("-inf"), 0.0, mx)), 0)
    k = tl.arange(0, KP)
    if FINAL:
        tl.store(val_ptr + row * K + k, _key_score(key), mask=k < K)
        tl.store(id_ptr + row * K + k, ids, mask=k < K)
        tl.store(max_ptr + row, mx + tl.log(se))
    else:
        out = row * tl.num_programs(1) + group
        tl.store(val_ptr + out * KP + k, _key_score(key))
        tl.store(id_ptr + out * KP + k, ids)
        tl.store(max_ptr + out, mx)
        tl.store(sum_ptr + out, se)


def _chunk_log2(V: int, log_k: int) -> int:
    """Chunk size (log2) per program: 512 entries, or 4 x the padded k if more (H200,
    V = 4096, 15 rows: k = 16 / 64 in 5-7 us at 512, k = 256 16 us at 1024; a program
    over all 4096 took 11-42 us), never past the padded vocabulary."""
    return min(max(9, log_k + 2), (V - 1).bit_length(), CHUNK.bit_length() - 1)


# The most candidates one merge program takes (parts x padded k). The bitonic top-k of a
# wide row in one program is slow: merging 64 parts of 64 (k = 64) in two levels of 512
# took 48 us for 15 rows of a 152K vocabulary, in one level of 4096 87 us (H200).
MERGE = 512


def fits(V: int, k: int) -> bool:
    """Whether `topk_logsumexp` takes (V, k); else torch's top-k is faster. The chunks'
    bitonic top-k grows with k. H200, 15 rows, fused ÷ torch time before chunks were
    chosen by their maxima, at k = 16 / 64 / 128 / 256: V = 32768 0.23 / 0.68 / 0.78 /
    0.97; V = 151936 0.58 / 0.80 / 1.09 / 1.72 (now V = 32768 at k = 256: 0.60; V =
    151936 at k = 64: 0.48; larger k not measured)."""
    return 1 <= k <= V and (k <= 64 or V * k <= 2 ** 23)


def topk_logsumexp(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [..., k] descending, ids [..., k] (int64), logsumexp [..., 1]) of
    the float rows of x [..., V] on the GPU: `x.topk(k)` and `x.logsumexp(-1,
    keepdim=True)` in one launch for one chunk; past that a pass for the chunks' maxima
    where there are more chunks than k, the chunks' top k, and merge levels of up to
    MERGE candidates each. Equal values: lower id first. (V, k) must satisfy `fits`."""
    *lead, V = x.shape
    if not fits(V, k):
        raise ValueError(f"topk_logsumexp: k = {k} over {V} entries is outside what it handles (see fits)")
    rows = x.reshape(-1, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    log_k = max(1, (k - 1).bit_length())
    log_c = max(log_k, _chunk_log2(V, log_k))
    parts = triton.cdiv(V, 2 ** log_c)
    warps = 4 if log_c <= 9 else 8
    vals = torch.empty(R, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(R, k, dtype=torch.long, device=x.device)
    lse = torch.empty(R, dtype=torch.float32, device=x.device)
    if parts == 1:
        _chunk_topk[(R, 1)](rows, vals, ids, lse, lse, lse, lse, V, rows.stride(0), k, 1, LOG_C=log_c,
                            LOG_K=log_k, CHUNKS=1, SELECT=False, LOG_NCH=0, num_warps=warps,
                            **chained(rows.device))
        return vals.view(*lead, k), ids.view(*lead, k), lse.view(*lead, 1)
    kp = 2 ** log_k

    def part_buffers(n):
        return (torch.empty(R, n, kp, dtype=torch.float32, device=x.device),
                torch.empty(R, n, kp, dtype=torch.long, device=x.device),
                torch.empty(R, n, dtype=torch.float32, device=x.device),
                torch.empty(R, n, dtype=torch.float32, device=x.device))

    select = parts > kp  # search only the kp chunks of largest maxima (`_chunk_topk`)
    cmax = csum = lse
    if select:
        per = max(1, CHUNK // 2 ** log_c)
        cmax = torch.empty(R, parts, dtype=torch.float32, device=x.device)
        csum = torch.empty_like(cmax)
        _chunk_stats[(R, triton.cdiv(parts, per))](rows, cmax, csum, V, rows.stride(0), parts, LOG_C=log_c,
                                                  PER=per, num_warps=8, **chained(rows.device))
    searched = kp if select else parts
    level = part_buffers(searched)
    _chunk_topk[(R, searched)](rows, *level, cmax, csum, V, rows.stride(0), k, parts, LOG_C=log_c, LOG_K=log_k,
                               CHUNKS=searched, SELECT=select, LOG_NCH=max(log_k, (parts - 1).bit_length()),
                               num_warps=warps, **chained(rows.device))
    parts = searched
    while True:
        group = min(parts, max(2, MERGE // kp))
        groups = triton.cdiv(parts, group)
        out = (vals, ids, lse, lse) if groups == 1 else part_buffers(groups)
        _merge_topk[(R, groups)](*level, *out, k, parts, LOG_K=log_k, GROUP=group,
                                 LOG_P=(group * kp - 1).bit_length(), FINAL=groups == 1, num_warps=4,
                                 **chained(rows.device))
        if groups == 1:
            return vals.view(*lead, k), ids.view(*lead, k), lse.view(*lead, 1)
        level, parts = out, groups
