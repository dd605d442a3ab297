"""Triton attention for a block of new tokens over a KV cache (tree verify, AR decode,
drafter block), with exactly the semantics of `layers.attention.sdpa_attention`.

Why it is split in three (the verify reads the shared context once for all tree nodes):

(a) The committed prefix has no mask, so every block query of request b sees the same
    keys. One program takes ALL T block queries x the whole GQA group of one KV head
    (T*G "rows") against one split of the prefix ("flash decoding"). The rows are
    tiled inside the program and the row tiles run back to back over the same small
    KV chunk, so the chunk comes from HBM once and the later row tiles hit L2: the
    prefix is read once per round however large the tree. For T*G <= 128 there is a
    single row tile and the chunk is loaded once, period.
(b) The T x T block, read at slots prefix_lens[b] + j with the block mask (ancestors,
    causal or all-true), has programs of its own while T * G fits one row tile (128
    rows; 64 in fp32), which run beside the prefix programs (the last prefix chunk would
    otherwise wait for it: T = 1 at 4K 11.1 vs 11.9 us). Past that the kernel is
    compute-bound and fills the SMs in whole waves, so the last prefix split takes the
    block after its chunk (T = 256 at 4K: 192 -> 128 programs, 72.6 -> 52.9 us), the
    splits sharing prefix and block keys evenly, a masked block key weighing two prefix
    keys (its chunk is shorter by twice the block: H100, T = 64 at 4K 22.0 -> 18.6 us,
    T = 256 51.9 -> 47.5 in two steps, BENCHMARKS.md 41-42). So does it where a place in the
    wave for the block programs would cost one of only 1-3 splits per (request, KV
    head): 8 requests decoding at 4K (8B shape) took 7.29 ms a step with 1 split and a
    block program per (request, head), 5.92 ms with 2 splits, the second taking the
    block. Past one row tile, where the block's key tiles can each have programs of
    their own (one per row tile) in the prefix splits' wave, they do: then no program
    walks the whole block after its prefix chunk (the built-in pair's trees of 64-256
    nodes: the 257-row call 20.9 -> 9.0 us on an H100; the 8B shape's verify would need
    a second wave). A single new token (decoding) whose block program would cost a
    split needs no masked pass: its block is its own key, right after the prefix, which
    the last split adds from loads issued before its prefix loop (4 requests at 4K: the
    wave streams the prefix with 4 splits instead of 3 and 32 one-key programs; the 8B
    step of 4 requests 1.3% faster at 4K, 4.9% at 16K).
(c) A second kernel merges the partial results of all splits by log-sum-exp (none where
    one part holds all keys, as for 16 requests decoding: it writes the output). A split
    with no keys writes lse = -inf (and no o), so the merge needs no prefix length:
    its loads issue as soon as it starts, not after a dependent load of prefix_lens.

gpt-oss (both per layer, `sinks` and `window` of `sdpa_attention`): a sink is one more
term of each row's denominator, added once where all parts meet, in the merge. A
sliding window masks keys at positions <= p - window in every tile (rows differ in
position: tree depths); as block tokens come after the prefix (positions >= L), no row
sees a prefix slot below L - window + 1, and the splits share only [L - window + 1, L).

Static shapes for CUDA graphs: the grid and the number of splits depend only on the
tensor shapes (and the SM count); each split's key range is computed on the device
from prefix_lens, so the work is spread over all splits whatever the actual length,
and splits past the end do nothing.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous, wait_for_previous
from treeflash.layers.attention import AttentionInputs

@triton.jit
def _split_range(lo, L, split, num_splits, last_extra, BLOCK_N: tl.constexpr):
    """Prefix slots [start, end) of `split` when slots lo..L-1 are shared by num_splits
    splits in whole tiles, the last of which also has `last_extra` keys' worth of work of
    its own (the block) and so fewer of the prefix; an empty range when the split lies past L."""
    chunk = tl.cdiv(tl.cdiv(L - lo + last_extra, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    return start, tl.minimum(start + chunk, L)


@triton.jit
def _key_tile(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base, sm_i, first, j0, n_keys, qk_scale,
              pos_base, sp_t, row_pos, window, m, l, acc,
              D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, FP32_DOT: tl.constexpr,
              WINDOW: tl.constexpr, EVICTION: tl.constexpr, FULL: tl.constexpr):
    """One step of the online softmax (see `_attend`): keys first + j0 .. j0 + BLOCK_N - 1.
    FULL: all BLOCK_N keys exist (no bounds masks)."""
    offs_d = tl.arange(0, D)
    j = j0 + tl.arange(0, BLOCK_N)
    key_ok = j < n_keys
    slots = first + j
    if FULL:
        k = tl.load(k_base + slots[:, None] * sk_s + offs_d[None, :], eviction_policy=EVICTION)
        v = tl.load(v_base + slots[:, None] * sv_s + offs_d[None, :], eviction_policy=EVICTION)
    else:
        k = tl.load(k_base + slots[:, None] * sk_s + offs_d[None, :], mask=key_ok[:, None], other=0.0,
                    eviction_policy=EVICTION)
        v = tl.load(v_base + slots[:, None] * sv_s + offs_d[None, :], mask=key_ok[:, None], other=0.0,
                    eviction_policy=EVICTION)
    if FP32_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="tf32x3")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED or WINDOW:  # a row may see no key of the tile
        if MASKED:
            ok = row_ok[:, None] & key_ok[None, :]
            allowed = tl.load(mask_base + tok[:, None] * sm_i + j[None, :], mask=ok, other=0) != 0
        else:
            allowed = key_ok[None, :]
        if WINDOW:
            if MASKED:
                key_pos = tl.load(pos_base + j * sp_t, mask=key_ok, other=0).to(tl.int32)
            else:
                key_pos = slots
            allowed = allowed & (key_pos[None, :] > row_pos[:, None] - window)
        s = tl.where(allowed, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key so far
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m - m_ref)
    else:  # every row sees the tile's first key, so m_new is finite; the scale joins the exponent's FMA
        if not FULL:
            s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FP32_DOT:
        acc = tl.dot(p, v, acc, input_precision="tf32x3")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return m_new, l, acc


@triton.jit
def _attend(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base, sm_i, first, n_keys, qk_scale,
            pos_base, sp_t, row_pos, window,
            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            MASKED: tl.constexpr, FP32_DOT: tl.constexpr, WINDOW: tl.constexpr, EVICTION: tl.constexpr):
    """Online softmax of one row tile over slots first + 0..n_keys-1. MASKED: the
    block, where row token `tok` sees key j only if block_mask[tok, j]. EVICTION: the
    L2 policy of the K/V loads ("evict_first" for tiles no other program reads). WINDOW: a row at
    position row_pos sees only keys at positions > row_pos - window (a prefix key's
    position is its slot, block key j's is pos_base[j * sp_t]). Whole tiles run without
    bounds masks, the last partial one after them. Returns (o, lse), lse in base 2; a
    row that saw no key gets o = 0, lse = -inf."""
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    full = tl.maximum(n_keys, 0) // BLOCK_N * BLOCK_N  # a split past the prefix has n_keys < 0
    for j0 in range(0, full, BLOCK_N):
        m, l, acc = _key_tile(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base, sm_i, first, j0, n_keys,
                              qk_scale, pos_base, sp_t, row_pos, window, m, l, acc,
                              D, BLOCK_N, MASKED, FP32_DOT, WINDOW, EVICTION, True)
    if full < n_keys:
        m, l, acc = _key_tile(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base, sm_i, first, full, n_keys,
                              qk_scale, pos_base, sp_t, row_pos, window, m, l, acc,
                              D, BLOCK_N, MASKED, FP32_DOT, WINDOW, EVICTION, False)
    return acc / tl.where(l > 0, l, 1.0)[:, None], m + tl.log2(l)


@triton.jit
def _combine(o, lse, o2, lse2):
    """Two normalised partials (o, lse in base 2) of the same rows as one; a side with
    lse = -inf (no key) has weight 0."""
    m = tl.maximum(lse, lse2)
    m = tl.where(m == float("-inf"), 0.0, m)
    w, w2 = tl.exp2(lse - m), tl.exp2(lse2 - m)
    return (o * w[:, None] + o2 * w2[:, None]) / tl.where(w + w2 > 0, w + w2, 1.0)[:, None], m + tl.log2(w + w2)


@triton.jit
def _store_output(out_ptr, o, b, kvh, rows, row_ok, offs_d, HKV: tl.constexpr, G: tl.constexpr, T: tl.constexpr,
                  D: tl.constexpr):
    """o [rows, D] of KV head kvh of request b into the output [B, T, H, D]: row r is
    token r // G, query head kvh * G + r % G."""
    out_rows = (b * T + rows // G).to(tl.int64) * (HKV * G) + kvh * G + rows % G
    tl.store(out_ptr + out_rows[:, None] * D + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _partial_attention(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, lse_ptr, prefix_ptr, pos_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_i, sp_b, sp_t,
    qk_scale, num_splits, block_split, row_programs, window,
    HKV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_N_TREE: tl.constexpr, FP32_DOT: tl.constexpr, WINDOW: tl.constexpr, PREFIX_EVICTION: tl.constexpr,
    OWN_KEY: tl.constexpr, BLOCK_CHUNKS: tl.constexpr, DIRECT: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (b * HKV + kv head, split, row program): the T*G rows of that KV head
    (row tiles row_program, row_program + row programs, ...) against one key range,
    written as normalised partials o [rows, D] and lse [rows].

    Row r is block token r // G, query head kvh * G + r % G: consecutive rows are
    consecutive heads of one token, so q loads are contiguous. Splits 0..num_splits-1
    are prefix chunks (no mask); split `block_split` (num_splits: a block-only program,
    or num_splits - 1) also attends the block with its mask, one partial for both.
    OWN_KEY (T = 1, block_split = -1): the last split adds the token's own key (slot L,
    if its mask entry lets it see itself; always inside its window) after its prefix.
    WINDOW: the prefix chunks cover only the slots some row can see (module doc).
    BLOCK_CHUNKS: splits num_splits, num_splits + 1, ... attend one BLOCK_N_TREE-key chunk
    of the block each, no prefix (block_split = -1).
    DIRECT (one part, no sinks): o is the output [B, T, H, D] itself and there is no
    merge, so this kernel, like the merge, lets the next one launch only when it is done.
    """
    if DIRECT:
        wait_for_previous(PDL)
    else:
        start_after_previous(PDL)
    ROWS: tl.constexpr = T * G
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    row_program = tl.program_id(2)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    L = tl.load(prefix_ptr + b).to(tl.int32)

    lo = 0
    if WINDOW:
        lo = tl.maximum(L - window + 1, 0)
    # The block's keys even out the splits. A masked key costs about two of the prefix (the
    # mask's load and select): H100, 8B layer at T = 256, 4K 49.1 -> 47.5 us, 1K 23.5 -> 22.0.
    last_extra = 2 * T if block_split == num_splits - 1 else 0
    start, end = _split_range(lo, L, split, num_splits, last_extra, BLOCK_N)
    with_block = split == block_split  # split num_splits has no prefix: start >= L
    chunk0, chunk_keys = 0, T
    if BLOCK_CHUNKS:
        with_block = split >= num_splits
        chunk0 = (split - num_splits) * BLOCK_N_TREE
        chunk_keys = tl.minimum(T - chunk0, BLOCK_N_TREE)
    own_key = OWN_KEY & (split == num_splits - 1)
    ran = (start < end) | with_block | own_key

    offs_d = tl.arange(0, D)
    b64 = b.to(tl.int64)  # a whole cache can pass 2^31 elements
    q_base = q_ptr + b64 * sq_b + kvh * G * sq_h
    k_base = k_ptr + b64 * sk_b + kvh.to(tl.int64) * sk_h
    v_base = v_ptr + b64 * sv_b + kvh.to(tl.int64) * sv_h
    mask_base = mask_ptr + b * sm_b
    pos_base = pos_ptr + b * sp_b
    if OWN_KEY:  # in flight while the prefix streams, so the last split ends no later
        own_ok = own_key & (tl.load(mask_base, mask=own_key, other=0) != 0)
        k_own = tl.load(k_base + L * sk_s + offs_d, mask=own_key, other=0.0)
        v_own = tl.load(v_base + L * sv_s + offs_d, mask=own_key, other=0.0)
    part = (pid_bh * tl.num_programs(1) + split).to(tl.int64)  # parts x rows x D can pass 2^31
    # Row tiles back to back over the same key range: after the first, it is in L2.
    for row0 in range(row_program * BLOCK_M, ROWS, row_programs * BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < ROWS
        tok = rows // G
        if ran:
            q = tl.load(q_base + tok[:, None] * sq_t + (rows % G)[:, None] * sq_h + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0)
            row_pos = 0
            if WINDOW:
                row_pos = tl.load(pos_base + tok * sp_t, mask=row_ok, other=0).to(tl.int32)
            o, lse = _attend(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base, sm_i, start, end - start,
                             qk_scale, pos_base, sp_t, row_pos, window, D, BLOCK_M, BLOCK_N, False, FP32_DOT, WINDOW,
                             PREFIX_EVICTION)
            if with_block:
                o_blk, lse_blk = _attend(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base + chunk0, sm_i,
                                         L + chunk0, chunk_keys, qk_scale, pos_base + chunk0 * sp_t, sp_t, row_pos,
                                         window, D, BLOCK_M, BLOCK_N_TREE, True, FP32_DOT, WINDOW, "")
                o, lse = _combine(o, lse, o_blk, lse_blk)
            if OWN_KEY:
                s_own = tl.sum(q.to(tl.float32) * k_own.to(tl.float32)[None, :], 1) * qk_scale
                o, lse = _combine(o, lse, v_own.to(tl.float32)[None, :], tl.where(own_ok, s_own, float("-inf")))
        else:  # an empty split: lse = -inf tells the merge to skip its (unwritten) o
            o = tl.zeros([BLOCK_M, D], tl.float32)
            lse = tl.full([BLOCK_M], float("-inf"), tl.float32)
        if DIRECT:
            _store_output(o_ptr, o, b, kvh, rows, row_ok, offs_d, HKV, G, T, D)
        else:
            if ran:
                tl.store(o_ptr + (part * ROWS + rows)[:, None] * D + offs_d[None, :],
                         o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.store(lse_ptr + part * ROWS + rows, lse, mask=row_ok)


@triton.jit
def _merge(o_ptr, lse_ptr, out_ptr, sinks_ptr, parts,
           HKV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
           R: tl.constexpr, CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (b * HKV + kv head, block of R rows): out = sum_s 2^(lse_s - M) o_s /
    sum_s 2^(lse_s - M) over the parts, CHUNK at a time (one chunk for up to CHUNK
    parts: all loads in flight at once). A part with lse = -inf did not run and its o
    is whatever the buffer held (NaN included): it gets weight 0 and is never added.
    HAS_SINKS: the head's sink is one more part, of lse sinks[head] (natural log) and
    o = 0. A row that saw no key and has no sink gets 0, as SDPA gives it.
    out is [B, T, H, D] contiguous. It lets the next kernel launch only when it is done:
    it runs beside the prefix pass (kernels/chained.py)."""
    wait_for_previous(PDL)
    ROWS: tl.constexpr = T * G
    BLOCKS: tl.constexpr = (ROWS + R - 1) // R
    pid = tl.program_id(0)
    bh = pid // BLOCKS
    b = bh // HKV
    kvh = bh % HKV
    rows = (pid % BLOCKS) * R + tl.arange(0, R)
    row_ok = rows < ROWS

    offs_d = tl.arange(0, D)
    head = kvh * G + rows % G
    if HAS_SINKS:
        m = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        den = tl.full([R], 1.0, tl.float32)
    else:
        m = tl.full([R], float("-inf"), tl.float32)
        den = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, D], tl.float32)
    for s0 in range(0, parts, CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        ok = (s < parts)[:, None] & row_ok[None, :]
        part_rows = (bh * parts + s).to(tl.int64)[:, None] * ROWS + rows[None, :]  # [CHUNK, R]
        lse = tl.load(lse_ptr + part_rows, mask=ok, other=float("-inf"))
        o = tl.load(o_ptr + part_rows[:, :, None] * D + offs_d[None, None, :], mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(lse - m_ref[None, :])
        alpha = tl.exp2(m - m_ref)
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(tl.where(w[:, :, None] > 0, o * w[:, :, None], 0.0), 0)
        m = m_new
    den = tl.where(den > 0, den, 1.0)
    _store_output(out_ptr, acc / den[:, None], b, kvh, rows, row_ok, offs_d, HKV, G, T, D)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: behave like an H200


def default_num_splits(batch: int, kv_heads: int, rows: int, capacity: int, device: torch.device,
                       row_programs: int = 1, single_token: bool = False) -> tuple[int, bool]:
    """(prefix splits, whether the block has programs of its own) from shapes only. One
    wave: the programs per (b, kv head, row program) fill the SMs at most once, as the
    larger tiles fit one program per SM and a second wave of a few programs would double
    the time (H200 sweep). The block's own programs (one row tile, see module doc) take
    places in that wave at the cost of one split per (b, kv head), unless the splits are
    long (>= 1024 keys) and at most half the block programs find no SM: those start when
    the first block programs end, long before the prefix programs do (16K, T = 1, 8 KV
    heads: 16 splits 23.3 us, 15 splits 24.4 us; 4K, T = 1: 11.3 vs 10.8 us). With 1-3
    splits per (b, kv head) (8 or more requests of 8 KV heads) a split is too much to give
    up (2 -> 1 leaves half the SMs idle) and the block joins the last split instead of
    making a second wave. No split shorter than 256 keys (512 past one 64-row tile) on a
    full cache, where the fixed cost of a program and of its rows x D partial outweighs
    its share of the prefix (4K, T = 16: 15 splits 11.8 us, 8 splits 13.5 us).
    A single token whose block programs would cost a split of >= 512 keys gives the
    wave to the prefix instead, its own key ending the last split (4 requests at 4K: 4
    splits of 1024 keys, not 3 of 1408 and 32 one-key programs). With short splits the
    extra loads of every program outweigh the split (one request at 4K, 16 splits of 256
    keys: the 8B step 1% slower)."""
    sms, heads = _sm_count(device), batch * kv_heads
    min_chunk = 256 if rows <= 64 else 512
    if row_programs > 1:  # compute-bound: two splits beat one (T=256: 4K 93 vs 98 us, 16K 222 vs 352)
        return max(1, min(max(sms // (heads * row_programs), 2), capacity // min_chunk)), False
    splits = max(1, min(sms // heads, capacity // min_chunk))
    overflow = heads * (splits + 1) - sms  # block programs past the wave
    if overflow <= 0 or (capacity // splits >= 1024 and 2 * overflow <= heads):
        return splits, True
    if splits >= 4 and not (single_token and capacity // splits >= 512):
        return splits - 1, True
    return splits, False


def default_row_programs(rows: int, block_m: int) -> int:
    """Programs that share a (b, kv head, split)'s row tiles. Up to 128 rows (T * G) one
    program loads each KV tile once for all of them. Past that the kernel is
    compute-bound (T * G FLOP per byte of K/V, see NOTES.md) and a single program per
    split walking 8 row tiles left most SMs idle: each row tile gets its own program
    and the KV chunk is re-read from L2, not HBM, by programs running side by side."""
    return triton.cdiv(rows, block_m)


def _key_tiles(block_m: int, fp32: bool, split_keys: int) -> tuple[int, int]:
    """(keys per tile, K/V tiles in flight per program). The few-row tiles of decoding
    are memory-bound and gain from every tile in flight that fits: 5 tiles of 64 keys
    (H200, T = 1, against 4: 16K 23.2 -> 22.7 us, 32K -5%, 4 requests at 4K -8%, 6
    slower again), or where a split holds >= 512 keys 3 of 128 (8K / 16K / 32K: 1.5 /
    1.0 / 0.8% faster; at 4K, splits of 256 keys, 5% slower); 64-row tiles are fastest
    at 4 of 64 (T = 16 at 4K and 16K: 5 stages 1-5% slower, 128 keys slower),
    128-row tiles fit 3, and fp32 tiles are twice the bytes."""
    if fp32:
        return 64, 2
    if block_m <= 16:
        return (128, 3) if split_keys >= 512 else (64, 5)
    return 64, 4 if block_m <= 64 else 3


def supports(head_dim: int) -> bool:
    """Head sizes the kernel's tiles are built for; others use the SDPA reference."""
    return head_dim in (64, 128)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   inputs: AttentionInputs, scale: float, num_splits: int | None = None,
                   row_programs: int | None = None, sinks: torch.Tensor | None = None,
                   window: int | None = None) -> torch.Tensor:
    """q [B, T, H, D] against cache [B, Hkv, S, D] -> [B, T, H, D]; see module doc.

    The block's K/V must already be at slots prefix_lens[b] + 0..T-1 (< S), and its
    positions (inputs.positions) must be >= prefix_lens[b] where `window` is given.
    `inputs.kv_len` is ignored: each request reads prefix_lens[b] + T slots.
    `num_splits` and `row_programs` override the shape-based choices (benchmarks).
    `sinks` [H] (natural log, not scaled) and `window`: as in `sdpa_attention`.
    """
    B, T, H, D = q.shape
    _, HKV, S, _ = k_cache.shape
    G = H // HKV
    assert H == G * HKV and D in (64, 128), "GQA group and head dim 64 / 128 (tile sizes assume these)"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    mask = inputs.block_mask
    assert mask.shape == (B, T, T) and mask.stride(-1) == 1, "block_mask must be [B, T, T]"
    assert sinks is None or sinks.shape == (H,), "one sink per query head"
    positions = inputs.positions
    rows = T * G
    # fp32 (tests, debugging) uses 3-pass tf32 dots for ~fp32 accuracy, and smaller
    # tiles / fewer stages so that its 4-byte tiles fit in shared memory.
    fp32 = q.dtype == torch.float32
    block_m = max(16, min(64 if fp32 else 128, triton.next_power_of_2(rows)))
    row_programs = min(row_programs or default_row_programs(rows, block_m), triton.cdiv(rows, block_m))
    if num_splits:  # given splits: a single token's key joins the last one
        splits, own_block = num_splits, row_programs == 1 and T > 1
    else:
        splits, own_block = default_num_splits(B, HKV, rows, S, q.device, row_programs, single_token=T == 1)
    # The split that also attends the block: a program of its own, the last prefix
    # split, programs of their own per tile of keys (module doc, (b)), or none where a
    # single token's own key ends the last split.
    block_n, stages = _key_tiles(block_m, fp32, min(S, window or S) // splits)
    block_n_tree = max(16, min(block_n, triton.next_power_of_2(T)))
    block_chunks = triton.cdiv(T, block_n_tree)
    if row_programs == 1 or B * HKV * row_programs * (splits + block_chunks) > _sm_count(q.device):
        block_chunks = 0
    own_key = T == 1 and not own_block
    block_split = -1 if block_chunks or own_key else splits if own_block else splits - 1
    parts = max(splits + block_chunks, block_split + 1)

    # Partial outputs in the input dtype: normalised, so bf16 costs no more accuracy than
    # the bf16 output itself, and halves their traffic (T=16: 12% -> 6% of the prefix).
    # With one part and no sinks there is nothing to merge: the partial is the output.
    direct = parts == 1 and sinks is None
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    o_part = out if direct else torch.empty(B * HKV, parts, rows, D, dtype=q.dtype, device=q.device)
    lse_part = torch.empty(1 if direct else B * HKV * parts * rows, dtype=torch.float32, device=q.device)
    LOG2E = 1.4426950408889634
    _partial_attention[(B * HKV, parts, row_programs)](
        q, k_cache, v_cache, mask.view(torch.uint8), o_part, lse_part, inputs.prefix_lens, positions,
        q.stride(0), q.stride(1), q.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3],
        mask.stride(0), mask.stride(1), *positions.stride(), scale * LOG2E, splits, block_split, row_programs,
        window or 0, HKV=HKV, G=G, T=T, D=D, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_N_TREE=block_n_tree, FP32_DOT=fp32, WINDOW=window is not None, BLOCK_CHUNKS=block_chunks > 0,
        # With one row tile each prefix tile is read once: its L2 lines go first, before
        # the partials' (H200, 16K, T = 1: 22.6 -> 22.1 us). Several row tiles re-read it.
        PREFIX_EVICTION="evict_first" if rows <= block_m else "", OWN_KEY=own_key, DIRECT=direct,
        num_warps=8 if block_m >= 128 else 4, num_stages=stages, **chained(q.device))
    if direct:
        return out
    # One or two warps per merge program and few rows each: the merge is a latency
    # chain of small loads, and 4 warps reducing one row's splits cost 12.6 us per layer
    # at T = 64 (2048 programs) against 2.6 us with one (H200, NOTES.md). One row per
    # program below 256 rows, so that all parts load in one chunk (16K, T = 1: 24.0 ->
    # 23.3 us with 16 splits). A chunk of parts x rows x D stays within 128 fp32
    # registers per thread.
    merge_rows = 4 if rows >= 256 else 1
    merge_warps = 2 if rows <= 16 else 1
    chunk = min(triton.next_power_of_2(parts), 4096 * merge_warps // (merge_rows * D))
    _merge[(B * HKV * triton.cdiv(rows, merge_rows),)](
        o_part, lse_part, out, lse_part if sinks is None else sinks.contiguous(), parts, HKV=HKV, G=G, T=T, D=D,
        R=merge_rows, CHUNK=chunk, HAS_SINKS=sinks is not None, num_warps=merge_warps, **chained(o_part.device))
    return out
