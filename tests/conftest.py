"""Shared fixtures. Append new fixtures in their own section; do not rewrite others'."""
from __future__ import annotations

# ---------------------------------------------------------------------------
# Engine tests (issue 2): tiny random Qwen3 / Llama checkpoints written by
# transformers itself, with a small byte-level BPE tokenizer, built once per session.
# ---------------------------------------------------------------------------
import copy
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Three prompts of different lengths (in tokens of the tiny tokenizer).
ENGINE_PROMPTS = [
    "def fib(n):",
    "import os\nimport sys\n\nclass Point:\n    def __init__(self, x, y):",
    "the quick brown fox",
]

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # small enough that the tiny head_dim has high, medium and low frequency bands
               "original_max_position_embeddings": 64}

_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
             pad_token_id=1,
             # larger than HF's 0.02: tied tiny models otherwise just repeat their last token
             initializer_range=0.3)

# name -> (architecture, config overrides, save_pretrained kwargs)
HF_VARIANTS = {
    # head_dim != hidden / heads, as in real Qwen3 checkpoints
    "qwen3": ("qwen3", dict(head_dim=32, tie_word_embeddings=False), {}),
    "qwen3-tied-sharded": ("qwen3", dict(head_dim=16, tie_word_embeddings=True),
                           {"max_shard_size": "50KB"}),
    "llama3-rope": ("llama", dict(tie_word_embeddings=False, rope_theta=500000.0,
                                  rope_scaling=dict(LLAMA3_ROPE)), {}),
    "llama-tied-bias": ("llama", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True), {}),
}


@dataclass
class HFCheckpoint:
    name: str
    path: Path
    model: torch.nn.Module   # the transformers model (float32, eval) the files were saved from

    def copy_to(self, dest: Path) -> Path:
        """A private copy of the checkpoint folder (for tests that damage it)."""
        shutil.copytree(self.path, dest)
        return dest


def _build_hf(name: str, folder: Path, dtype: torch.dtype = torch.float32) -> HFCheckpoint:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from treeflash.checkpoints import write_tiny_tokenizer

    arch, overrides, save_kwargs = HF_VARIANTS[name]
    vocab = write_tiny_tokenizer(folder)
    cfg_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if arch == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    cfg = cfg_cls(vocab_size=vocab, **_TINY, **overrides)
    torch.manual_seed(sorted(HF_VARIANTS).index(name))
    model = model_cls(cfg).eval()
    if dtype != torch.float32:
        copy.deepcopy(model).to(dtype).save_pretrained(folder, **save_kwargs)
        # round the weights only: `.to(dtype).float()` on the model would also round
        # the rotary inv_freq buffer of transformers
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype).float())
    else:
        model.save_pretrained(folder, **save_kwargs)
    # HF generate must not stop at EOS: the engine tests compare exactly 48 tokens.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 1
    return HFCheckpoint(name, folder, model)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name, dtype=float32) -> HFCheckpoint, built once per session.

    With dtype bfloat16 the files hold bf16 weights and `model` is the float32 model
    holding those same (rounded) values."""
    built: dict[tuple[str, torch.dtype], HFCheckpoint] = {}

    def get(name: str, dtype: torch.dtype = torch.float32) -> HFCheckpoint:
        key = (name, dtype)
        if key not in built:
            folder = tmp_path_factory.mktemp(f"hf-{name}-{str(dtype).replace('torch.', '')}")
            built[key] = _build_hf(name, folder, dtype)
        return built[key]

    return get


@pytest.fixture
def hf_model64(hf_checkpoint):
    """hf_model64(name): a float64 copy of the transformers model of checkpoint `name`."""
    def get(name: str):
        return copy.deepcopy(hf_checkpoint(name).model).double()
    return get
