"""gpt-oss targets (GptOssForCausalLM): attention sinks, sliding-window layers, YaRN,
biased experts with a clamped SwiGLU, and MXFP4 experts as OpenAI publishes them.

- A tiny checkpoint written by transformers (float32; window shorter than the prompts,
  sinks and biases far from 0, a SwiGLU clamp that bites) gives transformers' logits,
  cache-free and through the KV cache, and its greedy tokens.
- Its MXFP4 copy loads to exactly the weights transformers' own dequantization gives.
- DFlash and DDTree give exactly the AR tokens (float64); TP = 2 gives the TP = 1 tokens.
- Bad gpt-oss configs and weights fail in one line.
- On the GPU (Triton attention with sinks and windows, fused experts with biases and the
  clamp): CUDA graphs give the eager tokens, and both give the AR tokens.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers  # the oracle: 4.55 or later has gpt-oss (the test extra asks for it)
from conftest import ENGINE_PROMPTS
from interpreter import CUDA
from test_models import hf_greedy, hf_logits, padded, rel_err, tf_logits
from test_gpu import assert_graphed_equals_eager_and_ar
from test_speculative import assert_drafts_lossless, spec_llm

from treeflash import LLM, SamplingParams, TreeflashError, UsageError
from treeflash.checkpoints import mxfp4_blocks, write_mxfp4_copy, write_random_drafter, write_tiny_tokenizer
from treeflash.layers.attention import AttentionInputs
from treeflash.models.moe import GptOssExperts, SparseMoE, mxfp4_dequantized


YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32}
GPT_OSS_TINY = dict(vocab_size=260, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                    max_position_embeddings=256, initializer_range=0.3, swiglu_limit=1.5,
                    bos_token_id=0, eos_token_id=0, pad_token_id=1,
                    # transformers 5 names RoPE's keys rope_parameters, 4 rope_scaling and rope_theta
                    **(dict(rope_parameters={**YARN, "rope_theta": 150000.0})
                       if int(transformers.__version__.split(".")[0]) >= 5
                       else dict(rope_scaling=YARN, rope_theta=150000.0)))


def _write_gpt_oss(folder, seed: int = 0, **overrides):
    """A random GptOssForCausalLM saved by transformers, with sinks and biases ~N(0, 0.5)
    (transformers' init leaves them near 0, where a missing sink or bias would pass)."""
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(seed)
    cfg = {**GPT_OSS_TINY, **overrides}
    model = GptOssForCausalLM(GptOssConfig(**cfg)).float().eval()
    for experts in (m for m in model.modules() if hasattr(m, "limit")):
        experts.limit = cfg["swiglu_limit"]  # transformers before 5.2x clamps at 7.0 whatever the config says
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")):
                p.normal_(0, 0.5)
    write_tiny_tokenizer(folder)
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(folder, transformers model) of the tiny gpt-oss checkpoint."""
    folder = tmp_path_factory.mktemp("gpt-oss")
    return folder, _write_gpt_oss(folder)


@pytest.fixture(scope="module")
def spec_gpt_oss(gpt_oss, tmp_path_factory):
    """(target, drafter): the tiny gpt-oss with a peaked LM head (ids 3..10 boosted, so
    random drafts get accepted) and a random 1-layer DFlash drafter of block size 8."""
    from safetensors.torch import load_file, save_file
    src, _ = gpt_oss
    target = tmp_path_factory.mktemp("spec-gpt-oss")
    for f in src.iterdir():
        if f.is_file():
            (target / f.name).write_bytes(f.read_bytes())
    w = load_file(str(src / "model.safetensors"))
    w["lm_head.weight"][3:11] *= 10
    save_file(w, str(target / "model.safetensors"))
    return target, write_random_drafter(target, target / "drafter", num_layers=1, block_size=8, seed=2)


# ----------------------------------------------------------------------------- transformers parity


def test_logits_and_greedy_tokens_match_transformers(gpt_oss):
    folder, model = gpt_oss
    llm = LLM(folder, device="cpu", dtype="float32")
    cfg = llm.config
    assert (cfg.sliding_layers, cfg.sliding_window, cfg.attention_sinks) == ((0, 2), 6, True)
    prompts = [llm.encode(p) for p in ENGINE_PROMPTS]
    assert max(len(p) for p in prompts) > 2 * cfg.sliding_window
    batch = padded(prompts)
    free = tf_logits(llm, batch)
    cached = tf_logits(llm, batch, llm.target.new_cache(3, batch.shape[1] + 4))
    for b, ids in enumerate(prompts):
        ref = hf_logits(model, ids)
        assert rel_err(free[b, :len(ids)], ref) < 1e-5, f"prompt {b} (cache-free)"
        assert rel_err(cached[b, :len(ids)], ref) < 1e-5, f"prompt {b} (KV cache)"
    outs = llm.generate(ENGINE_PROMPTS, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, ids, 24)
    # what the parity rests on is used: the SwiGLU clamp bites (gate above the limit, up
    # past it, in experts that were picked), and without the window the logits would differ
    gate, up = [], []

    def pre_activations(experts, args, out):
        x, _, ids = args
        for e in ids.unique().tolist():
            rows = (ids == e).any(-1)
            h = x[rows] @ experts.gate_up_proj[e].T + experts.gate_up_proj_bias[e]
            gate.append(h[:, :h.shape[1] // 2].max())
            up.append(h[:, h.shape[1] // 2:].abs().max())
    for layer in llm.target.model.layers:
        assert isinstance(layer.mlp.experts, GptOssExperts)
        layer.mlp.experts.register_forward_hook(pre_activations)
    tf_logits(llm, batch)
    assert max(gate) > cfg.swiglu_limit and max(up) > cfg.swiglu_limit
    for layer in llm.target.model.layers:
        layer.self_attn.window = None
    ids = prompts[0]
    assert rel_err(tf_logits(llm, torch.tensor([ids]))[0], hf_logits(model, ids)) > 1e-3


@pytest.mark.parametrize("split", [4, 9])
def test_a_block_after_a_prefix_matches_transformers(gpt_oss, split):
    """Decode and verify attend over a cached prefix with positions (the window's
    reference mask, not the prefill's): a causal block of more tokens than the window
    after a prefix gives transformers' logits of the whole prompt."""
    folder, model = gpt_oss
    llm = LLM(folder, device="cpu", dtype="float32")
    ids = llm.encode(ENGINE_PROMPTS[1])
    assert len(ids) - split > llm.config.sliding_window
    cache = llm.target.new_cache(1, len(ids) + 4)
    with torch.no_grad():
        llm.target(torch.tensor([ids[:split]]), AttentionInputs.causal(torch.arange(split)[None], kv_len=split), cache)
        inputs = AttentionInputs.causal(torch.arange(split, len(ids))[None], prefix_lens=torch.tensor([split]),
                                        kv_len=len(ids))
        assert not inputs.is_prefill
        h, _ = llm.target(torch.tensor([ids[split:]]), inputs, cache)
    assert rel_err(llm.target.logits(h)[0], hf_logits(model, ids)[split:]) < 1e-5


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_with_sinks_in_chunks_equals_one_pass(monkeypatch, window, masked):
    """Long prompts go through the hand-written softmax (SDPA has no sinks) in query
    chunks against only the keys each chunk sees: the same as one pass over all."""
    import treeflash.layers.attention as attention
    gen = torch.Generator().manual_seed(0)
    B, H, Hkv, T, D = 2, 6, 2, 37, 8
    q, k, v = (torch.randn(B, n, T, D, generator=gen, dtype=torch.float64) for n in (H, Hkv, Hkv))
    sinks = torch.randn(H, generator=gen, dtype=torch.float64)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    seen = (j <= i) & (j > i - window) if window else j <= i
    mask = (seen & (torch.rand(B, T, T, generator=gen) < 0.8) | (i == j)) if masked else None
    full = seen.expand(B, T, T) if mask is None else mask
    kk, vv = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = (q @ kk.transpose(-1, -2) * 0.3).masked_fill(~full[:, None], float("-inf"))
    p = torch.cat([s, sinks[None, :, None, None].expand(B, H, T, 1)], -1).softmax(-1)[..., :-1]
    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", B * H * 48)   # chunks of one to a few queries
    got = attention._attention(q, k, v, mask, 0.3, sinks, None if masked else window)
    torch.testing.assert_close(got, p @ vv)


def test_mxfp4_experts_load_as_transformers_dequantizes_them(gpt_oss, tmp_path):
    """The published form: experts as MXFP4 blocks and scales. Loaded, they are exactly
    the weights transformers' dequantization gives, and the model gives the logits of
    those weights."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    folder, _ = gpt_oss
    mx = write_mxfp4_copy(folder, tmp_path / "mxfp4")
    stored = load_file(str(mx / "model.safetensors"))
    assert stored["model.layers.1.mlp.experts.down_proj_blocks"].dtype == torch.uint8
    assert "model.layers.1.mlp.experts.down_proj" not in stored
    # transformers' dequantization of the same bytes, in its layout ([E, in, out])
    plain = dict(stored)
    for key in [k for k in stored if k.endswith("_blocks")]:
        name = key.removesuffix("_blocks")
        plain[name] = convert_moe_packed_tensors(plain.pop(key), plain.pop(name + "_scales"), dtype=torch.float32)
    (tmp_path / "plain").mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (tmp_path / "plain" / f.name).write_bytes(f.read_bytes())
    save_file(plain, str(tmp_path / "plain" / "model.safetensors"))
    ours, theirs = LLM(mx, device="cpu", dtype="float32"), LLM(tmp_path / "plain", device="cpu", dtype="float32")
    for a, b in zip(ours.target.parameters(), theirs.target.parameters()):
        assert torch.equal(a, b)
    # quantization is not the identity: some weights moved, none by more than a step
    original = LLM(folder, device="cpu", dtype="float32").target.model.layers[1].mlp.experts.gate_up_proj
    moved = (ours.target.model.layers[1].mlp.experts.gate_up_proj - original).abs()
    assert moved.max() > 0 and moved.max() <= original.abs().max() / 2
    batch = padded([ours.encode(p) for p in ENGINE_PROMPTS])
    assert torch.equal(tf_logits(ours, batch), tf_logits(theirs, batch))


def test_mxfp4_round_trip_is_exact_on_representable_values():
    values = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]).repeat(8) * torch.tensor(
        [1.0, -1.0]).repeat_interleave(32) * 2.0 ** torch.arange(-2, 0).repeat_interleave(32)
    blocks, scales = mxfp4_blocks(values.view(1, 64))
    assert blocks.shape == (1, 2, 16) and scales.shape == (1, 2)
    assert torch.equal(mxfp4_dequantized(blocks, scales, torch.float32), values.view(1, 64))


def test_mxfp4_scales_keep_every_value_within_half_a_step():
    """Each group of 32 gets the scale that brings its largest value within e2m1's range
    (6), not past it (a smaller one clips it): every value of real weights then lies at
    most half the widest e2m1 step (1, between 4 and 6) times the scale from its code."""
    w = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0))
    blocks, scales = mxfp4_blocks(w)
    step = torch.exp2(scales.float() - 127)
    error = (mxfp4_dequantized(blocks, scales, torch.float32) - w).abs().unflatten(-1, (-1, 32))
    assert (error <= step[..., None]).all()


# ----------------------------------------------------------------------------- speculative and TP


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 16)])
def test_speculative_equals_ar(spec_gpt_oss, ar_reference, method, budget):
    assert_drafts_lossless(*spec_gpt_oss, method, budget, ar_reference)


def test_prefix_caching_gives_the_tokens_of_a_whole_prefill(spec_gpt_oss):
    """A next turn prefills only its new tokens, from a cached prefix longer than the
    window, at the positions the sliding layers' masks read."""
    target, drafter = spec_gpt_oss
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    cached = spec_llm(target, drafter, "ddtree", 12, enable_prefix_caching=True)
    fresh = spec_llm(target, drafter, "ddtree", 12)
    first = cached.encode(ENGINE_PROMPTS[1])
    answer = cached.generate(first, params)[0]
    turn = first + answer.token_ids + cached.encode(" more", special=False)
    got = cached.generate(turn, params)[0]
    assert got.stats["cached_tokens"] == len(first) + len(answer.token_ids) - 1 > 3 * cached.config.sliding_window
    assert got.token_ids == fresh.generate(turn, params)[0].token_ids


def test_tp2_tokens_equal_tp1(spec_gpt_oss):
    """Sinks cut by heads, experts by their intermediate size, the down bias added once."""
    target, drafter = spec_gpt_oss
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(target, draft_model=drafter, method="ddtree", budget=12, device="cpu", dtype="float64", tp=tp)
        try:
            outs[tp] = [o.token_ids for o in llm.generate(ENGINE_PROMPTS, params)]
        finally:
            llm.close()
    assert outs[1] == outs[2]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["sliding_attention"]), "'layer_types' must name full_attention or sliding_attention "
                                              "for each of the 4 layers"),
    (dict(sliding_window=0), "'sliding_window' must be a positive integer"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok \(5\) exceeds num_local_experts \(4\)"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "yarn rope scaling lacks 'factor'"),
    # without its own, YaRN's original context is max_position_embeddings (as transformers reads it)
    (dict(rope_parameters={**YARN, "original_max_position_embeddings": None}, max_position_embeddings=None),
     "yarn rope scaling lacks 'original_max_position_embeddings'"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     "gpt-oss is supported unquantized or with MXFP4 experts, not with quant_method 'fp8'"),
    (dict(swiglu_limit=-1), "'swiglu_limit' must be a number > 0"),
])
def test_bad_gpt_oss_configs_fail_in_one_line(gpt_oss, clone_checkpoint, change, message):
    folder = clone_checkpoint(gpt_oss[0], **change)
    with pytest.raises(TreeflashError, match=message) as e:
        LLM(folder, device="cpu")
    assert "\n" not in str(e.value)


def test_a_config_that_leaves_keys_out_takes_gpt_oss_defaults(gpt_oss):
    """gpt-oss's own defaults (transformers' GptOssConfig: YaRN at theta 150000, eps 1e-5,
    head size 64) for keys a config leaves out, not Llama's; a given rope_theta gets the
    default YaRN, as in transformers."""
    from transformers import GptOssConfig
    from treeflash.config import ModelConfig
    cfg = json.loads((gpt_oss[0] / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "rms_norm_eps", "head_dim"):
        cfg.pop(key, None)
    ours, theirs = ModelConfig.from_dict(cfg), GptOssConfig(**cfg)
    rope = theirs.to_dict().get("rope_parameters") or {**theirs.rope_scaling, "rope_theta": theirs.rope_theta}
    assert (ours.rms_norm_eps, ours.head_dim, ours.rope_theta) == (theirs.rms_norm_eps, theirs.head_dim,
                                                                   rope["rope_theta"]) == (1e-5, 64, 150000.0)
    for key in ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings"):
        assert ours.rope_scaling[key] == rope[key]
    given = ModelConfig.from_dict({**cfg, "rope_theta": 5e5})
    assert given.rope_theta == GptOssConfig(**cfg, rope_theta=5e5).rope_parameters["rope_theta"] == 5e5
    assert given.rope_scaling == ours.rope_scaling


def test_bad_gpt_oss_weights_and_options_fail_in_one_line(gpt_oss, tmp_path, clone_checkpoint):
    from safetensors.torch import load_file, save_file
    folder, _ = gpt_oss
    with pytest.raises(UsageError, match="quantization fp8 is not supported for gpt-oss"):
        LLM(folder, device="cpu", quantization="fp8")
    mx = write_mxfp4_copy(folder, tmp_path / "mxfp4")
    w = load_file(str(mx / "model.safetensors"))
    w["model.layers.2.mlp.experts.down_proj_scales"] = w["model.layers.2.mlp.experts.down_proj_scales"].float()
    save_file(w, str(mx / "model.safetensors"))
    with pytest.raises(TreeflashError, match=r"weight model\.layers\.2\.mlp\.experts\.down_proj_scales has dtype "
                                             r"torch\.float32, expected uint8 \(MXFP4\)"):
        LLM(mx, device="cpu")
    del w["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(w, str(mx / "model.safetensors"))
    with pytest.raises(TreeflashError, match=r"weight model\.layers\.2\.mlp\.experts\.down_proj_scales is missing"):
        LLM(mx, device="cpu")
    both = load_file(str(folder / "model.safetensors"))   # a hand-edited copy may hold both forms
    both.update(load_file(str(write_mxfp4_copy(folder, tmp_path / "mx2") / "model.safetensors")))
    save_file(both, str(mx / "model.safetensors"))
    with pytest.raises(TreeflashError, match=r"holds both model\.layers\.0\.mlp\.experts\.gate_up_proj and "
                                             r"model\.layers\.0\.mlp\.experts\.gate_up_proj_blocks"):
        LLM(mx, device="cpu")
    _write_gpt_oss(tmp_path / "i40", intermediate_size=40)
    w = load_file(str(tmp_path / "i40" / "model.safetensors"))
    for i in range(4):
        E, I, H = w.pop(f"model.layers.{i}.mlp.experts.down_proj").shape
        w[f"model.layers.{i}.mlp.experts.down_proj_blocks"] = torch.zeros(E, H, 2, 16, dtype=torch.uint8)
        w[f"model.layers.{i}.mlp.experts.down_proj_scales"] = torch.full((E, H, 2), 127, dtype=torch.uint8)
    save_file(w, str(tmp_path / "i40" / "model.safetensors"))
    with pytest.raises(TreeflashError, match=r"down_proj_blocks: MXFP4 groups 32 input features, and 40 is not a "
                                             r"multiple of 32"):
        LLM(tmp_path / "i40", device="cpu")
    wrong = clone_checkpoint(folder, intermediate_size=64)
    with pytest.raises(TreeflashError, match=r"weight model\.layers\.0\.mlp\.experts\.gate_up_proj has shape "
                                             r"\[4, 64, 64\], expected \[4, 64, 128\]"):
        LLM(wrong, device="cpu")
    qwen = json.loads((folder / "config.json").read_text())
    qwen.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", quantization_config={"quant_method": "mxfp4"})
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps(qwen))
    with pytest.raises(TreeflashError, match="MXFP4 quantization is supported only for gpt-oss experts"):
        LLM(tmp_path / "qwen", device="cpu")


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("method,budget", [("ar", None), ("dflash", None), ("ddtree", 24)])
def test_gpu_engine_graphs_match_eager(method, budget, tmp_path):
    """Head size 64 (the Triton attention's, with sinks and the window), window 8."""
    from safetensors.torch import load_file, save_file
    _write_gpt_oss(tmp_path, seed=3, head_dim=64, sliding_window=8)
    w = load_file(str(tmp_path / "model.safetensors"))
    w["lm_head.weight"][3:11] *= 10
    save_file(w, str(tmp_path / "model.safetensors"))
    drafter = write_random_drafter(tmp_path, tmp_path / "drafter", num_layers=1, block_size=8, seed=2)
    prompts = ["def fib(n):", "import os\nimport sys\n\nclass Point:", "x"]
    graphed = assert_graphed_equals_eager_and_ar(tmp_path, drafter, method, budget, prompts, 40)
    assert graphed.target.model.layers[0].self_attn.window == 8
    assert any(isinstance(m, SparseMoE) for m in graphed.target.modules())


def test_tree_branches_deeper_than_the_window_match_transformers_on_their_paths(gpt_oss):
    """DDTree's verify block: a tree node sits at position n + depth, not at n + its slot,
    and its window counts positions along its own path. A root with two branches of 8
    tokens (the second's slots 8 past its depths), window 6: every node gets the logits
    transformers gives the prompt followed by that node's path."""
    folder, model = gpt_oss
    llm = LLM(folder, device="cpu", dtype="float32")
    W = llm.config.sliding_window
    ids = llm.encode(ENGINE_PROMPTS[1])
    n, depth = 10, 8
    assert depth > W and len(ids) > n + depth
    root, first, second = ids[n], ids[n + 1:n + 1 + depth], [5 + i for i in range(depth)]
    tokens = [root] + first + second
    T = len(tokens)
    positions = torch.tensor([n] + [n + d for d in range(1, depth + 1)] * 2)
    mask = torch.zeros(T, T, dtype=torch.bool)
    mask[:, 0] = True
    for branch in (range(1, depth + 1), range(depth + 1, T)):
        for i in branch:
            mask[i, branch.start:i + 1] = True
    cache = llm.target.new_cache(1, n + T)
    with torch.no_grad():
        llm.target(torch.tensor([ids[:n]]), AttentionInputs.causal(torch.arange(n)[None], kv_len=n), cache)
        inputs = AttentionInputs(positions[None], torch.tensor([n]), mask[None], kv_len=n + T)
        logits = llm.target.logits(llm.target(torch.tensor([tokens]), inputs, cache)[0])[0]
    want_first = hf_logits(model, ids[:n + 1 + depth])[n:]
    want_second = hf_logits(model, ids[:n + 1] + second)[n + 1:]
    assert rel_err(logits[:depth + 1], want_first) < 1e-5
    assert rel_err(logits[depth + 1:], want_second) < 1e-5


# ------------------------------------------------------------------------------ MXFP4 experts under TP


@pytest.mark.parametrize("intermediate", [32, 64], ids=["rank-slices-inside-a-group", "rank-slices-on-group-edges"])
def test_mxfp4_experts_under_tp2_give_the_tp1_tokens(gpt_oss, tmp_path, intermediate):
    """The published MXFP4 experts on 2 ranks: each rank dequantizes its own slice of the
    down projection's 32-value groups (half an expert's intermediate size: a slice that
    starts inside a group, or on a group's edge), and TP = 2 gives the TP = 1 tokens."""
    folder = gpt_oss[0]
    if intermediate != GPT_OSS_TINY["intermediate_size"]:
        folder = tmp_path / "wide"
        _write_gpt_oss(folder, intermediate_size=intermediate)
    mx = write_mxfp4_copy(folder, tmp_path / "mxfp4")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(mx, device="cpu", dtype="float64", tp=tp)
        try:
            outs[tp] = [o.token_ids for o in llm.generate(ENGINE_PROMPTS, params)]
        finally:
            llm.close()
    assert outs[1] == outs[2]
