"""A checkpoint's chat template (Jinja, as Hugging Face tokenizers ship it), rendered in a
sandbox: messages in, the prompt text the model was trained on out."""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from treeflash.errors import TreeflashError, UsageError, is_text, shown
from treeflash.files import SPECIAL_TOKENS, read_text, tokenizer_settings


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _refuse(message: str):
    raise TreeflashError(" ".join(str(message).split()))  # one line, whatever the template wrote


CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's chat_template_content_format
REASONING_NAMES = ("reasoning_content", "thinking", "reasoning")  # the first that a message sets wins
CONTINUE_MARK = "TreeflashContinueHere "  # where a continued final message ends, found in the rendered text


def plain_messages(messages, parts: bool = False) -> list[dict]:
    """A conversation as a template takes it: [{"role", "content"}] with text content
    (OpenAI's list of text parts joined by newlines, as vLLM does; kept as the list with
    `parts`, for a template that loops over them) and the messages' other keys as given (a
    template may read `reasoning_content`, `tool_call_id`, ...); a UsageError names the
    first message that is not one."""
    if not isinstance(messages, list) or not messages:
        raise UsageError("'messages' must be a non-empty list of messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise UsageError(f"messages[{i}] must be an object with a non-empty string 'role'")
        content = m.get("content")
        texts = [content]
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            for j, p in enumerate(content):
                if not isinstance(p, dict) or p.get("type") != "text":
                    raise UsageError(f"messages[{i}]: only text content parts are supported")
                if not isinstance(p.get("text"), str):
                    raise UsageError(f"messages[{i}].content[{j}]: a text part must have a string 'text'")
            texts = [p["text"] for p in content]
            content = content if parts else "\n".join(texts)
        # an assistant's turn that only calls tools, or only reasoned (an answer cut short
        # in its reasoning comes back with content null)
        if content is None and (m.get("tool_calls") or m["role"] == "assistant"):
            content = texts[0] = ""
        if not isinstance(content, (str, list)):
            raise UsageError(f"messages[{i}] must have string 'content'")
        if parts and isinstance(content, str):  # one part, for a template that loops over them
            content = [{"type": "text", "text": content}]
        if not (all(map(is_text, texts)) and is_text(m["role"])):
            raise UsageError(f"messages[{i}] must be valid Unicode text")
        for key in ("name", "tool_call_id", *REASONING_NAMES):  # a template writes them into the prompt
            if m.get(key) is not None and not (isinstance(m[key], str) and is_text(m[key])):
                raise UsageError(f"messages[{i}].{key} must be a string, got {shown(m[key])}")
        calls = m.get("tool_calls")
        # keys set to null are left out (OpenAI's SDK writes "tool_calls": null into every
        # message it returns, and templates test whether a key is defined), as transformers does
        entry = {k: v for k, v in m.items() if v is not None} | {"content": content}
        if calls is not None:  # (a falsy non-list, {} or 0, is refused as well)
            entry["tool_calls"] = _tool_calls(calls, f"messages[{i}]")
        # a turn's reasoning under each name templates read it by (gpt-oss's read `thinking`)
        reasoning = next((entry[k] for k in REASONING_NAMES if k in entry), None)
        if reasoning is not None:
            entry = {"thinking": reasoning, **entry, "reasoning_content": reasoning}
        plain.append(entry)
    return plain


def checked_tools(tools) -> list[dict] | None:
    """OpenAI's `tools` as a template takes them (None for none); a UsageError naming
    'tools' if they are not a list of functions."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"]
            and _object_schema(t["function"].get("parameters")) for t in tools):
        raise UsageError("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                         "\"parameters\": {\"type\": \"object\", ...}}}", param="tools")
    return tools


def _object_schema(parameters) -> bool:
    """A function's parameters: none, or a schema of an object (its keyword arguments),
    as OpenAI requires; [] or "string" would make calls no client can unpack."""
    return parameters is None or isinstance(parameters, dict) and parameters.get("type", "object") == "object"


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as templates read them: each function's
    arguments as an object (OpenAI sends a JSON string; vLLM parses it for the template
    too), kept as given if it is not JSON."""
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            for c in calls):
        raise UsageError(f"{where}: 'tool_calls' must be a list of {{\"function\": {{\"name\": ..., "
                         f"\"arguments\": ...}}}}")
    out = []
    for c in calls:
        args = c["function"].get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):  # not JSON (or nested past Python's stack): as given
                pass
        out.append({**c, "function": {**c["function"], "arguments": args}})
    return out


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_tag():
    """`{% generation %}...{% endgeneration %}`, which marks the assistant's tokens for
    training (TRL's assistant-only loss): rendered as its body, as transformers does."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):  # a call block, as transformers': what it sets stays inside
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


def _loops_over_content(env, *sources: str | None) -> bool:
    """Whether a template loops over a message's content (Gemma 3's, Llama 4's), which
    then takes OpenAI's list of parts; the others take its text, the parts joined (vLLM
    tells its "openai" content format from its "string" one so). A loop over a name set
    from content counts too, unless it reads its items as tool calls: Mistral's
    parallel-tool template sets `tool_calls = message.content` for a role of its own,
    and takes text. (Text given to a template that wanted parts would vanish without a
    word; parts given to one that wanted text are refused, so doubt goes to parts.)"""
    from jinja2 import nodes

    def is_key(node, names: tuple[str, ...]) -> bool:  # x.name or x['name'], name in names
        if isinstance(node, nodes.Getattr):
            return node.attr in names
        return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value in names

    def of_content(node) -> bool:
        while isinstance(node, nodes.Filter):  # message['content'] | selectattr(...)
            node = node.node
        return is_key(node, ("content",))

    def reads_tool_calls(loop) -> bool:  # call.function, call['arguments'], ...
        return isinstance(loop.target, nodes.Name) and any(
            is_key(n, ("function", "name", "arguments", "id")) and isinstance(n.node, nodes.Name)
            and n.node.name == loop.target.name for n in loop.find_all((nodes.Getattr, nodes.Getitem)))

    for source in filter(None, sources):
        tree = env.parse(source)
        named = {a.target.name for a in tree.find_all(nodes.Assign)  # {% set content = message['content'] %}
                 if isinstance(a.target, nodes.Name) and of_content(a.node)}
        for loop in tree.find_all(nodes.For):
            it = loop.iter
            while isinstance(it, nodes.Filter):
                it = it.node
            if of_content(it) or isinstance(it, nodes.Name) and it.name in named and not reads_tool_calls(loop):
                return True
    return False


@dataclass(frozen=True)
class ChatFormat:
    """How a conversation becomes a prompt (vLLM's and transformers' options): the
    template's own variables (`chat_template_kwargs`: Qwen3's enable_thinking, ...), and
    where the prompt ends: after the assistant's turn header (`add_generation_prompt`),
    or inside the final message, which the model then continues (`continue_final_message`:
    an answer's given beginning)."""
    variables: dict | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def checked(self) -> "ChatFormat":
        """Self, or a UsageError whose `param` names the malformed option."""
        def refuse(param: str, why: str):
            raise UsageError(f"{param} {why}", param=param)

        v = self.variables
        if v is not None and (not isinstance(v, dict) or not all(isinstance(k, str) for k in v)):
            refuse("chat_template_kwargs", "must be an object of template variables")
        fixed = sorted(set(v or ()) & {"messages", "add_generation_prompt", "tools"})
        if fixed:
            refuse("chat_template_kwargs", f"may not set {', '.join(fixed)}")
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                refuse(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.add_generation_prompt and self.continue_final_message:
            refuse("continue_final_message", "needs add_generation_prompt = false (the final message is "
                                             "continued: no new turn is opened)")
        return self


NO_TEMPLATE = ("has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja): give plain "
               "prompts (LLM.generate; treeflash generate without --chat; the server's /v1/completions)")


class ChatTemplate:
    """A checkpoint's template; `tool_source`: the one for conversations with tools, where
    a checkpoint names one ('tool_use', as Hermes models do; transformers picks it so)."""

    def __init__(self, source: str, special_tokens: dict | None = None, tool_source: str | None = None):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _refuse
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
            self.tool_template = env.from_string(tool_source) if tool_source is not None else self.template
            self.takes_parts = _loops_over_content(env, source, tool_source)
        except jinja2.TemplateError as e:
            raise TreeflashError(f"malformed chat template: {e}") from None
        # what a template may name: bos_token, eos_token, ... (unset ones are not defined, as
        # in transformers: `bos_token + x` refuses, `bos_token is defined` is false)
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ChatTemplate | None":
        """The template of a checkpoint folder (chat_template.jinja, or tokenizer_config.json's
        'chat_template': a string, or a list of named ones of which 'default', and
        'tool_use' for tools if there is one, which newer transformers save as
        additional_chat_templates/tool_use.jinja); None without one."""
        folder = Path(folder)
        config = tokenizer_settings(folder)
        sources = cls.sources(folder, config)
        return None if sources is None else cls(sources[0], cls.special_tokens_of(config), sources[1])

    @classmethod
    def given(cls, source: str, folder: str | Path) -> "ChatTemplate":
        """A template given instead of the model's (vLLM's --chat-template): a Jinja file's
        path, or the template itself; with the special tokens of the model's folder."""
        try:
            is_file = Path(source).is_file()
        except OSError:  # a name too long for a path: a template
            is_file = False
        text = None
        if is_file:
            try:
                text = Path(source).read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise UsageError(f"chat template {source}: not UTF-8 text") from None
            except OSError as e:
                raise UsageError(f"cannot read chat template {source}: {e.strerror or e}") from None
        if text is None and not any(c in source for c in "{}\n"):
            raise UsageError(f"chat template: no file {source} (nor a template: it has no {{ }})")
        try:
            return cls(source if text is None else text, cls.special_tokens_of(tokenizer_settings(folder)))
        except TreeflashError as e:
            raise UsageError(str(e)) from None

    @staticmethod
    def special_tokens_of(config: dict) -> dict:
        """A tokenizer_config.json's special tokens as a template names them: set ones only
        (null: not defined for the template, as in transformers)."""
        tokens = {k: _token_text(config[k]) for k in SPECIAL_TOKENS if _token_text(config.get(k))}
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            tokens["additional_special_tokens"] = [_token_text(t) for t in extra]
        return tokens

    @staticmethod
    def sources(folder: Path, config: dict | None = None) -> tuple[str, str | None] | None:
        """The (default, tool_use) template sources of a checkpoint folder (`config`: its
        tokenizer_config.json, if read already), or None without a template: whether there
        is one is known before the model (and jinja2) loads."""
        folder = Path(folder)
        config = tokenizer_settings(folder) if config is None else config
        source = config.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            source = read_text(folder / "chat_template.jinja")
        tool_source = None
        if isinstance(source, list):
            if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in source):
                raise TreeflashError(f"{folder}: 'chat_template' must be a string or a list of "
                                     f"{{\"name\": ..., \"template\": ...}}")
            named = {t["name"]: t.get("template") for t in source}
            if "default" not in named:
                raise TreeflashError(f"{folder}: the chat templates ({', '.join(sorted(named))}) name none 'default'")
            source, tool_source = named["default"], named.get("tool_use")
        if (folder / "additional_chat_templates" / "tool_use.jinja").exists():
            tool_source = read_text(folder / "additional_chat_templates" / "tool_use.jinja")
        if source is None:
            return None
        if not isinstance(source, str) or not isinstance(tool_source, (str, type(None))):
            raise TreeflashError(f"{folder}: 'chat_template' must be a string or a list of named templates")
        return source, tool_source

    def render(self, messages: list[dict], fmt: ChatFormat = ChatFormat(), tools: list[dict] | None = None) -> str:
        """The prompt for `messages` (and the `tools` the model may call), by default ending
        where the assistant's answer starts (see `ChatFormat`)."""
        import jinja2
        final = None
        if fmt.continue_final_message and messages:  # marked, to cut the text where the message ends
            content = messages[-1]["content"]
            if isinstance(content, list):  # its parts: the last one's text ends it
                final = content[-1]["text"] if content else ""
                content = [*content[:-1], {**content[-1], "text": final + CONTINUE_MARK}] if content else \
                    [{"type": "text", "text": CONTINUE_MARK}]
            else:
                final, content = content, content + CONTINUE_MARK
            messages = [*messages[:-1], {**messages[-1], "content": content}]
        try:
            template = self.template if tools is None else self.tool_template
            # a kwarg may set bos_token, as in transformers; documents (RAG templates') are None unless given
            variables = {**self.special_tokens, "documents": None, **(fmt.variables or {})}
            text = template.render(**variables, messages=messages, add_generation_prompt=fmt.add_generation_prompt,
                                   tools=tools)
        except jinja2.TemplateError as e:
            raise TreeflashError(str(e)) from None
        except TreeflashError:  # the template's raise_exception(...)
            raise
        except Exception as e:  # a template's own arithmetic or string operation on the messages
            raise TreeflashError(f"{type(e).__name__}: {e}") from None
        if fmt.continue_final_message and messages:  # cut where the final message's text ends, as transformers
            at = text.rfind(CONTINUE_MARK.strip())
            # a template that trims the message trims the space after the text as well
            text = text[:at] if text.startswith(CONTINUE_MARK, at) else text[:at].rstrip()
            if at < 0 or not text.rstrip().endswith(final.strip()):
                raise TreeflashError("the template does not write the final message's text as given: "
                                     "it cannot be continued")
        return text

    def prompt(self, messages, fmt: ChatFormat = ChatFormat(), tools: list[dict] | None = None,
               content_format: str = "auto") -> str:
        """`render` of a conversation checked by `plain_messages` (and `fmt` by its
        `checked`); a UsageError if either is malformed or the template refuses them (say,
        "roles must alternate"). `content_format` (vLLM's chat_template_content_format):
        "string" gives every message's content as text, "openai" as a list of parts,
        "auto" as the template reads it."""
        if content_format not in CONTENT_FORMATS:
            raise UsageError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, "
                             f"got {content_format!r}")
        parts = self.takes_parts if content_format == "auto" else content_format == "openai"
        plain, fmt = plain_messages(messages, parts), fmt.checked()
        if fmt.continue_final_message and messages[-1].get("content") is None:
            raise UsageError("continue_final_message: the final message has no content to continue")
        try:
            return self.render(plain, fmt, tools)
        except TreeflashError as e:
            raise UsageError(f"the chat template refused the messages: {e}") from None
