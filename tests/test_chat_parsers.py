"""Chat answers split into parts (`treeflash serve --tool-call-parser hermes
--reasoning-parser qwen3`).

What a client relies on: its tools and its earlier calls reach the chat template; an
answer's `<tool_call>` blocks come back as `tool_calls` (the text around them as
content, finish_reason 'tool_calls') and its `<think>` block as `reasoning_content`, the
same whole or streamed however the text is cut; a block that is not a call stays text;
requests the server cannot honour get a 400.
"""
from __future__ import annotations

import json
import shutil

import pytest

from treeflash.server.answers import MessageStream, ReasoningStream, ToolCallStream

def split_tool_calls(text: str, parser: str = "hermes") -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole answer, as the server's message has them."""
    _, content, calls = MessageStream(None, parser).push(text, final=True)
    return content or None if calls else content, calls


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    reasoning, content, _ = MessageStream(parser).push(text, final=True)
    return reasoning or None, content


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
ANSWER = "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Oslo")
# text after the calls, with blank lines; blocks that are not calls (prose, NaN, a number
# JSON cannot write, no name, nested past Python's stack) stay text as written
ANSWERS = [ANSWER, CALL + "\n\nIt is noon.\n\nAnything else?\n\n- a\n- b\n",
           "See <tool_call>a tag in prose</tool_call> here.\n\n" + CALL,
           '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>\n<tool_call>{"name": ""}</tool_call> ',
           "<tool_call>" + "[" * 5000 + "</tool_call>", "no calls at all \n\n", CALL + " \n",
           "Let me check.\n" + CALL + "\nDone.", "A " + CALL + " B",
           '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>']


def test_split_tool_calls():
    content, calls = split_tool_calls(ANSWER)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"] * 2
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris", "days": 2},
                                                                       {"city": "Oslo", "days": 2}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    # no call: the text as it is; a block that is not a call stays text; an unclosed last
    # block (the model stopped at EOS) is still a call
    assert split_tool_calls("plain < text <tool") == ("plain < text <tool", [])
    assert split_tool_calls("a <tool_call>not json</tool_call>") == ("a <tool_call>not json</tool_call>", [])
    content, calls = split_tool_calls('ok <tool_call>{"name": "f"}')
    assert content == "ok" and calls[0]["function"] == {"name": "f", "arguments": "{}"}
    assert split_tool_calls(CALL)[0] is None


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("piece", [1, 2, 5, 13])
def test_a_stream_cut_anywhere_gives_the_whole_answer(answer, piece):
    stream, content, calls = ToolCallStream(), "", []
    for i in range(0, len(answer), piece):
        text, new = stream.push(answer[i:i + piece])
        assert answer is not ANSWER or "<" not in text  # a tag's beginning is held until it is known
        content, calls = content + text, calls + new
    text, new = stream.finish()
    content, calls = content + text, calls + new
    whole_content, whole = split_tool_calls(answer)
    assert (content or None if calls else content) == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole]


def test_what_stays_text():
    assert split_tool_calls(ANSWERS[1])[0] == "It is noon.\n\nAnything else?\n\n- a\n- b"
    assert split_tool_calls(ANSWERS[2])[0] == "See <tool_call>a tag in prose</tool_call> here."
    assert split_tool_calls(ANSWERS[3]) == (ANSWERS[3], [])
    assert split_tool_calls(ANSWERS[4]) == (ANSWERS[4], [])
    assert split_tool_calls(ANSWERS[5]) == (ANSWERS[5], [])
    assert split_tool_calls(ANSWERS[6])[0] is None
    assert split_tool_calls(ANSWERS[7])[0] == "Let me check.\n\nDone."  # text on both sides of a call
    assert split_tool_calls(ANSWERS[8])[0] == "A  B"
    assert split_tool_calls(ANSWERS[9]) == (ANSWERS[9], [])  # 1e999 reads as inf, which JSON cannot write


def test_an_unclosed_block_that_is_not_a_call_stays_as_written():
    """An answer cut off inside a <tool_call> block that is no call (max_tokens, EOS): its
    text comes back as the model wrote it, with no closing tag added."""
    assert split_tool_calls("Sure <tool_call>not json") == ("Sure <tool_call>not json", [])


def test_a_short_call_in_one_piece_after_a_long_call_is_a_call():
    """A round of speculative decoding may bring many tokens at once: a piece holding a
    long call's end and a whole short call after it gives both calls (the short one's
    end is searched from its own start), and the text after them as content."""
    long_call = CALL.replace('"days": 2', '"note": "' + "x" * 200 + '"')
    pieces = [long_call[:100], long_call[100:] + '\n<tool_call>{"name": "f"}</tool_call>\nDone.', ""]
    stream, content, calls = MessageStream(None, "hermes"), "", []
    for i, piece in enumerate(pieces):
        _, c, new = stream.push(piece, final=i == len(pieces) - 1)
        content, calls = content + c, calls + new
    assert (content, [c["function"]["name"] for c in calls]) == ("Done.", ["get_weather", "f"])


# ----------------------------------------------------------------------------- server

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from treeflash import LLM, GenerationOutput  # noqa: E402
from treeflash.chat import ChatTemplate  # noqa: E402
from treeflash.engine.options import builtin_paths  # noqa: E402
from treeflash.errors import UsageError  # noqa: E402
from treeflash.server.app import build_app  # noqa: E402

# writes the tools and earlier calls (arguments as objects), as Qwen's templates do
TEMPLATE = ("[{{ 'none' if tools is none else 'some' }}]{% if tools %}### tools:\n"
            "{% for t in tools %}{{ t.function.name }}: {{ t.function.parameters | tojson }}\n"
            "{% endfor %}{% endif %}{% for m in messages %}### {{ m.role }}:\n{{ m.content }}"
            "{% for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': "
            "c.function.arguments} | tojson }}</tool_call>{% endfor %}\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": {"type": "object", "properties": {"city": {}}}}}]
MESSAGES = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "user", "content": "and Paris?"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """An LLM whose chat answer is ANSWER's tokens (one per on_tokens call; a test may put
    another answer in `script`), recording the prompts it was given, and a server for it
    with the hermes and qwen3 parsers."""
    folder = tmp_path_factory.mktemp("tools") / "target"
    shutil.copytree(builtin_paths()[0], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    llm = LLM(folder, device="cpu", dtype="float32")
    prompts = []

    def generate(batch, params, on_tokens=None, on_done=None, *, use_tqdm=False, _texts=None):
        outs, ids = [], llm.encode(script.get("answer", ANSWER))
        for k, prompt in enumerate(batch):
            prompts.append(llm.tokenizer.decode(prompt))
            for t in ids:
                if on_tokens is not None:
                    on_tokens(k, [t], None)
            outs.append(GenerationOutput(llm.tokenizer.decode(ids), list(ids), script.get("reason", "stop")))
            if on_done is not None:
                on_done(k, outs[-1])
        return outs

    llm.generate = generate
    app = build_app(llm, "tiny", ChatTemplate.from_folder(folder), tool_parser="hermes", reasoning_parser="qwen3")
    with TestClient(app) as client:
        client.llm = llm  # the scripted engine, for LLM.chat
        yield client, prompts


script: dict = {}  # the scripted engine's answer, when not ANSWER (and its finish reason, when not 'stop')


@pytest.fixture
def answer():
    """Sets the scripted engine's answer for one test."""
    yield lambda text: script.update(answer=text)
    script.clear()


def _stream(client, body, parts: dict | None = None) -> tuple[str, list[dict], str]:
    """(content, tool calls by index, finish_reason) of a streamed chat answer; its
    reasoning into parts["reasoning"]."""
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    content, calls, reason = "", {}, None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice = json.loads(line[6:])["choices"][0]
        content += choice["delta"].get("content") or ""
        if parts is not None:
            parts["reasoning"] = parts.get("reasoning", "") + (choice["delta"].get("reasoning_content") or "")
        for c in choice["delta"].get("tool_calls") or []:
            assert c["index"] not in calls
            calls[c["index"]] = {k: v for k, v in c.items() if k != "index"}
        reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_tools_reach_the_template_and_calls_come_back(scripted):
    client, prompts = scripted
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 50}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    prompt = prompts[-1]
    assert 'get_weather: {"type": "object", "properties": {"city": {}}}' in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>' in prompt
    assert "### tool:\nsunny" in prompt
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me check."
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == ["Paris", "Oslo"]
    content, calls, reason = _stream(client, body)
    assert content.strip() == "Let me check." and reason == "tool_calls"
    assert [c["function"] for c in calls] == [c["function"] for c in message["tool_calls"]]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


@pytest.mark.parametrize("choice", [{}, {"tool_choice": "auto"}])
def test_parallel_tool_calls_false_keeps_the_first_call(scripted, choice):
    """parallel_tool_calls false with automatic calls: the answer's first call only (OpenAI's
    and vLLM's), whole and streamed; true or left out: every call."""
    client, _ = scripted
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 50, **choice}
    for flag, cities in ((False, ["Paris"]), (True, ["Paris", "Oslo"]), (None, ["Paris", "Oslo"])):
        asked = {**body, "parallel_tool_calls": flag}
        choice0 = client.post("/v1/chat/completions", json=asked).json()["choices"][0]
        assert choice0["finish_reason"] == "tool_calls"
        got = [json.loads(c["function"]["arguments"])["city"] for c in choice0["message"]["tool_calls"]]
        content, calls, reason = _stream(client, asked)
        assert got == [json.loads(c["function"]["arguments"])["city"] for c in calls] == cities
        assert content.strip() == choice0["message"]["content"] == "Let me check." and reason == "tool_calls"


@pytest.mark.parametrize("extra", [{}, {"tool_choice": "none"}])
def test_without_tools_the_answer_is_text(scripted, extra):
    """No tools: nothing written into the prompt (the template sees tools = None, as in
    transformers), nothing parsed; tool_choice 'none': the tools are in the prompt (vLLM's
    default) but the answer is not parsed."""
    client, prompts = scripted
    body = {"messages": MESSAGES[:1], "max_tokens": 50, **extra, **({"tools": TOOLS} if extra else {})}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert ("### tools" in prompts[-1]) == bool(extra) and prompts[-1].startswith("[some]" if extra else "[none]")
    assert choice["message"]["content"] == ANSWER and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"
    assert _stream(client, body) == (ANSWER, [], "stop")


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "number", "maximum": 2.5}}}}}], "tool_choice": "required"},
     "tool_choice"),  # a parameter schema that structured outputs cannot keep
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"tools": {"get_weather": {}}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs"),
])
def test_tool_requests_the_server_cannot_honour(scripted, body, param):
    client, _ = scripted
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES[:1], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    bad_call = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]
    r = client.post("/v1/chat/completions", json={"messages": bad_call})
    assert r.status_code == 400 and "tool_calls" in r.json()["error"]["message"]


def test_a_deeply_nested_call_is_no_server_error(scripted):
    """A client's earlier call whose arguments nest past Python's stack: passed as given."""
    client, prompts = scripted
    deep = [{"role": "assistant", "content": None,
             "tool_calls": [{"function": {"name": "f", "arguments": "[" * 1100}}]}]
    r = client.post("/v1/chat/completions", json={"messages": deep, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_a_tool_use_template_is_taken_for_tools(tmp_path):
    """Hermes checkpoints name two templates, 'default' and 'tool_use': with tools the
    latter renders (as transformers picks it); a tool with parameters null is taken."""
    config = {"chat_template": [{"name": "default", "template": "plain {{ messages[0].content }}"},
                                {"name": "tool_use",
                                 "template": "tools {{ tools | length }} {{ messages[0].content }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_folder(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert template.prompt(messages) == "plain hi"
    assert template.prompt(messages, tools=TOOLS) == "tools 1 hi"
    from treeflash.server.answers import request_tools
    nulled = [{"type": "function", "function": {"name": "f", "parameters": None}}]
    assert request_tools({"tools": nulled}, "hermes") == (nulled, "hermes", None)


def test_newer_transformers_tool_use_template_file_is_taken_for_tools(tmp_path):
    """transformers >= 4.54 saves named templates as additional_chat_templates/NAME.jinja."""
    (tmp_path / "chat_template.jinja").write_text("plain {{ messages[0].content }}")
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(
        "tools {{ tools | length }} {{ messages[0].content }}")
    template = ChatTemplate.from_folder(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert template.prompt(messages) == "plain hi"
    assert template.prompt(messages, tools=TOOLS) == "tools 1 hi"


def test_named_templates_without_a_default_are_refused_as_such(tmp_path):
    from treeflash.errors import TreeflashError
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "rag", "template": "R"}]}))
    with pytest.raises(TreeflashError, match=r"the chat templates \(rag\) name none 'default'"):
        ChatTemplate.from_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": ["R"]}))
    with pytest.raises(TreeflashError, match="must be a string or a list of"):
        ChatTemplate.from_folder(tmp_path)


def test_a_messages_other_keys_reach_the_template():
    """Qwen3's template reads an assistant turn's reasoning_content, gpt-oss's its thinking:
    keys past role and content are the template's (as transformers and vLLM pass them)."""
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}"
                            "[{{ m.reasoning_content }}]{% endif %}{{ m.content }}{{ m.tool_call_id }}{% endfor %}")
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo", "reasoning_content": "R"},
                {"role": "tool", "content": "4", "tool_call_id": "7"}]
    assert template.prompt(messages) == "<user>hi<assistant>[R]yo<tool>47"


def test_tools_need_a_parser():
    """A server started without --tool-call-parser refuses tools (it would not parse the
    answer), and an unknown parser is refused at start."""
    from treeflash.errors import UsageError
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32")
    with TestClient(build_app(llm, "tiny", ChatTemplate("{{ messages[0].content }}"))) as client:
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES[:1], "tools": TOOLS})
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "tools"
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES[:1], "tools": TOOLS, "max_tokens": 2,
                                                      "tool_choice": "none"})  # not to be used: fine
        assert r.status_code == 200, r.text
    with pytest.raises(UsageError, match="unknown tool-call parser"):
        build_app(llm, "tiny", None, tool_parser="mistral")
    with pytest.raises(UsageError, match="unknown reasoning parser"):
        build_app(llm, "tiny", None, reasoning_parser="o1")


# ----------------------------------------------------------------------------- reasoning

THOUGHT = "<think>\nThe user wants Paris.\n</think>\n\n"
REASONED = [THOUGHT + "It is sunny.", THOUGHT + CALL, "<think>\ncut off before the e", "No thinking here.",
            "<thin", "", "<think></think>answer", "</think> ends nothing", "\n <think>r</think>x", "  \n"]


@pytest.mark.parametrize("text", REASONED)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_reasoning_stream_cut_anywhere_gives_the_whole_answer(text, piece):
    for parser in ("qwen3", "deepseek_r1"):
        stream, reasoning, content = ReasoningStream(parser), "", ""
        for i in range(0, len(text), piece):
            r, c = stream.push(text[i:i + piece])
            reasoning, content = reasoning + r, content + c
        r, c = stream.finish()
        assert ((reasoning + r) or None, content + c) == split_reasoning(text, parser)


def test_split_reasoning():
    assert split_reasoning(REASONED[0], "qwen3") == ("\nThe user wants Paris.\n", "It is sunny.")
    assert split_reasoning(REASONED[2], "qwen3") == ("\ncut off before the e", "")  # cut off: all reasoning
    assert split_reasoning("No thinking here.", "qwen3") == (None, "No thinking here.")
    # DeepSeek-R1's prompt opens the block: the answer starts inside it
    assert split_reasoning("step 1\n</think>\nDone.", "deepseek_r1") == ("step 1\n", "Done.")
    assert split_reasoning("No end tag", "deepseek_r1") == ("No end tag", "")
    assert split_reasoning(REASONED[6], "qwen3") == (None, "answer")
    for parser in ("qwen3", "deepseek_r1"):  # the opening tag after white space
        assert split_reasoning(REASONED[8], parser) == ("r", "x")
    assert split_reasoning("  \n", "qwen3") == (None, "  \n")


def test_reasoning_cut_off_inside_its_end_tag_stays_reasoning():
    """An answer cut off (max_tokens) after part of `</think>`: that part is reasoning's
    text; none of the reasoning leaks into the content."""
    for parser, text in (("qwen3", "<think>\nwait</thi"), ("deepseek_r1", "wait</thi")):
        assert split_reasoning(text, parser) == (text.removeprefix("<think>"), ""), parser


def test_a_prompt_that_opens_the_reasoning_is_read_from_inside_it():
    """A Qwen3 prompt that ends with <think> (Qwen3-Thinking-2507's template; a final
    message continued inside the block) leaves the answer inside its reasoning: qwen3's
    parser reads it as deepseek_r1 does, so `...</think>` is not content."""
    from treeflash.chat import ChatTemplate
    from treeflash.server.protocol import parse_chat
    body = {"messages": MESSAGES[:1], "max_tokens": 8}
    for prompt_end, parser in (("<think>\n", "deepseek_r1"), ("", "qwen3"), ("<think>\n\n</think>\n\n", "qwen3")):
        template = ChatTemplate("{{ messages[0].content }}\nassistant: " + prompt_end.replace("\n", "{{ '\\n' }}"))
        req = parse_chat(body, ("m",), template, lambda text, **kw: [1] * 4, 100, reasoning_parser="qwen3")
        assert req.reasoning == parser and req.reasoned == (prompt_end.count("<") != 2), prompt_end
    reasoning, content, _ = MessageStream("deepseek_r1").push("I should say hi.</think>\n\nHi!", final=True)
    assert (reasoning, content) == ("I should say hi.", "Hi!")


def test_a_continued_final_message_is_read_where_it_left_its_reasoning():
    """An assistant prefill continued (continue_final_message) inside an unclosed <think>
    block is reasoning, and a structured output waits for its end; one that closed the
    block is continued in the answer, with no reasoning to wait for. Before, only a
    prefill that ended with the tag itself was read from inside (`<think>\nLet me see`
    came back as content, and a guided choice could open another <think> in it)."""
    from treeflash.chat import ChatTemplate
    from treeflash.server.protocol import parse_chat
    template = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}{{ '\\n' }}{% endfor %}")
    for parser, prefill, read, reasoned in (
            ("qwen3", "<think>\nLet me see", "deepseek_r1", True),
            ("qwen3", "<think>\nx\n</think>\n\nThe answer is", "qwen3", False),
            ("qwen3", "<think>a</think> b <think>\nagain", "deepseek_r1", True),
            ("qwen3", "The answer is", "qwen3", True),
            ("deepseek_r1", "step 1</think>\nSo", "deepseek_r1", False),
            ("deepseek_r1", "step 1", "deepseek_r1", True)):
        body = {"messages": MESSAGES[:1] + [{"role": "assistant", "content": prefill}], "max_tokens": 8,
                "add_generation_prompt": False, "continue_final_message": True, "guided_choice": ["yes", "no"]}
        req = parse_chat(body, ("m",), template, lambda text, **kw: [1] * 4, 100, reasoning_parser=parser)
        waits = req.params.structured_outputs.reasoning
        assert (req.reasoning, req.reasoned, waits) == (read, reasoned, read if reasoned else None), prefill


def test_a_prefill_inside_its_reasoning_is_answered_as_reasoning(scripted, answer):
    """Through the server, whole and streamed: the continuation of a prefill inside an
    open <think> is reasoning up to </think>, and the rest is content."""
    client, _ = scripted
    body = {"messages": MESSAGES[:1] + [{"role": "assistant", "content": "<think>\nLet me see"}], "max_tokens": 40,
            "add_generation_prompt": False, "continue_final_message": True}
    answer(" the sky.</think>\n\nIt is blue.")
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (" the sky.", "It is blue.")
    parts = {}
    assert _stream(client, body, parts)[0] == "It is blue." and parts["reasoning"] == " the sky."


def test_reasoning_comes_back_apart_and_calls_after_it(scripted, answer):
    client, _ = scripted
    body = {"messages": MESSAGES[:1], "max_tokens": 80}
    answer(REASONED[0])
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("\nThe user wants Paris.\n", "It is sunny.")
    parts = {}
    assert _stream(client, body, parts) == ("It is sunny.", [], "stop")
    assert parts["reasoning"] == message["reasoning_content"]
    answer(REASONED[1])  # thinking, then a call
    choice = client.post("/v1/chat/completions", json={**body, "tools": TOOLS}).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] == "\nThe user wants Paris.\n"
    parts = {}
    content, calls, reason = _stream(client, {**body, "tools": TOOLS}, parts)
    assert content == "" and [c["function"] for c in calls] == [c["function"] for c in choice["message"]["tool_calls"]]
    assert reason == "tool_calls" and parts["reasoning"] == "\nThe user wants Paris.\n"
    answer("Plain.")
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] == "Plain."


def test_tokenize_counts_the_tools(scripted):
    """vLLM's /tokenize takes a chat's tools: the ids of the prompt the chat would get."""
    client, prompts = scripted
    client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2})
    r = client.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 200, r.text
    body = r.json()
    without = client.post("/tokenize", json={"messages": MESSAGES}).json()
    assert body["count"] > without["count"]
    assert client.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"] == prompts[-1]
    for bad in ({"messages": MESSAGES, "tools": [{"type": "x"}]}, {"prompt": "x", "tools": TOOLS}):
        r = client.post("/tokenize", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_llm_chat_writes_the_tools_into_the_prompt(scripted):
    """LLM.chat(tools=...), as vLLM's: the prompt the server's chat gets; bad tools are
    refused before anything is rendered."""
    from treeflash.errors import UsageError
    client, prompts = scripted
    client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2})
    served = prompts[-1]
    assert served.startswith("[some]### tools:")
    client.llm.chat(MESSAGES, tools=TOOLS)
    assert prompts[-1] == served
    client.llm.chat(MESSAGES)
    assert prompts[-1].startswith("[none]")
    with pytest.raises(UsageError, match="'tools' must be a list"):
        client.llm.chat(MESSAGES, tools=[{"type": "retrieval"}])
    for parameters in ([], 0, "", False, {"type": "string"}):  # arguments are an object: keyword arguments
        with pytest.raises(UsageError, match="'tools' must be a list"):
            client.llm.chat(MESSAGES, tools=[{"type": "function", "function": {"name": "f", "parameters": parameters}}])
    client.llm.chat(MESSAGES, tools=[{"type": "function", "function": {"name": "f", "parameters": None}}])


# ----------------------------------------------------------------------------- llama3_json

LLAMA_ANSWERS = ['{"name": "get_weather", "parameters": {"city": "Paris"}}',
                 '<|python_tag|> {"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": [1, 2]}}',
                 ' \n{"name": "f"}', "Hello {\"name\": \"f\"}", '{"name": "f", "parameters": {', "{not json}",
                 '{"name": "f"} and more', "<|python", "", '{"name": "Alice", "age": 30}',
                 '{"name": "f", "parameters": {}}; {"name": "Bob", "city": "Paris"}']


def test_llama3_json_calls():
    """Llama 3.1-3.3 answer a call with the whole answer: JSON objects of a name and its
    parameters, ';' between them, after an optional <|python_tag|>; anything else is text
    (a JSON answer with a "name" among other keys too)."""
    content, calls = split_tool_calls(LLAMA_ANSWERS[0], "llama3_json")
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    content, calls = split_tool_calls(LLAMA_ANSWERS[1], "llama3_json")
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"x": [1, 2]}
    assert split_tool_calls(LLAMA_ANSWERS[2], "llama3_json")[1][0]["function"]["name"] == "f"
    for text in LLAMA_ANSWERS[3:]:
        assert split_tool_calls(text, "llama3_json") == (text, []), text


@pytest.mark.parametrize("text", LLAMA_ANSWERS)
@pytest.mark.parametrize("piece", [1, 4])
def test_llama3_json_stream_cut_anywhere_gives_the_whole_answer(text, piece):
    stream, content, calls = MessageStream(None, "llama3_json"), "", []
    for i in range(0, len(text), piece):
        _, c, new = stream.push(text[i:i + piece], final=False)
        content, calls = content + c, calls + new
    _, c, new = stream.push("", final=True)
    content, calls = content + c, calls + new
    whole_content, whole = split_tool_calls(text, "llama3_json")
    assert ((content or None) if calls else content) == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole]


def test_a_llama3_json_call_may_name_its_type():
    """Llama 3.x may write `"type": "function"` beside the name and parameters: still a
    call, with its parameters as the arguments."""
    content, calls = split_tool_calls('{"type": "function", "name": "f", "parameters": {"x": 1}}', "llama3_json")
    assert content is None and [c["function"] for c in calls] == [{"name": "f", "arguments": '{"x": 1}'}]


def test_llama3_json_through_the_server(scripted, answer):
    client, _ = scripted
    answer(LLAMA_ANSWERS[1])
    with TestClient(build_app(client.llm, "tiny", ChatTemplate(TEMPLATE), tool_parser="llama3_json")) as llama:
        body = {"messages": MESSAGES[:1], "tools": TOOLS, "max_tokens": 50}
        choice = llama.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["f", "g"]
        content, calls, reason = _stream(llama, body)
        assert (content, reason) == ("", "tool_calls")
        assert [c["function"] for c in calls] == [c["function"] for c in choice["message"]["tool_calls"]]


# ----------------------------------------------------------------------------- forced calls

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_forced_calls_schema_keeps_each_tools_definitions():
    """A tool's own $defs (pydantic's) resolve in the schema of the whole answer (its root's
    $id, which would make it a resource of its own, is dropped); a tool that lists no
    parameters is called with {}."""
    import re

    from treeflash.server.answers import forced_calls_schema
    from treeflash.structured.json_schema import schema_regex
    loc = {"$id": "https://example.com/f", "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}},
           "required": ["loc"],
           "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    other = {"type": "object", "properties": {"loc": {"$ref": "#/definitions/Loc"}}, "required": ["loc"],
             "definitions": {"Loc": {"type": "object", "properties": {"zip": {"type": "integer"}},
                                     "required": ["zip"]}}}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in (("f", loc), ("g", other), ("h", None))]
    regex = schema_regex(forced_calls_schema(tools))
    good = [{"name": "f", "parameters": {"loc": {"city": "x"}}}, {"name": "g", "parameters": {"loc": {"zip": 1}}},
            {"name": "h", "parameters": {}}]
    assert re.fullmatch(regex, json.dumps(good))
    for bad in ([{"name": "f", "parameters": {"loc": {"zip": 1}}}], [{"name": "h", "parameters": {"a": 1}}], []):
        assert not re.fullmatch(regex, json.dumps(bad)), bad


def test_forced_calls_keep_every_constraint_of_a_tools_schema():
    """A tool's schema is compiled as given: constraints beyond 'properties' are kept or
    refused, never read as "no parameters"; only its root's definitions move (a property
    named 'definitions' or '$defs', and a const holding such keys, are the tool's data);
    its $defs and definitions stay apart."""
    import re

    from treeflash.server.answers import forced_calls_schema
    from treeflash.structured.json_schema import schema_regex

    def calls(parameters):
        return forced_calls_schema([{"type": "function", "function": {"name": "f", "parameters": parameters}}])
    for refused in ({"type": "object", "required": ["city"]},
                    {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 1},
                    {"allOf": [{"$ref": "#/$defs/A"}], "$defs": {"A": {"type": "object", "required": ["city"]}}},
                    {"type": "object", "not": {"type": "string"}}):
        with pytest.raises(UsageError):
            schema_regex(calls(refused))
    for empty in (None, {}, {"type": "object"}, {"type": "object", "description": "no arguments", "title": "T"}):
        assert re.fullmatch(schema_regex(calls(empty)), '[{"name": "f", "parameters": {}}]')
    data = {"type": "object", "required": ["definitions", "$defs", "k"],
            "properties": {"definitions": {"type": "integer"}, "$defs": {"type": "integer"},
                           "k": {"const": {"$defs": 1, "a": 2}},
                           "a": {"$ref": "#/definitions/X"}, "b": {"$ref": "#/$defs/X"}},
            "definitions": {"X": {"type": "integer"}}, "$defs": {"X": {"type": "string"}}}
    regex = schema_regex(calls(data))
    answer = {"definitions": 1, "$defs": 2, "k": {"$defs": 1, "a": 2}, "a": 3, "b": "s"}
    assert re.fullmatch(regex, json.dumps([{"name": "f", "parameters": answer}]))
    for wrong in ({**answer, "a": "s"}, {**answer, "b": 3}, {**answer, "k": {"a": 2}}):
        assert not re.fullmatch(regex, json.dumps([{"name": "f", "parameters": wrong}])), wrong


def test_a_forced_tools_bad_schema_is_named_with_its_own_path():
    """An unsupported parameter schema of a forced tool is refused naming the tool and a
    path in its own schema (not in the list-of-calls schema the answer is built from)."""
    from treeflash.server.answers import forced_calls_schema, forced_schema_error
    from treeflash.structured.json_schema import schema_regex
    bad = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "nonsense"}}}
    tools = FORCED_TOOLS + [{"type": "function", "function": {"name": "broken", "parameters": bad}}]
    schema = forced_calls_schema(tools)
    with pytest.raises(UsageError, match=r"anyOf\[2\]\.properties\.parameters\.properties\.b") as e:
        schema_regex(schema)
    assert forced_schema_error(tools, schema, str(e.value)).startswith(
        "tool 'broken', parameters schema: 'type' at $.properties.b ")
    schema_regex(forced_calls_schema(tools, name="get_weather"))  # only the named tool's schema is compiled
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32")
    with TestClient(build_app(llm, "tiny", ChatTemplate("{{ messages[0].content }}"))) as client:
        for choice in ("required", {"type": "function", "function": {"name": "broken"}}):
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "tools": tools, "tool_choice": choice})
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
            assert r.json()["error"]["message"].startswith("tool 'broken', parameters schema: "), r.text


@pytest.mark.parametrize("choice,names", [("required", {"get_weather", "get_time"}),
                                          ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"})])
def test_a_forced_call_is_a_call_without_a_parser(choice, names):
    """tool_choice 'required' or a named function (vLLM's): the answer is constrained to
    a JSON list of calls of the tools (the named one: exactly one), whatever the model
    would say, and comes back as tool_calls, whole or streamed, on a server without a
    tool-call parser; parallel_tool_calls false allows one call. The answer ends with
    'tool_calls', or 'stop' where the function was named (OpenAI's and vLLM's rule)."""
    llm = LLM(builtin_paths()[0], device="cpu", dtype="float32")
    with TestClient(build_app(llm, "tiny", ChatTemplate("{{ messages[0].content }}"))) as client:
        body = {"messages": [{"role": "user", "content": "def weather(city):"}], "tools": FORCED_TOOLS,
                "tool_choice": choice, "max_tokens": 60, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()["choices"][0]
        calls = out["message"]["tool_calls"]
        finish = "tool_calls" if choice == "required" else "stop"
        assert out["finish_reason"] == finish and out["message"]["content"] is None
        assert calls and {c["function"]["name"] for c in calls} <= names
        assert len(calls) == 1 or choice == "required"
        for c in calls:
            args = json.loads(c["function"]["arguments"])
            assert isinstance(args, dict) and (c["function"]["name"] == "get_time" and args == {}
                                               or isinstance(args["city"], str) and len(args["city"]) <= 12)
        content, streamed, reason = _stream(client, body)
        assert (content, reason) == ("", finish)
        assert [c["function"] for c in streamed] == [c["function"] for c in calls]
        one = client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False}).json()
        assert len(one["choices"][0]["message"]["tool_calls"]) == 1


def test_a_long_call_streamed_in_small_pieces_is_read_in_linear_time():
    """The server's event loop reads every stream: a 200 KB call pushed 4 characters at a
    time took 5 s when each piece searched the whole block for its end again (now ~0.2 s;
    CPU time, so that a loaded machine's other processes do not count)."""
    import time
    text = '<tool_call>{"name": "f", "arguments": {"x": "' + "a" * 200_000 + '"}}</tool_call>'
    stream, calls, start = MessageStream(None, "hermes"), [], time.process_time()
    for i in range(0, len(text), 4):
        calls += stream.push(text[i:i + 4])[2]
    calls += stream.push("", final=True)[2]
    assert time.process_time() - start < 1.5
    assert [c["function"]["name"] for c in calls] == ["f"] and len(calls[0]["function"]["arguments"]) > 200_000


def test_special_tokens_named_only_in_special_tokens_map_json(tmp_path):
    """Older transformers saved bos_token / eos_token in special_tokens_map.json only:
    the template renders them and the end token ends generation, as transformers reads
    that file; where tokenizer_config.json names one too, the config wins."""
    import shutil

    from treeflash.engine.options import builtin_paths
    from treeflash.tokenizer import Tokenizer
    shutil.copy(builtin_paths()[0] / "tokenizer.json", tmp_path / "tokenizer.json")
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|pad|>", "eos_token": {"content": "<|endoftext|>", "special": True}}))
    messages = [{"role": "user", "content": "hi"}]
    assert ChatTemplate.from_folder(tmp_path).prompt(messages) == "<|pad|>hi<|endoftext|>"
    assert Tokenizer(tmp_path).eos_token_ids == [0]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|mask|>"}))
    assert ChatTemplate.from_folder(tmp_path).prompt(messages) == "<|pad|>hi<|mask|>"
    assert Tokenizer(tmp_path).eos_token_ids == [2]


# ----------------------------------------------------------------------------- tool schemas (cases a mutation review found untested)

TWO_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]


def test_tool_choice_required_without_parallel_tool_calls_allows_several_calls():
    """parallel_tool_calls left out is true (OpenAI's default): only an explicit false
    limits a forced answer to one call."""
    from treeflash.server.answers import FORCED, request_tools
    _, reader, schema = request_tools({"tools": TWO_TOOLS, "tool_choice": "required"}, None)
    assert reader == FORCED and "maxItems" not in schema and schema["minItems"] == 1
    _, _, one = request_tools({"tools": TWO_TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, None)
    assert one["maxItems"] == 1


def test_a_named_function_is_called_exactly_once():
    from treeflash.server.answers import request_tools
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, _, schema = request_tools({"tools": TWO_TOOLS, "tool_choice": named}, None)
    assert schema["minItems"] == schema["maxItems"] == 1
    from treeflash.structured.json_schema import schema_regex
    from treeflash.structured.regex import compile_regex
    dfa = compile_regex(schema_regex(schema))
    call = '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    assert dfa.matches(f"[{call}]".encode()) and not dfa.matches(f"[{call}, {call}]".encode())


def test_a_const_value_shaped_like_a_reference_is_kept_as_data():
    from treeflash.server.answers import forced_calls_schema
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "$defs": {"a": {"type": "string"}},
        "properties": {"x": {"const": {"$ref": "#/$defs/a"}}, "y": {"$ref": "#/$defs/a"}}}}}]
    params = forced_calls_schema(tools)["items"]["properties"]["parameters"]
    assert params["properties"]["x"]["const"] == {"$ref": "#/$defs/a"}  # data, as written
    assert params["properties"]["y"]["$ref"] != "#/$defs/a"  # a real reference is renamed apart


def test_a_forced_call_beside_a_structured_output_is_refused_as_both():
    """tool_choice 'required' or a named function constrains the answer to its calls: a
    structured output asked beside it is refused by name, before anything is compiled (not
    dropped for the calls' schema)."""
    from treeflash.server.protocol import APIError, parse_chat
    template = ChatTemplate("{{ messages[0].content }}")
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice in ("required", named):
        for extra in ({"guided_regex": "a"}, {"response_format": {"type": "json_object"}}):
            body = {"messages": MESSAGES[:1], "tools": TWO_TOOLS, "tool_choice": choice, **extra}
            with pytest.raises(APIError, match="not both") as e:
                parse_chat(body, ("m",), template, lambda text, **kw: [1] * 4, 100, tool_parser="hermes")
            assert e.value.param == next(iter(extra)), (choice, extra)


def test_a_forced_tools_bad_schema_is_named_beside_a_text_response_format(scripted):
    """response_format {"type": "text"} asks for nothing: a forced call whose tool's
    schema cannot be compiled is still refused as tool_choice's, in the tool's own terms
    (not as response_format's)."""
    client, _ = scripted
    bad = {"type": "object", "properties": {"b": {"type": "nonsense"}}}
    tools = [{"type": "function", "function": {"name": "broken", "parameters": bad}}]
    for choice in ("required", {"type": "function", "function": {"name": "broken"}}):
        r = client.post("/v1/chat/completions", json={"messages": MESSAGES[:1], "tools": tools, "tool_choice": choice,
                                                      "response_format": {"type": "text"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
        assert r.json()["error"]["message"].startswith("tool 'broken', parameters schema: "), r.text


# ------------------------------------------------------------------------------ messages and templates

@pytest.mark.parametrize("messages,message", [
    ([], "'messages' must be a non-empty list of messages"),
    ([{"role": "user"}], r"messages\[0\] must have string 'content'"),  # (an assistant's may be null: vLLM's "")
    ([{"role": "user", "content": [{"text": "hi"}]}], r"messages\[0\]: only text content parts are supported"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]: only text content parts are supported"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}],
     r"messages\[0\]\.content\[1\]: a text part must have a string 'text'"),
    ([{"role": "user\udcff", "content": "hi"}], r"messages\[0\] must be valid Unicode text"),
    # fields a template writes into the prompt: a non-string was written as its Python repr
    ([{"role": "user", "content": "q", "name": {"first": "Ann"}}], r"messages\[0\]\.name must be a string"),
    ([{"role": "user", "content": "q", "name": True}], r"messages\[0\]\.name must be a string, got True"),
    ([{"role": "tool", "content": "4", "tool_call_id": 7}], r"messages\[0\]\.tool_call_id must be a string"),
    ([{"role": "assistant", "content": "", "reasoning_content": ["x"]}],
     r"messages\[0\]\.reasoning_content must be a string"),
    ([{"role": "assistant", "content": "", "tool_calls": {}}], r"messages\[0\]: 'tool_calls' must be a list"),
])
def test_malformed_conversations_are_refused_naming_the_message(messages, message):
    """A conversation the template could not render as given is a one-line UsageError
    naming what is wrong, not a prompt rendered without it."""
    with pytest.raises(UsageError, match=message):
        ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}").prompt(messages)


def test_an_empty_list_of_tools_is_no_tools(scripted):
    """OpenAI clients send "tools": [] for none: the prompt is the one without tools (the
    template sees tools none), not a tool prompt listing nothing."""
    client, prompts = scripted
    client.llm.chat(MESSAGES, tools=[])
    with_empty = prompts[-1]
    client.llm.chat(MESSAGES)
    assert with_empty == prompts[-1] and with_empty.startswith("[none]")


def test_a_tools_parameters_without_a_type_are_an_object():
    """A function's parameters schema that leaves out "type" (properties only) describes
    keyword arguments as OpenAI reads it: taken, not refused as "must be a list"."""
    from treeflash.chat import checked_tools
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"properties": {"city": {}}}}}]
    assert checked_tools(tools) == tools


def test_a_final_message_the_template_rewrites_cannot_be_continued():
    """continue_final_message ends the prompt inside the final message's text: a template
    that writes another text there is refused, not continued from a prompt that does not
    end in what the client gave."""
    from treeflash.chat import ChatFormat
    template = ChatTemplate("{% for m in messages %}{{ m.content | replace('x', 'y') }}{% endfor %}")
    continued = ChatFormat(add_generation_prompt=False, continue_final_message=True)
    assert template.prompt([{"role": "assistant", "content": "abc"}], continued) == "abc"
    with pytest.raises(UsageError, match="does not write the final message's text as given: it cannot be continued"):
        template.prompt([{"role": "assistant", "content": "fix"}], continued)


def test_tojson_in_a_template_writes_text_as_it_is():
    """Templates write tools and calls with tojson as transformers' does (ensure_ascii off):
    "°C" reaches the model as the characters, not as \\u00b0 escapes it was not trained on."""
    template = ChatTemplate("{{ messages[0].content | tojson }}")
    assert template.prompt([{"role": "user", "content": "20 °C, 東京"}]) == '"20 °C, 東京"'


@pytest.mark.parametrize("name", ["add_generation_prompt", "continue_final_message"])
def test_chat_format_switches_must_be_booleans(name):
    """add_generation_prompt / continue_final_message given as "false" (which would read as
    true) are refused, naming the option."""
    from treeflash.chat import ChatFormat
    with pytest.raises(UsageError, match=f"{name} must be true or false, got 'false'") as e:
        ChatTemplate("{{ messages[0].content }}").prompt([{"role": "user", "content": "hi"}],
                                                          ChatFormat(**{name: "false"}))
    assert e.value.param == name


def test_an_answer_cut_off_at_its_opening_tag_leaks_no_tag():
    """An answer cut off (max_tokens) right after `<think>` is an empty reasoning, not a
    "<think>" in the content; deepseek_r1's answer starts inside the reasoning, so one
    cut off before anything is known (a blank, part of a tag) is reasoning, as qwen3's
    is content."""
    for parser in ("qwen3", "deepseek_r1"):
        assert split_reasoning("<think>", parser) == (None, ""), parser
        stream = ReasoningStream(parser)
        assert stream.push("<think>") == ("", "") and stream.finish() == ("", "")
    for text in ("<th", "\n"):
        assert split_reasoning(text, "deepseek_r1") == (text, "")
        assert split_reasoning(text, "qwen3") == (None, text)


def test_a_llama3_json_answer_of_only_the_python_tag_is_text():
    """An answer that is `<|python_tag|>` and nothing after it (cut off, or a model that
    stopped there) holds no call: its text comes back as content, not as nothing."""
    for text in ("<|python_tag|>", "<|python_tag|> \n"):
        assert split_tool_calls(text, "llama3_json") == (text, [])


def test_a_call_cut_off_by_max_tokens_ends_with_length(scripted, answer):
    """finish_reason 'tool_calls' replaces 'stop' only: an answer that made a call and
    then ran into max_tokens ends with 'length' (the client must know it was cut off),
    whole and streamed; its complete call still comes back."""
    client, _ = scripted
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 50}
    answer(CALL + "\nAnd now")
    script["reason"] = "length"
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    content, calls, reason = _stream(client, body)
    assert reason == "length" and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_streamed_deltas_carry_only_the_parts_they_have(scripted, answer):
    """A streamed chat delta names only the parts it adds: reasoning deltas carry no
    "content" key (clients show a content key as the answer starting), and the last
    event, when the answer's text was all sent, has an empty delta beside its
    finish_reason, as OpenAI's."""
    client, _ = scripted
    answer(THOUGHT + "It is sunny.")
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES[:1], "max_tokens": 80, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert deltas[-1]["finish_reason"] == "stop" and deltas[-1]["delta"] == {}
    assert all(d["delta"].get("content", "x") != "" and d["delta"].get("reasoning_content", "x") != ""
               for d in deltas)
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == "\nThe user wants Paris.\n"
    assert "".join(d["delta"].get("content", "") for d in deltas) == "It is sunny."


def test_content_parts_are_joined_by_newlines_and_a_call_without_arguments_has_none():
    """A message's list of text parts reaches the template as one text, the parts joined
    by newlines (as vLLM joins them); an earlier call given without "arguments" reaches
    it with empty arguments ({}), not null."""
    template = ChatTemplate("{% for m in messages %}{{ m.content }}|{% for c in m.tool_calls or [] %}"
                            "{{ c.function.name }}({{ c.function.arguments | tojson }}){% endfor %}{% endfor %}")
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                       "function": {"name": "now"}}]}]
    assert template.prompt(messages) == "a\nb||now({})"
