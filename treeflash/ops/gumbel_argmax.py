"""Fused position-keyed sampling: argmax(logits / T + g(seed, p)) in one pass over the
vocabulary, without materializing the [rows, V] noise tensor.

This is what keeps sampling nearly free: the torch reference in
`treeflash.engine.sampling` builds the Gumbel vector with a dozen int64 passes over
[B, N+1, V]; here each program streams its row (or 8192 entries of it) once. The hash
is the same integer function, so the noise matches the reference bit for bit (up to
the last ulp of log).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous
from treeflash.sampling_params import MIN_TEMPERATURE

_MIN_T = tl.constexpr(MIN_TEMPERATURE)  # a global a kernel reads must be a constexpr


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _noise_key(seed_ptr, pos_ptr, row, T):
    """`treeflash.engine.sampling.noise_key` of row b * T + t: the hash of (seed_b,
    position), the same integer function, so the noise is the reference's."""
    seed = tl.load(seed_ptr + row // T)
    s = _mix32(seed & 0xFFFFFFFF) ^ _mix32((seed >> 32) ^ 0x5BD1E995)
    return _mix32((s + tl.load(pos_ptr + row) * 0x9E3779B9) & 0xFFFFFFFF)


@triton.jit
def _gumbel(key, ids):
    """g(seed, p) of global token ids [BLOCK] for a row's key (`_noise_key`):
    `treeflash.engine.sampling.gumbel_noise`'s integer hash, 23-bit uniforms (u < 1, so
    the noise is finite), then -log(-log(u))."""
    h = _mix32(key ^ _mix32((ids * 0x85EBCA6B + 0x27D4EB2F) & 0xFFFFFFFF))
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return -tl.log(-tl.log(u))


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, row_stride, seed_ptr, pos_ptr, temp_ptr, floor_ptr, out_ptr, val_ptr, start,
                          T, V: tl.constexpr, BLOCK: tl.constexpr, SPAN: tl.constexpr, SAMPLED: tl.constexpr,
                          FLOOR: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, chunk): the argmax of ids chunk * SPAN + [0, SPAN) of its row;
    SAMPLED: of logits / max(T, MIN_TEMPERATURE) + noise where T > 0 (FLOOR: only logits >= the row's floor),
    a request's T rows sharing its seed and temperature. Writes (index, value) to slot
    row * chunks + chunk (a chunk of only -inf gives index 0, as a row of them does)."""
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    if SAMPLED:
        key = _noise_key(seed_ptr, pos_ptr, row, T)  # int64 holding the uint32 hash of (seed, position)
        t = tl.load(temp_ptr + row // T)             # float32, 0 = greedy
        greedy = t == 0
        t_safe = tl.where(greedy, 1.0, tl.maximum(t, _MIN_T))  # as the torch path
        if FLOOR:
            floor = tl.load(floor_ptr + row)         # float32: filters keep logits >= it
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.full([BLOCK], 0, tl.int64)
    for i in range(0, SPAN // BLOCK):
        ids = chunk * SPAN + i * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        inside = ids < V
        val = tl.load(logits_ptr + row * row_stride + ids, mask=inside, other=float("-inf")).to(tl.float32)
        if SAMPLED:
            sampled = val / t_safe + _gumbel(key, ids + start)  # the global token id's noise
            if FLOOR:
                sampled = tl.where(val >= floor, sampled, float("-inf"))
            val = tl.where(greedy, val, sampled)
            val = tl.where(inside, val, float("-inf"))
        better = val > best_val  # strict: the first index wins ties, as torch.argmax
        best_val = tl.where(better, val, best_val)
        best_idx = tl.where(better, ids, best_idx)
    m = tl.max(best_val, axis=0)
    cand = tl.where(best_val == m, best_idx, V)
    slot = row * tl.num_programs(1) + chunk
    tl.store(out_ptr + slot, tl.min(cand, axis=0))
    tl.store(val_ptr + slot, m)


@triton.jit
def _chunks_argmax_kernel(idx_ptr, val_ptr, out_ptr, out_val_ptr, CHUNKS: tl.constexpr, CP: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Program row: the best of its chunks' (index, value), the lowest index among
    equal values (chunks are in id order, so this is the first index of the row)."""
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CP)
    ok = c < CHUNKS
    val = tl.load(val_ptr + row * CHUNKS + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * CHUNKS + c, mask=ok, other=0)
    m = tl.max(val, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (val == m), idx, 2 ** 62), axis=0))
    tl.store(out_val_ptr + row, m)


@triton.jit
def _coupled_scores_kernel(x_ptr, seed_ptr, pos_ptr, temp_ptr, out_ptr, start, D, V: tl.constexpr,
                           BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, chunk): x + T * noise of BLOCK ids of row b * D + d up to T = 1 (x
    where T = 0), x / T + noise past it."""
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inside = ids < V
    key = _noise_key(seed_ptr, pos_ptr, row, D)
    t = tl.load(temp_ptr + row // D)
    x = tl.load(x_ptr + row * V + ids, mask=inside, other=0.0)
    g = _gumbel(key, ids + start)  # finite: x + 0 * g is x
    tl.store(out_ptr + row * V + ids, tl.where(t > 1.0, x / tl.maximum(t, 1.0) + g, x + t * g), mask=inside)


def coupled_scores(logits: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor, temperature: torch.Tensor,
                   vocab_start: int = 0) -> torch.Tensor:
    """float32 logits [B, D, V] + T_b g(seed_b, p) for T_b <= 1 (unchanged where T_b ==
    0), logits / T_b + g past it: the coupled drafter's scores (`SpeculativeDecoder`) in
    one pass, where the torch noise took ~240 us at a 152K vocabulary and D = 15 (H200)."""
    B, D, V = logits.shape
    x = logits.contiguous()
    out = torch.empty_like(x)
    block = 2048
    _coupled_scores_kernel[(B * D, triton.cdiv(V, block))](x, seed.contiguous(), positions.contiguous(),
                                                           temperature.float().contiguous(), out, vocab_start, D, V,
                                                           BLOCK=block, **chained(x.device))
    return out


SPAN = 8192  # vocabulary entries per program: a 152K vocabulary is 19 programs per row, not 1


def _argmax_rows(rows: torch.Tensor, sampling: tuple | None = None, start: int = 0,
                 floor: torch.Tensor | None = None):
    """(index [R], value [R]) of the argmax of each row of `rows` [R, V] (see the kernel;
    `sampling`: (seed [B], positions [R], temperature [B], rows per request)). Past one
    SPAN a row is split over programs and a second launch picks the best."""
    R, V = rows.shape
    block = min(1024, triton.next_power_of_2(V))
    chunks = triton.cdiv(V, SPAN)
    span = SPAN if chunks > 1 else triton.cdiv(V, block) * block
    out = torch.empty(R, chunks, dtype=torch.long, device=rows.device)
    val = torch.empty(R, chunks, dtype=torch.float32, device=rows.device)
    seed, pos, temp, T = sampling or (rows, rows, rows, 1)
    _gumbel_argmax_kernel[(R, chunks)](rows, rows.stride(0), seed, pos, temp, temp if floor is None else floor, out,
                                       val, start, T, V, BLOCK=block, SPAN=span, SAMPLED=sampling is not None,
                                       FLOOR=floor is not None, **chained(rows.device))
    if chunks == 1:
        return out.view(R), val.view(R)
    best, best_val = torch.empty(R, dtype=torch.long, device=rows.device), torch.empty(R, device=rows.device)
    _chunks_argmax_kernel[(R,)](out, val, best, best_val, CHUNKS=chunks, CP=triton.next_power_of_2(chunks),
                                num_warps=1, **chained(out.device))
    return best, best_val


def gumbel_argmax(logits: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor,
                  temperature: torch.Tensor, vocab_start: int = 0, with_values: bool = False,
                  floor: torch.Tensor | None = None):
    """Tokens [B, T] = argmax(logits / T_b + g(seed_b, p)) (plain argmax where T_b == 0)
    for logits [B, T, V] on CUDA, positions [B, T], seed/temperature [B]; with `floor`
    [B, T] (float32, `filter_floor`) only among logits >= it.

    `logits` may be a vocabulary slice starting at id `vocab_start` (tensor parallelism):
    the noise is that of the global ids, the returned indices are local, and with
    `with_values` the winning (float32) values come too, for the cross-rank pick."""
    B, T, V = logits.shape
    rows = logits.reshape(B * T, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if floor is not None:
        floor = floor.float().reshape(-1).contiguous()
    sampling = (seed.contiguous(), positions.reshape(-1).contiguous(), temperature.float().contiguous(), T)
    out, val = _argmax_rows(rows, sampling, vocab_start, floor=floor)
    return (val.view(B, T), out.view(B, T)) if with_values else out.view(B, T)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of a CUDA tensor [..., V] (first index among equal maxima), one
    program per row (per 8192 entries past that). NaN never wins here (torch.argmax
    would pick it)."""
    *lead, V = x.shape
    rows = x.reshape(-1, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return _argmax_rows(rows)[0].view(lead)
