"""Top-k of each row of a vocabulary slice and the row's log-sum-exp, in one launch
(more past one chunk): the drafter's per-depth candidates for the DDTree builder.

torch does it in ~6 launches (topk, then max / sub / exp / sum / log for the
log-sum-exp) that together cost more than the tree builder at small budgets. Here
program (row, chunk) reads its chunk of the row once, keeps its max and sum of
exponentials, and selects the chunk's top k with the tree builder's bitonic top-k over
packed (score, index) keys (ties toward the lower index). With one chunk that is the
answer; otherwise merge launches take the top k of up to MERGE chunk candidates per
program, and combine their log-sum-exps, level by level until one program per row is
left (a 152K vocabulary at k = 16: 297 chunks, 2 groups, then 1). H200, 15 rows, bf16
(BENCHMARKS.md section 2): V = 4096, k = 16 / 64: 5.6 / 7.1 us against 45 us for
torch's topk + logsumexp; V = 151936: 52 / 73 us against 90 us.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous
from treeflash.kernels.tree_build import _PAD_KEY, _key_score, _pack, _score_key, _topk, _unpack

CHUNK = 4096  # the most vocabulary entries per program


@triton.jit
def _lse_parts(x):
    """max(x) and sum(exp(x - max)); an all -inf x gives (-inf, 0)."""
    mx = tl.max(x, 0)
    ref = tl.where(mx == float("-inf"), 0.0, mx)
    return mx, tl.sum(tl.exp(x - ref), 0)


@triton.jit
def _chunk_topk(x_ptr, val_ptr, id_ptr, max_ptr, sum_ptr, V, sx, K,
                LOG_C: tl.constexpr, LOG_K: tl.constexpr, CHUNKS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, chunk): the chunk's top 2^LOG_K (value, id) and (max, sumexp).
    With one chunk, writes the row's final answer (first K entries) and its lse."""
    start_after_previous(PDL)
    C: tl.constexpr = 2 ** LOG_C
    KP: tl.constexpr = 2 ** LOG_K
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * C + tl.arange(0, C)
    ok = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * sx + offs, mask=ok, other=float("-inf")).to(tl.float32)
    mx, se = _lse_parts(x)
    key = tl.where(ok, _score_key(x), _PAD_KEY)
    key, idx = _unpack(_topk(_pack(key, offs), LOG_C, LOG_K))
    k = tl.arange(0, KP)
    part = row * CHUNKS + chunk
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


MERGE = 4096  # the most candidates one merge program takes (parts x padded k)


def fits(V: int, k: int) -> bool:
    """Whether `topk_logsumexp` takes (V, k); else torch's top-k is faster. The chunks'
    bitonic top-k grows with k: H200, 15 rows, fused ÷ torch time at k = 16 / 64 / 128
    / 256: V = 32768 0.23 / 0.68 / 0.78 / 0.97; V = 151936 0.58 / 0.80 / 1.09 / 1.72."""
    return 1 <= k <= V and (k <= 64 or V * k <= 2 ** 23)


def topk_logsumexp(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [..., k] descending, ids [..., k] (int64), logsumexp [..., 1]) of
    the float rows of x [..., V] on the GPU: `x.topk(k)` and `x.logsumexp(-1,
    keepdim=True)` in one launch past one chunk, and merge levels of up to MERGE
    candidates each past that. Equal values: lower id first. (V, k) must satisfy `fits`."""
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
        _chunk_topk[(R, 1)](rows, vals, ids, lse, lse, V, rows.stride(0), k,
                            LOG_C=log_c, LOG_K=log_k, CHUNKS=1, num_warps=warps, **chained(rows.device))
        return vals.view(*lead, k), ids.view(*lead, k), lse.view(*lead, 1)
    kp = 2 ** log_k

    def part_buffers(n):
        return (torch.empty(R, n, kp, dtype=torch.float32, device=x.device),
                torch.empty(R, n, kp, dtype=torch.long, device=x.device),
                torch.empty(R, n, dtype=torch.float32, device=x.device),
                torch.empty(R, n, dtype=torch.float32, device=x.device))

    level = part_buffers(parts)
    _chunk_topk[(R, parts)](rows, *level, V, rows.stride(0), k,
                            LOG_C=log_c, LOG_K=log_k, CHUNKS=parts, num_warps=warps, **chained(rows.device))
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
