"""What a request asks of sampling: `SamplingParams` and its checks, and where values
come from besides the caller (a model's generation_config.json, OpenAI's logit_bias).
How a batch of them samples on the device is `treeflash.engine.sampling`."""
from __future__ import annotations

import copy
import functools
import math
import numbers
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from treeflash.errors import UsageError, is_text, shown
from treeflash.files import read_json_object
from treeflash.structured.grammar import StructuredOutputs

MIN_TEMPERATURE = 1e-6  # a sampled request's temperature is at least this, on every path that samples
                        # (torch and Triton: they must sample alike); 1e-40 overflowed logits / T to inf
MAX_LOGPROBS = 20  # most likely alternatives a request may ask for per token (vLLM's default limit)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value's bound in the API, as OpenAI's (the server's and from_optional's)
# SamplingParams' bounds (vLLM's has none: code bans tokens with -1e9 or -inf, also taken here).
# Above, a sampled logit / T of 1e7 or more drowns the sampler's noise in float32 rounding, and
# two tokens given the same large bias would always resolve to one: 1e4 keeps it below 1e-3.
LOGIT_BIAS_RANGE = (-1e30, 1e4)
MAX_PENALTY = 2.0       # presence / frequency penalties' bound, as OpenAI's
FLOAT32_MAX = 3.4028234663852886e38  # a temperature past it is inf as float32
MAX_REPETITION_PENALTY = 1e30  # it and its reciprocal bound it: both finite and normal in float32
BAD_WORD_TOKENS = 8      # a bad word's token sequence at most (the last is banned after the others)
MAX_BAD_SEQUENCES = 128  # a request's bad words' token sequences at most (two spellings per word)
DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: int = 0  # 0 or -1 (vLLM's): off
    top_p: float = 1.0
    min_p: float = 0.0  # keep tokens at least min_p x the most likely one's probability (0 = off)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)  # end like EOS (kept in token_ids), ignore_eos or not
    logprobs: int | None = None  # report each token's log-probability and this many alternatives' (None: off)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (None: off)
    skip_special_tokens: bool = True          # leave special tokens' text out of the output text
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    logit_bias: dict[int, float] | None = None  # added to those tokens' logits (before the temperature)
    allowed_token_ids: list[int] | None = None  # sample only among these (None: all)
    min_tokens: int = 0  # no EOS (ignored or not), stop token or stop string before this many new tokens
    presence_penalty: float = 0.0    # subtracted from the logits of tokens the output holds
    frequency_penalty: float = 0.0   # subtracted once per time the output holds the token
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: as many as fit)
    structured_outputs: StructuredOutputs | None = None  # the text must match a schema, regex, choice or grammar
    bad_words: list[str] | None = None  # never generated: a word's last token is banned where it would end it

    def __post_init__(self):
        self.validate()  # where the caller makes it, as in vLLM; `generate` checks the vocabulary too

    def __setattr__(self, name, value):
        """Fields only, and vLLM's `max_tokens` and `n` as the constructor takes them: a
        vLLM field set on an instance (`p.n = 4`, `p.logits_processors = [...]`) would
        otherwise be ignored without a word."""
        if name not in SamplingParams.__dataclass_fields__ and name not in ("max_tokens", "n"):
            _vllm_keywords({name: value})  # one at what this engine does is taken (and not kept), as in __init__
            return
        super().__setattr__(name, value)

    @property
    def n(self) -> int:
        """vLLM's outputs per prompt: one here (the constructor refuses others)."""
        return 1

    @n.setter
    def n(self, value) -> None:
        _one_output(value)

    def clone(self) -> "SamplingParams":
        """vLLM's: a deep copy."""
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs) -> "SamplingParams":
        """vLLM's: the keywords given as None left out (their defaults), and as vLLM's,
        logit_bias keys taken as integers and its values clamped to [-100, 100] (OpenAI's
        range: the form a request's JSON gives)."""
        if isinstance(kwargs.get("logit_bias"), dict):
            kwargs["logit_bias"] = _clamped_bias(kwargs["logit_bias"])
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    def with_seed(self, seed: int) -> "SamplingParams":
        """A copy that samples with `seed`: checked already, so its lists (a long
        allowed_token_ids or logit_bias) are not walked again, and shared."""
        copied = copy.copy(self)
        copied.seed = seed
        return copied

    def check_seed(self) -> None:
        """`validate`'s check of the seed (-1: none, as in vLLM), which `LLM.generate` runs
        alone on parameters that differ from the ones it checked last only in their seeds."""
        self.seed = plain_number(self.seed)
        if type(self.seed) is int and self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 63):
            raise UsageError(f"invalid sampling parameters: seed must be an integer in [0, 2^63), got "
                             f"{shown(self.seed)}")

    @property
    def max_tokens(self) -> int:
        """vLLM's name for max_new_tokens, read and set as in vLLM (also a keyword of the
        constructor): vLLM's code runs as it is. Not a field, so `dataclasses.replace`
        and copies carry max_new_tokens alone."""
        return self.max_new_tokens

    @max_tokens.setter
    def max_tokens(self, value: int) -> None:
        self.max_new_tokens = value

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        def bad(msg, param=None):
            raise UsageError(f"invalid sampling parameters: {msg}", param=param)
        for name in _NUMBERS:
            setattr(self, name, plain_number(getattr(self, name)))
        for name in ("stop_token_ids", "allowed_token_ids"):
            if isinstance(getattr(self, name), (list, tuple)):
                setattr(self, name, [plain_number(t) for t in getattr(self, name)])
        if isinstance(self.logit_bias, dict):
            self.logit_bias = {plain_number(t): plain_number(v) for t, v in self.logit_bias.items()}
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            bad(f"max_new_tokens must be an integer >= 1, got {shown(self.max_new_tokens)}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0, got {shown(self.temperature)}")
        if self.temperature > FLOAT32_MAX:  # inf as float32: masked logits (-inf / inf) became NaN and won
            bad(f"temperature must be at most {FLOAT32_MAX:.4g} (float32's largest), got {shown(self.temperature)}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be an integer >= 0, or -1 (0 and -1: off, as in vLLM), got {shown(self.top_k)}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {shown(self.top_p)}")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1] (0 = off), got {shown(self.min_p)}")
        self.check_seed()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                bad(f"{name} must be true or false, got {shown(getattr(self, name))}")
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            bad(f"stop must be a string or a list of strings, got {shown(self.stop)}")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        for s in self.stop:
            if not is_text(s):  # it could never match the output
                bad(f"stop string {shown(s)} is not valid Unicode text", param="stop")
        self.stop = [str(s) for s in self.stop]  # plain: a subclass may not unpickle in a TP worker
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(_is_id(t) for t in self.stop_token_ids):
            bad(f"stop_token_ids must be a list of token ids (integers in [0, 2^63)), got {shown(self.stop_token_ids)}")
        if vocab_size is not None and any(t >= vocab_size for t in self.stop_token_ids):
            bad(f"stop token id {max(self.stop_token_ids)} is outside the vocabulary of {vocab_size}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                bad(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (or None: off), got {shown(k)}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) \
                or not 0 <= self.min_tokens <= self.max_new_tokens:
            bad(f"min_tokens must be an integer in [0, max_new_tokens = {self.max_new_tokens}], "
                f"got {shown(self.min_tokens)}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_id(t) and not isinstance(v, bool) and isinstance(v, (int, float))
                    for t, v in self.logit_bias.items()):
                bad(f"logit_bias must map token ids (integers in [0, 2^63)) to numbers, got {shown(self.logit_bias)}")
            lo, hi = LOGIT_BIAS_RANGE
            if not all(lo <= v <= hi or v == -math.inf for v in self.logit_bias.values()):  # NaN too
                bad(f"logit_bias values must be in [{lo:g}, {hi:g}], or -inf (a ban)")
            self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}  # plain, for TP workers
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids \
                    or not all(_is_id(t) for t in self.allowed_token_ids):
                bad(f"allowed_token_ids must be a non-empty list of token ids, got {shown(self.allowed_token_ids)}")
            self.allowed_token_ids = list(dict.fromkeys(int(t) for t in self.allowed_token_ids))  # a set, in order
            if set(self.allowed_token_ids) <= self.bias_bans:
                bad("logit_bias bans (-inf) every token of allowed_token_ids: no token could be generated")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                bad(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {shown(v)}")
        v = self.repetition_penalty
        lo, hi = 1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            bad(f"repetition_penalty must be in [{lo:g}, {hi:g}] (1 = off), got {shown(v)}")
        if (why := truncation_error(self.truncate_prompt_tokens)) is not None:
            bad(f"truncate_prompt_tokens {why}")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in self.bad_words):
                bad(f"bad_words must be a list of words (non-blank strings), got {shown(self.bad_words)}")
            self.bad_words = [str(w) for w in self.bad_words]
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputs):
                bad(f"structured_outputs must be StructuredOutputs, got {shown(self.structured_outputs)}")
            self.structured_outputs.validate()
            # min_tokens or allowed tokens could leave a state no token; ignore_eos would
            # fill the rest of max_tokens with EOS once the output is complete
            for name in ("min_tokens", "allowed_token_ids", "ignore_eos"):
                if getattr(self, name):
                    bad(f"structured outputs cannot be combined with {name}", param=name)
        if vocab_size is not None:
            for name, ids in (("logit_bias", self.logit_bias or ()),
                              ("allowed_token_ids", self.allowed_token_ids or ())):
                if any(t >= vocab_size for t in ids):
                    bad(f"{name} token id {max(ids)} is outside the vocabulary of {vocab_size}")
            if len(self.bias_bans) == vocab_size:
                bad("logit_bias bans (-inf) every token of the vocabulary: no token could be generated")
        return self

    @property
    def biased(self) -> bool:
        """Whether `bias` (module doc) changes anything for this request."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or self.min_tokens > 0

    @property
    def bias_bans(self) -> set[int]:
        """The token ids logit_bias bans (-inf), which every check of a token left counts."""
        return {t for t, v in (self.logit_bias or {}).items() if v == -math.inf}

    @property
    def banned(self) -> bool:
        """Whether bad words (module doc) change anything for this request."""
        return bool(self.bad_words)

    @property
    def penalized(self) -> bool:
        """Whether `penalize` (module doc) changes anything for this request."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p cut this (sampled) request's distribution."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


GENERATION_KEYS = ("temperature", "top_p", "top_k", "min_p", "max_new_tokens", "repetition_penalty")


def _one_output(n) -> None:
    if isinstance(n, bool) or plain_number(n) != 1:
        raise UsageError(f"invalid sampling parameters: n must be 1, one output per prompt (give a prompt n "
                         f"times, each with its own seed; the server takes n), got {shown(n)}")


# vLLM SamplingParams fields with no counterpart here: named as such when set on an instance
_VLLM_ONLY = {"best_of", "logits_processors", "detokenize", "output_kind", "guided_decoding", "extra_args",
              "spaces_between_special_tokens", "flat_logprobs", "prompt_logprobs_mode", "seed_offset"}
# ... and the values of them that the constructor takes, as they mean what this engine does
_VLLM_DEFAULTS = {"best_of": (None, 1), "detokenize": (True,), "spaces_between_special_tokens": (True,),
                  "logits_processors": (None, []), "guided_decoding": (None,), "extra_args": (None, {}),
                  "flat_logprobs": (False,)}


def _vllm_keywords(kwargs: dict) -> None:
    """Take vLLM-only keywords out of a constructor call's `kwargs`: at a value that asks
    for what this engine does (`best_of=1`, `detokenize=True`) dropped, else refused in
    words (the dataclass would raise a bare TypeError)."""
    for name in [k for k in kwargs if k not in SamplingParams.__dataclass_fields__]:
        value = kwargs.pop(name)
        if name not in _VLLM_ONLY:
            raise UsageError(f"SamplingParams has no field {name!r}")
        taken = _VLLM_DEFAULTS.get(name, ())
        if not any(type(value) is type(v) and value == v for v in taken):
            raise UsageError(f"SamplingParams takes vLLM's {name!r} only as " + " or ".join(map(repr, taken)) +
                             f" (what this engine does), got {shown(value)}" if taken else
                             f"SamplingParams has no field {name!r} (vLLM's; not supported)")


def _as_in_vllm(init):
    """The dataclass constructor, also taking vLLM's `max_tokens` keyword for
    max_new_tokens and its `n` at 1 (vLLM's default, which its scripts often spell out;
    a request here has one output), and warning where vLLM's code would sample and this
    does not: a filter or a seed without a temperature (vLLM's default is 1, this one's
    greedy)."""
    @functools.wraps(init)
    def __init__(self, *args, max_tokens=..., n=1, **kwargs):
        _one_output(n)
        _vllm_keywords(kwargs)
        if max_tokens is not ...:
            max_tokens = plain_number(max_tokens)
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise UsageError(f"invalid sampling parameters: max_tokens must be an integer >= 1 (vLLM's None, "
                                 f"as many as fit, is not taken), got {shown(max_tokens)}")
            if args or "max_new_tokens" in kwargs:
                raise UsageError("invalid sampling parameters: give max_tokens or max_new_tokens, not both "
                                 "(dataclasses.replace gives max_new_tokens: replace a copy's max_new_tokens)")
            kwargs["max_new_tokens"] = max_tokens
        init(self, *args, **kwargs)  # checks the values first
        if "temperature" not in kwargs and len(args) < 2 and _samples_in_vllm(kwargs):
            warnings.warn("SamplingParams without a temperature is greedy (temperature 0, where top_k, top_p, min_p "
                          "and seed do nothing; vLLM's default is 1.0): give temperature", stacklevel=2)
    return __init__


SamplingParams.__init__ = _as_in_vllm(SamplingParams.__init__)


def generation_folder(source: str | Path, model: str | Path, name: str = "generation_config") -> Path | None:
    """Where sampling defaults come from, as vLLM's generation_config reads: "auto" the
    model's folder, "none" (vLLM's "vllm") no file, else a folder holding a
    generation_config.json (`name`: the option's, for its error)."""
    if source == "auto":
        return Path(model)
    if source in ("none", "vllm"):
        return None
    if not isinstance(source, (str, Path)) or not (Path(source) / "generation_config.json").is_file():
        raise UsageError(f"{name} must be 'auto', 'none' (vLLM's 'vllm') or a folder with a "
                         f"generation_config.json, got {shown(source)}")
    return Path(source)


def generation_defaults(folder: str | Path) -> dict:
    """The sampling values a model's generation_config.json asks for, as `SamplingParams`
    fields (only those it gives): what vLLM's `LLM` and server use where the caller gives
    none (Qwen3, for one, asks for temperature 0.6, top_p 0.95, top_k 20). Filters without
    a temperature come with transformers' and vLLM's 1, not SamplingParams' greedy
    default, where they would do nothing. do_sample false is greedy (temperature 0, the
    file's own temperature too), as transformers decodes the model (vLLM does not read
    it). A value that `SamplingParams` refuses is refused here, naming the file."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    config = read_json_object(path, missing_ok=False)
    if not isinstance(config.get("do_sample", False), (bool, type(None))):  # "false" would read as sampling
        raise UsageError(f"{path}: 'do_sample' must be true or false, got {shown(config['do_sample'])}")
    got = {k: config[k] for k in GENERATION_KEYS if config.get(k) is not None}
    for k in ("top_k", "max_new_tokens"):  # 20.0 is 20
        if isinstance(got.get(k), float) and got[k].is_integer():
            got[k] = int(got[k])
    if got.get("top_k") == -1:  # vLLM's "off"
        got["top_k"] = 0
    if config.get("do_sample") is False:  # (the server's own default temperature is OpenAI's 1)
        got["temperature"] = 0.0
    elif "temperature" not in got and _samples_in_vllm(got):  # filters for transformers' (and vLLM's) default
        got["temperature"] = 1.0
    try:
        SamplingParams(**got)
    except UsageError as e:
        raise UsageError(f"{path}: {e}") from None
    return got


def _samples_in_vllm(values: dict) -> bool:
    """Whether `values` (SamplingParams keywords) set a filter or a seed: sampling at
    vLLM's default temperature of 1."""
    return values.get("top_k", 0) not in (0, -1) or values.get("top_p", 1.0) != 1 \
        or values.get("min_p", 0.0) != 0 or values.get("seed") not in (None, -1)


def truncation_error(k) -> str | None:
    """What is wrong with a prompt truncation (keep the last k tokens; -1: as many as
    fit), or None if nothing."""
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not (k >= 1 or k == -1)):
        return f"must be an integer >= 1, or -1 (as many as fit), got {shown(k)}"
    return None


_NUMBERS = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "prompt_logprobs",
            "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "truncate_prompt_tokens")


def plain_number(x):
    """A NumPy (or any `numbers`) integer or real as Python's int or float, as vLLM takes
    them, a subclass of int or float (an IntEnum of the caller's script) too: a TP
    worker unpickles plain values only (it cannot load the caller's class, and died),
    and the checks know int and float. Any other value as it is, for the checks to
    judge (a bool too)."""
    if type(x) in (bool, int, float) or not isinstance(x, numbers.Real):
        return x
    return int(x) if isinstance(x, numbers.Integral) else float(x)


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 63


def _clamped_bias(bias: dict) -> dict:
    """vLLM's from_optional logit_bias: keys of digits as token ids, numbers clamped to
    [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]; anything else left for `validate` to refuse (a NaN
    clamped would have banned its token)."""
    def key(t):
        return int(t) if isinstance(t, str) and t.isascii() and t.isdigit() and len(t) <= 19 else t

    def value(b):
        real = isinstance(b, (int, float)) and not isinstance(b, bool) and b == b
        return min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b)) if real else b
    return {key(t): value(b) for t, b in bias.items()}


def token_bias(mapping) -> dict[int, float]:
    """OpenAI's logit_bias as JSON gives it (token ids as strings of digits -> numbers),
    as SamplingParams takes it; the keys are checked here, the values where
    SamplingParams is made (`validate`)."""
    if not isinstance(mapping, dict):
        raise UsageError(f"logit_bias must be an object of token ids to numbers, got {shown(mapping)}")
    out = {}
    for key, value in mapping.items():
        # at most 19 digits: any longer is no token id (and int() would refuse past 4300)
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19):
            raise UsageError(f"logit_bias keys must be token ids, got {shown(key)}")
        if int(key) in out:
            raise UsageError(f"logit_bias has token id {int(key)} twice")
        out[int(key)] = value
    return out
