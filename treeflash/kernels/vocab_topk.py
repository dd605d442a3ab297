"""Top-k of each row of a vocabulary slice and the row's log-sum-exp, in one launch
(two past one chunk): the drafter's per-depth candidates for the DDTree builder.

torch does it in ~6 launches (topk, then max / sub / exp / sum / log for the
log-sum-exp) that together cost more than the tree builder at small budgets. Here
program (row, chunk) reads its chunk of the row once, keeps its max and sum of
exponentials, and selects the chunk's top k with the tree builder's bitonic top-k over
packed (score, index) keys (ties toward the lower index). With one chunk that is the
answer; otherwise a second launch takes the top k of the chunks' candidates and
combines their log-sum-exps. H200, 15 rows of 4096 (the built-in drafter's block):
5-7 us for k = 16 / 64 against 52 us for torch's topk + logsumexp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

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
                LOG_C: tl.constexpr, LOG_K: tl.constexpr, CHUNKS: tl.constexpr):
    """Program (row, chunk): the chunk's top 2^LOG_K (value, id) and (max, sumexp).
    With one chunk, writes the row's final answer (first K entries) and its lse."""
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
def _merge_topk(cval_ptr, cid_ptr, cmax_ptr, csum_ptr, val_ptr, id_ptr, lse_ptr, K,
                LOG_K: tl.constexpr, CHUNKS: tl.constexpr, LOG_P: tl.constexpr):
    """Program row: top K of the row's CHUNKS x 2^LOG_K candidates, and its lse."""
    KP: tl.constexpr = 2 ** LOG_K
    P: tl.constexpr = 2 ** LOG_P
    row = tl.program_id(0)
    c = tl.arange(0, P)
    ok = c < CHUNKS * KP
    v = tl.load(cval_ptr + row * CHUNKS * KP + c, mask=ok, other=float("-inf"))
    key = tl.where(ok, _score_key(v), _PAD_KEY)
    # Candidates are chunk-major, so their position orders equal values by token id.
    key, pos = _unpack(_topk(_pack(key, c), LOG_P, LOG_K))
    k = tl.arange(0, KP)
    tl.store(val_ptr + row * K + k, _key_score(key), mask=k < K)
    tl.store(id_ptr + row * K + k, tl.load(cid_ptr + row * CHUNKS * KP + pos), mask=k < K)
    ch = tl.arange(0, 2 ** (LOG_P - LOG_K))  # >= CHUNKS
    m = tl.load(cmax_ptr + row * CHUNKS + ch, mask=ch < CHUNKS, other=float("-inf"))
    s = tl.load(csum_ptr + row * CHUNKS + ch, mask=ch < CHUNKS, other=0.0)
    mx = tl.max(m, 0)
    ref = tl.where(mx == float("-inf"), 0.0, mx)
    tl.store(lse_ptr + row, mx + tl.log(tl.sum(s * tl.exp(m - ref), 0)))


def _chunk_log2(V: int, log_k: int) -> int:
    """Chunk size (log2) per program: 512 entries, or 4 x the padded k if more (H200,
    V = 4096, 15 rows: k = 16 / 64 in 5-7 us at 512, k = 256 16 us at 1024; a program
    over all 4096 took 11-42 us), never past the padded vocabulary."""
    return min(max(9, log_k + 2), (V - 1).bit_length(), CHUNK.bit_length() - 1)


def fits(V: int, k: int) -> bool:
    """Whether `topk_logsumexp` takes (V, k): its second launch merges at most 4096
    candidates in one program (chunks x padded k), e.g. k = 64 up to V = 32K. Larger
    vocabularies keep torch's top-k (a wider merge was slower than torch at V = 152K)."""
    log_k = max(1, (k - 1).bit_length())
    chunks = -(-V // 2 ** _chunk_log2(V, log_k))
    return 1 <= k <= V and (chunks == 1 or chunks << log_k <= 4096)


def topk_logsumexp(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values [..., k] descending, ids [..., k] (int64), logsumexp [..., 1]) of
    the float rows of x [..., V] on the GPU: `x.topk(k)` and `x.logsumexp(-1,
    keepdim=True)` in one launch (two past one chunk). Equal values: lower id first.
    (V, k) must satisfy `fits`."""
    *lead, V = x.shape
    if not fits(V, k):
        raise ValueError(f"topk_logsumexp: k = {k} over {V} entries is outside what it handles (see fits)")
    rows = x.reshape(-1, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    log_k = max(1, (k - 1).bit_length())
    log_c = max(log_k, _chunk_log2(V, log_k))
    chunks = triton.cdiv(V, 2 ** log_c)
    warps = 4 if log_c <= 9 else 8
    vals = torch.empty(R, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(R, k, dtype=torch.long, device=x.device)
    lse = torch.empty(R, dtype=torch.float32, device=x.device)
    if chunks == 1:
        _chunk_topk[(R, 1)](rows, vals, ids, lse, lse, V, rows.stride(0), k,
                            LOG_C=log_c, LOG_K=log_k, CHUNKS=1, num_warps=warps)
    else:
        kp = 2 ** log_k
        cval = torch.empty(R, chunks, kp, dtype=torch.float32, device=x.device)
        cid = torch.empty(R, chunks, kp, dtype=torch.long, device=x.device)
        cmax = torch.empty(R, chunks, dtype=torch.float32, device=x.device)
        csum = torch.empty(R, chunks, dtype=torch.float32, device=x.device)
        _chunk_topk[(R, chunks)](rows, cval, cid, cmax, csum, V, rows.stride(0), k,
                                 LOG_C=log_c, LOG_K=log_k, CHUNKS=chunks, num_warps=warps)
        _merge_topk[(R,)](cval, cid, cmax, csum, vals, ids, lse, k,
                          LOG_K=log_k, CHUNKS=chunks, LOG_P=(chunks * kp - 1).bit_length(), num_warps=4)
    return vals.view(*lead, k), ids.view(*lead, k), lse.view(*lead, 1)
