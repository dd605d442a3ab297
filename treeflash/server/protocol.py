"""OpenAI request bodies in, engine requests and OpenAI response bodies out.

Everything a client can get wrong is checked here, before the engine sees it, and
becomes an `APIError` with the status and error body OpenAI (and vLLM) use.
"""
from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from treeflash.chat import ChatFormat, checked_tools, plain_messages
from treeflash.errors import ContextLengthError, TreeflashError, UsageError, is_text, shown
from treeflash.sampling_params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY,
                                       SamplingParams, generation_defaults, token_bias)
from treeflash.server.answers import HARMONY, MessageStream, chat_parsers, harmony_opened, request_tools
from treeflash.structured.grammar import REASONING_TAGS, StructuredOutputs

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions

# Parameters (OpenAI's and vLLM's) this engine cannot honour, with the values that ask
# for nothing: anything else is refused, never silently ignored.
UNSUPPORTED = {
    "suffix": ((None, ""), "suffix is not supported"),
    "tools": ((None, []), "tool calls are for chat completions"),  # chat: `request_tools`
    "tool_choice": ((None, "none", "auto"), "tool calls are for chat completions"),
    "functions": ((None, []), "function calls are not supported"),
    "spaces_between_special_tokens": ((None, True), "spaces_between_special_tokens = false is not supported"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "chat_template": ((None,), "a request's own chat_template is not supported"),
    "function_call": ((None, "none", "auto"), "function calls are not supported (use tools)"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "audio output is not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "web_search_options": ((None,), "web search is not supported"),
}
# The ways to ask for structured outputs: vLLM's (current and older) and OpenAI's
STRUCTURED_KEYS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                   "response_format")
# vLLM's structured_outputs flags that ask for nothing when false
VLLM_STRUCTURED_FLAGS = ("json_object", "disable_fallback", "disable_any_whitespace", "disable_additional_properties")
# What a request may hold besides UNSUPPORTED's keys: the parameters this server reads, and
# OpenAI's bookkeeping that does not touch the output. Anything else (a misspelled
# "temprature", another server's extension) is refused, as OpenAI does, not ignored.
SAMPLING_KEYS = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "n",
                 "best_of", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias",
                 "allowed_token_ids", "skip_special_tokens",
                 "include_stop_str_in_output", "stream", "stream_options", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "truncate_prompt_tokens", "user", "metadata", "store",
                 "service_tier", "safety_identifier", "prompt_cache_key", "parallel_tool_calls", "bad_words",
                 "prompt_logprobs", "request_id", "priority", *STRUCTURED_KEYS}
# OpenAI's keys in SAMPLING_KEYS checked here only for their type (bookkeeping, and
# parallel_tool_calls, which chat's tool calls read).
BOOKKEEPING = (("user", str, "a string"), ("metadata", dict, "an object of strings"),
               ("store", bool, "true or false"), ("service_tier", str, "a string"),
               ("safety_identifier", str, "a string"), ("prompt_cache_key", str, "a string"),
               ("parallel_tool_calls", bool, "true or false"))
# how messages become the prompt (vLLM's; `ChatFormat`); reasoning_effort is a template
# variable (gpt-oss's template reads it)
CHAT_FORMAT_KEYS = ("chat_template_kwargs", "add_generation_prompt", "continue_final_message", "reasoning_effort",
                    "documents")
REASONING_EFFORTS = ("low", "medium", "high")
KNOWN_KEYS = {"completion": SAMPLING_KEYS | {"prompt", "logprobs", "echo", "add_special_tokens"} | set(UNSUPPORTED),
              "chat": SAMPLING_KEYS | {"messages", "logprobs", "top_logprobs", "echo", "add_special_tokens",
                                       *CHAT_FORMAT_KEYS} | set(UNSUPPORTED),
              "tokenize": {"model", "prompt", "messages", "tools", "add_special_tokens", "return_token_strs",
                           *CHAT_FORMAT_KEYS},
              "detokenize": {"model", "tokens"}}
MAX_STOPS = 64
MAX_REQUEST_ID = 256  # characters of a request_id (or X-Request-Id): the answer's id repeats it in every chunk
LOGPROB_FLOOR = -9999.0  # what a log-probability of -inf is reported as (JSON has no infinity), as in vLLM
MAX_PROMPTS = 1024  # choices per request: prompts x n


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves temperature, top_p, top_k, min_p or repetition_penalty
    out gets: OpenAI's values, or those of the model's generation_config.json, which vLLM
    and SGLang apply by default (Qwen3, for one, asks for temperature 0.6, top_p 0.95,
    top_k 20). The file's max_new_tokens bounds a chat request without max_tokens, as in vLLM."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0: off
    min_p: float = 0.0          # 0: off
    max_tokens: int | None = None  # chat without max_tokens (None: what fits the context)
    repetition_penalty: float = 1.0  # 1: off

    @classmethod
    def from_folder(cls, folder: str | Path) -> "SamplingDefaults":
        try:
            got = generation_defaults(folder)
        except TreeflashError as e:
            raise UsageError(str(e)) from None
        plain = cls()
        return cls(float(got.get("temperature", plain.temperature)), float(got.get("top_p", plain.top_p)),
                   got.get("top_k", plain.top_k), float(got.get("min_p", plain.min_p)), got.get("max_new_tokens"),
                   float(got.get("repetition_penalty", plain.repetition_penalty)))

    def describe(self) -> str:
        tokens = f", chat max_tokens {self.max_tokens}" if self.max_tokens else ""
        min_p = f", min_p {self.min_p:g}" if self.min_p else ""
        rep = f", repetition_penalty {self.repetition_penalty:g}" if self.repetition_penalty != 1 else ""
        return (f"temperature {self.temperature:g}, top_p {self.top_p:g}, top_k {self.top_k or 'off'}"
                f"{min_p}{rep}{tokens}")


class APIError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Request:
    """One validated request: the prompts as token ids, and how to sample them."""
    kind: str                  # "completion" or "chat"
    prompts: list[list[int]]   # token ids; a completion may hold several prompts
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    n: int = 1                 # choices per prompt
    echo: list[str] | None = None  # completions with echo: each prompt's text, put before its choices' text
    tool_calls: str | None = None  # chat with tools: the parser whose calls become tool_calls (`server.answers`)
    reasoning: str | None = None  # chat: the reasoning parser that splits <think> off (`server.answers`)
    reasoned: bool = True  # whether the answer may reason (not if the prompt closed the reasoning block)
    opened: str | None = None  # Harmony: the header of the message the prompt ends inside (`harmony_opened`)
    continuous_usage: bool = False  # streamed: every choice's event has its usage so far (vLLM's)
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: alternatives per prompt token
    one_call: bool = False  # parallel_tool_calls false: the answer's first tool call only
    named_call: bool = False  # tool_choice names the function: its call ends with 'stop' (OpenAI's)
    echo_only: bool = False  # completions' echo with max_tokens 0: the prompt (and its logprobs) only
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def finish_reason(self, reason: str, called: bool) -> str:
        """An answer that called tools ends with 'tool_calls' where it would with 'stop',
        unless tool_choice named the function (OpenAI's and vLLM's rule)."""
        return "tool_calls" if called and reason == "stop" and not self.named_call else reason

    def message_stream(self) -> MessageStream:
        """What splits a chat answer into reasoning, content and tool calls."""
        return MessageStream(self.reasoning if self.reasoned else None, self.tool_calls, self.opened,
                             1 if self.one_call else None)

    def runs(self) -> list[tuple[list[int], SamplingParams]]:
        """(prompt, params) of each choice, prompt-major (choice index = prompt * n + j).
        With a seed, choice j samples with seed + j: n different answers, reproducible."""
        seeded = self.n > 1 and self.params.seed is not None
        return [(p, self.params.with_seed((self.params.seed + j) % 2 ** 63) if seeded else self.params)
                for p in self.prompts for j in range(self.n)]


def _number(body: dict, key: str, default, kind, lo=None, hi=None, lo_open=False):
    """body[key] checked (null or absent: the default)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind) or (isinstance(value, float) and not math.isfinite(value)):
        what = "an integer" if kind is int else "a finite number"
        raise APIError(f"'{key}' must be {what}, got {shown(value)}", param=key)
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        lo, hi = (f"{b:.6g}" if isinstance(b, float) else b for b in (lo, hi))  # 1e-30, not 9.999999999999999e-31
        bounds = f"{'>' if lo_open else '>='} {lo}" if hi is None else f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise APIError(f"'{key}' must be {bounds}, got {shown(value)}", param=key)
    return value


def _seed(body: dict) -> int | None:
    """The request's seed: vLLM's int64 range (-1: no seed); a negative one is taken mod 2^63."""
    if body.get("seed") == -1:  # vLLM's "no seed" (-1.0 came in as -1)
        return None
    seed = _number(body, "seed", None, int, -2 ** 63, 2 ** 63 - 1)
    return None if seed is None else seed % 2 ** 63


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(f"'{key}' must be true or false, got {shown(value)}", param=key)
    return value


def _min_tokens(body: dict, max_tokens: int) -> int:
    """The request's min_tokens, at most the tokens it may get."""
    min_tokens = _number(body, "min_tokens", 0, int, 0)
    if min_tokens > max_tokens:
        raise APIError(f"'min_tokens' ({min_tokens}) must not exceed the most tokens this request may get "
                       f"({max_tokens})", param="min_tokens")
    return min_tokens


def _sampling(body: dict, prompt_lens: list[int], max_model_len: int, default_tokens: int | None,
              defaults: SamplingDefaults, vocab_size: int | None, kind: str) -> SamplingParams:
    for key, (harmless, why) in UNSUPPORTED.items():
        if any(v is True or v is False for v in harmless) and body.get(key) is not None and \
                not isinstance(body[key], bool):  # 0 and 1 would pass `in` as False and True
            raise APIError(f"'{key}' must be true or false, got {shown(body[key])}", param=key)
        if body.get(key) not in harmless and not (kind == "chat" and key in ("tools", "tool_choice")):
            raise APIError(why, param=key)
    if _number(body, "best_of", 1, int, 1) != 1:
        raise APIError("only best_of = 1 is supported (it ranks choices by logprobs)", param="best_of")
    if _number(body, "priority", 0, int) != 0:
        raise APIError("priority scheduling is not enabled: requests run in arrival order (priority must be 0)",
                       param="priority")
    for name, type_, what in BOOKKEEPING:  # not read, but not taken whatever they hold
        if body.get(name) is not None and (not isinstance(body[name], type_) or (
                type_ is dict and not all(isinstance(v, str) for v in body[name].values()))):
            raise APIError(f"'{name}' must be {what}, got {shown(body[name])}", param=name)
    _number(body, "max_tokens", None, int, 1)  # checked even where max_completion_tokens wins
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = max_model_len - max(prompt_lens)
    asked = _number(body, key, None, int, 1)
    if asked is not None and asked > room:  # in OpenAI's and vLLM's words and code, which clients match
        raise _context_error(ContextLengthError(max_model_len, f"; the prompt holds {max(prompt_lens)} and {key} "
                                                               f"asks for {asked} more", param=key))
    max_tokens = asked if asked is not None else min(default_tokens or room, room)
    top_k = _number(body, "top_k", defaults.top_k, int, -1)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise APIError(f"'stop' must be a string or a list of strings, got {shown(stop)}", param="stop")
    stop = [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]  # "" stops nothing
    if len(stop) > MAX_STOPS:
        raise APIError(f"at most {MAX_STOPS} stop strings, got {len(stop)}", param="stop")
    stop_ids = _token_ids(body, "stop_token_ids", vocab_size, empty=True)
    if stop_ids is not None and len(stop_ids) > MAX_STOPS:
        raise APIError(f"at most {MAX_STOPS} stop token ids, got {len(stop_ids)}", param="stop_token_ids")
    bad_words = body.get("bad_words")
    if bad_words is not None and not (isinstance(bad_words, list) and all(isinstance(w, str) for w in bad_words)):
        raise APIError(f"'bad_words' must be a list of strings, got {shown(bad_words)}", param="bad_words")
    min_tokens = _min_tokens(body, max_tokens)
    try:
        return SamplingParams(
            max_new_tokens=max_tokens, min_tokens=min_tokens, logit_bias=_logit_bias(body, vocab_size),
            allowed_token_ids=_token_ids(body, "allowed_token_ids", vocab_size),
            temperature=float(_number(body, "temperature", defaults.temperature, (int, float), 0, 2)),
            top_k=0 if top_k == -1 else top_k,
            top_p=float(_number(body, "top_p", defaults.top_p, (int, float), 0, 1, lo_open=True)),
            min_p=float(_number(body, "min_p", defaults.min_p, (int, float), 0, 1)),
            presence_penalty=float(_number(body, "presence_penalty", 0.0, (int, float), -MAX_PENALTY, MAX_PENALTY)),
            frequency_penalty=float(_number(body, "frequency_penalty", 0.0, (int, float), -MAX_PENALTY, MAX_PENALTY)),
            repetition_penalty=float(_number(body, "repetition_penalty", defaults.repetition_penalty, (int, float),
                                             1 / MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY)),
            seed=_seed(body), stop=stop,
            ignore_eos=_flag(body, "ignore_eos", False), stop_token_ids=list(stop_ids or []),
            logprobs=_logprobs(body, kind), skip_special_tokens=_flag(body, "skip_special_tokens", True),
            include_stop_str_in_output=_flag(body, "include_stop_str_in_output", False),
            structured_outputs=structured_outputs(body), bad_words=[w for w in bad_words or [] if w.strip()] or None)
    except TreeflashError as e:
        raise APIError(str(e), param=getattr(e, "param", None)) from None


def structured_outputs(body: dict) -> StructuredOutputs | None:
    """The request's constraint on its text, however it asks: vLLM's structured_outputs
    ({"json" | "regex" | "choice": ...}) or guided_json / guided_regex / guided_choice,
    or OpenAI's response_format ({"type": "json_schema", "json_schema": {"schema": ...}};
    "text" asks for nothing). At most one of them."""
    given = [k for k in STRUCTURED_KEYS if body.get(k) is not None
             and not (k == "response_format" and body[k] == {"type": "text"})]
    if len(given) > 1:
        raise APIError(f"give one of {' and '.join(given)}, not both", param=given[1])
    if not given:
        return None
    key, value = given[0], body[given[0]]
    if key == "structured_outputs":
        if not isinstance(value, dict):
            raise APIError(f"'structured_outputs' must be an object, got {shown(value)}", param=key)
        # a client that sends vLLM's whole parameter object sends its unset fields too
        value = {k: v for k, v in value.items() if v is not None and not (k in VLLM_STRUCTURED_FLAGS and v is False)}
        extra = sorted(set(value) - {"json", "regex", "choice", "grammar", "json_object"})
        if extra:
            raise APIError(f"structured_outputs.{extra[0]} is not supported (unknown)", param=key)
        spec = StructuredOutputs(**value)
    elif key == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        schema = value.get("json_schema") if kind == "json_schema" else None
        # a key the type does not read is refused, as OpenAI does: other APIs' {"type":
        # "json_object", "schema": ...} would give JSON that ignores the schema
        own = {"json_object": ("type",), "json_schema": ("type", "json_schema")}.get(kind)
        extra = sorted(k for k, v in value.items() if v is not None and k not in own) if own else []
        if extra:
            where = (f"{{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., \"{extra[0]}\": ...}}}}"
                     if extra[0] in ("schema", "strict", "name", "description") else f"'{kind}' reads only {', '.join(own)}")
            raise APIError(f"'response_format' of type {kind} takes no {shown(extra[0])} ({where})", param=key)
        if kind == "json_object":
            spec = StructuredOutputs(json_object=True)
        elif isinstance(schema, dict) and isinstance(schema.get("schema"), dict):
            spec = StructuredOutputs(json=schema["schema"])
        else:
            raise APIError("'response_format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                           "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                           param=key)
    else:
        spec = StructuredOutputs(**{key.removeprefix("guided_"): value})
    try:
        return spec.validate()
    except UsageError as e:
        raise APIError(str(e), param=key) from None


def _logit_bias(body: dict, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias: an object of token ids (as strings) -> a bias in [-100, 100]."""
    if body.get("logit_bias") is None:
        return None
    try:
        out = token_bias(body["logit_bias"])
    except UsageError as e:
        raise APIError(str(e).replace("logit_bias", "'logit_bias'", 1), param="logit_bias") from None
    for value in out.values():
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise APIError(f"'logit_bias' values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                           f"got {shown(value)}", param="logit_bias")
    if out and vocab_size is not None and max(out) >= vocab_size:
        raise APIError(f"'logit_bias' token id {max(out)} is outside the vocabulary of {vocab_size}",
                       param="logit_bias")
    return {t: float(v) for t, v in out.items()}


def _token_ids(body: dict, key: str, vocab_size: int | None, empty: bool = False) -> list[int] | None:
    """body[key]: a list of token ids in the vocabulary (non-empty unless `empty`), or None."""
    ids = body.get(key)
    if ids is None:
        return None
    if not (isinstance(ids, list) and (ids or empty) and all(isinstance(t, int) and not isinstance(t, bool)
                                                             and t >= 0 for t in ids)):
        what = "a list of token ids" if empty else "a non-empty list of token ids"
        raise APIError(f"'{key}' must be {what}, got {shown(ids)}", param=key)
    if ids and vocab_size is not None and max(ids) >= vocab_size:
        raise APIError(f"'{key}' token id {max(ids)} is outside the vocabulary of {vocab_size}", param=key)
    return ids


def _logprobs(body: dict, kind: str) -> int | None:
    """How many alternatives per token to report (0: the chosen token's log-probability
    only), or None: no logprobs. Completions ask with `logprobs: N`; chat with
    `logprobs: true` and `top_logprobs: N`."""
    if kind == "completion":
        if body.get("logprobs") is False:  # what clients send for "off"
            return None
        return _number(body, "logprobs", None, int, 0, MAX_LOGPROBS)
    top = _number(body, "top_logprobs", None, int, 0, MAX_LOGPROBS)
    off = type(body.get("logprobs")) is int and body["logprobs"] == 0  # 0 means false, as it did before
    if not off and _flag(body, "logprobs", False):
        return top or 0
    if top:
        raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return None


def _stream_flags(body: dict) -> tuple[bool, bool, bool]:
    """`stream`, `stream_options.include_usage` and vLLM's `continuous_usage_stats`
    (usage in every event; it needs include_usage, as in vLLM); options need a stream
    (as OpenAI answers), and an option this server does not know is refused."""
    stream = _flag(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not isinstance(options, dict):
        raise APIError("'stream_options' must be an object", param="stream_options")
    if not stream:
        raise APIError("'stream_options' needs 'stream': true", param="stream_options")
    flags = {}
    for key in ("include_usage", "continuous_usage_stats", "include_obfuscation"):  # no padding to obfuscate
        flags[key] = options.get(key)
        if flags[key] is not None and not isinstance(flags[key], bool):
            raise APIError(f"'stream_options.{key}' must be true or false, got {shown(flags[key])}",
                           param="stream_options")
    if flags["continuous_usage_stats"] and not flags["include_usage"]:
        raise APIError("'stream_options.continuous_usage_stats' needs 'include_usage': true", param="stream_options")
    if unknown := sorted(set(options) - set(flags)):
        raise APIError(f"unknown stream option '{unknown[0]}'", param="stream_options")
    return stream, bool(flags["include_usage"]), bool(flags["continuous_usage_stats"])


def check_model(body: dict, served: str | tuple[str, ...]) -> None:
    """The body's model, if it names one, is among the `served` names (the first one is
    what responses say)."""
    names = (served,) if isinstance(served, str) else served
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(f"'model' must be a string, got {shown(model)}", param="model")
    if model and model not in names:  # "" (as null): the served model, as vLLM answers
        raise unknown_model(model, names)


def unknown_model(model, names: tuple[str, ...]) -> APIError:
    return APIError(f"the model {shown(model)} does not exist (this server serves "
                    f"{', '.join(repr(n) for n in names)})", status=404, param="model", code="model_not_found")


def check_keys(body: dict, kind: str) -> None:
    unknown = sorted(k for k in body if k not in KNOWN_KEYS[kind])
    if unknown:
        raise APIError(f"unrecognized request argument {shown(unknown[0])}", param=unknown[0][:80])


INTEGER_KEYS = ("max_tokens", "max_completion_tokens", "n", "seed", "top_k", "min_tokens", "best_of", "top_logprobs",
                "prompt_logprobs", "truncate_prompt_tokens", "priority")


def _whole_numbers(body: dict, kind: str) -> dict:
    """The body with its integer fields' whole-number floats as integers: vLLM's pydantic
    models take max_tokens 100.0 as 100 (100.5 is still refused below)."""
    keys = INTEGER_KEYS + (("logprobs",) if kind == "completion" else ())  # chat's logprobs is a flag
    whole = {k: int(v) for k in keys if isinstance(v := body.get(k), float) and v.is_integer()}
    return {**body, **whole} if whole else body


def parse_completion(body: dict, served: str | tuple[str, ...], encode, max_model_len: int,
                     defaults: SamplingDefaults = SamplingDefaults(), vocab_size: int | None = None,
                     decode=None) -> Request:
    """A /v1/completions body. `encode(prompt)` turns a string or token ids into checked
    token ids (the engine's own checks: vocabulary, length); `decode(ids)` gives a
    token-id prompt's text, for echo."""
    check_keys(body, "completion")
    check_model(body, served)
    body = _whole_numbers(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                                                   for t in p)) for p in prompt):
        prompts = prompt
    else:
        raise APIError("'prompt' must be a string, a list of token ids, or a non-empty list of those",
                       param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", param="prompt")
    special = _flag(body, "add_special_tokens", True)  # a text prompt's BOS (vLLM's default: added)
    truncate = _truncation(body, max_model_len)
    ids = [_encode(encode, p, param="prompt", special=special, truncate=truncate) for p in prompts]
    stream, include_usage, continuous = _stream_flags(body)
    # OpenAI's legacy API and vLLM: echo with max_tokens 0 scores the prompt and generates nothing
    echo_only = body.get("echo") is True and type(body.get("max_tokens")) is int and body["max_tokens"] == 0 \
        and body.get("max_completion_tokens") is None
    if echo_only:
        _min_tokens(body, 0)  # (the one token generated below is dropped: a min_tokens would do nothing)
        body = {**body, "max_tokens": 1}  # one token is generated (the engine needs a round), and dropped
    params = _sampling(body, [len(i) for i in ids], max_model_len, DEFAULT_COMPLETION_TOKENS, defaults, vocab_size,
                       "completion")
    echo = None
    if _flag(body, "echo", False):
        if params.logprobs is not None and stream:
            raise APIError("echo with logprobs is not streamed (the prompt's logprobs come whole)", param="echo")
        # the prompt as the model read it: a token-id or truncated prompt's text is decoded
        echo = [p if isinstance(p, str) and truncate is None else decode(i, params.skip_special_tokens)
                for p, i in zip(prompts, ids)]
        params = replace(params, prompt_logprobs=params.logprobs)  # scoring a text, as lm-eval does
    params, k = _with_prompt_logprobs(body, params, stream)
    return Request("completion", ids, params, stream, include_usage, _choices(body, len(ids)), echo=echo,
                   continuous_usage=continuous, prompt_logprobs=k, echo_only=echo_only, id=request_id(body))


def _with_prompt_logprobs(body: dict, params: SamplingParams, stream: bool) -> tuple[SamplingParams, int | None]:
    """vLLM's prompt_logprobs (0 to MAX_LOGPROBS alternatives per prompt token, besides
    the token itself): params that compute them (as many as echo's logprobs also need),
    and how many to report."""
    k = body.get("prompt_logprobs")
    if k is None:
        return params, None
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS:
        raise APIError(f"'prompt_logprobs' must be an integer from 0 to {MAX_LOGPROBS} (-1, the whole vocabulary, "
                       f"is not supported), got {shown(k)}", param="prompt_logprobs")
    if stream:
        raise APIError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    return replace(params, prompt_logprobs=max(k, params.prompt_logprobs or 0)), k


def _truncation(body: dict, max_model_len: int) -> int | None:
    """vLLM's truncate_prompt_tokens: keep a prompt's last k tokens (-1: as many as fit);
    k below the context limit, checked here to be named (the engine's check would name
    the prompt)."""
    k = _number(body, "truncate_prompt_tokens", None, int, -1, max_model_len - 1)
    if k == 0:
        raise APIError("'truncate_prompt_tokens' must be >= 1, or -1 (as many as fit)",
                       param="truncate_prompt_tokens")
    return k


def request_id(body: dict) -> str:
    """The id an answer has after its "cmpl-" or "chatcmpl-": vLLM's request_id field, else
    a new one (the server's X-Request-Id header wins over both, as in vLLM)."""
    given = body.get("request_id")
    return uuid.uuid4().hex if given is None else checked_id(given, "'request_id'", param="request_id")


def checked_id(given, name: str, param: str | None = None) -> str:
    """A request id a client gave (its request_id, or X-Request-Id): 1 to MAX_REQUEST_ID
    characters, as the answer repeats it in every chunk."""
    if not (isinstance(given, str) and 0 < len(given) <= MAX_REQUEST_ID):
        raise APIError(f"{name} must be a string of 1 to {MAX_REQUEST_ID} characters, got {shown(given)}",
                       param=param)
    return given


def _choices(body: dict, prompts: int) -> int:
    """`n`, the choices per prompt."""
    n = _number(body, "n", 1, int, 1)
    if n * prompts > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} choices per request (prompts x n), got {n * prompts}", param="n")
    return n


def parse_chat(body: dict, served: str | tuple[str, ...], template, encode, max_model_len: int,
               defaults: SamplingDefaults = SamplingDefaults(), vocab_size: int | None = None,
               tool_parser: str | None = None, reasoning_parser: str | None = None) -> Request:
    """A /v1/chat/completions body: the messages (and tools, with a `tool_parser`)
    rendered by the model's chat template; with a `reasoning_parser` its answers'
    reasoning comes back apart, and a structured output constrains what follows it
    (Harmony's, openai_gptoss: the answer is decoded with its special tokens for the
    parser, and structured outputs are refused)."""
    tool_parser, reasoning_parser = chat_parsers(tool_parser, reasoning_parser)
    check_keys(body, "chat")
    check_model(body, served)
    body = _whole_numbers(body, "chat")
    if body.get("echo") not in (None, False):
        raise APIError("echo is supported for completions only", param="echo")
    try:
        tools, reader, forced = request_tools(body, tool_parser)
    except UsageError as e:
        raise APIError(str(e), param=e.param) from None
    # the template writes its own special tokens; add_special_tokens adds the tokenizer's too (vLLM)
    text = render_chat(body, template, tools)
    ids = [_encode(encode, text, param="messages", special=_flag(body, "add_special_tokens", False),
                   truncate=_truncation(body, max_model_len))]
    stream, include_usage, continuous = _stream_flags(body)
    params = _sampling(body, [len(ids[0])], max_model_len, defaults.max_tokens, defaults, vocab_size, "chat")
    if forced is not None:  # tool_choice 'required' or a named function: the answer is the calls
        if params.structured_outputs is not None:
            asked = next(k for k in STRUCTURED_KEYS if body.get(k) is not None)
            raise APIError(f"give tool_choice that forces a call or {asked}, not both", param=asked)
        try:
            params = replace(params, structured_outputs=StructuredOutputs(json=forced))
        except UsageError as e:
            raise APIError(str(e), param="tool_choice") from None
    opened = None
    if reasoning_parser == HARMONY:
        if params.structured_outputs is not None:
            asked = "tool_choice" if forced is not None else next(
                k for k in STRUCTURED_KEYS if body.get(k) is not None
                and not (k == "response_format" and body[k] == {"type": "text"}))
            what = "a forced tool call (tool_choice 'required' or a named function)" if forced is not None \
                else f"structured outputs ({asked})"
            raise APIError(f"{what} is not supported with the {HARMONY} reasoning parser (gpt-oss): the constraint "
                           f"cannot wait for the final channel, whose markers are special tokens", param=asked)
        # the parser reads the markers, special tokens; the parts it gives the client hold none
        params, opened = replace(params, skip_special_tokens=False), harmony_opened(text)
    tags = REASONING_TAGS.get(reasoning_parser)
    # the messages were checked as they were rendered: only the final one's text is read again
    final = plain_messages(body["messages"][-1:])[0]["content"] if _flag(body, "continue_final_message", False) \
        else None
    inside = None if tags is None else left_in_reasoning(text, tags, final)
    reasoned = reasoning_parser is not None and inside is not False
    if inside:  # the answer starts inside its reasoning: read as deepseek_r1 reads it
        reasoning_parser = next(p for p, t in REASONING_TAGS.items() if t == (None, tags[1]))
    if reasoned and params.structured_outputs is not None:  # the answer reasons first (vLLM's)
        params = replace(params, structured_outputs=replace(params.structured_outputs, reasoning=reasoning_parser))
    params, k = _with_prompt_logprobs(body, params, stream)
    return Request("chat", ids, params, stream, include_usage, _choices(body, 1), tool_calls=reader,
                   reasoning=reasoning_parser, reasoned=reasoned, opened=opened, continuous_usage=continuous,
                   prompt_logprobs=k, one_call=body.get("parallel_tool_calls") is False,
                   named_call=isinstance(body.get("tool_choice"), dict), id=request_id(body))


def left_in_reasoning(text: str, tags: tuple[str | None, str], final: str | None) -> bool | None:
    """Where a chat prompt `text` leaves the answer with respect to its reasoning block
    (`tags`: its opening and closing tags): True inside it, False past it, None not known
    (it may reason first). A continued final message (`final`, its text) decides where
    it opened or closed the block: "<think>Let me see" is continued inside it, and
    "<think>...</think>The answer" past it. Otherwise the prompt's end does: the opening
    tag (Qwen3-Thinking-2507's template) leaves the answer inside, the closing tag
    (Qwen3's with enable_thinking false) past it."""
    opening, closing = tags
    if final is not None:
        opened, closed = (final.rfind(opening) if opening else -1), final.rfind(closing)
        if opened != closed:  # not both -1
            return opened > closed
    end = text.rstrip()
    if end.endswith(closing):
        return False
    return True if opening and end.endswith(opening) else None


def render_chat(body: dict, template, tools: list[dict] | None = None) -> str:
    """The body's messages (text only, and tool calls) as the chat template renders them
    with `tools`, in the body's `ChatFormat` (vLLM's chat_template_kwargs,
    add_generation_prompt, continue_final_message)."""
    try:
        plain_messages(body.get("messages"))  # a malformed message is named first, template or not
    except UsageError as e:
        raise APIError(str(e), param="messages") from None
    fmt = ChatFormat(body.get("chat_template_kwargs"), _flag(body, "add_generation_prompt", True),
                     _flag(body, "continue_final_message", False))
    try:
        fmt.checked()
    except UsageError as e:
        raise APIError(str(e), param=e.param) from None
    docs = body.get("documents")
    if docs is not None:  # vLLM's: for the template's retrieval-augmented prompt (chat_template_kwargs' wins)
        if not (isinstance(docs, list) and all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values())
                                               for d in docs)):
            raise APIError(f"'documents' must be a list of objects of strings, got {shown(docs)}", param="documents")
        fmt = replace(fmt, variables={"documents": docs, **(fmt.variables or {})})
    effort = body.get("reasoning_effort")
    if effort is not None:  # chat_template_kwargs' own value wins
        if effort not in REASONING_EFFORTS:
            raise APIError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {shown(effort)}",
                           param="reasoning_effort")
        fmt = replace(fmt, variables={"reasoning_effort": effort, **(fmt.variables or {})})
    if template is not None:
        try:
            return template.prompt(body.get("messages"), fmt, tools)
        except UsageError as e:
            raise APIError(str(e), param="messages") from None
    raise APIError("this model has no chat template (tokenizer_config.json 'chat_template' or "
                   "chat_template.jinja): use /v1/completions")


def parse_tokenize(body: dict, served: str | tuple[str, ...], template, tokenizer) -> tuple[list[int], bool]:
    """A /tokenize body (vLLM's): the token ids of a prompt, or of chat messages (and
    tools) as the template renders them (`add_special_tokens`: default true for a prompt,
    false for messages, whose template writes its own), and whether `return_token_strs`
    asks for the tokens as the vocabulary spells them."""
    check_keys(body, "tokenize")
    check_model(body, served)
    return _tokenize(body, template, tokenizer), _flag(body, "return_token_strs", False)


def _tokenize(body: dict, template, tokenizer) -> list[int]:
    if ("prompt" in body) == ("messages" in body):
        raise APIError("give either 'prompt' or 'messages'", param="prompt")
    if "messages" in body:
        try:
            tools = checked_tools(body.get("tools"))
        except UsageError as e:
            raise APIError(str(e), param=e.param) from None
        return tokenizer.encode(render_chat(body, template, tools), _flag(body, "add_special_tokens", False))
    for key in (*CHAT_FORMAT_KEYS, "tools"):
        if body.get(key) is not None:
            raise APIError(f"{key} applies to 'messages'", param=key)
    if not isinstance(body["prompt"], str):
        raise APIError("'prompt' must be a string", param="prompt")
    if not is_text(body["prompt"]):
        raise APIError("'prompt' must be valid Unicode text", param="prompt")
    return tokenizer.encode(body["prompt"], _flag(body, "add_special_tokens", True))


def parse_detokenize(body: dict, served: str | tuple[str, ...], vocab_size: int) -> list[int]:
    """A /detokenize body (vLLM's): token ids to turn back into text."""
    check_keys(body, "detokenize")
    check_model(body, served)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                               and 0 <= t < vocab_size for t in tokens):
        raise APIError(f"'tokens' must be a list of token ids below {vocab_size}", param="tokens")
    return tokens


def _context_error(e: ContextLengthError, param: str | None = None) -> APIError:
    """OpenAI's answer to a request past the context: its words and its code."""
    return APIError(str(e), param=param or e.param, code="context_length_exceeded")


def _encode(encode, prompt, param: str, **kw) -> list[int]:
    try:
        return encode(prompt, **kw)
    except ContextLengthError as e:
        raise _context_error(e, param) from None
    except TreeflashError as e:
        raise APIError(str(e), param=param) from None


def usage(req: Request, outputs) -> dict:
    """OpenAI's usage of a request's GenerationOutputs (n per prompt: its prompt counted
    once); with prefix caching, the prompt tokens found in the caches (its first choice's)."""
    prompt_tokens, completion_tokens = sum(map(len, req.prompts)), sum(len(o.token_ids) for o in outputs)
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if outputs and "cached_tokens" in outputs[0].stats:
        body["prompt_tokens_details"] = {"cached_tokens": sum(o.stats["cached_tokens"] for o in outputs[::req.n])}
    return body


def logprobs_body(req: Request, entries, tokenizer, offset: int = 0, first: int | None = None) -> dict | None:
    """The OpenAI `logprobs` of a choice's tokens (`TokenLogprob`s; None if the request
    did not ask). Completions: the legacy lists, each token's text offset counted from
    `offset` (a stream's characters so far) and its alternatives as {text: logprob},
    the chosen one included (null for an echoed prompt's first token, `first`, which
    nothing predicts: its entry is None, as in `prompt_logprobs`). Chat: one entry per token with its bytes, which rebuild characters that
    a token splits."""
    if req.params.logprobs is None:
        return None

    def value(lp: float) -> float | None:  # JSON has no NaN or infinity
        return None if math.isnan(lp) else max(lp, LOGPROB_FLOOR)

    if req.kind == "chat":
        def item(token_id, lp):
            return {"token": tokenizer.token_text(token_id), "logprob": value(lp),
                    "bytes": list(tokenizer.token_bytes(token_id))}
        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                            for e in entries]}
    tokens = [tokenizer.token_text(first if e is None else e.token_id) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    k = req.params.logprobs  # prompt_logprobs may have computed more alternatives for the echoed prompt
    top = [None if e is None else
           {tokenizer.token_text(i): value(lp) for i, lp in [*e.top[:k], (e.token_id, e.logprob)]} for e in entries]
    return {"tokens": tokens, "token_logprobs": [None if e is None else value(e.logprob) for e in entries],
            "top_logprobs": top, "text_offset": offsets}


def response(req: Request, model: str, outputs, tokenizer=None) -> dict:
    """The whole (non-streamed) answer to `req` from its GenerationOutputs (`tokenizer`
    names the tokens of logprobs, if asked)."""
    chat = req.kind == "chat"
    echoed = req.echo is not None and req.params.logprobs is not None
    choices = [{"index": i, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                "logprobs": logprobs_body(req, (out.prompt_logprobs if echoed else []) + (out.logprobs or []),
                                          tokenizer, first=out.prompt_token_ids[0] if echoed else None),
                **({"message": message(req, out)} if chat else
                   {"text": (req.echo[i // req.n] if req.echo else "") + out.text}),
                **({"prompt_logprobs": prompt_logprobs_body(req, out, tokenizer)} if not chat
                   and req.prompt_logprobs is not None else {})}
               for i, out in enumerate(outputs)]
    for choice in choices:
        if chat:
            choice["finish_reason"] = req.finish_reason(choice["finish_reason"], "tool_calls" in choice["message"])
    return {"id": ("chatcmpl-" if chat else "cmpl-") + req.id,
            "object": "chat.completion" if chat else "text_completion", "created": req.created,
            "model": model, "choices": choices,
            **({"prompt_logprobs": prompt_logprobs_body(req, outputs[0], tokenizer)} if chat
               and req.prompt_logprobs is not None else {}),
            "usage": usage(req, outputs)}


def prompt_logprobs_body(req: Request, out, tokenizer) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, null for the first (nothing predicts
    it), then {token id: {logprob, rank, decoded_token}} for the token itself (its rank
    in the vocabulary) and the `req.prompt_logprobs` most likely ids (ranks 1, 2, ...)."""
    def item(token_id: int, lp: float, rank: int | None) -> dict:
        return {"logprob": None if math.isnan(lp) else max(lp, LOGPROB_FLOOR), "rank": rank,
                "decoded_token": tokenizer.token_text(token_id)}

    return [None if e is None else
            {str(e.token_id): item(e.token_id, e.logprob, e.rank),
             **{str(i): item(i, lp, r) for r, (i, lp) in enumerate(e.top[:req.prompt_logprobs], 1) if i != e.token_id}}
            for e in out.prompt_logprobs]


def message(req: Request, out) -> dict:
    """A chat answer's message: its text, or with a reasoning parser or tools, its parts
    (`treeflash.server.answers`); a part that is empty is null."""
    reasoning, content, calls = req.message_stream().push(out.text, final=True)
    calls = [{k: v for k, v in c.items() if k != "index"} for c in calls]
    return {"role": "assistant", "content": (content or None) if calls or req.reasoning else content,
            **({"reasoning_content": reasoning or None} if req.reasoning else {}),
            **({"tool_calls": calls} if calls else {})}


def chunk(req: Request, model: str, text: str | None = None, finish_reason: str | None = None,
          first: bool = False, usage_: dict | None = None, stop_reason: int | str | None = None,
          index: int = 0, logprobs: dict | None = None, tool_calls: list[dict] | None = None,
          reasoning: str | None = None, generated: int = 0) -> dict:
    """One streamed event of choice `index`: a text delta (with its tokens' `logprobs`
    body, if asked), chat reasoning or tool calls (each with its `index` among the
    choice's calls), the finish reason (with vLLM's stop_reason: the stop token id or
    string), or (choices empty) the usage; with continuous usage, a choice's event has
    its usage so far (`generated` tokens)."""
    chat = req.kind == "chat"
    if usage_ is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant"} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]
    else:
        choices = [{"index": index, "text": text or "", "finish_reason": finish_reason, "logprobs": logprobs}]
    if finish_reason is not None:
        choices[0]["stop_reason"] = stop_reason
    out = {"id": ("chatcmpl-" if chat else "cmpl-") + req.id,
           "object": "chat.completion.chunk" if chat else "text_completion", "created": req.created,
           "model": model, "choices": choices}
    if usage_ is None and req.continuous_usage:
        prompt = len(req.prompts[index // req.n])
        usage_ = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    if usage_ is not None:
        out["usage"] = usage_
    return out
