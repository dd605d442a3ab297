"""Train a DFlash drafter for a frozen target (TRAINING.md); export it in the
published layout.

Each training sequence runs once through the frozen target (cache-free, causal), giving
the tapped hidden states of every position. Random anchor positions `a` are drawn per
sequence; each makes a block [x_a, MASK x (b-1)] at positions a..a+b-1 that sees the
target features of positions < a and itself (bidirectionally), never another block, as
at inference. Slot k predicts x_{a+k} (same position, no shift) through the target's
frozen LM head, with cross-entropy weighted by exp(-(k-1)/gamma): a deep slot only
counts once every slot before it is accepted. All blocks of a batch run in one
`DFlashDraftModel.forward_dense` pass with a [B, M, P+M] mask.

Training text is the corpus (default) or target-generated continuations
(`generate_continuations`: greedy AR from corpus prompts), which are exactly what the
drafter must predict when verifying greedy decoding: the target's own tokens.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from treeflash.config import DTYPES, DraftConfig, ModelConfig, default_target_layer_ids, read_config_json
from treeflash.engine.options import resolve_device, resolve_dtype
from treeflash.errors import TreeflashError, UsageError
from treeflash.files import model_folder
from treeflash.memory import available_bytes
from treeflash.models.dflash import DFlashDraftModel
from treeflash.models.loader import build_on, check_sizes, load_weights, stored_shapes, weights_dtype
from treeflash.models.transformer import CausalLM
from treeflash.tokenizer import Tokenizer
from treeflash.train.common import (DEFAULT_OPTIONS, MiB, Progress, RunDir, TrainOptions, Trainer, abs_path,
                                    check_export_dir, check_logits_fit, check_out_dir, check_shard_mb,
                                    check_trainable, exporting, flag, hf_tensors, init_weights, save_safetensors,
                                    to_device, within, write_summary)
from treeflash.train.corpus import (NPY_ERRORS, TokenWindows, file_hash, fixed_windows, load_corpus, npy_error,
                                    tokenizer_hash)
from treeflash.train.target import causal_inputs
from treeflash.train.tokenizer import MASK

# The drafter's defaults where they differ from the target's (common.DEFAULT_OPTIONS), and
# its own options.
DRAFTER_OPTIONS = {"batch_size": 32, "seq_len": 512, "lr": 2e-3, "eval_tokens": 1 << 18,
                   "gamma": 7.0, "blocks_per_seq": 32, "dtype": None, "tau_prompts": 16,
                   "tau_new_tokens": 128, "generated": None}
# --tau-prompts at most (as bench's --num-prompts): 10^9 took gigabytes before training began
MAX_TAU_PROMPTS = 65536
DRAFTER_SHAPE = {"num_layers": 2, "block_size": 16,
                 "target_layer_ids": None,  # None: treeflash.config.default_target_layer_ids
                 "mask_token_id": None}     # None: the target tokenizer's <|mask|>


@dataclass
class DrafterShape:
    """The drafter shape (default: 2 layers of the target's width, ~7 MB in bf16 for the
    default target). A field left None is unset: a fresh run takes DRAFTER_SHAPE's value,
    a resumed run its own (a set field must match the run's)."""

    num_layers: int | None = None
    block_size: int | None = None
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None


def target_dtype(cfg: ModelConfig, target_dir: str | Path) -> str | None:
    """The target's stored dtype (config.json's, else its weights'), if a drafter trains
    and exports in it (not float64: the drafter trains in float32 at most)."""
    stored = cfg.torch_dtype or weights_dtype(target_dir)
    return stored if stored in ("bfloat16", "float16", "float32") else None


def load_frozen_target(target_dir: str | Path, device: torch.device) -> CausalLM:
    """The target in its inference dtype (bf16 on CUDA, float32 on CPU), without grads."""
    cfg = ModelConfig.from_pretrained(target_dir)
    check_sizes(target_dir, cfg, stored_shapes(target_dir))
    with build_on(device, resolve_dtype("auto", target_dtype(cfg, target_dir), device)):
        target = CausalLM(cfg)
    load_weights(target, target_dir)
    return target.eval().requires_grad_(False)


def drafter_config(shape: DrafterShape, t: ModelConfig, dtype: str) -> dict:
    """config.json in the published DFlash layout (Qwen3 keys plus the DFlash ones)."""
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,  # what DFlashDraftModel runs
        "num_hidden_layers": shape.num_layers, "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads, "head_dim": t.head_dim, "vocab_size": t.vocab_size,
        "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta,
        "max_position_embeddings": t.max_position_embeddings, "tie_word_embeddings": False,
        "block_size": shape.block_size, "num_target_layers": t.num_layers,
        "dflash_config": {"mask_token_id": shape.mask_token_id, "target_layer_ids": shape.target_layer_ids},
        "torch_dtype": dtype,
    }
    if t.rope_scaling:
        config["rope_scaling"] = t.rope_scaling
    return config


def build_drafter(config: dict, target: CausalLM, device: torch.device) -> DFlashDraftModel:
    """A trainable float32 drafter; its final norm starts as the target's, since both feed
    the same LM head."""
    try:  # the shape comes from the flags: a bad one is a usage error, not a damaged checkpoint
        dcfg = DraftConfig.from_dict(config, "the drafter shape")
        dcfg.check_fits(target.config)
    except TreeflashError as e:
        raise UsageError(str(e)) from None
    check_trainable(dcfg.layers, device, "the drafter shape", embeddings=False)
    with build_on(device, torch.float32):
        drafter = DFlashDraftModel(dcfg)
    init_weights(drafter, dcfg.layers.num_layers)
    with torch.no_grad():
        drafter.norm.weight.copy_(target.model.norm.weight)
    return drafter.requires_grad_(True)


def sample_anchors(batch: int, lo: int, hi: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, n] distinct anchor positions in lo..hi per row."""
    return torch.rand(batch, hi - lo + 1, generator=gen).topk(n, dim=1).indices + lo


def make_blocks(ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int):
    """Blocks [B, n*b] and their positions, labels [B, n, b-1], and the attention mask
    [B, n*b, S + n*b]: target features before the block's anchor, plus its own block."""
    B, S = ids.shape
    n, b, dev = anchors.shape[1], block_size, ids.device
    pos = anchors[:, :, None] + torch.arange(b, device=dev)                    # [B, n, b]
    block = torch.full_like(pos, mask_id)
    block[:, :, 0] = ids.gather(1, anchors)
    labels = ids.gather(1, pos[:, :, 1:].reshape(B, -1)).view(B, n, b - 1)
    ctx = torch.arange(S, device=dev) < anchors[:, :, None]                     # [B, n, S]
    ctx = ctx[:, :, None, :].expand(B, n, b, S).reshape(B, n * b, S)
    own = torch.eye(n, dtype=torch.bool, device=dev).repeat_interleave(b, 0).repeat_interleave(b, 1)
    mask = torch.cat([ctx, own.expand(B, -1, -1)], dim=-1)
    return block.view(B, n * b), pos.view(B, n * b), labels, mask


def draft_logits(target: CausalLM, drafter: DFlashDraftModel, ids: torch.Tensor, anchors: torch.Tensor):
    """Logits [B, n, b-1, V] of the blocks anchored at `anchors` [B, n], and their labels."""
    b = drafter.block_size
    with torch.no_grad():
        _, feats = target(ids, causal_inputs(ids), None, drafter.target_layer_ids)
        block, pos, labels, mask = make_blocks(ids, anchors, b, drafter.mask_token_id)
        embeds = target.embed(block)
    B, S = ids.shape
    fpos = torch.arange(S, device=ids.device).expand(B, S)
    h = drafter.forward_dense(embeds, pos, feats, fpos, mask)
    h = h.view(B, anchors.shape[1], b, -1)[:, :, 1:]
    return drafter.scaled_logits(target.logits(h).float()), labels


def slot_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
    return (ce * weights).sum(-1).mean() / weights.sum()


def evaluate_drafter(target, drafter, windows: torch.Tensor, blocks: int, batch_size: int,
                     weights: torch.Tensor, device: torch.device, lo: int = 1) -> dict:
    """Held-out weighted loss, per-slot top-1 accuracy against the data, and `tau_est`:
    1 + the mean run of leading correct slots (the τ of greedy chain drafting if the target
    always agreed with the data; on target-generated text it does). Anchors from `lo`,
    fixed, so evaluations are comparable."""
    gen = torch.Generator().manual_seed(1234)
    b = drafter.block_size
    S = windows.shape[1]
    n = min(blocks, S - b - lo + 1)
    loss, correct, run, count = 0.0, 0.0, 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i:i + batch_size].to(device)
        anchors = sample_anchors(ids.shape[0], lo, S - b, n, gen).to(device)
        logits, labels = draft_logits(target, drafter, ids, anchors)
        hit = logits.argmax(-1) == labels                                   # [B, n, b-1]
        k = ids.shape[0] * n
        loss += weighted_ce(logits, labels, weights).item() * k
        correct = correct + hit.float().sum((0, 1)).cpu()
        run += hit.int().cumprod(-1).sum().item()
        count += k
    acc = correct / count
    return {"eval_loss": round(loss / count, 5), "acc1": round(float(acc[0]), 4),
            "acc_mean": round(float(acc.mean()), 4), "tau_est": round(1 + run / count, 3)}


def target_fingerprint(target_dir: str | Path, weights: bool = True) -> str:
    """What a generated file and a drafter run record of their target: a hash of its
    config.json, tokenizer.json and weights, so that a drafter is not trained on another
    target's continuations, or resumed against another target, by mistake. Of each
    safetensors file it hashes the header (names, shapes, offsets) and 4 KiB of every
    64 MiB of data: two trainings of one shape differ everywhere, and an 8B target is
    read in a second, not a minute. `weights=False`: the fingerprint of files written
    before it covered the weights."""
    folder = Path(target_dir)
    h = hashlib.sha256(json.dumps(json.loads((folder / "config.json").read_text()), sort_keys=True).encode())
    tok = folder / "tokenizer.json"
    if tok.exists():
        h.update(tok.read_bytes())
    for path in sorted(folder.glob("*.safetensors")) if weights else ():
        size = path.stat().st_size
        h.update(size.to_bytes(8, "little"))
        with path.open("rb") as f:
            header = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header, size)))
            for offset in [*range(0, size, 64 << 20), max(size - 4096, 0)]:
                f.seek(offset)
                h.update(f.read(4096))
    return h.hexdigest()[:16]


class GeneratedRows:
    """Target-generated sequences [N, P+G] (prompt + greedy continuation); anchors start at
    the last prompt token, so every label is a target-generated token. `heldout` holds the
    continuations of held-out prompts (None in files without them): the drafter is
    evaluated, and its best step chosen, on the text it is trained to predict."""

    def __init__(self, path: str | Path, device: torch.device, target_dir: str | Path | None = None):
        try:
            f = np.load(path)
            if not isinstance(f, np.lib.npyio.NpzFile):  # a plain .npy array, not `train generate`'s .npz
                raise ValueError("not an .npz file of `treeflash train generate`")
            with f:
                ids, prompt_len = f["ids"], f["prompt_len"]
                held = f["heldout_ids"] if "heldout_ids" in f.files else None
                writer = str(f["target"]) if "target" in f.files else None
        except NPY_ERRORS as e:
            raise UsageError(f"cannot read generated sequences {path}: {npy_error(e)}") from None
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise UsageError(f"{path}: 'ids' must be a 2-D array of token ids, got {ids.dtype} {ids.shape}")
        if writer is not None and target_dir is not None and writer not in (
                target_fingerprint(target_dir), target_fingerprint(target_dir, weights=False)):
            raise UsageError(f"{path} was generated by another target than {target_dir} "
                             f"(its config.json, tokenizer.json or weights differ)")
        if ids.shape[0] == 0:
            raise UsageError(f"{path} holds no generated sequences")
        if prompt_len.ndim != 0 or not np.issubdtype(prompt_len.dtype, np.integer) or \
                not 1 <= int(prompt_len) < ids.shape[1]:
            raise UsageError(f"{path}: 'prompt_len' must be one integer from 1 to {ids.shape[1] - 1} (the "
                             f"sequences are {ids.shape[1]} tokens), got {prompt_len.tolist()!r}")
        prompt_len = int(prompt_len)
        if held is not None and held.size and (held.ndim != 2 or held.shape[1] != ids.shape[1]
                                               or not np.issubdtype(held.dtype, np.integer)):
            raise UsageError(f"{path}: 'heldout_ids' must be a 2-D array of token ids as long as 'ids' "
                             f"({ids.shape[1]}), got {held.dtype} {held.shape}")
        if target_dir is not None:  # rows the target could not have written
            cfg = ModelConfig.from_pretrained(target_dir)
            if ids.shape[1] > cfg.max_position_embeddings:
                raise UsageError(f"{path}: its sequences of {ids.shape[1]} tokens exceed the target's context of "
                                 f"{cfg.max_position_embeddings}")
            for name, rows in (("ids", ids), ("heldout_ids", held)):
                if rows is not None and rows.size and not (0 <= rows.min() and rows.max() < cfg.vocab_size):
                    raise UsageError(f"{path}: '{name}' holds token ids outside the target's vocabulary of "
                                     f"{cfg.vocab_size}")
        self.ids = torch.from_numpy(ids.astype(np.int64)).to(device)
        self.heldout = torch.from_numpy(held.astype(np.int64)) if held is not None and held.size else None
        self.length, self.lo, self.prompt_len = ids.shape[1], max(prompt_len - 1, 1), prompt_len

    def sample(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        rows = torch.randint(0, self.ids.shape[0], (batch,), generator=gen)
        return self.ids[to_device(rows, self.ids.device)]


def generate_continuations(target_dir: str | Path, data_dir: str | Path, out_path: str | Path,
                           num_prompts: int = 512, prompt_len: int = 64, new_tokens: int = 448,
                           batch_size: int = 128, seed: int = 0, device: str = "auto",
                           heldout_prompts: int | None = None) -> dict:
    """Greedy AR continuations by the target (`treeflash.LLM`) of random windows of the
    corpus' train split (`ids` [num_prompts, prompt_len + new_tokens]) and of its held-out
    split (`heldout_ids`, default num_prompts / 32, at least 16), with `prompt_len`, in an
    .npz file."""
    from treeflash import LLM, SamplingParams
    if heldout_prompts is None:
        heldout_prompts = max(16, num_prompts // 32)
    for key, value in (("num_prompts", num_prompts), ("prompt_len", prompt_len),
                       ("new_tokens", new_tokens), ("batch_size", batch_size)):
        if value < 1:
            raise UsageError(f"{flag(key)} must be >= 1, got {value}")
    if heldout_prompts < 0:
        raise UsageError(f"--heldout-prompts must be >= 0, got {heldout_prompts}")
    if not 0 <= seed < 2 ** 63:
        raise UsageError(f"--seed must be in [0, 2^63), got {seed}")
    out = Path(out_path)
    if out.is_dir():  # not <folder>.npz beside it
        raise UsageError(f"--out {out} is a folder: give a file name")
    out = out if out.suffix == ".npz" else out.with_name(out.name + ".npz")  # as numpy names it
    target_dir = _target_folder(target_dir)
    _check_generated_out(out, target_dir, data_dir)
    tcfg = ModelConfig.from_pretrained(target_dir)
    context = tcfg.max_position_embeddings
    if prompt_len + new_tokens > context:  # before the corpus' checks, whose advice would not help
        raise UsageError(f"prompt_len + new_tokens = {prompt_len + new_tokens} exceeds the target's context of {context}")
    data = load_corpus(data_dir)
    _require_same_tokenizer(data, target_dir)
    if data.train.size <= prompt_len:
        raise UsageError(f"the corpus has {data.train.size} tokens, too few for prompts of {prompt_len}")
    if heldout_prompts and data.heldout.size <= prompt_len:
        raise UsageError(f"the held-out split has {data.heldout.size} tokens, too few for prompts of {prompt_len} "
                         f"(pass heldout_prompts=0 / --heldout-prompts 0 to skip held-out continuations)")
    total = num_prompts + heldout_prompts
    # the target's ids, which a padded LM head may take past a uint16 corpus' 65535
    dtype = data.train.dtype if tcfg.vocab_size <= np.iinfo(data.train.dtype).max + 1 else np.dtype(np.int32)
    # the rows are held until the end, and the prompts drawn into them pass through an
    # array of their own: a count off by a few zeros took gigabytes, then the OS killed it,
    # with no word
    need = total * (2 * prompt_len + new_tokens) * dtype.itemsize
    have = available_bytes(torch.device("cpu"))
    if have is not None and need > have:
        raise UsageError(f"--num-prompts {num_prompts} (and {heldout_prompts} held out) of {prompt_len + new_tokens} "
                         f"tokens take about {need / 2**30:,.1f} GiB to hold, more than the "
                         f"{have / 2**30:,.1f} GiB free on this host")
    llm = LLM(target_dir, method="ar", device=device)  # its max_model_len: the context checked above
    rng = np.random.default_rng(seed)
    rows = np.zeros((total, prompt_len + new_tokens), dtype=dtype)
    rows[:, :prompt_len] = [split[s:s + prompt_len]
                            for split, n in ((data.train, num_prompts), (data.heldout, heldout_prompts))
                            for s in rng.integers(0, split.size - prompt_len, n)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    bar, t0 = Progress("generate", total, 0), time.perf_counter()
    for i in range(0, total, batch_size):
        batch = rows[i:i + batch_size, :prompt_len].astype(np.int64).tolist()
        for j, res in enumerate(llm.generate(batch, params)):
            rows[i + j, prompt_len:] = res.token_ids
        bar.step(len(batch))
    bar.close()
    seconds = time.perf_counter() - t0
    out.parent.mkdir(parents=True, exist_ok=True)
    # Whole or not at all (a file of its own, renamed once written), and not over a file
    # that appeared while generating.
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # (mkstemp's would leave the file 0600)
    try:
        with open(tmp, "wb") as f:
            np.savez(f, ids=rows[:num_prompts], heldout_ids=rows[num_prompts:], prompt_len=np.int64(prompt_len),
                     target=np.str_(target_fingerprint(target_dir)))
        if out.exists():
            raise UsageError(f"--out {out} appeared while generating: remove it or choose another path")
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    meta = {"path": str(out), "sequences": num_prompts, "heldout_sequences": heldout_prompts,
            "prompt_len": prompt_len, "new_tokens": new_tokens,
            "generated_tokens": total * new_tokens, "seconds": round(seconds, 2),
            "tokens_per_s": round(total * new_tokens / seconds)}
    print(f"[generate] {json.dumps(meta)}", flush=True)
    return meta


def measure_tau(target_dir: str | Path, drafter_dir: str | Path, prompts: list[list[int]],
                new_tokens: int, device: str = "auto") -> dict:
    """τ (mean tokens committed per round) of DFlash chains and DDTree through the engine,
    greedy, and the fraction of outputs identical to plain AR decoding (lossless check)."""
    from treeflash import LLM, SamplingParams
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    ref = [r.token_ids for r in LLM(target_dir, method="ar", device=device).generate(prompts, params)]
    out = {}
    for method in ("dflash", "ddtree"):
        res = LLM(target_dir, draft_model=drafter_dir, method=method, device=device).generate(prompts, params)
        out[f"tau_{method}"] = round(sum(len(r.token_ids) for r in res) / sum(r.stats["rounds"] for r in res), 3)
        out[f"same_as_ar_{method}"] = round(sum(r.token_ids == a for r, a in zip(res, ref)) / len(ref), 3)
    return out


def generated_file(path: str | Path) -> Path:
    """What `--generated path` reads: path, or path.npz where path is not there (`train
    generate --out path` writes path.npz, as numpy names it)."""
    path = Path(path)
    return path if path.suffix == ".npz" or path.exists() else path.with_name(path.name + ".npz")


def _check_generated_out(out: Path, target_dir: str | Path, data_dir: str | Path) -> None:
    """Before generating for minutes: the file must be new (a drafter run may be bound to
    an existing one, by its bytes), writable, and not inside the target or the corpus (a
    train.npz there would take the corpus' place)."""
    where = out.resolve()
    for what, folder in (("target", target_dir), ("corpus", data_dir)):
        if within(where.parent, Path(folder).resolve()):
            raise UsageError(f"--out {out} is inside the {what} folder {folder}: choose another path")
    check_out_dir(where.parent)  # a folder that can be made and written
    if where.is_dir():
        raise UsageError(f"--out {out} is a folder: give a file name")
    if where.exists():
        raise UsageError(f"--out {out} exists (a drafter run may train on it): remove it or choose another path")


def _target_folder(target_dir: str | Path) -> str | Path:
    """The target's folder (a hub id: its Hugging Face cache's copy, as LLM reads one),
    checked to hold a target."""
    target_dir = model_folder(target_dir)
    if not (Path(target_dir) / "config.json").exists():
        raise UsageError(f"target checkpoint not found: {target_dir} (no config.json; train or "
                         f"download the target first)")
    if "DFlashDraftModel" in (read_config_json(target_dir, "target").get("architectures") or []):
        raise UsageError(f"--target {target_dir} is a DFlash drafter: give the target model the drafter is for")
    return target_dir


def _require_same_tokenizer(data, target_dir: str | Path) -> None:
    """The corpus keeps the tokenizer it was made with: another one than the target's
    would train on token ids that mean other text to it."""
    mine, theirs = Path(data.path) / "tokenizer.json", Path(target_dir) / "tokenizer.json"
    if not theirs.exists():
        raise UsageError(f"the target in {target_dir} has no tokenizer.json: the corpus's tokenizer cannot be "
                         f"checked against it (copy the target's tokenizer.json there)")
    if mine.exists() and not Tokenizer(data.path).same_vocabulary(Tokenizer(target_dir)):
        raise UsageError(f"the corpus in {data.path} was tokenized with another tokenizer than the target's "
                         f"in {target_dir}: re-tokenize it with the target's (treeflash train corpus)")


def train_drafter(target_dir: str | Path, data_dir: str | Path, run_dir: str | Path,
                  out_dir: str | Path | None = None, shape: DrafterShape | None = None,
                  opts: TrainOptions | None = None, resume: bool = False, generated: str | Path | None = None,
                  gamma: float | None = None, blocks_per_seq: int | None = None, dtype: str | None = None,
                  tau_prompts: int | None = None, tau_new_tokens: int | None = None,
                  max_shard_mb: float | None = None) -> dict:
    """Train (or resume) a drafter for the target in `target_dir` on the corpus in `data_dir`
    (or on `generated` sequences, evaluated on their held-out continuations when the file
    has them, else on the corpus). Exports to `out_dir` (default `<run_dir>/model`), then
    measures τ through the engine on `tau_prompts` held-out prompts. Unset (None) shape
    fields and options take the defaults (DRAFTER_SHAPE, DRAFTER_OPTIONS), or the resumed
    run's values (see `RunDir`). Returns the summary (also in `<run_dir>/summary.json`)."""
    target_dir = _target_folder(target_dir)
    tcfg = ModelConfig.from_pretrained(target_dir)
    run = RunDir(run_dir, resume, "drafter")
    seq_len_given = opts is not None and opts.seq_len is not None
    blocks_given = blocks_per_seq is not None  # (the default is cut to fit without a word)
    if generated is not None and "generated" in run.saved_options and run.saved_options["generated"] is None:
        raise UsageError("--resume: this run trains on the corpus; --generated would change its training text")
    generated = None if generated is None else str(generated_file(abs_path(generated, "--generated")))
    o = run.settle_options({**asdict(opts or TrainOptions()), "generated": generated, "gamma": gamma,
                            "blocks_per_seq": blocks_per_seq, "dtype": dtype, "tau_prompts": tau_prompts,
                            "tau_new_tokens": tau_new_tokens, "out": abs_path(out_dir, "--out"),
                            "max_shard_mb": max_shard_mb},
                           {**DEFAULT_OPTIONS, **DRAFTER_OPTIONS,  # default sequences fit the target's context
                            "seq_len": min(DRAFTER_OPTIONS["seq_len"], tcfg.max_position_embeddings),
                            "tau_new_tokens": min(DRAFTER_OPTIONS["tau_new_tokens"],
                                                  max(1, tcfg.max_position_embeddings // 2))})
    opts = TrainOptions.of(o).validate()
    check_shard_mb(o["max_shard_mb"])
    generated, gamma, blocks_per_seq = o["generated"], o["gamma"], o["blocks_per_seq"]
    tau_prompts, tau_new_tokens = o["tau_prompts"], o["tau_new_tokens"]
    for key, value in (("gamma", gamma), ("blocks_per_seq", blocks_per_seq), ("tau_prompts", tau_prompts),
                       ("tau_new_tokens", tau_new_tokens)):  # types first: a hand-edited run.json holds anything
        kind = (int, float) if key == "gamma" else int
        if isinstance(value, bool) or not isinstance(value, kind):
            raise UsageError(f"{flag(key)} must be {'a number' if key == 'gamma' else 'an integer'}, got {value!r}")
    if not 0 <= tau_prompts <= MAX_TAU_PROMPTS:
        raise UsageError(f"--tau-prompts must be from 0 to {MAX_TAU_PROMPTS} (0: skip the measure), got {tau_prompts}")
    if tau_new_tokens < 1:
        raise UsageError(f"--tau-new-tokens must be >= 1, got {tau_new_tokens}")
    if not gamma > 0:
        raise UsageError(f"--gamma must be > 0, got {gamma}")
    if blocks_per_seq < 1:
        raise UsageError(f"--blocks-per-seq must be >= 1, got {blocks_per_seq}")
    out = Path(o["out"]) if o["out"] is not None else run.path / "model"
    check_out_dir(out, {"target": target_dir, "data": data_dir}, run.path)
    check_export_dir(out, run)
    signature = {"target_layers": tcfg.num_layers, "target_hidden": tcfg.hidden_size,
                 "target_vocab": tcfg.vocab_size}
    for k, v in signature.items():  # not flags: a target of another shape is another target
        run.bind(k, v, f"{target_dir} is not the target this run trained against ({k.replace('_', ' ')} {v}, "
                       f"the run's {run.saved.get(k)})")
    shape = DrafterShape(**run.settle_spec(asdict(shape or DrafterShape()), DRAFTER_SHAPE))
    if isinstance(shape.num_layers, bool) or not isinstance(shape.num_layers, int) or not 0 < shape.num_layers < 2 ** 31:
        raise UsageError(f"--num-layers must be a positive integer, got {shape.num_layers!r}")
    if isinstance(shape.block_size, bool) or not isinstance(shape.block_size, int) or shape.block_size < 2:
        raise UsageError(f"--block-size must be an integer >= 2, got {shape.block_size!r}")
    if opts.seq_len < shape.block_size + 1:
        raise UsageError(f"--seq-len {opts.seq_len} is too short for blocks of {shape.block_size}")
    if opts.seq_len > tcfg.max_position_embeddings:
        raise UsageError(f"--seq-len {opts.seq_len} exceeds the target's context of "
                         f"{tcfg.max_position_embeddings} tokens (max_position_embeddings)")
    plen = min(64, tcfg.max_position_embeddings - tau_new_tokens)  # τ prompts
    if tau_prompts and plen < 1:
        raise UsageError(f"--tau-new-tokens {tau_new_tokens} leaves no room for a prompt in the target's "
                         f"context of {tcfg.max_position_embeddings}")
    data = load_corpus(data_dir)
    _require_same_tokenizer(data, target_dir)
    bound = {"target": run.bind("target", target_fingerprint(target_dir), f"{target_dir} is not the target this "
                                f"run trained against (its config.json, tokenizer.json or weights differ)"),
             "corpus_tokenizer": run.bind("corpus_tokenizer", tokenizer_hash(data.path),
                                          f"the corpus in {data_dir} was made with another tokenizer than the "
                                          f"run's (tokenizer.json differs)"),
             "corpus_tokens": run.bind("corpus_tokens", data.sizes, f"the corpus in {data_dir} is not the one this "
                                       f"run trained on (its token counts differ)")}
    if generated is not None:  # its rows are the training text: the same file (wherever it now is)
        if not Path(generated).is_file():
            raise UsageError(f"--generated {generated}: {'a folder' if Path(generated).is_dir() else 'no such file'}"
                             f"; give the .npz file that `treeflash train generate` wrote")
        bound["generated_sha256"] = run.bind("generated_sha256", file_hash(generated), f"{generated} is not the "
                                             f"file of generated sequences this run trained on (its bytes differ)")
    if int(data.meta["vocab_size"]) > tcfg.vocab_size:
        raise UsageError(f"the corpus in {data_dir} was tokenized with a vocabulary of {data.meta['vocab_size']}, "
                         f"larger than the target's {tcfg.vocab_size}: use the target's tokenizer")
    if shape.target_layer_ids is None:  # the published default, kept inside shallow targets
        ids = default_target_layer_ids(tcfg.num_layers, shape.num_layers)
        shape.target_layer_ids = sorted({min(max(i, 0), tcfg.num_layers - 1) for i in ids})
    if shape.mask_token_id is None:
        shape.mask_token_id = Tokenizer(target_dir).tok.token_to_id(MASK)
        if shape.mask_token_id is None:
            raise UsageError(f"the target's tokenizer has no {MASK} token: give the drafter's mask token id "
                             f"(--mask-token-id)")
    if shape.mask_token_id in tcfg.eos_token_ids:
        print(f"treeflash: note: mask token id {shape.mask_token_id} is the target's end of text, which it "
              f"generates: the drafter cannot tell a masked position from it (give an id the target never "
              f"produces, e.g. a reserved special token)", file=sys.stderr)
    elif in_text := int(np.count_nonzero(data.train == shape.mask_token_id)):  # an ordinary token, or in a chat
        print(f"treeflash: note: mask token id {shape.mask_token_id} is in the corpus's text {in_text} times: there "
              f"the drafter cannot tell a masked position from it (give an id no text holds, e.g. a reserved "
              f"special token)", file=sys.stderr)
    config = drafter_config(shape, tcfg, o["dtype"] or target_dtype(tcfg, target_dir) or "bfloat16")
    if config["torch_dtype"] not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"export dtype must be bfloat16, float16 or float32, got {config['torch_dtype']!r}")
    device = resolve_device(opts.device)
    b = shape.block_size
    source = GeneratedRows(generated, device, target_dir) if generated else TokenWindows(data.train, opts.seq_len, device)
    lo = source.lo if generated else 1  # a corpus window's first anchor needs one position of context
    if generated and seq_len_given:
        print(f"treeflash: note: --seq-len sets the corpus windows' length; the rows of {generated} are "
              f"{source.length} tokens (held-out corpus windows, where the file has no held-out rows, keep it)",
              file=sys.stderr)
    if source.length - b < lo:
        raise UsageError(f"training sequences of {source.length} tokens are too short for blocks of {b}")
    if generated and source.heldout is not None:  # evaluate on what it learns: the target's own text
        held, held_lo, held_text = source.heldout[:max(1, opts.eval_tokens // source.length)], lo, "generated"
    else:
        held, held_lo, held_text = fixed_windows(data.heldout, opts.seq_len, opts.eval_tokens), 1, "corpus"
        if held.shape[1] < b + 2:  # a block after the first anchor, at position 1, and its label
            raise UsageError(f"the held-out split ({data.heldout.size} tokens) is too short for blocks of {b}"
                             if held.shape[1] < opts.seq_len else
                             f"--seq-len {opts.seq_len} is too short for the held-out windows' blocks of {b} "
                             f"(needs >= {b + 2})")
    # the anchors a sequence has (more --blocks-per-seq are cut to them), in training and evaluation
    n = min(blocks_per_seq, source.length - b - lo + 1)
    drawn = max(n, min(blocks_per_seq, held.shape[1] - b - held_lo + 1))
    check_logits_fit(opts.batch_size * drawn * b, tcfg.vocab_size, device,
                     f"--batch-size {opts.batch_size} x --blocks-per-seq {blocks_per_seq}"
                     f"{f' ({drawn} drawn)' if drawn < blocks_per_seq else ''} x block size {b}")
    tau_ids = tau_prompt_ids(data.heldout, source, tau_prompts, plen)
    torch.manual_seed(opts.seed)
    target = load_frozen_target(target_dir, device)
    drafter = build_drafter(config, target, device)
    run.begin({**asdict(shape), **signature, **bound}, o)  # once every input was read and checked
    if n < blocks_per_seq and blocks_given:
        print(f"treeflash: note: --blocks-per-seq {blocks_per_seq} is more anchors than a sequence of "
              f"{source.length} tokens has for blocks of {b}: {n} are drawn", file=sys.stderr)
    weights = slot_weights(b, gamma, device)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"[drafter] {n_params:,} parameters, taps {shape.target_layer_ids}, block {b}, "
          f"{n} blocks/sequence, data: {'generated ' + str(generated) if generated else 'corpus'}, "
          f"held-out: {held.shape[0]} {held_text} sequences, device {device}", flush=True)

    def batch_loss(gen):
        ids = source.sample(opts.batch_size, gen)
        anchors = to_device(sample_anchors(ids.shape[0], lo, source.length - b, n, gen), device)
        logits, labels = draft_logits(target, drafter, ids, anchors)
        return weighted_ce(logits, labels, weights), ids.numel()

    trainer = Trainer("drafter", run, drafter, opts, device)
    final = trainer.fit(batch_loss, lambda: evaluate_drafter(target, drafter, held, blocks_per_seq,
                                                             opts.batch_size, weights, device, held_lo))
    with exporting(out) as folder:
        save_safetensors(hf_tensors(drafter), folder, DTYPES[config["torch_dtype"]], int(o["max_shard_mb"] * MiB))
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    summary = {"kind": "drafter", "steps": trainer.step, "minutes": round(trainer.elapsed / 60, 2),
               "parameters": n_params, "data": str(generated) if generated else "corpus",
               "heldout_text": held_text, **final,
               "export": str(out), "export_bytes": sum(f.stat().st_size for f in out.glob("*.safetensors"))}
    write_summary(run, summary)  # before τ, which takes minutes on a CPU: Ctrl-C there keeps this session's
    if tau_ids:
        try:
            summary.update(measure_tau(target_dir, out, tau_ids, tau_new_tokens, opts.device))
        except Exception as e:  # a measurement, not the product: never lose a trained drafter to it
            summary["tau_error"] = f"{type(e).__name__}: {e}"
            print(f"[drafter] warning: τ measurement failed: {summary['tau_error']}", flush=True)
        write_summary(run, summary)
    print(f"[drafter] {json.dumps(summary)}", flush=True)
    return summary


def tau_prompt_ids(heldout: np.ndarray, source, count: int, length: int) -> list[list[int]]:
    """τ's prompts: from the corpus's held-out split, or, where that is empty (training then
    evaluates on generated held-out rows), the prompts of those rows (their last `length`
    tokens)."""
    if not count:
        return []
    if heldout.size:
        return held_prompts(heldout, count, length)
    rows = np.linspace(0, source.heldout.shape[0] - 1, min(count, source.heldout.shape[0])).astype(np.int64)
    return [source.heldout[r, max(source.prompt_len - length, 0):source.prompt_len].tolist() for r in rows]


def held_prompts(heldout: np.ndarray, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens spread evenly over the held-out split."""
    length = min(length, max(heldout.size // 2, 1))
    starts = np.linspace(0, heldout.size - length, count).astype(np.int64)
    return [heldout[s:s + length].astype(np.int64).tolist() for s in starts]

