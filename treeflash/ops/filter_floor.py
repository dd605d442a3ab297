"""The sampling filters' floor (`treeflash.engine.sampling.filter_floor`) on the GPU, in a
few launches and without sorting the vocabulary.

From a row's W largest logits (`ops.topk`: fused up to 64 of a 152K vocabulary), one
program per row computes min-p's and top-k's floor and, over the window, top-p's cut:
~20 small torch launches become one. Top-p needs the mass of every kept token, ties with the k-th
past the window included: one pass over the row sums it.

A top-p without top-k may reach past the window. Sorting 152K logits for it cost ~17 us
a row (1.1 ms for a verify of 63 nodes), so those rows search instead. The cut is the
largest logit v whose mass at or above it, C(v), reaches p x the total; C falls as v
rises, so it is found 2 bits at a time on an order-preserving integer key of the logits
(16 bits for bf16, 32 for float32): a pass sums the candidates' mass into 4 bins by the
next digit of the key's distance from the row's largest logit, and keeps the bin where C
crosses the target. Bins hold only integer-keyed groups, so the last pass leaves one
logit, the exact cut. Rows whose cut lies among their 16 largest logits (most rows of a
trained model at T <= 1) take it from the window; they and other rows do no work in those
passes. Tokens more than 40 T below the top are left out of the search: their mass is
below e^-40 each, and p < 1 in float32 is at most 1 - 6e-8, so the cut never reaches
them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.distributed import TPGroup
from treeflash.kernels.chained import chained, start_after_previous
from treeflash.sampling_params import MIN_TEMPERATURE

_MIN_T = tl.constexpr(MIN_TEMPERATURE)  # a global a kernel reads must be a constexpr

SPAN = 2048   # vocabulary entries per program of a pass over the row (75 for a 152K vocabulary)
BLOCK = 256   # of them at a time
SEARCH_BELOW_TOP = tl.constexpr(40.0)  # nats (at T) below the top past which no token can be the cut


@triton.jit
def _pre_floor(vals_ptr, row, W, b, temp_ptr, topk_ptr, minp_ptr):
    """(the row's largest logit, T clamped as the torch path does, min-p's and top-k's
    floor) from the window `vals` [R, W] (sorted, largest first)."""
    t = tl.maximum(tl.load(temp_ptr + b), _MIN_T)
    top = tl.load(vals_ptr + row * W).to(tl.float32)
    k = tl.minimum(tl.maximum(tl.load(topk_ptr + b), 0), W)
    kth = tl.load(vals_ptr + row * W + tl.maximum(k - 1, 0)).to(tl.float32)
    kth = tl.where(k > 0, kth, float("-inf"))
    return top, t, tl.maximum(kth, top + t * tl.log(tl.load(minp_ptr + b)))


@triton.jit
def _row_mass_kernel(x_ptr, sx, vals_ptr, W, temp_ptr, topk_ptr, minp_ptr, out_ptr, T, V,
                     BLOCK: tl.constexpr, SPAN: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, chunk): sum of exp((x - top) / T) over the chunk's logits x at or
    above the row's min-p / top-k floor."""
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    top, t, floor = _pre_floor(vals_ptr, row, W, row // T, temp_ptr, topk_ptr, minp_ptr)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, SPAN // BLOCK):
        ids = chunk * SPAN + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * sx + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
        acc += tl.where(x >= floor, tl.exp((x - top) / t), 0.0)
    tl.store(out_ptr + row * tl.num_programs(1) + chunk, tl.sum(acc, 0))


@triton.jit
def _floor_kernel(vals_ptr, W, temp_ptr, topk_ptr, topp_ptr, minp_ptr, mass_ptr, CH, floor_ptr, lo_ptr, target_ptr,
                  active_ptr, T, CHP: tl.constexpr, TOP_P: tl.constexpr, OPEN: tl.constexpr,
                  TILE: tl.constexpr = 16, PDL: tl.constexpr = False):
    """Program row: its floor from the window, as the torch path computes it (module
    doc). Top-p's prefix sums run over tiles of TILE values, each carrying the sum before
    it, until they pass p (not at all where p = 1): the same additions whatever the
    window's width, so a row's floor does not depend on the width its batch chose. OPEN:
    also the search's bounds for the rows of a top-p without top-k whose cut is past the
    first tile (active): any window holds that tile, so whether a row searches does not
    depend on its batch either."""
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    top, t, floor = _pre_floor(vals_ptr, row, W, b, temp_ptr, topk_ptr, minp_ptr)
    if TOP_P:
        p = tl.load(topp_ptr + b)
        c = tl.arange(0, CHP)
        total = tl.sum(tl.load(mass_ptr + row * CH + c, mask=c < CH, other=0.0), 0)
        before = tl.zeros([], tl.float32)
        first = tl.zeros([], tl.float32)  # the mass of the first tile
        cut = tl.full([], float("inf"), tl.float32)
        j = tl.zeros([], tl.int32)
        while (j < W) & ((before < p) | (j == 0)) & (p < 1):  # tile 0 even at a p of 0 in float32: its top stays
            w = j + tl.arange(0, TILE)
            vals = tl.load(vals_ptr + row * W + w, mask=w < W, other=float("-inf")).to(tl.float32)
            kept = (vals >= floor) & (w < W)
            probs = tl.where(kept, tl.exp((vals - top) / t), 0.0) / total
            nucleus = (kept & (before + (tl.cumsum(probs, 0) - probs) < p)) | (w == 0)
            cut = tl.minimum(cut, tl.min(tl.where(nucleus, vals, float("inf")), 0))
            before += tl.sum(probs, 0)
            first = tl.where(j == 0, before, first)
            j += TILE
        if OPEN:  # the cut is past the first tile: search
            active = ((tl.load(topk_ptr + b) <= 0) & (first < p) & (p < 1)
                      & (tl.load(temp_ptr + b) > 0))
            tl.store(lo_ptr + row, tl.maximum(floor, top - SEARCH_BELOW_TOP * t))
            tl.store(target_ptr + row, p * total)
            tl.store(active_ptr + row, active.to(tl.int32))
        floor = tl.where(p < 1, cut, floor)
    tl.store(floor_ptr + row, floor)


@triton.jit
def _key(x, BITS: tl.constexpr):
    """Order-preserving integer key of float32 values x: of their top BITS bits (exact
    for bf16 values at 16), in [0, 2^BITS); int32 at 16 bits, int64 at 32."""
    H: tl.constexpr = 1 << (BITS - 1)
    b = x.to(tl.int32, bitcast=True) >> (32 - BITS)
    if BITS == 32:
        b = b.to(tl.int64)
    return tl.where(b >= 0, b + H, H - 1 - (b & (H - 1)))


@triton.jit
def _value(key, BITS: tl.constexpr):
    """The float32 value of a `_key`."""
    H: tl.constexpr = 1 << (BITS - 1)
    b = tl.where(key >= H, key - H, -1 - key)
    return (b.to(tl.int32) << (32 - BITS)).to(tl.float32, bitcast=True)


@triton.jit
def _choose(hist, prefix, above, target):
    """The next state of a row's search from its bins' masses [4] (by digit of the
    distance from the top: small digits hold large logits): the first digit where the
    mass above plus the bins so far reaches the target. If float rounding leaves every
    digit short, the last non-empty one (the cut takes the whole group)."""
    bins = tl.arange(0, 4)
    upto = tl.sum(tl.where(bins[None, :] <= bins[:, None], hist[None, :], 0.0), 1)
    first = tl.min(tl.where(above + upto >= target, bins, 4), 0)
    last = tl.max(tl.where(hist > 0, bins, 0), 0)
    d = tl.where(first < 4, first, last)
    return prefix * 4 + d, above + tl.sum(tl.where(bins < d, hist, 0.0), 0)


@triton.jit
def _search_kernel(x_ptr, sx, vals_ptr, W, temp_ptr, lo_ptr, target_ptr, active_ptr, hist_in_ptr, CH, hist_ptr,
                   prefix_ptr, above_ptr, floor_ptr, R, T, V, LEVEL: tl.constexpr, BITS: tl.constexpr,
                   CHP: tl.constexpr, BLOCK: tl.constexpr, SPAN: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, chunk) of pass LEVEL: the row's state (digits so far, mass above
    their group) from the previous pass's bins, then the mass of its chunk's logits in
    that group by their next 2-bit digit, in four running sums (a [BLOCK, bins] one-hot
    was ~10x slower). The pass after the last (LEVEL = BITS / 2, one program a row)
    writes the cut to the floor of the active rows."""
    start_after_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    active = tl.load(active_ptr + row) != 0
    top = tl.load(vals_ptr + row * W).to(tl.float32)
    ktop = _key(tl.where(top == 0, 0.0, top), BITS)  # -0.0 keys below +0.0: the search takes both as +0.0
    prefix = tl.zeros([], tl.int64).to(ktop.dtype)
    above = tl.zeros([], tl.float32)
    bins = tl.arange(0, 4)
    if LEVEL > 0:
        prefix = tl.load(prefix_ptr + (LEVEL - 1) * R + row).to(ktop.dtype)
        above = tl.load(above_ptr + (LEVEL - 1) * R + row)
        c = tl.arange(0, CHP)
        hist = tl.sum(tl.load(hist_in_ptr + (row * CH + c[:, None]) * 4 + bins[None, :],
                              mask=(c[:, None] < CH) & active, other=0.0), 0)
        prefix, above = _choose(hist, prefix, above, tl.load(target_ptr + row))
    if LEVEL == BITS // 2:
        tl.store(floor_ptr + row, _value(ktop - prefix, BITS), mask=active)
    else:
        tl.store(prefix_ptr + LEVEL * R + row, prefix, mask=chunk == 0)
        tl.store(above_ptr + LEVEL * R + row, above, mask=chunk == 0)
        shift: tl.constexpr = BITS - 2 * (LEVEL + 1)
        t = tl.maximum(tl.load(temp_ptr + row // T), _MIN_T)
        lo = tl.load(lo_ptr + row)
        m0 = tl.zeros([BLOCK], tl.float32)
        m1 = tl.zeros([BLOCK], tl.float32)
        m2 = tl.zeros([BLOCK], tl.float32)
        m3 = tl.zeros([BLOCK], tl.float32)
        for i in range(0, tl.where(active, SPAN // BLOCK, 0)):
            ids = chunk * SPAN + i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * sx + ids, mask=ids < V, other=float("-inf")).to(tl.float32)
            off = ktop - _key(tl.where(x == 0, 0.0, x), BITS)
            e = tl.where((x >= lo) & ((off >> (shift + 2)) == prefix), tl.exp((x - top) / t), 0.0)
            digit = (off >> shift) & 3
            m0 += tl.where(digit == 0, e, 0.0)
            m1 += tl.where(digit == 1, e, 0.0)
            m2 += tl.where(digit == 2, e, 0.0)
            m3 += tl.where(digit == 3, e, 0.0)
        sums = tl.where(bins == 0, tl.sum(m0, 0), tl.where(bins == 1, tl.sum(m1, 0),
                                                           tl.where(bins == 2, tl.sum(m2, 0), tl.sum(m3, 0))))
        tl.store(hist_ptr + (row * tl.num_programs(1) + chunk) * 4 + bins, sums)


def filter_floor(x: torch.Tensor, vals: torch.Tensor, sb, tp: TPGroup = TPGroup()) -> torch.Tensor:
    """`treeflash.engine.sampling.filter_floor` [B, T] (float32) of CUDA logits x [B, T, V]
    (this rank's slice) from `vals` [B, T, W], the W = sb.filter_width largest logits of
    each whole row (fewer in a smaller vocabulary; all of it where the width is 0),
    largest first."""
    B, T, V = x.shape
    R, W = B * T, vals.shape[-1]
    rows = x.reshape(R, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    vals = vals.reshape(R, W).contiguous()
    temp, topk, topp, minp = (sb.temperature.float().contiguous(), sb.top_k.contiguous(),
                              sb.top_p.float().contiguous(), sb.min_p.float().contiguous())
    launch = chained(x.device)
    floor = torch.empty(R, device=x.device)
    mass, CH = floor, 1
    if sb.any_top_p:
        CH = triton.cdiv(V, SPAN)
        mass = torch.empty(R, CH, device=x.device)
        _row_mass_kernel[(R, CH)](rows, rows.stride(0), vals, W, temp, topk, minp, mass, T, V,
                                  BLOCK=BLOCK, SPAN=SPAN, **launch)
        if tp.size > 1:
            mass, CH = tp.all_reduce(mass.sum(1, keepdim=True).contiguous()), 1
    search = sb.any_open_top_p  # implies any_top_p: the mass is summed above
    lo, target = (torch.empty(R, device=x.device) for _ in range(2)) if search else (floor, floor)
    active = torch.empty(R, dtype=torch.int32, device=x.device) if search else floor
    _floor_kernel[(R,)](vals, W, temp, topk, topp, minp, mass, CH, floor, lo, target, active, T,
                        CHP=triton.next_power_of_2(CH), TOP_P=sb.any_top_p, OPEN=search, num_warps=1, **launch)
    if search:
        _search(rows, vals, temp, lo, target, active, floor, T, tp)
    return floor.view(B, T)


def _search(rows, vals, temp, lo, target, active, floor, T, tp: TPGroup) -> None:
    """The passes of the cut's search (module doc) for the active rows, into `floor`."""
    R, V = rows.shape
    bits = 16 if rows.dtype == torch.bfloat16 else 32
    levels, chunks = bits // 2, triton.cdiv(V, SPAN)
    hist = torch.empty(levels, R, chunks, 4, device=rows.device)
    prefix = torch.empty(levels, R, dtype=torch.long, device=rows.device)
    above = torch.empty(levels, R, device=rows.device)
    hist_in, CH = hist[0], chunks
    for level in range(levels + 1):
        grid = (R, 1 if level == levels else chunks)
        _search_kernel[grid](rows, rows.stride(0), vals, vals.shape[-1], temp, lo, target, active, hist_in, CH,
                             hist[min(level, levels - 1)], prefix, above, floor, R, T, V, LEVEL=level, BITS=bits,
                             CHP=triton.next_power_of_2(CH), BLOCK=BLOCK, SPAN=SPAN, **chained(rows.device))
        if level < levels:
            hist_in = hist[level]
            if tp.size > 1:
                hist_in, CH = tp.all_reduce(hist_in.sum(1, keepdim=True).contiguous()), 1
