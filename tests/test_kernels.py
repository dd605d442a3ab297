"""tree_attention against the SDPA reference: on a GPU, or in the Triton interpreter on
CPU (`TRITON_INTERPRET=1`), which CI runs on a subset through a subprocess
(`test_kernel_in_the_triton_interpreter`)."""
import pytest
import torch
from interpreter import DEV, INTERPRET, run_interpreted, spawns_interpreter
from interpreter import kernel as kernel_test

pytest.importorskip("triton")

from treeflash.kernels import tree_attention  # noqa: E402
from treeflash.layers.attention import AttentionInputs, sdpa_attention  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def random_ancestors(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """[B, T, T] ancestor-or-self matrices of random trees (node 0 the root, parent < child)."""
    anc = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        anc[b, 0, 0] = True
        for i in range(1, T):
            parent = int(torch.randint(0, i, (1,), generator=gen))
            anc[b, i] = anc[b, parent]
            anc[b, i, i] = True
    return anc


def make_inputs(B, T, S, mask_kind, gen):
    # lengths: 0, full (S - T), and random in between
    lens = torch.randint(0, S - T + 1, (B,), generator=gen)
    lens[0] = 0
    lens[-1] = S - T
    if mask_kind == "tree":
        mask = random_ancestors(B, T, gen)
    elif mask_kind == "aligned":  # as the tree builders leave it: rows padded to ANCESTOR_ROW_ALIGN bytes
        from treeflash.engine.tree import ancestor_buffer
        mask = ancestor_buffer(B, T, DEV, fill=random_ancestors(B, T, gen).to(DEV))  # made on DEV: .to keeps no padding
    elif mask_kind == "all":
        mask = torch.ones(B, T, T, dtype=torch.bool)
    elif mask_kind == "none":  # every row sees the prefix only (request 0's: no key at all)
        mask = torch.zeros(B, T, T, dtype=torch.bool)
    else:  # causal, as an expanded (stride-0) view like AttentionInputs.causal
        mask = torch.ones(T, T, dtype=torch.bool, device=DEV).tril().expand(B, T, T)  # nor a stride 0
    positions = lens[:, None] + torch.arange(T)
    return AttentionInputs(positions.to(DEV), lens.to(DEV), mask.to(DEV))


def check(B, T, HKV, G, D, S, dtype, mask_kind, num_splits=None, seed=0, row_programs=None, shift=0.0):
    """`shift`: q's first feature lowered and k's raised by it, every score by about
    shift^2 * scale (shift 30, D 64: -112 +- 5)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(B, T, S, mask_kind, gen)
    q = torch.randn(B, T, HKV * G, D, generator=gen)
    k = torch.randn(B, HKV, S, D, generator=gen)
    q[..., 0] -= shift
    k[..., 0] += shift
    q, k = q.to(DEV, dtype), k.to(DEV, dtype)
    v = torch.randn(B, HKV, S, D, generator=gen).to(DEV, dtype)
    scale = D ** -0.5
    out = tree_attention(q, k, v, inputs, scale, num_splits=num_splits, row_programs=row_programs)
    ref = sdpa_attention(q.double(), k.double(), v.double(), inputs, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err < TOL[dtype], f"max abs err {err}"


# The interpreter keeps bf16 as raw uint16 and its tl.dot does integer math on them.
HALF = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]


@kernel_test
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("G", [1, 3, 4, 8])
@pytest.mark.parametrize("T", [1, 16, 37])
@pytest.mark.parametrize("mask_kind", ["tree", "all", "causal"])
def test_matches_sdpa(G, T, mask_kind, dtype):
    check(B=3, T=T, HKV=2, G=G, D=128, S=400, dtype=dtype, mask_kind=mask_kind, seed=T * 10 + G)


@kernel_test
@pytest.mark.parametrize("dtype", HALF + [torch.float32])
@pytest.mark.parametrize("D", [64, 128])
def test_dtypes_and_head_dims(dtype, D):
    check(B=2, T=16, HKV=2, G=4, D=D, S=300, dtype=dtype, mask_kind="tree", seed=D)


@kernel_test
@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_split_counts(num_splits):
    """One split, a few, and more splits than tiles (most splits empty); 27 rows of a
    3-head group, so the merge's row blocks cross tokens and the last one is partial."""
    check(B=3, T=9, HKV=2, G=3, D=64, S=500, dtype=torch.float32, mask_kind="tree",
          num_splits=num_splits, seed=num_splits)


@kernel_test
@pytest.mark.parametrize("row_programs, num_splits", [(1, 2), (2, 2), (3, 2), (2, 1)])
def test_row_programs(row_programs, num_splits):
    """148 rows = 3 row tiles of 64 (fp32): one program walking all three (the block has
    programs of its own), two sharing them unevenly, one per tile (past one row program
    the block's keys have programs of their own, also beside a single split)."""
    check(B=2, T=37, HKV=2, G=4, D=64, S=300, dtype=torch.float32, mask_kind="tree",
          num_splits=num_splits, row_programs=row_programs, seed=row_programs + 10 * num_splits)


@kernel_test
@pytest.mark.parametrize("mask_kind", ["tree", "none", "all"])
def test_block_keys_in_chunks(mask_kind):
    """200 rows = 4 row tiles of 64 (fp32), a program per tile: the block's 100 keys are
    attended in chunks of 64 by programs of their own (64 + 36 keys), each row's chunks
    merged with its prefix splits; rows that see no key of a chunk, or of any."""
    from treeflash.kernels.tree_attention import default_row_programs
    assert default_row_programs(200, 64) == 4
    check(B=2, T=100, HKV=2, G=2, D=64, S=300, dtype=torch.float32, mask_kind=mask_kind, seed=len(mask_kind))


@kernel_test
@pytest.mark.parametrize("B", [8, 16])
@pytest.mark.parametrize("T", [1, 3])
def test_many_requests_fold_the_block_into_the_last_split(B, T):
    """8 or 16 requests of 8 KV heads leave 1-2 splits per (request, head) and no place
    for block programs in the wave (`default_num_splits`): the last split attends the
    block after its prefix chunk, with one row tile, or a decoding token's own key."""
    check(B=B, T=T, HKV=8, G=2, D=64, S=600, dtype=torch.float32, mask_kind="tree", seed=B + T)


@kernel_test
@pytest.mark.parametrize("row_programs", [1, 2])
def test_empty_splits_are_never_read(row_programs, monkeypatch):
    """64 splits of a 500-slot cache (one request of length 0), 148 rows in one program
    or over two: most splits hold no key and write no partial output. With every buffer the kernel allocates full of NaN, none
    of it may reach the result."""
    empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    check(B=3, T=37, HKV=2, G=4, D=64, S=500, dtype=torch.float32, mask_kind="tree",
          num_splits=64, row_programs=row_programs, seed=5)


@kernel_test
@pytest.mark.parametrize("T, row_programs, num_splits", [(1, None, 1), (37, 3, 1), (37, 2, 1)])
@pytest.mark.parametrize("mask_kind", ["tree", "none"])
def test_one_part_is_the_output(T, row_programs, num_splits, mask_kind, monkeypatch):
    """Where one program's part holds all of a row's keys (a single token with one split
    and its own key; row tiles of one split, one or two to a program, on a GPU with no
    room for block programs), it writes the output itself and no merge runs, also for
    rows that see no key."""
    import sys
    module = sys.modules["treeflash.kernels.tree_attention"]
    monkeypatch.setattr(module, "_sm_count", lambda device: 4)
    monkeypatch.setattr(module, "_merge", None)  # indexing it would raise
    check(B=3, T=T, HKV=2, G=4, D=64, S=300, dtype=torch.float32, mask_kind=mask_kind, num_splits=num_splits,
          row_programs=row_programs, seed=T)


@kernel_test
@pytest.mark.parametrize("num_splits", [None, 3, 64])
@pytest.mark.parametrize("mask_kind", ["all", "none"])
def test_a_single_token_sees_the_prefix_and_itself(num_splits, mask_kind):
    """Decoding (T = 1): the prefix over default splits with a block program, and over
    given splits whose last one adds the token's own key, also where that split holds
    no prefix (64 of 500 slots); an empty prefix; a token whose mask hides itself (the
    prefix only)."""
    check(B=3, T=1, HKV=2, G=4, D=64, S=500, dtype=torch.float32, mask_kind=mask_kind, num_splits=num_splits,
          seed=num_splits or 0)


@kernel_test
@pytest.mark.parametrize("T, D, num_splits", [(1, 128, 2), (1, 64, 3), (4, 128, 1)])
def test_long_splits_of_few_rows_take_128_key_tiles(T, D, num_splits):
    """Up to 16 rows over splits of >= 512 keys: tiles of 128 keys (a split's range is
    whole tiles of that size), a decoding token's own key, a small tree's block."""
    from treeflash.kernels.tree_attention import _key_tiles
    assert _key_tiles(T * 4, False, 1700 // num_splits)[0] == 128
    check(B=2, T=T, HKV=2, G=4, D=D, S=1700, dtype=HALF[0], mask_kind="tree", num_splits=num_splits,
          seed=T + num_splits)


@kernel_test
@pytest.mark.parametrize("T, num_splits", [(4, 3), (1, 64)])
def test_far_negative_scores_outweigh_a_part_that_saw_no_key(T, num_splits):
    """Every score near -112 (base 2: -162): each row's keys are its prefix only (mask
    "none"), and a part of it saw no key at all: the block's program (its prefix and
    block both empty), or the last of 64 splits with the token's hidden own key. Such a
    part has lse = -inf and weighs nothing, however small the real parts' lse."""
    check(B=3, T=T, HKV=2, G=2, D=64, S=200, dtype=torch.float32, mask_kind="none", num_splits=num_splits,
          seed=T, shift=30.0)


@kernel_test
@pytest.mark.parametrize("mask_kind, T", [("aligned", 9), ("causal", 9), ("causal", 1)])
def test_block_masks_laid_out_as_the_engine_passes_them(mask_kind, T):
    """The verify's ancestors as the tree builders leave them (`ancestor_buffer`: 9 rows
    of 16 bytes, not 9), and one causal mask for the whole batch (`AttentionInputs.causal`:
    a stride-0 view, as AR decoding and the drafter's blocks pass it), a single token's
    included: the mask is read through its strides, never as a contiguous [B, T, T]."""
    gen = torch.Generator().manual_seed(T)
    mask = make_inputs(3, T, 200, mask_kind, gen).block_mask
    assert mask.stride(0) == 0 if mask_kind == "causal" else mask.stride(1) == 16
    check(B=3, T=T, HKV=2, G=2, D=64, S=200, dtype=torch.float32, mask_kind=mask_kind, num_splits=2, seed=T)


@kernel_test
def test_merge_rescales_between_chunks_of_parts():
    """65 parts (64 splits and the block's program) for 32 rows of head dim 64: the merge
    takes them 64 at a time, and the last chunk's part (a block of 16 keys, all seen)
    outweighs the short prefixes (0-24 keys) of the first: the running sums are rescaled
    to its larger maximum."""
    check(B=3, T=16, HKV=2, G=2, D=64, S=40, dtype=torch.float32, mask_kind="all", num_splits=64, seed=3)


@kernel_test
def test_merge_of_many_rows_covers_a_partial_last_block():
    """258 rows (86 tokens of a 3-head group, as Llama-3.2-3B's 24 query heads over 8 KV
    heads): past 256 rows the merge takes 4 rows a program, and the last program's 2 rows
    are written too."""
    check(B=2, T=86, HKV=1, G=3, D=64, S=200, dtype=torch.float32, mask_kind="tree", seed=86)


def test_default_splits_fill_one_wave():
    """Shapes only, an H200's 132 SMs (the CPU stand-in): 8 KV heads at 16K take 16
    splits, the 8 block programs overflowing by 4; at 4K, or with 16 (b, head) pairs
    whose block programs would mostly overflow, the block keeps a place in the wave; with
    64 or 128 pairs (1-2 splits each) and past one row tile the block folds into the last
    split and there is no block program. A single token keeps its block programs where
    they cost no split or a short one; elsewhere its key ends the last split."""
    from treeflash.kernels.tree_attention import default_num_splits
    cpu = torch.device("cpu")
    assert default_num_splits(1, 8, 4, 16384 + 1, cpu) == (16, True)
    assert default_num_splits(1, 8, 4, 4096 + 1, cpu) == (15, True)
    assert default_num_splits(2, 8, 4, 16384 + 1, cpu) == (7, True)  # overflow 12 of 16 block programs
    assert default_num_splits(4, 8, 4, 4096 + 1, cpu) == (3, True)
    assert default_num_splits(8, 8, 4, 1 << 20, cpu) == (2, False)  # 132 // 64 = 2: no split to spare
    assert default_num_splits(16, 8, 4, 4096 + 1, cpu) == (1, False)
    assert default_num_splits(1, 8, 1024, 16384 + 256, cpu, row_programs=8) == (2, False)
    assert default_num_splits(1, 1, 4, 200, cpu) == (1, True)  # shorter than one 256-key split
    one = {"single_token": True}
    assert default_num_splits(1, 8, 4, 16384 + 1, cpu, **one) == (16, True)
    assert default_num_splits(1, 8, 4, 4096 + 1, cpu, **one) == (15, True)  # 16 splits of 256 keys
    assert default_num_splits(2, 8, 4, 4096 + 1, cpu, **one) == (8, False)
    assert default_num_splits(2, 8, 4, 16384 + 1, cpu, **one) == (8, False)
    assert default_num_splits(4, 8, 4, 4096 + 1, cpu, **one) == (4, False)
    assert default_num_splits(8, 8, 4, 1 << 20, cpu, **one) == (2, False)


@kernel_test
@pytest.mark.skipif(INTERPRET, reason="large shapes are slow in the interpreter")
@pytest.mark.parametrize("T", [64, 128, 256])
def test_large_trees(T):
    """Many row tiles per program (T*G up to 2048 rows) and long prefixes."""
    check(B=2, T=T, HKV=2, G=8, D=128, S=3000, dtype=torch.bfloat16, mask_kind="tree", seed=T)
    check(B=2, T=T, HKV=4, G=4, D=128, S=5000, dtype=torch.float32, mask_kind="tree", seed=T + 1)


@spawns_interpreter
def test_kernel_in_the_triton_interpreter():
    """CPU CI: splits, row programs, head sizes and dtypes in the interpreter (fp16 and
    fp32: its bf16 is raw integers)."""
    run_interpreted(__file__, "split_counts or row_programs or dtypes_and_head_dims or empty_splits or many_requests"
                    " or single_token or long_splits or block_keys_in_chunks or far_negative_scores"
                    " or laid_out_as_the_engine or rescales_between_chunks or partial_last_block or one_part_is", 42,
                    timeout=600)
