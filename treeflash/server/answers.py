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
- Harmony (gpt-oss; vLLM's `--reasoning-parser openai_gptoss` and `--tool-call-parser
  openai`): the answer is messages, `<|channel|>analysis<|message|>...<|end|>
  <|start|>assistant<|channel|>final<|message|>...<|return|>`. `HarmonyStream` reads
  them: analysis -> reasoning, final and commentary (a preamble to the user) -> content,
  a message to a recipient (`to=functions.NAME`, in the header before or after the
  channel) -> a call of NAME with the message as its JSON arguments (not JSON: its text
  is content). Messages of one part are joined by a newline; an answer cut off in a
  message gives the part so far to its channel's part; text outside any message (a
  model that skipped the format) is content; a `<|message|>` or `<|constrain|>` in a
  message's text is dropped. Its markers are special tokens, so such a request's text is
  decoded with them (`skip_special_tokens` false, whatever the request says: protocol's
  `parse_chat`; its stop strings are matched in that text, headers included) and the
  parts, which never hold them, are what the client gets. `openai` reads the calls,
  `openai_gptoss` the rest: `openai` alone implies `openai_gptoss` (vLLM always splits
  gpt-oss's reasoning off), and without `openai` (or with tool_choice 'none') a call's
  text is content. Structured outputs cannot wait for the final channel (its markers are
  special tokens, which a constraint never allows): refused with either.

Streamed, each part is sent as soon as it is known: text that may begin a tag is held
until it does or cannot, and a call is one delta when its block (Harmony: its message)
closes.
"""
from __future__ import annotations

import json
import re
import uuid

from treeflash.chat import checked_tools
from treeflash.errors import UsageError, shown
from treeflash.structured.grammar import REASONING_TAGS
from treeflash.structured.json_schema import schema_regex

HARMONY, HARMONY_TOOLS = "openai_gptoss", "openai"  # gpt-oss's Harmony format: reasoning, and calls
TOOL_PARSERS = ("hermes", "llama3_json", HARMONY_TOOLS)
# structured outputs wait for the reasoning that REASONING_TAGS' parsers split off; not Harmony's
REASONING_PARSERS = (*REASONING_TAGS, HARMONY)
THINK, END_THINK = REASONING_TAGS["qwen3"]
CALL, END_CALL = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def chat_parsers(tool_parser: str | None, reasoning_parser: str | None) -> tuple[str | None, str | None]:
    """The (tool-call, reasoning) parsers a server reads chat answers with: `openai`
    alone implies `openai_gptoss` (both read one Harmony answer); a UsageError for an
    unknown parser, or a pair that reads different formats."""
    for what, name, names in (("tool-call", tool_parser, TOOL_PARSERS), ("reasoning", reasoning_parser,
                                                                          REASONING_PARSERS)):
        if name not in (None, *names):
            raise UsageError(f"unknown {what} parser {name!r} (choose from {', '.join(names)})")
    if tool_parser == HARMONY_TOOLS and reasoning_parser is None:
        reasoning_parser = HARMONY
    if (tool_parser == HARMONY_TOOLS) != (reasoning_parser == HARMONY) and tool_parser is not None:
        raise UsageError(f"--tool-call-parser {tool_parser} and --reasoning-parser {reasoning_parser} read different "
                         f"formats: gpt-oss's Harmony answers take --tool-call-parser {HARMONY_TOOLS} with "
                         f"--reasoning-parser {HARMONY}")
    return tool_parser, reasoning_parser


def request_tools(body: dict, parser: str | None) -> tuple[list[dict] | None, str | None, dict | None]:
    """(the body's `tools` as the template takes them, or None; what reads the answer's
    calls: a parser's name, FORCED, or None; for a forced call, the JSON schema the
    answer must follow). tool_choice 'none': the tools are written into the prompt, the
    answer is not read for calls; 'auto' (also when left out, as OpenAI and vLLM do): the parser reads them;
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
        params, own = _hoisted(_parameters(f), f"f{i}_")
        defs.update(own)
        calls.append({"type": "object", "required": ["name", "parameters"],
                      "properties": {"name": {"enum": [f["name"]]}, "parameters": params}})
    return {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1,
            **({"maxItems": 1} if name is not None or one else {}), **({"$defs": defs} if defs else {})}


def forced_schema_error(tools: list[dict], forced: dict, error: str) -> str:
    """`error`, from compiling `forced_calls_schema`, told in the tool's own terms: the
    tool at fault and a path in its parameters' schema (not in the list of calls)."""
    calls = forced["items"].get("anyOf", [forced["items"]])
    names = {c["properties"]["name"]["enum"][0] for c in calls}
    for f in (t["function"] for t in tools if t["function"]["name"] in names):
        try:
            schema_regex(_parameters(f))
        except UsageError as e:
            return f"tool {shown(f['name'])}, parameters schema: {str(e).removeprefix('json schema: ')}"
    return error


# keys that say nothing of a tool's arguments: with only these (and type object) it takes none
_ANNOTATIONS = {"type", "title", "description", "$schema", "$id", "$comment", "examples", "default"}


def _parameters(function: dict) -> dict:
    """A tool's parameter schema; a tool that lists no parameters is called with {}.
    Any other constraint (required names, additionalProperties, allOf, ...) stays, to be
    compiled or refused: read as "no parameters" it would make calls that break it."""
    params = function.get("parameters") or {}
    if params.get("type", "object") == "object" and set(params) <= _ANNOTATIONS:
        return {"type": "object", "properties": {}}
    return params


def _hoisted(schema: dict, prefix: str) -> tuple[dict, dict]:
    """A tool's parameter schema without its own definitions (its root's `$defs` and
    `definitions`), and those definitions renamed apart with `prefix` (the two tables
    apart too): its `#/$defs/X` and `#/definitions/X` references then resolve in the
    schema of the whole answer, which holds every tool's. Values (const, enum, default,
    examples) and property names are data, kept as they are."""
    names = {"$defs": prefix + "d_", "definitions": prefix + "D_"}  # apart: both may name an X
    own = {names[table] + k: v for table in names if isinstance(schema.get(table), dict)
           for k, v in schema[table].items()}

    def renamed(node, data: bool = False):
        if data:
            return node
        if isinstance(node, list):
            return [renamed(v) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
            table, name = ref[2:].split("/", 1)
            node = {**node, "$ref": "#/$defs/" + names[table] + name}
        return {k: ({n: renamed(v) for n, v in sub.items()} if k in ("properties", "patternProperties")
                    and isinstance(sub, dict) else renamed(sub, k in ("const", "enum", "default", "examples")))
                for k, sub in node.items()}
    # its root's $id goes too: its references resolve from the answer's root now
    return (renamed({k: v for k, v in schema.items() if k not in names and k != "$id"}),
            {k: renamed(v) for k, v in own.items()})


def _tag_start(text: str, tag: str) -> int:
    """How many of text's last characters could begin `tag` (held back until known);
    all of them while the whole text may still become the tag."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-k:])), 0)


class ReasoningStream:
    """Splits text, fed in pieces, into (reasoning, the rest); the whitespace between
    `</think>` and the rest is dropped."""

    def __init__(self, parser: str):
        assert parser in REASONING_TAGS
        self.parser, self.held = parser, ""
        self.state = "start"  # start (is there an opening tag?), thinking, lead (whitespace after it), answer

    def push(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = rest = ""
        while True:
            if self.state == "start":  # the opening tag may follow white space
                lead = self.held.lstrip()
                if _tag_start(lead, THINK) == len(lead):
                    return reasoning, rest  # not yet known
                opened = lead.startswith(THINK)
                if opened:
                    self.held = lead[len(THINK):]
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
    """OpenAI's tool call for a model's {"name", "arguments" or "parameters"}, or None
    (also where the arguments hold a number JSON cannot write, as 1e999 reads: inf)."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    try:
        args = json.dumps(call.get("arguments", call.get("parameters", {})), ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": args}}


class ToolCallStream:
    """Splits text, fed in pieces, into (content, calls completed now). Trailing
    whitespace is held until text follows it; whitespace after a call is dropped while no
    content was sent, and at the end of an answer with calls."""

    def __init__(self):
        self.held, self.in_block, self.calls = "", False, 0
        self.blank, self.sent = "", False  # trailing whitespace held back; any content sent yet
        self.searched = 0  # how much of a block's text is known not to hold its end (a long call
        # streamed in small pieces is searched once, not once per piece)

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
                self.held, self.in_block, self.searched = self.held[at + len(CALL):], True, 0
            else:
                at = self.held.find(END_CALL, self.searched)
                if at < 0:
                    self.searched = max(0, len(self.held) - len(END_CALL) + 1)
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
                # a call holds a name and its arguments, nothing else: a JSON answer that has a
                # "name" among its keys ({"name": "Alice", "age": 30}) is an answer
                call = isinstance(obj, dict) and obj.keys() <= {"name", "arguments", "parameters", "type"}
                calls.append(_openai_call(obj) if call else None)
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


# Harmony's markers (special tokens of gpt-oss's tokenizer)
H_START, H_END, H_MESSAGE, H_CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
H_CONSTRAIN, H_RETURN, H_CALL = "<|constrain|>", "<|return|>", "<|call|>"
H_ENDS = (H_END, H_RETURN, H_CALL)  # a message's end (<|return|> and <|call|> are EOS: usually not in the text)
BODY_ENDS = (*H_ENDS, H_START, H_CHANNEL)  # and the next header, begun without one
BODY_MARKERS = (*BODY_ENDS, H_MESSAGE, H_CONSTRAIN)  # the last two out of place in a message's text: dropped
HEADER_OPENERS = (H_START, H_CHANNEL, H_MESSAGE, H_CONSTRAIN, "to=")  # how text between messages is a header
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]*)")
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")


def harmony_opened(prompt: str) -> str | None:
    """The header of the message a Harmony prompt ends inside (continue_final_message:
    the answer goes on with its text), or None: the prompt ends between messages or in
    a header (the generation prompt `<|start|>assistant`)."""
    tail = prompt[max(prompt.rfind(H_START), 0):]
    at = tail.find(H_MESSAGE)
    if at < 0 or any(m in tail[at:] for m in H_ENDS):
        return None
    return tail[:at]


class HarmonyStream:
    """Splits a Harmony answer (gpt-oss), fed in pieces, into (reasoning, content, calls
    completed now): see the module's docstring. `calls`: messages to a recipient are
    calls (else their text is content); `opened`: the header of the message the prompt
    left open (`harmony_opened`), which the answer starts inside."""

    def __init__(self, calls: bool = True, opened: str | None = None):
        self.read_calls, self.held = calls, ""
        self.state = "open"  # open (between messages: is a header next?), header, body
        self.route, self.recipient, self.body = None, None, ""  # the body's part; a call's name and text so far
        self.started = False  # the body has sent text (a part's second message starts with a newline)
        self.wrote = {"reasoning": False, "content": False}
        if opened is not None:
            self._begin(opened)

    def push(self, text: str) -> tuple[str, str, list[dict]]:
        self.held += text
        out, calls = {"reasoning": "", "content": ""}, []
        while True:
            if self.state == "open":
                lead = self.held.lstrip()
                if not lead or any(m.startswith(lead) and m != lead for m in HEADER_OPENERS):
                    break  # not yet known
                if lead.startswith(HEADER_OPENERS):
                    self.held, self.state = lead, "header"
                else:
                    self._begin(None)  # text outside any message
            elif self.state == "header":
                at = self.held.find(H_MESSAGE)
                if at < 0:
                    break
                self._begin(self.held[:at])
                self.held = self.held[at + len(H_MESSAGE):]
            else:
                hits = [(at, m) for m in BODY_MARKERS if (at := self.held.find(m)) >= 0]
                if not hits:
                    keep = len(self.held) - max(_tag_start(self.held, m) for m in BODY_MARKERS)
                    self._text(self.held[:keep], out)
                    self.held = self.held[keep:]
                    break
                at, end = min(hits)
                self._text(self.held[:at], out)
                if end not in BODY_ENDS:
                    self.held = self.held[at + len(end):]
                    continue
                self._end(out, calls)
                if end in H_ENDS:
                    self.held, self.state = self.held[at + len(end):], "open"
                else:  # a header begun without an end: it is read from its marker
                    self.held, self.state = self.held[at:], "header"
        return out["reasoning"], out["content"], calls

    def finish(self) -> tuple[str, str, list[dict]]:
        """The rest: a message cut off gives its text so far to its part (a call's, if
        it is whole JSON, is a call); a header cut off, or whitespace after a message,
        gives nothing; other text between messages is content."""
        out, calls = {"reasoning": "", "content": ""}, []
        held, self.held = self.held, ""
        if self.state == "open" and held.strip():
            self._begin(None)
        if self.state == "body":
            self._text(held, out)
            self._end(out, calls)
        self.state = "open"
        return out["reasoning"], out["content"], calls

    def _begin(self, header: str | None) -> None:
        """A message's body starts (`header`: its header's text; None for text outside
        any message)."""
        channel = recipient = None
        if header is not None:
            header = header[header.rfind(H_START) + len(H_START):] if H_START in header else header
            channel = (m.group(1) if (m := _CHANNEL.search(header)) else None)
            recipient = (m.group(1) if (m := _RECIPIENT.search(header)) else None)
        self.recipient, self.body, self.started, self.state = recipient, "", False, "body"
        if recipient and self.read_calls:  # a call of the request's functions; a message to anyone else
            # (a built-in tool such as python or browser, or a tool's reply the model went on to
            # invent) is neither the answer nor a call the client can run: dropped, as vLLM does
            self.route = "call" if recipient.startswith("functions.") else "drop"
        else:
            self.route = "reasoning" if channel == "analysis" and not recipient else "content"

    def _text(self, text: str, out: dict) -> None:
        if not text or self.route == "drop":
            return
        if self.route == "call":
            self.body += text
            return
        if not self.started and self.wrote[self.route]:
            text = "\n" + text
        self.started = self.wrote[self.route] = True
        out[self.route] += text

    def _end(self, out: dict, calls: list) -> None:
        """The body ends: a call's text is read (not JSON: it is content, as written)."""
        if self.route == "call":
            call = None
            try:
                args = json.loads(self.body, parse_constant=_no_constant)
            except (ValueError, RecursionError):
                pass
            else:
                call = _openai_call({"name": self.recipient.removeprefix("functions."), "arguments": args})
            if call is not None:
                calls.append(call)
            else:
                self.route = "content"
                self._text(self.body, out)
        self.route, self.body, self.state = None, "", "open"


class MessageStream:
    """A chat answer's parts: `push` of its text in pieces (`final`: the last) gives
    (reasoning, content, tool call deltas numbered by their `index` among its calls).
    A whole answer is one final push. A Harmony answer (either Harmony parser) is read
    by one `HarmonyStream` (`opened`: the header the prompt left open). `max_calls`: the
    calls after that many are dropped (parallel_tool_calls false: one, as OpenAI and vLLM)."""

    def __init__(self, reasoning_parser: str | None = None, tool_parser: str | None = None,
                 opened: str | None = None, max_calls: int | None = None):
        self.harmony = None
        if reasoning_parser == HARMONY or tool_parser == HARMONY_TOOLS:
            assert tool_parser in (None, HARMONY_TOOLS), "Harmony answers' calls are read by the openai parser"
            self.harmony = HarmonyStream(tool_parser == HARMONY_TOOLS, opened)
            reasoning_parser = tool_parser = None
        self.reasoning = ReasoningStream(reasoning_parser) if reasoning_parser else None
        streams = {"hermes": ToolCallStream, "llama3_json": JsonCallStream, FORCED: ForcedCallStream}
        self.tools = streams[tool_parser]() if tool_parser else None
        self.calls = 0  # sent so far
        self.max_calls = max_calls

    def push(self, text: str, final: bool = False) -> tuple[str, str, list[dict]]:
        reasoning, calls = "", []
        if self.harmony is not None:
            reasoning, text, calls = self.harmony.push(text)
            if final:
                more, rest, last = self.harmony.finish()
                reasoning, text, calls = reasoning + more, text + rest, calls + last
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
        if self.max_calls is not None:
            calls = calls[:max(0, self.max_calls - self.calls)]
        numbered = [{"index": self.calls + k, **c} for k, c in enumerate(calls)]
        self.calls += len(calls)
        return reasoning, text, numbered
