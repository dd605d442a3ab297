"""Structured outputs' per-round steps in one launch each (torch references:
`SamplingBatch.node_states`, `SamplingBatch.path_states` and `grammar_masked`).

The two walks follow a chain of states depth by depth: in torch each depth is ~5-8
small kernels, and a round of a 16-token block ran ~200 of them (built-in pair on an
H200: a DFlash round 0.39 -> 1.06 ms). Here one program per request walks the chain.
The mask writes -inf in place instead of gathering the rows' table rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous


@triton.jit
def _node_states_kernel(table_ptr, V, root_ptr, tokens_ptr, parents_ptr, depths_ptr, out_ptr, T,
                        MAX_DEPTH: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):
    """Program b: out[b, t] = table[out[b, parent], token] (row 0 where not allowed),
    level by level from the root's state; a level reads what the last one stored."""
    start_after_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    inside = t < T
    tokens = tl.load(tokens_ptr + b * T + t, mask=inside, other=0)
    parents = tl.load(parents_ptr + b * T + t, mask=inside, other=0)
    depths = tl.load(depths_ptr + b * T + t, mask=inside, other=0)
    root = tl.load(root_ptr + b)
    tl.store(out_ptr + b * T + t, tl.zeros([BLOCK_T], tl.int64) + root, mask=inside)
    for d in range(1, MAX_DEPTH + 1):
        tl.debug_barrier()  # the last level's stores, visible to every thread of the program
        level = inside & (depths == d)
        above = tl.load(out_ptr + b * T + parents, mask=level, other=0)
        nxt = tl.load(table_ptr + above * V + tokens, mask=level, other=0)
        tl.store(out_ptr + b * T + t, tl.maximum(nxt, 0).to(tl.int64), mask=level)


def node_states(table: torch.Tensor, root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                depths: torch.Tensor, max_depth: int) -> torch.Tensor:
    B, T = tokens.shape
    out = torch.empty(B, T, dtype=torch.long, device=tokens.device)
    _node_states_kernel[(B,)](table, table.shape[1], root, tokens.contiguous(), parents.contiguous(),
                              depths.contiguous(), out, T, MAX_DEPTH=max_depth,
                              BLOCK_T=max(16, triton.next_power_of_2(T)), **chained(table.device))
    return out


@triton.jit
def _path_states_kernel(table_ptr, V, root_ptr, cand_ptr, out_ptr, D, K: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Program b: for each depth, the state before it, then the first of the depth's K
    candidates the state allows (else the first) moves it on."""
    start_after_previous(PDL)
    b = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    state = tl.load(root_ptr + b)
    for d in range(D):
        tl.store(out_ptr + b * D + d, state)
        cand = tl.load(cand_ptr + (b * D + d) * K + k, mask=k < K, other=0)
        allowed = tl.load(table_ptr + state * V + cand, mask=k < K, other=-1) >= 0
        first = tl.min(tl.where(allowed, k, K), axis=0) % K
        token = tl.sum(tl.where(k == first, cand, 0), axis=0)
        state = tl.maximum(tl.load(table_ptr + state * V + token), 0).to(tl.int64)


def path_states(table: torch.Tensor, root: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    B, D, K = candidates.shape
    out = torch.empty(B, D, dtype=torch.long, device=candidates.device)
    _path_states_kernel[(B,)](table, table.shape[1], root, candidates.contiguous(), out, D, K=K,
                              BLOCK_K=max(16, triton.next_power_of_2(K)), **chained(table.device))
    return out


@triton.jit
def _grammar_mask_kernel(x_ptr, table_ptr, states_ptr, V, start, C, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, block): x[row, c] = -inf where table[state of the row, start + c] < 0."""
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < C
    state = tl.load(states_ptr + row)
    allowed = tl.load(table_ptr + state * V + start + cols, mask=inside, other=0) >= 0
    x = tl.load(x_ptr + row * C + cols, mask=inside)
    tl.store(x_ptr + row * C + cols, tl.where(allowed, x, float("-inf")), mask=inside)


def grammar_mask_(x: torch.Tensor, table: torch.Tensor, states: torch.Tensor, start: int) -> torch.Tensor:
    """x [B, R, C] (contiguous; vocabulary ids start..start + C) masked in place where each
    row's state (states [B, R]) allows no token: no [B, R, C] table rows gathered (at 32
    requests of 65 rows and 152K tokens, 1.3 GB a round)."""
    B, R, C = x.shape
    BLOCK = 2048
    _grammar_mask_kernel[(B * R, triton.cdiv(C, BLOCK))](x, table, states.contiguous(), table.shape[1], start, C,
                                                         BLOCK=BLOCK, **chained(x.device))
    return x
