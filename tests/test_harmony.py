"""gpt-oss's Harmony answers split into parts (`treeflash serve --reasoning-parser
openai_gptoss --tool-call-parser openai`, vLLM's names).

What a client relies on: the analysis channel comes back as `reasoning_content`, the
final channel and commentary preambles as content, a commentary message to
`functions.NAME` as a tool call (recipient before or after the channel), the same whole
or streamed however the text is cut; a cut-off answer gives its text so far; text
outside the format is content; no marker (special tokens, which the parser needs in the
text) ever reaches the client, whatever skip_special_tokens says, while stop strings,
logprobs and usage work as for any answer; structured outputs, which cannot wait for the
final channel, get a 400.
"""
from __future__ import annotations

import json
import random
import re

import pytest

from treeflash.errors import UsageError
from treeflash.server.answers import HarmonyStream, MessageStream, chat_parsers, harmony_opened

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")

THINK = "<|channel|>analysis<|message|>User asks 2+2. Simple: 4.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>The answer is 4."
ANSWER = THINK + FINAL + "<|return|>"
# a call, the recipient after the channel, and before it (in the turn's header)
CALL_AFTER = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
CALL_BEFORE = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}'
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Let me check the weather.<|end|>"
CALLED = "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant" + CALL_AFTER

ANSWERS = [ANSWER, CALLED, THINK + PREAMBLE + CALL_BEFORE + "<|call|>", ANSWER[:40], ANSWER[:-len("<|return|>")],
           " to=functions.get_weather<|channel|>commentary json<|message|>{}", "Plain text, no format at all.",
           "Skipped the format<|end|><|start|>assistant<|channel|>final<|message|>then kept it",
           "<|channel|>final<|message|>a < b and <| is text<|return|>", "", "  \n", "to", "<|cha",
           # not JSON: as written; a recipient with no name; a header cut off; ignore_eos' next turn
           "<|channel|>commentary to=functions.f json<|message|>{not json}<|call|>",
           "<|channel|>commentary to=functions. json<|message|>{}<|call|>", THINK + "<|start|>assistant<|chan",
           ANSWER + "<|start|>assistant<|channel|>final<|message|>More.",
           "<|channel|>final<|message|>a<|message|>b<|constrain|>c<|return|>"]  # markers out of place: dropped


def split(text: str, tools: bool = True, opened: str | None = None) -> tuple[str, str, list[dict]]:
    """(reasoning, content, calls' functions) of a whole answer."""
    reasoning, content, calls = MessageStream("openai_gptoss", "openai" if tools else None, opened).push(
        text, final=True)
    return reasoning, content, [c["function"] for c in calls]


def streamed(text: str, cuts, tools: bool = True, opened: str | None = None) -> tuple[str, str, list[dict]]:
    """The same, fed in the pieces between `cuts`."""
    stream, reasoning, content, calls = HarmonyStream(tools, opened), "", "", []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:]):
        r, c, new = stream.push(text[a:b])
        reasoning, content, calls = reasoning + r, content + c, calls + new
    r, c, new = stream.finish()
    return reasoning + r, content + c, [x["function"] for x in calls + new]


def test_reasoning_final_and_calls():
    assert split(ANSWER) == ("User asks 2+2. Simple: 4.", "The answer is 4.", [])
    assert split(CALLED) == ("Need the weather.", "", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])
    # the recipient in the turn's header, before the channel (arguments re-written as JSON, as the others')
    reasoning, content, calls = split(ANSWERS[2])
    assert (reasoning, content) == ("User asks 2+2. Simple: 4.", "Let me check the weather.")  # the preamble
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    _, _, whole = MessageStream("openai_gptoss", "openai").push(CALLED, final=True)
    assert whole[0]["type"] == "function" and re.fullmatch(r"call_[0-9a-f]{24}", whole[0]["id"])
    assert whole[0]["index"] == 0
    # right after the generation prompt `<|start|>assistant`, the header may start with the recipient
    assert split(ANSWERS[5]) == ("", "", [{"name": "get_weather", "arguments": "{}"}])
    # two calls (ignore_eos): numbered
    _, _, two = MessageStream("openai_gptoss", "openai").push(CALL_AFTER + CALL_BEFORE, final=True)
    assert [c["index"] for c in two] == [0, 1] and len({c["id"] for c in two}) == 2


def test_cut_off_and_out_of_format_answers():
    assert split(ANSWER[:40]) == ("User asks ", "", [])  # cut off in the analysis: reasoning so far
    assert split(ANSWERS[4]) == ("User asks 2+2. Simple: 4.", "The answer is 4.", [])  # <|return|> not in the text
    assert split(THINK + FINAL[:-6]) == ("User asks 2+2. Simple: 4.", "The answer", [])
    assert split(THINK + "<|start|>assistant<|chan") == ("User asks 2+2. Simple: 4.", "", [])  # a header cut off
    assert split("Plain text, no format at all.") == ("", "Plain text, no format at all.", [])
    assert split(ANSWERS[7]) == ("", "Skipped the format\nthen kept it", [])  # a part's messages: one per line
    assert split(ANSWERS[8]) == ("", "a < b and <| is text", [])
    assert split("") == split("  \n") == ("", "", [])
    assert split("to") == ("", "to", []) and split("<|cha") == ("", "<|cha", [])
    assert split(ANSWERS[-2]) == ("User asks 2+2. Simple: 4.", "The answer is 4.\nMore.", [])
    assert split(ANSWERS[-1]) == ("", "abc", [])
    # a call cut off: a call if its JSON is whole, else its text is content
    assert split(CALL_AFTER[:-len("<|call|>")])[2] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert split(CALL_AFTER[:-12]) == ("", '{"city": "Par', [])
    assert split(ANSWERS[13]) == ("", "{not json}", [])
    assert split(ANSWERS[14]) == ("", "{}", [])


def test_messages_to_other_recipients_are_neither_calls_nor_content():
    """Only messages to functions.NAME are the request's calls: one to a built-in tool
    (python, browser.search) or a tool's reply the model went on to invent (ignore_eos)
    is dropped, as vLLM drops it, not shown as content or as an undeclared call."""
    browser = '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>'
    python = "<|start|>assistant<|channel|>analysis to=python code<|message|>print(2**10)<|call|>"
    invented = '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 20}<|end|>'
    for text in (THINK + browser, THINK + python):
        assert split(text) == ("User asks 2+2. Simple: 4.", "", [])
    assert split(CALLED + invented) == split(CALLED)
    assert split(THINK + python + FINAL)[1] == "The answer is 4."
    for at in range(len(CALLED + invented) + 1):
        assert streamed(CALLED + invented, [at]) == split(CALLED), at


def test_without_the_tool_parser_a_call_is_content():
    """No `openai` tool parser (or tool_choice 'none'): the call's arguments are content."""
    assert split(CALLED, tools=False) == ("Need the weather.", '{"city": "Paris"}', [])
    assert split(ANSWERS[2], tools=False)[1] == 'Let me check the weather.\n{"city":"Oslo"}'


def test_a_recipient_right_after_a_marker_is_still_a_call():
    """The header's `to=functions.NAME` may follow a marker with no space between
    (`<|constrain|>to=...`): still a call, not its arguments as content."""
    text = '<|channel|>commentary<|constrain|>to=functions.get_weather<|message|>{"city": "Rome"}<|call|>'
    want = ("", "", [{"name": "get_weather", "arguments": '{"city": "Rome"}'}])
    assert split(text) == streamed(text, range(1, len(text))) == want


def test_an_empty_message_adds_no_line_to_its_part():
    """A message with no text (an empty preamble) gives its part nothing: the next
    message of that part does not start with a newline, whole or streamed."""
    text = "<|channel|>commentary<|message|><|end|><|start|>assistant<|channel|>final<|message|>Hi<|return|>"
    assert split(text) == streamed(text, range(1, len(text))) == ("", "Hi", [])


@pytest.mark.parametrize("text", ANSWERS)
def test_a_stream_cut_anywhere_gives_the_whole_answer(text):
    whole = split(text)
    for tools in (True, False):
        want = split(text, tools)
        for at in range(len(text) + 1):  # every split point
            assert streamed(text, [at], tools) == want, at
    for piece in (1, 2, 3, 5):
        assert streamed(text, range(piece, len(text), piece)) == whole
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        assert streamed(text, cuts) == whole


def test_no_marker_is_sent_before_it_is_known():
    """Streamed, text that may begin a marker is held: no delta ever holds part of one."""
    stream = HarmonyStream()
    for ch in ANSWERS[2]:
        reasoning, content, _ = stream.push(ch)
        assert "<" not in reasoning + content


@pytest.mark.parametrize("text", [ANSWER, ANSWERS[2]])
def test_a_cut_off_answer_is_the_beginning_of_the_whole(text):
    """An answer cut anywhere but inside a marker (markers are single tokens): each part
    is the beginning of the whole answer's, and holds no marker."""
    inside = {i for m in MARKERS for s in (k for k in range(len(text)) if text.startswith(m, k))
              for i in range(s + 1, s + len(m))}
    full = split(text, tools=False)
    for at in sorted(set(range(len(text) + 1)) - inside):
        reasoning, content, _ = split(text[:at], tools=False)
        assert full[0].startswith(reasoning) and full[1].startswith(content), at
        assert not any(m in reasoning + content for m in MARKERS)


def test_the_prompt_may_leave_a_message_open():
    """continue_final_message: a prompt that ends inside a message's text; the answer goes
    on in that message's channel."""
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>analysis<|message|>The user"
    assert harmony_opened(prompt) == "<|start|>assistant<|channel|>analysis"
    rest = " says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    assert split(rest, opened=harmony_opened(prompt)) == (" says hi.", "Hi!", [])
    assert streamed(rest, range(1, len(rest)), opened=harmony_opened(prompt)) == (" says hi.", "Hi!", [])
    assert split("Hi!", opened="<|start|>assistant<|channel|>final") == ("", "Hi!", [])
    for between in ("<|start|>user<|message|>hi<|end|><|start|>assistant", "<|start|>user<|message|>hi<|end|>",
                    "no format"):
        assert harmony_opened(between) is None


def test_which_parsers_go_together():
    """`openai` reads the calls of the answers `openai_gptoss` reads: alone it implies it
    (vLLM always splits gpt-oss's reasoning off); mixed with another format's, refused."""
    assert chat_parsers("openai", None) == ("openai", "openai_gptoss")
    assert chat_parsers(None, "openai_gptoss") == (None, "openai_gptoss")
    assert chat_parsers("hermes", "qwen3") == ("hermes", "qwen3")
    for pair in (("openai", "qwen3"), ("hermes", "openai_gptoss"), ("llama3_json", "openai_gptoss")):
        with pytest.raises(UsageError, match="read different formats"):
            chat_parsers(*pair)
    with pytest.raises(UsageError, match="unknown reasoning parser 'harmony'"):
        chat_parsers(None, "harmony")


def test_serve_refuses_mismatched_parsers_in_one_line(capsys):
    from treeflash.cli import main
    assert main(["serve", "--tool-call-parser", "openai", "--reasoning-parser", "qwen3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "read different formats" in err


# ----------------------------------------------------------------------------- server

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402
from test_chat_parsers import TOOLS  # noqa: E402

from treeflash import LLM, SamplingParams  # noqa: E402
from treeflash.chat import ChatTemplate  # noqa: E402
from treeflash.engine.requests import TokenLogprob  # noqa: E402
from treeflash.server.app import build_app  # noqa: E402

# Harmony as gpt-oss's template writes it (much shortened): tools in a developer message,
# earlier calls and tool answers as messages, the generation prompt `<|start|>assistant`
TEMPLATE = ("<|start|>system<|message|>You are ChatGPT.<|end|>"
            "{% if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n{% for t in tools %}"
            "type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;\n{% endfor %}}"
            "<|end|>{% endif %}"
            "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
            "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary json<|message|>"
            "{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
            "{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
            "{% elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
            "{{ m.content }}<|end|>{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
USER = [{"role": "user", "content": "What is 2+2?"}]


def _write_harmony_model(folder) -> None:
    """A tiny random target whose byte-level BPE tokenizer has Harmony's special tokens
    (EOS: <|return|> and <|call|>, as gpt-oss's generation_config), and the template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from treeflash.checkpoints import write_random_target
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", *MARKERS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["analysis final commentary assistant functions get_weather json city Paris Oslo",
                             "The user asks what 2+2 is. The answer is 4. Let me check the weather."] * 4, trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    ids = {m: tok.token_to_id(m) for m in MARKERS}
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|return|>", "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE}))
    (folder / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [ids["<|return|>"], tok.token_to_id("<|endoftext|>"), ids["<|call|>"]]}))
    write_random_target(folder, num_layers=2, vocab_size=tok.get_vocab_size(), eos_token_id=ids["<|return|>"])


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("harmony") / "gpt-oss-tiny"
    _write_harmony_model(folder)
    return folder


script: dict = {}  # the scripted engine's answer, when not ANSWER


@pytest.fixture(scope="module")
def scripted(harmony_model):
    """A server (both Harmony parsers) for an engine whose answer is script["answer"]'s
    tokens, one per on_tokens call, ended, cut at stop strings and decoded by the
    engine's own code (`RequestRules.append_until_end`, `cut_at_stop_string`, `output`), with made-up
    logprobs; the prompts it got are recorded."""
    llm = LLM(harmony_model, device="cpu", dtype="float32")
    prompts = []

    def generate(batch, params, on_tokens=None, on_done=None):
        params = params if isinstance(params, list) else [params] * len(batch)
        outs = []
        for k, (prompt, p) in enumerate(zip(batch, params)):
            prompts.append(llm.tokenizer.decode(prompt, skip_special=False))
            out, reason, lps = [], None, []
            for t in llm.encode(script.get("answer", ANSWER), special=False):
                before = len(out)
                reason = llm.rules.append_until_end([t], out, p, p.max_new_tokens)
                if p.stop and llm.rules.cut_at_stop_string(out, before, p, prompt):
                    reason = "stop"
                new = [TokenLogprob(t, -0.25, [(t, -0.25)]) for t in out[before:]] if p.logprobs is not None else None
                lps += new or []
                if on_tokens is not None:
                    on_tokens(k, out[before:], new)
                if reason:
                    break
            outs.append(llm.rules.output(out, reason or "length", p, prompt,
                                         lps if p.logprobs is not None else None, None, {"rounds": 1}))
            if on_done is not None:
                on_done(k, outs[-1])
        return outs

    llm.generate = generate
    app = build_app(llm, "gpt-oss-tiny", ChatTemplate.from_folder(harmony_model), tool_parser="openai",
                    reasoning_parser="openai_gptoss")
    with TestClient(app) as client:
        client.llm = llm
        yield client, prompts


@pytest.fixture
def answer():
    yield lambda text: script.update(answer=text)
    script.clear()


def _events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _stream(client, body) -> dict:
    """A streamed answer gathered: {reasoning, content, calls, finish_reason, stop_reason,
    logprobs, usage}."""
    got = {"reasoning": "", "content": "", "calls": [], "finish_reason": None, "logprobs": [], "usage": None}
    for event in _events(client.post("/v1/chat/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}})):
        got["usage"] = event.get("usage") or got["usage"]
        if not event["choices"]:
            continue
        choice = event["choices"][0]
        delta = choice["delta"]
        got["reasoning"] += delta.get("reasoning_content") or ""
        got["content"] += delta.get("content") or ""
        got["calls"] += [c["function"] for c in delta.get("tool_calls") or []]
        got["logprobs"] += (choice["logprobs"] or {}).get("content") or []
        if choice["finish_reason"]:
            got["finish_reason"], got["stop_reason"] = choice["finish_reason"], choice["stop_reason"]
    return got


def _whole(client, body) -> dict:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice, message = out["choices"][0], out["choices"][0]["message"]
    return {"reasoning": message.get("reasoning_content") or "", "content": message["content"] or "",
            "calls": [c["function"] for c in message.get("tool_calls") or []],
            "finish_reason": choice["finish_reason"], "stop_reason": choice["stop_reason"],
            "logprobs": (choice["logprobs"] or {}).get("content") or [], "usage": out["usage"],
            "message": message}


def _both(client, body) -> dict:
    """The whole answer, checked equal to the streamed one."""
    whole, stream = _whole(client, body), _stream(client, body)
    assert {k: v for k, v in whole.items() if k != "message"} == stream
    for part in ("reasoning", "content"):
        assert not any(m in whole[part] for m in MARKERS), whole[part]
    return whole


@pytest.mark.parametrize("skip", [None, True, False])
def test_reasoning_and_content_come_back_apart(scripted, answer, skip):
    """Whatever skip_special_tokens says, the parser reads the markers and the client
    gets none."""
    client, prompts = scripted
    answer(ANSWER)
    body = {"messages": USER, "max_tokens": 100, **({} if skip is None else {"skip_special_tokens": skip})}
    got = _both(client, body)
    assert prompts[-1].endswith("<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant")
    assert (got["reasoning"], got["content"], got["calls"]) == ("User asks 2+2. Simple: 4.", "The answer is 4.", [])
    assert got["finish_reason"] == "stop" and got["stop_reason"] is None
    n = len(client.llm.encode(ANSWER, special=False))
    assert got["usage"]["completion_tokens"] == n  # the markers are tokens: counted
    assert got["message"]["role"] == "assistant" and "tool_calls" not in got["message"]


def test_tool_calls_come_back(scripted, answer):
    client, prompts = scripted
    answer(CALLED)
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 100}
    got = _both(client, body)
    assert "type get_weather = (_: {" in prompts[-1]
    assert got["calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert (got["reasoning"], got["message"]["content"], got["finish_reason"]) == ("Need the weather.", None,
                                                                                   "tool_calls")
    call = got["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    # the call and the tool's answer go back into the next prompt
    followed = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": call["function"]}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    answer(ANSWER)
    assert _both(client, {**body, "messages": followed})["content"] == "The answer is 4."
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|><|start|>functions.get_weather to=assistant') in prompts[-1]
    # the preamble, then a call with the recipient before the channel
    answer(THINK + PREAMBLE + CALL_BEFORE + "<|call|>")
    got = _both(client, body)
    assert got["content"] == "Let me check the weather." and got["finish_reason"] == "tool_calls"
    assert got["calls"] == [{"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    # tool_choice 'none': the answer is not read for calls, its arguments are content
    answer(CALLED)
    got = _both(client, {**body, "tool_choice": "none"})
    assert (got["content"], got["calls"], got["finish_reason"]) == ('{"city": "Paris"}', [], "stop")


def test_stop_strings_logprobs_and_cut_off_answers(scripted, answer):
    client, _ = scripted
    answer(ANSWER)
    body = {"messages": USER, "max_tokens": 100}
    got = _both(client, {**body, "stop": ["is 4"]})
    assert (got["reasoning"], got["content"]) == ("User asks 2+2. Simple: 4.", "The answer ")
    assert (got["finish_reason"], got["stop_reason"]) == ("stop", "is 4")
    got = _both(client, {**body, "stop": ["is 4"], "include_stop_str_in_output": True})
    assert got["content"] == "The answer is 4" and got["stop_reason"] == "is 4"
    # the EOS token kept in the text (include_stop_str_in_output) ends the message: no marker shown
    got = _both(client, {**body, "include_stop_str_in_output": True})
    assert (got["reasoning"], got["content"]) == ("User asks 2+2. Simple: 4.", "The answer is 4.")
    # logprobs: one entry per token, markers too (as vLLM names tokens)
    got = _both(client, {**body, "logprobs": True, "top_logprobs": 1})
    ids = client.llm.encode(ANSWER, special=False)
    assert [e["token"] for e in got["logprobs"]] == [client.llm.tokenizer.token_text(t) for t in ids]
    assert "<|channel|>" in [e["token"] for e in got["logprobs"]]
    # cut off by max_tokens in the analysis: reasoning so far, no content
    cut = len(client.llm.encode(THINK, special=False)) - 3
    got = _both(client, {**body, "max_tokens": cut})
    assert got["finish_reason"] == "length" and got["content"] == "" and got["message"]["content"] is None
    assert "User asks 2+2. Simple: 4.".startswith(got["reasoning"]) and got["reasoning"]
    assert got["usage"]["completion_tokens"] == cut


def test_continuing_the_final_message(scripted, answer):
    """continue_final_message: the prompt ends inside the assistant's final message, and
    the answer, which goes on with it, is content."""
    client, prompts = scripted
    answer(" is 4.<|return|>")
    body = {"messages": [*USER, {"role": "assistant", "content": "The answer"}], "max_tokens": 20,
            "add_generation_prompt": False, "continue_final_message": True}
    got = _both(client, body)
    assert prompts[-1].endswith("<|channel|>final<|message|>The answer")
    assert (got["reasoning"], got["content"]) == ("", " is 4.")


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"guided_regex": "[0-9]+"}, "guided_regex"),
    ({"structured_outputs": {"choice": ["4", "5"]}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
])
def test_structured_outputs_are_refused(scripted, extra, param):
    """A constraint cannot wait for the final channel (its markers are special tokens,
    never allowed): refused, not applied to the reasoning."""
    client, _ = scripted
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 10, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert "openai_gptoss" in r.json()["error"]["message"]
    ok = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 10,
                                                   "response_format": {"type": "text"}})
    assert ok.status_code == 200, ok.text


def test_only_the_reasoning_parser(scripted, answer):
    """--reasoning-parser openai_gptoss alone: reasoning apart; tools need a tool parser
    (or tool_choice 'none', then a call's arguments are content)."""
    client, _ = scripted
    with TestClient(build_app(client.llm, "t", ChatTemplate(TEMPLATE), reasoning_parser="openai_gptoss")) as c:
        answer(ANSWER)
        got = _both(c, {"messages": USER, "max_tokens": 100})
        assert (got["reasoning"], got["content"]) == ("User asks 2+2. Simple: 4.", "The answer is 4.")
        r = c.post("/v1/chat/completions", json={"messages": USER, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        answer(CALLED)
        got = _both(c, {"messages": USER, "tools": TOOLS, "tool_choice": "none", "max_tokens": 100})
        assert (got["content"], got["finish_reason"]) == ('{"city": "Paris"}', "stop")
    with TestClient(build_app(client.llm, "t", ChatTemplate(TEMPLATE), tool_parser="openai")) as c:
        got = _both(c, {"messages": USER, "tools": TOOLS, "max_tokens": 100})  # openai implies openai_gptoss
        assert got["reasoning"] == "Need the weather." and got["calls"][0]["name"] == "get_weather"
    with pytest.raises(UsageError, match="read different formats"):
        build_app(client.llm, "t", None, tool_parser="hermes", reasoning_parser="openai_gptoss")


def test_other_parsers_keep_their_text(scripted, answer):
    """Requests read by other parsers, or none, are unchanged: skip_special_tokens drops
    the markers' text, as it would any special token."""
    client, _ = scripted
    answer(ANSWER)
    with TestClient(build_app(client.llm, "t", ChatTemplate(TEMPLATE))) as c:
        got = _both(c, {"messages": USER, "max_tokens": 100})
        assert got["content"] == "analysisUser asks 2+2. Simple: 4.assistantfinalThe answer is 4."
        shown = _whole(c, {"messages": USER, "max_tokens": 100, "skip_special_tokens": False})
        assert shown["content"] == ANSWER[:-len("<|return|>")]


def test_a_real_engine_answer(harmony_model):
    """The real engine (random weights, markers made likely with logit_bias): the message
    is the parser's reading of the text generate gives with special tokens, whole and
    streamed alike, with its tokens counted."""
    llm = LLM(harmony_model, device="cpu", dtype="float32")
    ids = {m: llm.tokenizer.tok.token_to_id(m) for m in MARKERS}
    bias = {str(ids[m]): 4.0 for m in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")}
    body = {"messages": USER, "max_tokens": 40, "temperature": 1.0, "seed": 3, "logit_bias": bias,
            "ignore_eos": True}
    with TestClient(build_app(llm, "t", ChatTemplate(TEMPLATE), tool_parser="openai")) as client:
        got = _both(client, {**body, "tools": TOOLS})
    prompt = llm.encode(ChatTemplate(TEMPLATE).prompt(USER, tools=TOOLS), special=False)
    out = llm.generate(prompt, SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True,
                                              logit_bias={int(k): v for k, v in bias.items()},
                                              skip_special_tokens=False))[0]
    assert sum(out.text.count(m) for m in MARKERS) >= 3, out.text  # the test reads markers
    reasoning, content, calls = split(out.text)
    assert (got["reasoning"], got["content"], got["calls"]) == (reasoning, content, calls)
    assert got["usage"]["completion_tokens"] == len(out.token_ids) == 40


# ----------------------------------------------------------------------------- Harmony channels (cases a mutation review found untested)

def test_harmony_call_on_the_analysis_channel_is_content_when_calls_are_not_read():
    """Without the openai tool parser (or tool_choice none) a call's text is content,
    whatever channel it is on: not reasoning."""
    from treeflash.server.answers import MessageStream
    text = '<|channel|>analysis to=functions.get_weather<|message|>{"city": "Rome"}<|call|>'
    reasoning, content, calls = MessageStream("openai_gptoss", None).push(text, final=True)
    assert (reasoning, content, calls) == ("", '{"city": "Rome"}', [])


@pytest.mark.parametrize("end", ["<|call|>", "<|return|>"])
def test_a_prompt_whose_last_message_is_closed_by_call_or_return_leaves_none_open(end):
    from treeflash.server.answers import harmony_opened
    prompt = ("<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>commentary to=functions.f "
              "<|constrain|>json<|message|>{}" + end)
    assert harmony_opened(prompt) is None
