"""Mixture-of-experts targets (Qwen3-MoE).

- Tiny checkpoints written by transformers' Qwen3MoeForCausalLM (a mix of dense and
  sparse layers, renormalized or plain top-k, one sharded with tied embeddings) load
  and give transformers' logits (float32, 1e-5) and greedy tokens.
- DFlash and DDTree give exactly the AR tokens (float64) on an MoE target with a shared
  expert; TP = 2 (gloo) gives the TP = 1 tokens and holds half the expert bytes.
- The fused Triton experts kernel equals the torch reference (in the Triton
  interpreter on CPU, through a subprocess; on CUDA in bf16 / float32, and replayed
  from a CUDA graph).
- Bad MoE configs fail with one line; the Kimi-K2-like bench shape fits one H200 and
  its memory floor counts the experts a forward picks.
"""
from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
from conftest import ENGINE_PROMPTS, MOE_TINY, MOE_VARIANTS
from interpreter import CUDA, DEV, run_interpreted, spawns_interpreter
from interpreter import kernel as kernel_test
from test_models import hf_greedy, hf_logits, padded, rel_err, tf_logits
from test_gpu import assert_graphed_equals_eager_and_ar
from test_speculative import assert_drafts_lossless
from test_tp import _run

from treeflash import LLM, SamplingParams, TreeflashError
from treeflash.config import ModelConfig
from treeflash.distributed import TPGroup
from treeflash.models.loader import build_on
from treeflash.bench.shape import KIMI_K2_4L, expected_experts, weight_bytes_read
from treeflash.models.moe import Experts, Router, SparseMoE, experts_reference
from treeflash.models.transformer import MLP, CausalLM

# ----------------------------------------------------------------------------- transformers parity

def test_config_and_layer_kinds_follow_transformers(moe_checkpoint):
    """Which layers are sparse: HF's rule (decoder_sparse_step, mlp_only_layers); the
    expert tensors transformers writes are per expert."""
    from safetensors import safe_open
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    for kw in (dict(decoder_sparse_step=2, mlp_only_layers=[3]), dict(decoder_sparse_step=3), dict(mlp_only_layers=[0, 4])):
        hf_cfg = Qwen3MoeConfig(**{**MOE_TINY, "num_hidden_layers": 6}, num_experts=4, num_experts_per_tok=2, **kw)
        with torch.device("meta"):
            hf = Qwen3MoeForCausalLM(hf_cfg)
        cfg = ModelConfig.from_dict(json.loads(hf_cfg.to_json_string()))
        want = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
        assert [cfg.sparse_layer(i) for i in range(6)] == want, kw
        with torch.device("meta"):
            ours = CausalLM(cfg)
        assert [isinstance(layer.mlp, SparseMoE) for layer in ours.model.layers] == want
    ck = moe_checkpoint("moe")
    cfg = ModelConfig.from_pretrained(ck.path)
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == ("qwen3_moe", 8, 2, 32)
    assert cfg.norm_topk_prob and cfg.mlp_only_layers == [0] and cfg.n_shared_experts == 0
    with safe_open(str(ck.path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in keys and "model.layers.1.mlp.gate.weight" in keys
    assert "model.layers.0.mlp.gate_proj.weight" in keys


@pytest.mark.parametrize("name", list(MOE_VARIANTS))
def test_logits_and_greedy_tokens_match_transformers(moe_checkpoint, name):
    """A padded batch of 3 prompts, cache-free and through the KV cache, against
    transformers per prompt; then 32 greedy tokens per prompt."""
    ck = moe_checkpoint(name)
    llm = LLM(ck.path, device="cpu", dtype="float32")
    prompts = [llm.encode(p) for p in ENGINE_PROMPTS]
    batch = padded(prompts)
    free = tf_logits(llm, batch)
    cached = tf_logits(llm, batch, llm.target.new_cache(3, batch.shape[1] + 4))
    for b, ids in enumerate(prompts):
        ref = hf_logits(ck.model, ids)
        assert rel_err(free[b, :len(ids)], ref) < 1e-5, f"{name} prompt {b} (cache-free)"
        assert rel_err(cached[b, :len(ids)], ref) < 1e-5, f"{name} prompt {b} (KV cache)"
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ck.model, ids, 32)
    assert len(set(outs[1].token_ids)) > 5
    # the routing is not degenerate: every sparse layer uses every expert on these prompts
    picked = []
    for layer in llm.target.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.gate.register_forward_hook(lambda m, args, out: picked.append(out[1]))
    tf_logits(llm, batch)
    assert picked and all(len(ids.unique()) == llm.config.num_experts for ids in picked)


# ----------------------------------------------------------------------------- speculative and TP

@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 24)])
def test_speculative_equals_ar(spec_moe, ar_reference, method, budget):
    assert_drafts_lossless(*spec_moe, method, budget, ar_reference)


@pytest.fixture(scope="module")
def tp_engines(spec_moe):
    """tp -> DDTree engine (float64, budget 12) on the shared-expert MoE target."""
    target, drafter = spec_moe
    built = {tp: LLM(target, draft_model=drafter, method="ddtree", budget=12, device="cpu", dtype="float64", tp=tp)
             for tp in (1, 2)}
    yield built
    for llm in built.values():
        llm.close()


def test_tp2_tokens_equal_tp1(tp_engines):
    for config in ("greedy", "sampled"):
        assert _run(tp_engines[2], config) == _run(tp_engines[1], config), config
    whole = tp_engines[1].target.model.layers[1].mlp.experts
    expert_bytes = sum(p.numel() * p.element_size() for p in whole.parameters()) * 3   # 3 sparse layers
    stats = tp_engines[2].rank_stats()
    total = tp_engines[1].rank_stats()[0]["param_bytes"]
    for s in stats:  # experts, shared experts, attention, vocabulary: sharded; router and norms: not
        assert abs(s["param_bytes"] - total / 2) < 0.02 * total / 2
    assert expert_bytes > 0.2 * total


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("change,message", [
    (dict(num_experts_per_tok=9), r"num_experts_per_tok \(9\) exceeds num_experts \(8\)"),
    (dict(moe_intermediate_size=None), "lacks required key 'moe_intermediate_size'"),
    (dict(num_local_experts=0, num_experts=None), "'num_experts' must be a positive integer"),
    (dict(mlp_only_layers=[4]), r"'mlp_only_layers' must list layer ids 0\.\.3"),
    (dict(norm_topk_prob="yes"), "'norm_topk_prob' must be true or false"),
    (dict(n_shared_experts=-1), "'n_shared_experts' must be an integer >= 0"),
    (dict(decoder_sparse_step=0), "'decoder_sparse_step' must be a positive integer"),
])
def test_bad_moe_configs_fail_in_one_line(moe_checkpoint, clone_checkpoint, change, message):
    folder = clone_checkpoint(moe_checkpoint("moe").path, **change)
    with pytest.raises(TreeflashError, match=message) as e:
        LLM(folder, device="cpu")
    assert "\n" not in str(e.value)


def test_a_null_norm_topk_prob_is_false_as_in_transformers(moe_checkpoint, clone_checkpoint):
    folder = clone_checkpoint(moe_checkpoint("moe").path, norm_topk_prob=None)
    assert ModelConfig.from_pretrained(folder).norm_topk_prob is False


def test_published_num_experts_key(moe_checkpoint, clone_checkpoint):
    """Published Qwen3-MoE configs say `num_experts`; transformers 5 writes `num_local_experts`."""
    folder = clone_checkpoint(moe_checkpoint("moe").path, num_local_experts=None, num_experts=8)
    assert ModelConfig.from_pretrained(folder).num_experts == 8


def test_unshardable_experts_fail_before_workers_start(moe_checkpoint, clone_checkpoint):
    folder = clone_checkpoint(moe_checkpoint("moe").path, moe_intermediate_size=31)
    start = time.monotonic()
    with pytest.raises(TreeflashError, match=r"moe_intermediate_size \(31\) is not divisible by the "
                                             r"tensor-parallel size 2"):
        LLM(folder, device="cpu", tp=2)
    assert time.monotonic() - start < 5   # refused on 'meta' modules, before any worker starts


def test_missing_expert_weight(moe_checkpoint, clone_checkpoint):
    folder = clone_checkpoint(moe_checkpoint("moe").path, n_shared_experts=1)
    with pytest.raises(TreeflashError, match=r"weight model\.layers\.1\.mlp\.shared_experts\.gate_proj\.weight "
                                             r"is missing"):
        LLM(folder, device="cpu")


# ----------------------------------------------------------------------------- the block

def _moe_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                head_dim=24, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32)
    return ModelConfig("qwen3_moe", **{**base, **kw})


def _filled(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.3)
    return module


def test_router_softmax_topk_and_renormalization():
    x = torch.randn(5, 16, dtype=torch.float64)
    for renorm in (False, True):
        r = _filled(Router(16, 6, 3, renorm).double(), 0)
        w, ids = r(x)
        probs = torch.softmax(x @ r.weight.T, -1)
        want = probs.topk(3, -1)
        assert torch.equal(ids, want.indices)
        expect = want.values / want.values.sum(-1, keepdim=True) if renorm else want.values
        torch.testing.assert_close(w, expect)
    for renorm in (False, True):   # bf16: softmax and renormalization in float32, cast back (as transformers)
        r = _filled(Router(16, 6, 3, renorm), 0).bfloat16()
        w, ids = r(x.bfloat16())
        want = (x.bfloat16() @ r.weight.T).float().softmax(-1).topk(3, -1)
        expect = want.values / want.values.sum(-1, keepdim=True) if renorm else want.values
        assert torch.equal(ids, want.indices) and w.dtype == torch.bfloat16 and torch.equal(w, expect.bfloat16())


def test_shared_expert_joins_the_routed_sum():
    cfg = _moe_cfg(n_shared_experts=2)
    with build_on("cpu", torch.float64):
        shared = MLP(cfg, TPGroup(), 2 * 32, bias=False)
        moe = SparseMoE(cfg, TPGroup(), shared)
    _filled(moe, 1)
    x = torch.randn(2, 3, 48, dtype=torch.float64)
    w, ids = moe.gate(x.reshape(-1, 48))
    routed = experts_reference(x.reshape(-1, 48), w, ids, moe.experts.gate_up_proj, moe.experts.down_proj)
    torch.testing.assert_close(moe(x), (routed + shared(x.reshape(-1, 48))).view(2, 3, 48))


def test_reference_equals_a_plain_per_token_loop():
    gen = torch.Generator().manual_seed(3)
    E, k, H, I, T = 5, 2, 8, 6, 9
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    gu, dn = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64), torch.randn(E, H, I, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen, dtype=torch.float64)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            g, u = (gu[e] @ x[t]).chunk(2)
            want[t] += w[t, j] * (dn[e] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(experts_reference(x, w, ids, gu, dn), want)
    # every expert on every token (what a CUDA graph captures): the same sums
    torch.testing.assert_close(experts_reference(x, w, ids, gu, dn, every_expert=True), want)


# ----------------------------------------------------------------------------- the kernel

def _case(T, E, k, H, I, dtype, skew=False, seed=0, device="cpu"):
    """x, routing weights, ids (distinct per token; `skew`: nearly all pairs on experts
    0 and 1, so one expert spans several row blocks), gate_up, down."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=gen)
    if skew:
        scores[:, :2] += 1
    ids = scores.topk(k, -1).indices
    w = torch.rand(T, k, generator=gen)
    x = torch.randn(T, H, generator=gen)
    gu = torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5
    dn = torch.randn(E, H, I, generator=gen) / I ** 0.5
    return [t.to(device, dtype) if t.is_floating_point() else t.to(device) for t in (x, w, ids, gu, dn)]


def _check_kernel(case, tol):
    from treeflash.kernels.fused_moe import fused_experts
    x, w, ids, gu, dn = case
    out = fused_experts(x, w, ids, gu, dn)
    ref = experts_reference(*(t.double() if t.is_floating_point() else t for t in (x, w, ids, gu, dn)))
    assert out.shape == x.shape and out.dtype == x.dtype
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, f"relative error {err}"


# T = 1 (decode), a few tokens, more pairs than experts, skewed routing, sizes that are
# not multiples of the tiles, top-1
# one token (the rows-times-vector path), twice: sizes on and off the tiles
KERNEL_CASES = [(1, 8, 2, 64, 32, False), (1, 6, 3, 80, 24, False), (7, 16, 4, 48, 40, False),
                (40, 4, 2, 32, 16, True), (33, 6, 1, 80, 24, False)]
KERNEL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3}   # relative to the output's largest value


@kernel_test
@pytest.mark.parametrize("T,E,k,H,I,skew", KERNEL_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])   # the interpreter has no working bf16 dot
def test_kernel_matches_reference(T, E, k, H, I, skew, dtype):
    case = _case(T, E, k, H, I, dtype, skew, seed=T, device="cuda" if CUDA else "cpu")
    _check_kernel(case, KERNEL_TOL[dtype])


@kernel_test
@pytest.mark.parametrize("T", [1, 5])   # one token (its picks added in the kernel), the grouped kernels
def test_kernel_adds_a_tokens_picks_in_float32(T):
    """float16, each token's two picks nearly cancel (equal routing weights; expert 1 is
    expert 0 with its down projection negated, plus 1/64 of another): each pick is ~64x
    the sum. Rounded to float16 (2^-11) before they were added, the sum would be off by
    ~64 * 2^-11 = 3% of itself; added in float32 and rounded once, it is within the
    float16 tolerance."""
    I = 32
    x, w, ids, gu, dn = _case(T, 2, 2, 48, I, torch.float32, seed=T)
    gen = torch.Generator().manual_seed(T)
    gu[1], w[:, 1] = gu[0], w[:, 0]
    dn[1] = torch.randn(dn[0].shape, generator=gen) / I ** 0.5 / 64 - dn[0]
    _check_kernel([t.to(DEV, torch.float16) if t.is_floating_point() else t.to(DEV) for t in (x, w, ids, gu, dn)],
                  KERNEL_TOL[torch.float16])


# (T, E, k, skew, one launch): one token; a tree's worth; the most pairs the grouping
# kernel takes (E = 384: 8 pairs per chunk, 64 chunks), pairs piled on two experts, E not
# a power of two; several chunks and a ragged last one; every expert picked (k = E);
# past the kernel's pairs (torch sorts)
ROUTING_CASES = [(1, 8, 2, False, True), (16, 128, 8, False, True), (64, 384, 8, True, True),
                 (33, 6, 3, True, True), (13, 384, 3, False, True), (5, 7, 7, False, True),
                 (65, 384, 8, False, False)]


@kernel_test
@pytest.mark.parametrize("T,E,k,skew,one_launch", ROUTING_CASES)
def test_group_pairs_kernel_matches_a_stable_sort(T, E, k, skew, one_launch):
    from treeflash.kernels.fused_moe import group_pairs, groups_in_one_launch
    assert groups_in_one_launch(T * k, E) == one_launch
    ids = _case(T, E, k, 8, 8, torch.float32, skew, seed=T, device="cuda" if CUDA else "cpu")[2]
    order, bounds = group_pairs(ids, E)
    sorted_ids, want = ids.reshape(-1).sort(stable=True)
    assert torch.equal(order.cpu(), want.cpu())
    assert torch.equal(bounds.cpu(), torch.searchsorted(sorted_ids, torch.arange(E + 1, device=ids.device),
                                                         out_int32=True).cpu())


@kernel_test
@pytest.mark.parametrize("T,E,k,skew,_", ROUTING_CASES)
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_kernel_matches_the_router(T, E, k, skew, _, renormalize):
    """The kernel's picks and weights are the torch Router's (float32 logits; skewed: a
    few experts far ahead of the rest)."""
    from treeflash.kernels.fused_moe import route
    gen = torch.Generator().manual_seed(T + E)
    logits = torch.randn(T, E, generator=gen) * (4 if skew else 1)
    probs = logits.softmax(-1)
    want = probs.topk(k, -1)
    want_w = want.values / want.values.sum(-1, keepdim=True) if renormalize else want.values
    w, ids = route(logits.to("cuda" if CUDA else "cpu"), k, renormalize)
    assert torch.equal(ids.cpu(), want.indices)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-5, atol=1e-7)


@kernel_test
def test_route_kernel_on_ties_and_nan():
    """Equal logits: the lowest expert ids first. A NaN logit makes every probability NaN
    (as in torch): the weights are NaN, and the picks are still k distinct experts."""
    from treeflash.kernels.fused_moe import route
    dev = "cuda" if CUDA else "cpu"
    w, ids = route(torch.zeros(2, 6, device=dev), 3, False)
    assert ids.tolist() == [[0, 1, 2]] * 2 and torch.allclose(w.cpu(), torch.full((2, 3), 1 / 6))
    w, ids = route(torch.tensor([[0.0, float("nan"), 1.0, 2.0]], device=dev), 2, False)
    assert len(set(ids[0].tolist())) == 2 and w.isnan().all()


# (arch, FP8 block): gpt-oss (router and expert biases, renormalized top-k, the clamp);
# Qwen3-MoE (plain top-k) with FP8 experts in blocks the kernels take, and 24 columns
# wide, which they do not take (the experts run in torch)
LAYER_CASES = [("gpt_oss", None), ("qwen3_moe", (16, 16)), ("qwen3_moe", (16, 24))]


@kernel_test
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("arch,fp8_block", LAYER_CASES)
def test_sparse_moe_on_the_kernels_equals_its_torch_path(monkeypatch, arch, fp8_block, T):
    """The layer hands the kernels what its torch path uses (the router's bias and
    renormalization, the experts' biases, clamp and FP8 scales), and keeps FP8 blocks
    the kernels do not take on the torch path."""
    import treeflash.models.moe as moe
    cfg = _moe_cfg(norm_topk_prob=arch == "gpt_oss")
    if arch == "gpt_oss":
        cfg = dataclasses.replace(cfg, arch="gpt_oss", expert_bias=True, swiglu_limit=7.0)   # gpt-oss's limit
    with build_on(DEV, torch.float32):
        layer = SparseMoE(cfg, TPGroup())
    if fp8_block:
        layer.experts.to_fp8(fp8_block, "mlp.experts")
    _filled(layer, T)
    if arch == "gpt_oss":   # gate / up pre-activations ~ 8 * 0.3 * sqrt(48) = 17: the clamp bites
        layer.experts.gate_up_proj.mul_(8)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)).to(DEV)
    got = {}
    for fused in (True, False):
        monkeypatch.setattr(moe, "fused_enabled", lambda t: fused)
        with torch.no_grad():
            got[fused] = layer(x)
    err = ((got[True] - got[False]).abs().max() / got[False].abs().max()).item()
    assert err < KERNEL_TOL[torch.float32], f"relative error {err}"
    if arch == "gpt_oss":   # what that rests on: the clamp bites (on the torch path, without it the output differs)
        layer.experts.clamp = None
        with torch.no_grad():
            assert not torch.allclose(layer(x), got[False])


def test_dependent_launches_only_where_the_gpu_has_them(monkeypatch):
    """`kernels.chained`: dependent launches on sm_90 and later; plain ones on older GPUs
    (the wait would not compile), for CPU tensors, and in the Triton interpreter, even
    for a CUDA tensor."""
    pytest.importorskip("triton")
    from treeflash.kernels.chained import _chained
    decide = _chained.__wrapped__   # not cached
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: [(8, 0), (9, 0)][index])
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert decide("cuda", 0) == decide("cpu", None) == {"PDL": False}
    assert decide("cuda", 1) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert decide("cuda", 1) == {"PDL": False}


@spawns_interpreter
def test_kernel_in_the_triton_interpreter():
    run_interpreted(__file__, "kernel_matches_reference or group_pairs_kernel or route_kernel or kernel_adds or "
                              "sparse_moe_on_the_kernels",
                    2 * len(KERNEL_CASES) + 3 * len(ROUTING_CASES) + 1 + 2 + 2 * len(LAYER_CASES))


# ----------------------------------------------------------------------------- bench shape

def test_kimi_shape_fits_one_h200_and_counts_picked_experts():
    cfg = KIMI_K2_4L
    with build_on("meta", torch.bfloat16):
        model = CausalLM(cfg)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 100e9 < total < 112e9   # 139 GiB = 149 GB on an H200: room for a drafter, KV and activations
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.model.layers] == [False, True, True, True]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    body = total - 2 * cfg.vocab_size * cfg.hidden_size * 2
    all_experts = len(experts) * cfg.num_experts * per_expert
    assert weight_bytes_read(model, 1) == pytest.approx(body - all_experts + len(experts) * 8 * per_expert)
    assert expected_experts(384, 8, 1) == pytest.approx(8)
    assert expected_experts(384, 8, 256) == pytest.approx(384 * (1 - (1 - 8 / 384) ** 256))
    assert weight_bytes_read(model, 10 ** 6) == pytest.approx(body)
    with torch.device("meta"):  # TP 8 shards it
        CausalLM(cfg, TPGroup(0, 8))
    # in FP8 (128 x 128 blocks) a picked expert reads 1 byte per weight and its scales
    with build_on("meta", torch.bfloat16):
        fp8 = CausalLM(dataclasses.replace(cfg, fp8_block=(128, 128)))
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    per_expert = 3 * H * I + 4 * (2 * I // 128 * H // 128 + H // 128 * I // 128)
    assert weight_bytes_read(fp8, 1) == weight_bytes_read(fp8, 10 ** 6) - len(experts) * (384 - 8) * per_expert
    assert 0.5 < weight_bytes_read(fp8, 1) / weight_bytes_read(model, 1) < 0.51


def test_weight_bytes_of_a_dense_model_are_its_body():
    cfg = _moe_cfg(num_experts=0)
    with build_on("meta", torch.float32):
        model = CausalLM(cfg)
    skip = {"model.embed_tokens.weight", "lm_head.weight"}
    assert weight_bytes_read(model, 7) == sum(p.numel() * 4 for n, p in model.named_parameters() if n not in skip)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 16, 256, 1024])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float32, 1e-5)])
def test_gpu_kernel_at_model_sizes(T, dtype, tol):
    """Kimi-K2 expert sizes at TP 8 (I = 256 per rank; E = 384, k = 8), H cut to 1024."""
    _check_kernel(_case(T, 384, 8, 1024, 256, dtype, seed=T, device="cuda"), tol)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_kernel_replays_from_a_cuda_graph():
    from treeflash.kernels.fused_moe import fused_experts
    static = _case(16, 64, 8, 512, 128, torch.bfloat16, seed=1, device="cuda")
    x, w, ids, gu, dn = static
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):   # compile outside the capture
        fused_experts(x, w, ids, gu, dn)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w, ids, gu, dn)
    for seed in (2, 3):
        new = _case(16, 64, 8, 512, 128, torch.bfloat16, skew=seed == 3, seed=seed, device="cuda")
        for buf, value in zip(static, new):
            buf.copy_(value)
        graph.replay()
        ref = experts_reference(*(t.double() if t.is_floating_point() else t for t in new))
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_reference_without_host_sync_equals_cpu():
    """The GPU torch path under graph capture (float64 models) runs every expert,
    weighted 0 where not picked."""
    case = _case(9, 6, 2, 32, 16, torch.float64, seed=4)
    got = experts_reference(*(t.cuda() for t in case), every_expert=True)
    torch.testing.assert_close(got.cpu(), experts_reference(*case))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("method,budget", [("ar", None), ("ddtree", 24)])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-experts", "fp8-experts"])
def test_gpu_engine_graphs_match_eager(spec_moe, method, budget, fp8, tmp_path):
    """Also with the target's experts (and other layers) in block-scaled FP8."""
    from treeflash.checkpoints import write_fp8_copy
    target, drafter = spec_moe
    if fp8:
        target = write_fp8_copy(target, tmp_path / "fp8", block=(16, 16))
    assert_graphed_equals_eager_and_ar(target, drafter, method, budget, ["def fib(n):", "import os", "x"], 32)
