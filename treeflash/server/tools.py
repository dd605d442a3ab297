"""Tool calls in chat completions (OpenAI's `tools`; vLLM's `hermes` tool-call parser).

The request's tools go to the chat template, which writes them into the prompt; the
model answers a call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen2.5, Qwen3, Hermes), and those blocks come back as the message's `tool_calls`,
whole or streamed (one delta per call, sent when its block closes). Text outside the
blocks stays the message's content; a block that is not such JSON stays there too, as
the model wrote it. Decoding is untouched: a tool call is text like any other.
"""
from __future__ import annotations

import json
import uuid

from treeflash.errors import UsageError, shown

PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _refuse(param: str, why: str):
    error = UsageError(why)
    error.param = param
    raise error


def request_tools(body: dict, parser: str | None) -> tuple[list[dict] | None, bool]:
    """(the body's `tools` as the template takes them, or None; whether the answer's tool
    calls are parsed): with tool_choice 'none' the tools are written into the prompt but
    not parsed (vLLM's default). A UsageError (with `param`) for malformed tools, a
    tool_choice this server cannot honour (a forced call needs guided decoding), or
    tools to call on a server started without a parser."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        _refuse("tool_choice", f"tool_choice {shown(choice)} is not supported (only 'auto' and 'none': a forced "
                               "call needs guided decoding)")
    if tools is None or tools == []:
        return None, False
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"]
            and isinstance(t["function"].get("parameters") or {}, dict) for t in tools):
        _refuse("tools", "'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                         "\"parameters\": {...}}}")
    if choice == "none":
        return tools, False
    if parser is None:
        _refuse("tools", "tool calls need a server started with --tool-call-parser hermes")
    return tools, True


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: json.loads takes them, clients would not


def _call(block: str) -> dict | None:
    """OpenAI's tool call for one block's text, or None if it is not a call."""
    try:
        call = json.loads(block, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    args = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


class ToolCallStream:
    """Splits a choice's text, fed in pieces, into content and tool calls: `push` returns
    (content to send now, calls completed now); text that may start a block is held until
    it does or cannot, and trailing whitespace until text follows it (whitespace around a
    call and at the end of an answer with calls is dropped). `finish` ends
    the text (an unclosed final block is read as a call, as the model may stop at EOS
    before closing it)."""

    def __init__(self):
        self.held, self.in_block, self.calls = "", False, 0
        self.blank, self.gap = "", ""  # trailing whitespace held back; the whitespace before a block
        self.fresh = False  # right after a call: the whitespace that follows it is dropped

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        content, calls = "", []
        while True:
            if not self.in_block:
                at = self.held.find(OPEN)
                if at < 0:
                    keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                                 if OPEN.startswith(self.held[-k:])), 0)
                    content += self._content(self.held[:len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep:]
                    return content, calls
                content += self._content(self.held[:at])
                self.held, self.in_block = self.held[at + len(OPEN):], True
                self.gap, self.blank = self.blank, ""
            else:
                at = self.held.find(CLOSE)
                if at < 0:
                    return content, calls
                content += self._block(self.held[:at], calls, closed=True)
                self.held, self.in_block = self.held[at + len(CLOSE):], False

    def finish(self) -> tuple[str, list[dict]]:
        calls: list[dict] = []
        content = self._block(self.held, calls, closed=False) if self.in_block else self._content(self.held)
        if not self.calls:
            content += self.blank  # an answer without calls is its text as written
        self.held, self.in_block, self.blank = "", False, ""
        return content, calls

    def _content(self, text: str) -> str:
        text = self.blank + text
        if self.fresh:
            text = text.lstrip()
            self.fresh = not text
        body = text.rstrip()
        self.blank = text[len(body):]
        return body

    def _block(self, text: str, calls: list, closed: bool) -> str:
        call = _call(text)
        if call is None:  # text as the model wrote it
            return self._content(self.gap + OPEN + text + (CLOSE if closed else ""))
        self.calls, self.fresh = self.calls + 1, True
        calls.append(call)
        return ""


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content or None, tool calls) of a whole answer."""
    stream = ToolCallStream()
    content, calls = stream.push(text)
    rest, more = stream.finish()
    content, calls = content + rest, calls + more
    return (content or None) if calls else content, calls
