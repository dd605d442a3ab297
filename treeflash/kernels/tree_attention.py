"""Triton attention for a block of new tokens over a KV cache (tree verify, AR decode,
drafter block), with exactly the semantics of `layers.attention.sdpa_attention`.

One launch in three parts (design.md section 5):

(a) The committed prefix has no mask, so every block query of request b sees the same
    keys. One program takes ALL T block queries x the whole GQA group of one KV head
    (T*G "rows") against one split of the prefix ("flash decoding"). The rows are
    tiled inside the program and the row tiles run back to back over the same small
    KV chunk, so the chunk comes from HBM once and the later row tiles hit L2: the
    prefix is read once per round however large the tree. For T*G <= 128 there is a
    single row tile and the chunk is loaded once, period.
(b) The T x T block is one more "split" of the same grid, read at slots
    prefix_lens[b] + j with the block mask (ancestors, causal or all-true).
(c) Each program writes its normalised partial (o, lse) per row tile and counts itself
    in an arrival counter of that (b, KV head, row tile). The last to arrive merges
    the partials of the tile by log-sum-exp, writes the output and zeroes the counter
    for the next launch. A separate merge launch cost 3-4 us per layer (one more graph
    node, then dependent loads): 15% of the whole op at 16K context, T = 1. Programs
    walk their row tiles in an order rotated by their split, so that with several row
    tiles the last arrivals, and so the merges, are spread over programs.

Static shapes for CUDA graphs: the grid and the number of splits depend only on the
tensor shapes (and the SM count); each split's key range is computed on the device
from prefix_lens, so the work is spread over all splits whatever the actual length,
and splits past the end only count themselves.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from treeflash.layers.attention import AttentionInputs

BLOCK_N = 64  # keys per tile


@triton.jit
def _split_range(L, split, num_splits, BLOCK_N: tl.constexpr):
    """Prefix slots [start, end) of `split` when L slots are shared by num_splits splits
    in whole tiles. The merge calls it too, to skip the splits that did not run."""
    chunk = tl.cdiv(tl.cdiv(L, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    return start, tl.minimum(start + chunk, L)


@triton.jit
def _attend(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base, sm_i, first, n_keys, qk_scale,
            D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            MASKED: tl.constexpr, FP32_DOT: tl.constexpr):
    """Online softmax of one row tile over slots first + 0..n_keys-1. MASKED: the
    block, where row token `tok` sees key j only if block_mask[tok, j]. Returns
    (o, lse), lse in base 2; a row that saw no key gets o = 0, lse = -inf."""
    offs_d = tl.arange(0, D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for j0 in range(0, n_keys, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        key_ok = j < n_keys
        slots = first + j
        k = tl.load(k_base + slots[:, None] * sk_s + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_base + slots[:, None] * sv_s + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        if FP32_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="tf32x3")
        else:
            s = tl.dot(q, tl.trans(k))
        if MASKED:
            ok = row_ok[:, None] & key_ok[None, :]
            allowed = tl.load(mask_base + tok[:, None] * sm_i + j[None, :], mask=ok, other=0) != 0
        else:
            allowed = key_ok[None, :]
        s = tl.where(allowed, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key so far
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m - m_ref)
        l = l * alpha + tl.sum(p, 1)
        if FP32_DOT:
            pv = tl.dot(p, v, input_precision="tf32x3")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    l = tl.where(l > 0, l, 1.0)  # a row that saw no key: o = 0, lse = m = -inf
    return acc / l[:, None], m + tl.log2(l)


@triton.jit
def _merge_tile(o_ptr, lse_ptr, out_base, so_t, part0, row0, L, num_splits,
                G: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, SPLITS_P2: tl.constexpr, MERGE_M: tl.constexpr):
    """Rows row0 .. row0 + BLOCK_M - 1 of out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)
    over the prefix splits that ran and the block split, MERGE_M rows of all splits at a
    time. Loads go through L2 (.cg): other SMs wrote them."""
    offs_d = tl.arange(0, D)
    s = tl.arange(0, SPLITS_P2)
    start, end = _split_range(L, s, num_splits, BLOCK_N)
    ran = (s < num_splits) & (start < end)
    # pipelined: the next chunks' loads are in flight while one is reduced
    for r0 in tl.range(row0, tl.minimum(row0 + BLOCK_M, ROWS), MERGE_M, num_stages=3):
        rows = r0 + tl.arange(0, MERGE_M)
        row_ok = rows < ROWS
        ok = ran[:, None] & row_ok[None, :]
        idx = (part0 + s)[:, None] * ROWS + rows[None, :]  # prefix splits x rows
        lse = tl.load(lse_ptr + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(o_ptr + idx[:, :, None] * D + offs_d[None, None, :], mask=ok[:, :, None], other=0.0,
                    cache_modifier=".cg")
        # The block split apart, so that 16 prefix splits take [16, ...] loads, not [32, ...].
        blk = (part0 + num_splits) * ROWS + rows
        lse_b = tl.load(lse_ptr + blk, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        o_b = tl.load(o_ptr + blk[:, None] * D + offs_d[None, :], mask=row_ok[:, None], other=0.0,
                      cache_modifier=".cg")
        m = tl.maximum(tl.max(lse, 0), lse_b)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m[None, :])
        w_b = tl.exp2(lse_b - m)
        den = tl.sum(w, 0) + w_b
        num = tl.sum(o.to(tl.float32) * w[:, :, None], 0) + o_b.to(tl.float32) * w_b[:, None]
        res = num / tl.where(den > 0, den, 1.0)[:, None]
        dst = out_base + (rows // G)[:, None] * so_t + (rows % G)[:, None] * D + offs_d[None, :]
        tl.store(dst, res.to(out_base.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _tree_attention(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, lse_ptr, out_ptr, count_ptr, prefix_ptr,
    sq_b, sq_t, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sm_b, sm_i,
    qk_scale, num_splits,
    HKV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_N_TREE: tl.constexpr,
    SPLITS_P2: tl.constexpr, MERGE_M: tl.constexpr, FP32_DOT: tl.constexpr,
):
    """Program (b * HKV + kv head, split): all T*G rows of that KV head against one key
    range, as normalised partials o [rows, D] and lse [rows]; the last program of a row
    tile to finish merges it into out [B, T, H, D] (contiguous).

    Row r is block token r // G, query head kvh * G + r % G: consecutive rows are
    consecutive heads of one token, so q loads and out stores are contiguous. Splits
    0..num_splits-1 are prefix chunks (no mask); split num_splits is the block.
    """
    ROWS: tl.constexpr = T * G
    N_TILES: tl.constexpr = (ROWS + BLOCK_M - 1) // BLOCK_M
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

    offs_d = tl.arange(0, D)
    b64 = b.to(tl.int64)  # a whole cache can pass 2^31 elements
    q_base = q_ptr + b64 * sq_b + kvh * G * sq_h
    k_base = k_ptr + b64 * sk_b + kvh.to(tl.int64) * sk_h
    v_base = v_ptr + b64 * sv_b + kvh.to(tl.int64) * sv_h
    mask_base = mask_ptr + b * sm_b
    part0 = pid_bh * (num_splits + 1)
    for i in range(N_TILES):
        tile = (i + split) % N_TILES
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < ROWS
        if start < end:  # an empty split writes nothing, the merge skips it
            tok = rows // G
            q = tl.load(q_base + tok[:, None] * sq_t + (rows % G)[:, None] * sq_h + offs_d[None, :],
                        mask=row_ok[:, None], other=0.0)
            if is_block:
                o, lse = _attend(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base, sm_i, L, T,
                                 qk_scale, D, BLOCK_M, BLOCK_N_TREE, True, FP32_DOT)
            else:
                o, lse = _attend(q, tok, row_ok, k_base, v_base, sk_s, sv_s, mask_base, sm_i, start, end - start,
                                 qk_scale, D, BLOCK_M, BLOCK_N, False, FP32_DOT)
            part = (part0 + split) * ROWS + rows
            tl.store(o_ptr + part[:, None] * D + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
                     mask=row_ok[:, None])
            tl.store(lse_ptr + part, lse, mask=row_ok)
        # All threads' partial stores come before the one thread that releases them with
        # the count (acq_rel: the last one also acquires all the others' partials).
        tl.debug_barrier()
        counter = count_ptr + pid_bh * N_TILES + tile
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits:
            _merge_tile(o_ptr, lse_ptr, out_ptr + (b64 * T * HKV + kvh) * G * D, HKV * G * D, part0,
                        tile * BLOCK_M, L, num_splits, G, ROWS, D, BLOCK_M, BLOCK_N, SPLITS_P2, MERGE_M)
            tl.store(counter, 0)  # every program of this launch has counted: ready for the next


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # interpreter runs: behave like an H200


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 counters, allocated once per device and size and never freed: each
    launch leaves them zero again, and CUDA graphs keep their address. Launches that
    share them must not overlap (one stream per device)."""
    key = (device, n)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("tree_attention: run each shape once before capturing it in a CUDA graph "
                               "(its arrival counters must be zeroed outside the graph)")
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def default_num_splits(batch: int, kv_heads: int, rows: int, capacity: int, device: torch.device) -> int:
    """Prefix splits from shapes only. One wave of prefix programs (splits x B x Hkv <=
    SMs): the larger tiles fit one program per SM, and a second wave of a few programs
    would double the time (H200 sweep). The block programs are short: they take the
    SMs left over, or follow the first to finish. On an H200 with 8 KV heads that is 16
    splits: 16K keys as 16 x 1024, not 14 x 1152 + 256 with 15. And no split shorter
    than 256 keys (512 past one 16-row MMA tile) on a full cache, where the fixed cost
    of a program and of its rows x D partial (written, then read by the merge)
    outweighs its share of the prefix."""
    one_wave = _sm_count(device) // (batch * kv_heads)
    min_chunk = 256 if rows <= 16 else 512
    return max(1, min(one_wave, capacity // min_chunk))


def supports(head_dim: int) -> bool:
    """Head sizes the kernel's tiles are built for; others use the SDPA reference."""
    return head_dim in (64, 128)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   inputs: AttentionInputs, scale: float, num_splits: int | None = None) -> torch.Tensor:
    """q [B, T, H, D] against cache [B, Hkv, S, D] -> [B, T, H, D]; see module doc.

    The block's K/V must already be at slots prefix_lens[b] + 0..T-1 (< S).
    `inputs.kv_len` is ignored: each request reads prefix_lens[b] + T slots.
    `num_splits` overrides the shape-based prefix split count (benchmarks).
    """
    B, T, H, D = q.shape
    _, HKV, S, _ = k_cache.shape
    G = H // HKV
    assert H == G * HKV and D in (64, 128), "GQA group and head dim 64 / 128 (tile sizes assume these)"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    mask = inputs.block_mask
    assert mask.shape == (B, T, T) and mask.stride(-1) == 1, "block_mask must be [B, T, T]"
    rows = T * G
    splits = num_splits or default_num_splits(B, HKV, rows, S, q.device)
    # fp32 (tests, debugging) uses 3-pass tf32 dots for ~fp32 accuracy, and smaller
    # tiles / fewer stages so that its 4-byte tiles fit in shared memory.
    fp32 = q.dtype == torch.float32
    block_m = max(16, min(64 if fp32 else 128, triton.next_power_of_2(rows)))
    num_warps = 8 if block_m >= 128 else 4
    # The merge loads [splits, MERGE_M, D] at once: up to 64 values a thread.
    splits_p2 = triton.next_power_of_2(splits)
    merge_m = max(1, min(triton.next_power_of_2(min(rows, block_m)), 64 * 32 * num_warps // (splits_p2 * D)))

    # Partial outputs in the input dtype: normalised, so bf16 costs no more accuracy than
    # the bf16 output itself, and halves their traffic (T=16: 12% -> 6% of the prefix).
    o_part = torch.empty(B * HKV, splits + 1, rows, D, dtype=q.dtype, device=q.device)
    lse_part = torch.empty(B * HKV, splits + 1, rows, dtype=torch.float32, device=q.device)
    out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
    counters = _arrival_counters(q.device, B * HKV * triton.cdiv(rows, block_m))
    LOG2E = 1.4426950408889634
    _tree_attention[(B * HKV, splits + 1)](
        q, k_cache, v_cache, mask.view(torch.uint8), o_part, lse_part, out, counters, inputs.prefix_lens,
        q.stride(0), q.stride(1), q.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3],
        mask.stride(0), mask.stride(1), scale * LOG2E, splits,
        HKV=HKV, G=G, T=T, D=D, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_N_TREE=max(16, min(BLOCK_N, triton.next_power_of_2(T))),
        SPLITS_P2=splits_p2, MERGE_M=merge_m, FP32_DOT=fp32,
        # small row tiles are memory-bound: one more tile in flight (H200, 16K, T=1: -5%)
        num_warps=num_warps, num_stages=2 if fp32 else 4 if block_m <= 64 else 3)
    return out
