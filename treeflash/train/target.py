"""Train a Qwen3-architecture target LM on a tokenized corpus; export a Hugging Face checkpoint.

The model is treeflash's own `CausalLM` run through its cache-free path (causal SDPA,
flash attention on CUDA), on random windows of the corpus. The export splits the fused
qkv / gate_up weights back into HF names and writes what `transformers` and
`treeflash.LLM` both load: config.json (Qwen3ForCausalLM), generation_config.json,
safetensors (sharded when large) and the tokenizer files.
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from treeflash.config import DTYPES, ModelConfig
from treeflash.engine.options import resolve_device
from treeflash.errors import UsageError
from treeflash.layers.attention import AttentionInputs
from treeflash.models.loader import build_on
from treeflash.models.transformer import CausalLM
from treeflash.tokenizer import Tokenizer
from treeflash.train.common import (DEFAULT_OPTIONS, MiB, RunDir, TrainOptions, Trainer, abs_path,
                                    check_export_dir, check_logits_fit, check_out_dir, check_shard_mb,
                                    check_trainable, exporting, hf_tensors, init_weights, save_safetensors,
                                    write_summary)
from treeflash.train.corpus import TOKENIZER_FILES, TokenWindows, fixed_windows, load_corpus, tokenizer_hash
from treeflash.train.tokenizer import PAD


# Default: ~14M parameters, ~28 MB in bf16 with vocab 4096 and tied embeddings.
TARGET_SHAPE = {"hidden_size": 384, "num_layers": 8, "num_heads": 6, "num_kv_heads": 2, "head_dim": 64,
                "intermediate_size": 1024, "rope_theta": 10000.0, "tie_word_embeddings": True}


@dataclass
class TargetShape:
    """The model shape. A field left None is unset: a fresh run takes TARGET_SHAPE's value,
    a resumed run its own (a set field must match the run's)."""

    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rope_theta: float | None = None
    tie_word_embeddings: bool | None = None

    def check(self) -> "TargetShape":
        """Refuse a shape in the words of its options (--num-layers, not config.json's
        num_hidden_layers, which the model config's own checks would name)."""
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2 ** 31:
                raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise UsageError(f"--num-heads {self.num_heads} is not a multiple of --num-kv-heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise UsageError(f"--head-dim {self.head_dim} is odd (rotary embeddings turn pairs of features)")
        if isinstance(self.rope_theta, bool) or not isinstance(self.rope_theta, (int, float)) or \
                not 0 < self.rope_theta < math.inf:
            raise UsageError(f"--rope-theta must be a finite number > 0, got {self.rope_theta!r}")
        return self


def hf_config(shape: TargetShape, vocab_size: int, max_len: int, eos_id: int, pad_id: int | None,
              dtype: str) -> dict:
    """A Qwen3ForCausalLM config.json."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": vocab_size, "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "hidden_act": "silu", "max_position_embeddings": max_len,
        "rms_norm_eps": 1e-6, "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "tie_word_embeddings": shape.tie_word_embeddings, "attention_bias": False,
        "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": shape.num_layers, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id, "torch_dtype": dtype,
    }


def build_target(cfg: ModelConfig, device: torch.device) -> CausalLM:
    """A trainable float32 CausalLM (inference builds parameters without grad)."""
    check_trainable(cfg, device, "the target shape")
    with build_on(device, torch.float32):
        model = CausalLM(cfg)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    init_weights(model, cfg.num_layers)
    return model.requires_grad_(True)


def causal_inputs(ids: torch.Tensor) -> AttentionInputs:
    """Cache-free causal attention; no explicit mask, so CUDA runs flash attention."""
    B, T = ids.shape
    return AttentionInputs(torch.arange(T, device=ids.device).expand(B, T), None, None)


def lm_loss(model: CausalLM, window: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a batch of windows [B, S+1]."""
    x, y = window[:, :-1], window[:, 1:]
    h, _ = model(x, causal_inputs(x))
    logits = model.logits(h).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def evaluate_lm(model: CausalLM, windows: torch.Tensor, batch_size: int, device: torch.device) -> dict:
    """Held-out loss (nats/token) and perplexity over fixed windows [N, S+1]."""
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i:i + batch_size].to(device)
        n = w[:, 1:].numel()
        total += lm_loss(model, w).item() * n
        count += n
    loss = total / count
    return {"eval_loss": round(loss, 5), "eval_ppl": round(math.exp(min(loss, 50.0)), 3)}


def export_target(model: CausalLM, config: dict, tokenizer_dir: Path, out_dir: str | Path,
                  max_shard_bytes: int = 16 * MiB) -> Path:
    """Write the HF checkpoint folder (weights in config['torch_dtype'])."""
    out = Path(out_dir)
    with exporting(out) as folder:
        save_safetensors(hf_tensors(model), folder, DTYPES[config["torch_dtype"]], max_shard_bytes)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        gen = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
               "pad_token_id": config["pad_token_id"], "do_sample": False}
        (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copy(tokenizer_dir / name, folder / name)
    return out


def train_target(data_dir: str | Path, run_dir: str | Path, out_dir: str | Path | None = None,
                 shape: TargetShape | None = None, opts: TrainOptions | None = None, resume: bool = False,
                 dtype: str | None = None, max_shard_mb: float | None = None) -> dict:
    """Train (or resume) a target on the corpus in `data_dir`; export it to `out_dir`
    (default `<run_dir>/model`). Unset (None) shape fields and options take the defaults,
    or the resumed run's values (see `RunDir`). Returns the summary (also in
    `<run_dir>/summary.json`)."""
    run = RunDir(run_dir, resume, "target")
    o = run.settle_options({**asdict(opts or TrainOptions()), "dtype": dtype, "out": abs_path(out_dir, "--out"),
                            "max_shard_mb": max_shard_mb}, {**DEFAULT_OPTIONS, "dtype": "bfloat16"})
    opts, dtype, max_shard_mb = TrainOptions.of(o).validate(), o["dtype"], o["max_shard_mb"]
    check_shard_mb(max_shard_mb)
    if dtype not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"export dtype must be bfloat16, float16 or float32, got {dtype!r}")
    out = Path(o["out"]) if o["out"] is not None else run.path / "model"
    check_out_dir(out, {"data": data_dir}, run.path)
    check_export_dir(out, run)
    data = load_corpus(data_dir)
    vocab = int(data.meta["vocab_size"])
    # before the shape: another tokenizer's corpus would first differ in vocab_size, not a flag
    tokenizer = run.bind("corpus_tokenizer", tokenizer_hash(data.path),
                         f"the corpus in {data_dir} was made with another tokenizer than the run's "
                         f"(tokenizer.json differs)")
    spec = run.settle_spec({**asdict(shape or TargetShape()), "vocab_size": vocab}, TARGET_SHAPE)
    spec["corpus_tokenizer"] = tokenizer
    spec["corpus_tokens"] = run.bind("corpus_tokens", data.sizes, f"the corpus in {data_dir} is not the one this "
                                     f"run trained on (its token counts differ)")
    shape = TargetShape(**{k: v for k, v in spec.items() if k in TargetShape.__dataclass_fields__}).check()
    pad = Tokenizer(data.path).tok.token_to_id(PAD)
    config = hf_config(shape, vocab, opts.seq_len, int(data.meta["eos_token_id"]), pad, dtype)
    device = resolve_device(opts.device)
    check_logits_fit(opts.batch_size * opts.seq_len, vocab, device, f"--batch-size {opts.batch_size} x --seq-len "
                                                                     f"{opts.seq_len}")
    windows = TokenWindows(data.train, opts.seq_len + 1, device)
    held = fixed_windows(data.heldout, opts.seq_len + 1, opts.eval_tokens)
    torch.manual_seed(opts.seed)
    model = build_target(ModelConfig.from_dict(config, "the target shape"), device)
    run.begin(spec, o)  # once every input was read and checked
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[target] {n_params:,} parameters, {data.train.size:,} train tokens, "
          f"device {device}", flush=True)
    trainer = Trainer("target", run, model, opts, device)
    final = trainer.fit(lambda gen: (lm_loss(model, windows.sample(opts.batch_size, gen)),
                                     opts.batch_size * opts.seq_len),
                        lambda: evaluate_lm(model, held, opts.batch_size, device))
    export_target(model, config, data.path, out, int(max_shard_mb * MiB))
    summary = {"kind": "target", "steps": trainer.step, "minutes": round(trainer.elapsed / 60, 2),
               "parameters": n_params, "tokens_seen": trainer.step * opts.batch_size * opts.seq_len,
               "train_tokens": int(data.train.size), "heldout_tokens_evaluated": int(held[:, 1:].numel()),
               **final, "export": str(out),
               "export_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors"))}
    write_summary(run, summary)
    print(f"[target] held-out loss {final['eval_loss']:.4f} (perplexity {final['eval_ppl']:.2f}) at step "
          f"{final['best_step']} of {trainer.step}; exported to {out}", flush=True)
    return summary
