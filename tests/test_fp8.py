"""Block-scaled FP8 checkpoints (quantization_config fp8 with weight_block_size, as
Qwen3-FP8 and DeepSeek-V3 publish them) load as they are and run:

- the logits equal transformers' on the dequantized weights (float32), with blocks that
  do not divide the matrices, and with layers left unquantized (the stored dtypes say which);
- DFlash and DDTree give AR's tokens on an FP8 target, greedy and sampled;
- mixture-of-experts targets (Qwen3-MoE-FP8's per-expert layout) too: transformers'
  logits, speculative = AR, TP = 2 = TP = 1 with half the expert bytes per rank;
- what cannot be loaded is refused in one line: other quantizations, a missing or
  misshapen scale, a block that straddles merged tensors (or experts' gate and up, or
  ranks), a quantized drafter.

On a GPU (skipped without CUDA): the Triton kernels that read FP8 weights as they are
(dense and grouped experts) match the product with the dequantized weights, and
CUDA-graph rounds on an FP8 target (dense and MoE) give the eager tokens.
"""
from __future__ import annotations

import copy
import json
import re

import pytest
import torch
from conftest import ENGINE_PROMPTS
from interpreter import DEV, run_interpreted, spawns_interpreter
from interpreter import kernel as kernel_test
from safetensors.torch import load_file, save_file

from treeflash import LLM, SamplingParams
from treeflash.checkpoints import fp8_blocks, write_fp8_copy
from treeflash.errors import TreeflashError
from treeflash.ops import FP8_MAX, Fp8Weight, dequantized


def _hf_weight(model, key: str) -> torch.Tensor:
    """The tensor of transformers' `model` that checkpoint tensor `key` loads into: a
    layer's weight, or one expert's slice of the experts' stacked gate_up / down."""
    expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", key)
    if expert is None:
        return model.get_submodule(key.removesuffix(".weight")).weight
    experts, e = model.get_submodule(expert[1]), int(expert[2])
    if expert[3] == "down":
        return experts.down_proj[e]
    return experts.gate_up_proj[e].chunk(2)[expert[3] == "up"]


def _dequantized_model(hf_model, folder, dtype=torch.float64):
    """transformers' model (in `dtype`) with every FP8 weight of `folder` put back."""
    model = copy.deepcopy(hf_model).to(dtype)
    stored = load_file(str(folder / "model.safetensors"))
    block = tuple(json.loads((folder / "config.json").read_text())["quantization_config"]["weight_block_size"])
    quantized = [k for k, v in stored.items() if v.dtype == torch.float8_e4m3fn]
    assert quantized
    with torch.no_grad():
        for key in quantized:
            _hf_weight(model, key).copy_(dequantized(stored[key], Fp8Weight(stored[key + "_scale_inv"], block),
                                                     dtype))
    return model, quantized


def _check_against_dequantized(llm, reference, original):
    """The engine's logits (a padded batch through the KV cache) are transformers' on the
    dequantized weights (`reference`) to 1e-5, visibly not the unquantized `original`'s,
    and its greedy tokens are the reference's."""
    from test_models import hf_logits, padded, rel_err, tf_logits
    prompts = [llm.encode(p) for p in ENGINE_PROMPTS]
    batch = padded(prompts)
    cached = tf_logits(llm, batch, llm.target.new_cache(3, batch.shape[1] + 4))
    for b, ids in enumerate(prompts):
        want = hf_logits(reference, ids)
        assert rel_err(cached[b, :len(ids)], want) < 1e-5, b
        assert rel_err(hf_logits(original, ids), want) > 1e-3, "the FP8 rounding changed nothing: a vacuous test"
    ids = prompts[1]
    out = llm.generate([ids], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    assert out.token_ids == reference.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16,
                                               eos_token_id=None, pad_token_id=1)[0, len(ids):].tolist()


def test_blocks_round_trip():
    """fp8 * scale is the weight to FP8's precision (3 mantissa bits), for blocks that
    do not divide the matrix too; values below e4m3's normal range (2^-6 of the scale)
    to half its smallest step, 2^-10 of the scale."""
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(0))
    w[0, :5] = torch.tensor([3e-5, -1e-4, 0.0, 2e-3, -5e-3])  # tiny beside the block's largest
    for block in ((16, 32), (128, 128), (7, 9)):
        q, scale = fp8_blocks(w, block)
        assert q.dtype == torch.float8_e4m3fn and scale.shape == (-(-40 // block[0]), -(-70 // block[1]))
        back = dequantized(q, Fp8Weight(scale, block), torch.float32)
        per_weight = scale.repeat_interleave(block[0], 0)[:40].repeat_interleave(block[1], 1)[:, :70]
        assert ((back - w).abs() <= w.abs() / 16 + per_weight * 2 ** -10).all()


def test_blocks_take_fp8_s_whole_range_and_keep_zero_blocks():
    """Each block's largest magnitude is stored as FP8's largest value (its scale is that
    magnitude over FP8_MAX: the round trip's bound above is relative to the scale), and
    a block of zeros (pruned or padding weights) is stored as zeros, not 0 / 0."""
    w = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    w[4:, 6:] = 0.0  # the last of the four (4, 6) blocks
    q, scale = fp8_blocks(w, (4, 6))
    largest = q.float().abs().view(2, 4, 2, 6).amax(dim=(1, 3))
    assert torch.equal(largest, torch.tensor([[FP8_MAX, FP8_MAX], [FP8_MAX, 0.0]]))
    assert torch.equal(dequantized(q, Fp8Weight(scale, (4, 6)), torch.float32)[4:, 6:], torch.zeros(4, 6))


def test_the_kernels_take_blocks_a_power_of_two_of_16_columns_or_more():
    """Which FP8 weights the GPU kernels read as they are: scale blocks whose columns are a
    power of two, 16 or more (any rows); the others (DeepSeek's 128 x 128 fits, a 48- or
    8-column block does not) are dequantized first, with a warning on CUDA."""
    from treeflash.ops import fp8_kernels_fit
    for block in ((128, 128), (1, 16), (7, 32), (16, 1024)):
        assert fp8_kernels_fit(block) and Fp8Weight(torch.ones(1, 1), block).fits_kernels, block
    for block in ((128, 8), (16, 4), (32, 48), (128, 96), (128, 1)):
        assert not fp8_kernels_fit(block) and not Fp8Weight(torch.ones(1, 1), block).fits_kernels, block


@pytest.mark.parametrize("name,block,skip", [("qwen3", (16, 32), ()), ("qwen3", (32, 48), ()),
                                             ("llama-tied-bias", (16, 16), ("mlp",))])
def test_logits_equal_transformers_on_the_dequantized_weights(hf_checkpoint, tmp_path, name, block, skip):
    ck = hf_checkpoint(name)
    folder = write_fp8_copy(ck.path, tmp_path / "fp8", block=block, skip=skip)
    reference, quantized = _dequantized_model(ck.model, folder)
    assert all(not any(s in k for s in skip) for k in quantized) and (not skip or len(quantized) < 7 * 2)
    llm = LLM(folder, device="cpu", dtype="float64")
    qkv = llm.target.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.block == block
    mlp = llm.target.model.layers[0].mlp.down_proj
    assert (mlp.weight.dtype == torch.float64) == bool(skip)
    _check_against_dequantized(llm, reference, ck.model)


@pytest.mark.parametrize("listed", [None, ["model.layers.*.mlp"], ["model.layers.0"]], ids=["none", "regex", "prefix"])
def test_the_stored_dtypes_say_which_layers_are_fp8(hf_checkpoint, tmp_path, listed):
    """Writers read modules_to_not_convert differently (transformers 4 as substrings,
    transformers 5 as prefixes, regexes or suffixes: "model.layers.1" is not layer 10's),
    and some leave it out: the checkpoint's own dtypes say which layers are FP8. Its MLPs
    stored in float32 load as such, whatever the list says (each of these was refused)."""
    ck = hf_checkpoint("llama-tied-bias")
    folder = write_fp8_copy(ck.path, tmp_path / "fp8", block=(16, 16), skip=("mlp",))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].pop("modules_to_not_convert")
    if listed is not None:
        config["quantization_config"]["modules_to_not_convert"] = listed
    (folder / "config.json").write_text(json.dumps(config))
    reference, _ = _dequantized_model(ck.model, folder)
    llm = LLM(folder, device="cpu", dtype="float64")
    layer = llm.target.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.down_proj.weight.dtype == layer.mlp.gate_up_proj.weight.dtype == torch.float64
    _check_against_dequantized(llm, reference, ck.model)


def test_speculative_methods_give_ar_tokens_on_an_fp8_target(spec_target, spec_drafter, tmp_path):
    target = write_fp8_copy(spec_target(), tmp_path / "fp8", block=(16, 32))
    drafter = spec_drafter()
    params = [SamplingParams(max_new_tokens=40), SamplingParams(max_new_tokens=40, temperature=1.0, seed=3),
              SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=5)]
    _check_speculative_equals_ar(target, drafter, [[5, 6, 7, 8], [100, 3, 9], [42]], params, "float32")


def _check_speculative_equals_ar(target, drafter, prompts, params, dtype):
    """DFlash and DDTree give AR's tokens, and some drafts were accepted."""
    ar = [o.token_ids for o in LLM(target, device="cpu", dtype=dtype).generate(prompts, params)]
    taus = []
    for method in ("dflash", "ddtree"):
        outs = LLM(target, draft_model=drafter, method=method, budget=64 if method == "ddtree" else None,
                   device="cpu", dtype=dtype).generate(prompts, params)
        assert [o.token_ids for o in outs] == ar, method
        taus += [o.stats["tau"] for o in outs]
    assert max(taus) > 1.2, "no draft was accepted: the comparison would not see a wrong verify"


# --- mixture of experts ---

def test_moe_logits_equal_transformers_on_the_dequantized_weights(moe_checkpoint, tmp_path):
    """Experts stored per expert in FP8 with their scales (Qwen3-MoE-FP8's layout), the
    router unquantized as published (it is not a `*_proj`), a dense first layer in FP8
    too. In float32: transformers' experts have no float64 path."""
    ck = moe_checkpoint("moe")
    folder = write_fp8_copy(ck.path, tmp_path / "fp8", block=(16, 16))
    reference, quantized = _dequantized_model(ck.model, folder, torch.float32)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in quantized
    assert "model.layers.0.mlp.gate_proj.weight" in quantized and "model.layers.1.mlp.gate.weight" not in quantized
    llm = LLM(folder, device="cpu", dtype="float32")
    experts = llm.target.model.layers[1].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.gate_up_proj_scale_inv.shape == (8, 4, 4)
    _check_against_dequantized(llm, reference, ck.model)


@pytest.fixture(scope="module")
def fp8_spec_moe(spec_moe, tmp_path_factory):
    """The shared-expert MoE target of test_moe in FP8 (16 x 16 blocks), and its drafter."""
    target, drafter = spec_moe
    return write_fp8_copy(target, tmp_path_factory.mktemp("fp8-moe"), block=(16, 16)), drafter


def test_speculative_methods_give_ar_tokens_on_an_fp8_moe_target(fp8_spec_moe):
    target, drafter = fp8_spec_moe
    params = [SamplingParams(max_new_tokens=32, ignore_eos=True),
              SamplingParams(max_new_tokens=32, temperature=1.0, seed=3, ignore_eos=True)]
    _check_speculative_equals_ar(target, drafter, [[5, 6, 7, 8], [100, 3, 9]], params, "float64")


def test_fp8_moe_tp2_equals_tp1_with_half_the_experts_per_rank(fp8_spec_moe):
    from test_tp import _run
    target, drafter = fp8_spec_moe
    engines = {tp: LLM(target, draft_model=drafter, method="ddtree", budget=12, device="cpu", dtype="float64", tp=tp)
               for tp in (1, 2)}
    try:
        for config in ("greedy", "sampled"):
            assert _run(engines[2], config) == _run(engines[1], config), config
        whole = engines[1].target.model.layers[1].mlp.experts
        assert whole.down_proj.dtype == torch.float8_e4m3fn and whole.down_proj_scale_inv.shape == (8, 4, 2)
        total = engines[1].rank_stats()[0]["param_bytes"]
        models = (engines[1].target, engines[1].drafter)
        replicated = sum(p.numel() * p.element_size() for m in models for n, p in m.named_parameters()
                         if "norm" in n or n.endswith("mlp.gate.weight"))   # norms and routers
        assert [s["param_bytes"] for s in engines[2].rank_stats()] == [(total - replicated) // 2 + replicated] * 2
    finally:
        for llm in engines.values():
            llm.close()


def test_fp8_experts_that_a_block_would_straddle_are_refused(moe_checkpoint, tmp_path):
    ck = moe_checkpoint("moe")   # moe_intermediate_size 32; attention and layer 0 left unquantized
    with pytest.raises(TreeflashError, match=r"experts\.\*\.gate_proj and up_proj: FP8 block size 64 does not "
                                             r"divide its 32 output features of one merged part"):
        LLM(write_fp8_copy(ck.path, tmp_path / "a", block=(64, 16), skip=("self_attn", "layers.0.")), device="cpu")
    with pytest.raises(TreeflashError, match=r"experts\.\*\.down_proj: FP8 block size 32 does not divide its 16 "
                                             r"input features per rank"):
        LLM(write_fp8_copy(ck.path, tmp_path / "b", block=(16, 32)), device="cpu", tp=2)
    with pytest.raises(TreeflashError, match="stores some of the experts of model.layers.1.mlp.experts in FP8 and "
                                             "some in higher precision"):
        LLM(write_fp8_copy(ck.path, tmp_path / "c", block=(16, 16), skip=("experts.3.",)), device="cpu")
    # a block that no tensor-parallel size could cut is not blamed on the size
    from treeflash.config import ModelConfig
    from treeflash.distributed import TPGroup
    from treeflash.models.moe import Experts
    cfg = ModelConfig.from_pretrained(ck.path)
    with torch.device("meta"):
        experts = Experts(cfg, TPGroup(0, 2))
    with pytest.raises(TreeflashError, match="64 does not divide its 32 output features of one merged part"):
        experts.to_fp8((64, 16), "x")


# --- quantization="fp8": a checkpoint in higher precision, quantized while loading ---

def _same_parameters(a, b):
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name, p in pa.items():
        assert p.dtype == pb[name].dtype, name
        bits = (lambda t: t.view(torch.uint8)) if p.dtype == torch.float8_e4m3fn else (lambda t: t)
        assert torch.equal(bits(p), bits(pb[name])), name


@pytest.fixture(scope="module")
def wide_pair(tmp_path_factory):
    """A dense target and an MoE target (its experts 128 wide) whose layers cut into 128 x
    128 blocks, also per rank at TP = 2, and a drafter for the dense one."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from conftest import MOE_TINY
    from treeflash.checkpoints import write_random_drafter, write_random_target, write_tiny_tokenizer
    root = tmp_path_factory.mktemp("wide")
    write_tiny_tokenizer(root / "dense")
    dense = write_random_target(root / "dense", hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4,
                                head_dim=64, intermediate_size=512, vocab_size=260, peaked_tokens=8, std=0.2)
    moe = root / "moe"
    write_tiny_tokenizer(moe)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**{**MOE_TINY, "hidden_size": 128, "num_key_value_heads": 4, "head_dim": 32,
                            "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2},
                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True)
    Qwen3MoeForCausalLM(cfg).save_pretrained(moe)
    return dense, moe, write_random_drafter(dense, root / "drafter", num_layers=1, block_size=8)


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_quantization_fp8_holds_what_an_fp8_checkpoint_holds(wide_pair, tmp_path, which):
    """Quantized while loading, the layers (attention, MLP, experts) are bit for bit
    those of the same checkpoint converted to FP8 128 x 128 blocks beforehand; so are
    the generated tokens."""
    src = wide_pair[0] if which == "dense" else wide_pair[1]
    online = LLM(src, device="cpu", dtype="float32", quantization="fp8")
    stored = LLM(write_fp8_copy(src, tmp_path / "fp8", block=(128, 128)), device="cpu", dtype="float32")
    plain = LLM(src, device="cpu", dtype="float32")
    assert online.target.model.layers[-1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    if which == "moe":
        assert online.target.model.layers[1].mlp.experts.down_proj.dtype == torch.float8_e4m3fn
    _same_parameters(online.target, stored.target)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    tokens = [o.token_ids for o in online.generate([[5, 6, 7], [42]], params)]
    assert tokens == [o.token_ids for o in stored.generate([[5, 6, 7], [42]], params)]
    bytes_of = [sum(p.numel() * p.element_size() for p in m.target.parameters()) for m in (online, plain)]
    assert bytes_of[0] < 0.6 * bytes_of[1]   # float32 layers became one byte per weight


def test_quantization_fp8_under_tp_and_with_a_drafter(wide_pair):
    """Each rank quantizes its own slice (TP = 2 gives TP = 1's tokens); the drafter
    stays as it is stored; DDTree gives AR's tokens."""
    from test_tp import _run
    dense, _, drafter = wide_pair
    engines = {tp: LLM(dense, draft_model=drafter, method="ddtree", budget=12, device="cpu", dtype="float64", tp=tp,
                       quantization="fp8") for tp in (1, 2)}
    try:
        for config in ("greedy", "sampled"):
            assert _run(engines[2], config) == _run(engines[1], config), config
        assert engines[1].drafter.fc.weight.dtype == torch.float64
    finally:
        for llm in engines.values():
            llm.close()
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    _check_speculative_equals_ar(dense, drafter, [[5, 6, 7, 8], [100, 3, 9]], params, "float64")


def test_quantization_fp8_is_refused_where_blocks_cannot_cut(hf_checkpoint, wide_pair, capsys):
    from treeflash.cli import main
    from treeflash.errors import UsageError
    with pytest.raises(UsageError, match="unknown quantization 'int4' \\(supported: fp8\\)"):
        LLM(wide_pair[0], device="cpu", quantization="int4")
    # q 64 rows, k and v 32: a 128-row block would straddle them
    with pytest.raises(TreeflashError, match="qkv_proj: FP8 block size 128 does not divide its 64 output features"):
        LLM(hf_checkpoint("qwen3").path, device="cpu", quantization="fp8")
    assert main(["generate", "--model", str(wide_pair[0]), "--quantization", "fp8", "--device", "cpu",
                 "--max-new-tokens", "4", "--method", "ar", "x"]) == 0
    assert main(["generate", "--model", str(wide_pair[0]), "--quantization", "awq", "--device", "cpu", "x"]) == 2
    capsys.readouterr()
    assert main(["bench", "--model", str(wide_pair[0]), "--draft-model", str(wide_pair[2]), "--methods", "ar,ddtree",
                 "--budgets", "8", "--num-prompts", "1", "--max-new-tokens", "8", "--batch-sizes", "1",
                 "--graphs", "off", "--temperatures", "0", "--quantization", "fp8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "ddtree" in out and "on cpu (float32, fp8 weights)" in out  # the header says so; the rows: test_bench


def _damaged(tmp_path, hf_checkpoint, change, block=(16, 32)):
    folder = write_fp8_copy(hf_checkpoint("qwen3").path, tmp_path / "fp8", block=block)
    w = load_file(str(folder / "model.safetensors"))
    change(w)
    save_file(w, str(folder / "model.safetensors"))
    return folder


SCALE = "model.layers.0.self_attn.k_proj.weight_scale_inv"


@pytest.mark.parametrize("change,words", [
    (lambda w: w.pop(SCALE), [SCALE, "missing"]),
    (lambda w: w.update({SCALE: w[SCALE][:1]}), [SCALE, "shape"]),
    (lambda w: w.update({SCALE.replace("_scale_inv", ""): w[SCALE.replace("_scale_inv", "")].float()}),
     ["k_proj", "some in higher precision", "one merged layer"]),
    (lambda w: w.update({"model.layers.0.self_attn.o_proj.weight": w["model.layers.0.self_attn.o_proj.weight"]
                         .view(torch.uint8).to(torch.float8_e4m3fn).view(torch.uint8).fill_(0x7F)
                         .view(torch.float8_e4m3fn)}), ["o_proj.weight", "NaN"]),
], ids=["missing-scale", "scale-shape", "not-fp8", "nan"])
def test_a_damaged_fp8_checkpoint_is_refused_in_one_line(tmp_path, hf_checkpoint, change, words):
    folder = _damaged(tmp_path, hf_checkpoint, change)
    with pytest.raises(TreeflashError) as e:
        LLM(folder, device="cpu", dtype="float32")
    assert all(w in str(e.value) for w in words) and "\n" not in str(e.value), str(e.value)


def test_what_fp8_cannot_hold_is_refused(tmp_path, hf_checkpoint, spec_target, spec_drafter):
    ck = hf_checkpoint("qwen3")  # q 128, k and v 64 rows: a 48-row block straddles q and k
    with pytest.raises(TreeflashError, match="block size 48 does not divide its 128 output features of one merged"):
        LLM(write_fp8_copy(ck.path, tmp_path / "a", block=(48, 32)), device="cpu")
    with pytest.raises(TreeflashError, match="stores some of .*q_proj.* in FP8 and some in higher precision"):
        LLM(write_fp8_copy(ck.path, tmp_path / "b", block=(16, 32), skip=("q_proj",)), device="cpu")
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    for f in spec_drafter().iterdir():
        (drafter / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [16, 16]}}))
    with pytest.raises(TreeflashError, match="drafter .* is quantized"):
        LLM(spec_target(), draft_model=drafter, method="dflash", device="cpu")


def test_bench_times_an_fp8_shape(capsys, tmp_path):
    """The header and every --out row say the weights were FP8, and in which blocks."""
    from treeflash.cli import main
    rows = tmp_path / "rows.jsonl"
    assert main(["bench", "--shape", "tiny", "--fp8", "16x16", "--contexts", "32", "--budgets", "0,7",
                 "--iters", "1", "--device", "cpu", "--out", str(rows)]) == 0
    out = capsys.readouterr().out
    assert "shape tiny fp8 16x16" in out and "verify" in out
    assert {json.loads(line)["fp8"] for line in rows.read_text().splitlines()} == {"16x16"}
    assert main(["bench", "--shape", "tiny", "--fp8", "big", "--device", "cpu"]) == 2
    assert "ROWSxCOLS" in capsys.readouterr().err
    assert main(["bench", "--fp8", "--device", "cpu"]) == 2
    assert "--fp8 applies to --shape only" in capsys.readouterr().err
    assert main(["bench", "--shape", "tiny", "--quantization", "fp8", "--device", "cpu"]) == 2
    assert "--quantization applies to model-pair mode" in capsys.readouterr().err


# --- GPU ---

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N,K,block", [(1000, 700, (128, 128)), (256, 512, (16, 32)), (96, 4096, (128, 128)),
                                       (4096, 1024, (128, 64)), (200, 96, (64, 32))])
def test_fp8_kernels_match_the_dequantized_product(dtype, N, K, block):
    """Every row count a round uses (one row: the GEMV, gated too; 2-300: the tiled
    product, up to 64 rows also gated into silu(gate) * up), with and without bias, sizes
    off the tiles and the scale blocks."""
    from treeflash.kernels.matmul import matmul
    from treeflash.ops import gated_linear
    torch.manual_seed(N + K)
    w, scale = fp8_blocks(torch.randn(N, K) / K ** 0.5, block)
    w, scale, b = w.cuda(), scale.cuda(), torch.randn(N, device="cuda", dtype=dtype)
    ref_w = dequantized(w, Fp8Weight(scale, block), torch.float32)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for M in (1, 2, 17, 64, 300):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        x[0, :K // 2] *= 50  # the first token's first blocks of features on a larger scale
        for bias in (None, b):
            want = torch.nn.functional.linear(x.float(), ref_w, None if bias is None else bias.float())
            got = matmul(x[:, None] if M == 1 else x, w, bias, scale, block).view(M, N)
            assert got.dtype == dtype
            assert (got.float() - want).abs().max() <= tol * want.abs().max(), (M, bias is not None)
        if (N // 2) % block[0] == 0 and M <= 64:  # gated: the MLP's [gate; up] in one launch
            g, u = torch.nn.functional.linear(x.float(), ref_w, b.float()).chunk(2, -1)
            want = torch.nn.functional.silu(g) * u
            got = matmul(x, w, b, scale, block, gated=True)
            assert got.shape == (M, N // 2) and (got.float() - want).abs().max() <= 2 * tol * want.abs().max(), M
    gu = torch.randn(1, 2 * K, device="cuda", dtype=dtype)
    g, u = gu.float().chunk(2, -1)
    want = torch.nn.functional.linear((torch.nn.functional.silu(g) * u).to(dtype).float(), ref_w)
    got = gated_linear(gu, w, Fp8Weight(scale, block))
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


def _check_fp8_experts(T, E, k, H, I, block, dtype, device, nan_after_scales=False):
    """The grouped-experts kernel on FP8 experts against the reference on the dequantized
    experts (float64). `nan_after_scales`: the memory after each scale tensor (not its
    own) holds NaN."""
    from test_moe import _case

    from treeflash.kernels.fused_moe import fused_experts
    from treeflash.models.moe import experts_reference
    x, w, ids, gu, dn = _case(T, E, k, H, I, dtype, skew=T == 40, seed=T, device=device)
    (gu, gu_s), (dn, dn_s) = ([torch.stack(t) for t in zip(*(fp8_blocks(m.float(), block) for m in mats))]
                              for mats in (gu, dn))
    if nan_after_scales:
        gu_s, dn_s = (torch.cat([s.flatten(), torch.full(s.shape[-1:], torch.nan, device=device)])[:s.numel()]
                      .view(s.shape) for s in (gu_s, dn_s))
    fp8 = (Fp8Weight(gu_s, block), Fp8Weight(dn_s, block))
    out = fused_experts(x, w, ids, gu, dn, fp8)
    ref = experts_reference(x.double(), w.double(), ids, gu, dn, fp8)
    assert out.shape == x.shape and out.dtype == dtype
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 2e-2), err


# Scale blocks narrower than the kernel's 128-column step (read one sub-step per block),
# one as wide, sizes off the tiles and the blocks, skewed routing (T = 40), one token
@kernel_test
@pytest.mark.parametrize("T,E,k,H,I,block", [(7, 16, 4, 200, 96, (32, 64)), (40, 4, 2, 96, 48, (16, 32)),
                                             (3, 4, 2, 96, 64, (32, 128)), (1, 16, 4, 200, 96, (32, 64))])
def test_fp8_experts_kernel_matches_the_dequantized_reference(T, E, k, H, I, block):
    _check_fp8_experts(T, E, k, H, I, block, torch.float32, DEV)


@kernel_test
@pytest.mark.parametrize("T", [1, 5])   # the one-token kernels, the grouped ones
def test_fp8_experts_kernel_reads_no_scale_past_a_row(T):
    """H = 96 and I = 80 in 32-column blocks (3 a row): the kernels' last K step runs past
    each row's last block (a step of 128 columns, 4 blocks; one token: the next power of
    two). Every expert is picked, the last too, whose last scale row ends the tensor:
    what lies after it (NaN here) does not reach the output."""
    _check_fp8_experts(T, 4, 4, 96, 80, (16, 32), torch.float32, DEV, nan_after_scales=True)


@spawns_interpreter
def test_fp8_experts_kernel_in_the_triton_interpreter():
    run_interpreted(__file__, "fp8_experts_kernel_matches or fp8_experts_kernel_reads", 4 + 2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,E,k,H,I,block", [(1, 384, 8, 1024, 256, (128, 128)), (16, 384, 8, 1024, 256, (128, 128)),
                                             (256, 384, 8, 1024, 256, (128, 128)), (7, 16, 4, 200, 96, (32, 64)),
                                             (5, 8, 2, 136, 80, (16, 16)), (1, 8, 2, 136, 80, (16, 16))])
def test_gpu_fp8_experts_kernel_at_model_sizes(dtype, T, E, k, H, I, block):
    """Kimi-K2-like experts (384, 8 per token; widths cut to H = 1024, I = 256: K2's
    expert at TP 8), 128 x 128 blocks: decode and trees of 16 and 256 tokens; and blocks
    narrower than the kernel's step, with partial last blocks, in bf16 too."""
    _check_fp8_experts(T, E, k, H, I, block, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_graphs_match_eager(tmp_path, dtype):
    """An FP8 target (128 x 128 blocks) on the device: graphed rounds give the eager
    tokens for every method, and in float32 DFlash and DDTree give AR's."""
    from treeflash.checkpoints import write_random_drafter, write_random_target
    target = write_random_target(tmp_path / "t", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                 head_dim=64, intermediate_size=512, peaked_tokens=8, std=0.2)
    drafter = write_random_drafter(target, tmp_path / "d", num_layers=2, block_size=8)
    target = write_fp8_copy(target, tmp_path / "fp8", block=(128, 128))
    prompts = [[5, 6, 7], [100, 3, 9, 12, 40], [42]]
    params = [SamplingParams(max_new_tokens=40, temperature=t, seed=i, ignore_eos=True)
              for i, t in enumerate((0.0, 1.0, 0.7))]
    ar = None
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 16)):
        kw = dict(draft_model=None if method == "ar" else drafter, method=method, budget=budget, device="cuda",
                  dtype=dtype)
        eager = [o.token_ids for o in LLM(target, cuda_graphs=False, **kw).generate(prompts, params)]
        graphed = [o.token_ids for o in LLM(target, cuda_graphs=True, **kw).generate(prompts, params)]
        assert graphed == eager, method
        ar = ar or eager
        if dtype == "float32":
            assert eager == ar, method
