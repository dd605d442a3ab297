"""gpt-oss's additions to the Triton kernels against the torch references: attention
sinks and sliding windows in `tree_attention` (`sdpa_attention`), expert biases and
the clamped SwiGLU in `fused_experts` (`experts_reference`), FP8 experts included. On a
GPU, or in the Triton interpreter on CPU through a subprocess
(`test_kernels_in_the_triton_interpreter`)."""
import pytest
import torch
from interpreter import CUDA, DEV, run_interpreted, spawns_interpreter
from interpreter import kernel as kernel_test

pytest.importorskip("triton")

from test_kernels import TOL, random_ancestors  # noqa: E402
from test_moe import _case as moe_case  # noqa: E402

from treeflash.kernels import tree_attention  # noqa: E402
from treeflash.layers.attention import AttentionInputs, sdpa_attention  # noqa: E402
from treeflash.models.moe import experts_reference  # noqa: E402
from treeflash.ops import Fp8Weight, dequantized, fp8_blocks  # noqa: E402

# ----------------------------------------------------------------------------- attention

LENS = (45, 300)   # two requests: a short prefix and one longer than every window but 1000
S = 340


def block_mask(kind: str, B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """[B, T, T]: random trees, a star (root and T - 1 children), a chain (causal), or a
    drafter block (all-true)."""
    if kind == "tree":
        return random_ancestors(B, T, gen)
    if kind == "star":
        mask = torch.eye(T, dtype=torch.bool)
        mask[:, 0] = True
        return mask.expand(B, T, T).clone()
    if kind == "chain":
        return torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T).clone()
    return torch.ones(B, T, T, dtype=torch.bool)


def attention_case(kind, T, HKV, G, D, dtype, lens=LENS, seed=0):
    """q, k, v, inputs, sinks [H] (natural log, around the scores' scale). Positions are
    prefix_len + depth in the tree (a drafter block's: prefix_len + index)."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lens)
    mask = block_mask(kind, len(lens), T, gen)
    depth = torch.arange(T).expand(len(lens), T) if kind == "all" else mask.sum(-1) - 1
    inputs = AttentionInputs((lens[:, None] + depth).to(DEV), lens.to(DEV), mask.to(DEV))
    q = torch.randn(len(lens), T, HKV * G, D, generator=gen).to(DEV, dtype)
    k = torch.randn(len(lens), HKV, S, D, generator=gen).to(DEV, dtype)
    v = torch.randn(len(lens), HKV, S, D, generator=gen).to(DEV, dtype)
    sinks = (torch.randn(HKV * G, generator=gen) + 1).to(DEV, dtype)
    return q, k, v, inputs, sinks


def check_attention(kind, window, with_sinks, dtype=torch.float32, num_splits=None, T=16, HKV=2, G=3, D=64,
                    lens=LENS, seed=0):
    q, k, v, inputs, sinks = attention_case(kind, T, HKV, G, D, dtype, lens, seed)
    sinks = sinks if with_sinks else None
    scale = D ** -0.5
    out = tree_attention(q, k, v, inputs, scale, num_splits=num_splits, sinks=sinks, window=window)
    ref = sdpa_attention(q.double(), k.double(), v.double(), inputs, scale,
                         sinks=None if sinks is None else sinks.double(), window=window)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err < TOL[dtype], f"max abs err {err}"
    return out, (q, k, v, inputs, sinks)


# (mask, window, sinks, splits): windows inside the short prefix (7, 40), inside the long
# one only (150: over 3 of 4 splits), past both (1000); with and without sinks, default
# splits (one on this cache) and 4; the last: neither (the path as before)
ATTENTION_CASES = [("tree", 7, True, None), ("tree", 40, False, 4), ("tree", 150, True, 4),
                   ("tree", 1000, True, None), ("star", 40, True, 4), ("chain", 7, False, None),
                   ("chain", 150, False, 4), ("all", 40, True, 4), ("tree", None, True, 4),
                   ("chain", None, True, None), ("tree", None, False, 4)]


@kernel_test
@pytest.mark.parametrize("kind,window,with_sinks,num_splits", ATTENTION_CASES)
def test_attention_matches_reference(kind, window, with_sinks, num_splits):
    check_attention(kind, window, with_sinks, num_splits=num_splits, seed=len(kind) + (window or 0))


@kernel_test
@pytest.mark.parametrize("kind,window", [("chain", 40), ("all", 30)])
def test_window_over_block_chunks(kind, window):
    """100 tokens of a 2-head group (200 rows, 4 row programs in fp32): the block's keys
    in chunks of 64, each chunk reading its own keys' positions for a window shorter
    than the block."""
    check_attention(kind, window, True, T=100, G=2, lens=(45, 240), seed=window)


@kernel_test
@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_of_one_sees_only_itself(with_sinks):
    """Window 1 excludes every prefix slot and every other block token: each row is its
    own value, shrunk by the sink's share exp(s) / (exp(s) + exp(sink)); an empty prefix
    and a 300-slot one, 4 splits (all prefix splits empty)."""
    for lens in ((0, 300), LENS):
        out, (q, k, v, inputs, sinks) = check_attention("tree", 1, with_sinks, num_splits=4, lens=lens)
        B, T, H, D = q.shape
        G = H // k.shape[1]
        slots = inputs.block_slots()
        own_v = torch.stack([v[b, :, slots[b]] for b in range(B)]).repeat_interleave(G, 1).transpose(1, 2)
        want = own_v.double()
        if sinks is not None:
            own_k = torch.stack([k[b, :, slots[b]] for b in range(B)]).repeat_interleave(G, 1).transpose(1, 2)
            s = (q.double() * own_k.double()).sum(-1) * D ** -0.5
            want = want * torch.sigmoid(s - sinks.double())[..., None]
        assert (out.double() - want).abs().max().item() < TOL[torch.float32]


@kernel_test
@pytest.mark.parametrize("window", [1, 7, 150, None])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decoding_token_with_window_and_sinks(window, with_sinks):
    """One token (T = 1): windows of itself only, inside the short prefix, inside the
    long one only, and none; with and without sinks."""
    check_attention("chain", window, with_sinks, num_splits=4, T=1, seed=window or 0)


@kernel_test
def test_decoding_token_sees_its_own_key_wherever_it_sits():
    """A token whose position lies past its slot (positions may exceed prefix_lens): with
    window 3 no prefix key is within reach of position L + 5, but its own key is."""
    q, k, v, inputs, _ = attention_case("chain", 1, 2, 3, 64, torch.float32)
    inputs.positions += 5
    out = tree_attention(q, k, v, inputs, 64 ** -0.5, num_splits=4, window=3)
    ref = sdpa_attention(q.double(), k.double(), v.double(), inputs, 64 ** -0.5, window=3)
    own_v = torch.stack([v[b, :, inputs.prefix_lens[b]] for b in range(len(q))]).repeat_interleave(3, 1)
    assert (ref - own_v.double()[:, None]).abs().max().item() < 1e-9
    assert (out.double() - ref).abs().max().item() < TOL[torch.float32]


@kernel_test
@pytest.mark.parametrize("with_sinks", [False, True])
def test_row_that_sees_no_key_is_zero(with_sinks):
    """A block row whose mask hides even itself, with window 1: no key at all. Zero, not
    NaN, as SDPA (and the softmax with a sink) gives it."""
    q, k, v, inputs, sinks = attention_case("tree", 16, 2, 3, 64, torch.float32)
    inputs.block_mask[:, 5] = False
    out = tree_attention(q, k, v, inputs, 64 ** -0.5, num_splits=4, sinks=sinks if with_sinks else None, window=1)
    assert torch.isfinite(out).all() and (out[:, 5] == 0).all()
    ref = sdpa_attention(q.double(), k.double(), v.double(), inputs, 64 ** -0.5,
                         sinks=sinks.double() if with_sinks else None, window=1)
    assert (out.double() - ref).abs().max().item() < TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["tree", "star", "chain", "all"])
@pytest.mark.parametrize("window", [None, 1, 7, 40, 150, 1000])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gpu_attention_matches_reference(dtype, kind, window, with_sinks):
    """Every mask x window x sinks, default splits and 4, a GQA group of 8 at head dim
    128 and of 3 at 64, 37 tokens (past one 64-row tile in fp32) and 100 (the block's
    keys in chunks)."""
    for num_splits in (None, 4):
        check_attention(kind, window, with_sinks, dtype, num_splits, seed=len(kind))
    check_attention(kind, window, with_sinks, dtype, 4, T=16, HKV=1, G=8, D=128, seed=1)
    check_attention(kind, window, with_sinks, dtype, 3, T=37, G=2, seed=2)
    check_attention(kind, window, with_sinks, dtype, None, T=100, G=2, lens=(45, 240), seed=3)  # block in chunks


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_attention_replays_from_a_cuda_graph():
    """Sinks and a window in a captured launch: new prefix lengths and positions replay
    correctly (the split ranges follow prefix_lens on the device)."""
    q, k, v, inputs, sinks = attention_case("tree", 16, 2, 4, 64, torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):   # compile outside the capture
        tree_attention(q, k, v, inputs, 0.125, sinks=sinks, window=40)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_attention(q, k, v, inputs, 0.125, sinks=sinks, window=40)
    for lens in ((300, 45), (0, 310)):
        new = attention_case("tree", 16, 2, 4, 64, torch.bfloat16, lens, seed=sum(lens))
        for buf, value in zip((q, k, v, inputs.positions, inputs.prefix_lens, inputs.block_mask, sinks),
                              (*new[:3], new[3].positions, new[3].prefix_lens, new[3].block_mask, new[4])):
            buf.copy_(value)
        graph.replay()
        ref = sdpa_attention(*(t.double() for t in new[:3]), new[3], 0.125, sinks=new[4].double(), window=40)
        assert (out.double() - ref).abs().max().item() < TOL[torch.bfloat16]


# ----------------------------------------------------------------------------- experts

ALPHA, LIMIT = 1.702, 7.0   # gpt-oss's


def experts_case(T, E, k, H, I, dtype, skew=False, seed=0):
    """test_moe's case with gate/up 5x as large and biases: many gate / up
    pre-activations pass the clamp's limit. x, weights, ids, gate_up, down, (gate_up
    bias, down bias)."""
    x, w, ids, gu, dn = moe_case(T, E, k, H, I, dtype, skew, seed, device=DEV)
    gen = torch.Generator().manual_seed(seed + 1)
    bias = (torch.randn(E, 2 * I, generator=gen) * 2, torch.randn(E, H, generator=gen))
    return x, w, ids, gu * 5, dn, tuple(b.to(DEV, dtype) for b in bias)


def picked_pre_activations(x, ids, gu, bias):
    """[T, k, 2I] float64: each token's gate, then up, pre-activations in the experts it picked."""
    pre = torch.einsum("th,eih->tei", x.double(), gu.double()) + bias[0].double()
    return pre[torch.arange(len(x), device=x.device)[:, None], ids]


def assert_clamp_bites(x, ids, gu, bias, limit=LIMIT):
    """Some picked gate pre-activations lie above `limit` and some up ones outside +-limit."""
    I = gu.shape[1] // 2
    picked = picked_pre_activations(x, ids, gu, bias)
    assert (picked[..., :I] > limit).any() and (picked[..., :I] < limit).any()
    assert (picked[..., I:].abs() > limit).any()


def check_experts(case, with_bias, with_clamp, tol, fp8=None, limit=LIMIT):
    from treeflash.kernels.fused_moe import fused_experts
    x, w, ids, gu, dn, bias = case
    bias = bias if with_bias else None
    clamp = (ALPHA, limit) if with_clamp else None
    out = fused_experts(x, w, ids, gu, dn, fp8, bias=bias, clamp=clamp)
    ref = experts_reference(x.double(), w.double(), ids, gu if fp8 else gu.double(), dn if fp8 else dn.double(),
                            fp8, bias=None if bias is None else tuple(b.double() for b in bias), clamp=clamp)
    assert out.shape == x.shape and out.dtype == x.dtype
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, f"relative error {err}"


# T = 1 (decode), a few tokens, skewed routing (one expert over several row blocks),
# sizes off the tiles, top-1
EXPERT_CASES = [(1, 8, 2, 64, 32, False), (1, 6, 3, 80, 24, False), (7, 16, 4, 48, 40, False),
                (40, 4, 2, 32, 16, True), (33, 6, 1, 80, 24, False)]
# bias and clamp together (gpt-oss), each alone, neither (the path as before)
VARIANTS = [(True, True), (True, False), (False, True), (False, False)]


@kernel_test
@pytest.mark.parametrize("T,E,k,H,I,skew", EXPERT_CASES)
@pytest.mark.parametrize("with_bias,with_clamp", VARIANTS)
def test_experts_match_reference(T, E, k, H, I, skew, with_bias, with_clamp):
    case = experts_case(T, E, k, H, I, torch.float32, skew, seed=T)
    if with_clamp:
        assert_clamp_bites(case[0], case[2], case[3], case[5])
    check_experts(case, with_bias, with_clamp, 1e-5)


@kernel_test
@pytest.mark.parametrize("T", [1, 7])   # the one-token kernels, the grouped ones
def test_clamp_leaves_gates_below_minus_the_limit(T):
    """gpt-oss clamps the gate from above only (the up on both sides). At a limit of 1 a
    gate far below -1 still counts (g * sigmoid(alpha g) is -0.064 at g = -2, where a
    gate clamped at -1 would give -0.154): the kernels leave it as the reference does."""
    limit = 1.0
    case = experts_case(T, 8, 2, 64, 32, torch.float32, seed=T)
    x, _, ids, gu, _, bias = case
    assert_clamp_bites(x, ids, gu, bias, limit)
    assert (picked_pre_activations(x, ids, gu, bias)[..., :gu.shape[1] // 2] < -2 * limit).any()
    check_experts(case, True, True, 1e-5, limit=limit)


def fp8_case(T, E, k, H, I, block, dtype, seed=0):
    """experts_case with gate_up and down block-scaled FP8, and their `Fp8Weight`s."""
    x, w, ids, gu, dn, bias = experts_case(T, E, k, H, I, dtype, skew=T == 40, seed=seed)
    (gu, gu_s), (dn, dn_s) = ([torch.stack(t) for t in zip(*(fp8_blocks(m.float(), block) for m in mats))]
                              for mats in (gu, dn))
    return (x, w, ids, gu, dn, bias), (Fp8Weight(gu_s, block), Fp8Weight(dn_s, block))


# scale blocks narrower than the kernel's 128-column step, as wide, sizes off the blocks
FP8_CASES = [(7, 16, 4, 200, 96, (32, 64)), (40, 4, 2, 96, 48, (16, 32)), (3, 4, 2, 96, 64, (32, 128)),
             (1, 16, 4, 200, 96, (32, 64))]


@kernel_test
@pytest.mark.parametrize("T,E,k,H,I,block", FP8_CASES)
def test_fp8_experts_with_bias_and_clamp_match_reference(T, E, k, H, I, block):
    case, fp8 = fp8_case(T, E, k, H, I, block, torch.float32, seed=T)
    gu = torch.stack([dequantized(g, Fp8Weight(s, block), torch.float64) for g, s in zip(case[3], fp8[0].scale)])
    assert_clamp_bites(case[0], case[2], gu, case[5])
    check_experts(case, True, True, 1e-5, fp8)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
@pytest.mark.parametrize("T", [1, 16, 256])
@pytest.mark.parametrize("with_bias,with_clamp", VARIANTS[:3])
def test_gpu_experts_at_model_sizes(dtype, tol, T, with_bias, with_clamp):
    """gpt-oss-20b's experts at TP 1 cut down (E = 32, k = 4, H = 1024, I = 512), and
    FP8 (128 x 128 blocks)."""
    case = experts_case(T, 32, 4, 1024, 512, dtype, seed=T)
    if with_clamp:
        assert_clamp_bites(case[0], case[2], case[3], case[5])
    check_experts(case, with_bias, with_clamp, tol)
    case, fp8 = fp8_case(T, 32, 4, 1024, 512, (128, 128), dtype, seed=T)
    check_experts(case, with_bias, with_clamp, tol, fp8)


@spawns_interpreter
def test_kernels_in_the_triton_interpreter():
    # by name: every kernel test carries the gpu mark (interpreter.kernel); the CUDA-only ones are test_gpu_*
    run_interpreted(__file__, "not test_gpu_ and not interpreter",
                    len(ATTENTION_CASES) + 2 + 2 + 8 + 1 + 2 + len(EXPERT_CASES) * len(VARIANTS) + 2 + len(FP8_CASES),
                    timeout=900)
