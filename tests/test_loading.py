"""Checkpoint loading: which weight files are read, and the configs treeflash must
refuse rather than run with wrong logits (or fail later with an internal error).

Loads that must succeed are checked against the logits of the transformers model the
checkpoint was saved from; refusals must be one-line `TreeflashError`s naming the
field or file at fault.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import ENGINE_PROMPTS
from safetensors.torch import load_file, save_file

from treeflash import LLM
from treeflash.config import MAX_BLOCK_SIZE, DraftConfig, ModelConfig
from treeflash.errors import TreeflashError
from treeflash.layers.attention import AttentionInputs
from treeflash.tokenizer import Tokenizer


@torch.no_grad()
def assert_logits_match(folder, hf_model) -> None:
    """treeflash's logits for one prompt equal those of the transformers model."""
    llm = LLM(folder, device="cpu", dtype="float32")
    ids = llm.encode(ENGINE_PROMPTS[1])
    T = len(ids)
    h, _ = llm.target(torch.tensor([ids]), AttentionInputs.causal(torch.arange(T)[None]))
    ours = llm.target.logits(h)[0].double()
    ref = hf_model(torch.tensor([ids])).logits[0].double()
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < 1e-5


def refused(fn, *words) -> str:
    """fn() raises a one-line TreeflashError mentioning every word; returns the message."""
    with pytest.raises(TreeflashError) as e:
        fn()
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    for w in words:
        assert w in msg, (w, msg)
    return msg


def edit_config(folder, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def perturbed(weights: dict) -> dict:
    return {k: v + 0.5 for k, v in weights.items()}


# --------------------------------------------------------------------------- which files


def test_model_safetensors_wins_over_other_unindexed_files(hf_checkpoint, tmp_path):
    """A backup copy next to model.safetensors (sorting after it) must not replace its
    tensors: like transformers, only model.safetensors is read."""
    ck = hf_checkpoint("qwen3")
    folder = ck.copy_to(tmp_path / "ck")
    w = load_file(str(folder / "model.safetensors"))
    save_file(perturbed(w), str(folder / "model.safetensors.bak.safetensors"))
    assert_logits_match(folder, ck.model)


def test_unindexed_shards_load_and_duplicate_tensors_are_refused(hf_checkpoint, tmp_path):
    """Without model.safetensors or an index every *.safetensors file is read; a tensor
    in two of them is ambiguous: refused, naming both files."""
    ck = hf_checkpoint("qwen3")
    folder = ck.copy_to(tmp_path / "ck")
    w = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    keys = sorted(w)
    half = len(keys) // 2
    save_file({k: w[k] for k in keys[:half]}, str(folder / "a.safetensors"))
    save_file({k: w[k] for k in keys[half:]}, str(folder / "b.safetensors"))
    assert_logits_match(folder, ck.model)
    save_file(perturbed({keys[0]: w[keys[0]]}), str(folder / "c.safetensors"))
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), keys[0], "a.safetensors", "c.safetensors")


def test_model_safetensors_wins_over_a_stale_index(hf_checkpoint, tmp_path):
    """transformers reads model.safetensors when present, before any index: a stale
    index whose shards are gone must not break the load."""
    ck = hf_checkpoint("qwen3")
    folder = ck.copy_to(tmp_path / "ck")
    index = {"metadata": {}, "weight_map": {k: "model-00001-of-00002.safetensors"
                                            for k in load_file(str(folder / "model.safetensors"))}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_logits_match(folder, ck.model)


def test_a_folder_named_like_a_weights_file_is_not_read(tmp_path):
    """Without model.safetensors or an index every *.safetensors *file* is read: a folder
    named x.safetensors beside the shards is no shard (not a "cannot read" refusal)."""
    from treeflash.models.loader import checkpoint_files
    folder = _tiny_target(tmp_path / "t")
    (folder / "model.safetensors").rename(folder / "a.safetensors")
    (folder / "b.safetensors").mkdir()
    files = checkpoint_files(folder)
    assert files and set(files.values()) == {folder / "a.safetensors"}


@pytest.mark.parametrize("index", [[], "weights"])
def test_an_index_that_is_no_json_object_is_refused_in_one_line(hf_checkpoint, tmp_path, index):
    """model.safetensors.index.json holding a list or a string (not {"weight_map": ...}):
    refused as a malformed index, not a TypeError traceback."""
    folder = hf_checkpoint("qwen3-tied-sharded").copy_to(tmp_path / "ck")
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), "malformed", "model.safetensors.index.json",
            "weight_map")


@pytest.mark.parametrize("entry", ["", "."])
def test_index_entry_that_is_not_a_file(hf_checkpoint, tmp_path, entry):
    """An index naming the folder itself ("" or ".") for a tensor: refused with the
    tensor and the index named, not an OS error naming neither."""
    folder = hf_checkpoint("qwen3-tied-sharded").copy_to(tmp_path / "ck")
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    key = sorted(index["weight_map"])[-1]
    index["weight_map"][key] = entry
    path.write_text(json.dumps(index))
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), key, "model.safetensors.index.json")


def test_tied_embeddings_stored_as_lm_head_only(hf_checkpoint, tmp_path):
    """Tied embeddings saved under lm_head.weight alone: transformers loads and ties
    them, so treeflash must too (and still refuse the file when untied)."""
    from transformers import AutoModelForCausalLM

    ck = hf_checkpoint("llama-tied-bias")
    folder = ck.copy_to(tmp_path / "ck")
    w = load_file(str(folder / "model.safetensors"))
    w["lm_head.weight"] = w.pop("model.embed_tokens.weight")
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert_logits_match(folder, AutoModelForCausalLM.from_pretrained(folder).eval())  # the oracle agrees
    assert_logits_match(folder, ck.model)
    edit_config(folder, tie_word_embeddings=False)
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), "model.embed_tokens.weight", "missing")


def test_a_shard_gone_from_a_sharded_checkpoint_is_named_as_missing(hf_checkpoint, tmp_path):
    """A sharded checkpoint with a shard gone (an interrupted download): refused in one
    line that names the shard as missing, not as "not a safetensors file"."""
    folder = hf_checkpoint("qwen3-tied-sharded").copy_to(tmp_path / "ck")
    shard = sorted(set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()))[1]
    (folder / shard).unlink()
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), shard, "is missing from")


def test_an_index_that_lists_a_weight_its_shard_does_not_hold_is_named(hf_checkpoint, tmp_path):
    """An index out of step with its shards (a weight listed in a shard that lacks it, a
    shard rewritten after the index): refused naming the index and the shard, not as
    "tensors this config.json has no place for", which sent users to the config."""
    folder = hf_checkpoint("qwen3-tied-sharded").copy_to(tmp_path / "ck")
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = shard
    path.write_text(json.dumps(index))
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), "model.layers.0.mlp.extra.weight",
            f"model.safetensors.index.json in {folder} lists weight model.layers.0.mlp.extra.weight in {shard}, "
            f"which does not hold it")


# --------------------------------------------------------------------------- configs we cannot run


@pytest.mark.parametrize("name,act", [("llama3-rope", "gelu"), ("qwen3", "gelu_pytorch_tanh"), ("qwen3", "relu")])
def test_unsupported_hidden_act_is_refused(hf_checkpoint, clone_checkpoint, name, act):
    """The MLP is SwiGLU: another activation would run with wrong logits."""
    folder = clone_checkpoint(hf_checkpoint(name).path, hidden_act=act)
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), "hidden_act", repr(act))


def test_silu_and_swish_load(hf_checkpoint, clone_checkpoint):
    ck = hf_checkpoint("qwen3")
    assert_logits_match(clone_checkpoint(ck.path, hidden_act="swish"), ck.model)
    assert ModelConfig.from_pretrained(clone_checkpoint(ck.path, hidden_act="silu")).arch == "qwen3"


# transformers-4 style configs (as released Qwen3 ones) lack layer_types: transformers
# then derives it from use_sliding_window, sliding_window and max_window_layers.
V4 = dict(layer_types=None)
SLIDING = [
    dict(V4, use_sliding_window=True, sliding_window=16, max_window_layers=0),
    dict(V4, use_sliding_window=True, sliding_window=16, max_window_layers=1),   # layer 1 of 2 slides
    dict(V4, use_sliding_window=True, sliding_window=16, max_window_layers=-1),  # every layer, as 0
    dict(layer_types=["full_attention", "sliding_attention"], use_sliding_window=True, sliding_window=16),
]
FULL = [
    # released Qwen3 configs
    dict(V4, use_sliding_window=False, sliding_window=None, max_window_layers=28),
    dict(V4, use_sliding_window=False, sliding_window=4096, max_window_layers=0),
    # the window never applies: no layer reaches max_window_layers, or layer_types says so
    dict(V4, use_sliding_window=True, sliding_window=16, max_window_layers=2),
    dict(layer_types=["full_attention", "full_attention"], use_sliding_window=True, sliding_window=16),
    dict(V4, use_sliding_window=True, sliding_window=256, max_window_layers=0),  # = max_position_embeddings
]


@pytest.mark.parametrize("name,changes,window,sliding", [
    *(("qwen3", changes, 16, sliding) for changes, sliding in zip(SLIDING, [(0, 1), (1,), (0, 1), (1,)])),
    # layouts the checkpoints of test_models do not have: Qwen2 without layer_types
    # (max_window_layers decides), a window without use_sliding_window (unused), a Mistral
    # with layer_types (Ministral's windows)
    ("qwen2-window", dict(layer_types=None, max_window_layers=0), 8, (0, 1)),
    ("qwen2-window", dict(layer_types=None, use_sliding_window=False, sliding_window=4), None, ()),
    ("mistral-window", dict(layer_types=["full_attention", "sliding_attention"], sliding_window=12), 12, (1,)),
])
def test_sliding_window_configs_match_transformers(hf_checkpoint, clone_checkpoint, name, changes, window,
                                                    sliding):
    """A sliding-window Qwen3, Qwen2 or Mistral slides in the layers transformers' rules
    pick (its window shorter than the test prompts), with the logits of the model
    transformers' Auto classes build from the same folder."""
    from transformers import AutoModelForCausalLM

    folder = clone_checkpoint(hf_checkpoint(name).path, **changes)
    cfg = ModelConfig.from_pretrained(folder)
    assert (cfg.sliding_window, cfg.sliding_layers) == (window, sliding)
    assert len(Tokenizer(folder).encode(ENGINE_PROMPTS[1])) > 2 * (window or 8)
    assert_logits_match(folder, AutoModelForCausalLM.from_pretrained(folder).eval())


@pytest.mark.parametrize("changes", FULL)
def test_qwen3_full_attention_configs_load(hf_checkpoint, clone_checkpoint, changes):
    """Configs where transformers attends fully in every layer load, with its logits."""
    from transformers import AutoModelForCausalLM

    folder = clone_checkpoint(hf_checkpoint("qwen3").path, **changes)
    assert_logits_match(folder, AutoModelForCausalLM.from_pretrained(folder).eval())


def test_default_window_and_qwen3_moe_sliding_window():
    """Without a sliding_window key transformers' window is 4096 (shorter than this
    context); Qwen3-MoE slides in every layer once use_sliding_window is set."""
    dense = dict(architectures=["Qwen3ForCausalLM"], vocab_size=64, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=8192, max_window_layers=0)
    assert ModelConfig.from_dict(dense).sliding_layers == ()
    cfg = ModelConfig.from_dict({**dense, "use_sliding_window": True})
    assert (cfg.sliding_window, cfg.sliding_layers) == (4096, (0, 1))
    moe = dict(dense, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=16, use_sliding_window=False, sliding_window=16, max_window_layers=2)
    assert ModelConfig.from_dict(moe).sliding_layers == ()
    cfg = ModelConfig.from_dict({**moe, "use_sliding_window": True})
    assert (cfg.sliding_window, cfg.sliding_layers) == (16, (0, 1))
    refused(lambda: ModelConfig.from_dict({**dense, "layer_types": ["full_attention", "chunked"]}), "layer_types")
    refused(lambda: ModelConfig.from_dict({**dense, "use_sliding_window": True, "sliding_window": 0}),
            "'sliding_window' must be a positive integer")


# --------------------------------------------------------------------------- Qwen2 and Mistral

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
QWEN2 = dict(SMALL, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
MISTRAL = dict(SMALL, architectures=["MistralForCausalLM"], model_type="mistral")


def _transformers_config(data: dict, folder):
    """transformers' config of config.json `data`, read as AutoConfig reads it from `folder`
    (a Mistral's with layer_types is a MinistralConfig)."""
    from transformers import AutoConfig
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    return AutoConfig.from_pretrained(folder)


@pytest.mark.parametrize("data", [
    QWEN2,
    dict(QWEN2, use_sliding_window=False, sliding_window=16, max_window_layers=0),  # Qwen2.5's: the window unused
    dict(QWEN2, use_sliding_window=True, sliding_window=16, max_window_layers=1),
    dict(QWEN2, use_sliding_window=True, sliding_window=16, max_window_layers=0),
    dict(QWEN2, use_sliding_window=True, sliding_window=16),  # max_window_layers 28: no layer reaches it
    dict(QWEN2, use_sliding_window=True, max_window_layers=0),  # the default window (4096) outlasts the context
    dict(QWEN2, use_sliding_window=True, sliding_window=None, max_window_layers=0),
    dict(QWEN2, use_sliding_window=True, sliding_window=16, max_window_layers=0,
         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),  # layer_types wins
    dict(QWEN2, use_sliding_window=False, sliding_window=16,  # no window without use_sliding_window
         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    MISTRAL,  # the default window (4096)
    dict(MISTRAL, max_position_embeddings=8192),
    dict(MISTRAL, sliding_window=16),
    dict(MISTRAL, sliding_window=None),
    dict(MISTRAL, sliding_window=16, use_sliding_window=False, max_window_layers=2),  # keys Mistral does not read
    # with layer_types transformers builds a Ministral, which slides where they say
    dict(MISTRAL, sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    dict(MISTRAL, sliding_window=16, layer_types=None),
    # YaRN serves 4 x 256 positions: a window of max_position_embeddings still cuts past them
    dict(MISTRAL, sliding_window=256, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 256}),
], ids=lambda d: json.dumps({k: v for k, v in d.items() if k not in SMALL and k != "architectures"}))
def test_qwen2_and_mistral_windows_are_the_ones_transformers_derives(data, tmp_path):
    """Each layer's window is the one transformers' attention gets: Mistral's sliding_window
    in every layer; Qwen2's (and Ministral's) in the layers its config class's layer_types
    names, which Qwen2 derives from use_sliding_window and max_window_layers. A window as
    long as the context served (with YaRN: past max_position_embeddings) never cuts
    anything: full attention."""
    theirs = _transformers_config(data, tmp_path)
    types = ["sliding_attention"] * theirs.num_hidden_layers if theirs.model_type == "mistral" else theirs.layer_types
    windows = [theirs.sliding_window if t == "sliding_attention" else None for t in types]
    ours = ModelConfig.from_dict(data)
    n, context = theirs.num_hidden_layers, ours.context_length
    assert [ours.attention_window(i) for i in range(n)] == \
        [w if w is not None and w < context else None for w in windows]


def test_keys_a_qwen2_or_mistral_config_leaves_out_take_transformers_defaults(tmp_path):
    """Qwen2Config's and MistralConfig's defaults, not Llama's: num_key_value_heads 32 and
    8 (not the heads), max_position_embeddings 32768 and 131072, Mistral's window of 4096
    in every layer; head_dim hidden / heads (Mistral's null too), rms_norm_eps 1e-6,
    rope_theta 10000, untied."""
    bare = dict(vocab_size=300, hidden_size=512, intermediate_size=128, num_hidden_layers=2, num_attention_heads=64)
    for model_type, kv, context, windows in (("qwen2", 32, 32768, [None] * 2), ("mistral", 8, 131072, [4096] * 2)):
        data = dict(bare, architectures=[f"{model_type.capitalize()}ForCausalLM"], model_type=model_type)
        ours, theirs = ModelConfig.from_dict(data), _transformers_config(data, tmp_path / model_type)
        head_dim = getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)  # Qwen2Attention's
        assert (ours.num_kv_heads, ours.max_position_embeddings) == (theirs.num_key_value_heads,
                                                                     theirs.max_position_embeddings) == (kv, context)
        assert (ours.head_dim, ours.rms_norm_eps, ours.rope_theta, ours.tie_word_embeddings) == \
            (head_dim, theirs.rms_norm_eps, theirs.rope_parameters["rope_theta"], theirs.tie_word_embeddings) \
            == (8, 1e-6, 10000.0, False)
        assert [ours.attention_window(i) for i in range(2)] == windows
    null = dict(MISTRAL, head_dim=None)
    assert ModelConfig.from_dict(null).head_dim == _transformers_config(null, tmp_path / "null").head_dim == 16


@pytest.mark.parametrize("flag", [True, False])
def test_qwen2_and_mistral_biases_are_their_classes_whatever_the_config_says(flag, tmp_path):
    """Qwen2's q/k/v projections have biases and its o_proj and MLP none; Mistral has none:
    their transformers classes read neither attention_bias nor mlp_bias."""
    from transformers import AutoModelForCausalLM
    for data, biases in ((QWEN2, (True, False, False)), (MISTRAL, (False, False, False))):
        data = dict(data, num_hidden_layers=1, attention_bias=flag, mlp_bias=flag)
        ours = ModelConfig.from_dict(data)
        layer = AutoModelForCausalLM.from_config(_transformers_config(data, tmp_path / data["model_type"])
                                                 ).model.layers[0]
        theirs = tuple(m.bias is not None for m in (layer.self_attn.q_proj, layer.self_attn.o_proj,
                                                     layer.mlp.gate_proj))
        assert (ours.attention_bias, ours.o_proj_bias, ours.mlp_bias) == theirs == biases


@pytest.mark.parametrize("data,key,value", [
    *[(dict(QWEN2, use_sliding_window=True), "sliding_window", v) for v in (0, -8, 8.0, "8", True)],
    *[(MISTRAL, "sliding_window", v) for v in (0, -8, 8.0, "8", True)],
    (QWEN2, "use_sliding_window", "true"),
    (dict(QWEN2, use_sliding_window=True, sliding_window=16), "max_window_layers", "1"),
    (dict(QWEN2, use_sliding_window=True), "layer_types", ["sliding_attention"]),
    (MISTRAL, "layer_types", ["sliding_attention", "chunked_attention", "full_attention"]),
])
def test_bad_qwen2_and_mistral_window_keys_are_refused(data, key, value):
    refused(lambda: ModelConfig.from_dict({**data, key: value}), f"'{key}' must", repr(value))


# --------------------------------------------------------------------------- drafter configs


@pytest.fixture
def drafter_dict(spec_drafter) -> dict:
    return json.loads((spec_drafter("qwen3", "peaked", 8) / "config.json").read_text())


def test_drafter_block_size_is_bounded(drafter_dict):
    """A huge block_size would allocate gigabytes of masks and hang: refused at load.
    The cap, and the target's context, bound it."""
    target = ModelConfig.from_dict({**drafter_dict, "architectures": ["Qwen3ForCausalLM"],
                                    "num_hidden_layers": drafter_dict["num_target_layers"],
                                    "max_position_embeddings": 128})
    DraftConfig.from_dict({**drafter_dict, "block_size": 16}).check_fits(target)
    for block in (MAX_BLOCK_SIZE + 1, 100000):
        refused(lambda: DraftConfig.from_dict({**drafter_dict, "block_size": block}), "block_size", str(block))
    big = DraftConfig.from_dict({**drafter_dict, "block_size": MAX_BLOCK_SIZE})
    refused(lambda: big.check_fits(target), "block_size", "max_position_embeddings")


@pytest.mark.parametrize("changes,field", [
    (dict(architectures=5), "architectures"),
    (dict(architectures=[{"a": 1}]), "architectures"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(block_size=1), "block_size"),   # a block of one drafts nothing: from 2 on
])
def test_bad_drafter_config_values(drafter_dict, changes, field):
    refused(lambda: DraftConfig.from_dict({**drafter_dict, **changes}), field)


def test_drafter_logit_and_embedding_scales_are_read_or_refused(drafter_dict):
    """The reference drafter's input_embedding_scale, output_multiplier and
    final_logit_softcapping are read (from dflash_config, else the top level), not
    ignored; is_causal, which it also honours, is refused rather than dropped."""
    plain = DraftConfig.from_dict(drafter_dict)
    assert (plain.input_embedding_scale, plain.output_multiplier, plain.final_logit_softcapping) == (1.0, 1.0, None)
    scaled = DraftConfig.from_dict({**drafter_dict, "output_multiplier": 0.5, "final_logit_softcapping": 0,
                                    "dflash_config": {**drafter_dict["dflash_config"], "input_embedding_scale": 8,
                                                      "final_logit_softcapping": 30.0}})
    assert (scaled.input_embedding_scale, scaled.output_multiplier, scaled.final_logit_softcapping) == (8.0, 0.5, 30.0)
    assert DraftConfig.from_dict({**drafter_dict, "final_logit_softcapping": 0}).final_logit_softcapping is None
    refused(lambda: DraftConfig.from_dict({**drafter_dict, "is_causal": True}), "is_causal")
    for key, value in (("output_multiplier", 0), ("input_embedding_scale", "2"), ("final_logit_softcapping", -1.0)):
        refused(lambda: DraftConfig.from_dict({**drafter_dict, key: value}), key)


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize("changes,field", [
    (dict(architectures=[], model_type=["x"]), "model_type"),
    (dict(architectures=[], model_type={"a": 1}), "model_type"),
    (dict(architectures=[["Qwen3ForCausalLM"]]), "architectures"),
    # Llama-3 frequencies divide by low_freq_factor (ZeroDivisionError, before) and by high - low
    (dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 0, "high_freq_factor": 4}),
     "low_freq_factor"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 4, "high_freq_factor": 4}),
     "needs high_freq_factor > low_freq_factor"),
    # transformers and vLLM refuse a llama3 scaling without both factors; it ran with made-up ones
    (dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 8}), "lacks 'high_freq_factor'"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "high_freq_factor": 4}), "lacks 'low_freq_factor'"),
    # values that would load as something else: "false" as true, true as 1, an infinite theta
    (dict(tie_word_embeddings="false"), "'tie_word_embeddings' must be true or false"),
    (dict(num_hidden_layers=True), "'num_hidden_layers' must be a positive integer"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("inf")}), "'rope_theta' must be a number"),
    (dict(eos_token_id=True), "'eos_token_id' must be a token id"),
    # shapes attention cannot take: heads shared unevenly among kv heads, an odd rotary size
    (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
    (dict(head_dim=33), "head_dim 33 is odd"),
    # DeepSeek's YaRN attention scale, which the engine does not apply: refused, not ignored
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7}),
     "mscale"),
    # YaRN's context (original x factor): past int positions it overflowed (OverflowError, before); one of no
    # position loaded and refused every prompt; a fractional original context was truncated
    (dict(rope_scaling={"rope_type": "yarn", "factor": 1e308, "original_max_position_embeddings": 64}),
     "from 2 to 2^31 - 1 positions"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 1e-5, "original_max_position_embeddings": 64}),
     "from 2 to 2^31 - 1 positions"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 100.7}),
     "'original_max_position_embeddings' must be a positive integer"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1, "high_freq_factor": 4,
                        "original_max_position_embeddings": 8192.5}),
     "'original_max_position_embeddings' must be a positive integer"),
])
def test_bad_target_config_values(hf_checkpoint, clone_checkpoint, changes, field):
    folder = clone_checkpoint(hf_checkpoint("qwen3").path, **changes)
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), field)


@pytest.mark.parametrize("changes,words", [
    (dict(hidden_size=10 ** 30), ("hidden_size", "below 2^31")),   # torch's overflow, with C++ frames, before
    (dict(num_hidden_layers=10 ** 6), ("1000000 layers", "holds 2")),   # built layers until memory ran out
    (dict(vocab_size=10 ** 9), ("vocab_size 1000000000", "embed_tokens.weight")),   # a 1.5 TB allocation
    (dict(eos_token_id=10 ** 5), ("eos_token_id 100000", "outside the vocabulary")),
    (dict(intermediate_size=2 ** 30), ("parameters", "the checkpoint holds")),   # 3 TB on the meta device only
    (dict(num_attention_heads=2 ** 24), ("parameters", "the checkpoint holds")),
])
def test_config_sizes_beyond_the_checkpoint_are_refused_before_building(hf_checkpoint, clone_checkpoint,
                                                                        changes, words):
    """A config.json size off by a few zeros: refused from the config and the weights'
    headers, before any layer is allocated."""
    folder = clone_checkpoint(hf_checkpoint("qwen3").path, **changes)
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), *words)


@pytest.mark.parametrize("arch,model_type", [
    ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"),   # z-lab's Qwen3.5 / 3.6 targets: linear attention
    ("Qwen3NextForCausalLM", "qwen3_next"),                  # Qwen3-Coder-Next
    ("DeepseekV3ForCausalLM", "kimi_k2"),                    # Kimi-K2.5's text model: latent attention
])
def test_published_drafters_targets_of_other_architectures_are_refused_by_name(hf_checkpoint, clone_checkpoint,
                                                                               arch, model_type):
    """Targets z-lab publishes drafters for whose layers treeflash does not have (README):
    one line naming the architecture and the supported ones, before any weight is read."""
    folder = clone_checkpoint(hf_checkpoint("qwen3").path, architectures=[arch], model_type=model_type)
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), "unsupported architecture", arch,
            "Qwen3ForCausalLM")


def test_a_drafter_given_as_the_model_says_where_it_belongs(spec_drafter):
    refused(lambda: LLM(spec_drafter(), device="cpu", dtype="float32"), "is a DFlash drafter", "--draft-model")


@pytest.mark.parametrize("bos,add,word", [(-1, True, "bos_token_id"), (10 ** 6, True, "bos_token_id"),
                                          ("1", True, "bos_token_id"), (1, "false", "add_bos_token")])


def test_bad_bos_settings_are_refused(hf_checkpoint, tmp_path, bos, add, word):
    """add_bos_token prepends bos_token_id to every prompt: an id outside the vocabulary
    (or a string flag, which read as true) is refused when the tokenizer loads."""
    folder = hf_checkpoint("qwen3").copy_to(tmp_path / "ck")
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": bos}))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": add}))
    refused(lambda: Tokenizer(folder), word)
    # a valid id is prepended
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    assert Tokenizer(folder).encode("def fib(n):")[0] == 1


def _tiny_tokenizer_folder(folder, config_changes: dict, tokenizer_changes: dict = ()):
    from treeflash.checkpoints import write_tiny_tokenizer
    write_tiny_tokenizer(folder)
    for name, changes in (("tokenizer_config.json", config_changes), ("tokenizer.json", dict(tokenizer_changes))):
        data = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**data, **changes}))
    return folder


def test_tokenizer_json_truncation_and_padding_do_not_touch_prompts(tmp_path):
    """Some published tokenizer.json files keep the truncation and padding they were
    trained with: transformers applies them only when asked, and so does treeflash (every
    prompt was cut to 8 tokens and padded with pad ids, silently)."""
    from transformers import AutoTokenizer

    from treeflash.tokenizer import Tokenizer
    folder = _tiny_tokenizer_folder(tmp_path, {}, {
        "truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0},
        "padding": {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 1,
                    "pad_type_id": 0, "pad_token": "<|pad|>"}})
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = Tokenizer(folder).encode(text)
    assert ids == AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"] and len(ids) > 16


def test_tokens_declared_only_in_tokenizer_config_are_added(tmp_path):
    """Tokens that tokenizer_config.json declares (added_tokens_decoder at their ids, or
    named as eos_token / additional_special_tokens) and tokenizer.json lacks are added, as
    transformers adds them: one token, an end token if named so. They were split into
    pieces and never ended a generation."""
    from transformers import AutoTokenizer

    from treeflash.tokenizer import Tokenizer
    from treeflash.checkpoints import write_tiny_tokenizer
    write_tiny_tokenizer(tmp_path / "base")
    n = Tokenizer(tmp_path / "base").vocab_size
    entry = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False, "special": True}
    folder = _tiny_tokenizer_folder(tmp_path / "ck", {
        "added_tokens_decoder": {str(n): {**entry, "content": "<|im_end|>"}}, "eos_token": "<|im_end|>",
        "additional_special_tokens": ["<|tool|>"]})
    ours, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    text = "hi<|im_end|>x<|tool|>"
    assert ours.encode(text) == hf(text)["input_ids"] == [*ours.encode("hi"), n, *ours.encode("x"), n + 1]
    assert n in ours.eos_token_ids and ours.decode([n, n + 1]) == "" and ours.decode([n], False) == "<|im_end|>"
    # declared at an id tokenizer.json would not give it: the model's row of that id means another token
    bad = _tiny_tokenizer_folder(tmp_path / "bad", {"added_tokens_decoder": {str(n + 3): {**entry, "content": "<x>"}}})
    refused(lambda: Tokenizer(bad), "tokenizer_config.json", "'<x>' is declared as id", f"gives it id {n}")


@pytest.mark.parametrize("split", [True, False])
def test_split_special_tokens_as_transformers(tmp_path, split):
    from transformers import AutoTokenizer

    from treeflash.tokenizer import Tokenizer
    folder = _tiny_tokenizer_folder(tmp_path, {"split_special_tokens": split})
    text = "a<|endoftext|>b"
    ids = Tokenizer(folder).encode(text)
    assert ids == AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"] and (len(ids) > 3) == split
    folder = _tiny_tokenizer_folder(tmp_path / "bad", {"split_special_tokens": "yes"})
    refused(lambda: Tokenizer(folder), "'split_special_tokens' must be true or false")


# --------------------------------------------------------------------------- unreadable files


def test_a_tokenizer_json_that_is_a_fifo_is_named(hf_checkpoint, tmp_path):
    folder = hf_checkpoint("qwen3").copy_to(tmp_path / "ck")
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")
    refused(lambda: Tokenizer(folder), "tokenizer.json", "not a regular file")


@pytest.mark.parametrize("source", ["generation_config.json", "tokenizer_config.json"])
def test_an_end_token_outside_the_vocabulary_is_refused_at_load(hf_checkpoint, tmp_path, source):
    """EOS ids from generation_config.json, or tokenizer_config.json's eos_token (an added
    token past the model's vocabulary), are sampler columns: refused when the model loads,
    not at the first request that holds them back (min_tokens) or constrains the output."""
    folder = hf_checkpoint("qwen3").copy_to(tmp_path / "ck")
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    if source == "generation_config.json":
        (folder / source).write_text(json.dumps({"eos_token_id": vocab + 5}))
    else:
        tok = json.loads((folder / "tokenizer.json").read_text())
        tok["added_tokens"].append({"id": vocab + 5, "content": "<|past|>", "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
        (folder / "tokenizer.json").write_text(json.dumps(tok))
        cfg = json.loads((folder / source).read_text())
        (folder / source).write_text(json.dumps({**cfg, "eos_token": "<|past|>"}))
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), source, "end-of-text token id", "outside",
            f"vocabulary of {vocab} tokens")


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "tokenizer_config.json",
                                  "model.safetensors.index.json"])
@pytest.mark.parametrize("kind", ["folder", "deep", "not utf-8", "fifo"])
def test_small_files_that_cannot_be_read_are_named(hf_checkpoint, tmp_path, name, kind):
    """A JSON file of the model folder that is a folder, nested past the parser, not
    UTF-8, or a FIFO: one line naming it (they escaped as IsADirectoryError,
    RecursionError...; a FIFO hung the load forever)."""
    folder = hf_checkpoint("qwen3").copy_to(tmp_path / "ck")
    path = folder / name
    if name == "model.safetensors.index.json":  # read only where there is no model.safetensors
        (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    if path.exists():
        path.unlink()
    if kind == "folder":
        path.mkdir()
    elif kind == "deep":
        path.write_text('{"x": ' + "[" * 100000 + "]" * 100000 + "}")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_bytes(b'{"x": "\xff\xfe"}')
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), name)


def test_a_chat_template_file_that_is_not_utf8_is_named(hf_checkpoint, tmp_path):
    from treeflash.chat import ChatTemplate
    folder = hf_checkpoint("qwen3").copy_to(tmp_path / "ck")
    (folder / "chat_template.jinja").write_bytes(b"\xff\xfe{{ messages }}")
    refused(lambda: ChatTemplate.from_folder(folder), "chat_template.jinja", "not UTF-8")


def test_a_drafter_checkpoint_skips_only_its_targets_embeddings_and_head(spec_target, spec_drafter, tmp_path):
    """A drafter may carry a copy of its target's embed_tokens / lm_head (not read); a
    tensor whose name merely contains those words is one the config has no place for; a
    layer named twice in target_layer_ids is refused."""
    import shutil
    folder = tmp_path / "drafter"
    shutil.copytree(spec_drafter(), folder)
    weights = load_file(folder / "model.safetensors")
    copies = {"lm_head.weight": torch.zeros(3, 2), "model.embed_tokens.weight": torch.zeros(3, 2)}
    save_file({**weights, **copies}, folder / "model.safetensors")
    LLM(spec_target(), draft_model=folder, method="dflash", device="cpu", dtype="float32")
    save_file({**weights, "layers.0.mlp.lm_head_gate.weight": torch.zeros(3, 2)}, folder / "model.safetensors")
    refused(lambda: LLM(spec_target(), draft_model=folder, method="dflash", device="cpu", dtype="float32"),
            "lm_head_gate", "no place")
    cfg = json.loads((folder / "config.json").read_text())
    twice = [DraftConfig.from_dict(cfg).target_layer_ids[0]] * 2
    refused(lambda: DraftConfig.from_dict({**cfg, "target_layer_ids": twice,
                                           "dflash_config": {**cfg.get("dflash_config", {}),
                                                             "target_layer_ids": twice}}),
            "target_layer_ids", "twice")


def test_weights_past_the_hosts_free_memory_are_refused_before_loading(spec_target, spec_drafter, monkeypatch):
    """On a CPU, weights that cannot fit in the memory left are refused in one line before
    anything loads: Linux would kill the process mid-load without a word (an 8B bf16
    checkpoint is 32 GB in float32, auto's CPU dtype). The need counts the drafter too,
    in the dtype asked for."""
    import treeflash.memory as memory
    need = LLM(spec_target(), draft_model=spec_drafter(), device="cpu", dtype="float32").load_stats["param_bytes"]
    load = lambda dtype: LLM(spec_target(), draft_model=spec_drafter(), device="cpu", dtype=dtype)  # noqa: E731
    monkeypatch.setattr(memory, "available_bytes", lambda device: need - 1)
    refused(lambda: load("float32"), "not enough cpu memory for the weights", "in float32", "--dtype bfloat16")
    monkeypatch.setattr(memory, "available_bytes", lambda device: need // 2 - 1)
    msg = refused(lambda: load("bfloat16"), "not enough cpu memory for the weights", "in bfloat16", "on a GPU")
    assert "--dtype" not in msg
    monkeypatch.setattr(memory, "available_bytes", lambda device: need // 2)
    assert load("bfloat16").load_stats["param_bytes"] == need // 2


def test_a_drafters_sliding_layers_see_the_contexts_last_keys_within_their_window(drafter_dict):
    """A drafter whose layers slide (use_sliding_window, layer_types, is_causal false, as
    some published ones): each block query sees the context's keys within the window
    and the whole block, as the same weights do under that explicit mask (the window was
    read but not built: every layer saw the whole context). Without is_causal false DFlash
    makes sliding layers causal, which is refused, as is a window shorter than the block."""
    from treeflash.models.dflash import DFlashDraftModel
    L, W, P = drafter_dict["num_hidden_layers"], 5, 12
    sliding = {**drafter_dict, "use_sliding_window": True, "sliding_window": W, "is_causal": False,
               "layer_types": ["sliding_attention"] * L, "block_size": 4}
    dcfg = DraftConfig.from_dict(sliding)
    assert dcfg.layers.sliding_layers == tuple(range(L)) and dcfg.layers.sliding_window == W
    torch.manual_seed(0)
    with torch.device("cpu"):
        windowed = DFlashDraftModel(dcfg).double()
        plain = DFlashDraftModel(DraftConfig.from_dict({**drafter_dict, "block_size": 4})).double()
    for p in windowed.parameters():
        p.data.normal_(0, 0.3)
    plain.load_state_dict(windowed.state_dict())
    H, b = dcfg.layers.hidden_size, 4
    features = torch.randn(1, P, len(dcfg.target_layer_ids) * H, dtype=torch.float64)
    block = torch.randn(1, b, H, dtype=torch.float64)
    cache = windowed.new_cache(1, 32)
    windowed.commit_context(cache, features, torch.arange(P)[None], torch.zeros(1, dtype=torch.long))
    inputs = AttentionInputs(P + torch.arange(b)[None], torch.tensor([P]), torch.ones(1, b, b, dtype=torch.bool))
    got = windowed(block, inputs, cache)
    query = P + torch.arange(b)[:, None]
    mask = torch.cat([torch.arange(P)[None] > query - W, torch.ones(b, b, dtype=torch.bool)], 1)[None]
    want = plain.forward_dense(block, P + torch.arange(b)[None], features, torch.arange(P)[None], mask)
    torch.testing.assert_close(got, want)
    whole = plain.forward_dense(block, P + torch.arange(b)[None], features, torch.arange(P)[None],
                                torch.ones(1, b, P + b, dtype=torch.bool))
    assert (got - whole).abs().max() > 1e-3  # the window matters here
    refused(lambda: DraftConfig.from_dict({k: v for k, v in sliding.items() if k != "is_causal"}),
            "sliding_attention", "is_causal")
    refused(lambda: DraftConfig.from_dict({**sliding, "sliding_window": 3}), "sliding window of 3", "block of 4")


# ----------------------------------------------------------------------------- config defaults and bounds (cases a mutation review found untested)

TINY_TARGET = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "vocab_size": 300, "max_position_embeddings": 256}
TINY_DRAFT = {**TINY_TARGET, "architectures": ["DFlashDraftModel"], "num_hidden_layers": 2, "block_size": 16,
         "num_target_layers": 4, "dflash_config": {"mask_token_id": 2, "target_layer_ids": [1, 2]}}


def test_an_eos_id_equal_to_the_vocabulary_size_is_outside_it():
    from treeflash.config import ModelConfig
    ModelConfig.from_dict({**TINY_TARGET, "eos_token_id": [0, 299]})
    with pytest.raises(TreeflashError, match="outside the vocabulary"):
        ModelConfig.from_dict({**TINY_TARGET, "eos_token_id": [0, 300]})


def test_without_num_key_value_heads_every_head_has_its_own_kv():
    """transformers' default (Llama 1, older configs): num_key_value_heads = num_attention_heads."""
    from treeflash.config import ModelConfig
    data = {k: v for k, v in TINY_TARGET.items() if k != "num_key_value_heads"}
    assert ModelConfig.from_dict(data).num_kv_heads == 4
    assert ModelConfig.from_dict({**data, "num_key_value_heads": None}).num_kv_heads == 4


def test_gpt_oss_without_layer_types_slides_in_the_even_layers():
    """transformers' GptOssConfig default: layer 0 sliding, then every other one."""
    from treeflash.config import ModelConfig
    data = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 300, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8}
    cfg = ModelConfig.from_dict(data)
    assert cfg.sliding_layers == (0, 2) and cfg.attention_window(0) == 8 and cfg.attention_window(1) is None


def test_gpt_oss_has_attention_biases_unless_its_config_says_not():
    """transformers' GptOssConfig default attention_bias is true (the published weights hold
    q/k/v/o biases); Qwen3 and Llama default to none."""
    from treeflash.config import ModelConfig
    data = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 300, "num_local_experts": 4, "num_experts_per_tok": 2}
    assert ModelConfig.from_dict(data).attention_bias is True
    assert ModelConfig.from_dict({**data, "attention_bias": False}).attention_bias is False
    assert ModelConfig.from_dict(TINY_TARGET).attention_bias is False


def test_rms_norm_eps_defaults_to_transformers_1e_6():
    """Qwen3Config's and LlamaConfig's default: a config without the key must not normalize
    with another epsilon (every logit would move)."""
    from treeflash.config import ModelConfig
    assert ModelConfig.from_dict(TINY_TARGET).rms_norm_eps == 1e-6
    assert ModelConfig.from_dict({**TINY_TARGET, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
                                 ).rms_norm_eps == 1e-6


def test_dflash_configs_block_size_wins_over_the_top_level_one():
    from treeflash.config import DraftConfig
    data = {**TINY_DRAFT, "block_size": 16, "dflash_config": {**TINY_DRAFT["dflash_config"], "block_size": 8}}
    assert DraftConfig.from_dict(data).block_size == 8


def test_a_top_level_mask_token_id_is_read():
    from treeflash.config import DraftConfig
    data = {**TINY_DRAFT, "mask_token_id": 5, "dflash_config": {"target_layer_ids": [1, 2]}}
    assert DraftConfig.from_dict(data).mask_token_id == 5
    with pytest.raises(TreeflashError, match="lacks dflash_config.mask_token_id"):
        DraftConfig.from_dict({**TINY_DRAFT, "dflash_config": {"target_layer_ids": [1, 2]}})
    for wrong in (5.0, "5", True):  # present, of the wrong type: not "lacks" it
        with pytest.raises(TreeflashError, match=r"mask_token_id must be a token id \(an integer\), got"):
            DraftConfig.from_dict({**TINY_DRAFT, "dflash_config": {"mask_token_id": wrong, "target_layer_ids": [1, 2]}})


def test_default_taps_are_dflashs():
    """DFlash's build_target_layer_ids: evenly from layer 1 to L - 3 (z-lab's Qwen3-8B
    drafter: 36 target layers, 5 draft layers, taps [1, 9, 17, 25, 33])."""
    from treeflash.config import DraftConfig, default_target_layer_ids
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]
    data = {**TINY_DRAFT, "num_target_layers": 36, "dflash_config": {"mask_token_id": 2}}
    assert DraftConfig.from_dict(data).target_layer_ids == [1, 33]


def test_a_tap_one_past_the_targets_last_layer_is_refused_at_load():
    from treeflash.config import DraftConfig, ModelConfig
    target = ModelConfig.from_dict(TINY_TARGET)
    DraftConfig.from_dict({**TINY_DRAFT, "dflash_config": {"mask_token_id": 2, "target_layer_ids": [1, 3]}}) \
        .check_fits(target)
    bad = DraftConfig.from_dict({**TINY_DRAFT, "dflash_config": {"mask_token_id": 2, "target_layer_ids": [1, 4]}})
    with pytest.raises(TreeflashError, match=r"taps target layers \[4\]"):
        bad.check_fits(target)


# ----------------------------------------------------------------------------- loader checks

def _tiny_target(folder, **kw):
    from treeflash.checkpoints import write_random_target
    return write_random_target(folder, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                               intermediate_size=64, **kw)


def test_a_config_wider_than_the_stored_embedding_is_refused_before_building(tmp_path):
    from treeflash.config import ModelConfig
    from treeflash.models.loader import check_sizes, stored_shapes
    folder = _tiny_target(tmp_path / "t")
    cfg = ModelConfig.from_pretrained(folder)
    shapes = stored_shapes(folder)
    check_sizes(folder, cfg, shapes)
    from dataclasses import replace
    with pytest.raises(TreeflashError, match="hidden_size 64"):
        check_sizes(folder, replace(cfg, hidden_size=64), shapes)


def test_a_config_one_layer_past_the_checkpoint_is_refused_by_its_count(tmp_path):
    """A config.json that says even one layer more than the checkpoint holds is refused by
    the count, before building (not later by the first missing weight)."""
    from dataclasses import replace

    from treeflash.models.loader import check_sizes, stored_shapes
    folder = _tiny_target(tmp_path / "t")
    cfg = ModelConfig.from_pretrained(folder)
    with pytest.raises(TreeflashError, match=f"says {cfg.num_layers + 1} layers, but the checkpoint holds "
                                             f"{cfg.num_layers}$"):
        check_sizes(folder, replace(cfg, num_layers=cfg.num_layers + 1), stored_shapes(folder))


def test_tensors_without_a_place_are_named_three_and_counted(hf_checkpoint, clone_checkpoint):
    """A config.json with fewer layers than the weights: the refusal names the first three
    leftover tensors and counts the rest, so the size of the mismatch shows."""
    folder = clone_checkpoint(hf_checkpoint("qwen3").path, num_hidden_layers=1)
    left = sorted(k for k in load_file(str(folder / "model.safetensors")) if ".layers.1." in k)
    assert len(left) > 3
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), "no place for: " + ", ".join(left[:3]) +
            f" and {len(left) - 3} more (")


def test_stored_rotary_inverse_frequencies_are_ignored(tmp_path):
    """Older checkpoints (Llama 2 era conversions) store layers.N.self_attn.rotary_emb.inv_freq:
    recomputed, not refused as a tensor the config has no place for."""
    from safetensors.torch import load_file, save_file

    from treeflash import LLM, SamplingParams
    folder = _tiny_target(tmp_path / "t")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = 1.0 / (10000 ** (torch.arange(0, 16, 2) / 16))
    save_file(tensors, str(folder / "model.safetensors"))
    llm = LLM(folder, device="cpu", dtype="float32")
    assert len(llm.generate("def", SamplingParams(max_new_tokens=2, ignore_eos=True))[0].token_ids) == 2


def test_loading_in_another_dtype_leaves_torchs_default_dtype(tmp_path):
    """Models are built in the load dtype (torch's default dtype, process-wide, while they
    are built); afterwards the caller's tensors are float32 again, not bfloat16."""
    LLM(_tiny_target(tmp_path / "t"), device="cpu", dtype="bfloat16")
    assert torch.get_default_dtype() == torch.float32 and torch.zeros(1).dtype == torch.float32


def test_auto_dtype_is_the_dtype_most_weights_are_stored_in(tmp_path):
    """A bf16 checkpoint with a few small float32 tensors (norms, scales) is bf16."""
    from safetensors.torch import save_file

    from treeflash.models.loader import weights_dtype
    tmp_path.mkdir(exist_ok=True)
    save_file({"a.weight": torch.zeros(64, 64, dtype=torch.bfloat16), "b.weight": torch.zeros(8, dtype=torch.float32),
               "c.weight": torch.zeros(4, dtype=torch.float32)}, str(tmp_path / "model.safetensors"))
    assert weights_dtype(tmp_path) == "bfloat16"


def test_a_config_ten_times_the_checkpoints_size_is_refused(tmp_path):
    from treeflash.models.loader import check_model_size
    shapes = {"w": (1000, 1000)}
    small = torch.nn.Linear(1000, 2000, bias=False, device="meta")
    check_model_size(tmp_path, small, shapes)  # 2x: within the slack
    big = torch.nn.Linear(1000, 10_000, bias=False, device="meta")
    with pytest.raises(TreeflashError, match="describes a model of"):
        check_model_size(tmp_path, big, shapes)


def test_an_fp8_layer_stored_as_raw_bytes_is_refused(hf_checkpoint, tmp_path):
    """An FP8 checkpoint whose layer holds its bytes as U8 (not F8_E4M3): refused naming
    the weight and its dtype, not cast value by value into garbage FP8 weights."""
    from treeflash.checkpoints import write_fp8_copy
    folder = write_fp8_copy(hf_checkpoint("qwen3").path, tmp_path / "fp8", block=(16, 32))
    key = "model.layers.0.self_attn.o_proj.weight"
    w = load_file(str(folder / "model.safetensors"))
    w[key] = w[key].view(torch.uint8)
    save_file(w, str(folder / "model.safetensors"))
    refused(lambda: LLM(folder, device="cpu", dtype="float32"), key, "dtype U8", "F8_E4M3")


def test_nan_in_gpt_oss_experts_is_refused(tmp_path):
    """gpt-oss's experts load through their own layout, not slices: a NaN there is refused
    in one line as in any other weight (NaN logits pick token 0: a silent early stop)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    from treeflash.checkpoints import write_tiny_tokenizer
    write_tiny_tokenizer(tmp_path)
    GptOssForCausalLM(GptOssConfig(vocab_size=260, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
                                   num_experts_per_tok=1, bos_token_id=0, eos_token_id=0, pad_token_id=1)
                      ).save_pretrained(tmp_path)
    w = load_file(str(tmp_path / "model.safetensors"))
    w["model.layers.1.mlp.experts.gate_up_proj"][1, 3, 5] = float("nan")
    save_file(w, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    refused(lambda: LLM(tmp_path, device="cpu", dtype="float32"), "layers.1.mlp.experts", "NaN or infinite")


# ----------------------------------------------------------------------------- tokenizer BOS


def test_add_bos_token_with_a_post_processor_that_adds_it_gives_one_bos(tmp_path):
    """Llama 2 / Mistral style: tokenizer.json's post-processor adds <s> and
    tokenizer_config.json says add_bos_token: one BOS, as transformers gives."""
    from tokenizers import Tokenizer as HF
    from tokenizers import processors

    from treeflash.checkpoints import write_tiny_tokenizer
    from treeflash.tokenizer import Tokenizer
    write_tiny_tokenizer(tmp_path)
    tok = HF.from_file(str(tmp_path / "tokenizer.json"))
    bos = tok.token_to_id("<|pad|>")
    tok.post_processor = processors.TemplateProcessing(single="<|pad|> $A", special_tokens=[("<|pad|>", bos)])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True, "bos_token": "<|pad|>"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": bos}))
    ids = Tokenizer(tmp_path).encode("def fib(n):")
    assert ids[0] == bos and ids[1] != bos


def test_add_bos_token_prepends_the_tokenizers_bos_token(tmp_path):
    """add_bos_token prepends the bos_token tokenizer_config.json names, as transformers'
    tokenizers do, also where no generation_config.json or config.json gives a
    bos_token_id (the prompt lost its BOS), and before a different id they give."""
    from treeflash.checkpoints import write_tiny_tokenizer
    from treeflash.tokenizer import Tokenizer
    write_tiny_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True,
                                                                "bos_token": {"content": "<|pad|>"}}))
    tok = Tokenizer(tmp_path)
    bos = tok.tok.token_to_id("<|pad|>")
    assert tok.encode("def fib(n):")[0] == bos and tok.encode("def fib(n):", special=False)[0] != bos
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": bos + 1}))
    assert Tokenizer(tmp_path).encode("def fib(n):")[0] == bos


# ----------------------------------------------------------------------------- defaults as transformers reads them


def test_keys_a_dense_config_leaves_out_take_transformers_defaults():
    """A Qwen3 or Llama config without rope_theta, tie_word_embeddings, max_window_layers
    (the first sliding layer), head_dim (Qwen3's is 128, Llama's hidden / heads) or
    max_position_embeddings runs the model transformers builds from it: its config
    classes' defaults, not others."""
    from transformers import LlamaConfig, Qwen3Config
    qwen3 = {**TINY_TARGET, "num_hidden_layers": 30, "use_sliding_window": True, "max_position_embeddings": 8192}
    ours, theirs = ModelConfig.from_dict(qwen3), Qwen3Config(**qwen3)
    rope = getattr(theirs, "rope_parameters", None) or {"rope_theta": theirs.rope_theta}
    assert ours.rope_theta == rope["rope_theta"] == 10000.0
    assert ours.tie_word_embeddings is theirs.tie_word_embeddings is False
    slides = tuple(i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention")
    assert ours.sliding_layers == slides == (28, 29)
    llama = {k: v for k, v in TINY_TARGET.items() if k not in ("head_dim", "max_position_embeddings")}
    llama.update(architectures=["LlamaForCausalLM"], model_type="llama")
    assert ModelConfig.from_dict(llama).head_dim == LlamaConfig(**llama).head_dim == 16
    assert ModelConfig.from_dict(llama).max_position_embeddings == LlamaConfig(**llama).max_position_embeddings
    bare = {k: v for k, v in TINY_TARGET.items() if k not in ("head_dim", "max_position_embeddings")}
    ours, theirs = ModelConfig.from_dict(bare), Qwen3Config(**bare)
    assert (ours.head_dim, ours.max_position_embeddings) == (theirs.head_dim, theirs.max_position_embeddings) \
        == (128, 32768)


def test_keys_a_qwen3_moe_config_leaves_out_take_transformers_defaults():
    """Qwen3MoeConfig's defaults: routing weights not renormalized (norm_topk_prob false)
    and experts in every layer (decoder_sparse_step 1): other ones change the logits."""
    from transformers import Qwen3MoeConfig
    moe = {**TINY_TARGET, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    ours, theirs = ModelConfig.from_dict(moe), Qwen3MoeConfig(**moe)
    assert (ours.norm_topk_prob, ours.decoder_sparse_step) == (theirs.norm_topk_prob, theirs.decoder_sparse_step) \
        == (False, 1)
    assert [ours.sparse_layer(i) for i in range(4)] == [True] * 4


def test_keys_a_gpt_oss_config_leaves_out_take_transformers_defaults():
    """GptOssConfig's sliding window (128) and the experts' SwiGLU clamp (7.0) for a
    config that leaves them out."""
    from transformers import GptOssConfig
    data = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 64,
            "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "vocab_size": 300, "num_local_experts": 4, "num_experts_per_tok": 2}
    ours, theirs = ModelConfig.from_dict(data), GptOssConfig(**data)
    assert (ours.sliding_window, ours.swiglu_limit) == (theirs.sliding_window, theirs.swiglu_limit) == (128, 7.0)


def test_a_one_layer_drafter_taps_the_targets_middle_layer_by_default():
    """DFlash's build_target_layer_ids for a single draft layer: the target's layer
    num_target_layers // 2 (not the evenly spaced rule of deeper drafters)."""
    from treeflash.config import default_target_layer_ids
    assert default_target_layer_ids(36, 1) == [18]
    data = {**TINY_DRAFT, "num_hidden_layers": 1, "dflash_config": {"mask_token_id": 2}}
    assert DraftConfig.from_dict(data).target_layer_ids == [2]


def test_a_drafter_whose_layers_all_precede_max_window_layers_loads_unslid():
    """use_sliding_window with max_window_layers = the drafter's layer count: transformers'
    rule slides from that layer on, so none slides; nothing is causal, nothing refused."""
    data = {**TINY_DRAFT, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    assert DraftConfig.from_dict(data).layers.sliding_layers == ()


def test_a_moe_that_routes_to_every_expert_loads():
    """num_experts_per_tok equal to num_experts (every expert active) is a valid config,
    as transformers reads it: only more than there are is refused."""
    moe = {**TINY_TARGET, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
           "num_experts_per_tok": 4, "moe_intermediate_size": 16}
    assert ModelConfig.from_dict(moe).num_experts_per_tok == 4


def test_dtype_wins_over_torch_dtype_as_in_transformers_5():
    """A config holding both names (transformers 5 writes `dtype`, older ones
    `torch_dtype`): the weights' dtype of dtype "auto" is the one transformers 5 reads."""
    from transformers import Qwen3Config
    data = {**TINY_TARGET, "dtype": "bfloat16", "torch_dtype": "float32"}
    assert ModelConfig.from_dict(data).torch_dtype == "bfloat16"
    assert Qwen3Config.from_dict(data).dtype == torch.bfloat16


def test_architectures_as_a_lone_name_is_read_as_a_list_of_one():
    """`"architectures": "LlamaForCausalLM"` (hand-written; transformers keeps it) names
    the model as the one-name list does."""
    data = {**TINY_TARGET, "architectures": "LlamaForCausalLM", "model_type": "llama"}
    assert ModelConfig.from_dict(data).arch == "llama"


# --------------------------------------------------------------------------- small files and memory figures (cases a mutation review found untested)


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads Linux's /proc")
def test_the_cpus_available_memory_is_in_bytes():
    """Every memory check (weights, caches, rounds, training) compares bytes with this:
    /proc/meminfo counts in KiB. It lies between the free memory (the kernel's MemFree,
    less its reserve) and the whole of it."""
    from treeflash.memory import available_bytes
    page = os.sysconf("SC_PAGE_SIZE")
    have = available_bytes(torch.device("cpu"))
    assert os.sysconf("SC_AVPHYS_PAGES") * page / 2 < have <= os.sysconf("SC_PHYS_PAGES") * page


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="resets the peak through Linux's /proc")
def test_the_load_figures_tell_the_resident_size_from_its_peak():
    """load_stats' rss_growth_bytes is the peak resident size during a load, reset at its
    start, less the size before it: 64 MiB touched, then unmapped, stay in the peak only."""
    import mmap

    from treeflash.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
    mib = 2 ** 20
    with mmap.mmap(-1, 64 * mib) as pages:  # mapped and unmapped here, whatever malloc's free lists hold
        for i in range(0, len(pages), mmap.PAGESIZE):
            pages[i] = 1
    assert rss_bytes() < peak_rss_bytes() - 32 * mib
    reset_peak_rss()
    assert peak_rss_bytes() < rss_bytes() + 32 * mib


def test_a_file_of_exactly_the_size_limit_is_read(tmp_path):
    """The limit is what a file may hold: at it the file is read, one byte past it refused."""
    from treeflash.files import read_text
    f = tmp_path / "grammar.txt"
    f.write_text("root ::= \"a\"")
    size = f.stat().st_size
    assert read_text(f, max_bytes=size) == f.read_text()
    refused(lambda: read_text(f, max_bytes=size - 1), f"{size:,} bytes, more than the {size - 1:,} it may hold")


def test_only_a_cpu_load_is_checked_against_the_hosts_memory(monkeypatch):
    """A GPU's weights do not stay in host memory: a host with less free memory than the
    model still loads it onto the GPU (CUDA reports its own shortage)."""
    import treeflash.memory as memory
    monkeypatch.setattr(memory, "available_bytes", lambda device: 0)
    with torch.device("meta"):
        shells = [torch.nn.Linear(64, 64)]
    memory.check_weights_fit(shells, torch.bfloat16, torch.device("cuda"))
    refused(lambda: memory.check_weights_fit(shells, torch.bfloat16, torch.device("cpu")),
            "not enough cpu memory for the weights")


def test_the_weights_need_counts_fp8_and_packed_parameters_at_their_own_size(monkeypatch):
    """Float32 shells are counted in the dtype asked for; an FP8 (or packed) parameter at
    its stored byte each: an FP8 checkpoint that fits is not refused as if it were bf16.
    The refusal gives both figures in GiB."""
    import treeflash.memory as memory
    with torch.device("meta"):
        dense = torch.nn.Linear(64, 64)
        fp8 = torch.nn.Module()
        fp8.weight = torch.nn.Parameter(torch.empty(64, 64, dtype=torch.float8_e4m3fn), requires_grad=False)
    need = (64 * 64 + 64) * 2 + 64 * 64
    monkeypatch.setattr(memory, "available_bytes", lambda device: need)
    memory.check_weights_fit([dense, fp8], torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(memory, "available_bytes", lambda device: need - 1)
    refused(lambda: memory.check_weights_fit([dense, fp8], torch.bfloat16, torch.device("cpu")),
            "not enough cpu memory for the weights")
    with torch.device("meta"):
        big = torch.nn.Linear(65536, 8192, bias=False)  # 2 GiB in float32
    monkeypatch.setattr(memory, "available_bytes", lambda device: 3 * 2 ** 29)
    refused(lambda: memory.check_weights_fit([big], torch.float32, torch.device("cpu")),
            "not enough cpu memory for the weights: 2.0 GiB in float32, 1.5 GiB free: load them in bfloat16 "
            "(--dtype bfloat16) or on a GPU")


def test_a_host_whose_free_memory_is_unknown_loads(monkeypatch):
    """Where the free memory cannot be read (no /proc/meminfo: macOS), the weights are
    loaded unchecked, not refused with an error of the check's own."""
    import treeflash.memory as memory
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)
    with torch.device("meta"):
        shells = [torch.nn.Linear(64, 64)]
    memory.check_weights_fit(shells, torch.float32, torch.device("cpu"))


def test_a_gpus_available_memory_counts_what_torchs_allocator_holds_unused(monkeypatch):
    """On CUDA, memory torch's caching allocator reserved but does not use is free for the
    next tensor: the driver's free memory plus reserved less allocated."""
    from treeflash.memory import available_bytes
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * gib)
    assert available_bytes(torch.device("cuda", 0)) == 12 * gib


def test_the_cpus_available_memory_is_memavailable_not_memfree(monkeypatch):
    """Linux's MemAvailable counts the page cache the kernel gives back (a model's files
    just read fill it): MemFree alone would refuse a model that fits."""
    import io

    import treeflash.memory as memory
    meminfo = "MemTotal:       16000000 kB\nMemFree:          1000000 kB\nMemAvailable:    9000000 kB\n"
    monkeypatch.setattr(memory, "open", lambda path, *a, **k: io.StringIO(meminfo), raising=False)
    assert memory.available_bytes(torch.device("cpu")) == 9000000 * 1024


def test_a_random_drafter_matches_its_target(tmp_path):
    """write_random_drafter: the target's RoPE scaling (positions past the original
    context must rotate as the target's do), taps clamped to its layers, the last token
    as the default MASK; write_random_target writes the EOS id it is given, none too."""
    from conftest import LLAMA3_ROPE

    from treeflash.checkpoints import write_random_drafter, write_random_target
    vocab, layers = 64, 2
    target = write_random_target(tmp_path / "t", hidden_size=32, num_layers=layers, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64, vocab_size=vocab, rope_scaling=LLAMA3_ROPE, eos_token_id=None)
    assert json.loads((target / "config.json").read_text())["eos_token_id"] is None
    config = json.loads((write_random_drafter(target, tmp_path / "d", num_layers=1, target_layer_ids=[-1, 5])
                         / "config.json").read_text())
    assert config["rope_scaling"] == LLAMA3_ROPE
    assert config["dflash_config"] == {"mask_token_id": vocab - 1, "target_layer_ids": [0, layers - 1]}


def test_a_random_drafter_is_written_as_asked(tmp_path):
    """write_random_drafter's block size, MASK token and dtype are those asked for (tests
    that ask for a block of 4 in bfloat16 get one), and its config says so as a published
    drafter's does."""
    from safetensors.torch import load_file

    from treeflash.checkpoints import write_random_drafter, write_random_target
    target = write_random_target(tmp_path / "t", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                 intermediate_size=64, vocab_size=64)
    folder = write_random_drafter(target, tmp_path / "d", num_layers=1, block_size=4, mask_token_id=2,
                                  dtype=torch.bfloat16)
    config = json.loads((folder / "config.json").read_text())
    draft = DraftConfig.from_dict(config)
    assert (draft.block_size, draft.mask_token_id, config["torch_dtype"]) == (4, 2, "bfloat16")
    assert {t.dtype for t in load_file(str(folder / "model.safetensors")).values()} == {torch.bfloat16}


def test_tokens_declared_out_of_id_order_load_at_their_ids_as_transformers(tmp_path):
    """added_tokens_decoder's keys need not come in id order (sorted as text, "100000"
    precedes "99999"): each missing token is added at the id it declares, with the
    lstrip it declares, as transformers loads them (taken in file order, the second was
    given the first's id and the load refused)."""
    from transformers import AutoTokenizer

    from treeflash.checkpoints import write_tiny_tokenizer
    from treeflash.tokenizer import Tokenizer
    write_tiny_tokenizer(tmp_path / "base")
    n = Tokenizer(tmp_path / "base").vocab_size
    entry = {"rstrip": False, "normalized": False, "single_word": False, "special": False}
    folder = _tiny_tokenizer_folder(tmp_path / "ck", {"added_tokens_decoder": {
        str(n + 1): {**entry, "content": "<b>", "lstrip": True}, str(n): {**entry, "content": "<a>", "lstrip": False}}})
    ours, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert [ours.tok.token_to_id(t) for t in ("<a>", "<b>")] == hf.convert_tokens_to_ids(["<a>", "<b>"]) == [n, n + 1]
    text = "x <a> y <b> z"
    assert ours.encode(text, special=False) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text, special=False)) == hf.decode(hf.encode(text, add_special_tokens=False))


def test_add_bos_token_without_any_bos_loads_and_prepends_nothing(tmp_path):
    """add_bos_token with no bos_token and no bos_token_id anywhere: transformers
    prepends nothing, and so does treeflash; the tokenizer loads."""
    from transformers import AutoTokenizer

    from treeflash.tokenizer import Tokenizer
    folder = _tiny_tokenizer_folder(tmp_path, {"add_bos_token": True})
    tok = Tokenizer(folder)
    assert tok.bos_token_id is None and not tok.add_bos
    text = "def fib(n):"
    assert tok.encode(text) == AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"] \
        == tok.encode(text, special=False)


def test_a_bos_id_equal_to_the_vocabulary_size_is_outside_it(tmp_path):
    folder = _tiny_tokenizer_folder(tmp_path, {"add_bos_token": True})
    size = Tokenizer(folder).vocab_size
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": size - 1}))
    assert Tokenizer(folder).encode("def fib(n):")[0] == size - 1
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": size}))
    refused(lambda: Tokenizer(folder), "bos_token_id", f"from 0 to {size - 1}", f"got {size}")


def test_end_ids_of_config_and_generation_config_both_end_a_request(tmp_path):
    """config.json's eos_token_id and generation_config.json's are both end tokens, each
    named by the file that gives it, beside the tokenizer's own EOS."""
    folder = _tiny_tokenizer_folder(tmp_path, {})
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 3}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [4]}))
    tok = Tokenizer(folder)
    assert tok.eos_sources == {3: "config.json", 4: "generation_config.json", tok.eos_token_id: "tokenizer_config.json"}
    assert tok.eos_token_ids == sorted({3, 4, tok.eos_token_id})


def test_yarn_with_deepseeks_attention_scale_in_either_key_is_refused():
    """DeepSeek's YaRN scales attention by mscale or mscale_all_dim, which the engine does
    not apply: either key alone is refused, not ignored."""
    from treeflash.config import ModelConfig
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert ModelConfig.from_dict({**TINY_TARGET, "rope_scaling": yarn}).rope_scaling["factor"] == 4.0
    for key in ("mscale", "mscale_all_dim"):
        with pytest.raises(TreeflashError, match="mscale"):
            ModelConfig.from_dict({**TINY_TARGET, "rope_scaling": {**yarn, key: 0.7}})


def test_a_quantized_drafter_is_refused():
    from treeflash.config import DraftConfig
    DraftConfig.from_dict(TINY_DRAFT)
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(TreeflashError, match="quantization_config"):
        DraftConfig.from_dict({**TINY_DRAFT, "quantization_config": quant})
