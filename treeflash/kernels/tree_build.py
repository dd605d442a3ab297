"""The DDTree builder (`engine.tree.build_tree`) as ONE Triton launch.

The torch builder is ~100 tiny kernels (a top-k per depth, then sort / scatter /
gather and the ancestor matrix); under a CUDA graph that is still ~1 ms, more than a
small model's whole round. Here one program per request does it all, in four phases
separated by `tl.debug_barrier()` (the phases talk through small global scratch
buffers, which a barrier makes visible to every thread of the program):

1. Beam per depth, exactly as the torch builder: beam_d = top N of
   {beam_{d-1}[i] + top_vals[d, j]}. Both lists are sorted descending, so (i, j)
   is beaten by all (i' <= i, j' <= j); only pairs with (i+1)(j+1) <= N can make the
   top N. That leaves ~N ln N candidates (280 at N=64, 1466 at 256, 3280 at 512),
   listed once per (N, K) on the host. Each candidate is packed into one int64, an
   order-preserving int32 of its float score above its (inverted) candidate number,
   and a bitonic top-k (`_topk`: tl.topk's algorithm, with a reduction the
   interpreter runs in numpy) keeps the N best, sorted.
2. The tree is the top N of the D x N beam entries, ordered by score, ties toward
   the shallower depth and then the better beam rank (as the torch builder's stable
   sort over depth-major scores): the same packing and top-k, with the flat
   index d * N + r under the score. A parent scores at least as high as its child and
   is shallower, so it always comes first.
3. Node k + 1 is the k-th selected entry; its parent is the node of its beam parent
   at depth d - 1 (found through a scratch map entry -> node), the root at depth 1.
   -inf entries (fewer prefixes than the budget) are padding: valid=False, and, as
   in the torch builder, depth 1 under the root (the first beam's -inf entries come
   first among equal scores, and there are always enough of them).
4. Ancestors without a [N+1, N+1] register tile: A[i, k] = the ancestor of node i
   at depth k, written by walking each node's parent chain (D+1 steps); then
   ancestors[i, j] = depth[j] <= depth[i] and A[i, depth[j]] == j, in row x column
   tiles.

Static shapes, no host sync: the launch is CUDA-graph capturable once the candidate
list for (N, K) is cached on the device (the first call, e.g. a warm-up round,
builds it; building it during a capture raises).
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from treeflash.engine.tree import DraftTree
from treeflash.kernels.chained import chained, start_after_previous

MAX_BUDGET = 512
MAX_ENTRIES = 16384   # D * N: the final top-k holds that many int64 in registers
_PAD_KEY = tl.constexpr(-0x7FFFFFFF)  # below the key of -inf (0x807FFFFF): padding never beats a real entry
_ROW_TILE, _COL_TILE = 32, 128  # ancestor matrix tile


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
def _build_tree_kernel(
    vals_ptr, ids_ptr, anchor_ptr, cand_ptr,
    score_ptr, src_ptr, node_ptr, chain_ptr,
    tok_ptr, par_ptr, dep_ptr, valid_ptr, anc_ptr,
    sv_b, sv_d, sv_k, si_b, si_d, si_k, K,
    N: tl.constexpr, D: tl.constexpr, LOG_NP: tl.constexpr, LOG_CP: tl.constexpr, LOG_TP: tl.constexpr,
    MP: tl.constexpr, DP: tl.constexpr, RT: tl.constexpr, CT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Program b builds request b's tree. Scratch (per request): score/src [D*N] the
    beams (float score; parent rank << 16 | column j), node [D*N] beam entry -> node
    index, chain [MP*DP] the ancestor-at-depth table."""
    start_after_previous(PDL)
    M: tl.constexpr = N + 1
    NP: tl.constexpr = 2 ** LOG_NP
    CP: tl.constexpr = 2 ** LOG_CP
    TP: tl.constexpr = 2 ** LOG_TP
    b = tl.program_id(0).to(tl.int64)
    vals = vals_ptr + b * sv_b
    ids = ids_ptr + b * si_b
    score = score_ptr + b * (D * N)
    src = src_ptr + b * (D * N)
    node = node_ptr + b * (D * N)
    chain = chain_ptr + b * (MP * DP)
    tok_out = tok_ptr + b * M
    par_out = par_ptr + b * M
    dep_out = dep_ptr + b * M
    valid_out = valid_ptr + b * M

    # 1. beams. Depth 1: the top-K tokens themselves (-inf past K).
    r = tl.arange(0, NP)
    tl.store(score + r, tl.load(vals + r * sv_k, mask=r < K, other=float("-inf")), mask=r < N)
    tl.store(src + r, r, mask=r < N)
    c = tl.arange(0, CP)
    cand = tl.load(cand_ptr + c)          # i << 16 | j, -1 past the list
    real = cand >= 0
    ci = cand >> 16
    cj = cand & 0xFFFF
    for d in range(1, D):
        tl.debug_barrier()                # beam d-1 stored by other threads
        s = tl.load(score + (d - 1) * N + ci, mask=real, other=float("-inf")) \
            + tl.load(vals + d * sv_d + cj * sv_k, mask=real, other=float("-inf"))
        key = tl.where(real, _score_key(s), _PAD_KEY)
        key, best = _unpack(_topk(_pack(key, c), LOG_CP, LOG_NP))
        tl.store(score + d * N + r, _key_score(key), mask=r < N)
        tl.store(src + d * N + r, tl.load(cand_ptr + best), mask=r < N)

    # 2. the N best beam entries, ties toward shallower depth, then better rank
    f = tl.arange(0, TP)
    tl.store(node + f, 0, mask=f < D * N)  # (a parent outside the tree reads the root)
    tl.debug_barrier()
    fs = tl.load(score + f, mask=f < D * N, other=float("-inf"))
    key = tl.where(f < D * N, _score_key(fs), _PAD_KEY)
    key, flat = _unpack(_topk(_pack(key, f), LOG_TP, LOG_NP))
    k = tl.arange(0, NP)
    sel = k < N
    tl.store(node + flat, k + 1, mask=sel)

    # 3. node k+1: token, depth, parent
    d = flat // N
    entry = tl.load(src + flat, mask=sel, other=0)
    col = entry & 0xFFFF
    tok = tl.load(ids + d * si_d + col * si_k, mask=sel & (col < K), other=0)
    valid = _key_score(key) > float("-inf")
    tl.debug_barrier()                    # node map complete
    parent = tl.load(node + (d - 1) * N + (entry >> 16), mask=sel & valid & (d > 0), other=0)
    tl.store(tok_out + 1 + k, tok, mask=sel)
    tl.store(par_out + 1 + k, parent, mask=sel)
    tl.store(dep_out + 1 + k, tl.where(valid, d + 1, 1), mask=sel)
    tl.store(valid_out + 1 + k, valid.to(tl.uint8), mask=sel)
    tl.store(tok_out, tl.load(anchor_ptr + b))
    tl.store(par_out, 0)
    tl.store(dep_out, 0)
    tl.store(valid_out, 1)

    # 4. ancestors: chain[i, depth of a] = a for every a on i's path to the root
    tl.debug_barrier()                    # parents and depths stored
    i = tl.arange(0, MP)
    live = i < M
    a = i
    for _ in range(D + 1):
        tl.store(chain + i * DP + tl.load(dep_out + a, mask=live, other=0), a, mask=live)
        a = tl.load(par_out + a, mask=live, other=0).to(tl.int32)
    tl.debug_barrier()
    anc = anc_ptr + b * (M * M)
    for r0 in range(0, M, RT):
        rows = r0 + tl.arange(0, RT)
        row_ok = rows < M
        row_dep = tl.load(dep_out + rows, mask=row_ok, other=0)
        for c0 in range(0, M, CT):
            cols = c0 + tl.arange(0, CT)
            col_ok = cols < M
            col_dep = tl.load(dep_out + cols, mask=col_ok, other=0)
            ok = row_ok[:, None] & col_ok[None, :]
            up = ok & (col_dep[None, :] <= row_dep[:, None])
            at = tl.load(chain + rows[:, None] * DP + col_dep[None, :], mask=up, other=-1)
            tl.store(anc + rows[:, None] * M + cols[None, :], (up & (at == cols[None, :])).to(tl.uint8), mask=ok)


def candidate_pairs(budget: int, k: int) -> np.ndarray:
    """The (beam rank i, column j) pairs that can reach a depth's top `budget`:
    (i+1)(j+1) <= budget, j < k; as i << 16 | j, i-major, padded with -1 to a power of
    two (at least `budget` entries, since every (i, 0) is in)."""
    pairs = [(i << 16) | j for i in range(budget) for j in range(min(k, budget // (i + 1)))]
    out = np.full(max(2, triton.next_power_of_2(len(pairs))), -1, dtype=np.int32)
    out[:len(pairs)] = pairs
    return out


def tree_candidates(budget: int, k: int, device: torch.device) -> torch.Tensor:
    """`candidate_pairs` on `device`, for `build_tree_fused`: a host-to-device copy, so
    made before a CUDA graph is captured and kept by the caller (the decoder)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"build_tree_fused: make its candidates (budget {budget}, K {k}) before capturing a "
                           "CUDA graph: they are copied to the device")
    return torch.from_numpy(candidate_pairs(budget, k)).to(device)


def _warps(candidates: int, entries: int) -> int:
    """Warps of the one program: its time is D sequential top-ks over the candidates.
    H200, D = 15, 4 / 8 / 16 warps: N = 32 (256 candidates) 18 / 20 / 23 us; N = 64 (512)
    57 / 43 / 39; N = 128 136 / 94 / 87; N = 256 356 / 306 / 244."""
    return 4 if candidates <= 256 and entries <= 2048 else 16


def build_tree_fused(top_vals: torch.Tensor, top_ids: torch.Tensor, anchor: torch.Tensor,
                     budget: int, candidates: torch.Tensor | None = None) -> DraftTree:
    """`engine.tree.build_tree` in one launch: same arguments (top_vals [B, D, K]
    descending log-probabilities, top_ids [B, D, K], K >= min(budget, V), anchor [B]),
    same tree. Equal scores are broken deterministically (beam: lower (rank, column)
    pair first), not necessarily as torch.topk does. `candidates`: `tree_candidates` of
    (budget, min(budget, K)), made here if not given (not inside a graph capture)."""
    B, D, K = top_vals.shape
    N = budget
    if not 1 <= N <= MAX_BUDGET or D * N > MAX_ENTRIES:
        raise ValueError(f"build_tree_fused: budget {N} x depth {D} is past the kernel's limits "
                         f"(budget <= {MAX_BUDGET}, budget * depth <= {MAX_ENTRIES})")
    K = min(N, K)
    dev = top_vals.device
    top_vals = top_vals.float()
    cand = tree_candidates(N, K, dev) if candidates is None else candidates
    M = N + 1
    NP = max(2, triton.next_power_of_2(N))
    TP = max(2, triton.next_power_of_2(D * N))
    MP = triton.next_power_of_2(M)
    DP = triton.next_power_of_2(D + 1)
    tokens = torch.empty(B, M, dtype=torch.long, device=dev)
    parents = torch.empty(B, M, dtype=torch.long, device=dev)
    depths = torch.empty(B, M, dtype=torch.long, device=dev)
    valid = torch.empty(B, M, dtype=torch.bool, device=dev)
    ancestors = torch.empty(B, M, M, dtype=torch.bool, device=dev)
    score = torch.empty(B, D * N, dtype=torch.float32, device=dev)
    src = torch.empty(B, D * N, dtype=torch.int32, device=dev)
    node = torch.empty(B, D * N, dtype=torch.int32, device=dev)
    chain = torch.empty(B, MP * DP, dtype=torch.int32, device=dev)
    _build_tree_kernel[(B,)](
        top_vals, top_ids, anchor, cand, score, src, node, chain,
        tokens, parents, depths, valid.view(torch.uint8), ancestors.view(torch.uint8),
        *top_vals.stride(), *top_ids.stride(), K,
        N=N, D=D, LOG_NP=NP.bit_length() - 1, LOG_CP=cand.numel().bit_length() - 1,
        LOG_TP=TP.bit_length() - 1, MP=MP, DP=DP,
        RT=_ROW_TILE, CT=_COL_TILE, num_warps=_warps(cand.numel(), TP), **chained(top_vals.device))
    return DraftTree(tokens, parents, depths, ancestors, valid)
