"""What the target and drafter trainers share: options, the training loop (AdamW, warmup +
cosine LR, bf16 autocast on CUDA, clipping, periodic held-out evals, a step or time budget),
resumable run folders, progress output, loss curves, and Hugging Face safetensors export.

A *run folder* holds everything needed to resume (`state.pt`: model, optimizer, step,
elapsed time, RNG states, loss history), the settings it was started with (`run.json`),
the metrics log (`log.jsonl`), `summary.json` and `loss.png`. Exported checkpoints go
elsewhere (`--out`), so a folder of results never carries optimizer state.
"""
from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file
from torch import nn

from treeflash.config import ModelConfig
from treeflash.memory import available_bytes
from treeflash.errors import TreeflashError, UsageError
from treeflash.files import probe_write

MiB = 1 << 20


# What a run uses for an option left unset (None) when it starts (the target's values;
# `drafter.DRAFTER_OPTIONS` holds the drafter's).
DEFAULT_OPTIONS = {
    "batch_size": 64, "seq_len": 1024, "lr": 2e-3,
    "min_lr_ratio": 0.1,            # cosine decays to lr * min_lr_ratio
    "warmup_steps": 100, "weight_decay": 0.1, "grad_clip": 1.0,
    "max_steps": None, "max_minutes": None,  # stop at whichever budget ends first
    "eval_every": 250,
    "eval_tokens": 1 << 20,         # held-out tokens per evaluation
    "save_every": 500, "log_every": 50, "seed": 0, "device": "auto",
    "out": None, "max_shard_mb": 16,  # the export: default RUN/model, shards of 16 MB
}

# Options that may change when a run is resumed: the budget, the intervals, the device, the
# export, and where the drafter's generated sequences are (the file may move; the drafter
# refuses a switch from corpus text). Every other option shapes the batches, the LR
# schedule or the evaluation, so a resumed run keeps the value it was started with and
# refuses another one.
SESSION_OPTIONS = {"max_steps", "max_minutes", "eval_every", "save_every", "log_every", "device",
                   "out", "max_shard_mb", "dtype", "tau_prompts", "tau_new_tokens", "generated"}


@dataclass
class TrainOptions:
    """Optimization and bookkeeping settings. A field left None is unset: a fresh run takes
    the default (`DEFAULT_OPTIONS`, `drafter.DRAFTER_OPTIONS`), a resumed run the value it
    was started with (run.json)."""

    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    min_lr_ratio: float | None = None
    warmup_steps: int | None = None
    weight_decay: float | None = None
    grad_clip: float | None = None
    max_steps: int | None = None
    max_minutes: float | None = None
    eval_every: int | None = None
    eval_tokens: int | None = None
    save_every: int | None = None
    log_every: int | None = None
    seed: int | None = None
    device: str | None = None

    @classmethod
    def of(cls, options: dict) -> "TrainOptions":
        """The TrainOptions fields of a settled options dict."""
        return cls(**{k: options[k] for k in cls.__dataclass_fields__})

    def validate(self) -> "TrainOptions":
        """Each value checked alone and named by its flag (the same keys in run.json)."""
        for key, kind in (("lr", "a number"), ("min_lr_ratio", "a number"), ("weight_decay", "a number"),
                          ("grad_clip", "a number"), ("max_minutes", "a number"), ("warmup_steps", "an integer"),
                          ("device", "a device name")):  # eval_tokens: with the counts below
            value = getattr(self, key)  # types first: a hand-edited run.json holds anything
            ok = isinstance(value, str) if key == "device" else not isinstance(value, bool) and isinstance(
                value, int if kind == "an integer" else (int, float))
            if value is not None and not ok:
                raise UsageError(f"{flag(key)} must be {kind}, got {value!r}")
        if self.max_steps is None and self.max_minutes is None:
            raise UsageError("give a training budget: --max-steps or --max-minutes")
        for key in ("batch_size", "seq_len", "eval_every", "save_every", "log_every", "eval_tokens"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{flag(key)} must be an integer >= 1, got {value!r}")
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int)
                                           or self.max_steps < 1):  # 0 exported untrained weights as a success
            raise UsageError(f"--max-steps must be an integer >= 1, got {self.max_steps!r}")
        if self.seq_len < 2:  # a model of a one-token context can take no prompt and answer it
            raise UsageError(f"--seq-len must be >= 2, got {self.seq_len}")
        # math.isfinite: a NaN passes every comparison's "not below"; inf minutes never end
        if self.max_minutes is not None and not (self.max_minutes > 0 and math.isfinite(self.max_minutes)):
            raise UsageError(f"--max-minutes must be a finite number > 0, got {self.max_minutes!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UsageError(f"--lr must be a finite number > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UsageError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps < 0:
            raise UsageError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        for key in ("weight_decay", "grad_clip"):
            if not (getattr(self, key) >= 0 and math.isfinite(getattr(self, key))):
                raise UsageError(f"{flag(key)} must be a finite number >= 0, got {getattr(self, key)}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63 - 1:
            raise UsageError(f"--seed must be an integer in [0, 2^63 - 1), got {self.seed!r}")
        return self


def flag(key: str) -> str:
    """The command-line flag of an option (max_steps: --max-steps)."""
    return "--" + key.replace("_", "-")


def check_trainable(cfg: ModelConfig, device: torch.device, what: str, embeddings: bool = True) -> None:
    """Refuse a shape whose float32 weights, gradients and Adam moments (16 bytes a
    parameter) would not fit in the memory free on `device`, before anything is built: a
    shape flag off by a few zeros would otherwise allocate until the OS killed the run.
    Counts the attention and MLP weights of every layer, and the embeddings (and an untied
    LM head) unless the model borrows them (a drafter)."""
    per_layer = cfg.hidden_size * (cfg.head_dim * 2 * (cfg.num_heads + cfg.num_kv_heads) + 3 * cfg.intermediate_size)
    params = cfg.num_layers * per_layer
    if embeddings:
        params += cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    need, have = 16 * params, available_bytes(device)
    if have is not None and need > have:
        raise UsageError(f"{what} has about {params:,} parameters: training them takes about {need / 2**30:,.1f} "
                         f"GiB (float32 weights, gradients and Adam moments), more than the {have / 2**30:,.1f} "
                         f"GiB free on {device}")


def check_logits_fit(rows: int, vocab_size: int, device: torch.device, what: str) -> None:
    """Refuse a batch whose float32 logits over the vocabulary, with their softmax and
    gradient (12 bytes a logit), would not fit in the memory free on `device`: a
    --batch-size off by a few zeros was killed by the OS after minutes, with no message."""
    need, have = 12 * rows * vocab_size, available_bytes(device)
    if have is not None and need > have:
        raise UsageError(f"{what} computes {rows:,} rows of {vocab_size:,} logits a step: about "
                         f"{need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB free on {device}")


def autocast(device: torch.device):
    """bf16 autocast on CUDA (weights and optimizer stay float32); plain float32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor to `device` without a sync: a plain copy from pageable memory would wait
    for the GPU queue to drain every step."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@contextlib.contextmanager
def tf32_products(device: torch.device):
    """TF32 float32 products while training on a GPU, put back afterwards: float32
    inference later in the same process (tests, the drafter's τ) keeps float32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def init_weights(model: nn.Module, num_layers: int, std: float = 0.02) -> None:
    """GPT-2 style: N(0, std) for matrices and embeddings, std/sqrt(2L) for the projections
    that write into the residual stream (o_proj, down_proj), ones for norms."""
    residual_std = std / math.sqrt(2 * num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, residual_std)
            else:
                p.normal_(0.0, std)


def make_optimizer(model: nn.Module, opts: TrainOptions, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms or biases)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opts.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


def abs_path(path: str | Path | None, option: str) -> str | None:
    """A path as run.json keeps it: absolute, so a resume from another folder finds it
    (`option` names it if it is empty: Path("") is the current folder, never what was meant)."""
    if path is not None and not str(path).strip():
        raise UsageError(f"{option} is empty: give a path")
    return None if path is None else str(Path(path).resolve())


def within(path: Path, folder: Path) -> bool:
    """`path` is `folder` or lies inside it (both resolved)."""
    return path == folder or folder in path.parents


def check_out_dir(path: str | Path | None, keep: dict[str, str | Path] | None = None,
                  run: str | Path | None = None) -> None:
    """Refuse an export folder before training rather than after: one that cannot be made or
    written, one that is, holds or lies inside an input folder (`keep`: e.g. {"target":
    target_dir}: an export there would overwrite its files), or one that is or holds the
    run folder (`run`; a folder inside it, such as the default RUN/model, is fine)."""
    if path is None:
        return
    out = Path(abs_path(path, "--out"))
    for what, folder in (keep or {}).items():
        folder = Path(folder).resolve()
        if out == folder:
            raise UsageError(f"output folder {path} is the {what} folder: the export would overwrite "
                             f"its files; choose another --out")
        if within(out, folder) or within(folder, out):
            where = "is inside" if within(out, folder) else "holds"
            raise UsageError(f"output folder {path} {where} the {what} folder {folder}: choose another --out")
    if run is not None and within(Path(run).resolve(), out):
        where = "is" if Path(run).resolve() == out else "holds"
        raise UsageError(f"output folder {path} {where} the run folder {run}: choose another --out "
                         f"(default: RUN/model)")
    # the folder itself where it exists, and where it is made (an export is written beside it)
    for p in ([out] if out.exists() else []) + [_made_in(out)]:
        check_writable(p, f"output folder {path}")


def _made_in(folder: Path) -> Path:
    """The nearest existing folder above `folder`: where mkdir(parents=True) makes it."""
    return next((p for p in folder.parents if p.exists()), folder)


def check_writable(folder: Path, what: str) -> None:
    """Refuse, before any work, a folder that files cannot be made in (`what` names it in
    the error): otherwise a run fails with a raw OS error once its inputs are loaded."""
    if not folder.is_dir():
        raise UsageError(f"{what}: {folder} exists and is not a folder")
    try:
        probe_write(folder)
    except OSError as e:
        raise UsageError(f"{what}: cannot write in {folder} ({e.strerror or e})") from None


def check_export_dir(out: Path, run: "RunDir") -> None:
    """An export replaces only this run's own earlier export (its --out, or RUN/model): a
    folder that holds anything else, another model say, is refused rather than overwritten."""
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not held:
        return
    if run.resume:  # the --out it last exported to, or its own RUN/model (one it may come back to)
        earlier = run.saved_options.get("out")
        if out.resolve() in {(run.path / "model").resolve(), *([Path(earlier).resolve()] if earlier else [])}:
            return
    raise UsageError(f"output folder {out} is not empty ({', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): "
                     f"an export would replace its files; choose a new or empty folder, or remove it")


def refuse_model_folder(out: str | Path, what: str) -> None:
    """`what` (a tokenizer, a corpus) written into a model's folder would silently no longer
    match its weights: refused."""
    out = Path(out)
    if out.is_dir() and ((out / "config.json").exists() or any(out.glob("*.safetensors"))):
        raise UsageError(f"output folder {out} holds a model (config.json or weights): {what} written there "
                         f"would no longer match it; choose another folder")


def check_shard_mb(value) -> None:
    """The export's shard size, checked before training rather than at the export."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise UsageError(f"--max-shard-mb must be a finite number > 0, got {value!r}")


def _settle(given: dict, saved: dict, defaults: dict, fixed: set[str]) -> dict:
    """`given` with its unset (None) values taken from `saved`, else from `defaults`; a set
    value of a `fixed` key must equal the saved one."""
    out = {}
    for k, v in given.items():
        if v is None:
            out[k] = saved[k] if k in saved else defaults.get(k)
        elif k in fixed and k in saved and saved[k] != v:
            raise UsageError(f"--resume: {k} = {v!r} differs from the run's {saved[k]!r} "
                             f"(leave it out to keep the run's)")
        else:
            out[k] = v
    return out


class RunDir:
    """A training run's folder. A fresh run refuses a folder that already holds state (so a
    finished run is never overwritten by accident); `resume` requires one. `run.json` keeps
    the model spec and the options, so that a resumed run goes on as it started."""

    def __init__(self, path: str | Path, resume: bool, kind: str):
        self.path, self.resume, self.kind = Path(path), resume, kind
        self.saved: dict = {}
        check_writable(self.path if self.path.exists() else _made_in(self.path.resolve()), f"run folder {self.path}")
        if resume and not self.state_path.exists():
            raise UsageError(f"--resume: no training state in {self.path} (state.pt not found)")
        if not resume and self.state_path.exists():
            raise UsageError(f"{self.path} already holds a training run: pass --resume to continue it, "
                             f"or choose another run folder")
        if resume:
            try:
                self.saved = json.loads(self.spec_path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise TreeflashError(f"cannot read {self.spec_path}: {e}") from None
            if not isinstance(self.saved, dict) or "kind" not in self.saved:
                raise TreeflashError(f"{self.spec_path} is damaged: not a run.json that treeflash wrote")
            if self.saved["kind"] != kind:
                raise UsageError(f"{self.path} is a {self.saved['kind']} run, not a {kind} run")
            options = self.saved.get("options")
            paths = ("out", "generated", "dtype")  # strings or null; the numbers are checked by TrainOptions
            if options is not None and (not isinstance(options, dict) or any(
                    options.get(k) is not None and not isinstance(options[k], str) for k in paths)):
                raise TreeflashError(f"{self.spec_path} is damaged: its options are not what treeflash wrote")

    state_path = property(lambda self: self.path / "state.pt")
    spec_path = property(lambda self: self.path / "run.json")
    log_path = property(lambda self: self.path / "log.jsonl")
    plot_path = property(lambda self: self.path / "loss.png")
    summary_path = property(lambda self: self.path / "summary.json")

    @property
    def saved_options(self) -> dict:
        """The options the run was started with ({} for a fresh run, or one from before
        run.json kept them)."""
        return self.saved.get("options") or {}

    def settle_spec(self, spec: dict, defaults: dict) -> dict:
        """The model spec: `spec` (None: unset) over the defaults, or over the resumed run's
        spec, which every value set in `spec` must match."""
        saved = {k: v for k, v in self.saved.items() if k not in ("kind", "options")}
        return _settle(spec, saved, defaults, set(spec))

    def bind(self, key: str, value: str, why: str) -> str:
        """A resumed run must go on with the input that `value` identifies (a hash of the
        corpus' tokenizer, of the target): the run records it in run.json."""
        if self.resume and self.saved.get(key) not in (None, value):
            raise UsageError(f"--resume: {why}")
        return value

    def settle_options(self, options: dict, defaults: dict) -> dict:
        """The options: `options` (None: unset) over the defaults, or over the resumed run's.
        A resumed run refuses another value of an option outside SESSION_OPTIONS; a budget
        given on resume replaces the run's (both limits), else the run's budget holds."""
        saved = self.saved_options
        if options.get("max_steps") is not None or options.get("max_minutes") is not None:
            saved = {k: v for k, v in saved.items() if k not in ("max_steps", "max_minutes")}
        return _settle(options, saved, defaults, set(options) - SESSION_OPTIONS)

    def begin(self, spec: dict, options: dict) -> None:
        """Create the folder and write run.json (a resumed run records this session's budget,
        intervals and export, for the next resume)."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not self.resume:
            self.log_path.unlink(missing_ok=True)  # left by a fresh run that died before its first save
        tmp = self.spec_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"kind": self.kind, **spec, "options": options}, indent=2))
        os.replace(tmp, self.spec_path)

    def save_state(self, state: dict) -> None:
        tmp = self.state_path.with_suffix(".pt.tmp")
        try:
            torch.save(state, tmp)
        except BaseException:  # a second Ctrl-C, a full disk: the last whole state stays, alone
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.state_path)  # never leave a half-written state behind

    def load_state(self) -> dict:
        try:
            with warnings.catch_warnings():  # torch warns in several lines about what it can read
                warnings.simplefilter("ignore")
                return torch.load(self.state_path, map_location="cpu", weights_only=True)
        except Exception as e:
            # not torch's message: it is several lines and suggests weights_only=False
            raise TreeflashError(f"cannot read training state {self.state_path}: damaged, or not a treeflash "
                                 f"training state ({type(e).__name__})") from None

    def rewrite_log(self, history: list[dict]) -> None:
        """log.jsonl as the saved state knows it: a run that died after its last save logged
        steps that the resumed run repeats."""
        tmp = self.log_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in history))
        os.replace(tmp, self.log_path)

    def log(self, record: dict) -> None:
        with self.log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")


class Progress:
    """A tqdm bar on a terminal; plain log lines (every `log_every` steps) elsewhere, e.g. in
    a remote job's captured output."""

    def __init__(self, desc: str, total: int | None, initial: int):
        self.desc = desc
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def show(self, metrics: dict) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in metrics.items()})
        else:
            self.write(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in metrics.items()))

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(f"[{self.desc}] {line}")
        else:
            print(f"[{self.desc}] {line}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def plot_history(history: list[dict], path: Path, title: str) -> bool:
    """Training and held-out loss against steps, as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train), label="train", linewidth=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="held-out", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


class Trainer:
    """The loop both trainers share. `batch_loss(gen)` draws a batch with the data generator
    `gen` (saved with the state, so a resumed run continues the same sample stream) and returns
    (loss, tokens); `evaluate()` returns held-out metrics with `eval_loss` (called in eval
    mode, no grad). The model ends with the weights of the best evaluation: a fixed time
    budget over a small corpus can overfit, and the held-out loss says when."""

    def __init__(self, name: str, run: RunDir, model: nn.Module, opts: TrainOptions, device: torch.device):
        self.name, self.run, self.model, self.opts, self.device = name, run, model, opts, device
        self.optimizer = make_optimizer(model, opts, device)
        self.gen = torch.Generator().manual_seed(opts.seed + 1)
        self.step, self.elapsed, self.history = 0, 0.0, []
        # the summed loss of the steps since the last log line (saved: a run stopped between
        # log lines logs, once resumed, the mean an uninterrupted run would have)
        self.loss_sum, self.loss_steps = torch.zeros(()), 0
        self.best = None  # (metrics, CPU copy of the weights) of the best evaluation
        self._plot_note = False
        if run.resume:
            self._restore(run.load_state())

    STATE_KEYS = ("step", "elapsed", "history", "model", "optim", "gen", "torch_rng")

    def _restore(self, state: dict) -> None:
        missing = [k for k in self.STATE_KEYS if k not in state] if isinstance(state, dict) else ["all"]
        if missing:  # a file torch can read, but not one `_save` wrote
            raise TreeflashError(f"training state {self.run.state_path} is not a treeflash training state "
                                 f"(missing: {', '.join(missing)})")
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            lines = [line.strip() for line in str(e).splitlines() if line.strip()] or ["?"]
            why = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]  # torch's heading, then what
            raise TreeflashError(f"training state in {self.run.path} does not fit this model: {why}") from None
        try:
            self.gen.set_state(state["gen"])
            torch.set_rng_state(state["torch_rng"])
            if self.device.type == "cuda" and state.get("cuda_rng") is not None:
                torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        except (RuntimeError, TypeError) as e:
            raise TreeflashError(f"training state {self.run.state_path}: damaged random-number state "
                                 f"({str(e).splitlines()[0]})") from None
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0 or \
                isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)) or \
                not 0 <= elapsed < math.inf or not isinstance(history, list) or \
                not all(isinstance(r, dict) and isinstance(r.get("step"), int) for r in history):
            raise TreeflashError(f"training state {self.run.state_path} is damaged: its step, elapsed time or "
                                 f"loss history is not what `_save` writes")
        self.step, self.elapsed, self.history = step, elapsed, history
        self.run.rewrite_log(self.history)
        if "loss_sum" in state:  # absent in states of older runs: the log starts anew
            loss_sum, loss_steps = state["loss_sum"], state.get("loss_steps")
            if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1 or \
                    isinstance(loss_steps, bool) or not isinstance(loss_steps, int) or loss_steps < 0:
                raise TreeflashError(f"training state {self.run.state_path} is damaged: its pending loss is not "
                                     f"what `_save` writes")
            self.loss_sum, self.loss_steps = loss_sum.reshape(()), loss_steps
        self.best = (state["best_metrics"], state["best_model"]) if state.get("best_model") else None
        metrics, weights = self.best or ({}, {})
        if self.best is not None and not (isinstance(metrics, dict) and isinstance(weights, dict)
                                          and isinstance(metrics.get("eval_loss"), (int, float))
                                          and isinstance(metrics.get("best_step"), int)):
            raise TreeflashError(f"training state {self.run.state_path} is damaged: its best model's metrics are "
                                 f"not what `_save` writes")

    def _save(self) -> None:
        self.run.save_state({
            "step": self.step, "elapsed": self.elapsed, "history": self.history,
            "model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
            "gen": self.gen.get_state(), "torch_rng": torch.get_rng_state(),
            "loss_sum": self.loss_sum.detach().cpu(), "loss_steps": self.loss_steps,
            "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "best_metrics": self.best[0] if self.best else None, "best_model": self.best[1] if self.best else None,
        })

    def progress(self) -> float:
        """Fraction of the budget used: steps or wall-clock time, whichever is further along."""
        o = self.opts
        p = 0.0
        if o.max_steps is not None:
            p = max(p, self.step / o.max_steps if o.max_steps else 1.0)
        if o.max_minutes is not None:
            p = max(p, self.elapsed / (60 * o.max_minutes))
        return min(p, 1.0)

    def lr(self) -> float:
        o = self.opts
        warm = min(1.0, (self.step + 1) / o.warmup_steps) if o.warmup_steps else 1.0
        cos = 0.5 * (1 + math.cos(math.pi * self.progress()))
        return o.lr * warm * (o.min_lr_ratio + (1 - o.min_lr_ratio) * cos)

    def _record(self, record: dict, bar: Progress) -> None:
        record = {"step": self.step, **record, "elapsed_s": round(self.elapsed, 2)}
        self.history.append(record)
        self.run.log(record)
        bar.show({k: v for k, v in record.items() if k != "elapsed_s"})

    def _evaluate(self, evaluate: Callable[[], dict], bar: Progress) -> dict:
        self.model.eval()
        with torch.no_grad(), autocast(self.device):
            metrics = evaluate()
        self.model.train()
        self._record(metrics, bar)
        if not math.isfinite(metrics["eval_loss"]):  # diverged weights: never "best", never exported
            raise TreeflashError(f"{self.name}: held-out loss became {metrics['eval_loss']} at step {self.step}; "
                                 f"try a lower learning rate")
        if self.best is None or metrics["eval_loss"] <= self.best[0]["eval_loss"]:
            weights = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
            self.best = ({**metrics, "best_step": self.step}, weights)
        return metrics

    def fit(self, batch_loss: Callable[[torch.Generator], tuple[torch.Tensor, int]],
            evaluate: Callable[[], dict]) -> dict:
        """Train until the budget is used; load the best evaluated weights and return their
        metrics (with `best_step`, and `final_eval_loss` of the last step)."""
        with tf32_products(self.device):
            return self._fit(batch_loss, evaluate)

    def _fit(self, batch_loss, evaluate) -> dict:
        o = self.opts
        bar = Progress(self.name, o.max_steps, self.step)
        if self.run.resume:
            bar.write(f"resuming at step {self.step} ({self.elapsed / 60:.2f} min done)")
            if o.max_steps is not None and self.step > o.max_steps:
                bar.write(f"note: the run is past --max-steps {o.max_steps}: nothing to train; its weights are "
                          f"exported")
        self.model.train()
        start = time.perf_counter() - self.elapsed
        self.loss_sum = self.loss_sum.to(self.device, torch.float32)
        tokens, t_log = 0, time.perf_counter()  # since t_log, in this process
        with interrupt_at_step_end() as interrupted:
            while self.progress() < 1.0:
                lr = self.lr()
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                with autocast(self.device):
                    loss, ntok = batch_loss(self.gen)
                loss.backward()
                if o.grad_clip:
                    nn.utils.clip_grad_norm_(self.model.parameters(), o.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.step += 1
                self.elapsed = time.perf_counter() - start
                self.loss_sum += loss.detach().float()
                self.loss_steps, tokens = self.loss_steps + 1, tokens + ntok
                bar.step()
                last = self.progress() >= 1.0
                if self.step % o.log_every == 0 or last:
                    mean = (self.loss_sum / self.loss_steps).item()
                    if not math.isfinite(mean):
                        raise TreeflashError(f"{self.name}: loss became {mean} at step {self.step}; "
                                             f"try a lower learning rate")
                    now = time.perf_counter()
                    self._record({"loss": round(mean, 5), "lr": float(f"{lr:.4g}"),
                                  "tok_per_s": round(tokens / max(now - t_log, 1e-9))}, bar)
                    self.loss_sum.zero_()
                    self.loss_steps, tokens, t_log = 0, 0, now
                if self.step % o.eval_every == 0 and not last:
                    self._evaluate(evaluate, bar)
                    self._plot()
                    t_log, tokens = time.perf_counter(), 0
                if self.step % o.save_every == 0 and not last:
                    self._save()
                self.elapsed = time.perf_counter() - start
                if interrupted():  # Ctrl-C: keep this step, then stop
                    self._save()
                    self._stop(bar)
            if o.warmup_steps and 0 < self.step <= o.warmup_steps:  # (--max-steps or --max-minutes ran out)
                bar.write(f"note: the run ended at step {self.step}, within its {o.warmup_steps} warmup steps: its "
                          f"learning rate never reached --lr {o.lr:g} (give fewer --warmup-steps)")
            final = self.history[-1] if self.history else {}
            if "eval_loss" not in final or final["step"] != self.step or self.best is None:
                # else a finished run, resumed: its last evaluation stands. The last step is
                # saved first: a second Ctrl-C during a long evaluation loses none of it
                self._save()
                final = self._evaluate(evaluate, bar)
                self._save()  # with the evaluation: a resumed run does not repeat it
                self._plot()
            if interrupted():  # Ctrl-C during the last evaluation: it finished and is saved
                self._stop(bar)
        best, weights = self.best
        if best["best_step"] != self.step:
            self.model.load_state_dict(weights)
            bar.write(f"keeping the weights of step {best['best_step']} (held-out loss {best['eval_loss']:.4f}, "
                      f"last {final['eval_loss']:.4f})")
        bar.close()
        return {**best, "final_eval_loss": final["eval_loss"]}

    def _stop(self, bar: "Progress") -> None:
        bar.write(f"interrupted: the state of step {self.step} is saved in {self.run.path} "
                  f"(--resume goes on from it)")
        bar.close()
        raise KeyboardInterrupt

    def _plot(self) -> None:
        if not plot_history(self.history, self.run.plot_path, f"{self.name} loss") and not self._plot_note:
            print(f"[{self.name}] note: matplotlib is not installed; no loss curve PNG", flush=True)
            self._plot_note = True


# --- Hugging Face export -------------------------------------------------------------------

def hf_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names, fused qkv_proj / gate_up_proj split back
    into q/k/v_proj and gate/up_proj. Tied (shared) parameters appear once."""
    merged = getattr(model, "merged_weights", {})
    out = {}
    for name, p in model.named_parameters():
        module_name, _, leaf = name.rpartition(".")
        prefix, _, local = module_name.rpartition(".")
        if local in merged:
            owner = model.get_submodule(module_name)
            for part, piece in zip(merged[local], p.detach().split(owner.parts, dim=0)):
                out[f"{prefix}.{part}.{leaf}" if prefix else f"{part}.{leaf}"] = piece
        else:
            out[name] = p.detach()
    return out


@contextlib.contextmanager
def interrupt_at_step_end():
    """Ctrl-C while training is taken where the step it arrives in ends (`Trainer` saves
    that step there: nothing trained is lost, and a resume stays exact); a second Ctrl-C
    interrupts at once. Only in the main thread (where Python runs signal handlers), and
    not where SIGINT is ignored."""
    asked: list[bool] = []
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield lambda: False
        return

    def ask(signum, frame):
        if asked:
            raise KeyboardInterrupt
        asked.append(True)
    signal.signal(signal.SIGINT, ask)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def exporting(out: Path):
    """A folder to write an export into, which takes `out`'s place only once complete: an
    interrupted export leaves the earlier one whole (never weights without config.json, or
    shards of two exports)."""
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    for left in out.parent.glob(f".{glob.escape(out.name)}.export-*"):  # by processes that died exporting
        if left == tmp or not _alive(left.name.rpartition("-")[2]):
            shutil.rmtree(left, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        old = out.parent / f".{out.name}.replaced-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: str) -> bool:
    """Whether a process of this id runs on this host (its export is under way)."""
    if not pid.isdigit():
        return True  # not a folder of ours: left alone
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process, or no pid of this host's range
        pass
    return True


def save_safetensors(tensors: dict[str, torch.Tensor], folder: Path, dtype: torch.dtype,
                     max_shard_bytes: int = 16 * MiB) -> list[Path]:
    """Write `model.safetensors`, or HF-style shards `model-0000i-of-0000n.safetensors` of at
    most `max_shard_bytes` each plus `model.safetensors.index.json` when the weights are larger."""
    for old in list(folder.glob("model*.safetensors")) + [folder / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # stale shards of an earlier export would confuse loaders
    tensors = {k: v.to("cpu", dtype).contiguous().clone() for k, v in tensors.items()}
    budget = max_shard_bytes - min(64 << 10, max_shard_bytes // 8)  # room for the JSON header
    shards, size = [{}], 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if shards[-1] and size + nbytes > budget:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    paths, weight_map = [], {}
    for name, shard in zip(names, shards):
        path = folder / name
        save_file(shard, str(path), metadata={"format": "pt"})
        path.chmod(0o644)  # safetensors creates files readable by their owner only
        paths.append(path)
        weight_map.update({k: name for k in shard})
    if len(shards) == 1:
        return paths
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths


def write_summary(run: RunDir, summary: dict) -> None:
    run.summary_path.write_text(json.dumps(summary, indent=2))
