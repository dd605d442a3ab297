"""OpenAI request bodies in, engine requests and OpenAI response bodies out.

Everything a client can get wrong is checked here, before the engine sees it, and
becomes an `APIError` with the status and error body OpenAI (and vLLM) use.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from treeflash.engine.sampling import SamplingParams
from treeflash.errors import TreeflashError

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions

# Parameters of the OpenAI API this engine cannot honour: refused, never silently ignored.
UNSUPPORTED = {
    "logprobs": "logprobs are not supported",
    "top_logprobs": "logprobs are not supported",
    "echo": "echo is not supported",
    "suffix": "suffix is not supported",
    "logit_bias": "logit_bias is not supported",
    "tools": "tool calls are not supported",
    "functions": "function calls are not supported",
    "response_format": "response_format is not supported",
}


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
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _number(body: dict, key: str, default, kind, lo=None, hi=None, lo_open=False):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise APIError(f"'{key}' must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=key)
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        bounds = f"{'>' if lo_open else '>='} {lo}" if hi is None else f"in {'(' if lo_open else '['}{lo}, {hi}]"
        raise APIError(f"'{key}' must be {bounds}, got {value!r}", param=key)
    return value


def _sampling(body: dict, prompt_lens: list[int], max_model_len: int, default_tokens: int | None) -> SamplingParams:
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False, 0, {}, []):
            raise APIError(why, param=key)
    if _number(body, "n", 1, int, 1) != 1 or _number(body, "best_of", 1, int, 1) != 1:
        raise APIError("only n = 1 is supported (send several requests instead)", param="n")
    for key in ("presence_penalty", "frequency_penalty"):
        if _number(body, key, 0, (int, float), -2, 2) != 0:
            raise APIError(f"'{key}' is not supported: sampling stays exactly the target model's", param=key)
    if _number(body, "repetition_penalty", 1, (int, float), 0, lo_open=True) != 1:
        raise APIError("'repetition_penalty' is not supported: sampling stays exactly the target model's",
                       param="repetition_penalty")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = max_model_len - max(prompt_lens)
    max_tokens = _number(body, key, default_tokens or room, int, 1)
    if max_tokens > room:
        raise APIError(f"this model's maximum context length is {max_model_len} tokens; the prompt holds "
                       f"{max(prompt_lens)} and {key} asks for {max_tokens} more", param=key)
    top_k = _number(body, "top_k", 0, int, -1)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise APIError(f"'stop' must be a string or a list of strings, got {stop!r}", param="stop")
    stop = [stop] if isinstance(stop, str) else [s for s in stop or [] if s]
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise APIError(f"'ignore_eos' must be true or false, got {ignore_eos!r}", param="ignore_eos")
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, (int, float), 0, 2)),
        top_k=0 if top_k == -1 else top_k,
        top_p=float(_number(body, "top_p", 1.0, (int, float), 0, 1, lo_open=True)),
        seed=_number(body, "seed", None, int, 0, 2 ** 63 - 1), stop=stop, ignore_eos=ignore_eos)
    try:
        return params.validate()
    except TreeflashError as e:
        raise APIError(str(e)) from None


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(f"'stream' must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError("'stream_options' must be an object", param="stream_options")
    return stream, bool(options.get("include_usage", False)) and stream


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise APIError(f"the model '{model}' does not exist (this server serves '{served}')",
                       status=404, param="model", code="model_not_found")


def parse_completion(body: dict, served: str, encode, max_model_len: int) -> Request:
    """A /v1/completions body. `encode(prompt)` turns a string or token ids into checked
    token ids (the engine's own checks: vocabulary, length)."""
    check_model(body, served)
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
    ids = [_encode(encode, p) for p in prompts]
    stream, usage = _stream_flags(body)
    if stream and len(ids) > 1:
        raise APIError("streaming takes one prompt per request", param="prompt")
    params = _sampling(body, [len(i) for i in ids], max_model_len, DEFAULT_COMPLETION_TOKENS)
    return Request("completion", ids, params, stream, usage)


def parse_chat(body: dict, served: str, template, encode, max_model_len: int) -> Request:
    """A /v1/chat/completions body: the messages rendered by the model's chat template."""
    check_model(body, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list of messages", param="messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(f"messages[{i}]: only text content parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(f"messages[{i}] must have string 'content'", param="messages")
        plain.append({"role": m["role"], "content": content})
    if template is None:
        raise APIError("this model has no chat template (tokenizer_config.json 'chat_template'): "
                       "use /v1/completions")
    try:
        text = template.render(plain)
    except TreeflashError as e:
        raise APIError(f"the chat template refused the messages: {e}", param="messages") from None
    ids = [_encode(encode, text, special=False)]
    stream, usage = _stream_flags(body)
    return Request("chat", ids, _sampling(body, [len(ids[0])], max_model_len, None), stream, usage)


def _encode(encode, prompt, **kw) -> list[int]:
    try:
        return encode(prompt, **kw)
    except TreeflashError as e:
        raise APIError(str(e), param="prompt") from None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(req: Request, model: str, outputs) -> dict:
    """The whole (non-streamed) answer to `req` from its GenerationOutputs."""
    chat = req.kind == "chat"
    choices = [{"index": i, "finish_reason": out.finish_reason, "logprobs": None,
                **({"message": {"role": "assistant", "content": out.text}} if chat else {"text": out.text})}
               for i, out in enumerate(outputs)]
    return {"id": ("chatcmpl-" if chat else "cmpl-") + req.id,
            "object": "chat.completion" if chat else "text_completion", "created": req.created,
            "model": model, "choices": choices,
            "usage": usage(sum(map(len, req.prompts)), sum(len(o.token_ids) for o in outputs))}


def chunk(req: Request, model: str, text: str | None = None, finish_reason: str | None = None,
          first: bool = False, usage_: dict | None = None) -> dict:
    """One streamed event: a text delta, the finish reason, or (choices empty) the usage."""
    chat = req.kind == "chat"
    if usage_ is not None:
        choices = []
    elif chat:
        delta = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    else:
        choices = [{"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}]
    out = {"id": ("chatcmpl-" if chat else "cmpl-") + req.id,
           "object": "chat.completion.chunk" if chat else "text_completion", "created": req.created,
           "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out
