"""A chat answer split into the parts OpenAI's message has: reasoning, content and tool
calls, whole or streamed. Decoding is not touched: the parts are text like any other,
so every method stays exact.

- Reasoning (vLLM's `--reasoning-parser`): a thinking model's `<think>...</think>`
  becomes `reasoning_content`. `qwen3`: Qwen3's hybrid models open the block themselves
  (with enable_thinking false their template writes an empty one into the prompt and
  the answer has none): reasoning only if the answer starts with `<think>`.
  `deepseek_r1`: the template's generation prompt opens the block (DeepSeek-R1,
  Qwen3-Thinking-2507), so the answer starts inside it. An answer cut off before
  `</think>` is all reasoning. With either, a prompt that ends with `</think>` (Qwen3
  with enable_thinking false) leaves the answer none: it is all content
  (`Request.reasoned` in `server.protocol`).
- Tool calls (vLLM's `--tool-call-parser`): the request's tools go to the chat
  template, and the model's calls become `tool_calls`. `hermes`: `<tool_call>{"name":
  ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Qwen3, Hermes); the content is
  the rest of the text, and with calls the whitespace that ends it, or starts it after a
  call, is dropped; a block that is not such JSON stays content, as written.
  `llama3_json`: an answer that is JSON calls, `{"name": ..., "parameters": {...}}`,
  separated by ';' and after an optional `<|python_tag|>` (Llama 3.1-3.3); an answer
  that does not start so, or does not parse, is content.

Streamed, each part is sent as soon as it is known: text that may begin a tag is held
until it does or cannot, and a call is one delta when its block closes.
"""
from __future__ import annotations

import json
import uuid

from treeflash.chat import checked_tools
from treeflash.errors import UsageError, shown
from treeflash.structured.grammar import REASONING_TAGS

TOOL_PARSERS = ("hermes", "llama3_json")
REASONING_PARSERS = tuple(REASONING_TAGS)  # structured outputs wait for the reasoning these split off
THINK, END_THINK = REASONING_TAGS["qwen3"]
CALL, END_CALL = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def request_tools(body: dict, parser: str | None) -> tuple[list[dict] | None, str | None, dict | None]:
    """(the body's `tools` as the template takes them, or None; what reads the answer's
    calls: a parser's name, FORCED, or None; for a forced call, the JSON schema the
    answer must follow). tool_choice 'none': the tools are written into the prompt, the
    answer is not read for calls (vLLM's default); 'auto': the parser reads them;
    'required' or a named function: the answer is constrained to a JSON list of calls
    (`forced_calls_schema`), with or without a parser. A UsageError (with `param`) for
    malformed tools or tool_choice, or automatic calls on a server without a parser."""
    tools, choice = checked_tools(body.get("tools")), body.get("tool_choice")
    named = isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
        choice.get("function"), dict) and isinstance(choice["function"].get("name"), str)
    if not (choice in (None, "none", "auto", "required") or named):
        raise UsageError(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, got {shown(choice)}", param="tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise UsageError("tool_choice forces a call, but the request has no tools", param="tool_choice")
        return None, None, None
    if choice == "none":
        return tools, None, None
    if choice in (None, "auto"):
        if parser is None:
            raise UsageError(f"tool calls need a server started with --tool-call-parser "
                             f"({' or '.join(TOOL_PARSERS)}), or a tool_choice that forces them", param="tools")
        return tools, parser, None
    one = body.get("parallel_tool_calls") is False
    return tools, FORCED, forced_calls_schema(tools, choice["function"]["name"] if named else None, one)


FORCED = "forced"  # the reader of answers that tool_choice constrained to a JSON list of calls


def forced_calls_schema(tools: list[dict], name: str | None = None, one: bool = False) -> dict:
    """The JSON schema of an answer that must call a tool (vLLM's form for tool_choice
    'required'): a list of at least one {"name", "parameters"}, each the name of one of
    the tools (or `name`, then exactly one call) with its parameters' schema; `one`: at
    most one call (parallel_tool_calls false)."""
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not functions:
        raise UsageError(f"tool_choice names the function {shown(name)}, which is not among the tools",
                         param="tool_choice")
    calls, defs = [], {}
    for i, f in enumerate(functions):
        params = f.get("parameters") or {}
        if params.get("type", "object") == "object" and not {"properties", "$ref", "anyOf", "oneOf"} & set(params):
            params = {"type": "object", "properties": {}}  # no parameters listed: called with {}
        params, own = _hoisted(params, f"f{i}_")
        defs.update(own)
        calls.append({"type": "object", "required": ["name", "parameters"],
                      "properties": {"name": {"enum": [f["name"]]}, "parameters": params}})
    return {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1,
            **({"maxItems": 1} if name is not None or one else {}), **({"$defs": defs} if defs else {})}


def _hoisted(schema: dict, prefix: str) -> tuple[dict, dict]:
    """A tool's parameter schema without its own definitions, and those definitions
    renamed with `prefix`: its `#/$defs/X` (or `#/definitions/X`) references then resolve
    in the schema of the whole answer, which holds every tool's."""
    own = {}
    for defs in (schema.get("definitions"), schema.get("$defs")):
        own.update(defs if isinstance(defs, dict) else {})

    def renamed(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
                node = {**node, "$ref": "#/$defs/" + prefix + ref.split("/", 2)[2]}
            return {k: renamed(v) for k, v in node.items() if k not in ("$defs", "definitions")}
        return [renamed(v) for v in node] if isinstance(node, list) else node
    return renamed(schema), {prefix + k: renamed(v) for k, v in own.items()}


def _tag_start(text: str, tag: str) -> int:
    """How many of text's last characters could begin `tag` (held back until known);
    all of them while the whole text may still become the tag."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningStream:
    """Splits text, fed in pieces, into (reasoning, the rest); the whitespace between
    `</think>` and the rest is dropped."""

    def __init__(self, parser: str):
        assert parser in REASONING_PARSERS
        self.parser, self.held = parser, ""
        self.state = "start"  # start (is there an opening tag?), thinking, lead (whitespace after it), answer

    def push(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = rest = ""
        while True:
            if self.state == "start":
                if _tag_start(self.held, THINK) == len(self.held):
                    return reasoning, rest  # not yet known
                opened = self.held.startswith(THINK)
                if opened:
                    self.held = self.held[len(THINK):]
                self.state = "thinking" if opened or self.parser == "deepseek_r1" else "answer"
            elif self.state == "thinking":
                at = self.held.find(END_THINK)
                if at < 0:
                    keep = len(self.held) - _tag_start(self.held, END_THINK)
                    reasoning, self.held = reasoning + self.held[:keep], self.held[keep:]
                    return reasoning, rest
                reasoning += self.held[:at]
                self.held, self.state = self.held[at + len(END_THINK):], "lead"
            elif self.state == "lead":
                self.held = self.held.lstrip()
                if not self.held:
                    return reasoning, rest
                self.state = "answer"
            else:
                rest, self.held = rest + self.held, ""
                return reasoning, rest

    def finish(self) -> tuple[str, str]:
        """What is held at the end: a partial tag is text of the part it was in."""
        held, self.held = self.held, ""
        if self.state == "start":
            return ("", held) if self.parser == "qwen3" else (held, "")
        return (held, "") if self.state == "thinking" else ("", held if self.state == "answer" else "")


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: json.loads takes them, clients would not


def _call(block: str) -> dict | None:
    """OpenAI's tool call for one block's text, or None if it is not a call."""
    try:
        call = json.loads(block, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
        return None
    return _openai_call(call)


def _openai_call(call) -> dict | None:
    """OpenAI's tool call for a model's {"name", "arguments" or "parameters"}, or None."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallStream:
    """Splits text, fed in pieces, into (content, calls completed now). Trailing
    whitespace is held until text follows it; whitespace after a call is dropped while no
    content was sent, and at the end of an answer with calls."""

    def __init__(self):
        self.held, self.in_block, self.calls = "", False, 0
        self.blank, self.sent = "", False  # trailing whitespace held back; any content sent yet

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        content, calls = "", []
        while True:
            if not self.in_block:
                at = self.held.find(CALL)
                if at < 0:
                    keep = len(self.held) - _tag_start(self.held, CALL)
                    content += self._content(self.held[:keep])
                    self.held = self.held[keep:]
                    return content, calls
                content += self._content(self.held[:at])
                self.held, self.in_block = self.held[at + len(CALL):], True
            else:
                at = self.held.find(END_CALL)
                if at < 0:
                    return content, calls
                content += self._block(self.held[:at], calls, closed=True)
                self.held, self.in_block = self.held[at + len(END_CALL):], False

    def finish(self) -> tuple[str, list[dict]]:
        """The rest: an unclosed final block is read as a call (a model may stop at EOS
        before closing it)."""
        calls: list[dict] = []
        content = self._block(self.held, calls, closed=False) if self.in_block else self._content(self.held)
        if not self.calls:
            content += self.blank  # an answer without calls is its text as written
        self.held, self.in_block, self.blank = "", False, ""
        return content, calls

    def _content(self, text: str) -> str:
        text = self.blank + text
        if self.calls and not self.sent:
            text = text.lstrip()
        body = text.rstrip()
        self.blank, self.sent = text[len(body):], self.sent or bool(body)
        return body

    def _block(self, text: str, calls: list, closed: bool) -> str:
        call = _call(text)
        if call is None:  # text as the model wrote it
            return self._content(CALL + text + (END_CALL if closed else ""))
        self.calls += 1
        calls.append(call)
        return ""


class JsonCallStream:
    """`llama3_json`: holds an answer that may be calls (it starts with '{' or the python
    tag) to its end, then reads it as calls separated by ';', or gives it back as content
    if it is not; any other answer streams as content."""

    def __init__(self):
        self.held, self.calls_maybe = "", None  # None: not yet known

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        if self.calls_maybe is None:
            start = self.held.lstrip()
            if _tag_start(start, PYTHON_TAG) == len(start):  # not yet known
                return "", []
            self.calls_maybe = start.startswith("{") or start.startswith(PYTHON_TAG)
        if self.calls_maybe:
            return "", []
        content, self.held = self.held, ""
        return content, []

    def finish(self) -> tuple[str, list[dict]]:
        held, self.held = self.held, ""
        body = held.strip().removeprefix(PYTHON_TAG).lstrip()
        calls, decoder, at = [], json.JSONDecoder(parse_constant=_no_constant), 0
        try:
            while at < len(body):
                obj, at = decoder.raw_decode(body, at)
                calls.append(_openai_call(obj))
                at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
        except (ValueError, RecursionError):
            calls = [None]
        if self.calls_maybe and calls and None not in calls:
            return "", calls
        return held, []


class ForcedCallStream:
    """An answer constrained to a JSON list of calls (`forced_calls_schema`): held to its
    end, then its calls; as content if it is not such a list (cut by max_tokens)."""

    def __init__(self):
        self.held = ""

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        held, self.held = self.held, ""
        try:
            calls = [_openai_call(c) for c in json.loads(held, parse_constant=_no_constant)]
        except (ValueError, TypeError, RecursionError):
            calls = [None]
        return ("", calls) if calls and None not in calls else (held, [])


class MessageStream:
    """A chat answer's parts: `push` of its text in pieces (`final`: the last) gives
    (reasoning, content, tool call deltas numbered by their `index` among its calls).
    A whole answer is one final push."""

    def __init__(self, reasoning_parser: str | None = None, tool_parser: str | None = None):
        self.reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None
        streams = {"hermes": ToolCallStream, "llama3_json": JsonCallStream, FORCED: ForcedCallStream}
        self.tools = streams[tool_parser]() if tool_parser else None
        self.calls = 0  # sent so far

    def push(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        reasoning, calls = "", []
        if self.reasoning is not None:
            reasoning, text = self.reasoning.push(text)
            if final:
                more, rest = self.reasoning.finish()
                reasoning, text = reasoning + more, text + rest
        if self.tools is not None:
            text, calls = self.tools.push(text)
            if final:
                rest, more = self.tools.finish()
                text, calls = text + rest, calls + more
        numbered = [{"index": self.calls + k, **c} for k, c in enumerate(calls)]
        self.calls += len(calls)
        return reasoning, text, numbered
