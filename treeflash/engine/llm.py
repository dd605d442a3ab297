"""The user-facing API: `LLM(model, draft_model=..., method=...).generate(prompts, params)`."""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import itertools
import numbers
import os
import random
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path

import torch

from treeflash.chat import NO_TEMPLATE, ChatFormat, ChatTemplate, checked_tools
from treeflash.config import DTYPES, FP8_BLOCK, DraftConfig, ModelConfig
from treeflash.distributed import TPGroup
from treeflash.engine.options import (attention_backend, builtin_paths, check_flag, check_int, resolve_device,
                                      resolve_dtype, tree_budget)
from treeflash.engine.pipeline import RoundPipeline
from treeflash.engine.tokenizer_view import TokenizerView
from treeflash.engine.requests import (GenerationOutput, RequestRules, TokenLogprob, prompt_token_logprobs,
                                       token_logprobs)
from treeflash.engine.round import DRAFT_MODES, METHODS, BatchState, SpeculativeDecoder
from treeflash.engine.sampling import SamplingBatch
from treeflash.engine.states import GRAPHED_PREFILL_MAX, KeptStates, suffix_chunks
from treeflash.engine.tp import attach as tp_attach, closed_error
from treeflash.errors import ContextLengthError, TreeflashError, UsageError, is_text, shown
from treeflash.models.dflash import DFlashDraftModel
from treeflash.models.loader import (build_on, check_model_size, check_sizes, load_weights, stored_shapes,
                                     weights_dtype)
from treeflash.models.transformer import CausalLM
from treeflash.files import model_folder, tokenizer_settings
from treeflash.memory import check_weights_fit, peak_rss_bytes, reset_peak_rss, rss_bytes
from treeflash.sampling_params import (MAX_LOGPROBS, SamplingParams, generation_defaults, generation_folder,
                                       truncation_error)
from treeflash.tokenizer import Tokenizer


def _arguments_taken(callback, name: str, forms: tuple[str, ...]) -> int | None:
    """How many positional arguments `callback` takes, the first of `forms` (argument
    lists, longest first) it can be called with; None where its signature cannot be
    read (it is called as documented). One that takes none of them is refused here,
    in one line, not by a TypeError from inside `generate`."""
    if not callable(callback):
        raise UsageError(f"{name} must be a function, got {type(callback).__name__}")
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):
        return None
    for form in forms:
        count = len(form.split(","))
        try:
            signature.bind(*range(count))
            return count
        except TypeError:
            continue
    raise UsageError(f"{name} must take the arguments {' or '.join(f'({f})' for f in forms)}, got {name}{signature}")


def _token_callback(on_tokens):
    """`on_tokens` as `generate` calls it, with (i, new_ids, new_logprobs): a callback
    that takes two arguments (written before logprobs existed) gets two."""
    if on_tokens is None or _arguments_taken(on_tokens, "on_tokens", ("i, new_ids, new_logprobs", "i, new_ids")) != 2:
        return on_tokens
    return lambda i, ids, _: on_tokens(i, ids)


def _checked_sampling_params(p) -> SamplingParams:
    """p, if it is SamplingParams (a dict or a string is a one-line error, not an AttributeError)."""
    if not isinstance(p, SamplingParams):
        raise UsageError(f"sampling parameters must be SamplingParams, got {type(p).__name__}")
    return p


def _shifted(callback, offset: int):
    """A per-request callback of a batch that starts at request `offset` of the call."""
    return callback if callback is None or offset == 0 else (lambda i, *rest: callback(i + offset, *rest))


class _PromptCount:
    """vLLM's `use_tqdm=True` without tqdm: a line on stderr that counts finished prompts."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.done = total, desc, 0

    def update(self, n: int = 1) -> None:
        self.done += n
        print(f"\r{self.desc}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.done:
            print(file=sys.stderr, flush=True)


def _progress_bar(use_tqdm, total: int):
    """The progress bar `generate` advances as each prompt finishes (None: none), as vLLM's
    `use_tqdm` asks: False, True (a count on stderr), or a tqdm-like class it makes with
    `total` and `desc` (its `update(1)` and `close()` are called)."""
    if use_tqdm is False:
        return None
    if use_tqdm is True:
        return _PromptCount(total, "Processed prompts")
    bar = use_tqdm(total=total, desc="Processed prompts")
    if not (callable(getattr(bar, "update", None)) and callable(getattr(bar, "close", None))):
        raise UsageError(f"use_tqdm made a {type(bar).__name__}, which has no update() and close() methods")
    return bar


def _advancing(bar, on_done):
    """`on_done` that advances the progress bar first."""
    def done(i: int, output) -> None:
        bar.update(1)
        if on_done is not None:
            on_done(i, output)
    return done


@dataclass
class _Request:
    """A request of the batch being generated, as the host follows it."""
    prompt: list[int]
    params: SamplingParams
    limit: int                      # new tokens at most (its max_new_tokens, within the context)
    committed: int                  # n on the device after the rounds read so far
    cached: int | None              # prompt tokens found in the caches (prefix caching)
    prompt_logprobs: list[TokenLogprob | None] | None
    logprobs: list[TokenLogprob] | None   # those of `out`, if asked
    text: str | None = None         # the prompt as given, if as text (the output's `prompt`)
    request_id: str = ""
    out: list[int] = field(default_factory=list)
    rounds: int = 1
    result: GenerationOutput | None = None  # once it has ended


@dataclass
class _Batch:
    """The batch in flight on this rank."""
    st: BatchState
    run_round: object      # (st, max_n) -> (new, counts, logprobs): `decoder.round` or a `GraphedRound`
    pipe: RoundPipeline
    active: list[bool]     # what st.active holds (as queued)


def _same_but_seed(a: SamplingParams, b: SamplingParams) -> bool:
    """Whether a and b ask the same but for their seeds (copies made by `with_seed` share
    their lists: no walk over a long allowed_token_ids)."""
    return all(x is y or x == y for f in fields(SamplingParams) if f.name != "seed"
               for x, y in [(getattr(a, f.name), getattr(b, f.name))])


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def _check_draft_mode_applies(method: str, draft_mode: str | None) -> None:
    if draft_mode is not None and method == "ar":
        raise UsageError("a draft mode applies to methods dflash and ddtree (method is ar)")


def _unwrapped(prompt):
    """A prompt as text or token ids: vLLM's TextPrompt {"prompt": text} and TokensPrompt
    {"prompt_token_ids": ids} give theirs (other keys, such as multi-modal data, are
    refused rather than dropped)."""
    if not isinstance(prompt, dict):
        return prompt
    if len(prompt) == 1 and next(iter(prompt)) in ("prompt", "prompt_token_ids"):
        key, value = next(iter(prompt.items()))
        if (key == "prompt") != isinstance(value, str):
            raise UsageError(f"a prompt dict's 'prompt' is text and its 'prompt_token_ids' a list of token ids, "
                             f"got {key!r}: {shown(value, 40)}")
        return value
    raise UsageError(f"a prompt dict holds one key, 'prompt' (text) or 'prompt_token_ids' (vLLM's TextPrompt "
                     f"and TokensPrompt), got {sorted(map(str, prompt))}")


MAX_BATCH = 256  # LLM's default max_batch

# vLLM LLM arguments with no counterpart here, and what this engine does instead
_VLLM_INSTEAD = {
    "gpu_memory_utilization": "caches are allocated per batch as it needs them, not as a share of the GPU up "
                              "front; max_batch and max_model_len bound them",
    "enable_chunked_prefill": "a batch's prompts are prefilled whole",
    "max_num_batched_tokens": "a batch's prompts are prefilled whole (max_batch bounds a batch)",
    "max_logprobs": f"SamplingParams.logprobs takes up to {MAX_LOGPROBS} alternatives",
    "kv_cache_dtype": "the caches hold the model's dtype",
    "speculative_config": "method, draft_model and budget choose the speculative decoding",
}


def _vllm_arguments(given: dict, model) -> None:
    """vLLM's LLM arguments beyond the ones `LLM` renames: trust_remote_code taken (a bool;
    no code from a checkpoint is ever run), tokenizer where it names the model's folder
    (the one this engine reads), the others refused in one line (a bare TypeError before)."""
    for name, value in given.items():
        if name == "trust_remote_code":
            check_flag(name, value)
        elif name == "tokenizer" and value is not None:
            if not isinstance(value, (str, Path)) or Path(model_folder(value)).resolve() != Path(model).resolve():
                raise UsageError(f"tokenizer must be None or the model's own folder: treeflash reads the tokenizer "
                                 f"files of the model's folder, got {shown(value)}")
        elif name != "tokenizer":
            raise UsageError(f"LLM has no argument {name!r}" +
                             (f" (vLLM's; not supported: {_VLLM_INSTEAD[name]})" if name in _VLLM_INSTEAD else ""))


def _vllm_name(ours: str, value, default, theirs: str, given):
    """An argument given under vLLM's name (`theirs`, as its value for `ours`): taken,
    unless `ours` was given too, with another value."""
    if value != default and value != given:
        raise UsageError(f"give {ours} or vLLM's {theirs}, not both (they say different things)")
    return given


class LLM:
    """A target model, optionally with a DFlash drafter, ready to generate.

    method: 'ar', 'dflash' or 'ddtree' (default: 'ddtree' with a drafter, else 'ar').
    draft_mode: how dflash and ddtree draft for sampled requests: 'coupled' (default) to
    the target's noise, or 'scaled' by the temperature (see `SpeculativeDecoder`).
    budget: DDTree nodes per round (default 63 on a GPU, 16 on a CPU), at most
    `max_budget` (a guard: a round holds [N+1, vocab] logits and an [N+1, N+1] mask per
    request).
    tp: tensor-parallel size. With tp > 1 this process is rank 0 (the driver) and
    starts tp - 1 worker processes (one per GPU, or gloo on CPU) that each hold a slice
    of the weights; see `treeflash.engine.tp`. Under torchrun, every rank calls `LLM`
    alike and only rank 0 returns. `close()` (or garbage collection, or exit) stops them.
    max_batch: the most prompts `generate` decodes at once (more go in turn; with prefix
    caching, all at once).
    enable_prefix_caching: a batch whose prompts begin with what a kept batch state of
    its size holds (a chat's next turn: the conversation so far, its last answer
    included) prefills only the rest, on those caches (copied into a larger state if the
    turn needs one), in chunks that replay CUDA graphs. The tokens are those of a
    prefill over the whole prompt up to rounding: a reused position's K/V came from the
    forward that committed it.
    quantization: "fp8" holds the target's layers (attention, MLPs, experts) in FP8 with
    128 x 128 blocks, quantized from a checkpoint in higher precision while loading, as
    an FP8 checkpoint would hold them (vLLM's `--quantization fp8`, with DeepSeek-V3's
    blocks); an FP8 checkpoint loads as it is either way.
    generation_config: "auto" (default) samples, where `generate` is given no parameters,
    with the values of the model's generation_config.json, as vLLM's; "none" (or vLLM's
    "vllm") ignores them: SamplingParams' defaults; a folder: its generation_config.json's.
    tensor_parallel_size, enforce_eager, max_num_seqs: vLLM's names for tp, not
    cuda_graphs and max_batch, so that code written for vLLM runs as it is; its
    trust_remote_code is taken (no code from a checkpoint is ever run), its tokenizer
    where it names the model's own folder; its other arguments are refused in words.
    seed: where the seeds of sampled requests that give none are drawn from, so that a
    script's runs repeat (vLLM's `seed`); None (default): fresh ones every run.
    """

    def __init__(self, model: str | Path | None = None, draft_model: str | Path | None = None,
                 method: str | None = None, budget: int | None = None, device: str = "auto",
                 dtype: str | torch.dtype = "auto", max_model_len: int | None = None,
                 max_budget: int = 512, tp: int = 1, cuda_graphs: bool = True, draft_mode: str | None = None,
                 enable_prefix_caching: bool = False, max_batch: int = MAX_BATCH, quantization: str | None = None,
                 generation_config: str = "auto", seed: int | None = None, *,
                 tensor_parallel_size: int | None = None, enforce_eager: bool | None = None,
                 max_num_seqs: int | None = None, _worker=None, **vllm_arguments):
        # _worker: a tensor-parallel worker's runtime, building its shard of the driver's engine
        if tensor_parallel_size is not None:
            tensor_parallel_size = check_int("tensor_parallel_size", tensor_parallel_size, 1)
            tp = _vllm_name("tp", tp, 1, "tensor_parallel_size", tensor_parallel_size)
        if enforce_eager is not None:
            check_flag("enforce_eager", enforce_eager)
            cuda_graphs = _vllm_name("cuda_graphs", cuda_graphs, True, "enforce_eager", not enforce_eager)
        if max_num_seqs is not None:
            max_num_seqs = check_int("max_num_seqs", max_num_seqs, 1)
            max_batch = _vllm_name("max_batch", max_batch, MAX_BATCH, "max_num_seqs", max_num_seqs)
        max_batch = check_int("max_batch", max_batch, 1)
        if seed is not None:
            seed = check_int("seed", seed, 0)
        self._seeds = random.Random(seed)  # the seeds of sampled requests that give none
        self._request_ids = itertools.count()  # vLLM's request_id: requests numbered in order, from 0
        self.max_batch = max_batch
        self._generating = threading.RLock()
        self._decoding = False  # inside `generate`: a callback that calls it again is refused
        for name, path in (("model", model), ("draft_model", draft_model)):
            if path is not None and not isinstance(path, (str, Path)):
                raise UsageError(f"{name} must be a folder path, got {path!r}")
        model, draft_model = model_folder(model), model_folder(draft_model)  # or a hub id, from its cache
        max_budget = check_int("max_budget", max_budget, 1)
        self.max_budget = max_budget
        if method is not None and (not isinstance(method, str) or method not in METHODS):
            raise UsageError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
        if draft_mode is not None and (not isinstance(draft_mode, str) or draft_mode not in DRAFT_MODES):
            raise UsageError(f"unknown draft mode {draft_mode!r} (choose from {', '.join(DRAFT_MODES)})")
        check_flag("cuda_graphs", cuda_graphs)
        if model is None:
            model, builtin_draft = builtin_paths()
            if draft_model is None and method != "ar" and (builtin_draft / "config.json").exists():
                draft_model = builtin_draft
        _vllm_arguments(vllm_arguments, model)
        check_flag("enable_prefix_caching", enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        tp = check_int("tp", tp, 1)
        if quantization not in (None, "fp8"):
            raise UsageError(f"unknown quantization {quantization!r} (supported: fp8)")
        self.device = resolve_device(device)
        self.config = ModelConfig.from_pretrained(model)
        shapes = stored_shapes(model)  # the weights' headers, read once for the size checks
        check_sizes(model, self.config, shapes)
        # quantization="fp8" of a checkpoint in higher precision: its layers' weights are
        # quantized to FP8 blocks while loading (an FP8 checkpoint stays as it is)
        quantize = quantization == "fp8" and self.config.fp8_block is None
        if quantize and self.config.arch == "gpt_oss":
            raise UsageError("quantization fp8 is not supported for gpt-oss (its experts load from MXFP4 "
                             "into the model's dtype)")
        if quantize:
            self.config = replace(self.config, fp8_block=FP8_BLOCK)
        with build_on("meta", torch.float32):  # sizes only: nothing is allocated
            shells = [CausalLM(self.config, TPGroup())]
        check_model_size(model, shells[0], shapes)
        # the weights' headers are read only when "auto" needs them
        said = self.config.torch_dtype  # a name that is no float dtype ("int8", [1]) says nothing
        said = said if isinstance(said, str) and said.replace("torch.", "") in DTYPES else None
        stored = said or (weights_dtype(model) if dtype == "auto" else None)
        self.dtype = resolve_dtype(dtype, stored, self.device)
        self.tokenizer = Tokenizer(model)
        for eos, source in self.tokenizer.eos_sources.items():  # a sampler's column: must be one
            if eos >= self.config.vocab_size:
                raise TreeflashError(f"{source} in {model}: end-of-text token id {eos} is outside the model's "
                                     f"vocabulary of {self.config.vocab_size} tokens")
        self.rules = RequestRules(self.tokenizer, self.config.vocab_size,  # shared by `with_method`
                                  sorted(set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids)))
        # a bad value fails here, not at generate
        defaults_from = generation_folder(generation_config, model)
        self.generation_defaults = generation_defaults(defaults_from) if defaults_from else {}
        dcfg = None
        if draft_model is not None:
            dcfg = DraftConfig.from_pretrained(draft_model)
            draft_shapes = stored_shapes(draft_model)
            check_sizes(draft_model, dcfg.layers, draft_shapes, embedding=False)
            dcfg.check_fits(self.config)
            with build_on("meta", torch.float32):
                shells.append(DFlashDraftModel(dcfg, TPGroup()))
            check_model_size(draft_model, shells[1], draft_shapes)
        if _worker is None:  # the driver checks the host once for all its ranks (they load at once)
            check_weights_fit(shells, self.dtype, self.device)
        if method is None:
            method = "ddtree" if dcfg is not None else "ar"
        if method != "ar" and dcfg is None:  # before any weight loads
            raise UsageError(f"method '{method}' needs a draft model (draft_model=, --draft-model): only the "
                             f"built-in model brings its drafter by default")
        budget = tree_budget(method, budget, max_budget, self.device)
        _check_draft_mode_applies(method, draft_mode)  # before any weight loads, as a budget
        if max_model_len is not None:
            max_model_len = check_int("max_model_len", max_model_len, 2)
        if max_model_len is not None and max_model_len > self.config.context_length:
            raise UsageError(f"max_model_len {max_model_len} exceeds the model's context of "
                             f"{self.config.context_length} positions ({self.config.context_origin}): positions "
                             f"past it were never trained")
        self.max_model_len = max_model_len or self.config.context_length
        # every rank builds the same engine from these arguments (workers get them from rank 0)
        # absolute: a worker resolves a relative path in the folder it started in
        args = dict(model=os.path.abspath(model),
                    draft_model=None if draft_model is None else os.path.abspath(draft_model),
                    method=method, budget=budget, device=device, dtype=dtype, max_model_len=max_model_len,
                    max_budget=max_budget, tp=tp, cuda_graphs=cuda_graphs, draft_mode=draft_mode,
                    enable_prefix_caching=enable_prefix_caching, quantization=quantization,
                    generation_config=generation_config)
        self.model_path = Path(args["model"])
        self._tp = tp_attach(tp, self.device, args, self.config, dcfg, worker=_worker)
        self.device = self._tp.device
        try:
            rss0 = rss_bytes()
            reset_peak_rss()
            with build_on(self.device, self.dtype):
                self.target = CausalLM(self.config, self._tp.group)
            load_weights(self.target, model, quantize=quantize)
            self.target.eval()
            self.drafter = None
            if dcfg is not None:
                with build_on(self.device, self.dtype):
                    self.drafter = DFlashDraftModel(dcfg, self._tp.group)
                load_weights(self.drafter, draft_model)
                self.drafter.eval()
            peak = peak_rss_bytes()
            models = [m for m in (self.target, self.drafter) if m is not None]
            self.load_stats = {  # this rank's share of the weights (see rank_stats)
                "rank": self._tp.rank,
                "param_bytes": sum(p.numel() * p.element_size() for m in models for p in m.parameters()),
                "rss_growth_bytes": None if rss0 is None or peak is None else peak - rss0,
            }
            head_dims = [self.config.head_dim] + ([self.drafter.config.layers.head_dim] if self.drafter else [])
            self._decode_with(method, budget, draft_mode or "coupled", cuda_graphs,
                              attention_backend(self.device, head_dims))
            self._tp.built()      # the workers' slices are loaded too
        except BaseException:
            self._tp.close()
            raise
        weakref.finalize(self, self._tp.close)

    def _decode_with(self, method: str, budget: int | None, draft_mode: str, cuda_graphs: bool,
                     backend: str) -> None:
        self.decoder = SpeculativeDecoder(self.target, self.drafter, method, budget or 0,
                                          draft_mode=draft_mode, attention_backend=backend)
        self.method = method
        self.states = KeptStates(self.decoder, self.device, cuda_graphs and self.device.type == "cuda",
                                 self.enable_prefix_caching, self._tp.group)
        self._run = None  # `_Batch`: state, round and result pipeline of the batch in flight

    def with_method(self, method: str, budget: int | None = None, cuda_graphs: bool | None = None,
                    draft_mode: str | None = None) -> "LLM":
        """This engine's weights, tokenizer and caches of compiled constraints, decoding
        with another method, budget, graphs setting or draft mode, with states and graphs
        of its own: `treeflash bench` loads a checkpoint once for every method. It shares
        this engine's lifetime (closing either closes both). One process only
        (tensor-parallel workers hold the engine they were built as). A ddtree budget left
        out is the constructor's default."""
        if self._tp.size > 1:
            raise UsageError("with_method needs tp=1: the tensor-parallel workers decode as the engine was built")
        if method not in METHODS:
            raise UsageError(f"unknown method {method!r} (choose from {', '.join(METHODS)})")
        budget = tree_budget(method, budget, self.max_budget, self.device)
        if method != "ar" and self.drafter is None:
            raise UsageError(f"method '{method}' needs a draft model")
        _check_draft_mode_applies(method, draft_mode)
        if cuda_graphs is not None:
            check_flag("cuda_graphs", cuda_graphs)
        other = copy.copy(self)
        other._decoding = False  # its own states: its callers may be this engine's callbacks
        other._made_from = self  # collecting this engine closes both: not while the copy is in use
        other._decode_with(method, budget, draft_mode or self.decoder.draft_mode,
                           self.cuda_graphs if cuda_graphs is None else cuda_graphs, self.decoder.backend)
        return other

    def check_healthy(self) -> None:
        """Raise `EngineDeadError` if this engine can serve no more requests (a
        tensor-parallel rank failed, the workers were shut down, or it was closed)."""
        self._tp.check()

    def close(self) -> None:
        """Release this engine on every rank; with tp > 1 the worker processes stop
        once no engine uses them. Idempotent; also done on garbage collection and exit.
        A round still in flight ends, and the graphs go, before the ranks are released."""
        # a round still in flight ends before its graph goes; an error there (a dead device
        # or rank) was told to the batch's caller already, and closing goes on regardless
        with contextlib.suppress(Exception):
            self._finish_run()
        self.states.clear()
        self._tp.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rank_stats(self) -> list[dict]:
        """Per rank: pid, parameter bytes held, RSS growth while loading, and the bytes
        of the KV caches held now (kept states, and the batch in flight)."""
        return self._tp.call(self, "_rank_stats", (), collect=True)

    def _rank_stats(self) -> dict:
        states = {id(s): s for s in self.states.held()}
        if self._run is not None:
            states[id(self._run.st)] = self._run.st
        return {**self.load_stats, "pid": os.getpid(), "cache_bytes": sum(s.cache_bytes for s in states.values())}

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a request unless it ignores EOS: the tokenizer's, config.json's
        and generation_config.json's."""
        return self.rules.eos_token_ids

    def check_sampling(self, p: SamplingParams) -> None:
        """Raise UsageError (one line) if p does not fit this model (see `RequestRules`)."""
        self.rules.check(_checked_sampling_params(p))

    def would_compile(self, p: SamplingParams) -> bool:
        """Whether checking p compiles its structured output (seconds at times): one not
        compiled, nor refused, yet."""
        _checked_sampling_params(p)
        return p.structured_outputs is not None and not self.rules.automata.known(p.structured_outputs)

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no parameters: `SamplingParams`'
        defaults (greedy, 128 new tokens) under the values of the model's
        generation_config.json, as vLLM's `LLM` does; the server's defaults come from it too."""
        return SamplingParams(**self.generation_defaults)

    get_default_sampling_params = default_sampling_params  # vLLM's name

    def get_tokenizer(self) -> TokenizerView:
        """vLLM's: the model's tokenizer under transformers' names and defaults
        (`apply_chat_template`, `encode`, `decode`, `eos_token_id`, ...), as vLLM returns a
        transformers tokenizer; `LLM.tokenizer` is treeflash's own."""
        return TokenizerView(self)

    @cached_property
    def chat_template(self) -> "ChatTemplate | None":
        """The model folder's chat template (None: it has none)."""
        if importlib.util.find_spec("jinja2") is None:
            raise UsageError("a chat template needs jinja2: pip install 'treeflash[serve]'")
        return ChatTemplate.from_folder(self.model_path)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             on_tokens=None, on_done=None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, *, use_tqdm=False, chat_template: str | None = None,
             chat_template_content_format: str = "auto") -> list[GenerationOutput]:
        """The assistant's answers to a conversation ([{"role": ..., "content": ...}, ...])
        or to each of a list of them: rendered by the model's chat template, or the Jinja
        source `chat_template` (either writes its own special tokens; the other arguments as
        vLLM's `LLM.chat` takes them: see `ChatFormat`, `ChatTemplate.prompt`, and `tools`,
        OpenAI's, which the template writes into the prompt), then `generate`d, as the
        server's /v1/chat/completions does. Returns one output per conversation (its text
        as the model wrote it: the server splits tool calls off; its `prompt` the rendered
        conversation, as vLLM's)."""
        one = isinstance(messages, list) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise UsageError("messages must be a conversation (a list of {'role', 'content'} messages) "
                             "or a list of conversations")
        fmt = ChatFormat(chat_template_kwargs, add_generation_prompt, continue_final_message)
        tools = checked_tools(tools)
        template = self._given_template(chat_template)
        # each rendered text goes through `encode` as a prompt of `generate` does: one too long
        # to fit is refused before the tokenizer spends seconds on it
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(conversations)
        truncates = [getattr(params[i], "truncate_prompt_tokens", None) if i < len(params) else None
                     for i in range(len(conversations))]
        texts = [self._chat_text(c, fmt, tools, template, chat_template_content_format) for c in conversations]
        return self.generate([self.encode(text, special=False, truncate=t) for text, t in zip(texts, truncates)],
                             sampling_params, on_tokens, on_done, use_tqdm=use_tqdm, _texts=texts)

    def _given_template(self, source: str | None) -> "ChatTemplate | None":
        """The template of `chat`'s `chat_template` (None: the model's own), with the
        model's special tokens."""
        if source is None:
            return None
        if not isinstance(source, str):
            raise UsageError(f"chat_template must be a template's Jinja source, got {type(source).__name__}")
        try:
            return ChatTemplate(source, ChatTemplate.special_tokens_of(tokenizer_settings(self.model_path)))
        except TreeflashError as e:
            raise UsageError(str(e)) from None

    def chat_prompt(self, messages: list[dict], fmt: ChatFormat = ChatFormat(),
                    tools: list[dict] | None = None) -> list[int]:
        """The token ids of a conversation (and its `tools`) as the model's chat template
        renders it, by default up to where the assistant's answer starts (see
        `ChatFormat`); `generate` checks that they fit (after
        SamplingParams.truncate_prompt_tokens)."""
        if not isinstance(fmt, ChatFormat):
            raise UsageError(f"chat_prompt's fmt must be a ChatFormat, got {type(fmt).__name__}")
        return self.token_ids(self._chat_text(messages, fmt, checked_tools(tools)), special=False)

    def _chat_text(self, messages: list[dict], fmt: ChatFormat, tools: list[dict] | None,
                   template: "ChatTemplate | None" = None, content_format: str = "auto") -> str:
        template = template or self.chat_template
        if template is None:
            raise UsageError(f"{self.model_path} {NO_TEMPLATE}; or give LLM.chat a chat_template")
        return template.prompt(messages, fmt, tools, content_format)

    def encode(self, prompt: str | list[int], special: bool = True, truncate: int | None = None) -> list[int]:
        """`token_ids` that fit the context; `truncate`: keep only the last k first (-1: as
        many as fit), SamplingParams.truncate_prompt_tokens. A text too long to fit
        whatever its tokens is refused before it is tokenized (megabytes take the
        tokenizer a minute, and a server's other requests wait for it)."""
        if (why := truncation_error(truncate)) is not None:
            raise UsageError(f"truncate {why}")
        if truncate is not None and truncate >= self.max_model_len:  # vLLM refuses it as well
            raise UsageError(f"truncate_prompt_tokens {truncate} does not fit the context limit of "
                             f"{self.max_model_len} tokens (at most {self.max_model_len - 1}; -1: as many as fit)")
        if isinstance(prompt, str) and truncate is None:
            most = self.tokenizer.longest_token_bytes
            if len(prompt) > 2 * self.max_model_len * most:  # > 2 x max_model_len tokens (normalizers may merge a few)
                raise ContextLengthError(self.max_model_len, f": a prompt of {len(prompt)} characters does not fit "
                                                             f"(a token of this model holds at most {most} bytes)")
        ids = self.token_ids(prompt, special)
        if truncate is not None:
            ids = ids[-(self.max_model_len - 1 if truncate == -1 else truncate):]
        if len(ids) >= self.max_model_len:
            raise ContextLengthError(self.max_model_len, f": a prompt of {len(ids)} tokens does not fit (it must "
                                                         f"leave room for one new token)")
        return ids

    def token_ids(self, prompt: str | list[int], special: bool = True) -> list[int]:
        """Checked token ids of a prompt, of any length; `special`: let the tokenizer add
        its special tokens (BOS), as for plain text (not for a rendered chat template)."""
        check_flag("special", special)
        if isinstance(prompt, str):
            if not is_text(prompt):
                raise UsageError("a prompt must be valid Unicode text (it holds undecodable characters)")
            ids = self.tokenizer.encode(prompt, special)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                        for t in prompt):
            ids = [int(t) for t in prompt]  # NumPy's integers too
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
        return ids

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 on_tokens=None, on_done=None, *, use_tqdm=False, _texts=None) -> list[GenerationOutput]:
        """Generate for a list of prompts (strings or token-id lists, or vLLM's prompt dicts
        {"prompt": text} and {"prompt_token_ids": ids}), in order, in batches
        of `max_batch` (with prefix caching, as one batch: a batch reuses the caches of
        the last batch of its size, which smaller chunks would overwrite).

        `on_tokens(i, new_ids, new_logprobs)` is called as request i commits tokens (for
        streaming; new_logprobs: their `TokenLogprob`s, or None if request i did not ask;
        a callback of two arguments gets the first two); if it returns True, request i
        ends there (finish_reason "abort": say, its client went away) and the others go
        on. `on_done(i, output)` is called as soon as request i has finished, with the
        output `generate` returns for it at the end. `use_tqdm` is vLLM's: True counts
        finished prompts on stderr; a tqdm-like class is made and advanced instead.
        Rounds are pipelined: the host reads and processes round r-1's tokens while
        round r runs on the device (see `_step`, `RoundPipeline`), with tensor
        parallelism too (every rank runs ahead alike). (`_texts`: the outputs' `prompt`s,
        where the prompts are token ids whose text is known: `chat` renders them.)
        """
        if not isinstance(prompts, (str, dict, list, tuple)):
            raise UsageError(f"prompts must be a string, a list of token ids, or a list of those, "
                             f"got {type(prompts).__name__}")
        single = isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], numbers.Integral))
        prompts = [_unwrapped(p) for p in ([prompts] if single else prompts)]
        params = self.default_sampling_params() if sampling_params is None else sampling_params
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise UsageError(f"{_count(len(prompts), 'prompt')} but {_count(len(params), 'sampling parameter set')}")
        if not prompts:
            return []
        last = None  # the parameters checked last: the n choices of a request differ only in their seeds
        for p in map(_checked_sampling_params, params):
            if last is None or not _same_but_seed(p, last):
                self.check_sampling(p)
                last = p
            else:  # its seed may have been set since it was made
                p.check_seed()
        ids = [self.encode(p, truncate=q.truncate_prompt_tokens) for p, q in zip(prompts, params)]
        # seeds are drawn here, so that every tensor-parallel rank samples alike; a subclass
        # becomes a plain SamplingParams (the workers could not unpickle a class of __main__)
        params = [p if type(p) is SamplingParams else SamplingParams(**{f.name: getattr(p, f.name)
                                                                        for f in fields(SamplingParams)})
                  for p in params]
        params = [p if p.seed is not None else p.with_seed(self._seeds.getrandbits(63)) for p in params]
        on_tokens = _token_callback(on_tokens)
        if on_done is not None:
            _arguments_taken(on_done, "on_done", ("i, output",))
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise UsageError(f"use_tqdm must be true, false or a tqdm-like class, got {type(use_tqdm).__name__}")
        # in order, at most max_batch at a time; with prefix caching as one batch (a batch
        # reuses the caches of the last batch of its size: chunks would overwrite them)
        step = len(ids) if self.enable_prefix_caching else self.max_batch
        texts = _texts or [p if isinstance(p, str) else None for p in prompts]  # the outputs' `prompt`, as vLLM's
        results = []
        with self._generating:  # one call at a time: a batch's state and graphs are the engine's
            if self._decoding:  # the same thread, from a callback (the lock lets it in)
                raise UsageError("generate was called from its own on_tokens or on_done callback, while this "
                                 "engine decodes that call's batch: call it after generate returns")
            self._decoding = True
            bar = None
            try:
                bar = _progress_bar(use_tqdm, len(ids))
                if bar is not None:
                    on_done = _advancing(bar, on_done)
                for s in range(0, len(ids), step):
                    e = s + step
                    constraints = [p.structured_outputs for p in params[s:e] if p.structured_outputs]
                    with self.rules.automata.pinned(constraints):
                        results += self._generate_batch(ids[s:e], params[s:e], _shifted(on_tokens, s),
                                                        _shifted(on_done, s), texts[s:e])
            finally:
                self._decoding = False
                if bar is not None:
                    bar.close()
        return results

    def _generate_batch(self, ids: list[list[int]], params: list[SamplingParams], on_tokens, on_done,
                        texts: list[str | None]):
        limits = [min(p.max_new_tokens, self.max_model_len - len(i)) for p, i in zip(params, ids)]
        dec = self.decoder
        per_round = dec.depth + 1  # the most tokens a round commits per request
        # Cache headroom past a request's last token (L + limit). The host is one round
        # behind the device: a request still short of its limit after round r-2 has
        # n <= L + limit - 2; round r-1 (its last useful one) commits <= depth + 1, and
        # round r, launched before the host read r-1, still runs it as active: another
        # depth + 1. From round r + 1 on it is inactive, n stays put, and every later
        # round (while others go on) writes its tree / drafter block at slots
        # n .. n + tree_slots - 1, n <= L + limit + 2 * depth; eager rounds read
        # kv_len = max_n + T slots, max_n (below) <= max(L + limit) + 2 * depth too. All
        # stay below max(L + limit) + 2 * depth + tree_slots < max_len.
        headroom = dec.tree_slots + 2 * per_round
        max_len = max(len(i) + m for i, m in zip(ids, limits)) + headroom
        start = time.perf_counter()
        drop = self.states.to_drop(len(ids), max_len)
        reuse = self.states.prefix_to_reuse(max_len, ids, params, drop,
                                            [self.rules.automaton(p) for p in params])
        first, lp, plp = self._tp.call(self, "_start", (len(ids), max_len, params, ids, drop, reuse))
        state = self._run.st
        reqs = [_Request(prompt, p, limit, committed=len(prompt), cached=None if reuse is None else reuse[1][b],
                         prompt_logprobs=prompt_lp, logprobs=[] if p.logprobs is not None else None, text=text,
                         request_id=str(next(self._request_ids)))
                for b, (prompt, p, limit, prompt_lp, text) in enumerate(
                    zip(ids, params, limits, prompt_token_logprobs(ids, params, plp, self.tokenizer.token_text), texts))]
        try:
            self._decode(reqs, first, lp, start, on_tokens, on_done)
        except BaseException:
            if not self.cuda_graphs:  # an eager engine keeps no caches, a failed batch's neither
                with contextlib.suppress(Exception):  # a dead runtime: the first error is the one to tell
                    self._tp.call(self, "_release", ())
            raise
        if self.enable_prefix_caching:  # every token but each request's last is in the caches
            state.tokens = [r.prompt + r.out[:-1] for r in reqs]
        if not self.cuda_graphs:
            self._tp.call(self, "_release", ())
        return [r.result for r in reqs]

    def _decode(self, reqs: list[_Request], first: list[int], lp: list, start: float, on_tokens, on_done) -> None:
        """Run the batch's rounds until every request has its result (the state `_start`
        made); tell the callbacks as tokens come."""
        per_round = self.decoder.depth + 1
        new, counts = [[t] for t in first], [1] * len(reqs)
        in_flight = None  # `active` of the round launched but not read yet
        # Pipelined: `_step` launches round r and returns round r-1's tokens, which the
        # host processes while round r runs. A request that finishes at round r-1 is
        # still active in round r (its commits there are ignored below) and inactive
        # from round r+1 on; when all are done, the round in flight is discarded (the
        # next `_start` waits for it).
        while True:
            for b, r in enumerate(reqs):
                if r.result is not None or counts[b] == 0:
                    continue
                stop = self._take(b, r, new[b][:counts[b]], lp, on_tokens)
                if stop:
                    r.result = self._result(r, stop, time.perf_counter() - start)
                    if on_done is not None:
                        on_done(b, r.result)
            active = [r.result is None for r in reqs]
            if not any(active):
                break
            # bounds eager attention reads of this round: n before it is at most what
            # the host has read plus the commits of the round in flight
            flight = in_flight or [False] * len(reqs)
            max_n = max(r.committed + per_round * f for r, f in zip(reqs, flight))
            got = self._tp.call(self, "_step", (None if all(active) else active, max_n))
            in_flight = active
            if got is None:  # the first round: nothing to read yet
                new, counts = [[] for _ in reqs], [0] * len(reqs)
                continue
            new, counts, *lp = got
            for r, c, a in zip(reqs, counts, active):
                r.committed += c
                r.rounds += a  # the round just read: r takes its tokens if it was going after the one before

    def _take(self, b: int, r: _Request, got: list[int], lp: list, on_tokens) -> str | None:
        """Add a round's committed tokens to request b's output (up to its end: EOS, the
        token limit, a stop string) with their logprobs (from the batch's rows `lp`) if
        asked, tell `on_tokens`; the stop reason if it ended ("abort": on_tokens said so),
        else None."""
        before = len(r.out)
        stop = self.rules.append_until_end(got, r.out, r.params, r.limit)
        if r.params.stop and self.rules.cut_at_stop_string(r.out, before, r.params, r.prompt):
            stop = "stop"
        added = None
        if r.logprobs is not None:  # those of the tokens kept
            added = token_logprobs(r.out[before:], [x[b] for x in lp], r.params.logprobs,
                                   self.tokenizer.token_text)
            r.logprobs += added
        if on_tokens is not None and len(r.out) > before and on_tokens(b, r.out[before:], added) is True:
            stop = stop or "abort"
        return stop

    def _result(self, r: _Request, reason: str, seconds: float) -> GenerationOutput:
        """Request r's output, with its stats (`seconds` from the batch's start to its last
        token; with prefix caching, the prompt tokens found in the caches)."""
        n = len(r.out)
        stats = {"method": self.method, "new_tokens": n, "rounds": r.rounds, "tau": round(n / r.rounds, 4),
                 "seconds": round(seconds, 4), "tokens_per_s": round(n / seconds, 2) if seconds > 0 else None,
                 **({"nodes_per_round": self.decoder.budget} if self.method == "ddtree" else {}),
                 **({"cached_tokens": r.cached or 0} if self.enable_prefix_caching else {})}
        out = self.rules.output(r.out, reason, r.params, r.prompt, r.logprobs, r.prompt_logprobs, stats)
        out.prompt, out.request_id = r.text, r.request_id  # before on_done sees them
        return out

    def _release(self) -> None:
        """On every rank: free the finished batch's caches, as an eager engine keeps none
        (graphed states, and with prefix caching the last, are kept by `states`)."""
        self._finish_run()

    def _finish_run(self) -> None:
        """Wait for the batch in flight's last round (if any), then let go of its state."""
        run, self._run = self._run, None
        if run is not None:
            run.pipe.finish()

    def _prefill_is_graphed(self, cells: int) -> bool:
        """Whether a batch's prefill of `cells` padded prompt tokens replays a CUDA graph
        (else it runs eagerly)."""
        return self.cuda_graphs and cells <= GRAPHED_PREFILL_MAX

    def _start(self, batch: int, max_len: int, params: list[SamplingParams], prompts: list[list[int]],
               drop: list[tuple[int, int]], reuse: tuple[tuple[int, int], list[int]] | None = None):
        """On every rank: a batch state (or the captured graph's) and the prefill, after
        dropping the graphed states `drop` (the driver's choice); with `reuse` (the
        driver's `KeptStates.prefix_to_reuse`: a kept state and per request the prompt
        tokens it holds) a prefill of each prompt past those, once they are in this
        batch's state.
        Returns each request's first token, their logprobs and the prompts' (as lists;
        [] if not asked)."""
        self._finish_run()  # before the previous batch's state or graph may be dropped, and its
        # caches go before the new ones are made
        if drop:
            self.states.drop(drop)
            torch.cuda.empty_cache()
        source = None
        if reuse is not None:  # held before `runner` may replace the eager engine's kept state
            source = self.states.state(reuse[0])
        sampling = SamplingBatch.from_params(params, self.device, self.decoder.target.lm_head.vocab_size,
                                             prompts, [self.rules.held_ids(p) for p in params],
                                             [self.rules.automaton(p) for p in params],
                                             [self.rules.bad_sequences(p) for p in params])
        st, run_round, graphed = self.states.runner(batch, max_len, sampling)
        st.tokens = None  # the caches change from here; the driver records them when the batch is done
        if reuse is not None:  # the rest of each prompt, after what the caches hold
            starts = reuse[1]
            if source is not st:  # after any capture on st (its warm-up rounds write from slot 0)
                st.copy_prefix(source, max(starts))
            for pieces, begins in suffix_chunks(prompts, starts, st.cache.max_len):
                ids, lens = self.decoder.prefill_inputs(st, pieces, begins)
                begin = torch.tensor(begins, device=ids.device)
                if self._prefill_is_graphed(ids.numel()):
                    lp, plp = graphed.prefill(ids, lens, begin)
                else:
                    lp, plp = self.decoder.prefill_tokens(st, ids, lens, begin=begin,
                                                          kv_len=max(begins) + ids.shape[1])
        else:
            ids, lens = self.decoder.prefill_inputs(st, prompts)
            scoring = [(b, len(q)) for b, (q, p) in enumerate(zip(prompts, params)) if p.prompt_logprobs is not None]
            if scoring or not self._prefill_is_graphed(ids.numel()):  # scoring: eager
                lp, plp = self.decoder.prefill_tokens(st, ids, lens, prompt_logprobs=scoring)
            else:
                lp, plp = graphed.prefill(ids, lens)
        self._run = _Batch(st, run_round, RoundPipeline(), [True] * batch)
        return st.anchor.tolist(), [t.tolist() for t in lp or ()], [t.tolist() for t in plp or ()]

    def _step(self, active: list[bool] | None, max_n: int):
        """On every rank: launch the next round of the batch in flight and queue the copy
        of its outputs to the host; return the previous round's (new tokens, counts, and
        the logprobs' tensors if asked) as lists, or None after the first round.
        `active` (once requests have finished) is copied to the device when it changed,
        without waiting for the round in flight; `max_n` bounds eager attention reads (at
        least every request's n before this round)."""
        run = self._run
        if run is None:  # `close()` from another thread ended the batch after this call's check
            raise closed_error()
        st = run.st
        if active is not None and active != run.active:
            src = torch.tensor(active, dtype=torch.bool, pin_memory=st.active.is_cuda)
            st.active.copy_(src, non_blocking=True)  # pinned: queued, the host goes on
            run.active = list(active)
        new, counts, logprobs = run.run_round(st, max_n)
        return run.pipe.push(new, counts, *(logprobs or ()))

    @property
    def cuda_graphs(self) -> bool:
        """Whether rounds (and short prefills) run as CUDA graphs."""
        return self.states.graphs

    @property
    def graph_captures(self) -> int:
        """Rounds and prefills captured so far (see `KeptStates.captures`)."""
        return self.states.captures

    def drop_graphs(self) -> None:
        """Free the kept graphed batch states with their graphs, on every rank: the next
        batch captures anew."""
        self._tp.call(self, "_drop_graphs", ())

    def _drop_graphs(self) -> None:
        self.states.drop()
