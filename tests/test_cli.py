"""Issue 2, point 3: `treeflash generate` on the command line.

Every bad input gives one clear line on stderr starting "treeflash: error:", no
traceback, nothing on stdout, and exit code 2 for usage errors (bad arguments,
bad prompt files) or 1 for the rest (bad model files, a prompt that does not fit).
The happy path: plain and --json output, --prompt-file with plain lines and JSONL,
stop strings, EOS.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ENGINE_PROMPTS
from safetensors.torch import load_file, save_file

from treeflash import LLM, SamplingParams
from treeflash.cli import main
from treeflash.errors import UsageError

STATS_KEYS = {"method", "new_tokens", "rounds", "tau", "seconds", "tokens_per_s"}

DEEP = "[" * 100_000 + "]" * 100_000  # deeper than the JSON parser recurses (Python 3.12+ went past 5000)


def run(capsys, *args):
    capsys.readouterr()  # drop what fixtures printed (transformers' progress bars)
    rc = main(["generate", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_error(rc, out, err, code, *words):
    assert rc == code, err
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("treeflash: error: "), err   # not "internal error": a known failure
    assert "Traceback" not in err
    for w in words:
        assert w.lower() in lines[0].lower(), (w, lines[0])


@pytest.fixture
def model(hf_checkpoint):
    return hf_checkpoint("qwen3").path


@pytest.fixture
def broken(hf_checkpoint, tmp_path):
    """A private copy of the qwen3 checkpoint to damage."""
    return hf_checkpoint("qwen3").copy_to(tmp_path / "ckpt")


def rewrite_weights(folder, change):
    path = folder / "model.safetensors"
    w = load_file(str(path))
    change(w)
    save_file(w, str(path), metadata={"format": "pt"})


def edit_config(folder, change):
    cfg = json.loads((folder / "config.json").read_text())
    change(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))


# --------------------------------------------------------------------------- model files: exit 1


def test_missing_model_folder(capsys, tmp_path):
    assert_error(*run(capsys, "hi", "--model", tmp_path / "nowhere", "--device", "cpu"), 1,
                 "not found", "nowhere")


def test_empty_model_paths_are_refused(capsys, model, tmp_path, monkeypatch):
    """Path("") is the current folder: an empty --model must not load whatever is there."""
    monkeypatch.chdir(model)   # the current folder holds a checkpoint
    assert_error(*run(capsys, "hi", "--model", "", "--device", "cpu"), 1, "empty model path")
    assert_error(*run(capsys, "hi", "--model", model, "--draft-model", " ", "--device", "cpu"), 1,
                 "empty drafter path")


def test_drafter_path_errors_name_the_drafter(capsys, model, tmp_path):
    assert_error(*run(capsys, "hi", "--model", model, "--draft-model", tmp_path / "nowhere", "--device", "cpu"),
                 1, "drafter folder not found", "nowhere")
    assert_error(*run(capsys, "hi", "--model", model, "--draft-model", tmp_path, "--device", "cpu"),
                 1, "config.json not found", "the drafter folder")


def test_model_path_is_a_file(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    assert_error(*run(capsys, "hi", "--model", tmp_path / "file", "--device", "cpu"), 1, "not a folder")


def test_missing_config_json(capsys, broken):
    (broken / "config.json").unlink()
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, "config.json", "not found")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", ""])
def test_malformed_config_json(capsys, broken, text):
    (broken / "config.json").write_text(text)
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, "malformed config.json")


def test_config_lacking_a_required_key(capsys, broken):
    edit_config(broken, lambda c: c.pop("hidden_size"))
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, "hidden_size")


def test_unsupported_architecture(capsys, broken):
    def change(c):
        c["architectures"] = ["MixtralForCausalLM"]
        c["model_type"] = "mixtral"
    edit_config(broken, change)
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1,
                 "unsupported architecture", "MixtralForCausalLM")


def test_architectures_and_model_type_that_disagree(capsys, broken):
    """transformers builds what model_type names: a Mistral (sliding window) whose
    architectures say Llama ran as Llama, with other logits past the window."""
    edit_config(broken, lambda c: c.update(model_type="mistral", sliding_window=8))
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1,
                 "architectures names", "but model_type is 'mistral'")


def test_unsupported_rope_scaling(capsys, broken):
    edit_config(broken, lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                            "rope_theta": 10000.0}))
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, "rope scaling type 'dynamic'")


@pytest.mark.parametrize("change,words", [
    (lambda c: c.update(rms_norm_eps="abc"), ["rms_norm_eps"]),
    (lambda c: c.update(num_key_value_heads="two"), ["num_key_value_heads"]),
    (lambda c: c.update(max_position_embeddings=-4), ["max_position_embeddings"]),
    (lambda c: c.update(eos_token_id="x"), ["eos_token_id"]),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0}), ["factor"]),
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": "big"}), ["rope_theta"]),
    (lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}), ["quantized", "awq"]),
    (lambda c: c.update(quantization_config={"quant_method": "fp8"}), ["per-tensor", "block-scaled FP8"]),
    (lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128]}),
     ["weight_block_size", "two positive integers"]),
    (lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                             "activation_scheme": "static"}), ["FP8 e4m3 weights with static"]),
    (lambda c: c.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                             "fmt": "e5m2"}), ["FP8 e5m2 weights with dynamic"]),
    # numbers that pass as numbers but overflow float32: every logit NaN, the answer token 0
    (lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e-300}), ["rope_theta 1e-300 gives rotary angles that overflow float32"]),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 1e-300,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
     ["with its rope scaling gives rotary angles that overflow"]),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                         "attention_factor": 1e300}), ["attention_factor 1e+300 is above 10"]),
], ids=["eps", "kv-heads", "max-pos", "eos", "llama3-no-factor", "theta", "awq", "fp8-per-tensor", "fp8-block",
        "fp8-static", "fp8-e5m2", "theta-tiny", "llama3-factor-tiny", "yarn-attention-factor"])
def test_bad_config_values(capsys, broken, change, words):
    """Values of the wrong type or range: a clear error naming the key, not an
    "internal error" from deep inside the engine (or a silently wrong model)."""
    edit_config(broken, change)
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, *words)


def test_bad_generation_config_eos(capsys, broken):
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, "x"]}))
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1,
                 "generation_config.json", "eos_token_id")


def test_options_left_out_take_the_models_generation_config(capsys, broken, model):
    """As LLM.generate and the server: a sampling option left out takes the model's
    generation_config.json value (with a note saying so), one given wins, and
    --generation-config none takes SamplingParams' own defaults. A bad value is refused
    naming the file."""
    import treeflash
    path = broken / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "max_new_tokens": 5, "repetition_penalty": 1.3}))
    prompt = ENGINE_PROMPTS[1]
    want = treeflash.LLM(model, device="cpu").generate(
        prompt, treeflash.SamplingParams(max_new_tokens=5, repetition_penalty=1.3, ignore_eos=True))[0]
    rc, out, err = run(capsys, prompt, "--model", broken, "--device", "cpu", "--json", "--ignore-eos")
    assert rc == 0, err
    assert json.loads(out)["token_ids"] == want.token_ids
    assert "max_new_tokens 5, repetition_penalty 1.3 from the model's generation_config.json" in err
    rc, out, err = run(capsys, prompt, "--model", broken, "--device", "cpu", "--json", "--ignore-eos",
                       "--max-new-tokens", 3, "--repetition-penalty", 1)
    assert rc == 0 and len(json.loads(out)["token_ids"]) == 3 and "generation_config" not in err
    rc, out, err = run(capsys, prompt, "--model", broken, "--device", "cpu", "--json", "--ignore-eos",
                       "--generation-config", "none")
    assert rc == 0 and len(json.loads(out)["token_ids"]) == 128 and "generation_config" not in err
    # vLLM's other values: vllm (none's name there) and a folder of its own
    rc, out, err = run(capsys, prompt, "--model", broken, "--device", "cpu", "--json", "--ignore-eos",
                       "--generation-config", "vllm", "--max-new-tokens", 4)
    assert rc == 0 and len(json.loads(out)["token_ids"]) == 4 and "generation_config" not in err
    other = broken.parent / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2}))
    rc, out, err = run(capsys, prompt, "--model", broken, "--device", "cpu", "--json", "--ignore-eos",
                       "--generation-config", other)
    assert rc == 0 and len(json.loads(out)["token_ids"]) == 2, err
    assert f"max_new_tokens 2 from {other}/generation_config.json" in err
    assert_error(*run(capsys, prompt, "--model", broken, "--device", "cpu", "--generation-config", broken.parent),
                 2, "--generation-config must be 'auto', 'none'")
    path.write_text(json.dumps({**config, "top_p": 0}))
    assert_error(*run(capsys, prompt, "--model", broken, "--device", "cpu"), 2, "generation_config.json", "top_p")
    # none reads no sampling value of the file, so a bad one does not keep the model from loading
    rc, out, err = run(capsys, prompt, "--model", broken, "--device", "cpu", "--json", "--max-new-tokens", 3,
                       "--generation-config", "none")
    assert rc == 0 and len(json.loads(out)["token_ids"]) <= 3, err


def test_sampling_options_at_temperature_0_say_they_do_nothing(capsys, model):
    """Decoding is greedy unless a temperature is given (or the model's
    generation_config.json sets one), where vLLM's default temperature is 1: --top-p or
    --seed alone gets a note that they have no effect, and the greedy tokens."""
    args = (ENGINE_PROMPTS[1], "--model", model, "--device", "cpu", "--json", "--max-new-tokens", 6, "--ignore-eos")
    rc, greedy, err = run(capsys, *args)
    assert rc == 0 and "no effect" not in err, err
    rc, out, err = run(capsys, *args, "--top-p", 0.9, "--seed", 3)
    assert rc == 0 and json.loads(out)["token_ids"] == json.loads(greedy)["token_ids"]
    assert "note: --top-p, --seed have no effect at temperature 0 (greedy decoding): give --temperature" in err
    rc, out, err = run(capsys, *args, "--top-k", 5, "--temperature", 0.8, "--seed", 3)
    assert rc == 0 and "no effect" not in err, err
    # --draft-mode shapes the trees of sampled requests only (the built-in pair drafts)
    rc, out, err = run(capsys, "def f(x):", "--device", "cpu", "--max-new-tokens", 4, "--draft-mode", "scaled")
    assert rc == 0 and "note: --draft-mode has no effect at temperature 0" in err, err


def test_a_hub_id_loads_from_the_hugging_face_cache(capsys, model, tmp_path, monkeypatch):
    """--model org/name (and LLM("org/name")) reads the snapshot that huggingface-cli and
    transformers left in the cache (refs/main's), as vLLM does offline; an id not cached
    says so, and that nothing is downloaded. Training (CLI and functions) takes ids too."""
    import shutil

    import treeflash
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(model, repo / "snapshots" / "abc123")
    (repo / "snapshots" / "old").mkdir()  # an older snapshot without a config: not taken
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    args = (ENGINE_PROMPTS[0], "--device", "cpu", "--json", "--max-new-tokens", 4, "--ignore-eos")
    rc, out, err = run(capsys, *args, "--model", "org/tiny")
    assert rc == 0, err
    rc, want, err = run(capsys, *args, "--model", model)
    assert json.loads(out)["token_ids"] == json.loads(want)["token_ids"]
    assert treeflash.LLM("org/tiny", device="cpu").model_path == repo / "snapshots" / "abc123"
    # without HF_HOME or HF_HUB_CACHE the cache is under $XDG_CACHE_HOME, as huggingface_hub puts it
    from treeflash.files import hub_snapshot
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    shutil.copytree(tmp_path / "hub", tmp_path / "xdg" / "huggingface" / "hub")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    xdg_repo = tmp_path / "xdg" / "huggingface" / "hub" / "models--org--tiny"
    assert hub_snapshot("org/tiny") == xdg_repo / "snapshots" / "abc123"
    monkeypatch.setenv("HF_HOME", "$XDG_CACHE_HOME/huggingface")  # expanded, as huggingface_hub does
    assert hub_snapshot("org/tiny") is not None
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert_error(*run(capsys, *args, "--model", "org/absent"), 1, "model folder not found: org/absent",
                 "Hugging Face cache", "does not download")
    rc, out, err = run(capsys, *args, "--model", "./typo")  # a path, not an id: no word of the cache
    assert rc == 1 and "model folder not found: ./typo" in err and "Hugging Face" not in err
    assert "`hf download org/absent`" in run(capsys, *args, "--model", "org/absent")[2]
    # training takes the id too: its tokenizer for a corpus, and the target it generates with
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f(x):\n    return x + 1\n" * 40)
    train = ["train", "corpus", "--tokenizer", "org/tiny", "--out", "corpus", "--roots", "src",
             "--heldout-fraction", "0"]
    assert main(train) == 0, capsys.readouterr().err
    train = ["train", "generate", "--target", "org/tiny", "--data", "corpus", "--out", "gen", "--num-prompts", "2",
             "--prompt-len", "4", "--new-tokens", "4", "--heldout-prompts", "0", "--device", "cpu"]
    assert main(train) == 0, capsys.readouterr().err
    assert (tmp_path / "gen.npz").is_file()
    # and so do the training functions the CLI calls, as `LLM` does
    from treeflash.train.corpus import write_corpus
    from treeflash.train.drafter import generate_continuations
    write_corpus("org/tiny", tmp_path / "corpus2", [src], heldout_fraction=0)
    meta = generate_continuations("org/tiny", tmp_path / "corpus2", tmp_path / "gen2", num_prompts=2, prompt_len=4,
                                  new_tokens=4, heldout_prompts=0, device="cpu")
    with np.load(meta["path"]) as a, np.load(tmp_path / "gen.npz") as b:
        assert a["ids"].shape == b["ids"].shape == (2, 8)


def test_integer_weights_are_refused(capsys, broken):
    """int8 tensors under the usual names (quantized checkpoints) must not be cast to
    float and run as garbage."""
    key = "model.layers.0.mlp.up_proj.weight"
    rewrite_weights(broken, lambda w: w.update({key: w[key].to(torch.int8)}))
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, key, "dtype")


def test_tokenizer_larger_than_the_model_vocabulary(capsys, tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from treeflash.checkpoints import write_tiny_tokenizer
    folder = tmp_path / "small-vocab"
    assert write_tiny_tokenizer(folder) > 100
    Qwen3ForCausalLM(Qwen3Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16)).save_pretrained(folder)
    assert_error(*run(capsys, "the quick brown fox", "--model", folder, "--device", "cpu"), 1, "vocab")


def test_missing_weight(capsys, broken):
    rewrite_weights(broken, lambda w: w.pop("model.layers.1.mlp.down_proj.weight"))
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1,
                 "model.layers.1.mlp.down_proj.weight", "missing")


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(capsys, broken, value):
    """NaN weights give NaN logits, whose argmax is token 0: without the check the
    answer looked like a normal early stop (finish_reason "stop", no text)."""
    def change(w):
        w["model.layers.0.mlp.up_proj.weight"][3, 5] = value
    rewrite_weights(broken, change)
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1,
                 "model.layers.0.mlp.up_proj.weight", "NaN or infinite")


def test_float32_weights_too_large_for_float16_are_refused(capsys, broken):
    rewrite_weights(broken, lambda w: w["model.norm.weight"].__setitem__(0, 1e6))  # finite in float32
    rc, out, err = run(capsys, "hi", "--model", broken, "--device", "cpu", "--json", "--max-new-tokens", 1)
    assert rc == 0, err   # float32 holds it
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu", "--dtype", "float16"), 1,
                 "model.norm.weight", "too large for torch.float16")


@pytest.mark.parametrize("key", ["model.layers.0.self_attn.k_proj.weight",   # part of merged QKV
                                 "model.norm.weight", "lm_head.weight"])
def test_weight_of_the_wrong_shape(capsys, broken, key):
    def change(w):
        shape = list(w[key].shape)
        shape[-1] += 1
        w[key] = torch.zeros(shape)
    rewrite_weights(broken, change)
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, key, "shape")


def test_config_with_fewer_layers_than_the_weights(capsys, broken):
    """A config.json that disagrees with its weights would run a different model (the
    last layer silently dropped): refused, naming a tensor left over."""
    edit_config(broken, lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] - 1))
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, "no place for", "model.layers.")


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias", "mlp_bias"])
def test_flags_must_be_true_or_false(capsys, broken, key):
    edit_config(broken, lambda c: c.update({key: "false"}))  # bool("false") is True
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, key, "true or false")


def test_tied_config_with_a_different_stored_lm_head(capsys, broken):
    edit_config(broken, lambda c: c.update(tie_word_embeddings=True))
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, "tie_word_embeddings",
                 "lm_head.weight")


def test_tied_config_with_an_equal_stored_lm_head_loads(capsys, broken):
    """Checkpoints of tied models that also store the LM head (equal to the embeddings)
    load; the output is the untied model's, whose head is that same matrix."""
    rewrite_weights(broken, lambda w: w.update({"lm_head.weight": w["model.embed_tokens.weight"].clone()}))
    rc, untied, _ = run(capsys, "hi", "--model", broken, "--device", "cpu", "--max-new-tokens", 4)
    assert rc == 0
    edit_config(broken, lambda c: c.update(tie_word_embeddings=True))
    rc, tied, err = run(capsys, "hi", "--model", broken, "--device", "cpu", "--max-new-tokens", 4)
    assert rc == 0, err
    assert tied == untied


def test_missing_shard_of_a_sharded_checkpoint(capsys, hf_checkpoint, tmp_path):
    """`generate` on a sharded checkpoint with a shard gone: exit 1, one line naming the
    shard as missing (the test's folder name holds "missing" too: the phrase is checked)."""
    folder = hf_checkpoint("qwen3-tied-sharded").copy_to(tmp_path / "sharded")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (folder / shard).unlink()
    assert_error(*run(capsys, "hi", "--model", folder, "--device", "cpu"), 1, shard, "is missing from")


def test_truncated_weights_file(capsys, broken):
    path = broken / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, "model.safetensors")


def test_missing_tokenizer(capsys, broken):
    (broken / "tokenizer.json").unlink()
    assert_error(*run(capsys, "hi", "--model", broken, "--device", "cpu"), 1, "tokenizer.json")


def test_prompt_longer_than_the_context_limit(capsys, model):
    long = ENGINE_PROMPTS[1]
    assert_error(*run(capsys, long, "--model", model, "--device", "cpu", "--max-model-len", 8), 2,
                 "maximum context length is 8 tokens")  # bad input, as an empty prompt: a usage error


@pytest.mark.parametrize("json_out", [False, True])
def test_truncate_prompt_tokens_reads_a_long_prompt(capsys, model, json_out):
    """--truncate-prompt-tokens K: a prompt past the context is read from its last K tokens
    (streamed or as JSON), as the API's truncate_prompt_tokens reads it."""
    from treeflash import LLM, SamplingParams
    long = ENGINE_PROMPTS[1]
    code, out, err = run(capsys, long, "--model", model, "--device", "cpu", "--max-model-len", 8,
                         "--max-new-tokens", 2, "--ignore-eos", "--truncate-prompt-tokens", 4,
                         *(["--json"] if json_out else []))
    assert code == 0, err
    want = LLM(model, device="cpu", max_model_len=8).generate(
        long, SamplingParams(max_new_tokens=2, ignore_eos=True, truncate_prompt_tokens=4))[0]
    if json_out:
        assert json.loads(out.splitlines()[0])["token_ids"] == want.token_ids
    else:
        assert out.rstrip("\n") == want.text


def test_output_cut_by_the_context_limit_says_so(capsys, model):
    """A prompt read from its last max_model_len - 1 tokens leaves room for one new
    token: the output stops there, finish_reason "length", and the stats line says why
    (it printed a bare "1 tokens" where 3 were asked for); an output that got all its
    tokens says nothing of the kind."""
    long = ENGINE_PROMPTS[1]
    for truncate, note in (("-1", True), ("4", False)):
        code, out, err = run(capsys, long, "--model", model, "--device", "cpu", "--max-model-len", 8,
                             "--max-new-tokens", 3, "--ignore-eos", "--truncate-prompt-tokens", truncate)
        assert code == 0, err
        assert (": 1 tokens" in err) == note and ("stopped at the context limit of 8" in err) == note, err


def test_prompt_longer_than_max_position_embeddings(capsys, broken):
    edit_config(broken, lambda c: c.update(max_position_embeddings=6))
    assert_error(*run(capsys, ENGINE_PROMPTS[1], "--model", broken, "--device", "cpu"), 2,
                 "maximum context length is 6 tokens")


# --------------------------------------------------------------------------- usage: exit 2


@pytest.mark.parametrize("args,words", [
    (["--temperature", "-1"], ["temperature"]),
    (["--top-p", "0"], ["top_p"]),
    (["--top-p", "1.5"], ["top_p"]),
    (["--top-k", "-2"], ["top_k"]),
    (["--min-p", "1.5"], ["min_p"]),
    (["--min-tokens", "5", "--max-new-tokens", "4"], ["min_tokens"]),
    (["--logit-bias", '{"x": 1}'], ["logit-bias"]),
    (["--logit-bias", '{"3": 1e5}'], ["logit_bias"]),  # past SamplingParams' 1e4
    (["--logit-bias", '{"%s": 1}' % ("1" * 5000)], ["logit_bias keys must be token ids"]),
    (["--repetition-penalty", "1e39"], ["repetition_penalty"]),
    (["--presence-penalty", "3"], ["presence_penalty"]),
    (["--repetition-penalty", "0"], ["repetition_penalty"]),
    (["--max-new-tokens", "0"], ["max_new_tokens"]),
    (["--temperature", "hot"], ["temperature"]),
    (["--dtype", "float8"], ["dtype"]),
    (["--device", "tpu"], ["device"]),
    (["--method", "ddtree"], ["draft model"]),
    (["--no-such-flag"], ["--no-such-flag"]),
])
def test_bad_arguments(capsys, model, args, words):
    assert_error(*run(capsys, "hi", "--model", model, "--device", "cpu", *args), 2, *words)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bad_max_model_len(capsys, model, value):
    assert_error(*run(capsys, "hi", "--model", model, "--device", "cpu", "--max-new-tokens", 2,
                      "--max-model-len", value), 2,
                 "max", "len")


def test_empty_prompt(capsys, model):
    assert_error(*run(capsys, "", "--model", model, "--device", "cpu"), 2, "empty prompt")


def test_no_prompt(capsys, model):
    assert_error(*run(capsys, "--model", model, "--device", "cpu"), 2, "no prompt")


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_empty_prompt_file(capsys, model, tmp_path, content):
    f = tmp_path / "prompts.txt"
    f.write_text(content)
    assert_error(*run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu"), 2,
                 "no prompt", str(f))


@pytest.mark.parametrize("line,words", [('{"prompt": "a", ', ["malformed JSON", ":2:"]),
                                        ('{"text": "a"}', ["'prompt'", ":2:"]),
                                        ('{"prompt": 5}', ["'prompt'", ":2:"]),
                                        ('{"x": ' + DEEP + '}', ["nested too deeply", ":2:"])])
def test_malformed_jsonl(capsys, model, tmp_path, line, words):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "def fib(n):"}\n' + line + "\n")
    assert_error(*run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu"), 2, *words)


@pytest.mark.parametrize("name,line,words", [("prompts.jsonl", '{"prompt": ""}', ["prompts.jsonl:3: empty prompt"]),
                                             ("prompts.txt", "x " * 5000, ["prompts.txt:3: This model's maximum context length", "does not fit"])])
def test_a_prompt_the_engine_refuses_is_named_by_its_line(capsys, model, tmp_path, name, line, words):
    """A prompt of a file that is empty once read, or too long for the context, stops
    the command before any output, naming the line to mend."""
    f = tmp_path / name
    f.write_text(("a\n\n" if name.endswith(".txt") else '{"prompt": "a"}\n\n') + line + "\n")
    assert_error(*run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu"), 2, *words)


@pytest.mark.parametrize("key", ["max_tokens", "temperature", "seed", "bad_words", "response_format"])
def test_jsonl_lines_with_per_prompt_settings_get_a_note(capsys, model, api, tmp_path, key):
    """The flags apply to every prompt: a setting in a line (a saved request body, say),
    or any other field, is not read, and the command says so instead of ignoring it
    silently."""
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt": ENGINE_PROMPTS[0], "id": 7}) + "\n" +
                 json.dumps({"prompt": ENGINE_PROMPTS[2], key: 2}) + "\n")
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, [ENGINE_PROMPTS[0], ENGINE_PROMPTS[2]], api, 3)
    assert f"note: prompts of {f} hold 'id', '{key}', which are not read: only 'prompt' is" in err


def test_a_json_prompt_file_may_hold_one_array(capsys, model, api, tmp_path):
    """A .json file holding an array (as a script's json.dump writes a list) is read as
    its items: strings, or objects with a 'prompt' whose other fields get the note; one
    holding one object written across lines is that prompt."""
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps([ENGINE_PROMPTS[0], {"prompt": ENGINE_PROMPTS[2], "id": 1}], indent=2))
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, [ENGINE_PROMPTS[0], ENGINE_PROMPTS[2]], api, 3)
    assert f"note: prompts of {f} hold 'id', which are not read" in err
    f.write_text(json.dumps({"prompt": ENGINE_PROMPTS[2]}, indent=2))  # one object, across lines
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, [ENGINE_PROMPTS[2]], api, 3)
    for text, words in [("[]", "holds no prompt"), ('["a", 3]', "[1]: a prompt must be a string"),
                        ('[{"text": "a"}]', "[0]: the object has no string 'prompt'"),
                        ('["a",', ":1: malformed JSON line"), ("7", "must hold an array")]:
        f.write_text(text)
        assert_error(*run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu"), 2, words)


@pytest.mark.parametrize("name", ["prompts.JSONL", "prompts.json"])
def test_json_prompt_files_in_any_case(capsys, model, api, tmp_path, name):
    f = tmp_path / name
    f.write_text(json.dumps({"prompt": ENGINE_PROMPTS[0]}) + "\n")
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, [ENGINE_PROMPTS[0]], api, 3)


@pytest.mark.parametrize("name,line", [("prompts.txt", ENGINE_PROMPTS[0]),
                                       ("prompts.jsonl", json.dumps({"prompt": ENGINE_PROMPTS[0]}))])
def test_a_byte_order_mark_is_not_part_of_the_prompt(capsys, model, api, tmp_path, name, line):
    f = tmp_path / name
    f.write_bytes(b"\xef\xbb\xbf" + line.encode() + b"\n")
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, [ENGINE_PROMPTS[0]], api, 3)


def test_prompt_lines_end_only_at_newlines(capsys, model, api, tmp_path):
    """A form feed in code or a raw U+2028 in a JSON string (json.dumps with
    ensure_ascii=False writes one) is part of its line: the first split one prompt in two
    silently, the second refused valid JSONL."""
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"import os\x0cimport sys\r\nx = 1\x1c\n")
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, ["import os\x0cimport sys", "x = 1\x1c"], api, 3)
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt": "a\u2028b\x85c"}, ensure_ascii=False) + "\n", encoding="utf-8")
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, ["a\u2028b\x85c"], api, 3)


def test_jsonl_under_other_names(capsys, model, api, tmp_path):
    """.ndjson and .jsonlines are JSONL; a plain-text file whose lines all look like
    JSONL prompts is read as text, as documented, with a note saying so."""
    line = json.dumps({"prompt": ENGINE_PROMPTS[0]}) + "\n"
    for name in ("prompts.ndjson", "prompts.jsonlines"):
        (tmp_path / name).write_text(line)
        rc, out, err = run(capsys, "--prompt-file", tmp_path / name, "--model", model, "--device", "cpu", "--json",
                           "--max-new-tokens", 3, "--ignore-eos")
        assert rc == 0, err
        check_json_lines(out, [ENGINE_PROMPTS[0]], api, 3)
    (tmp_path / "prompts.txt").write_text(line)
    rc, out, err = run(capsys, "--prompt-file", tmp_path / "prompts.txt", "--model", model, "--device", "cpu",
                       "--json", "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, [line.strip()], api, 3)
    assert "is read as plain text" in err and "--prompt-format json reads them as such" in err


def test_prompt_format_json_reads_jsonl_from_stdin(capsys, model, api, monkeypatch, tmp_path):
    """`cat requests.jsonl | treeflash generate --prompt-file -` had no way to say the
    lines are JSON (stdin has no .jsonl name, and /dev/stdin is no regular file):
    --prompt-format json reads them, from stdin or from a file of any name; text reads a
    .jsonl file's lines as prompts; without --prompt-file it is refused."""
    lines = "".join(json.dumps({"prompt": p}) + "\n" for p in ENGINE_PROMPTS[:2])
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    rc, out, err = run(capsys, "--prompt-file", "-", "--prompt-format", "json", "--model", model, "--device", "cpu",
                       "--json", "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, ENGINE_PROMPTS[:2], api, 3)
    (tmp_path / "requests.jsonl").write_text(lines)
    rc, out, err = run(capsys, "--prompt-file", tmp_path / "requests.jsonl", "--prompt-format", "text", "--model",
                       model, "--device", "cpu", "--json", "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, [line.replace("\\n", "\n") for line in lines.splitlines()], api, 3)  # (text's \n)
    assert "note" not in err  # text was asked for: no note that the lines look like JSON
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"42")))
    assert_error(*run(capsys, "--prompt-file", "-", "--prompt-format", "json", "--model", model, "--device", "cpu"),
                 2, "stdin: a JSON prompt document must hold an array of prompts")
    assert_error(*run(capsys, "hi", "--prompt-format", "json"), 2, "--prompt-format says how --prompt-file is read")


@pytest.mark.parametrize("flag", ["--json-schema", "--grammar", "--prompt-file"])
def test_option_files_that_never_end_are_refused(capsys, model, tmp_path, flag):
    """A FIFO (or a device) named by an option waited forever, or read until memory ran
    out; a schema or grammar file far past what a structured output may hold is refused
    before it is read."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    args = ["--prompt-file", fifo] if flag == "--prompt-file" else ["hi", flag, fifo]
    assert_error(*run(capsys, *args, "--model", model, "--device", "cpu"), 2 if flag != "--prompt-file" else 1,
                 "not a regular file")
    if flag != "--prompt-file":
        big = tmp_path / "big"
        big.write_text("x" * (4 * 1_000_000 + 1))
        assert_error(*run(capsys, "hi", flag, big, "--model", model, "--device", "cpu"), 2, "more than the")


def test_a_draft_mode_with_ar_is_refused(capsys, model):
    """--draft-mode acts on dflash and ddtree drafts: with ar it did nothing, silently."""
    assert_error(*run(capsys, "hi", "--model", model, "--device", "cpu", "--method", "ar", "--draft-mode", "scaled"),
                 2, "a draft mode applies to methods dflash and ddtree (method is ar)")


def test_a_draft_model_with_ar_is_refused(capsys):
    """--draft-model with --method ar loaded the drafter and drafted nothing, silently."""
    from treeflash.engine.options import builtin_paths
    assert_error(*run(capsys, "hi", "--device", "cpu", "--method", "ar", "--draft-model", builtin_paths()[1]),
                 2, "--draft-model drafts for --method dflash and ddtree")


def test_non_finite_logprobs_are_json_null(capsys, model, monkeypatch):
    """JSON has no NaN or infinity: --json writes null there, so strict parsers read every line."""
    from treeflash.engine import llm as llm_module
    real = llm_module.token_logprobs
    monkeypatch.setattr(llm_module, "token_logprobs", lambda *a: [
        llm_module.TokenLogprob(e.token_id, float("-inf"), [(t, float("nan")) for t, _ in e.top]) for e in real(*a)])
    rc, out, err = run(capsys, "hi", "--model", model, "--device", "cpu", "--json", "--max-new-tokens", 2,
                       "--ignore-eos", "--logprobs", 1)
    assert rc == 0, err
    entries = json.loads(out, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))["logprobs"]
    assert len(entries) == 2 and all(e["logprob"] is None and e["top"][0][1] is None for e in entries)


@pytest.mark.parametrize("line", ["[1, 2, 3]", "null", '"a string"', "{ not json but a prompt"])
def test_jsonl_lines_must_be_prompt_objects(capsys, model, tmp_path, line):
    f = tmp_path / "prompts.jsonl"
    f.write_text('{"prompt": "def fib(n):"}\n' + line + "\n")
    assert_error(*run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu"), 2, ":2:")


def test_plain_prompt_lines_may_start_with_a_brace(capsys, model, api, tmp_path):
    """In a plain-text prompt file (not .jsonl) every line is a prompt, code too."""
    f = tmp_path / "prompts.txt"
    f.write_text('{ "a": 1 }\nint main() {\n')
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, ['{ "a": 1 }', "int main() {"], api, 3)


@pytest.mark.parametrize("gpus", [0, 1])
def test_cuda_device_strings_are_checked(monkeypatch, gpus):
    """A device string that names no device (cuda:x, cuda:-1) is a usage error saying the
    forms there are, with or without a GPU (not "no GPU" for a typo); on a machine with
    one GPU (faked here), cuda:1 is one naming the devices there are, not torch's
    internal error."""
    from treeflash.engine.options import resolve_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for device in ["cuda:x", "cuda:-1", "cuda:0:1", "cuda:", "gpu", "cuda:abc"]:
        with pytest.raises(UsageError, match=r"unknown device .* cpu, cuda or cuda:N\)$"):
            resolve_device(device)
    if gpus:
        assert resolve_device("cuda:0") == torch.device("cuda:0")
        with pytest.raises(UsageError, match="unknown device 'cuda:1' .* cuda:0 to cuda:0"):
            resolve_device("cuda:1")
    else:
        with pytest.raises(UsageError, match="'cuda:1' requested but no CUDA GPU is available"):
            resolve_device("cuda:1")


def test_a_prompt_file_of_dash_is_standard_input(capsys, model, api, monkeypatch):
    """`--prompt-file -` reads the prompts from standard input, as a file is read (one a
    line, "\r\n" ends a line, and an old Mac file's lone "\r"); its lines are named
    stdin:LINE in errors."""
    for lines in (f"{ENGINE_PROMPTS[0]}\r\n\n{ENGINE_PROMPTS[2]}\n", f"{ENGINE_PROMPTS[0]}\r{ENGINE_PROMPTS[2]}\r"):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
        rc, out, err = run(capsys, "--prompt-file", "-", "--model", model, "--device", "cpu", "--json",
                           "--max-new-tokens", 3, "--ignore-eos")
        assert rc == 0, err
        check_json_lines(out, [ENGINE_PROMPTS[0], ENGINE_PROMPTS[2]], api, 3)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"fine\n\xff\n")))
    assert_error(*run(capsys, "--prompt-file", "-", "--model", model, "--device", "cpu"), 1,
                 "cannot read standard input: not UTF-8 text")  # exit 1, as for an unreadable file
    monkeypatch.setattr(sys, "stdin", None)  # started with it closed (`<&-`, cron)
    assert_error(*run(capsys, "--prompt-file", "-", "--model", model, "--device", "cpu"), 1,
                 "cannot read standard input: it is closed")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n  \n")))
    assert_error(*run(capsys, "--prompt-file", "-", "--model", model, "--device", "cpu"), 2,
                 "prompt file stdin holds no prompt")


def test_missing_prompt_file(capsys, model, tmp_path):
    assert_error(*run(capsys, "--prompt-file", tmp_path / "none.txt", "--model", model, "--device", "cpu"),
                 1, "none.txt")


# --------------------------------------------------------------------------- the real entry point


def test_the_command_line_loads_torch_inside_its_error_handling():
    """Ctrl-C in the first seconds (while torch imports) printed a traceback: importing
    `treeflash` ran `import torch` before the command line's handler was set up. Now the
    package loads the engine on first use, and the command inside `main`."""
    code = ("import sys, treeflash.cli; assert 'torch' not in sys.modules, 'torch'; "
            "from treeflash import LLM, SamplingParams; assert 'torch' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args,code", [(["hi", "--model", "/nonexistent/model"], 1),
                                       (["hi", "--top-p", "1.5"], 2)])
def test_python_m_treeflash_errors(model, args, code):
    if "--model" not in args:
        args = args + ["--model", str(model)]
    env = dict(os.environ)
    env.pop("TREEFLASH_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "treeflash", "generate", *args, "--device", "cpu"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == code
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("treeflash: error: ")


def test_reader_closing_the_pipe_stops_quietly(model):
    """`treeflash generate ... | head -c 1`: no traceback, no 'internal error'."""
    proc = subprocess.Popen([sys.executable, "-m", "treeflash", "generate", ENGINE_PROMPTS[0], "--model", str(model),
                             "--device", "cpu", "--max-new-tokens", "200", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(1)) == 1
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 141) and err == b""


def test_output_folder_that_is_a_file(capsys, tmp_path):
    """Refused before any training: a file in the way of --out."""
    (tmp_path / "file").write_text("x")
    rc = main(["train", "tokenizer", "--out", str(tmp_path / "file" / "tok"), "--roots", str(tmp_path)])
    out, err = capsys.readouterr()
    assert rc == 2 and "not a folder" in err and len(err.splitlines()) == 1 and "[tokenizer]" not in out


@pytest.mark.parametrize("weight_map", [[1, 2], None, {"model.norm.weight": 5}])
def test_malformed_index_weight_map(capsys, hf_checkpoint, tmp_path, weight_map):
    folder = hf_checkpoint("qwen3-tied-sharded").copy_to(tmp_path / "sharded")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = weight_map
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_error(*run(capsys, "hi", "--model", folder, "--device", "cpu"), 1, "malformed", "index")


def test_index_naming_the_wrong_shard(capsys, hf_checkpoint, tmp_path):
    folder = hf_checkpoint("qwen3-tied-sharded").copy_to(tmp_path / "sharded")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    key = next(k for k, f in index["weight_map"].items() if f == shards[0])
    index["weight_map"][key] = shards[1]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_error(*run(capsys, "hi", "--model", folder, "--device", "cpu"), 1, key)


def test_python_m_treeflash_json(model):
    r = subprocess.run([sys.executable, "-m", "treeflash", "generate", ENGINE_PROMPTS[0], "--model", str(model),
                        "--device", "cpu", "--json", "--max-new-tokens", "5", "--ignore-eos"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()
    obj = json.loads(line)
    assert len(obj["token_ids"]) == 5 and STATS_KEYS <= set(obj["stats"])


# --------------------------------------------------------------------------- happy paths


@pytest.fixture(scope="module")
def api(hf_checkpoint):
    return LLM(hf_checkpoint("qwen3").path, device="cpu", dtype="float32")


def check_json_lines(out: str, prompts: list[str], api: LLM, n: int):
    lines = out.splitlines()
    assert len(lines) == len(prompts)
    for line, prompt in zip(lines, prompts):
        obj = json.loads(line)
        assert {"text", "token_ids", "stats"} <= set(obj)
        assert STATS_KEYS <= set(obj["stats"])
        s = obj["stats"]
        assert s["method"] == "ar" and s["new_tokens"] == len(obj["token_ids"]) == n
        assert s["rounds"] >= 1 and s["tau"] == pytest.approx(n / s["rounds"], abs=1e-3)
        assert s["seconds"] > 0 and s["tokens_per_s"] > 0
        expected = api.generate(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))[0]
        assert obj["token_ids"] == expected.token_ids and obj["text"] == expected.text


def test_json_output(capsys, model, api):
    rc, out, err = run(capsys, ENGINE_PROMPTS[1], "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 6, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, [ENGINE_PROMPTS[1]], api, 6)


def test_json_logprobs(capsys, model, api):
    rc, out, err = run(capsys, ENGINE_PROMPTS[1], "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 6, "--ignore-eos", "--logprobs", 2)
    assert rc == 0, err
    want = api.generate(ENGINE_PROMPTS[1], SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=2))[0]
    got = json.loads(out)["logprobs"]
    assert [(e["token_id"], e["logprob"], e["rank"], [tuple(t) for t in e["top"]]) for e in got] == \
        [(e.token_id, e.logprob, e.rank, e.top) for e in want.logprobs]
    assert_error(*run(capsys, "hi", "--model", model, "--device", "cpu", "--logprobs", 2), 2, "--json")
    assert_error(*run(capsys, "hi", "--model", model, "--device", "cpu", "--json", "--logprobs", 21), 2,
                 "logprobs")


def test_plain_output_streams_the_text(capsys, model, api):
    rc, out, err = run(capsys, ENGINE_PROMPTS[0], "--model", model, "--device", "cpu",
                       "--max-new-tokens", 12, "--ignore-eos")
    assert rc == 0, err
    expected = api.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    assert out == expected.text + "\n"
    assert "12 tokens" in err and "Traceback" not in err


def test_an_interrupt_while_streaming_ends_the_streamed_line(capsys, model, api, monkeypatch):
    """Ctrl-C in the middle of a streamed answer: what was streamed stays, its line is
    ended (the shell's prompt does not follow the text), and the command exits 130."""
    real = LLM.generate

    def interrupted(self, prompts, params=None, on_tokens=None, on_done=None):
        def first_then_stop(i, ids):
            on_tokens(i, ids)
            raise KeyboardInterrupt
        return real(self, prompts, params, on_tokens=first_then_stop)

    monkeypatch.setattr(LLM, "generate", interrupted)
    rc, out, err = run(capsys, ENGINE_PROMPTS[0], "--model", model, "--device", "cpu", "--max-new-tokens", 12,
                       "--ignore-eos")
    expected = real(api, ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].text
    assert rc == 130 and "interrupted" in err
    assert out.endswith("\n") and expected.startswith(out[:-1]) and len(out) > 1


def test_prompt_file_with_plain_lines(capsys, model, api, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text(f"{ENGINE_PROMPTS[0]}\n\n{ENGINE_PROMPTS[2]}\n")
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 5, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, [ENGINE_PROMPTS[0], ENGINE_PROMPTS[2]], api, 5)


def test_a_prompt_file_runs_in_batches_of_max_batch(capsys, model, api, tmp_path, monkeypatch):
    """Each batch is printed as it finishes, in prompt order, with the tokens of one batch
    (one engine batch: the engine's own max_batch is the flag's, also past its default)."""
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ENGINE_PROMPTS))
    sizes = []
    real = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, *a, **k: sizes.append((len(prompts), self.max_batch))
                        or real(self, prompts, *a, **k))
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 4, "--ignore-eos", "--max-batch", 2)
    assert rc == 0, err
    assert sizes == [(2, 2), (1, 2)]
    monkeypatch.undo()
    check_json_lines(out, ENGINE_PROMPTS, api, 4)
    assert_error(*run(capsys, "hi", "--model", model, "--max-batch", 0), 2, "--max-batch must be >= 1")
    # a prompt that does not fit, after a batch's worth: refused before anything is generated
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [*ENGINE_PROMPTS[:2], "x = 1\n" * 2000]))
    assert_error(*run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                      "--max-new-tokens", 4, "--max-batch", 2), 2, "This model's maximum context length is")


def test_prompt_file_with_jsonl(capsys, model, api, tmp_path):
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(ENGINE_PROMPTS)))
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 4, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, ENGINE_PROMPTS, api, 4)   # multi-line prompts survive JSONL


def test_seeded_sampling_on_the_command_line(capsys, model, api):
    args = [ENGINE_PROMPTS[0], "--model", model, "--device", "cpu", "--json", "--max-new-tokens", 10,
            "--ignore-eos", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05",
            "--seed", "11", "--logit-bias", '{"7": 2.5, "12": -100}', "--min-tokens", "3",
            "--presence-penalty", "0.5", "--frequency-penalty", "0.25", "--repetition-penalty", "1.2"]
    rc, out, _ = run(capsys, *args)
    assert rc == 0
    ids = json.loads(out)["token_ids"]
    assert json.loads(run(capsys, *args)[1])["token_ids"] == ids   # same seed, same tokens
    expected = api.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20,
                                                              top_p=0.9, min_p=0.05, seed=11, ignore_eos=True,
                                                              logit_bias={7: 2.5, 12: -100.0}, min_tokens=3,
                                                              presence_penalty=0.5, frequency_penalty=0.25,
                                                              repetition_penalty=1.2))[0]
    assert ids == expected.token_ids
    unbiased = api.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9,
                                                              min_p=0.05, seed=11, ignore_eos=True))[0]
    assert ids != unbiased.token_ids  # --logit-bias and the penalties were read


def test_stop_string(capsys, model, api):
    full = api.generate(ENGINE_PROMPTS[2], SamplingParams(max_new_tokens=32, ignore_eos=True))[0]
    start = len(api.tokenizer.decode(full.token_ids[:8]))
    stop = next(full.text[i:i + 2] for i in range(start, len(full.text) - 2)
                if full.text[i:i + 2].strip() and "\ufffd" not in full.text[i:i + 2])
    rc, out, err = run(capsys, ENGINE_PROMPTS[2], "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 32, "--ignore-eos", "--stop", stop)
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["text"] == full.text[:full.text.find(stop)]
    assert obj["finish_reason"] == "stop" and len(obj["token_ids"]) < 32
    # plain output prints the same cut text
    rc, out, _ = run(capsys, ENGINE_PROMPTS[2], "--model", model, "--device", "cpu",
                     "--max-new-tokens", 32, "--ignore-eos", "--stop", stop)
    assert rc == 0 and out == obj["text"] + "\n"


def test_eos_stops_generation(capsys, eos_checkpoint):
    rc, out, err = run(capsys, ENGINE_PROMPTS[0], "--model", eos_checkpoint.path, "--device", "cpu", "--json",
                       "--max-new-tokens", 48)
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["finish_reason"] == "stop"
    assert obj["token_ids"] == eos_checkpoint.full[:eos_checkpoint.step + 1]
    assert obj["token_ids"][-1] == eos_checkpoint.eos
    rc, out, _ = run(capsys, ENGINE_PROMPTS[0], "--model", eos_checkpoint.path, "--device", "cpu", "--json",
                     "--max-new-tokens", 48, "--ignore-eos")
    assert json.loads(out)["token_ids"] == eos_checkpoint.full


def test_eager_and_draft_mode_flags(capsys, model):
    """--eager (no CUDA graphs) and --draft-mode are accepted and change no token (the
    draft mode with the built-in pair: AR drafts nothing)."""
    for base, extras in ((["hi", "--model", model], [["--eager"]]),
                         (["def fib(n):"], [["--draft-mode", "scaled"], ["--draft-mode", "coupled"]])):
        base = [*base, "--device", "cpu", "--max-new-tokens", 6, "--json", "--temperature", 0.8, "--seed", 3]
        rc, out, err = run(capsys, *base)
        assert rc == 0, err
        for extra in extras:
            rc2, out2, err2 = run(capsys, *base, *extra)
            assert rc2 == 0, err2
            assert json.loads(out2)["token_ids"] == json.loads(out)["token_ids"]
    assert_error(*run(capsys, *base, "--draft-mode", "fancy"), 2, "draft-mode")


def test_chat_prompts_go_through_the_chat_template(capsys, broken, monkeypatch):
    """--chat: each prompt is a user's message as the model's template renders it (what
    LLM.chat generates); a model without a template is a usage error, before it loads."""
    import treeflash.cli
    with monkeypatch.context() as m:
        m.setattr(treeflash.cli, "make_llm", lambda args: pytest.fail("loaded a model --chat cannot use"))
        rc, out, err = run(capsys, "hi", "--model", broken, "--device", "cpu", "--chat")
    assert_error(rc, out, err, 2, "no chat template")
    (broken / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    rc, out, err = run(capsys, ENGINE_PROMPTS[1], "--model", broken, "--device", "cpu", "--chat", "--json",
                       "--max-new-tokens", 6, "--ignore-eos")
    assert rc == 0, err
    llm = LLM(broken, device="cpu", dtype="float32")
    want = llm.chat([{"role": "user", "content": ENGINE_PROMPTS[1]}],
                    SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert json.loads(out)["token_ids"] == want.token_ids
    assert llm.chat_prompt([{"role": "user", "content": "x"}]) == llm.encode("<user>x<assistant>", special=False)
    # tools and the format are checked as chat() checks them (a string of tools was rendered into the prompt)
    for tools in ("notalist", [{"x": 1}]):
        with pytest.raises(UsageError, match="'tools' must be a list of"):
            llm.chat_prompt([{"role": "user", "content": "x"}], tools=tools)
    with pytest.raises(UsageError, match="fmt must be a ChatFormat"):
        llm.chat_prompt([{"role": "user", "content": "x"}], fmt="x")
    # the template's own variables (vLLM's chat_template_kwargs), only with --chat
    (broken / "chat_template.jinja").write_text("{{ greeting }}{{ messages[0].content }}")
    rc, out, err = run(capsys, ENGINE_PROMPTS[1], "--model", broken, "--device", "cpu", "--chat", "--json",
                       "--max-new-tokens", 6, "--ignore-eos", "--chat-template-kwargs", '{"greeting": "Hi. "}')
    assert rc == 0, err
    want = llm.generate([llm.encode("Hi. " + ENGINE_PROMPTS[1], special=False)],
                        SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert json.loads(out)["token_ids"] == want.token_ids
    assert_error(*run(capsys, "x", "--model", broken, "--chat-template-kwargs", "{}"), 2, "needs --chat")
    for kwargs in ("[1]", '{"x": ' + DEEP + '}'):  # a JSON nesting too deep for the parser too
        assert_error(*run(capsys, "x", "--model", broken, "--chat", "--chat-template-kwargs", kwargs), 2,
                     "not a JSON object")


@pytest.mark.parametrize("error,first", [
    # torch's CPU allocator: a RuntimeError whose message goes on with C++ frames
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 1536000000000 bytes.\nframe #0: c10::ThrowEnforceNotMet\nframe #1: ..."),
     "treeflash: error: out of memory ([enforce fail"),
    (TypeError("empty(): argument 'size' failed to unpack the object at pos 2 with error \"Overflow\"\n"
               "Exception raised from THPUtils_unpackLong at python_arg_parser.cpp:1\nframe #0: ..."),
     "treeflash: internal error: TypeError: empty(): argument"),
    # a terminal or pipe whose encoding lacks a character of the text (PYTHONIOENCODING=ascii)
    (UnicodeEncodeError("ascii", "a\U0001f600b", 1, 2, "ordinal not in range(128)"),
     "treeflash: error: the output's encoding (ascii) cannot write the text ('\\U0001f600'): set PYTHONIOENCODING"),
    # a file or folder the command was pointed at: the user's to mend, not an engine bug
    (PermissionError(13, "Permission denied", "out.jsonl"), "treeflash: error: [Errno 13] Permission denied"),
    # CUDA's out of memory (no "can't allocate memory" in it): the user's to mend, with the hint
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                 "79.10 GiB\nframe #0: ..."),
     "treeflash: error: out of memory (CUDA out of memory. Tried to allocate 2.00 GiB."),
    # Python's MemoryError says nothing: named by its type, not "()"
    (MemoryError(), "treeflash: error: out of memory (MemoryError): ask for less (a shorter --max-model-len"),
])
def test_an_unexpected_failure_is_one_line_without_cpp_frames(capsys, monkeypatch, error, first):
    def fail(args):
        raise error
    monkeypatch.setattr("treeflash.cli.cmd_generate", fail)
    monkeypatch.delenv("TREEFLASH_DEBUG", raising=False)
    rc, out, err = run(capsys, "x")
    assert rc == 1 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith(first), err
    assert "frame #" not in err


@pytest.mark.parametrize("command,argv,names,absent", [
    ("treeflash.cli.cmd_generate", ["generate", "x"], "--max-model-len", "--batch-size"),
    ("treeflash.train.cli.run_tokenizer", ["train", "tokenizer", "--out", "t"], "--batch-size", "--max-model-len"),
    ("treeflash.bench.cmd_bench", ["bench"], "--max-new-tokens", "--contexts"),
    ("treeflash.bench.cmd_bench", ["bench", "--shape", "tiny"], "--contexts", "--max-new-tokens"),
])
def test_running_out_of_memory_names_the_commands_own_options(capsys, monkeypatch, command, argv, names, absent):
    """A train run that runs out of memory is not told to shorten --max-model-len, which it
    lacks; nor bench --shape to ask for fewer --max-new-tokens, which it refuses."""
    def fail(args):
        raise MemoryError()
    monkeypatch.setattr(command, fail)
    monkeypatch.delenv("TREEFLASH_DEBUG", raising=False)
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("treeflash: error: out of memory") and names in err, err
    assert absent not in err, err


# --------------------------------------------------------------------------- cases a mutation review found untested


def test_a_prompt_and_a_prompt_file_together_are_refused(capsys, model, tmp_path):
    """Both given: one of them would be dropped without a word, so neither is taken."""
    f = tmp_path / "prompts.txt"
    f.write_text("x = 1\n")
    assert_error(*run(capsys, "hi", "--prompt-file", f, "--model", model, "--device", "cpu"), 2, "not both")


def test_backslash_n_in_a_plain_prompt_file_is_a_newline(capsys, model, api, tmp_path):
    """As --prompt-file's help says: a prompt of several lines fits on one line of the file."""
    f = tmp_path / "prompts.txt"
    f.write_text(ENGINE_PROMPTS[1].replace("\n", "\\n") + "\n")
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 3, "--ignore-eos")
    assert rc == 0, err
    check_json_lines(out, [ENGINE_PROMPTS[1]], api, 3)


def test_a_plain_file_with_one_jsonl_looking_line_gets_no_note(capsys, model, tmp_path):
    """The note that a .txt file may be JSONL is for files whose every line looks so, not
    for code that holds one such line."""
    f = tmp_path / "prompts.txt"
    f.write_text('{"prompt": "a"}\nint main() {\n')
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 2, "--ignore-eos")
    assert rc == 0 and "note" not in err, err


@pytest.mark.parametrize("count,more", [(12, " and 2 more"), (10, "")])
def test_the_note_on_unread_jsonl_fields_names_each_once_and_at_most_ten(capsys, model, tmp_path, count, more):
    """A file of saved request bodies repeats the same fields on every line: the note names
    each once, ten at most, and counts the rest (ten are all named: no "and 0 more")."""
    keys = [f"k{i:02d}" for i in range(count)]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p, **dict.fromkeys(keys, 1)}) + "\n" for p in ENGINE_PROMPTS[:2]))
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--json",
                       "--max-new-tokens", 2, "--ignore-eos")
    assert rc == 0, err
    named = ", ".join(f"'{k}'" for k in keys[:10])
    assert f"note: prompts of {f} hold {named}{more}, which are not read" in err


def test_one_moot_sampling_option_gets_a_singular_note(capsys, model):
    rc, out, err = run(capsys, "hi", "--model", model, "--device", "cpu", "--max-new-tokens", 2, "--seed", 3)
    assert rc == 0 and "note: --seed has no effect at temperature 0" in err, err


def test_plain_output_of_several_prompts_separates_them_by_a_blank_line(capsys, model, api, tmp_path):
    """Without --json, a file's answers are printed one after the other: a blank line
    tells where one ends and the next begins."""
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ENGINE_PROMPTS[:2]))
    rc, out, err = run(capsys, "--prompt-file", f, "--model", model, "--device", "cpu", "--max-new-tokens", 4,
                       "--ignore-eos")
    assert rc == 0, err
    texts = [o.text for o in api.generate(ENGINE_PROMPTS[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))]
    assert out == texts[0] + "\n\n" + texts[1] + "\n"


def test_no_command_is_a_usage_error(capsys):
    """`treeflash` alone (a script that lost its subcommand) fails, with a hint, not exit 0."""
    capsys.readouterr()
    assert main([]) == 2
    out, err = capsys.readouterr()
    assert_error(2, out, err, 2, "no command given", "treeflash generate --help")


def _cached_snapshot(hub, name, commit, mtime):
    """A snapshot folder of hub id `name` in the cache `hub`, made at `mtime`."""
    folder = hub / ("models--" + name.replace("/", "--")) / "snapshots" / commit
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    os.utime(folder, (mtime, mtime))
    return folder


def test_the_cached_snapshot_is_refs_mains_else_the_newest(tmp_path, monkeypatch):
    """As huggingface_hub: refs/main names the snapshot, though a newer one is there (a
    branch or revision downloaded later); without refs/main, the newest with a config."""
    from treeflash.files import hub_snapshot
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    old = _cached_snapshot(tmp_path / "hub", "org/m", "old", 1_000_000)
    new = _cached_snapshot(tmp_path / "hub", "org/m", "new", 2_000_000)
    newest_without_config = old.parent / "partial"
    newest_without_config.mkdir()
    assert hub_snapshot("org/m") == new
    (old.parent.parent / "refs").mkdir()
    (old.parent.parent / "refs" / "main").write_text("old\n")
    assert hub_snapshot("org/m") == old


def test_the_older_hub_cache_variable_and_a_home_relative_cache_are_read(tmp_path, monkeypatch):
    """HUGGINGFACE_HUB_CACHE (older huggingface_hub's name) still names the cache, and a
    cache given as ~/... is under the home folder, as huggingface_hub reads them."""
    from treeflash.files import hub_snapshot
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    folder = _cached_snapshot(tmp_path / "old-hub", "org/m", "abc", 1_000_000)
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "old-hub"))
    assert hub_snapshot("org/m") == folder
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", "~/old-hub")
    assert hub_snapshot("org/m") == folder


def test_a_local_folder_named_like_a_hub_id_wins_over_the_cache(tmp_path, monkeypatch):
    """--model org/m where ./org/m exists is that folder, as vLLM and transformers read it."""
    from treeflash.files import model_folder
    _cached_snapshot(tmp_path / "hub", "org/m", "abc", 1_000_000)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "m").mkdir(parents=True)
    assert model_folder("org/m") == "org/m"


@pytest.mark.parametrize("flag,value,words", [("--json-schema", "5", ("cannot read 5", "nor is it a JSON object")),
                                              ("--grammar", "root = x", ("nor is it GBNF rules",)),
                                              ("--json-schema", "", ("empty: give a JSON object or a file",)),
                                              ("--grammar", " ", ("empty: give GBNF rules",))])
def test_a_structured_output_flag_that_is_neither_inline_nor_a_file(capsys, flag, value, words):
    """--json-schema and --grammar take the text or a file's path: a value that is neither
    says both in its one line (not only that no such file exists)."""
    assert_error(*run(capsys, "hi", flag, value, "--device", "cpu"), 2, flag, *words)


def test_an_inline_json_schema_may_start_with_blanks(tmp_path):
    """A schema pasted from a file ('$(cat schema.json)' keeps its leading lines) is still
    the schema, not a file name; a path names a file holding one."""
    from treeflash.cli import build_parser
    schema = {"type": "integer"}
    parse = lambda value: build_parser().parse_args(["generate", "x", "--json-schema", value]).json_schema  # noqa: E731
    assert parse("\n  " + json.dumps(schema)) == schema
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    assert parse(str(tmp_path / "schema.json")) == schema


def test_generate_options_default_to_what_their_help_says():
    """Left out, each option is what --help promises (scripts rely on the defaults)."""
    from treeflash.cli import build_parser
    args = build_parser().parse_args(["generate", "x"])
    assert (args.max_budget, args.max_batch, args.min_tokens, args.tp) == (512, 16, 0, 1)
    assert (args.device, args.dtype, args.generation_config) == ("auto", "auto", "auto")
    assert (args.presence_penalty, args.frequency_penalty, args.stop, args.stop_token_ids) == (0.0, 0.0, [], [])


def test_json_object_alone_constrains_the_output():
    """--json-object, given with no other constraint, is one (it was the only one that
    a check for "any given" could miss: a flag, not a value)."""
    from treeflash.cli import build_parser, structured_from
    parse = lambda *flags: structured_from(build_parser().parse_args(["generate", "x", *flags]))  # noqa: E731
    assert parse() is None
    assert parse("--json-object").json_object is True


def test_an_explicit_temperature_0_wins_over_the_models_generation_config(capsys, broken, api):
    """--temperature 0 is given, not left out: greedy, though generation_config.json
    samples at 1.5, and no note claims the file's temperature applies."""
    path = broken / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "temperature": 1.5}))
    rc, out, err = run(capsys, ENGINE_PROMPTS[1], "--model", broken, "--device", "cpu", "--json",
                       "--max-new-tokens", 8, "--ignore-eos", "--temperature", 0)
    assert rc == 0, err
    want = api.generate(ENGINE_PROMPTS[1], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert json.loads(out)["token_ids"] == want.token_ids and "temperature 1.5" not in err


def test_the_generation_config_note_names_filters_only_where_they_sample(capsys, broken):
    """The model's top_k applies where its temperature samples, and the note says so; at
    --temperature 0 it would do nothing, and the note leaves it out."""
    path = broken / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "temperature": 1.5, "top_k": 20}))
    args = ("hi", "--model", broken, "--device", "cpu", "--max-new-tokens", 2)
    rc, out, err = run(capsys, *args)
    assert rc == 0 and "top_k 20" in err and "from the model's generation_config.json" in err, err
    rc, out, err = run(capsys, *args, "--temperature", 0)
    assert rc == 0 and "top_k" not in err, err


@pytest.mark.parametrize("error", [ValueError("engine bug"), PermissionError(13, "Permission denied", "out.jsonl")])
def test_treeflash_debug_shows_an_engine_errors_traceback(capsys, monkeypatch, error):
    """TREEFLASH_DEBUG=1 lets an unexpected error through (with its traceback), for a bug
    report: an OSError too, whose plain report is one line."""
    def fail(args):
        raise error
    monkeypatch.setattr("treeflash.cli.cmd_generate", fail)
    monkeypatch.setenv("TREEFLASH_DEBUG", "1")
    with pytest.raises(type(error)) as raised:
        main(["generate", "x"])
    assert raised.value is error
    for off in ("0", ""):  # as vLLM's flags read "0": off (it turned tracebacks on)
        monkeypatch.setenv("TREEFLASH_DEBUG", off)
        assert main(["generate", "x"]) == 1


def test_a_closed_standard_output_is_an_error(capsys, monkeypatch):
    """Started with standard output closed (`>&-`), generate printed nothing and exited 0:
    now exit 1 with one line, as for a closed standard input."""
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["generate", "x", "--device", "cpu"]) == 1
    assert capsys.readouterr().err.strip() == "treeflash: error: cannot write standard output: it is closed"


def test_model_flags_reach_the_engine(monkeypatch):
    """Each model flag is the engine's matching option (--eager: no CUDA graphs, which a
    CPU run cannot show)."""
    import treeflash
    from treeflash.cli import build_parser, make_llm
    got = {}
    monkeypatch.setattr(treeflash, "LLM", lambda model, **options: got.update(options, model=model))
    make_llm(build_parser().parse_args(["generate", "x"]))
    assert got["cuda_graphs"] is True and got["max_budget"] == 512
    make_llm(build_parser().parse_args([
        "generate", "x", "--model", "m", "--draft-model", "d", "--method", "dflash", "--budget", "8",
        "--max-budget", "32", "--device", "cpu", "--dtype", "bfloat16", "--max-model-len", "100", "--eager",
        "--draft-mode", "scaled", "--tp", "2", "--quantization", "fp8", "--max-batch", "3",
        "--generation-config", "none"]))
    assert got == dict(model="m", draft_model="d", method="dflash", budget=8, max_budget=32, device="cpu",
                       dtype="bfloat16", max_model_len=100, cuda_graphs=False, draft_mode="scaled", tp=2,
                       quantization="fp8", max_batch=3, enable_prefix_caching=False, generation_config="none",
                       seed=None)


def test_a_malformed_file_is_named_with_its_folder(capsys, model, tmp_path):
    """The target and the drafter both have a config.json: the error says whose is bad."""
    import shutil

    from treeflash.engine.options import builtin_paths
    drafter = tmp_path / "drafter"
    shutil.copytree(builtin_paths()[1], drafter)
    (drafter / "config.json").write_text("{not json")
    assert_error(*run(capsys, "hi", "--model", model, "--draft-model", drafter, "--device", "cpu"), 1,
                 f"malformed config.json in {drafter}")


# ------------------------------------------------------------------- cases a second mutation review found untested


def test_a_stop_token_id_ends_the_answer_and_is_its_stop_reason(capsys, model, api):
    """--stop-token-id ends the answer as vLLM's stop_token_ids: the token is the last of
    token_ids, --json's stop_reason names it, and its text is in neither output (the
    streamed plain text included)."""
    full = api.generate(ENGINE_PROMPTS[0], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    k = next(i for i in range(2, 12) if full[i] not in full[:i] and api.tokenizer.decode([full[i]]).strip())
    args = (ENGINE_PROMPTS[0], "--model", model, "--device", "cpu", "--max-new-tokens", 12, "--ignore-eos",
            "--stop-token-id", full[k])
    rc, out, err = run(capsys, *args, "--json")
    assert rc == 0, err
    got = json.loads(out)
    assert (got["token_ids"], got["finish_reason"], got["stop_reason"]) == (full[:k + 1], "stop", full[k])
    rc, plain, err = run(capsys, *args)
    assert rc == 0 and plain == got["text"] + "\n", err


def test_plain_output_of_a_sentencepiece_model_keeps_its_first_space(capsys, tmp_path):
    """A SentencePiece tokenizer (Llama 2, Mistral) strips a text's first space when it
    decodes it alone: the streamed answer, decoded after the prompt, starts with the
    space its first token carries, as --json's text does."""
    from conftest import write_sentencepiece_model
    folder = write_sentencepiece_model(tmp_path / "sp", spaced=True)
    args = ("ab ab", "--model", folder, "--device", "cpu", "--max-new-tokens", 8, "--ignore-eos")
    rc, out, err = run(capsys, *args, "--json")
    assert rc == 0, err
    text = json.loads(out)["text"]
    assert text.startswith(" ") and text.strip()
    rc, out, err = run(capsys, *args)
    assert rc == 0 and out == text + "\n", err


def test_an_answer_ended_by_eos_is_not_said_to_stop_at_the_context_limit(capsys, eos_checkpoint):
    """Fewer tokens than --max-new-tokens, ended by EOS: the stats line does not claim
    the context cut it (that note is for finish_reason "length" only)."""
    rc, out, err = run(capsys, ENGINE_PROMPTS[0], "--model", eos_checkpoint.path, "--device", "cpu",
                       "--max-new-tokens", 48)
    assert rc == 0, err
    assert f": {eos_checkpoint.step + 1} tokens" in err and "context limit" not in err, err


def test_a_drafter_named_by_a_hub_id_loads_from_the_cache(capsys, tmp_path, monkeypatch):
    """--draft-model org/name is read from the Hugging Face cache, as --model is."""
    import shutil

    from treeflash.engine.options import builtin_paths
    target, drafter = builtin_paths()
    shutil.copytree(drafter, _cached_snapshot(tmp_path / "hub", "org/drafter", "abc", 1_000_000), dirs_exist_ok=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(capsys, ENGINE_PROMPTS[0], "--model", target, "--draft-model", "org/drafter", "--device", "cpu",
                       "--json", "--max-new-tokens", 4, "--ignore-eos")
    assert rc == 0, err
    assert json.loads(out)["stats"]["method"] == "ddtree"


def test_the_cache_variables_take_huggingface_hubs_precedence(tmp_path, monkeypatch):
    """HF_HUB_CACHE, else the older HUGGINGFACE_HUB_CACHE, else HF_HOME/hub (not
    ~/.cache), as huggingface_hub reads them."""
    from treeflash.files import hub_snapshot
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    caches = {var: _cached_snapshot(tmp_path / var / "hub", "org/m", "abc", 1_000_000)
              for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME")}
    for var, folder in caches.items():
        monkeypatch.setenv(var, str(tmp_path / var / ("" if var == "HF_HOME" else "hub")))
    for var, folder in caches.items():
        assert hub_snapshot("org/m") == folder, var
        monkeypatch.delenv(var)


def test_a_refs_main_whose_snapshot_has_no_config_falls_back_to_the_newest(tmp_path, monkeypatch):
    """refs/main may name a revision whose download has not come (or stopped before its
    config.json): the newest complete snapshot is read, not an empty folder."""
    from treeflash.files import hub_snapshot
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    folder = _cached_snapshot(tmp_path / "hub", "org/m", "old", 1_000_000)
    (folder.parent.parent / "refs").mkdir()
    (folder.parent.parent / "refs" / "main").write_text("partial")
    (folder.parent / "partial").mkdir()
    assert hub_snapshot("org/m") == folder


def test_a_path_of_three_parts_is_not_a_hub_id(capsys, tmp_path, monkeypatch):
    """models/org/name, not there, is a path that was mistyped: its error says nothing of
    the Hugging Face cache (hub ids are org/name)."""
    from treeflash.files import is_hub_id
    monkeypatch.chdir(tmp_path)
    assert is_hub_id("org/name") and not is_hub_id("models/org/name")
    rc, out, err = run(capsys, "hi", "--model", "models/org/name", "--device", "cpu")
    assert rc == 1 and "model folder not found: models/org/name" in err and "Hugging Face" not in err, err


def test_an_inline_grammar_may_start_with_a_comment():
    """GBNF files often open with a comment line: pasted inline, the grammar is still read
    as one, not as a file name."""
    from treeflash.cli import build_parser
    grammar = '# digits only\nroot ::= [0-9]+'
    assert build_parser().parse_args(["generate", "x", "--grammar", grammar]).grammar == grammar


def test_a_grammar_file_of_multibyte_text_is_read_up_to_its_character_limit(tmp_path):
    """An option's file is limited by what its structured output may hold in characters:
    a grammar of non-ASCII text within it is read, though it has more bytes than that."""
    from treeflash.cli import build_parser
    from treeflash.structured.grammar import MAX_INPUT_CHARS
    grammar = 'root ::= "' + "\u00e9" * (MAX_INPUT_CHARS["grammar"] - 20) + '"'
    f = tmp_path / "grammar.gbnf"
    f.write_text(grammar, encoding="utf-8")
    assert f.stat().st_size > MAX_INPUT_CHARS["grammar"]
    assert build_parser().parse_args(["generate", "x", "--grammar", str(f)]).grammar == grammar


def test_a_schema_file_that_cannot_be_read_is_not_taken_for_inline_text(capsys, tmp_path):
    """A file that exists but cannot be read is named with its own error, without the
    guess that the value was meant as inline JSON."""
    f = tmp_path / "schema.json"
    f.write_bytes(b'{"type": "\xff"}')
    rc, out, err = run(capsys, "hi", "--json-schema", f, "--device", "cpu")
    assert_error(rc, out, err, 2, "--json-schema", "schema.json", "not UTF-8")
    assert "nor is it" not in err


def test_every_sampling_option_at_temperature_0_is_named_in_the_note(capsys, model):
    rc, out, err = run(capsys, "hi", "--model", model, "--device", "cpu", "--max-new-tokens", 2, "--top-k", 5,
                       "--top-p", 0.9, "--min-p", 0.1, "--seed", 3)
    assert rc == 0 and "note: --top-k, --top-p, --min-p, --seed have no effect at temperature 0" in err, err


def test_a_generation_config_that_does_not_sample_leaves_its_filters_out_of_the_note(capsys, broken):
    """do_sample false: the model's filters do nothing (greedy), and the note names only
    what applies."""
    path = broken / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config.pop("temperature", None)
    path.write_text(json.dumps({**config, "do_sample": False, "top_k": 20, "top_p": 0.9, "min_p": 0.1,
                                "repetition_penalty": 1.1}))
    rc, out, err = run(capsys, "hi", "--model", broken, "--device", "cpu", "--max-new-tokens", 2)
    assert rc == 0, err
    # (greedy is what the CLI does without the file too: the note leaves the temperature out)
    assert "note: repetition_penalty 1.1 from the model's generation_config.json" in err, err
    assert not any(f in err for f in ("top_k", "top_p", "min_p")), err


@pytest.mark.parametrize("flag,value,words", [("--regex", "(", ("regex '('", "missing ')'")),
                                              ("--json-schema", '{"type": "foo"}', ("json schema", "'type'")),
                                              ("--grammar", "root ::= x", ("grammar", "no rule defines"))])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_constraints_mistake_stops_the_command_before_the_model_loads(capsys, model, monkeypatch, flag, value,
                                                                        words, command):
    """A bad regex, schema or grammar was reported only once the model had loaded (minutes,
    for a large one): it is compiled first."""
    import treeflash

    def no_loading(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(treeflash, "LLM", no_loading)
    capsys.readouterr()
    extra = ["--methods", "ar", "--eos", "--num-prompts", "1"] if command == "bench" else ["hi"]
    rc = main([command, *extra, "--model", str(model), "--device", "cpu", flag, value])
    assert_error(rc, *capsys.readouterr(), 2, *words)


def test_flags_are_not_abbreviated(capsys):
    """A flag is taken only as spelled, as vLLM's parser takes it: argparse's prefixes read
    `generate --prompt "..."` as --prompt-file (and failed on a file named by the prompt),
    and `train generate --prompt 8` as --prompt-len."""
    assert_error(*run(capsys, "--prompt", "def f():"), 2, "unrecognized arguments: --prompt")
    for argv in (["bench", "--method", "ar"], ["train", "generate", "--target", "t", "--data", "d", "--out", "o", "--prompt", "8"]):
        assert main(argv) == 2
        assert "unrecognized arguments" in capsys.readouterr().err
