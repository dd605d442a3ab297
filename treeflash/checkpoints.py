"""Write checkpoints in the published layouts: random DFlash drafters for any target,
and tiny random targets with a small tokenizer (for tests, demos and timing shapes)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from treeflash.config import TARGET_ARCHITECTURES, ModelConfig, default_target_layer_ids, read_config_json
from treeflash.ops import fp8_blocks


def _normal(gen: torch.Generator, *shape, std: float = 0.02) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def _layer_weights(gen, prefix: str, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int,
                   qk_norm: bool, std: float) -> dict[str, torch.Tensor]:
    w = {
        f"{prefix}self_attn.q_proj.weight": _normal(gen, heads * head_dim, hidden, std=std),
        f"{prefix}self_attn.k_proj.weight": _normal(gen, kv_heads * head_dim, hidden, std=std),
        f"{prefix}self_attn.v_proj.weight": _normal(gen, kv_heads * head_dim, hidden, std=std),
        f"{prefix}self_attn.o_proj.weight": _normal(gen, hidden, heads * head_dim, std=std),
        f"{prefix}mlp.gate_proj.weight": _normal(gen, inter, hidden, std=std),
        f"{prefix}mlp.up_proj.weight": _normal(gen, inter, hidden, std=std),
        f"{prefix}mlp.down_proj.weight": _normal(gen, hidden, inter, std=std),
        f"{prefix}input_layernorm.weight": 1 + _normal(gen, hidden, std=0.1),
        f"{prefix}post_attention_layernorm.weight": 1 + _normal(gen, hidden, std=0.1),
    }
    if qk_norm:
        w[f"{prefix}self_attn.q_norm.weight"] = 1 + _normal(gen, head_dim, std=0.1)
        w[f"{prefix}self_attn.k_norm.weight"] = 1 + _normal(gen, head_dim, std=0.1)
    return w


def write_random_drafter(target_dir: str | Path, out_dir: str | Path, num_layers: int = 2,
                         block_size: int = 16, mask_token_id: int | None = None,
                         target_layer_ids: list[int] | None = None, seed: int = 0,
                         std: float = 0.02, dtype: torch.dtype = torch.float32) -> Path:
    """A random DFlash drafter for the target in `target_dir`, in the published layout."""
    t = ModelConfig.from_dict(read_config_json(target_dir), f"config.json in {target_dir}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    ids = target_layer_ids or default_target_layer_ids(t.num_layers, num_layers)
    ids = [min(max(i, 0), t.num_layers - 1) for i in ids]
    mask = t.vocab_size - 1 if mask_token_id is None else mask_token_id
    H = t.hidden_size
    w = {}
    for i in range(num_layers):
        w.update(_layer_weights(gen, f"layers.{i}.", H, t.intermediate_size, t.num_heads, t.num_kv_heads,
                                t.head_dim, True, std))
    w["fc.weight"] = _normal(gen, H, len(ids) * H, std=std)
    w["hidden_norm.weight"] = 1 + _normal(gen, H, std=0.1)
    w["norm.weight"] = 1 + _normal(gen, H, std=0.1)
    save_file({k: v.to(dtype).contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": H, "intermediate_size": t.intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim,
        "vocab_size": t.vocab_size, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta,
        "max_position_embeddings": t.max_position_embeddings, "tie_word_embeddings": False,
        "block_size": block_size, "num_target_layers": t.num_layers,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids},
        "torch_dtype": str(dtype).replace("torch.", ""),
    }
    if t.rope_scaling:
        config["rope_scaling"] = t.rope_scaling
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 256) -> int:
    """A byte-level BPE tokenizer trained on a few lines of Python; returns its size.

    Special tokens: <|endoftext|> (EOS), <|pad|>, <|mask|> (the drafter's MASK)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|pad|>", "<|mask|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
            "import os\nimport sys\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n",
            "for i in range(10):\n    print(i, i * i)\n", "the quick brown fox jumps over the lazy dog\n"] * 4
    tok.train_from_iterator(text, trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok.get_vocab_size()


def write_random_target(out_dir: str | Path, arch: str = "qwen3", hidden_size: int = 64, num_layers: int = 4,
                        num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, intermediate_size: int = 128,
                        vocab_size: int | None = None, tie_word_embeddings: bool = False, seed: int = 0,
                        std: float = 0.02, rope_scaling: dict | None = None, max_position_embeddings: int = 2048,
                        dtype: torch.dtype = torch.float32, eos_token_id: int | None = 0,
                        peaked_tokens: int = 0) -> Path:
    """A random Qwen3, Qwen2 (with q/k/v biases), Llama or Mistral (no sliding window)
    checkpoint, with a tiny tokenizer unless vocab_size is given.

    `peaked_tokens` > 0 boosts that many LM-head rows (token ids 3, 4, ...), so the model
    mostly picks among them, by context: a random drafter sharing the head then gets
    real acceptances, which exercises the accept/commit paths of speculative rounds."""
    if arch not in ("qwen3", "qwen2", "llama", "mistral"):
        raise ValueError(f"write_random_target writes dense targets, not {arch!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if vocab_size is None:
        vocab_size = write_tiny_tokenizer(out)
    gen = torch.Generator().manual_seed(seed)
    H = hidden_size
    w = {"model.embed_tokens.weight": _normal(gen, vocab_size, H, std=1.0),
         "model.norm.weight": 1 + _normal(gen, H, std=0.1)}
    for i in range(num_layers):
        w.update(_layer_weights(gen, f"model.layers.{i}.", H, intermediate_size, num_heads, num_kv_heads,
                                head_dim, arch == "qwen3", std))
        if arch == "qwen2":  # drawn after the weights: the other architectures' streams stay as they were
            for name, rows in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads)):
                w[f"model.layers.{i}.self_attn.{name}_proj.bias"] = _normal(gen, rows * head_dim, std=std * 10)
    if not tie_word_embeddings:
        w["lm_head.weight"] = _normal(gen, vocab_size, H, std=std * 4)
    if peaked_tokens:
        head = "model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"
        w[head][3:3 + peaked_tokens] *= 25.0
    save_file({k: v.to(dtype).contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    config = {
        "architectures": [next(name for name, a in TARGET_ARCHITECTURES.items() if a == arch)], "model_type": arch,
        "hidden_size": H, "intermediate_size": intermediate_size, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "vocab_size": vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": str(dtype).replace("torch.", ""), "eos_token_id": eos_token_id,
    }
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if arch == "mistral":
        config["sliding_window"] = None  # transformers' default is a window of 4096
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def write_fp8_copy(src: str | Path, out_dir: str | Path, block: tuple[int, int] = (128, 128),
                   skip: tuple[str, ...] = ()) -> Path:
    """A copy of the checkpoint in `src` with its layers' linear weights (every 2-D
    `*_proj.weight` under `layers.`, but those whose names hold an entry of `skip`) in
    block-scaled FP8 with `weight_scale_inv`, and config.json's quantization_config
    saying so: a checkpoint as Qwen3-FP8 and DeepSeek-V3 publish them."""
    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _all_tensors(src)
    layers = [n for n in tensors if ".layers." in n and n.endswith("_proj.weight") and tensors[n].dim() == 2]
    kept = sorted(n.removesuffix(".weight") for n in layers if any(s in n for s in skip))
    for name in layers:
        if name.removesuffix(".weight") not in kept:
            tensors[name], tensors[name + "_scale_inv"] = fp8_blocks(tensors[name], block)
    # the modules kept by their whole names: a substring, prefix or regex reading all agree
    _write_copy(src, out, tensors, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": list(block),
                                    **({"modules_to_not_convert": kept} if kept else {})})
    return out


def _all_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _write_copy(src: Path, out: Path, tensors: dict, quantization: dict) -> None:
    """`tensors` as out's weights, src's other files beside them, and config.json with
    `quantization` as its quantization_config."""
    save_file(tensors, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith((".safetensors", ".index.json")):
            (out / f.name).write_bytes(f.read_bytes())
    cfg = read_config_json(src)
    cfg["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def mxfp4_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) in OCP MXFP4, as gpt-oss stores it (the inverse of
    `models.moe.mxfp4_dequantized`): each group of 32 values gets the power-of-two scale
    that brings its largest into e2m1's range (6), then each value the nearest e2m1 code."""
    from treeflash.models.moe import FP4_E2M1
    groups = w.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    magnitudes = torch.tensor(FP4_E2M1[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    pairs = codes.to(torch.uint8).unflatten(-1, (16, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4), (exp + 127).to(torch.uint8)


def write_mxfp4_copy(src: str | Path, out_dir: str | Path) -> Path:
    """A copy of the gpt-oss checkpoint in `src` (experts in transformers' unquantized
    layout) with its experts in MXFP4 and config.json saying so, as OpenAI publishes
    gpt-oss (the biases, attention and router stay as they are)."""
    src, out = Path(src), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = _all_tensors(src)
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_blocks(tensors.pop(name).transpose(1, 2))
    _write_copy(src, out, tensors, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    return out
