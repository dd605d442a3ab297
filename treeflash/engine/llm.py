"""The user-facing API: `LLM(model, draft_model=..., method=...).generate(prompts, params)`."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treeflash.config import DTYPES, DraftConfig, ModelConfig
from treeflash.engine.round import METHODS, GraphedRound, SpeculativeDecoder
from treeflash.engine.sampling import SamplingBatch, SamplingParams
from treeflash.errors import TreeflashError, UsageError
from treeflash.models.dflash import DFlashDraftModel
from treeflash.models.loader import build_on, load_weights
from treeflash.models.transformer import CausalLM
from treeflash.tokenizer import Tokenizer

DEFAULT_BUDGET = 64
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin"


@dataclass
class GenerationOutput:
    text: str
    token_ids: list[int]
    finish_reason: str           # "stop" (EOS or stop string) or "length"
    stats: dict = field(default_factory=dict)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"unknown device '{device}' (choose auto, cpu or cuda)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("device 'cuda' requested but no CUDA GPU is available")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None, device: torch.device) -> torch.dtype:
    """`auto` = the checkpoint's dtype, except float32 on CPU for bf16/fp16 checkpoints
    (CPU half-precision matmuls are slow and not what a user testing on a laptop wants)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise UsageError(f"unknown dtype '{dtype}' (choose auto, {', '.join(sorted(set(DTYPES)))})")
        return DTYPES[dtype]
    chosen = DTYPES.get(str(checkpoint_dtype or "float32").replace("torch.", ""), torch.float32)
    if device.type == "cpu" and chosen in (torch.bfloat16, torch.float16):
        return torch.float32
    return chosen


def triton_available() -> bool:
    try:
        import treeflash.kernels.tree_attention  # noqa: F401
        return True
    except ImportError:
        return False


def builtin_paths() -> tuple[Path, Path]:
    target, drafter = BUILTIN_DIR / "target", BUILTIN_DIR / "drafter"
    if not (target / "config.json").exists():
        raise TreeflashError("no --model given and the built-in model is not installed")
    return target, drafter


class LLM:
    """A target model, optionally with a DFlash drafter, ready to generate.

    method: 'ar', 'dflash' or 'ddtree' (default: 'ddtree' with a drafter, else 'ar').
    budget: DDTree nodes per round (default 64); must fit `max_budget`, the tree room
    reserved in the KV cache.
    """

    def __init__(self, model: str | Path | None = None, draft_model: str | Path | None = None,
                 method: str | None = None, budget: int | None = None, device: str = "auto",
                 dtype: str | torch.dtype = "auto", max_model_len: int | None = None,
                 max_budget: int = 512, tp: int = 1, cuda_graphs: bool = True, draft_mode: str = "scaled"):
        if model is None:
            model, builtin_draft = builtin_paths()
            if draft_model is None and (builtin_draft / "config.json").exists():
                draft_model = builtin_draft
        if tp != 1:
            raise UsageError("tensor parallelism (tp > 1) is not available in this build")
        self.device = resolve_device(device)
        self.config = ModelConfig.from_pretrained(model)
        self.dtype = resolve_dtype(dtype, self.config.torch_dtype, self.device)
        self.tokenizer = Tokenizer(model)
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids))
        with build_on(self.device, self.dtype):
            self.target = CausalLM(self.config)
        load_weights(self.target, model)
        self.target.eval()
        self.drafter = None
        if draft_model is not None:
            dcfg = DraftConfig.from_pretrained(draft_model)
            dcfg.check_fits(self.config)
            with build_on(self.device, self.dtype):
                self.drafter = DFlashDraftModel(dcfg)
            load_weights(self.drafter, draft_model)
            self.drafter.eval()
        method = method or ("ddtree" if self.drafter is not None else "ar")
        if method not in METHODS:
            raise UsageError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
        if method == "ddtree":
            budget = DEFAULT_BUDGET if budget is None else budget
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise UsageError(f"ddtree budget must be an integer >= 1, got {budget!r}")
            if budget > max_budget:
                raise UsageError(f"ddtree budget {budget} exceeds the {max_budget} tree nodes reserved "
                                 f"(raise max_budget)")
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                          or max_model_len < 2):
            raise UsageError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        backend = "triton" if self.device.type == "cuda" and triton_available() else "sdpa"
        self.decoder = SpeculativeDecoder(self.target, self.drafter, method, budget or 0,
                                          draft_mode=draft_mode, attention_backend=backend)
        self.method = method
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._graphed = None  # (key, state, GraphedRound) of the last graph captured

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise UsageError(f"token id {bad[0]} is outside the vocabulary of {self.config.vocab_size}")
        else:
            raise UsageError("a prompt must be a string or a list of token ids")
        if not ids:
            raise UsageError("empty prompt: give at least one token")
        if max(ids) >= self.config.vocab_size:
            raise TreeflashError(f"the tokenizer produced token id {max(ids)}, outside the model's vocabulary "
                                 f"of {self.config.vocab_size}: tokenizer and checkpoint do not match")
        if len(ids) >= self.max_model_len:
            raise TreeflashError(f"prompt of {len(ids)} tokens does not fit the context limit of "
                                 f"{self.max_model_len} tokens")
        return ids

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 on_tokens=None) -> list[GenerationOutput]:
        """Generate for a batch of prompts (strings or token-id lists).

        `on_tokens(i, new_ids)` is called as request i commits tokens (for streaming).
        """
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                               and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        if not prompts:
            return []
        params = sampling_params or SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise UsageError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        for p in params:
            p.validate()
        ids = [self.encode(p) for p in prompts]
        limits = [min(p.max_new_tokens, self.max_model_len - len(i)) for p, i in zip(params, ids)]
        max_len = max(len(i) + m for i, m in zip(ids, limits)) + 2 * self.decoder.tree_slots + 2
        start = time.perf_counter()
        dec = self.decoder
        st, run_round = self._runner(len(ids), max_len, SamplingBatch.from_params(params, self.device))
        dec.prefill(st, ids)
        outs = [[] for _ in ids]
        rounds = [1] * len(ids)
        done = [False] * len(ids)
        reasons = ["length"] * len(ids)
        new = st.anchor[:, None].tolist()
        counts = [1] * len(ids)
        while True:
            for b in range(len(ids)):
                if done[b] or counts[b] == 0:
                    continue
                before = len(outs[b])
                stop = self._accept(new[b][:counts[b]], outs[b], params[b], limits[b])
                if params[b].stop and self._cut_at_stop_string(outs[b], before, params[b].stop):
                    stop = "stop"
                if on_tokens is not None and len(outs[b]) > before:
                    on_tokens(b, outs[b][before:])
                if stop:
                    done[b], reasons[b] = True, stop
            if all(done):
                break
            if any(done):
                st.active.copy_(torch.tensor([not d for d in done]))
            if st.max_n is not None:
                st.max_n = max(len(i) + len(o) for i, o in zip(ids, outs))
            new_t, counts_t = run_round(st)
            new, counts = new_t.tolist(), counts_t.tolist()
            for b in range(len(ids)):
                rounds[b] += not done[b]
        seconds = time.perf_counter() - start
        results = []
        for b in range(len(ids)):
            text = self.tokenizer.decode(outs[b])
            hits = [text.find(x) for x in params[b].stop if x in text]
            text = text[:min(hits)] if hits else text
            n = len(outs[b])
            results.append(GenerationOutput(text, outs[b], reasons[b], {
                "method": self.method, "new_tokens": n, "rounds": rounds[b],
                "tau": round(n / rounds[b], 4), "seconds": round(seconds, 4),
                "tokens_per_s": round(n / seconds, 2) if seconds > 0 else None,
                **({"nodes_per_round": dec.budget} if self.method == "ddtree" else {}),
            }))
        return results

    def _runner(self, batch: int, max_len: int, sampling: SamplingBatch):
        """A batch state and the function that runs one round on it.

        With CUDA graphs, states are bucketed (cache length rounded up) and the captured
        round is kept for the next call with the same batch size, bucket and sampling
        mode; the sampling values are copied into the captured buffers.
        """
        if not self.cuda_graphs:
            return self.decoder.new_state(batch, max_len, sampling), self.decoder.round
        bucket = 1 << max(10, (max_len - 1).bit_length())
        key = (batch, bucket, sampling.any_sampled, sampling.any_filtered)
        if self._graphed is None or self._graphed[0] != key:
            self._graphed = None
            torch.cuda.empty_cache()
            st = self.decoder.new_state(batch, bucket, sampling)
            self._graphed = (key, st, GraphedRound(self.decoder, st))
        _, st, graph = self._graphed
        st.sampling.copy_(sampling)
        return st, graph

    def _accept(self, got: list[int], out: list[int], p: SamplingParams, limit: int) -> str | None:
        """Append committed tokens up to EOS / the token limit; return the stop reason."""
        for t in got:
            out.append(t)
            if not p.ignore_eos and t in self.eos_token_ids:
                return "stop"
            if len(out) >= limit:
                return "length"
        return None

    def _cut_at_stop_string(self, out: list[int], before: int, stops: list[str]) -> bool:
        """If a stop string appeared among the tokens added after `before`, drop every
        token after the one that completed it (as AR would have stopped there)."""
        if not any(x in self.tokenizer.decode(out) for x in stops):
            return False
        for k in range(before + 1, len(out) + 1):
            text = self.tokenizer.decode(out[:k])
            if any(x in text for x in stops):
                del out[k:]
                return True
        return False
