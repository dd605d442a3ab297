"""Fused Triton layer ops against the torch layers they replace: on a GPU, or on the
CPU in the Triton interpreter (float32 only: its bf16 is raw integers), which CI runs
through a subprocess (`test_ops_in_the_triton_interpreter`)."""
import pytest
import torch
import torch.nn.functional as F
from interpreter import CUDA, DEV, INTERPRET, run_interpreted, spawns_interpreter
from interpreter import kernel as gpu_or_interpreter

DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


@gpu_or_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_ops_match_torch(dtype):
    """The residual add + RMSNorm (a width of 384: not a power of two, masked lanes),
    norm + RoPE and the SiLU gating against the torch layers they replace."""
    from treeflash.layers.norm import RMSNorm
    from treeflash.layers.rotary import RotaryEmbedding, apply_rotary
    from treeflash.ops.fused import add_rms_norm, norm_rope, silu_mul
    torch.manual_seed(0)
    tol, H, D = 1e-5 if dtype == torch.float32 else 2e-2, 384, 128
    with torch.device(DEV):
        norm = RMSNorm(H).to(dtype)
        norm.weight.data.normal_()
        x, r = torch.randn(2, 5, H, dtype=dtype), torch.randn(2, 5, H, dtype=dtype)
        with torch.enable_grad():  # the torch reference path
            ref_s, ref_n = x + r, norm(x + r)
        s, n = add_rms_norm(x, norm.weight, norm.eps, residual=r)
        assert (s - ref_s).abs().max() <= tol and (n - ref_n).abs().max() <= tol * 4
        qkv = torch.randn(2, 5, 8 * D, dtype=dtype)
        q = qkv[..., :4 * D].view(2, 5, 4, D)
        cos, sin = RotaryEmbedding(D, 1e6).cos_sin(torch.randint(0, 9000, (2, 5)), dtype)
        qn = RMSNorm(D).to(dtype)
        qn.weight.data.normal_()
        with torch.enable_grad():
            ref = apply_rotary(qn(q), cos, sin)
        assert (norm_rope(q, qn.weight, qn.eps, cos, sin) - ref).abs().max() <= tol * 8
        assert (norm_rope(q, None, 0.0, cos, sin) - apply_rotary(q, cos, sin)).abs().max() <= tol * 8
        gu = torch.randn(3, 2 * 1000, dtype=dtype)
        g, u = gu.chunk(2, -1)
        assert (silu_mul(gu) - F.silu(g) * u).abs().max() <= tol * 4


@gpu_or_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("T,D", [(7, 128), (20, 128), (20, 80)])
def test_rope_into_cache_matches_the_layer_steps(dtype, qk_norm, T, D):
    """One launch = norm_rope(q), norm_rope(k) and the two cache writes at
    prefix_lens + t, bit for bit (decode/verify/draft path); and the k/v-only form the
    drafter's context projection uses. 14 and 40 tokens: one head per program and 8
    (with a partial last block of heads). A head size of 80 (not a power of two, as in
    some published models) runs the kernels with masked lanes: norm_rope is checked
    against the torch layers there."""
    from treeflash.layers.attention import write_block
    from treeflash.layers.norm import RMSNorm
    from treeflash.layers.rotary import RotaryEmbedding, apply_rotary
    from treeflash.ops.fused import norm_rope, rope_into_cache
    torch.manual_seed(1)
    B, H, HKV, S = 2, 6, 2, 80
    with torch.device(DEV):
        qkv = torch.randn(B, T, (H + 2 * HKV) * D, dtype=dtype)
        qw, kw = (torch.rand(D, dtype=dtype) + 0.5, torch.rand(D, dtype=dtype) + 0.5) if qk_norm else (None, None)
        prefix = torch.tensor([0, 50])
        cos, sin = RotaryEmbedding(D, 1e6).cos_sin(prefix[:, None] + torch.arange(T), dtype)
        q, k, v = qkv.split([H * D, HKV * D, HKV * D], -1)
        q, k, v = q.view(B, T, H, D), k.view(B, T, HKV, D), v.view(B, T, HKV, D)
        # other slots keep their values (7)
        k_ref, v_ref = torch.full((B, HKV, S, D), 7.0, dtype=dtype), torch.full((B, HKV, S, D), 7.0, dtype=dtype)
        slots = prefix[:, None] + torch.arange(T)
        write_block(k_ref, norm_rope(k, kw, 1e-6, cos, sin), slots)
        write_block(v_ref, v, slots)
        k_cache, v_cache = torch.full_like(k_ref, 7.0), torch.full_like(v_ref, 7.0)
        out = rope_into_cache(qkv, H, HKV, qw, kw, 1e-6, cos, sin, k_cache, v_cache, prefix)
        assert torch.equal(out, norm_rope(q, qw, 1e-6, cos, sin))
        with torch.enable_grad():  # the torch layers
            qn = RMSNorm(D, 1e-6).to(dtype)
            if qw is not None:
                qn.weight.data.copy_(qw)
            want = apply_rotary(qn(q) if qw is not None else q, cos, sin)
        assert (out.float() - want.float()).abs().max() <= (1e-5 if dtype == torch.float32 else 0.1)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
        k_cache.fill_(7.0), v_cache.fill_(7.0)
        assert rope_into_cache(qkv[..., H * D:].contiguous(), H, HKV, qw, kw, 1e-6, cos, sin,
                               k_cache, v_cache, prefix, with_q=False) is None
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@gpu_or_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [(640, 384), (100, 300), (4096, 1024), (96, 4096)])
def test_gemv_matches_linear(dtype, N, K):
    """The batch-1 GEMV (every tile shape: tall, wide, square-ish; sizes off the tiles),
    with bias, and gated (silu(gate) * up applied to its input), against F.linear."""
    from treeflash.kernels.gemv import gemv
    torch.manual_seed(N + K)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.device(DEV):
        x, w, b = torch.randn(1, 1, K, dtype=dtype), torch.randn(N, K, dtype=dtype) / K ** 0.5, torch.randn(N, dtype=dtype)
        assert gemv(x, w).shape == (1, 1, N)
        assert (gemv(x, w) - F.linear(x, w)).abs().max() <= tol
        assert (gemv(x, w, b) - F.linear(x, w, b)).abs().max() <= tol
        gu = torch.randn(1, 2 * K, dtype=dtype)
        g, u = gu.chunk(2, -1)
        assert (gemv(gu, w, gated=True) - F.linear((F.silu(g.float()) * u.float()).to(dtype), w)).abs().max() <= tol


@gpu_or_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", [(640, 384), (100, 300), (4352, 64), (96, 4096)])
def test_few_row_matmul_matches_linear(dtype, N, K):
    """The few-row product a verify round or a draft block takes (2-64 rows: padded,
    exact tiles, and K split into shares or not; sizes off the tiles; none), with bias, and
    gated (silu(gate) * up, the MLP's first half; to 128 rows), against torch in float64;
    on a GPU `ops.linear` and `ops.swiglu`, as the layers call them, take it."""
    from treeflash.kernels.matmul import GATED_MAX_ROWS, MAX_ROWS, matmul
    from treeflash.ops import linear, swiglu
    torch.manual_seed(N + K)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    with torch.device(DEV), torch.no_grad():
        w, b = torch.randn(N, K, dtype=dtype) / K ** 0.5, torch.randn(N, dtype=dtype)
        for M in (2, 17, MAX_ROWS, GATED_MAX_ROWS) if INTERPRET else (2, 16, 17, 33, MAX_ROWS, 65, GATED_MAX_ROWS):
            x = torch.randn(1, M, K, dtype=dtype)
            for bias in (None, b) if M <= MAX_ROWS else ():
                want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
                got = matmul(x, w, bias)
                assert got.shape == (1, M, N) and got.dtype == dtype
                assert (got.double() - want).abs().max() <= tol * want.abs().max(), (M, bias is not None)
                assert not CUDA or torch.equal(linear(x, w, bias), got)
            # gated: w is [gate; up], the MLP's merged projection
            g, u = F.linear(x.double(), w.double(), b.double()).chunk(2, -1)
            want = F.silu(g) * u
            got = matmul(x, w, b, gated=True)
            assert got.shape == (1, M, N // 2) and got.dtype == dtype
            assert (got.double() - want).abs().max() <= 2 * tol * want.abs().max(), M
            assert not CUDA or torch.equal(swiglu(x, w, b), got)
        empty = torch.randn(1, 0, K, dtype=dtype)  # no rows: nothing launched
        assert matmul(empty, w, b).shape == (1, 0, N) and matmul(empty, w, b, gated=True).shape == (1, 0, N // 2)


@gpu_or_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norm_adds_a_split_product_s_shares(dtype):
    """A few-row product whose K is split in shares, asked not to add them
    (`add_shares=False`, as a decoder layer asks for its o and down projections), comes
    back as `SplitSums`; the fused RMSNorm adds them (and the residual) in its own
    launch, bit for bit as the product's own sum followed by the norm. A bias keeps the
    sum in the product's launch."""
    from treeflash.kernels.matmul import matmul
    from treeflash.ops import SplitSums
    from treeflash.ops.fused import add_rms_norm
    torch.manual_seed(1)
    N, K = 256, 1024  # 4 strips of 64 rows: K splits in shares to fill the SMs
    with torch.device(DEV), torch.no_grad():
        w, norm = torch.randn(N, K, dtype=dtype) / K ** 0.5, torch.rand(N, dtype=dtype) + 0.5
        for M in (2, 17):
            x, r = torch.randn(1, M, K, dtype=dtype), torch.randn(1, M, N, dtype=dtype)
            split, y = matmul(x, w, add_shares=False), matmul(x, w)
            assert isinstance(split, SplitSums) and split.parts.shape[0] > 1 and split.shape == (1, M, N)
            assert torch.equal(split.sum(), y)
            for got, want in zip(add_rms_norm(split, norm, 1e-6, residual=r), add_rms_norm(y, norm, 1e-6, residual=r)):
                assert got.shape == want.shape and torch.equal(got, want)
            assert torch.equal(add_rms_norm(split, norm, 1e-6), add_rms_norm(y, norm, 1e-6))
        assert isinstance(matmul(x, w, torch.randn(N, dtype=dtype), add_shares=False), torch.Tensor)


@gpu_or_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 65, 4096), (3, 1000), (1, 1, 7), (3, 20000)])
def test_row_argmax_matches_argmax(dtype, shape):
    """Greedy picks in one launch (two past 8192 entries a row): torch.argmax's index, the
    first among equal maxima, also across the programs that split a row."""
    from treeflash.ops.gumbel_argmax import row_argmax
    x = torch.randint(-40, 40, shape, generator=torch.Generator().manual_seed(shape[-1])).to(dtype)
    # ties for the maximum: in one lane of the 1024-wide blocks (index 5 and 1029, for
    # V = 4096) and across lanes (the last index)
    x[..., 5::1024] = 41
    x[..., -1] = 41
    x[0, ..., 15000 % shape[-1]] = 42  # one row's maximum alone, past the first 8192 entries
    assert torch.equal(row_argmax(x.to(DEV)).cpu(), x.argmax(-1))
    # every entry below 0 (log-probabilities), past 8192 entries: the launch that picks the
    # best of 3 programs pads them to 4, and the padding slot never wins (not a value of 0)
    neg = x - 100
    assert torch.equal(row_argmax(neg.to(DEV)).cpu(), neg.argmax(-1))
    x[..., 5] = float("nan")  # NaN never wins (torch.argmax would take it), not even its own lane
    assert torch.equal(row_argmax(x.to(DEV)).cpu(), x.nan_to_num(float("-inf")).argmax(-1))


@gpu_or_interpreter
@pytest.mark.parametrize("V", [1000, 20000])
def test_gumbel_argmax_matches_reference(V):
    """Sampling by argmax(logits / T + noise), a row split over programs past 8192
    entries (20000: 3 of them, a vocabulary slice from id 5000): the reference noise's
    pick, and plain argmax where T = 0; with a floor (filters), the pick among the
    logits at least the floor, the greedy row's unchanged."""
    from treeflash.engine.sampling import gumbel_noise
    from treeflash.ops.gumbel_argmax import gumbel_argmax
    gen = torch.Generator().manual_seed(V)
    logits = torch.randn(2, 3, V, generator=gen) * 4
    seed, pos = torch.tensor([7, 2 ** 40 + 1]), torch.tensor([[3, 4, 5], [90, 91, 92]])
    temp = torch.tensor([0.0, 0.7])
    values, got = gumbel_argmax(logits.to(DEV), seed.to(DEV), pos.to(DEV), temp.to(DEV), vocab_start=5000,
                                with_values=True)
    noisy = logits / 0.7 + gumbel_noise(seed, pos, 5000, V)
    assert torch.equal(got.cpu()[0], logits[0].argmax(-1)) and torch.equal(got.cpu()[1], noisy[1].argmax(-1))
    assert torch.allclose(values.cpu()[1], noisy[1].amax(-1))
    floor = logits.topk(3, dim=-1).values[..., -1]  # top-3
    got = gumbel_argmax(logits.to(DEV), seed.to(DEV), pos.to(DEV), temp.to(DEV), vocab_start=5000,
                        floor=floor.to(DEV)).cpu()
    top3 = noisy[1].masked_fill(logits[1] < floor[1, :, None], float("-inf")).argmax(-1)
    assert torch.equal(got[0], logits[0].argmax(-1)) and torch.equal(got[1], top3)
    assert not torch.equal(top3, noisy[1].argmax(-1))  # the floor changed a pick
    # a logit equal to the floor is kept: at the row's largest logit (top-k 1) the pick is it
    top1 = gumbel_argmax(logits.to(DEV), seed.to(DEV), pos.to(DEV), temp.to(DEV), vocab_start=5000,
                         floor=logits.amax(-1).to(DEV)).cpu()
    assert torch.equal(top1, logits.argmax(-1))
    # below 1e-6 the temperature is 1e-6, as in the torch path (at 1e-40 every positive logit
    # overflowed to +inf and the lowest such id won): the near-greedy pick
    tiny = gumbel_argmax(logits.to(DEV), seed.to(DEV), pos.to(DEV), torch.tensor([0.0, 1e-40]).to(DEV)).cpu()
    assert torch.equal(tiny[1], logits[1].argmax(-1))


@gpu_or_interpreter
def test_coupled_scores_match_reference():
    """The coupled drafter's scores, logits + T x the target's noise for the same
    position and token (a vocabulary slice from id 5000) up to T = 1, logits / T + noise
    past it, in one pass: the torch reference's values (up to the last ulp of log),
    unchanged for a greedy request, and finite at a temperature of 1e-40 (logits / T
    overflowed)."""
    from treeflash.engine.sampling import gumbel_noise
    from treeflash.ops.gumbel_argmax import coupled_scores
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 5000, generator=gen) * 4
    seed, pos = torch.tensor([7, 2 ** 40 + 1]), torch.tensor([[3, 4, 5], [90, 91, 92]])
    noise = gumbel_noise(seed, pos, 5000, 5000)[1]
    for t in (0.7, 1e-40, 2.0):
        temp = torch.tensor([0.0, t])
        got = coupled_scores(logits.to(DEV), seed.to(DEV), pos.to(DEV), temp.to(DEV), vocab_start=5000).cpu()
        assert torch.equal(got[0], logits[0])
        want = logits[1] / t + noise if t > 1 else logits[1] + torch.tensor(t) * noise
        torch.testing.assert_close(got[1], want, rtol=1e-5, atol=1e-5)
        if t > 1e-30:  # each depth's best is the target's coupled pick, argmax(logits / T + g)
            assert torch.equal(got[1].argmax(-1), (logits[1] / t + noise).argmax(-1))


@gpu_or_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [None, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
                                     {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                      "truncate": False}], ids=["plain", "llama3", "yarn"])
def test_cos_sin_matches_the_rotary_layer(dtype, scaling):
    """RoPE's cos/sin in one launch: on CUDA the very bits of the torch layer (the same
    float32 products, the same libdevice cos/sin; YaRN's attention factor on both), at
    positions up to a million; in the interpreter (numpy's cos) within a float32 rounding."""
    from treeflash.layers.rotary import RotaryEmbedding
    from treeflash.ops.fused import cos_sin
    pos = torch.tensor([[0, 1, 2, 3, 4095, 4096, 131071, 999_999]] * 2) + torch.tensor([[0], [7]])
    pos = pos.to(DEV)
    for D in (128, 80):  # 80: not a power of two, masked lanes
        rot = RotaryEmbedding(D, 5e5, scaling)
        ref = rot.cos_sin(pos, dtype)  # grad enabled: the torch layer
        got = cos_sin(pos, rot.inv_freq.to(DEV), dtype, rot.scale)
        assert (rot.scale > 1.3) == (scaling is not None and "rope_type" in scaling)
        for g, r in zip(got, ref):
            assert g.shape == r.shape == (2, 8, D) and g.dtype == dtype
            assert torch.equal(g, r) if CUDA else (g - r).abs().max() <= 1e-6


@gpu_or_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,H,ids_shape",
                         [(4096, 384, (2, 16)), (10, 64, (1,)), (50, 5000, (3, 7)), (10, 64, (2, 0))])
def test_embedding_rows_match_torch(dtype, rows, H, ids_shape):
    """The embedding lookup in one launch (a row wider than one block: two programs per
    token): F.embedding's rows, repeated ids included, and no ids at all."""
    from treeflash.ops.fused import gather_rows
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(rows, H, generator=g).to(dtype)
    ids = torch.randint(0, rows, ids_shape, generator=g)
    if ids.numel():
        ids.view(-1)[0] = rows - 1
        ids.view(-1)[-1] = ids.view(-1)[0]
    assert torch.equal(gather_rows(weight.to(DEV), ids.to(DEV)).cpu(), F.embedding(ids, weight))


@gpu_or_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,per_row,controls", [(5, False, "both"), (7, True, "both"), (4, False, "bias"),
                                                   (3, True, "penalties")])
def test_logit_controls_match_torch(dtype, rows, per_row, controls):
    """The one-launch bias and penalties equal torch's (within a rounding of the
    division): inputs broadcast over a round's rows from a request's [V] row, or one per
    row (a tree's recomputed columns), a vocabulary past one block, every sign and flag,
    stop tokens held back at some positions only."""
    from treeflash.engine.sampling import SamplingBatch, _controlled
    from treeflash.sampling_params import SamplingParams
    from treeflash.ops.logit_controls import logit_controls
    gen = torch.Generator().manual_seed(rows)
    B, C = 3, 2500
    params = [SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, min_tokens=4,
                             logit_bias={7: 3.0, 2400: -2.5}),
              SamplingParams(repetition_penalty=0.8, allowed_token_ids=list(range(0, C, 3))),
              SamplingParams(frequency_penalty=-1.0, min_tokens=1)]
    sb = SamplingBatch.from_params(params, "cpu", C, [[0, 1]] * B, [{5, 2000}] * B)
    x = (torch.randn(B, rows, C, generator=gen) * 3).to(dtype)
    x[..., :50] = 0.0  # exactly zero logits (unbiased, penalized: they stay 0, no 0 * inf)
    shape = (B, rows if per_row else 1, C)
    positions = torch.arange(rows)[None].repeat(B, 1)  # prompt of 2: rows 0-1 early for request 0 (min_end 6)
    bias = (sb.bias.view(B, 1, C).expand(shape).contiguous(), sb.stop_mask.view(B, 1, C).expand(shape).contiguous(),
            positions + 3) if controls != "penalties" else None
    penalties = (torch.randint(0, 3, shape, generator=gen).float(), torch.rand(shape, generator=gen) < 0.2) \
        if controls != "bias" else None
    want = _controlled(x, sb, bias, penalties)
    dev = lambda t: None if t is None else tuple(u.to(DEV) for u in t)  # noqa: E731
    got = logit_controls(x.to(DEV), None if bias is None else (*dev(bias), sb.min_end.to(DEV)),
                         None if penalties is None else (*dev(penalties), *dev((sb.repetition, sb.frequency,
                                                                               sb.presence)))).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(want).any() == (bias is not None)
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)
    assert not torch.equal(want, x.float())  # the controls did something


@spawns_interpreter
def test_ops_in_the_triton_interpreter():
    run_interpreted(__file__, "gemv_matches or few_row_matmul or rope_into_cache or row_argmax or gumbel_argmax or cos_sin "
                    "or embedding_rows or logit_controls or node_states or path_states or grammar_mask or split_product "
                    "or coupled_scores or filter_floor_kernels or fused_ops_match_torch", 48, timeout=600)


def _grammar_batch(V: int, B: int, seed: int):
    """A SamplingBatch of B requests under one random token automaton over V tokens
    (-1: not allowed), at random committed states."""
    from treeflash.engine.sampling import SamplingBatch
    gen = torch.Generator().manual_seed(seed)
    S = 9
    table = torch.randint(0, S, (S, V), generator=gen, dtype=torch.int32)
    table[torch.rand(S, V, generator=gen) < 0.6] = -1
    table[:, 0] = torch.arange(S, dtype=torch.int32)  # every state allows something
    sb = SamplingBatch(*(torch.zeros(B),) * 5, any_sampled=False, any_filtered=False, guided_rows=S)
    sb.grammar = table
    sb.grammar_state = torch.randint(0, S, (B,), generator=gen)
    return sb


@gpu_or_interpreter
@pytest.mark.parametrize("budget", [1, 15, 40, None], ids=["1", "15", "40", "chain"])
def test_node_states_match_torch(budget):
    """Each tree node's automaton state, one program per request, equals the torch
    walk level by level (random trees from random draft scores, tokens often disallowed;
    these stay within two levels, so also DFlash-linear's chain, down to the last depth)."""
    from dataclasses import replace

    from tree_oracle import chain_of_scores, tree_of_logprobs
    from treeflash.ops.structured import node_states
    B, D, V = 3, 6, 50
    sb = _grammar_batch(V, B, budget or 0)
    gen = torch.Generator().manual_seed(budget or 0)
    scores, anchor = torch.randn(B, D, V, generator=gen), torch.randint(0, V, (B,), generator=gen)
    tree = tree_of_logprobs(scores.log_softmax(-1), anchor, budget) if budget else chain_of_scores(scores, anchor)
    want = sb.node_states(tree.tokens, tree.parents, tree.depths, D)
    if budget is None:  # the last level moves a state: a walk that stops short of it differs
        assert tree.depths.amax() == D and (want[:, D] != sb.grammar_state).any()
    dev = replace(sb, grammar=sb.grammar.to(DEV), grammar_state=sb.grammar_state.to(DEV))
    got = node_states(dev.grammar, dev.grammar_state, *(t.to(DEV) for t in (tree.tokens, tree.parents, tree.depths)),
                      D)
    assert torch.equal(got.cpu(), want)
    assert (want > 0).float().mean() > 0.2 and (want[:, 1:] == 0).any()  # moved, and dead nodes


@gpu_or_interpreter
@pytest.mark.parametrize("K", [1, 16])
def test_path_states_match_torch(K):
    """The drafter's guided path, one program per request: at each depth the first of its
    candidates the state allows (else the first) moves the state; equal to the torch walk."""
    from treeflash.ops.structured import path_states
    B, D, V = 4, 9, 60
    sb = _grammar_batch(V, B, K)
    candidates = torch.randint(1, V, (B, D, K), generator=torch.Generator().manual_seed(K))
    want = sb.path_states(candidates)
    got = path_states(sb.grammar.to(DEV), sb.grammar_state.to(DEV), candidates.to(DEV)).cpu()
    assert torch.equal(got, want)
    assert len(set(want.flatten().tolist())) > 3  # the walk moves through states


@gpu_or_interpreter
@pytest.mark.parametrize("start,C", [(0, 50), (20, 30)])
def test_grammar_mask_matches_torch(start, C):
    """Rows masked in place by their states' table rows (a vocabulary slice from `start`,
    as under tensor parallelism): equal to torch's gather and masked_fill."""
    from treeflash.engine.sampling import grammar_masked
    from treeflash.ops.structured import grammar_mask_
    B, R, V = 3, 5, 50
    sb = _grammar_batch(V, B, start + C)
    gen = torch.Generator().manual_seed(C)
    states = torch.randint(0, sb.grammar.shape[0], (B, R), generator=gen)
    x = torch.randn(B, R, C, generator=gen)
    want = grammar_masked(x, sb, states, start)
    got = grammar_mask_(x.clone().to(DEV), sb.grammar.to(DEV), states.to(DEV), start).cpu()
    assert torch.equal(got, want) and torch.isinf(want).any() and not torch.isinf(x).any()


_FILTERS = [(0.7, 0, 0.9, 0.0), (1.5, -1, 0.5, 0.02), (0.6, 20, 0.95, 0.0), (1.0, 7, 1.0, 0.0), (0.8, 0, 1.0, 0.1),
            (1.0, 0, 0.99, 0.0), (0.0, 0, 0.5, 0.0), (1.0, 0, 1.0, 0.0)]  # (T, top_k, top_p, min_p) per request


@gpu_or_interpreter
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("V", [10, 3000, 20000] if CUDA else [10, 3000])  # a window past V, 1 to 10 spans
def test_filter_floor_kernels_match_the_sort(dtype, V):
    """The GPU floor (`treeflash.ops.filter_floor`: the window's kernel, the mass pass,
    and the search of a top-p without top-k, on peaked and on flat rows) against a sort
    of the whole row in float64: the same logit in nearly every row, a cut within
    float32 rounding of p in all; a top-p row without top-k gets the same floor alone
    as in its batch (its search does not depend on the batch's window)."""
    from sampling_oracle import floor_is_valid
    from treeflash.engine.sampling import SamplingBatch, filter_floor
    from treeflash.ops.filter_floor import filter_floor as fused
    from treeflash.sampling_params import SamplingParams
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1) for t, k, p, m in _FILTERS]
    gen = torch.Generator().manual_seed(V)
    scale = torch.tensor([3.0, 0.3, 2.0, 3.0, 1.0, 0.5, 2.0, 1.0])[:, None, None]  # 0.3, 0.5: flat rows
    x = (torch.randn(len(params), 3, V, generator=gen) * scale).to(dtype)
    x[1, 2] = (x[1, 2] * 8).round() / 8  # many ties
    x[0, 1] = -x[0, 1].abs() - 1  # its largest logits: -0.0 and +0.0
    x[0, 1, :2] = torch.tensor([-0.0, 0.0])
    sb = SamplingBatch.from_params(params, DEV)
    assert sb.filter_width == 64 and sb.any_open_top_p
    with torch.inference_mode():
        vals = x.to(DEV).topk(min(64, V)).values
        vals[0, 1, :2] = torch.tensor([-0.0, 0.0])  # the order a top-k may give them
        got = fused(x.to(DEV), vals, sb).cpu().double()
        alone = [fused(x[b:b + 1].to(DEV), x[b:b + 1].to(DEV).topk(min(16, V)).values,
                       SamplingBatch.from_params([params[b]], DEV)).cpu().double() for b in (0, 1, 5)]
    want = filter_floor(x.double(), SamplingBatch.from_params(params, "cpu"))
    for b, (t, k, p, m) in enumerate(_FILTERS):
        for r in range(3):
            assert floor_is_valid(x[b, r], got[b, r].item(), t, k, p, m), (b, r, got[b, r], want[b, r])
    assert (got == want).sum() >= 19  # of 24: the min-p row (3) is float32 against float64
    for b, row in zip((0, 1, 5), alone):
        assert torch.equal(row[0], got[b])


@gpu_or_interpreter
def test_filter_floor_kernels_reach_a_far_tail():
    """A top-p without top-k whose cut lies far below the top (one peak and a heavy tail
    8 to 9 nats down, at T = 1 and at T = 0.5 with the tail twice as far): the search
    still covers the cut (it leaves out only tokens 40 T below the top)."""
    from sampling_oracle import floor_is_valid
    filters = [(1.0, 0, 0.9, 0.0), (0.5, 0, 0.8, 0.0)]
    gen = torch.Generator().manual_seed(0)
    x = -8.5 + torch.rand(2, 1, 3000, generator=gen) - 0.5
    x[1] *= 0.5
    x[:, :, 7] = 0.0
    got = _fused_floor(x, filters)[0].double()
    for b, (t, k, p, m) in enumerate(filters):
        assert got[b] < -5 * t and floor_is_valid(x[b, 0], got[b].item(), t, k, p, m), (b, got[b])


def _fused_floor(x: torch.Tensor, filters: list[tuple]):
    """(the GPU floor [B] of logits x [B, 1, V] from their 64 largest, the requests'
    SamplingParams) for (T, top_k, top_p, min_p) per request."""
    from treeflash.engine.sampling import SamplingBatch
    from treeflash.ops.filter_floor import filter_floor as fused
    from treeflash.sampling_params import SamplingParams
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, seed=1) for t, k, p, m in filters]
    with torch.inference_mode():
        got = fused(x.to(DEV), x.to(DEV).topk(64).values, SamplingBatch.from_params(params, DEV))
    return got.cpu()[:, 0], params


@gpu_or_interpreter
def test_filter_floor_kernels_search_40_t_below_the_top():
    """At T = 4 a tail 60 nats below the top (15 T: e^-15 of the top's mass each, ~3e-4
    of the row in all) holds the cut of top-p 0.9999: the search leaves out only tokens
    40 T (160 nats) below the top, not 40 nats, and finds the sort's floor."""
    from sampling_oracle import floor_of_sorted_row
    x = torch.full((1, 1, 1000), -60.0)
    x[..., 7] = 0.0
    got, params = _fused_floor(x, [(4.0, 0, 0.9999, 0.0)])
    assert got.tolist() == [floor_of_sorted_row(x[0, 0], params[0])] == [-60.0]


@gpu_or_interpreter
def test_filter_floor_kernels_keep_the_top_where_top_p_rounds_to_0():
    """A top-p below float32's smallest number is valid (p > 0), and a batch holds it as
    0: the row's largest logit stays, as on the torch path (near-greedy), with a top-k or
    without (a batch that searches). The window's sums used to stop before their first tile at p = 0,
    and the floor was +inf: no logit kept, and the sampler took id 0."""
    from treeflash.engine.sampling import SamplingBatch, filter_floor
    tiny = 1e-46
    assert torch.tensor(tiny).item() == 0.0
    x = torch.randn(2, 1, 100, generator=torch.Generator().manual_seed(0))
    got, params = _fused_floor(x, [(1.0, 0, tiny, 0.0), (1.0, 5, tiny, 0.0)])
    want = filter_floor(x.double(), SamplingBatch.from_params(params, "cpu"))[:, 0].float()
    assert torch.equal(got, want) and torch.equal(want, x.amax(-1)[:, 0])


@gpu_or_interpreter
def test_filter_floor_kernels_take_a_top_k_past_the_vocabulary():
    """A top-k of 20 over a vocabulary of 10 (the window holds all 10 logits) keeps every
    token, as the torch path (which clamps k to the window) does: its floor is the row's
    smallest logit, not a value read past the row's window (the next row's, 50 higher)."""
    from treeflash.engine.sampling import SamplingBatch, filter_floor
    from treeflash.ops.filter_floor import filter_floor as fused
    from treeflash.sampling_params import SamplingParams
    x = torch.randn(2, 1, 10, generator=torch.Generator().manual_seed(0))
    x[1] += 50
    params = [SamplingParams(temperature=1.0, top_k=20, seed=1), SamplingParams(temperature=1.0, top_k=3, seed=1)]
    sb = SamplingBatch.from_params(params, DEV)
    assert sb.filter_width > 10
    with torch.inference_mode():
        got = fused(x.to(DEV), x.to(DEV).topk(10).values, sb).cpu()
    want = filter_floor(x.double(), SamplingBatch.from_params(params, "cpu")).float()
    assert want[0, 0] == x[0].min() and torch.equal(got, want)  # the smallest logit: all kept


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_rows_floor_does_not_depend_on_its_batch():
    """Top-p's p set within a few float32 steps of the row's own prefix sums, where a
    change in the order of additions would move the cut: a row's floor is the same
    whichever window its batch reads (16, 64 or 4096 largest logits, or the whole row
    sorted for a top-k past 2048)."""
    from treeflash.engine.sampling import SamplingBatch, filter_floor
    from treeflash.sampling_params import SamplingParams
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(6, 1024, generator=gen) * 2).cuda()
    params, rows = [], []
    for r in range(6):
        for top_k, t in ((20, 0.7), (0, 1.0)):
            v = base[r].double().sort(descending=True).values
            probs = torch.softmax((v - v[0]) / t, 0)[:top_k or 200]
            for c in (probs / probs.sum() if top_k else probs).cumsum(0)[::3].float():
                for step in range(-4, 5):
                    p = (c.view(torch.int32) + step).view(torch.float32).item()
                    if 0 < p < 1:
                        params.append(SamplingParams(temperature=t, top_k=top_k, top_p=p, seed=1))
                        rows.append(r)
    x, n = base[rows][:, None], len(params)
    with torch.inference_mode():
        alone = filter_floor(x, SamplingBatch.from_params(params, "cuda"))
        for k in (40, 2000, 2049):
            sb = SamplingBatch.from_params(params + [SamplingParams(temperature=1.0, top_k=k, seed=1)], "cuda")
            assert sb.filter_width == {40: 128, 2000: 4096, 2049: 0}[k]
            assert torch.equal(filter_floor(torch.cat([x, base[:1, None]]), sb)[:n], alone), k
