"""tree_attention against the SDPA reference (needs a GPU, or TRITON_INTERPRET=1 on CPU:
`TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py`)."""
import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)

from treeflash.kernels import tree_attention  # noqa: E402
from treeflash.kernels.tree_attention import _COUNTERS  # noqa: E402
from treeflash.layers.attention import AttentionInputs, sdpa_attention  # noqa: E402

if INTERPRET:
    # Triton 3.6's interpreter calls int() on the (1,)-shaped arrays of loaded scalars
    # (as a loop bound), which numpy >= 2.3 rejects: take their one element instead.
    from triton.runtime import interpreter

    _patch_lang_tensor = interpreter._patch_lang_tensor

    def _patch_index(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_index

DEV = "cuda" if torch.cuda.is_available() else "cpu"
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


def make_inputs(B, T, S, mask_kind, gen, lens=None):
    if lens is None:  # 0, full (S - T), and random in between
        lens = torch.randint(0, S - T + 1, (B,), generator=gen)
        lens[0] = 0
        lens[-1] = S - T
    else:
        lens = torch.tensor(lens)
    if mask_kind == "tree":
        mask = random_ancestors(B, T, gen)
    elif mask_kind == "all":
        mask = torch.ones(B, T, T, dtype=torch.bool)
    else:  # causal, as an expanded (stride-0) view like AttentionInputs.causal
        mask = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)
    positions = lens[:, None] + torch.arange(T)
    return AttentionInputs(positions.to(DEV), lens.to(DEV), mask.to(DEV))


def check(B, T, HKV, G, D, S, dtype, mask_kind, num_splits=None, seed=0, lens=None, calls=1):
    """`calls` > 1: the same call again, which must give the same bits (the arrival
    counters are back at zero after each launch)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(B, T, S, mask_kind, gen, lens)
    q = torch.randn(B, T, HKV * G, D, generator=gen).to(DEV, dtype)
    k = torch.randn(B, HKV, S, D, generator=gen).to(DEV, dtype)
    v = torch.randn(B, HKV, S, D, generator=gen).to(DEV, dtype)
    scale = D ** -0.5
    out = tree_attention(q, k, v, inputs, scale, num_splits=num_splits)
    for _ in range(calls - 1):
        assert torch.equal(tree_attention(q, k, v, inputs, scale, num_splits=num_splits), out)
    assert all(not c.any() for c in _COUNTERS.values()), "arrival counters not reset"
    ref = sdpa_attention(q.double(), k.double(), v.double(), inputs, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err < TOL[dtype], f"max abs err {err}"


# The interpreter keeps bf16 as raw uint16 and its tl.dot does integer math on them.
HALF = [torch.float16] if INTERPRET else [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("T", [1, 16, 37])
@pytest.mark.parametrize("mask_kind", ["tree", "all", "causal"])
def test_matches_sdpa(G, T, mask_kind, dtype):
    check(B=3, T=T, HKV=2, G=G, D=128, S=400, dtype=dtype, mask_kind=mask_kind, seed=T * 10 + G)


@pytest.mark.parametrize("dtype", HALF + [torch.float32])
@pytest.mark.parametrize("D", [64, 128])
def test_dtypes_and_head_dims(dtype, D):
    check(B=2, T=16, HKV=2, G=4, D=D, S=300, dtype=dtype, mask_kind="tree", seed=D)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_split_counts(num_splits):
    """One split, a few, and more splits than tiles (most splits empty)."""
    check(B=3, T=8, HKV=2, G=4, D=64, S=500, dtype=torch.float32, mask_kind="tree",
          num_splits=num_splits, seed=num_splits)


@pytest.mark.parametrize("T, G, D, B", [(1, 4, 128, 1), (1, 8, 64, 2), (16, 4, 64, 2), (16, 8, 128, 1),
                                        (64, 4, 128, 2), (64, 8, 64, 1)])
def test_one_launch(T, G, D, B):
    """The merge by the last program: contexts on and off the 64-key tiles, empty
    splits, one to four row tiles (T*G up to 512), and three calls in a row."""
    S = 1100 + T
    for lens in ([1000, 64], [0, 1], [S - T, 130]):
        check(B=B, T=T, HKV=2, G=G, D=D, S=S, dtype=torch.float16, mask_kind="tree",
              seed=T + G + D + sum(lens), lens=lens[:B])
    check(B=B, T=T, HKV=2, G=G, D=D, S=S, dtype=torch.float16, mask_kind="tree",
          num_splits=16, seed=1, lens=[70, 333][:B], calls=3)


@pytest.mark.skipif(INTERPRET, reason="large shapes are slow in the interpreter")
@pytest.mark.parametrize("T", [64, 128, 256])
def test_large_trees(T):
    """Many row tiles per program (T*G up to 2048 rows) and long prefixes."""
    check(B=2, T=T, HKV=2, G=8, D=128, S=3000, dtype=torch.bfloat16, mask_kind="tree", seed=T)
    check(B=2, T=T, HKV=4, G=4, D=128, S=5000, dtype=torch.float32, mask_kind="tree", seed=T + 1)


def random_call(B, T, HKV, G, S, lens, seed, num_splits=None):
    """bf16 q / caches and a tree mask on the device, as the closure attn() -> out."""
    gen = torch.Generator().manual_seed(seed)
    inputs = make_inputs(B, T, S, "tree", gen, lens)
    q, k, v = (torch.randn(*shape, generator=gen).to(DEV, torch.bfloat16)
               for shape in ((B, T, HKV * G, 128), (B, HKV, S, 128), (B, HKV, S, 128)))
    return lambda: tree_attention(q, k, v, inputs, 128 ** -0.5, num_splits=num_splits), (q, k, v, inputs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="races need a real GPU")
@pytest.mark.parametrize("T, G", [(1, 4), (16, 4), (64, 8)])
def test_merge_has_no_race(T, G):
    """8K-16K prefixes over 8 KV heads in 16 splits, as on an 8B layer: 50 launches
    each of two inputs, alternating, give the same bits as the first launch of that
    input. The partial buffers are reused from the other input's launch, so a partial
    read before it is visible, or a merge by the wrong program, would differ."""
    calls = [random_call(B=2, T=T, HKV=8, G=G, S=16384 + T, lens=[16384, 8000], seed=T + i, num_splits=16)
             for i in range(2)]
    firsts = []
    for attn, (q, k, v, inputs) in calls:
        firsts.append(attn())
        ref = sdpa_attention(q.float(), k.float(), v.float(), inputs, 128 ** -0.5)
        assert (firsts[-1].float() - ref).abs().max().item() < TOL[torch.bfloat16]
    diffs = sum(not torch.equal(attn(), first) for _ in range(50) for (attn, _), first in zip(calls, firsts))
    assert diffs == 0, f"{diffs} of 100 launches differ"
    assert all(not c.any() for c in _COUNTERS.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="CUDA graphs need a GPU")
def test_cuda_graph_replays():
    """Captured after a warm-up call, replayed three times: the counters the graph
    holds are zero again after every replay, so each replay gives the eager result."""
    attn, _ = random_call(B=1, T=16, HKV=8, G=4, S=4096 + 16, lens=[4000], seed=3)
    eager = attn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = attn()
    for _ in range(3):
        out.zero_()
        g.replay()
        assert torch.equal(out, eager)
    assert all(not c.any() for c in _COUNTERS.values())
