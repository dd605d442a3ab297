"""`treeflash serve`: the OpenAI-compatible server over the built-in pair (CPU, float32).

What a client relies on: the server answers exactly what `LLM.generate` gives for the
same parameters (whole or streamed, completions or chat through the model's chat
template); streamed deltas add up to the whole text, stop strings included; every bad
request gets an OpenAI error body with the right status and the server keeps serving,
also after the engine itself fails; and `treeflash serve` runs as a real HTTP server.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")
from starlette.testclient import TestClient  # noqa: E402

from treeflash import LLM, SamplingParams, StructuredOutputs, UsageError  # noqa: E402
from treeflash.engine.options import builtin_paths  # noqa: E402
from treeflash.server.app import build_app  # noqa: E402
from treeflash.chat import ChatFormat, ChatTemplate  # noqa: E402
from treeflash.tokenizer import TextStream  # noqa: E402

PROMPT = "def fib(n):"
TEMPLATE = ("{% for m in messages %}### {{ m.role }}:\n{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """The built-in target with a chat template in its tokenizer_config.json."""
    folder = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(builtin_paths()[0], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def llm(chat_model):
    return LLM(chat_model, draft_model=builtin_paths()[1], device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def client(llm, chat_model):
    with TestClient(build_app(llm, "tiny", ChatTemplate.from_folder(chat_model))) as c:
        yield c


def events(resp) -> list:
    """The data of a server-sent-event stream: JSON objects, then '[DONE]'."""
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    out = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_completion_is_what_generate_gives(llm, client):
    for body, params in [({"temperature": 0}, SamplingParams(max_new_tokens=24)),
                         ({"temperature": 0.8, "top_p": 0.9, "seed": 3},
                          SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=3))]:
        want = llm.generate(PROMPT, params)[0]
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 24, **body})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["object"] == "text_completion" and got["model"] == "tiny"
        assert got["choices"][0]["text"] == want.text
        assert got["choices"][0]["finish_reason"] == want.finish_reason == "length"
        n = len(llm.encode(PROMPT))
        assert got["usage"] == {"prompt_tokens": n, "completion_tokens": 24, "total_tokens": n + 24}
    # token-id prompts and several prompts in one request: one choice each, in order
    ids = llm.encode(PROMPT)
    r = client.post("/v1/completions", json={"prompt": [ids, "import os"], "max_tokens": 8, "temperature": 0})
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [o.text for o in llm.generate([ids, "import os"], SamplingParams(max_new_tokens=8))]


@pytest.mark.parametrize("stop", [None, ["\n"], ["is_", "assert"], ["(n).is_p"]])  # the last spans deltas
def test_streamed_deltas_add_up_to_the_whole_text(client, stop):
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": stop}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    got = events(client.post("/v1/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}))
    assert got[-1] == "[DONE]" and got[-2]["choices"] == [] and got[-2]["usage"]["completion_tokens"] > 0
    text = "".join(e["choices"][0]["text"] for e in got[:-2])
    assert text == whole["text"]
    assert got[-3]["choices"][0]["finish_reason"] == whole["finish_reason"]
    if stop:
        assert whole["finish_reason"] == "stop" and not any(s in text for s in stop)
    else:
        assert len(got) > 4  # streamed in several deltas, not one at the end


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": [PROMPT, "import os"]}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})])
def test_continuous_usage_in_every_event(client, path, extra):
    """vLLM's stream_options.continuous_usage_stats: every choice's event carries its
    usage so far (its prompt, its tokens), ending at what the final usage counts."""
    body = {**extra, "max_tokens": 12, "temperature": 0.8, "seed": 1, "n": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    got = events(client.post(path, json=body))
    final = got[-2]["usage"]
    seen = {}
    for e in got[:-2]:
        i, usage = e["choices"][0]["index"], e["usage"]
        assert usage["completion_tokens"] >= seen.get(i, 0)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen[i] = usage["completion_tokens"]
    assert sorted(seen) == list(range(len(seen))) and all(n == 12 for n in seen.values())
    assert final["completion_tokens"] == sum(seen.values())
    # each choice's prompt is its own (n = 2: choices 2k and 2k + 1 share prompt k; the final usage counts it once)
    prompt_of = {e["choices"][0]["index"]: e["usage"]["prompt_tokens"] for e in got[:-2]}
    assert all(prompt_of[i] == prompt_of[i + 1] for i in range(0, len(prompt_of), 2))
    assert sum(prompt_of[i] for i in range(0, len(prompt_of), 2)) == final["prompt_tokens"]


@pytest.mark.parametrize("stop", [["\n"], ["(n).is_p"]])
def test_stop_strings_kept_in_the_text_on_request(client, stop):
    """include_stop_str_in_output: the text runs to the stop string's end, streamed or
    whole; skip_special_tokens=false is accepted (the built-in model writes none)."""
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stop": stop}
    cut = client.post("/v1/completions", json=body).json()["choices"][0]
    body["include_stop_str_in_output"] = True
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["text"] == cut["text"] + whole["stop_reason"]
    got = events(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in got[:-1]) == whole["text"]
    r = client.post("/v1/completions", json={**body, "skip_special_tokens": False})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == whole["text"]


def test_stop_string_ties_and_kept_stop_tokens(client, llm):
    """Stop strings completed by one token: the first listed ends the text (as vLLM
    checks them in order). A stop token's text is kept with
    include_stop_str_in_output, as vLLM keeps it."""
    prompt = "def add(a, b):"
    first = llm.generate(prompt, SamplingParams(max_new_tokens=1))[0]
    assert llm.tokenizer.token_text(first.token_ids[0]) == " return"  # what the built-in model writes
    for stop in ([" re", " r"], [" r", " re"]):
        for include in (False, True):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": stop,
                    "include_stop_str_in_output": include}
            whole = client.post("/v1/completions", json=body).json()["choices"][0]
            streamed = events(client.post("/v1/completions", json={**body, "stream": True}))[:-1]
            assert whole["stop_reason"] == stop[0] and whole["text"] == (stop[0] if include else "")
            assert "".join(e["choices"][0]["text"] for e in streamed) == whole["text"]
    # completed by one token, at different places: still the first listed, as vLLM (which
    # checks each in turn after every token) ends it, not the one that begins first
    for stop, text in ((["rn", " return"], " retu"), ([" return", "rn"], "")):
        for include in (False, True):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": stop,
                    "include_stop_str_in_output": include}
            whole = client.post("/v1/completions", json=body).json()["choices"][0]
            streamed = events(client.post("/v1/completions", json={**body, "stream": True}))[:-1]
            assert (whole["stop_reason"], whole["text"]) == (stop[0], text + (stop[0] if include else ""))
            assert "".join(e["choices"][0]["text"] for e in streamed) == whole["text"]
    ids = llm.generate(prompt, SamplingParams(max_new_tokens=8)).pop().token_ids
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop_token_ids": [ids[4]]}
    for include in (False, True):
        got = client.post("/v1/completions", json={**body, "include_stop_str_in_output": include}).json()
        text = llm.tokenizer.decode(ids[:5 if include else 4])
        assert got["choices"][0]["text"] == text and got["choices"][0]["stop_reason"] == ids[4]
        streamed = events(client.post("/v1/completions", json={**body, "include_stop_str_in_output": include,
                                                               "stream": True}))[:-1]
        assert "".join(e["choices"][0]["text"] for e in streamed) == text


def test_chat_renders_the_template(llm, client):
    messages = [{"role": "system", "content": "Write Python."},
                {"role": "user", "content": [{"type": "text", "text": "fib"}]}]
    ids = llm.encode("### system:\nWrite Python.\n### user:\nfib\n### assistant:\n", special=False)
    want = llm.generate(ids, SamplingParams(max_new_tokens=20))[0]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 20, "temperature": 0})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert got["usage"]["prompt_tokens"] == len(ids)
    chunks = events(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 20,
                                                               "temperature": 0, "stream": True}))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == want.text


BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5] * 2000}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": -2 ** 63 - 1}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -1.5}, 400, "seed"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"}, 400,
     "reasoning_effort"),
    ("/v1/completions", {"prompt": "x", "reasoning_effort": "low"}, 400, "reasoning_effort"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_obfuscation": 1}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": ["x"] * 600, "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, 400, "top_logprobs"),  # a chat argument
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": "a"}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": "1"}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1024}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"prompt": "x"}, 400, "prompt"),  # a completion's argument
    ("/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages"),
    ("/v1/completions", {"model": 7, "prompt": "x"}, 400, "model"),
    ("/v1/completions", {"model": "\ud800", "prompt": "x"}, 404, "model"),  # quoted back: still valid JSON
    ("/v1/completions", b'{"prompt": "x", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "min_p": -0.1}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "min_p": "0.1"}, 400, "min_p"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": [5]}, 400, "logit_bias"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"5": NaN}}', 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [99999]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"²": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1" * 5000: 1}}, 400, "logit_bias"),  # no int() of it
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1, "005": 2}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 1e39}, 400, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),  # no parser
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 2, "allowed_token_ids": [5],
                         "stop_token_ids": [5], "stream": True}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "temprature": 0}, 400, "temprature"),  # misspelled: not ignored
    ("/v1/completions", {"prompt": "x", "typical_p": 0.5}, 400, "typical_p"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": 1}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999], "stream": True}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "include_stop_str_in_output": 1}, 400, "include_stop_str_in_output"),
    ("/v1/completions", {"prompt": "x", "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "no"}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "\ud800", "content": "x"}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 65}, 400, "stop"),
    ("/v1/completions", {"prompt": ["x"] * 1025}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
     "continue_final_message"),
    # max_completion_tokens wins, but a bad max_tokens beside it is still an error
    ("/v1/completions", {"prompt": "x", "max_tokens": "abc", "max_completion_tokens": 2}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -5, "max_completion_tokens": 2}, 400, "max_tokens"),
    # bookkeeping keys the server does not read still have types
    ("/v1/completions", {"prompt": "x", "user": 5}, 400, "user"),
    ("/v1/completions", {"prompt": "x", "metadata": [1, 2]}, 400, "metadata"),
    ("/v1/completions", {"prompt": "x", "metadata": {"a": 1}}, 400, "metadata"),
    ("/v1/completions", {"prompt": "x", "store": "maybe"}, 400, "store"),
    ("/v1/completions", {"prompt": "x", "service_tier": 7}, 400, "service_tier"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "parallel_tool_calls": "x"}, 400,
     "parallel_tool_calls"),
    # flags that ask for nothing when false are still true or false (0 and 1 are not)
    ("/v1/completions", {"prompt": "x", "use_beam_search": "yes"}, 400, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "use_beam_search": 0}, 400, "use_beam_search"),
    ("/v1/completions", {"prompt": "x", "spaces_between_special_tokens": 1}, 400, "spaces_between_special_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, 400, "stop"),  # could never match: not ignored
    ("/v1/completions", {"prompt": "x", "\ud800": 1}, 400, "\ud800"),  # named back as JSON escapes, not a 500
    ("/v1/completions", {"prompt": "x", "k" * 5000: 1}, 400, "k" * 80),  # named back cut short, as in the message
    # true is not the number 1 where a request names token ids or biases
    ("/v1/completions", {"prompt": [True, 5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [True]}, 400, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [True]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": True}}, 400, "logit_bias"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": -2.5}, 400, "presence_penalty"),  # the bound below
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [0] * 65}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": "yes"}, 400, "stream_options"),
    # a json_schema beside another type asks for that type: refused, not taken as a schema
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml", "json_schema": {
        "name": "s", "schema": {"type": "boolean"}}}}, 400, "response_format"),
    # a key its type does not read (other APIs' json_object with a schema) is refused, not ignored
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_object", "schema": {
        "type": "object", "required": ["a"]}}}, 400, "response_format"),
    # echo with max_tokens 0 scores the prompt only where max_tokens counts: beside
    # max_completion_tokens it is a bad max_tokens like any other
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0, "max_completion_tokens": 2}, 400,
     "max_tokens"),
    ("/v1/completions", {"prompt": "x", "echo": True, "max_tokens": 0, "min_tokens": 1}, 400, "min_tokens"),
    # vLLM's priority needs its priority scheduling (requests run in arrival order); request_id is a string
    ("/v1/completions", {"prompt": "x", "priority": 1}, 400, "priority"),
    ("/v1/completions", {"prompt": "x", "request_id": 5}, 400, "request_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "request_id": ""}, 400, "request_id"),
    ("/v1/completions", {"prompt": "x", "request_id": "r" * 257}, 400, "request_id"),
    # a whole-number float is taken as its integer, a fraction is not
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 1.5}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1.0}, 400, "logprobs"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(client, path, body, status, param):
    kw = {"content": body} if isinstance(body, bytes) else {"content": json.dumps(body)}
    r = client.post(path, **kw)
    assert r.status_code == status, r.text
    assert len(r.content) < 1000  # the message does not echo the input back
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and err["param"] == param
    ok = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_n_choices_per_prompt(client, llm):
    """n choices per prompt, prompt-major; with a seed, choice j samples with seed + j
    (different answers, reproducible); prompt tokens are counted once per prompt."""
    prompts = [PROMPT, "import os"]
    body = {"prompt": prompts, "max_tokens": 10, "temperature": 1.0, "seed": 11, "n": 3}
    got = client.post("/v1/completions", json=body).json()
    want = [llm.generate(p, SamplingParams(max_new_tokens=10, temperature=1.0, seed=11 + j))[0]
            for p in prompts for j in range(3)]
    assert [c["index"] for c in got["choices"]] == list(range(6))
    assert [c["text"] for c in got["choices"]] == [w.text for w in want]
    assert len({w.text for w in want[:3]}) > 1  # not three copies of one sample
    assert got["usage"]["prompt_tokens"] == sum(len(llm.encode(p)) for p in prompts)
    assert got["usage"]["completion_tokens"] == sum(len(w.token_ids) for w in want)
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "fib"}],
                                                     "max_tokens": 6, "temperature": 0, "n": 2}).json()
    assert len(chat["choices"]) == 2 and chat["choices"][0]["message"] == chat["choices"][1]["message"]


def test_usage_counts_a_prompts_cached_tokens_once_whatever_n():
    """usage with n choices per prompt: each prompt's tokens, and the tokens its first
    choice found in the prefix caches, are counted once (the later choices find the
    first's prompt cached: counting theirs too would report more cached tokens than
    prompt tokens); every choice's completion tokens count."""
    from types import SimpleNamespace

    from treeflash.server.protocol import Request, usage
    req = Request("completion", [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=2), n=2)
    outputs = [SimpleNamespace(token_ids=[7, 8], stats={"cached_tokens": c}) for c in (0, 3, 1, 2)]
    assert usage(req, outputs) == {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13,
                                   "prompt_tokens_details": {"cached_tokens": 1}}


def test_logprobs_are_the_engines_in_openai_form(client, llm):
    """Completions: `logprobs: N` gives the legacy lists (each token's text, logprob,
    text offset, and up to N + 1 alternatives: the chosen one included); chat:
    `logprobs: true, top_logprobs: N` gives one entry per token with its bytes. Both
    carry the engine's values, streamed or whole; without asking, logprobs is null."""
    tok = llm.tokenizer
    want = llm.generate(PROMPT, SamplingParams(max_new_tokens=12, logprobs=3))[0]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    got = client.post("/v1/completions", json=body).json()["choices"][0]
    lp = got["logprobs"]
    assert got["text"] == want.text
    assert lp["tokens"] == [tok.token_text(t) for t in want.token_ids] and "".join(lp["tokens"]) == want.text
    assert lp["token_logprobs"] == [e.logprob for e in want.logprobs]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(12)]
    for alts, e in zip(lp["top_logprobs"], want.logprobs):
        assert alts == {**{tok.token_text(i): v for i, v in e.top}, tok.token_text(e.token_id): e.logprob}
        assert 3 <= len(alts) <= 4
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}))[:-1]
    parts = [e["choices"][0]["logprobs"] for e in streamed if e["choices"][0]["logprobs"]]
    assert [x for p in parts for x in p["tokens"]] == lp["tokens"]
    assert [x for p in parts for x in p["text_offset"]] == lp["text_offset"]  # counted across events
    assert [x for p in parts for x in p["token_logprobs"]] == lp["token_logprobs"]
    for off in (None, False):  # what clients send for "no logprobs"
        plain = client.post("/v1/completions", json={**body, "logprobs": off}).json()["choices"][0]
        assert plain["logprobs"] is None and plain["text"] == want.text

    messages = [{"role": "user", "content": "fib"}]
    ids = llm.encode("### user:\nfib\n### assistant:\n", special=False)
    want = llm.generate(ids, SamplingParams(max_new_tokens=10, logprobs=2))[0]
    body = {"messages": messages, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [e.logprob for e in want.logprobs]
    assert [c["token"] for c in content] == [tok.token_text(t) for t in want.token_ids]
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == tok.decode(want.token_ids)
    assert [[a["logprob"] for a in c["top_logprobs"]] for c in content] == \
        [[v for _, v in e.top] for e in want.logprobs]
    streamed = events(client.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]
    assert [c for e in streamed if e["choices"][0]["logprobs"] for c in e["choices"][0]["logprobs"]["content"]] \
        == content
    only = client.post("/v1/chat/completions", json={**body, "top_logprobs": None}).json()
    assert all(c["top_logprobs"] == [] for c in only["choices"][0]["logprobs"]["content"])
    for off in (False, 0, None):
        plain = client.post("/v1/chat/completions", json={**body, "logprobs": off, "top_logprobs": 0}).json()
        assert plain["choices"][0]["logprobs"] is None


def test_logprobs_body_is_strict_json_for_any_value(llm):
    """A log-probability of -inf is reported as vLLM does (-9999) and a NaN (an overflow
    in the activations) as null: json.dumps would write the bare words -Infinity / NaN,
    which strict JSON parsers refuse."""
    from treeflash.engine.requests import TokenLogprob
    from treeflash.server.protocol import LOGPROB_FLOOR, Request, logprobs_body
    entries = [TokenLogprob(5, float("nan"), [(5, float("nan"))]), TokenLogprob(6, float("-inf"), [(7, -0.5)])]
    assert LOGPROB_FLOOR == -9999.0  # vLLM's value: clients compare against it
    for kind in ("completion", "chat"):
        req = Request(kind, [[1]], SamplingParams(max_new_tokens=2, logprobs=1))
        body = json.loads(json.dumps(logprobs_body(req, entries, llm.tokenizer), allow_nan=False))
        if kind == "chat":
            assert [c["logprob"] for c in body["content"]] == [None, LOGPROB_FLOOR]
            assert [c["top_logprobs"][0]["logprob"] for c in body["content"]] == [None, -0.5]
        else:
            assert body["token_logprobs"] == [None, LOGPROB_FLOOR]
            assert list(body["top_logprobs"][1].values()) == [-0.5, LOGPROB_FLOOR]


def test_echo_puts_the_prompt_before_each_choice(client, llm):
    """Completions with echo: each choice's text starts with its prompt (a string as
    sent, token ids decoded), whole and streamed; not with logprobs (that needs the
    prompt's own), nor for chat."""
    ids = llm.encode("import os")
    body = {"prompt": [PROMPT, ids], "max_tokens": 6, "temperature": 0, "n": 2, "echo": True}
    want = [o.text for o in llm.generate([PROMPT, ids], SamplingParams(max_new_tokens=6))]
    got = client.post("/v1/completions", json=body).json()["choices"]
    heads = [PROMPT, llm.tokenizer.decode(ids)]
    assert [c["text"] for c in got] == [heads[i // 2] + want[i // 2] for i in range(4)]
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}))[:-1]
    texts = ["".join(e["choices"][0]["text"] for e in streamed if e["choices"][0]["index"] == i) for i in range(4)]
    assert texts == [c["text"] for c in got]
    bad = client.post("/v1/completions", json={**body, "logprobs": 1, "stream": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"
    bad = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "echo": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "echo"


def test_echo_with_logprobs_scores_the_prompt(client, llm):
    """What evaluation harnesses send to score a text (lm-eval's loglikelihood): echo,
    logprobs and max_tokens 1 give the prompt's tokens with their log-probabilities
    (null for the first), then the generated token's, as the engine's prompt_logprobs."""
    tok, ids = llm.tokenizer, llm.encode(PROMPT)
    want = llm.generate(PROMPT, SamplingParams(max_new_tokens=1, logprobs=2, prompt_logprobs=2))[0]
    got = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True,
                                               "logprobs": 2}).json()["choices"][0]
    lp = got["logprobs"]
    assert got["text"] == PROMPT + want.text and "".join(lp["tokens"]) == got["text"]
    assert lp["tokens"] == [tok.token_text(t) for t in ids + want.token_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [e.logprob for e in want.prompt_logprobs[1:] + want.logprobs]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids) + 1)]
    assert all(2 <= len(t) <= 3 for t in lp["top_logprobs"][1:])


def test_echo_with_max_tokens_0_scores_the_prompt_only(client, llm):
    """OpenAI's legacy scoring call (GPT-3-era harnesses): echo, logprobs and max_tokens
    0 give the prompt, its tokens' log-probabilities and no generated token, whole and
    streamed; max_tokens 0 without echo is still refused."""
    tok, ids = llm.tokenizer, llm.encode(PROMPT)
    want = llm.generate(PROMPT, SamplingParams(max_new_tokens=1, logprobs=2, prompt_logprobs=2))[0]
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}
    got = client.post("/v1/completions", json=body).json()
    choice = got["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [tok.token_text(t) for t in ids]
    assert choice["logprobs"]["token_logprobs"][1:] == [e.logprob for e in want.prompt_logprobs[1:]]
    assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    chunks = events(client.post("/v1/completions", json={**body, "logprobs": None, "stream": True,
                                                         "stream_options": {"include_usage": True}}))
    assert chunks.pop() == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] == 0
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == PROMPT
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    bad = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_what_openai_clients_send_as_nothing_is_taken(client):
    """Values a client sends that ask for nothing: an empty model name (the served one,
    as vLLM answers), OpenAI's chat fields at null or their text-only value, and a signed
    64-bit seed (reproducible as any other)."""
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for extra in ({"model": ""}, {"function_call": None}, {"function_call": "none"}, {"modalities": ["text"]},
                  {"audio": None}, {"prediction": None}, {"web_search_options": None}):
        r = client.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 200, (extra, r.text)
    for extra, param in (({"modalities": ["text", "audio"]}, "modalities"), ({"audio": {"voice": "x"}}, "audio"),
                         ({"function_call": {"name": "f"}}, "function_call")):
        r = client.post("/v1/chat/completions", json={**chat, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    sampled = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    texts = [client.post("/v1/completions", json={**sampled, "seed": s}).json()["choices"][0]["text"]
             for s in (-5, -5, -2 ** 63)]
    assert texts[0] == texts[1]


def test_prompt_logprobs_as_vllm_returns_them(client, llm):
    """vLLM's prompt_logprobs: per prompt token null for the first, then {id: {logprob,
    rank, decoded_token}} for the token (its rank in the vocabulary) and the k most likely
    ids; in each completion choice (beside an echo's logprobs, which keep their own k),
    and beside a chat answer's choices."""
    tok, ids = llm.tokenizer, llm.encode(PROMPT)
    want = llm.generate(PROMPT, SamplingParams(max_new_tokens=2, prompt_logprobs=3))[0].prompt_logprobs
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    for extra in ({}, {"echo": True, "logprobs": 1}, {"n": 2}):
        got = client.post("/v1/completions", json={**body, **extra}).json()
        for choice in got["choices"]:
            plp = choice["prompt_logprobs"]
            assert len(plp) == len(ids) and plp[0] is None
            for entry, e, t in zip(plp[1:], want[1:], ids[1:]):
                assert list(entry)[0] == str(t) and entry[str(t)] == {
                    "logprob": e.logprob, "rank": e.rank, "decoded_token": tok.token_text(t)}
                top = {str(i): (lp, r) for r, (i, lp) in enumerate(e.top, 1)}
                assert {k: (v["logprob"], v["rank"]) for k, v in entry.items() if k != str(t)} == \
                    {k: v for k, v in top.items() if k != str(t)}
            assert any(e.rank > 3 for e in want[1:]), "every prompt token among the top 3: ranks not tested"
        if extra.get("echo"):
            assert all(len(t) <= 2 for t in got["choices"][0]["logprobs"]["top_logprobs"][1:])
        else:
            assert got["choices"][0].get("logprobs") is None
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}],
                                                     "max_tokens": 2, "prompt_logprobs": 0}).json()
    plp = chat["prompt_logprobs"]
    assert plp[0] is None and all(len(entry) == 1 for entry in plp[1:]) and "prompt_logprobs" not in chat["choices"][0]
    assert len(plp) == len(llm.chat_prompt([{"role": "user", "content": PROMPT}]))


def test_echos_logprobs_keep_their_alternatives_beside_fewer_prompt_logprobs(client, llm):
    """echo with logprobs N and prompt_logprobs k < N: the echoed prompt tokens still get
    N alternatives (the engine computes max(N, k)), prompt_logprobs only k."""
    n = len(llm.encode(PROMPT))
    got = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "echo": True,
                                               "logprobs": 3, "prompt_logprobs": 1}).json()["choices"][0]
    assert all(3 <= len(t) <= 4 for t in got["logprobs"]["top_logprobs"][1:n])
    assert all(1 <= len(entry) <= 2 for entry in got["prompt_logprobs"][1:])


def test_token_bytes_rebuild_split_characters(llm, tmp_path):
    """A token may hold part of a UTF-8 character: its text is U+FFFD, its bytes are
    exact, and a token sequence's bytes are the text's. Byte-level BPE (the built-in
    tokenizer, Qwen, Llama 3) and SentencePiece with byte fallback (Llama 2, Mistral),
    whose pieces keep the space that its decoder strips from a text's start."""
    from conftest import write_sentencepiece_tokenizer

    from treeflash.tokenizer import Tokenizer
    tok = llm.tokenizer
    text = "héllo wörld ✓ 日本"
    ids = tok.encode(text, special=False)
    assert any("\ufffd" in tok.token_text(t) for t in ids)
    assert b"".join(tok.token_bytes(t) for t in ids).decode() == text

    write_sentencepiece_tokenizer(tmp_path)
    spt = Tokenizer(tmp_path)
    ids = spt.encode("ab ab é     ab", special=False)
    assert [spt.token_text(t) for t in ids][:2] == [" ab", " ab"]  # not "ab": the space is the token's
    assert "    " in [spt.token_text(t) for t in ids]              # a piece of four spaces keeps them
    assert b"".join(spt.token_bytes(t) for t in ids).decode() == " ab ab é     ab" == " " + spt.decode(ids)
    # a continuation keeps its first space (decoded alone, " ab" would lose it), whole or streamed
    prompt, more = ids[:1], ids[1:]
    assert spt.decode(more) == "ab é     ab" and spt.decode_continuation(more, prompt) == " ab é     ab"
    stream = TextStream(spt, context=prompt)
    assert "".join(stream.push([t]) for t in more) == " ab é     ab"
    # a prompt cut inside a character: streamed deltas still add up to the whole text
    ids = tok.encode("say 日本語 ok", special=False)
    for cut in range(1, len(ids)):
        whole = tok.decode_continuation(ids[cut:], ids[:cut])
        stream = TextStream(tok, context=ids[:cut])
        assert "".join(stream.push([t]) for t in ids[cut:]) == whole and stream.finish(whole) == ""


def metric_samples(text: str) -> dict:
    """Prometheus text as {sample name with labels: value}."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def scrape(client) -> dict:
    """GET /metrics as {sample name with labels: value}."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")  # the text format
    return metric_samples(r.text)


def test_metrics_count_requests_tokens_and_forwards(client):
    """/metrics (Prometheus text): requests by outcome, finished generations by reason,
    prompt and generated tokens, and the target forwards behind them (tokens / forwards
    is tau), as the responses' usage reports them."""
    _wait(lambda: (lambda m: m["treeflash_requests_running"] == m["treeflash_requests_waiting"] == 0)(
        scrape(client)))  # earlier tests' cancelled requests may still be ending
    before = scrape(client)
    whole = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 20, "temperature": 0, "n": 2,
                                                 "ignore_eos": True}).json()
    streamed = events(client.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 7, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}))
    bad = client.post("/v1/completions", json={"prompt": [5, 99999]})  # refused before the engine: not counted
    assert bad.status_code == 400
    # a job is answered from on_done, and leaves the running gauge when its generate call
    # returns: on a loaded machine a scrape can fall between the two
    _wait(lambda: scrape(client)["treeflash_requests_running"] == 0)
    after = scrape(client)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta['treeflash_requests_total{outcome="ok"}'] == 2
    assert delta['treeflash_requests_total{outcome="error"}'] == 0
    assert delta['treeflash_choices_total{finish_reason="length"}'] == 3
    assert delta["treeflash_generation_tokens_total"] == 20 * 2 + 7
    assert delta["treeflash_prompt_tokens_total"] == 2 * whole["usage"]["prompt_tokens"]  # once per prompt
    assert delta["treeflash_request_seconds_count"] == 2 and delta["treeflash_request_seconds_sum"] > 0
    assert delta["treeflash_time_to_first_token_seconds_count"] == 2
    assert 0 < delta["treeflash_time_to_first_token_seconds_sum"] <= delta["treeflash_request_seconds_sum"]
    assert 3 <= delta["treeflash_generation_rounds_total"] < 47  # the drafter gets more than one token a forward
    for name in ("treeflash_request_seconds", "treeflash_time_to_first_token_seconds"):  # histograms
        buckets = [(k, v) for k, v in after.items() if k.startswith(name + "_bucket")]
        assert buckets[-1] == (name + '_bucket{le="+Inf"}', after[name + "_count"])
        counts = [v for _, v in buckets]
        assert counts == sorted(counts) and delta[name + '_bucket{le="+Inf"}'] == 2  # cumulative
        bounds = [float(k.split('le="')[1][:-2]) for k, _ in buckets[:-1]]
        assert bounds == sorted(bounds) and all('.' in k for k, _ in buckets[:-1])  # "1.0", as client libraries
    from treeflash.server.metrics import ServerMetrics
    m = ServerMetrics()
    for seconds in (0.01, 0.0100001, 400):  # a bound is its bucket's own (le: less or equal)
        m.request_done("ok", seconds)
    lines = m.render(0, 0, 0).splitlines()
    assert 'treeflash_request_seconds_bucket{le="0.01"} 1' in lines
    assert 'treeflash_request_seconds_bucket{le="0.025"} 2' in lines
    assert 'treeflash_request_seconds_bucket{le="300.0"} 2' in lines
    assert 'treeflash_request_seconds_bucket{le="+Inf"} 3' in lines
    assert streamed[-2]["usage"]["completion_tokens"] == 7
    assert after["treeflash_requests_running"] == 0 and after["treeflash_requests_waiting"] == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_choices_add_up_to_the_whole_answer(client, path):
    """Several prompts and n choices stream interleaved, each event naming its choice:
    each choice's deltas add up to its whole text, each ends once with its own finish
    reason, and the usage counts every prompt once."""
    body = {"max_tokens": 12, "temperature": 1.0, "seed": 4, "n": 2, "stop": ["\n\n"]}
    if path.endswith("completions") and "chat" not in path:
        body["prompt"] = [PROMPT, "import os"]
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    whole = client.post(path, json=body).json()
    got = events(client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}}))
    assert got[-1] == "[DONE]" and got[-2]["usage"] == whole["usage"]
    chat = "chat" in path
    for want in whole["choices"]:
        mine = [e["choices"][0] for e in got[:-2] if e["choices"][0]["index"] == want["index"]]
        text = "".join(c["delta"].get("content", "") if chat else c["text"] for c in mine)
        assert text == (want["message"]["content"] if chat else want["text"])
        ends = [c for c in mine if c["finish_reason"] is not None]
        assert len(ends) == 1 and ends[0] is mine[-1] and ends[0]["finish_reason"] == want["finish_reason"]
        if chat:
            assert mine[0]["delta"] == {"role": "assistant"}


def test_stop_token_ids_end_like_eos(client, llm):
    """A stop token id ends the request where greedy decoding first produces it, as vLLM
    does: kept in the tokens, left out of the text, finish_reason "stop" and stop_reason
    the id (a stop string's stop_reason is the string); whole and streamed alike."""
    full = llm.generate(PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True))[0].token_ids
    k = next(i for i in range(3, len(full)) if full[i] not in full[:i] and llm.tokenizer.decode(full[i:i + 1]))
    got = llm.generate(PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True, stop_token_ids=[full[k]]))[0]
    assert got.token_ids == full[:k + 1] and got.finish_reason == "stop" and got.stop_reason == full[k]
    assert got.text == llm.tokenizer.decode(full[:k])
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_token_ids": [full[k]]}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"], whole["stop_reason"]) == (got.text, "stop", full[k])
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == got.text
    assert streamed[-2]["choices"][0]["stop_reason"] == full[k]
    stop = llm.tokenizer.decode(full[k:k + 2]).strip() or llm.tokenizer.decode(full[k:k + 2])
    by_string = client.post("/v1/completions", json={**body, "stop_token_ids": [], "stop": [stop]}).json()
    assert by_string["choices"][0]["stop_reason"] == stop


def test_warm_up_runs_rounds_in_every_mode(llm, monkeypatch):
    """`treeflash serve`'s warm-up runs rounds (with --eager that is what compiles the
    round's kernels) in the greedy, sampled and top-p modes, and in the mode of the
    model's sampling defaults (Qwen3's top-k 20 and top-p 0.95: a filter width of its
    own; a repetition penalty: the penalized mode)."""
    from treeflash.server.cli import warm_up
    from treeflash.server.protocol import SamplingDefaults
    modes = []
    real = llm.decoder.round
    monkeypatch.setattr(llm.decoder, "round", lambda st, max_n: modes.append(
        (st.sampling.any_sampled, st.sampling.any_filtered, st.sampling.filter_width, st.sampling.any_penalized))
        or real(st, max_n))
    warm_up(llm, SamplingDefaults(max_tokens=8))
    assert set(modes) == {(False, False, 0, False), (True, False, 0, False), (True, True, 16, False)}
    modes.clear()
    warm_up(llm, SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, max_tokens=8, repetition_penalty=1.05))
    assert (True, True, 64, True) in modes


def test_api_key_guards_the_v1_routes(llm):
    """With an API key, /v1 routes answer only requests that carry it (401 with an OpenAI
    error body otherwise); /health and /metrics stay open for probes and scrapers."""
    with TestClient(build_app(llm, "t", api_key="s3cret")) as c:
        body = {"prompt": PROMPT, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = c.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.get("/v1/models", headers=headers).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_a_model_may_be_named_by_an_alias(llm):
    """A server answers requests naming its model or one of its aliases (`treeflash serve`
    adds --model as given, as vLLM names the model), and says its first name back."""
    with TestClient(build_app(llm, "Qwen3-8B", aliases=("./Qwen3-8B",))) as c:
        for model in ("Qwen3-8B", "./Qwen3-8B"):
            r = c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "Qwen3-8B"
        r = c.post("/v1/completions", json={"model": "Qwen3", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404 and "Qwen3-8B" in r.json()["error"]["message"]


def test_tokenize_and_detokenize(client, llm):
    """vLLM's /tokenize (a prompt, or chat messages through the template) and /detokenize:
    the ids generation would use, and back; bad bodies get 400s naming the field."""
    r = client.post("/tokenize", json={"prompt": PROMPT}).json()
    assert r["tokens"] == llm.encode(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == llm.max_model_len
    plain = client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert plain == llm.encode(PROMPT, special=False)
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "fib"}]}).json()["tokens"]
    assert chat == llm.encode("### user:\nfib\n### assistant:\n", special=False)
    parts = [{"type": "text", "text": "fib"}, {"type": "text", "text": "fast"}]  # joined by a newline, as vLLM
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": parts}]}).json()["tokens"]
    assert r == llm.encode("### user:\nfib\nfast\n### assistant:\n", special=False)
    assert client.post("/detokenize", json={"tokens": plain}).json()["prompt"] == PROMPT
    # vLLM's return_token_strs: the vocabulary's spellings, as transformers' convert_ids_to_tokens
    from transformers import PreTrainedTokenizerFast
    hf = PreTrainedTokenizerFast(tokenizer_file=str(llm.model_path / "tokenizer.json"))
    r = client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == llm.encode(PROMPT) and r["token_strs"] == hf.convert_ids_to_tokens(r["tokens"])
    assert "token_strs" not in client.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": False}).json()
    eos = llm.eos_token_ids[0]  # special tokens are text too (a chat's tokens decode back to the chat)
    assert client.post("/detokenize", json={"tokens": [eos] + plain}).json()["prompt"] == \
        llm.tokenizer.token_text(eos) + PROMPT
    for path, body, param in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                              ("/tokenize", {"prompt": "a", "x": 1}, "x"),
                              ("/tokenize", {"prompt": "a", "return_token_strs": 1}, "return_token_strs"),
                              ("/detokenize", {"tokens": [5, 99999]}, "tokens"),
                              ("/detokenize", {"tokens": "5"}, "tokens")]:
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, body)


def test_token_ids_from_0_to_the_vocabulary_size_are_taken_and_none_past_it(client, llm):
    """Token ids run from 0 to vocab_size - 1: both ends are taken wherever a request
    names ids, and the first id past them (vocab_size) is refused like any larger one,
    with a 400 naming the field (not a null param from the engine's own check, and not
    an empty /detokenize text)."""
    vocab = llm.config.vocab_size
    for path, body, param in [("/v1/completions", {"logit_bias": {str(vocab): 1}}, "logit_bias"),
                              ("/v1/completions", {"allowed_token_ids": [vocab]}, "allowed_token_ids"),
                              ("/v1/completions", {"stop_token_ids": [vocab]}, "stop_token_ids"),
                              ("/detokenize", {"tokens": [vocab]}, "tokens")]:
        r = client.post(path, json={**body, **({"prompt": PROMPT, "max_tokens": 2} if "/v1" in path else {})})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert str(vocab) in r.json()["error"]["message"]
    ends = [0, vocab - 1]
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "allowed_token_ids": ends,
                                             "stop_token_ids": ends, "logit_bias": {str(t): 1 for t in ends}})
    assert r.status_code == 200, r.text
    assert client.post("/detokenize", json={"tokens": ends}).status_code == 200


def test_tokenize_adds_a_prompts_special_tokens_as_completions_do(chat_model):
    """/tokenize gives the ids /v1/completions reads: a prompt with the tokenizer's
    special tokens (BOS) unless add_special_tokens is false; messages only if it is true
    (the template writes its own)."""
    from treeflash.server.protocol import parse_tokenize
    seen = []

    class Tokenizer:
        def encode(self, text, special):
            seen.append(special)
            return [5]
    template = ChatTemplate.from_folder(chat_model)
    for body in ({"prompt": "x"}, {"prompt": "x", "add_special_tokens": False},
                 {"messages": [{"role": "user", "content": "x"}]},
                 {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": True}):
        assert parse_tokenize(body, "m", template, Tokenizer()) == ([5], False)
    assert seen == [True, False, False, True]


def test_special_tokens_are_left_out_of_the_text_unless_asked(client, llm):
    """skip_special_tokens is true unless a request says false (OpenAI's and vLLM's
    default): a special token the model writes (EOS, forced here) is not in the text."""
    eos = llm.eos_token_ids[0]
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "logit_bias": {str(eos): 100}}
    plain = client.post("/v1/completions", json=body).json()
    assert plain["choices"][0]["text"] == "" and plain["usage"]["completion_tokens"] == 2
    kept = client.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()
    assert kept["choices"][0]["text"] == llm.tokenizer.token_text(eos) * 2 != ""


def test_prefix_caching_serves_the_next_turn_from_the_caches(llm, client, chat_model):
    """With `serve --enable-prefix-caching`, a chat's next turn reports the prompt tokens
    it found in the caches (usage.prompt_tokens_details.cached_tokens, as OpenAI) and
    answers what a server without it answers."""
    caching = LLM(chat_model, draft_model=builtin_paths()[1], device="cpu", dtype="float32",
                  enable_prefix_caching=True)
    turn = [{"role": "user", "content": "def fib(n):"}]
    body = {"max_tokens": 8, "temperature": 0}
    with TestClient(build_app(caching, "tiny", ChatTemplate.from_folder(chat_model))) as c:
        first = c.post("/v1/chat/completions", json={**body, "messages": turn}).json()
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        turn += [first["choices"][0]["message"], {"role": "user", "content": "and add(a, b)?"}]
        got = c.post("/v1/chat/completions", json={**body, "messages": turn}).json()
        streamed = events(c.post("/v1/chat/completions", json={
            **body, "messages": turn, "stream": True, "stream_options": {"include_usage": True}}))
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > first["usage"]["prompt_tokens"]
    assert streamed[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == got["usage"]["prompt_tokens"] - 1
    want = client.post("/v1/chat/completions", json={**body, "messages": turn}).json()
    assert got["choices"] == want["choices"] and "prompt_tokens_details" not in want["usage"]


def test_serve_flags_reach_the_engine_and_app():
    """`serve --enable-prefix-caching` builds a caching engine; `--allowed-origins` with
    no origin turns CORS off."""
    from treeflash.cli import build_parser, make_llm
    args = build_parser().parse_args(["serve", "--device", "cpu", "--method", "ar", "--enable-prefix-caching",
                                      "--allowed-origins"])
    assert args.allowed_origins == []
    assert make_llm(args).enable_prefix_caching is True
    assert make_llm(build_parser().parse_args(["serve", "--device", "cpu", "--method", "ar"])).enable_prefix_caching \
        is False


def two_tokens(prompt, special=True, truncate=None) -> list[int]:
    """An encoder for the request parsers that reads every prompt as two tokens."""
    return [5, 6]


def test_seed_minus_one_is_no_seed():
    """vLLM's seed -1 means "no seed" (front-ends send it for a random answer); other
    negative seeds stay errors (the error table above)."""
    from treeflash.server.protocol import parse_completion
    assert parse_completion({"prompt": "x", "seed": -1}, "m", two_tokens, 64).params.seed is None
    assert parse_completion({"prompt": "x", "seed": -1.0}, "m", two_tokens, 64).params.seed is None
    assert parse_completion({"prompt": "x", "seed": 7}, "m", two_tokens, 64).params.seed == 7


def test_seed_takes_vllms_whole_int64_range():
    """seed is vLLM's signed 64-bit integer: its largest value is a seed like any other
    (with n choices, choice j's seed + j wraps to 0, 1, ...: still a seed the engine
    takes); one past it is refused naming seed."""
    from treeflash.server.protocol import APIError, parse_completion
    top = 2 ** 63 - 1
    assert parse_completion({"prompt": "x", "seed": top}, "m", two_tokens, 64).params.seed == top
    runs = parse_completion({"prompt": "x", "seed": top, "n": 3}, "m", two_tokens, 64).runs()
    assert [p.validate().seed for _, p in runs] == [top, 0, 1]
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": "x", "seed": top + 1}, "m", two_tokens, 64)
    assert e.value.param == "seed"


def test_max_completion_tokens_bounds_the_answer_and_wins_over_max_tokens(chat_model):
    """OpenAI's max_completion_tokens (what its newer clients send instead of the
    deprecated max_tokens) bounds the answer as max_tokens does, in completions and chat;
    given with max_tokens it wins; past the context it is refused naming itself."""
    from treeflash.server.protocol import APIError, parse_chat, parse_completion
    assert parse_completion({"prompt": "x", "max_completion_tokens": 5}, "m", two_tokens, 64).params.max_new_tokens == 5
    assert parse_completion({"prompt": "x", "max_tokens": 9, "max_completion_tokens": 5}, "m", two_tokens,
                            64).params.max_new_tokens == 5
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5}
    assert parse_chat(chat, "m", ChatTemplate.from_folder(chat_model), two_tokens, 64).params.max_new_tokens == 5
    room = 64 - len(two_tokens("x"))
    assert parse_completion({"prompt": "x", "max_completion_tokens": room}, "m", two_tokens,
                            64).params.max_new_tokens == room
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": "x", "max_tokens": 2, "max_completion_tokens": room + 1}, "m", two_tokens, 64)
    assert e.value.param == "max_completion_tokens"


def test_the_stop_limits_are_inclusive():
    """MAX_STOPS stop strings, and as many stop token ids, are taken (one more of either
    is refused: the error table above)."""
    from treeflash.server.protocol import MAX_STOPS, parse_completion
    params = parse_completion({"prompt": "x", "stop": [f"s{i}" for i in range(MAX_STOPS)],
                               "stop_token_ids": list(range(MAX_STOPS))}, "m", two_tokens, 64).params
    assert len(params.stop) == len(params.stop_token_ids) == MAX_STOPS


def test_an_empty_plain_chat_answer_is_empty_text_not_null():
    """Without tools or a reasoning parser a chat answer's content is its text: "" when
    the model wrote nothing (EOS first), as vLLM answers; null stands only for an empty
    part beside tool calls or reasoning."""
    from types import SimpleNamespace

    from treeflash.server.protocol import Request, message
    req = Request("chat", [[5, 6]], SamplingParams(max_new_tokens=2))
    assert message(req, SimpleNamespace(text="")) == {"role": "assistant", "content": ""}
    reasoned = Request("chat", [[5, 6]], SamplingParams(max_new_tokens=2), reasoning="qwen3")
    assert message(reasoned, SimpleNamespace(text="")) == {"role": "assistant", "content": None,
                                                            "reasoning_content": None}


def test_whole_number_floats_are_taken_as_integers(client):
    """vLLM's pydantic models read max_tokens 3.0 as 3: a client that computes its
    integer fields as floats gets the same answer, not a 400."""
    ints = {"prompt": PROMPT, "max_tokens": 3, "n": 2, "seed": 7, "temperature": 1.0, "top_k": 5, "logprobs": 2,
            "min_tokens": 3, "echo": True}
    floats = {**ints, **{k: float(ints[k]) for k in ("max_tokens", "n", "seed", "top_k", "logprobs", "min_tokens")}}
    want, got = (client.post("/v1/completions", json=b) for b in (ints, floats))
    assert got.status_code == 200, got.text
    strip = lambda r: [(c["text"], c["logprobs"]) for c in r.json()["choices"]]  # noqa: E731
    assert strip(got) == strip(want) and got.json()["usage"] == want.json()["usage"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2.0, "top_logprobs": 1.0,
            "logprobs": True}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 1


def test_an_answer_takes_the_id_its_request_gives(client):
    """vLLM's request_id field (and its X-Request-Id header, which wins) name the answer:
    "cmpl-ID" / "chatcmpl-ID", whole and streamed; priority 0 (the default) is taken."""
    body = {"prompt": PROMPT, "max_tokens": 2, "request_id": "job-7", "priority": 0.0}
    assert client.post("/v1/completions", json=body).json()["id"] == "cmpl-job-7"
    assert client.post("/v1/completions", json=body, headers={"X-Request-Id": "hdr"}).json()["id"] == "cmpl-hdr"
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}))
    assert {e["id"] for e in streamed if isinstance(e, dict)} == {"cmpl-job-7"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "request_id": "c1"}
    assert client.post("/v1/chat/completions", json=chat).json()["id"] == "chatcmpl-c1"
    ids = {client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()["id"] for _ in range(2)}
    assert len(ids) == 2  # without one, each answer's own
    long = client.post("/v1/completions", json=body, headers={"X-Request-Id": "h" * 257})
    assert long.status_code == 400 and "X-Request-Id" in long.json()["error"]["message"]


def test_blank_bad_words_ban_nothing():
    """bad_words that are blank ("" or whitespace, which no token sequence spells as a
    word) ask for nothing, as "" in stop does: dropped, not a 400 for the whole request."""
    from treeflash.server.protocol import parse_completion
    assert parse_completion({"prompt": "x", "bad_words": ["", " ", "foo"]}, "m", two_tokens, 64).params.bad_words \
        == ["foo"]
    assert parse_completion({"prompt": "x", "bad_words": ["", "\n"]}, "m", two_tokens, 64).params.bad_words is None


def test_max_tokens_left_out_is_openais_16_for_completions_and_what_fits_for_chat(chat_model):
    """Without max_tokens a completion gets at most 16 tokens (OpenAI's default), fewer
    where the context has less room; a chat request gets what fits the context."""
    from treeflash.server.protocol import parse_chat, parse_completion
    assert parse_completion({"prompt": "x"}, "m", two_tokens, 64).params.max_new_tokens == 16
    assert parse_completion({"prompt": "x"}, "m", two_tokens, 10).params.max_new_tokens == 8
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert parse_chat(chat, "m", ChatTemplate.from_folder(chat_model), two_tokens, 64).params.max_new_tokens == 62


def test_a_request_past_the_context_is_named_as_openai_and_vllm_name_it(client, llm):
    """A context overflow says so in OpenAI's and vLLM's words, which clients match
    (LiteLLM's context-window fallbacks look for "This model's maximum context length
    is", capital T and all), with OpenAI's code."""
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                   "max_completion_tokens": llm.max_model_len})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_completion_tokens", r.text
    assert err["message"].startswith(f"This model's maximum context length is {llm.max_model_len} tokens")
    assert err["code"] == "context_length_exceeded"
    # so is a prompt that cannot fit by itself, in tokens or in characters
    for prompt in (list(range(3, llm.max_model_len + 3)), "x" * (10 ** 6)):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "prompt", r.text
        assert err["message"].startswith(f"This model's maximum context length is {llm.max_model_len} tokens")
        assert err["code"] == "context_length_exceeded"


def test_1024_choices_per_request_are_taken():
    """The request limits are inclusive: 1024 prompts, or prompts x n = 1024 choices, are
    taken (1025 are refused: the error table above)."""
    from treeflash.server.protocol import parse_completion
    assert len(parse_completion({"prompt": ["x"] * 1024}, "m", two_tokens, 64).runs()) == 1024
    assert len(parse_completion({"prompt": ["x"] * 512, "n": 2}, "m", two_tokens, 64).runs()) == 1024


def test_a_range_error_shows_its_bounds_as_written():
    """'[1e-30, 1e+30]', not the float 1 / 1e30 printed as 9.999999999999999e-31."""
    from treeflash.server.protocol import APIError, parse_completion
    for body, bounds in (({"repetition_penalty": -1}, "in [1e-30, 1e+30], got -1"),
                         ({"temperature": 3}, "in [0, 2], got 3"), ({"top_p": 0}, "in (0, 1], got 0")):
        with pytest.raises(APIError, match=re.escape(bounds)):
            parse_completion({"prompt": "x", **body}, "m", two_tokens, 64)


def test_add_special_tokens_reaches_the_tokenizer(chat_model):
    """vLLM's add_special_tokens: a completion's text gets the tokenizer's special tokens
    (BOS) unless it says false; a chat prompt only if it says true (its template writes
    its own)."""
    from treeflash.server.protocol import parse_chat, parse_completion
    seen = []

    def encode(prompt, special=True, truncate=None):
        seen.append(special)
        return [5, 6]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    template = ChatTemplate.from_folder(chat_model)
    for extra in ({}, {"add_special_tokens": False}, {"add_special_tokens": True}):
        parse_completion({"prompt": "x", **extra}, "m", encode, 64)
        parse_chat({**chat, **extra}, "m", template, encode, 64)
    assert seen == [True, False, False, False, True, True]


def test_values_that_ask_for_nothing_are_accepted(client, llm):
    """Defaults sent explicitly (null, "", the OpenAI default) change nothing; a request
    without max_tokens gets at most what fits the context."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    want = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    extra = {"suffix": "", "response_format": {"type": "text"}, "tool_choice": "none", "stream": None, "n": 1,
             "logprobs": None, "stop": "", "presence_penalty": 0, "top_k": -1, "ignore_eos": None, "user": "me",
             "metadata": {"trace": "t1"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True,
             "max_completion_tokens": None, "safety_identifier": "u1", "prompt_cache_key": "k1", "seed": -1}
    r = client.post("/v1/completions", json={**body, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    ids = [5] * (llm.max_model_len - 4)
    r = client.post("/v1/completions", json={"prompt": ids, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4  # not 16: 4 fit
    r = client.post("/v1/completions", content=b'{"prompt": "' + b"a" * (33 << 20) + b'"}')
    assert r.status_code == 413


def test_routes_and_errors_outside_the_api(client, llm, chat_model):
    from treeflash import __version__
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/version").json() == {"version": __version__}  # vLLM's probe
    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny"] and models[0]["max_model_len"] == llm.max_model_len
    assert 0 < time.time() - models[0]["created"] < 3600  # when the server took the model, as vLLM's
    r = client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    with TestClient(build_app(llm, "tiny", None, aliases=("tiny-2", "./tiny"))) as c:  # every name it answers to
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny", "tiny-2", "./tiny"]
        assert c.get("/v1/models/tiny-2").json()["id"] == "tiny-2"  # OpenAI's retrieve-model route
        for other in ("other", ""):  # an empty name is none of them (in a body it means the served one)
            r = c.get(f"/v1/models/{other}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert "'tiny', 'tiny-2', './tiny'" in r.json()["error"]["message"]


def test_browser_pages_may_call_the_server(client, llm):
    """CORS, as vLLM: any origin by default (a preflight, then the request); none with
    allowed_origins=() (`serve --allowed-origins` with no origins)."""
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type,authorization"}
    r = client.options("/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers={"Origin": "http://ui.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    with TestClient(build_app(llm, "tiny", None, allowed_origins=())) as c:
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers={"Origin": "http://ui.example"})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_an_unexpected_error_is_a_500_body_and_the_connection_stays(llm, monkeypatch, caplog):
    """A bug in a handler answers 500 with an OpenAI error body and one log line, as a
    normal response: the client's keep-alive connection is not dropped, and the server
    goes on serving."""
    import treeflash.server.app as app_module

    def broken(*args):
        raise TypeError("a bug")
    monkeypatch.setattr(app_module, "parse_tokenize", broken)
    with TestClient(build_app(llm, "tiny", None), raise_server_exceptions=True) as c:
        r = c.post("/tokenize", json={"prompt": "a"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "TypeError: a bug" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    assert any("TypeError: a bug" in m for m in caplog.messages)


def test_llm_chat_is_what_the_chat_endpoint_gives(llm, client, monkeypatch):
    """LLM.chat (vLLM's Python chat API): the template's rendering generated, the same
    text as /v1/chat/completions; one output per conversation; bad messages and a model
    without a template are one-line usage errors."""
    from treeflash.errors import UsageError
    talk = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": PROMPT}]
    other = [{"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]}]
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    (out,) = llm.chat(talk, params)
    rendered = "### system:\nYou write Python.\n### user:\ndef fib(n):\n### assistant:\n"
    assert out.token_ids == llm.generate(llm.encode(rendered, special=False), params)[0].token_ids
    r = client.post("/v1/chat/completions", json={"messages": talk, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == out.text
    both = llm.chat([talk, other], params)
    assert [o.token_ids for o in both] == [out.token_ids, llm.chat(other, params)[0].token_ids]
    for bad, message in [([], "conversation"), ("hi", "conversation"), ([{"role": "user"}], "messages\\[0\\]"),
                         ([talk, [{"content": "x"}]], "'role'")]:
        with pytest.raises(UsageError, match=message):
            llm.chat(bad, params)
    for source, message in [("{{ raise_exception('roles must alternate') }}", "refused the messages: roles must"),
                            # one line, as every error (a template's message may span several)
                            ("{{ raise_exception('roles must\\n  alternate') }}", "messages: roles must alternate$"),
                            ("{{ messages[0]['content'] + 1 }}", "refused the messages: TypeError")]:
        monkeypatch.setitem(llm.__dict__, "chat_template", ChatTemplate(source))  # a template's own refusal
        with pytest.raises(UsageError, match=message):
            llm.chat(talk, params)
    monkeypatch.setitem(llm.__dict__, "chat_template", None)
    with pytest.raises(UsageError, match="no chat template"):
        llm.chat(talk, params)


def test_chat_template_kwargs_set_the_templates_variables(llm, monkeypatch):
    """chat_template_kwargs (vLLM's; Qwen3's enable_thinking) reach the template, in
    /v1/chat/completions, /tokenize and LLM.chat alike, and may set a special token's
    text as in transformers; a malformed one, or one that would set what the engine sets,
    is the request's error (400 naming the field)."""
    from treeflash.errors import UsageError
    template = ChatTemplate("{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
                            "{{ bos_token }}{{ messages[0].content }}")
    talk = [{"role": "user", "content": "fib"}]
    plain, off = llm.encode("fib", special=False), llm.encode("<no-think>fib", special=False)
    assert plain != off
    with TestClient(build_app(llm, "t", template)) as c:
        for kwargs, ids in ((None, plain), ({}, plain), ({"enable_thinking": True}, plain),
                            ({"enable_thinking": False}, off), ({"bos_token": "<no-think>"}, off)):
            body = {"messages": talk, "chat_template_kwargs": kwargs}
            assert c.post("/tokenize", json=body).json()["tokens"] == ids
            r = c.post("/v1/chat/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
        for kwargs in ([1], "x", {"messages": []}, {"add_generation_prompt": False}):
            r = c.post("/v1/chat/completions", json={"messages": talk, "chat_template_kwargs": kwargs})
            assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", kwargs
        r = c.post("/tokenize", json={"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    monkeypatch.setitem(llm.__dict__, "chat_template", template)
    params = SamplingParams(max_new_tokens=4)
    assert llm.chat(talk, params, chat_template_kwargs={"enable_thinking": False})[0].token_ids == \
        llm.generate([off], params)[0].token_ids
    with pytest.raises(UsageError, match="chat_template_kwargs may not set messages"):
        llm.chat(talk, params, chat_template_kwargs={"messages": []})


def test_reasoning_effort_is_the_templates_variable(llm):
    """OpenAI's reasoning_effort reaches the template as the variable gpt-oss's reads, as
    vLLM passes it; chat_template_kwargs' own value wins; a value outside low / medium /
    high, or one for a plain prompt, is the request's error."""
    template = ChatTemplate("{{ reasoning_effort | default('medium') }}:{{ messages[0].content }}")
    talk = [{"role": "user", "content": "fib"}]
    with TestClient(build_app(llm, "t", template)) as c:
        for extra, text in (({}, "medium:fib"), ({"reasoning_effort": "low"}, "low:fib"),
                            ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                             "high:fib")):
            want = llm.encode(text, special=False)
            assert c.post("/tokenize", json={"messages": talk, **extra}).json()["tokens"] == want
            r = c.post("/v1/chat/completions", json={"messages": talk, "max_tokens": 2, **extra})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want)
        for bad in ("max", 1, ["low"]):
            r = c.post("/v1/chat/completions", json={"messages": talk, "reasoning_effort": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"
        r = c.post("/tokenize", json={"prompt": "x", "reasoning_effort": "low"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def test_a_final_message_can_be_continued(llm, monkeypatch):
    """add_generation_prompt: false ends the prompt after the last message's turn;
    continue_final_message: true ends it inside the final message (an answer's given
    beginning, which the model continues), as transformers renders it; both at once, or
    a template that does not write the final message as given, are refused."""
    from treeflash.errors import UsageError
    template = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    talk = [{"role": "user", "content": "fib"}, {"role": "assistant", "content": "def fib(n):"}]
    cases = [({}, "<user>fib</user><assistant>def fib(n):</assistant><assistant>"),
             ({"add_generation_prompt": False}, "<user>fib</user><assistant>def fib(n):</assistant>"),
             ({"add_generation_prompt": False, "continue_final_message": True}, "<user>fib</user><assistant>def fib(n):")]
    with TestClient(build_app(llm, "t", template)) as c:
        for options, text in cases:
            ids = llm.encode(text, special=False)
            assert c.post("/tokenize", json={"messages": talk, **options}).json()["tokens"] == ids
            r = c.post("/v1/chat/completions", json={"messages": talk, "max_tokens": 2, **options})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids)
        for options, param in (({"continue_final_message": True}, "continue_final_message"),
                               ({"add_generation_prompt": "no"}, "add_generation_prompt")):
            r = c.post("/v1/chat/completions", json={"messages": talk, **options})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, options
    monkeypatch.setitem(llm.__dict__, "chat_template", template)
    params = SamplingParams(max_new_tokens=4)
    assert llm.chat(talk, params, add_generation_prompt=False, continue_final_message=True)[0].token_ids == \
        llm.generate([llm.encode(cases[2][1], special=False)], params)[0].token_ids
    monkeypatch.setitem(llm.__dict__, "chat_template", ChatTemplate("{{ messages[-1].content | upper }}"))
    with pytest.raises(UsageError, match="cannot be continued"):
        llm.chat(talk, params, add_generation_prompt=False, continue_final_message=True)


@pytest.mark.parametrize("source,messages,continued,want", [
    # a template that trims the final message: cut after its last text, not at an earlier
    # message that begins alike ("Hi " is in "Hi there")
    ("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}",
     [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hi "}], True,
     "<user>Hi there</user><assistant>Hi"),
    ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}",
     [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hi "}], True,
     "<user>Hi there</user><assistant>Hi "),
    # keys set to null are not defined for the template (OpenAI's SDK writes "tool_calls": null)
    ("{% for m in messages %}{% if 'tool_calls' in m %}{{ m.tool_calls | length }}{% endif %}"
     "{% if m.name is defined %}{{ m.name }}:{% endif %}{{ m.content }}|{% endfor %}",
     [{"role": "user", "content": "a", "name": None}, {"role": "assistant", "content": "b", "tool_calls": None}],
     False, "a|b|"),
    # a turn's reasoning under any of its names reaches templates under each of them
    ("{% for m in messages %}[{{ m.thinking }}|{{ m.reasoning_content }}]{{ m.content }}{% endfor %}",
     [{"role": "assistant", "content": "b", "reasoning": "r"}, {"role": "assistant", "content": "c", "thinking": "t"},
      {"role": "assistant", "content": "d", "reasoning_content": "rc", "thinking": "t2"}], False,
     "[r|r]b[t|t]c[t2|rc]d"),
    # a template that loops over a message's parts (Gemma 3's) gets them; others the text (vLLM's formats)
    ("{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}|{% endfor %}",
     [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]},
      {"role": "user", "content": "plain"}], False, "Helloworld|plain|"),
    ("{% for m in messages %}{% set c = m.content %}{% for p in c | selectattr('type', 'eq', 'text') %}"
     "{{ p.text }}{% endfor %}|{% endfor %}",
     [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b "}]}], True, "ab "),
    ("{% for m in messages %}{{ m.content }}|{% endfor %}",
     [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}], False,
     "Hello\nworld|"),
    # a special token the tokenizer does not set is not defined (ChatTemplate(source) sets none)
    ("{% if bos_token is defined %}D{% else %}U{% endif %}{{ messages[0].content }}",
     [{"role": "user", "content": "q"}], False, "Uq"),
    # a loop over a name set from content that reads its items as tool calls (Mistral's
    # parallel-tool template, for a role of its own) leaves the template the text ...
    ("{% for m in messages %}{% if m.role == 'tool_calls' %}{% set calls = m.content %}{% for c in calls %}"
     "{% if c.type == 'function' %}{{ c.name }}{% endif %}{% endfor %}{% else %}{{ '[INST] ' + m.content }}"
     "{% endif %}{% endfor %}", [{"role": "user", "content": "Hello"}], False, "[INST] Hello"),
    # ... any other loop over it gets parts, however it reads them (a macro, a map)
    ("{% macro part(p) %}{% if p.type == 'text' %}{{ p.text }}{% endif %}{% endmacro %}{% for m in messages %}"
     "{% set c = m.content %}{% for item in c %}{{ part(item) }}{% endfor %}|{% endfor %}",
     [{"role": "user", "content": "Hello"}], False, "Hello|"),
    ("{% for m in messages %}{% set c = m.content %}{% for t in c | selectattr('type', 'equalto', 'text') | "
     "map(attribute='text') %}{{ t }}{% endfor %}|{% endfor %}", [{"role": "user", "content": "Hi"}], False, "Hi|"),
    # an answer cut short in its reasoning comes back with content null
    ("{% for m in messages %}[{{ m.reasoning_content }}]{{ m.content }}{% endfor %}",
     [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "reasoning_content": "hmm"},
      {"role": "user", "content": "go on"}], False, "[]q[hmm][]go on"),
    # documents are None unless given (RAG templates test them); what {% generation %} sets stays inside
    ("{% if documents is not none %}D{% endif %}{% set x = 'out' %}{% generation %}{% set x = 'in' %}"
     "{{ messages[0].content }}{% endgeneration %}{{ x }}", [{"role": "user", "content": "q"}], False, "qout"),
])
def test_messages_reach_the_template_as_transformers_gives_them(source, messages, continued, want):
    """As transformers' apply_chat_template (and so vLLM) renders them, checked against it
    where these cases were written."""
    fmt = ChatFormat(add_generation_prompt=False, continue_final_message=continued)
    assert ChatTemplate(source).prompt(messages, fmt) == want


def test_documents_reach_the_template_and_an_empty_final_message_is_not_continued(llm, monkeypatch):
    """vLLM's `documents` (a retrieval-augmented prompt's) reach the template; a final
    message with no content (a turn that only called tools) has nothing to continue."""
    template = ChatTemplate("{% for d in documents or [] %}[{{ d.title }}]{% endfor %}"
                            "{% for m in messages %}{{ m.content }}{% endfor %}")
    with TestClient(build_app(llm, "tiny", template)) as c:
        talk = {"messages": [{"role": "user", "content": "q"}]}
        got = c.post("/tokenize", json={**talk, "documents": [{"title": "a"}, {"title": "b"}]}).json()
        assert llm.tokenizer.decode(got["tokens"]) == "[a][b]q"
        r = c.post("/v1/chat/completions", json={**talk, "max_tokens": 1, "documents": "a"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
    calls = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]
    with pytest.raises(UsageError, match="the final message has no content to continue"):
        template.prompt([{"role": "user", "content": "q"}, *calls],
                        ChatFormat(add_generation_prompt=False, continue_final_message=True))


def test_a_model_without_chat_template_refuses_chat(llm):
    with TestClient(build_app(llm, "tiny", None)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_an_engine_failure_fails_that_request_only(client, llm, monkeypatch):
    real = llm.generate
    calls = []

    def fail_once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return real(*args, **kw)

    monkeypatch.setattr(llm, "generate", fail_once)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
    assert r.status_code == 500 and "device lost" in r.json()["error"]["message"]
    calls.clear()
    got = events(client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "stream": True}))
    assert "device lost" in got[0]["error"]["message"] and got[-1] == "[DONE]"
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4}).status_code == 200


class FakeLLM:
    """LLM.generate's protocol without a model: each prompt's text is its first id, one
    token per step until max_new_tokens (or until on_tokens says stop: "abort"), on_done
    as each finishes; prompt [666] makes the call fail. Calls are recorded, and the
    first waits for `gate`."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls, self.gate = tokenizer, [], threading.Event()

    def generate(self, prompts, params, on_tokens=None, on_done=None):
        from treeflash import GenerationOutput
        self.calls.append([p[0] for p in prompts])
        self.gate.wait(30)
        if [666] in prompts:
            raise RuntimeError("poisoned")
        outs, n = [None] * len(prompts), [0] * len(prompts)
        while None in outs:
            for k, p in enumerate(prompts):
                if outs[k] is None:
                    n[k] += 1
                    abort = on_tokens(k, [7], None) is True
                    if abort or n[k] == params[k].max_new_tokens:
                        outs[k] = GenerationOutput(str(p[0]), [7] * n[k], "abort" if abort else "length")
                        on_done(k, outs[k])
            time.sleep(0.002)
        return outs


def _job(tokenizer, *prompts, tokens=2, metrics=None):
    from treeflash.server.app import Job
    from treeflash.server.protocol import Request
    return Job(Request("completion", [list(p) for p in prompts], SamplingParams(max_new_tokens=tokens)), None,
               tokenizer, metrics)


def _wait(condition, timeout=30.0):
    end = time.time() + timeout
    while not condition():
        assert time.time() < end, "timed out"
        time.sleep(0.005)


@pytest.fixture
def fake_worker(llm):
    from treeflash.server.app import EngineWorker
    fake = FakeLLM(llm.tokenizer)
    worker = EngineWorker(fake, max_batch=4)
    yield fake, worker, lambda *prompts, tokens=2: _job(llm.tokenizer, *prompts, tokens=tokens,
                                                        metrics=worker.metrics)
    worker.stop()


def test_worker_batches_isolates_failures_and_drops_gone_clients(fake_worker):
    from treeflash.server.app import Cancelled
    fake, worker, job = fake_worker
    plug = job([1])
    worker.jobs.put(plug)
    _wait(lambda: fake.calls)  # the worker is inside generate, held by the gate
    ok, poison, gone, pair = job([2]), job([666]), job([3]), job([4], [5])
    gone.cancel()  # its client left while it was queued
    for j in (ok, poison, gone, pair):
        worker.jobs.put(j)
    fake.gate.set()
    assert [o.text for o in plug.future.result(30)] == ["1"]
    assert [o.text for o in ok.future.result(30)] == ["2"]
    assert [o.text for o in pair.future.result(30)] == ["4", "5"]
    with pytest.raises(RuntimeError, match="poisoned"):
        poison.future.result(30)
    with pytest.raises(Cancelled):
        gone.future.result(30)
    # one batch of 4 prompts failed; each job then ran alone (the cancelled one never)
    assert fake.calls == [[1], [2, 666, 4, 5], [2], [666], [4, 5]]


def test_a_gone_client_ends_only_its_request(fake_worker):
    """In a batch, a short request is answered when its own tokens are done, and a long
    one whose client left stops at its next step; a failing part of a batch fails only
    its own request."""
    from treeflash.server.app import Cancelled
    fake, worker, job = fake_worker
    fake.gate.set()
    short, long = job([1], tokens=3), job([2], tokens=100000)
    worker.jobs.put(short)
    worker.jobs.put(long)  # may or may not join short's batch: both ways must work
    assert short.future.result(30)[0].token_ids == [7] * 3
    _wait(lambda: long.started)
    assert not long.future.done()
    long.cancel()
    with pytest.raises(Cancelled):
        long.future.result(30)
    # max_batch 4 prompts a call: [a, b0, b1, b2] then [b3 (poison)]
    a, b = job([3]), job([4], [5], [6], [666])
    fake.gate.clear()
    worker.jobs.put(a)
    worker.jobs.put(b)
    fake.gate.set()
    assert [o.text for o in a.future.result(30)] == ["3"]
    with pytest.raises(RuntimeError, match="poisoned"):
        b.future.result(30)
    assert worker.metrics.requests == {"ok": 2, "error": 1, "cancelled": 1}  # as /metrics counts them

def test_stopping_the_worker_ends_running_and_queued_requests(fake_worker):
    """Shutting down: the running request ends at its next step and the queued ones never
    start, all answered "shutting down" (503); the thread is gone when stop returns."""
    fake, worker, job = fake_worker
    fake.gate.set()
    running = job([1], tokens=100000)
    worker.jobs.put(running)
    _wait(lambda: running.started)
    queued = [job([2]) for _ in range(3)]
    for j in queued:
        worker.jobs.put(j)
    worker.stop(timeout=10)
    assert not worker.thread.is_alive()
    for j in [running, *queued]:
        with pytest.raises(Exception, match="shutting down") as e:
            j.future.result(0)
        assert e.value.status == 503
    assert fake.calls == [[1]]


def test_the_engine_goes_on_after_a_cancelled_generation(llm):
    """Cancelling raises out of LLM.generate mid-round; the next request is exact."""
    from treeflash.server.app import Cancelled, EngineWorker
    worker = EngineWorker(llm)
    try:
        ids = llm.encode(PROMPT)
        gone = _job(llm.tokenizer, ids, tokens=400)
        gone.req.params.ignore_eos = True
        worker.jobs.put(gone)
        while not gone.started:
            time.sleep(0.005)
        gone.cancel()
        with pytest.raises(Cancelled):
            gone.future.result(60)
        after = _job(llm.tokenizer, ids, tokens=30)
        worker.jobs.put(after)
        assert after.future.result(60)[0].token_ids == llm.generate(ids, SamplingParams(max_new_tokens=30))[0].token_ids
    finally:
        worker.stop()


def test_text_stream_never_splits_a_character(llm):
    text = "naïve café ✓ 漢字 done"
    ids = llm.tokenizer.encode(text, special=False)
    stream = TextStream(llm.tokenizer, [])
    deltas = [stream.push([t]) for t in ids]
    assert "".join(deltas) + stream.finish(llm.tokenizer.decode(ids)) == llm.tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


def _status(url: str, body: dict) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, json.dumps(body).encode()), timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def _serve(*args, interactive: bool = False):
    """`treeflash serve` on a free port of this machine (CPU, float32), once it answers;
    `interactive`: Ctrl-C (SIGINT) works as in a terminal (a background job, as a test
    runner's worker may be, starts with it ignored)."""
    import signal
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "treeflash", "serve", "--port", str(port), "--device", "cpu",
                             "--dtype", "float32", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if interactive else None)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            urllib.request.urlopen(base + "/health", timeout=1)
            return proc, port, base, env
        except (urllib.error.URLError, OSError):  # refused, or (the port held while it loads) no answer yet
            if proc.poll() is not None:
                pytest.fail(proc.stderr.read())
            time.sleep(0.1)
    proc.kill()
    pytest.fail("treeflash serve did not start")


def test_treeflash_serve_with_tensor_parallelism(llm):
    """--tp 2 (gloo on CPU): the worker thread drives the tensor-parallel processes."""
    proc, _, base, _ = _serve("--tp", "2")
    try:
        got = _post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0})
        assert got["choices"][0]["text"] == llm.generate(PROMPT, SamplingParams(max_new_tokens=16))[0].text
    finally:
        proc.terminate()
        proc.wait(30)


def test_treeflash_serve_answers_concurrent_clients(llm):
    """The real command: uvicorn on a port, requests from several threads at once
    (batched by --max-batch), each answered as generate answers it alone."""
    proc, port, base, env = _serve("--max-batch", "2")
    try:
        prompts = [PROMPT, "import os\n", "class Point:"]
        want = [o.text for o in llm.generate(prompts, SamplingParams(max_new_tokens=16))]
        got = [None] * len(prompts)

        def ask(i):
            got[i] = _post(base + "/v1/completions", {"prompt": prompts[i], "max_tokens": 16,
                                                      "temperature": 0})["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == want
        with pytest.raises(urllib.error.HTTPError) as e:
            _post(base + "/v1/completions", {"prompt": "x", "temperature": -1})
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "temperature"
        # clients that give up on long requests: theirs end, and the next client is not kept waiting
        for _ in range(2):
            req = urllib.request.Request(base + "/v1/completions", json.dumps(
                {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True}).encode())
            with pytest.raises(OSError):  # a timeout
                urllib.request.urlopen(req, timeout=0.3)
        start = time.time()
        assert _post(base + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})["usage"]["completion_tokens"] == 4
        assert time.time() - start < 5  # two 1000-token requests would take far longer on this CPU
        # megabytes of prompt tokenize for seconds on a worker thread: the server answers meanwhile
        # (the tokenizer's plain encode stalled /health for the whole 8 s of a 9 MiB prompt)
        huge = {}
        big = threading.Thread(target=lambda: huge.update(r=_status(base + "/v1/completions",
                                                                    {"prompt": "é " * 1_500_000})))
        big.start()
        time.sleep(0.5)
        start = time.time()
        with urllib.request.urlopen(base + "/health", timeout=60) as r:
            assert r.status == 200
        health = time.time() - start
        with urllib.request.urlopen(base + "/metrics", timeout=60) as r:  # what a scraper asks every few seconds
            assert r.status == 200
        big.join(120)
        assert huge["r"][0] == 400 and "maximum context length is" in huge["r"][1], huge
        assert health < 1.0, health
        # a second server on the same port: one line before loading anything, exit 2
        second = subprocess.run([sys.executable, "-m", "treeflash", "serve", "--port", str(port)],
                                capture_output=True, text=True, timeout=60, env=env)
        assert second.returncode == 2 and second.stderr.count("\n") == 1
        assert second.stderr.startswith("treeflash: error: cannot listen on 127.0.0.1:")
    finally:
        proc.terminate()
        proc.wait(30)
    log = proc.stdout.read()  # a line per API request, as vLLM's (not the /health probes nor the scrapes)
    assert log.count('"POST /v1/completions HTTP/1.1" 200') >= 4 and '"POST /v1/completions HTTP/1.1" 400' in log
    assert "/health" not in log and "/metrics" not in log


def test_chat_template_sources_and_failures(tmp_path, llm):
    from treeflash.errors import TreeflashError
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<E>"}, "chat_template": [{"name": "tool_use", "template": "T"},
                                                           {"name": "default", "template": "{{ eos_token }}D"}]}))
    assert ChatTemplate.from_folder(tmp_path).render([]) == "<E>D"  # the named default, with its tokens
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert ChatTemplate.from_folder(tmp_path).render([{"role": "user", "content": "x"}]) == "Jx"  # the file wins
    (tmp_path / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(TreeflashError, match="malformed chat template"):
        ChatTemplate.from_folder(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None}))
    assert ChatTemplate.from_folder(tmp_path) is None
    # a template that refuses the conversation (raise_exception) is the client's error
    refusing = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}x")
    with TestClient(build_app(llm, "t", refusing)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "s"}]})
        assert r.status_code == 400 and r.json()["error"]["message"].endswith("user first")
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "s"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(llm.encode("x", special=False))


def test_chat_templates_get_what_transformers_gives_them(tmp_path):
    """Templates as fine-tuned checkpoints ship them render as with transformers: the
    `{% generation %}` tag (TRL's assistant-only loss) as its body, every special token
    of tokenizer_config.json (a null one left undefined), and tojson's separators / sort_keys."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "pad_token": "<P>", "unk_token": {"content": "<U>"}, "additional_special_tokens": ["<A>"], "mask_token": None,
        "chat_template": "{{ bos_token }}{{ pad_token }}|{{ unk_token }}|{{ additional_special_tokens[0] }}|"
                         "{{ mask_token if mask_token is defined else 'no mask' }}|"
                         "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}|"
                         "{{ messages | tojson(separators=(',', ':'), sort_keys=True) }}"}))
    got = ChatTemplate.from_folder(tmp_path).render([{"role": "user", "content": "hi"}])
    assert got == '<P>|<U>|<A>|no mask|hi|[{"content":"hi","role":"user"}]'


def test_logit_bias_allowed_token_ids_min_tokens_and_penalties(client, llm):
    """The server's logit_bias (token ids as strings, as OpenAI sends them), allowed_token_ids,
    min_tokens and penalties give the engine's tokens for the same parameters, streamed or
    not, and those differ from the tokens without them."""
    free = llm.generate(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True))[0].token_ids
    repetitive = "x = x + x + x + x"  # greedy goes on with " + x": the penalties bite
    cases = [({"logit_bias": {str(free[1]): -100, "7": 5.5}}, dict(logit_bias={free[1]: -100.0, 7: 5.5}), PROMPT),
             ({"allowed_token_ids": sorted(set(free[::2]))}, dict(allowed_token_ids=sorted(set(free[::2]))), PROMPT),
             ({"presence_penalty": 2, "frequency_penalty": 2}, dict(presence_penalty=2.0, frequency_penalty=2.0),
              repetitive),
             ({"repetition_penalty": 2}, dict(repetition_penalty=2.0), repetitive),
             ({"min_tokens": 12, "stop_token_ids": [free[2]]}, dict(min_tokens=12), PROMPT)]
    for sent, kw, prompt in cases:
        plain = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=sent.get("stop_token_ids", []))
        want = llm.generate(prompt, replace(plain, **kw))[0]
        assert want.token_ids != llm.generate(prompt, plain)[0].token_ids, sent  # it changed the output
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **sent}
        got = client.post("/v1/completions", json=body).json()["choices"][0]
        assert got["text"] == want.text
        streamed = events(client.post("/v1/completions", json={**body, "stream": True}))
        assert "".join(e["choices"][0]["text"] for e in streamed[:-1] if e["choices"]) == want.text
    assert len(want.token_ids) == 12 and free[2] not in want.token_ids  # without min_tokens: 3 tokens


def test_sampling_defaults_come_from_generation_config(tmp_path, llm):
    """A request that leaves temperature / top_p / top_k / min_p out gets the model's
    generation_config.json values (as with vLLM), or OpenAI's without the file; values
    it sends win. A broken file is refused in one line naming it."""
    from treeflash.errors import UsageError
    from treeflash.server.protocol import SamplingDefaults
    assert SamplingDefaults.from_folder(tmp_path) == SamplingDefaults(1.0, 1.0, 0)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "min_p": 0.05,
         "repetition_penalty": 1.05}))
    qwen = SamplingDefaults.from_folder(tmp_path)
    assert (qwen.temperature, qwen.top_p, qwen.top_k, qwen.min_p, qwen.max_tokens, qwen.repetition_penalty) == \
        (0.6, 0.95, 20, 0.05, None, 1.05)
    assert "repetition_penalty 1.05" in qwen.describe()
    assert "min_p 0.05" in qwen.describe()
    for bad in ('{"temperature": -1}', '{"top_p": 0}', '{"top_k": 2.5}', '{"min_p": 2}', '{"max_new_tokens": 0}',
                '{"repetition_penalty": 0}',
                '{"top_k": "20"}',  # a string: a UsageError naming the file, not a TypeError from comparing it
                '[1]', '{'):
        (tmp_path / "generation_config.json").write_text(bad)
        with pytest.raises(UsageError, match="generation_config.json") as e:
            SamplingDefaults.from_folder(tmp_path)
        assert "\n" not in str(e.value)
    greedy = SamplingDefaults(temperature=0.0, max_tokens=5)
    want = llm.generate(PROMPT, SamplingParams(max_new_tokens=12))[0].text
    template = ChatTemplate("{{ messages[0].content }}")
    with TestClient(build_app(llm, "t", template, defaults=greedy)) as c:
        body = {"prompt": PROMPT, "max_tokens": 12}
        assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
        chat = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT},
                                                                 ], "ignore_eos": True}).json()
        assert chat["usage"]["completion_tokens"] == 5  # the file's max_new_tokens
        sampled = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5)
        got = c.post("/v1/completions", json={**body, "temperature": 1.0, "top_p": 0.9, "seed": 5}).json()
        assert got["choices"][0]["text"] == llm.generate(PROMPT, sampled)[0].text
    # a file's min_p and repetition_penalty apply to requests that leave them out; a request's own win
    min_p = SamplingDefaults(temperature=1.5, min_p=0.2, repetition_penalty=1.4)
    with TestClient(build_app(llm, "t", template, defaults=min_p)) as c:
        body = {"prompt": PROMPT, "max_tokens": 12, "seed": 5, "ignore_eos": True}
        for sent, want_p, rep in (({}, 0.2, 1.4), ({"min_p": 0}, 0.0, 1.4), ({"repetition_penalty": 1}, 0.2, 1.0)):
            got = c.post("/v1/completions", json={**body, **sent}).json()["choices"][0]["text"]
            want = SamplingParams(max_new_tokens=12, temperature=1.5, min_p=want_p, seed=5, ignore_eos=True,
                                  repetition_penalty=rep)
            assert got == llm.generate(PROMPT, want)[0].text


def test_generation_configs_max_new_tokens_is_the_chat_default(tmp_path):
    """generation_config.json's max_new_tokens becomes the max_tokens of a chat request
    that leaves it out (as in vLLM), and the startup line says so."""
    from treeflash.server.protocol import SamplingDefaults
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "max_new_tokens": 7}))
    defaults = SamplingDefaults.from_folder(tmp_path)
    assert (defaults.temperature, defaults.max_tokens) == (0.7, 7) and "chat max_tokens 7" in defaults.describe()


@pytest.mark.parametrize("args,words", [(["--max-batch", "0"], "--max-batch"), (["--port", "0"], "--port"),
                                       (["--port", "65536"], "--port must be in 1..65535"),
                                       (["--generation-config", "x"], "--generation-config"),
                                       (["--tool-call-parser", "x"], "--tool-call-parser"),
                                       (["--tool-call-parser", "hermes"], "chat template"),  # the built-in has none
                                       (["--reasoning-parser", "qwen3"], "chat template"),
                                       (["--served-model-name", "tiny", " "], "a model name cannot be empty")])
def test_serve_refuses_bad_options_in_one_line(capsys, args, words):
    from treeflash.cli import main
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("treeflash: error:") and words in err


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_serving_on_the_gpu_with_cuda_graphs():
    """The worker thread captures and replays the rounds' CUDA graphs: answers, whole and
    streamed, hold generate's tokens (the same engine called from the test's thread)."""
    gpu = LLM(device="cuda", dtype="bfloat16")
    assert gpu.cuda_graphs
    with TestClient(build_app(gpu, "tiny")) as c:
        for body, params in [({"temperature": 0}, SamplingParams(max_new_tokens=64)),
                             ({"temperature": 0.7, "seed": 5}, SamplingParams(max_new_tokens=64, temperature=0.7, seed=5))]:
            got = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 64, **body}).json()
            streamed = events(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 64, "stream": True,
                                                              **body}))
            want = gpu.generate(PROMPT, params)[0].text
            assert got["choices"][0]["text"] == want
            assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == want
    assert gpu.graph_captures > 0
    test_the_engine_goes_on_after_a_cancelled_generation(gpu)  # a graph round left in flight, then exact


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_warm_up_captures_what_requests_need():
    """After `treeflash serve`'s warm-up, short requests and chat requests without
    max_tokens (whose cache may fill the context) capture nothing, in any sampling mode,
    the model's defaults (Qwen3's filters here) included."""
    from treeflash.server.cli import warm_up
    from treeflash.server.protocol import SamplingDefaults
    gpu = LLM(device="cuda", dtype="bfloat16")
    defaults = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    warm_up(gpu, defaults)
    captured = gpu.graph_captures
    with TestClient(build_app(gpu, "tiny", ChatTemplate("{{ messages[0].content }}"), defaults=defaults)) as c:
        for extra in ({"temperature": 0}, {"temperature": 0.7, "top_k": 0, "top_p": 1},
                      {"temperature": 0.7, "top_k": 0, "top_p": 0.9}, {}):
            assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, **extra}).status_code == 200
            chat = {"messages": [{"role": "user", "content": PROMPT}], **extra}
            assert c.post("/v1/chat/completions", json=chat).status_code == 200
    assert gpu.graph_captures == captured


def test_treeflash_serve_shuts_down_promptly():
    """SIGTERM with requests running and queued: they are answered "shutting down" (a
    streamed one gets it as its last event) within a round, and the server exits without a
    traceback, long before the requests' max_tokens."""
    import signal
    proc, _, base, _ = _serve()
    got = {}

    def ask(name, stream):
        body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "temperature": 0, "stream": stream}
        req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode())
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                got[name] = r.read().decode()
        except urllib.error.HTTPError as e:
            got[name] = (e.code, json.loads(e.read())["error"]["message"])

    threads = [threading.Thread(target=ask, args=(name, name == "streamed")) for name in ("streamed", "queued")]
    try:
        threads[0].start()
        time.sleep(1.0)
        threads[1].start()
        time.sleep(0.5)
        start = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
        assert time.time() - start < 10
        for t in threads:
            t.join(20)
    finally:
        proc.kill()
        proc.wait(30)
    assert got["queued"] == (503, "the server is shutting down")
    last = [line for line in got["streamed"].splitlines() if line.startswith("data: ")][-2:]
    assert json.loads(last[0][6:])["error"]["message"] == "the server is shutting down" and last[1] == "data: [DONE]"
    assert "Traceback" not in proc.stderr.read()


def test_a_second_ctrl_c_exits_at_once_without_a_traceback():
    """Ctrl-C twice (an impatient user) with a request running: the server exits at
    once, as "interrupted" (130), with no traceback from asyncio's own handler."""
    import signal
    proc, _, base, _ = _serve(interactive=True)
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}
    def ask():
        try:
            _status(base + "/v1/completions", body)
        except OSError:  # the server went away mid-answer
            pass
    asker = threading.Thread(target=ask, daemon=True)
    try:
        asker.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 130
    finally:
        proc.kill()
        proc.wait(30)
    err = proc.stderr.read()
    assert "Traceback" not in err and err.strip().endswith("treeflash: interrupted"), err


def test_truncate_prompt_tokens(client, llm):
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens (usage counts those; echo
    shows them), also for chat and for a prompt longer than the context."""
    ids = llm.encode(PROMPT * 40)
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "truncate_prompt_tokens": 9}
    got = client.post("/v1/completions", json=body).json()
    want = llm.generate(ids[-9:], SamplingParams(max_new_tokens=6))[0]
    assert got["choices"][0]["text"] == want.text and got["usage"]["prompt_tokens"] == 9
    echo = client.post("/v1/completions", json={**body, "prompt": PROMPT * 40, "echo": True}).json()
    assert echo["choices"][0]["text"] == llm.tokenizer.decode(ids[-9:]) + want.text
    huge = [5] * (llm.max_model_len + 10)
    r = client.post("/v1/completions", json={**body, "prompt": huge, "truncate_prompt_tokens": -1, "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == llm.max_model_len - 1, r.text
    chat = {"messages": [{"role": "user", "content": PROMPT * 40}], "max_tokens": 3, "temperature": 0}
    r = client.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 7})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 7
    # LLM.chat too, for a conversation longer than the context
    long_chat = [{"role": "user", "content": PROMPT * 400}]
    params = SamplingParams(max_new_tokens=3, truncate_prompt_tokens=7)
    want = llm.generate(llm.chat_prompt(long_chat)[-7:], params)[0]
    assert llm.chat(long_chat, params)[0].token_ids == want.token_ids
    with pytest.raises(UsageError, match="This model's maximum context length is"):
        llm.chat(long_chat, SamplingParams(max_new_tokens=3))
    for k in (0, -2, "9"):
        r = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": k})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    r = client.post("/v1/completions", json={**body, "prompt": ids[:5], "truncate_prompt_tokens": llm.max_model_len})
    err = r.json()["error"]  # named as the other bad values are, with its bound
    assert r.status_code == 400 and err["param"] == "truncate_prompt_tokens", r.text
    assert f"{llm.max_model_len - 1}]" in err["message"], r.text


def test_treeflash_serve_with_chat_parsers(chat_model):
    """--tool-call-parser and --reasoning-parser reach the real server: tools are taken
    and the message has its reasoning field."""
    proc, _, base, _ = _serve("--model", str(chat_model), "--draft-model", str(builtin_paths()[1]),
                              "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    try:
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        got = _post(base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "tools": tools, "max_tokens": 4})
        message = got["choices"][0]["message"]
        assert "reasoning_content" in message and isinstance(message["content"], (str, type(None)))
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def slow_compiles(monkeypatch):
    """Every structured output takes `seconds` to compile (a large vocabulary's table
    does); `compiling` counts those started."""
    import treeflash.structured.cache as cache_module
    plain, compiling, seconds = cache_module.token_automaton, [], 1.0

    def slow(*args):
        compiling.append(1)
        time.sleep(seconds)
        return plain(*args)
    monkeypatch.setattr(cache_module, "token_automaton", slow)
    return compiling


def test_slow_compiles_do_not_hold_up_other_requests(llm, chat_model, slow_compiles):
    """More requests whose constraints compile for a second each than the threads that
    read requests: a plain request sent behind them is answered at once (the compiles have
    a thread of their own), and each constrained one is answered in turn."""
    readers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor
    with TestClient(build_app(llm, "tiny", ChatTemplate.from_folder(chat_model))) as c:
        got = {}

        def ask(k):
            body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "structured_outputs": {"regex": f"{k}[0-9]*"}}
            got[k] = c.post("/v1/completions", json=body)
        threads = [threading.Thread(target=ask, args=(k,)) for k in range(readers + 1)]
        for t in threads:
            t.start()
        _wait(lambda: len(slow_compiles) >= 1)
        start = time.time()
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and time.time() - start < 0.8
        for t in threads:
            t.join(60)
    assert all(r.status_code == 200 and r.json()["choices"][0]["text"].startswith(str(k)) for k, r in got.items())
    assert len(got) == readers + 1


def _held_until(gate: threading.Event, real):
    """`real`, made to wait for `gate` first (at most 30 s)."""
    def held(*args, **kw):
        gate.wait(30)
        return real(*args, **kw)
    return held


def _run_scenario(app, gate: threading.Event, scenario) -> None:
    """asyncio.run(scenario()), then `gate` opened and `app` shut down, whatever happened."""
    try:
        asyncio.run(scenario())
    finally:
        gate.set()
        app.state.shutdown()


def test_a_compile_waits_only_for_clients_still_there(llm, monkeypatch):
    """Structured outputs compile one at a time: a compile whose client left while it waited
    its turn is dropped (never run), and a constraint compiled already is checked at once,
    not behind the compile under way."""
    import treeflash.structured.cache as cache_module
    gate, compiled = threading.Event(), []
    held = _held_until(gate, cache_module.token_automaton)
    monkeypatch.setattr(cache_module, "token_automaton", lambda *args: compiled.append(1) or held(*args))
    app = build_app(llm, "tiny", None)
    body = {"prompt": PROMPT, "max_tokens": 2}
    stay = dict(leave=lambda sent: False)

    async def scenario():
        gate.set()
        known = {**body, "structured_outputs": {"regex": "[a-z]+"}}
        assert (await _asgi(app, "POST", "/v1/completions", known, **stay))[0] == 200
        gate.clear()
        slow = asyncio.ensure_future(_asgi(app, "POST", "/v1/completions",
                                           {**body, "structured_outputs": {"regex": "[0-9]+"}}, **stay))
        while len(compiled) < 2:  # its compile is under way
            await asyncio.sleep(0.01)
        status, text = await _asgi(app, "POST", "/v1/completions", {**body, "structured_outputs": {"regex": "x+"}})
        assert status == 499 and "disconnected" in json.loads(text)["error"]["message"]
        assert (await asyncio.wait_for(_asgi(app, "POST", "/v1/completions", known, **stay), 20))[0] == 200
        gate.set()
        assert (await slow)[0] == 200
    _run_scenario(app, gate, scenario)
    assert len(compiled) == 2  # not x+'s
    assert not llm.rules.automata.known(StructuredOutputs(regex="x+"))


def test_draining_answers_requests_being_checked_and_new_ones(llm, chat_model, slow_compiles):
    """A shutdown that begins while requests wait for their constraints' compile answers
    them "shutting down" (503, an OpenAI body) at once, not after the compile or the
    server's grace period with a bare 500; requests after it get the same."""
    app = build_app(llm, "tiny", ChatTemplate.from_folder(chat_model))
    with TestClient(app) as c:
        got = {}

        def ask(k):
            body = {"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {"regex": f"x{k}[0-9]*"}}
            got[k] = c.post("/v1/completions", json=body)
        threads = [threading.Thread(target=ask, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        _wait(lambda: len(slow_compiles) >= 1)
        start = time.time()
        threading.Thread(target=app.state.drain).start()  # as the signal handler starts it
        for t in threads:
            t.join(60)
        assert time.time() - start < 1.0 and sorted(got) == list(range(4))
        late = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
        for r in [*got.values(), late]:
            assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down"


def test_an_app_serves_again_after_a_shutdown(llm, chat_model):
    """An app embedded in a program (or a test) may be started again after its lifespan
    ended: it answers, constrained requests included, not "shutting down"."""
    app = build_app(llm, "tiny", ChatTemplate.from_folder(chat_model))
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "structured_outputs": {"regex": "[0-9]+"}}
    for _ in range(2):
        with TestClient(app) as c:
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body, slow", [
    ("/tokenize", {"prompt": PROMPT, "return_token_strs": True}, "vocab_spellings"),
    ("/detokenize", {"tokens": [5, 6, 7]}, "parse_detokenize"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "n": 3, "logprobs": 2}, "response"),
])
def test_building_an_answer_keeps_no_other_client_waiting(llm, chat_model, monkeypatch, path, body, slow):
    """The work of an answer that grows with the request (a long text's tokens and their
    spellings, a long id list's check and text, n choices' texts and logprobs) runs off
    the event loop: a client that asks meanwhile is answered at once."""
    import treeflash.server.app as app_module
    entered, other_answered = threading.Event(), threading.Event()
    owner = llm.tokenizer if slow == "vocab_spellings" else app_module
    build = getattr(owner, slow)

    def held(*args, **kwargs):  # until the other client has its answer (10 s at most)
        entered.set()
        other_answered.wait(10)
        return build(*args, **kwargs)
    monkeypatch.setattr(owner, slow, held)
    with TestClient(build_app(llm, "tiny", ChatTemplate.from_folder(chat_model))) as c:
        got = []
        heavy = threading.Thread(target=lambda: got.append(c.post(path, json=body)))
        heavy.start()
        assert entered.wait(30)
        start = time.time()
        other = c.get("/v1/models")
        waited = time.time() - start
        other_answered.set()
        heavy.join(60)
    assert other.status_code == 200 and waited < 5, waited
    assert got[0].status_code == 200, got[0].text


def test_echo_with_max_tokens_0_ends_by_length_whatever_the_token(client, llm):
    """echo with max_tokens 0 generates nothing: finish_reason is "length" and stop_reason
    null even where the one token the engine runs for it would have stopped it."""
    first = llm.generate(PROMPT, SamplingParams(max_new_tokens=1, ignore_eos=True))[0].token_ids[0]
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "stop_token_ids": [first]}
    for stream in (False, True):
        r = client.post("/v1/completions", json={**body, "stream": stream})
        choices = [e["choices"][0] for e in events(r)[:-1]] if stream else r.json()["choices"]
        assert "".join(c["text"] for c in choices) == PROMPT
        assert (choices[-1]["finish_reason"], choices[-1]["stop_reason"]) == ("length", None)


def test_metrics_count_every_prompt_of_a_request(client):
    """A request of several prompts and n choices counts each prompt's tokens once in
    treeflash_prompt_tokens_total: what its usage reports."""
    _wait(lambda: scrape(client)["treeflash_requests_running"] == 0)
    before = scrape(client)["treeflash_prompt_tokens_total"]
    got = client.post("/v1/completions", json={"prompt": [PROMPT, "import os"], "max_tokens": 2, "n": 2}).json()
    _wait(lambda: scrape(client)["treeflash_requests_running"] == 0)
    assert scrape(client)["treeflash_prompt_tokens_total"] - before == got["usage"]["prompt_tokens"]


def test_a_request_cancelled_between_its_parts_ends_there(fake_worker):
    """A request of more prompts than max_batch runs in parts: one whose client leaves in
    its first part is answered at once, and its later parts never run."""
    from treeflash.server.app import Cancelled
    fake, worker, job = fake_worker
    fake.gate.set()
    long = job([1], [2], [3], [4], [5], tokens=100000)  # max_batch 4: [1, 2, 3, 4], then [5]
    worker.jobs.put(long)
    _wait(lambda: long.started)
    long.cancel()
    with pytest.raises(Cancelled):
        long.future.result(10)
    assert fake.calls == [[1, 2, 3, 4]]


class _FailingLLM(FakeLLM):
    """FakeLLM whose prompt [667] gets a token and then fails its call (a device lost
    mid-generation), and whose prompt [668] kills the engine: that call and every later
    one raise EngineDeadError."""

    dead = False

    def generate(self, prompts, params, on_tokens=None, on_done=None):
        from treeflash.errors import EngineDeadError
        if not (self.dead or [667] in prompts or [668] in prompts):
            return super().generate(prompts, params, on_tokens, on_done)
        self.calls.append([p[0] for p in prompts])
        self.gate.wait(30)
        if self.dead or [668] in prompts:
            self.dead = True
            raise EngineDeadError("tensor-parallel worker rank 1 was killed")
        for k, p in enumerate(prompts):
            if p == [667]:
                on_tokens(k, [7], None)
        raise RuntimeError("lost midway")


@pytest.fixture
def failing_worker(llm):
    from treeflash.server.app import EngineWorker
    fake = _FailingLLM(llm.tokenizer)
    worker = EngineWorker(fake, max_batch=4)
    yield fake, worker, lambda *prompts: _job(llm.tokenizer, *prompts, metrics=worker.metrics)
    worker.stop()


def test_a_request_that_got_tokens_is_not_run_again(failing_worker):
    """A batch that fails after one request received tokens: that request fails (run
    again, its streamed client would get its tokens twice); the one that received none
    runs again alone and is answered."""
    fake, worker, job = failing_worker
    plug = job([1])
    worker.jobs.put(plug)
    _wait(lambda: fake.calls)
    streamed, other = job([667]), job([2])
    worker.jobs.put(streamed)
    worker.jobs.put(other)
    fake.gate.set()
    assert [o.text for o in other.future.result(30)] == ["2"]
    with pytest.raises(RuntimeError, match="lost midway"):
        streamed.future.result(30)
    assert fake.calls == [[1], [667, 2], [2]]


def test_a_dead_engine_fails_the_batch_without_retries(failing_worker):
    """A batch that fails with EngineDeadError is not retried request by request: every
    request of it gets that error at once."""
    from treeflash.errors import EngineDeadError
    fake, worker, job = failing_worker
    plug = job([1])
    worker.jobs.put(plug)
    _wait(lambda: fake.calls)
    jobs = [job([668]), job([2])]
    for j in jobs:
        worker.jobs.put(j)
    fake.gate.set()
    for j in jobs:
        with pytest.raises(EngineDeadError):
            j.future.result(30)
    assert fake.calls == [[1], [668, 2]]


def test_engine_errors_get_their_statuses(llm, monkeypatch):
    """A failure the engine knows (a TreeflashError: the request's) is a 400 with its
    message; running out of memory is a 503 (retry smaller), not a 500; the server goes
    on serving, whole or streamed."""
    import torch
    from treeflash.errors import UsageError as EngineUsageError
    real = llm.generate
    failures = []

    def failing(*args, **kw):
        if failures:
            raise failures.pop()
        return real(*args, **kw)
    monkeypatch.setattr(llm, "generate", failing)
    body = {"prompt": PROMPT, "max_tokens": 2}
    with TestClient(build_app(llm, "tiny", None)) as c:
        for error, status, words in ((EngineUsageError("this batch is too large"), 400, "this batch is too large"),
                                     (torch.OutOfMemoryError("CUDA out of memory"), 503, "out of memory"),
                                     (MemoryError(), 503, "out of memory")):
            failures.append(error)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == status and words in r.json()["error"]["message"], r.text
            assert r.json()["error"]["type"] == ("invalid_request_error" if status == 400 else "server_error")
            failures.append(error)
            got = events(c.post("/v1/completions", json={**body, "stream": True}))
            assert words in got[0]["error"]["message"] and got[-1] == "[DONE]"
            assert c.post("/v1/completions", json=body).status_code == 200


def _http_scope(method: str, path: str, headers: tuple = ()) -> dict:
    """The ASGI scope of a JSON request from a client at 127.0.0.1 (extra `headers` as byte pairs)."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), *headers], "client": ("127.0.0.1", 1),
            "server": ("testserver", 80)}


async def _asgi(app, method: str, path: str, body: dict | None = None, leave=None, gone: asyncio.Event | None = None):
    """One request to `app` over raw ASGI: (status, body bytes). Its client goes away
    (http.disconnect) once `leave(messages sent so far)` is true, or when `gone` is set;
    at once after its body when neither is given and there is a body."""
    sent, asked = [], []
    if gone is None:
        gone = asyncio.Event()
        if body is not None and leave is None:
            gone.set()

    async def receive():
        if not asked:
            asked.append(1)
            return {"type": "http.request", "body": json.dumps(body or {}).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if leave is not None and leave(sent):
            gone.set()
    await app(_http_scope(method, path), receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_a_client_that_goes_away_ends_its_request(llm):
    """A client that disconnects, while its whole answer is generated or in the middle
    of its stream, ends its request at the next round (counted "cancelled", 499, not run
    to max_tokens): the engine is free for the others."""
    app = build_app(llm, "tiny", None)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def metrics():
        _, text = await _asgi(app, "GET", "/metrics")
        return metric_samples(text.decode())

    async def scenario():
        status, text = await _asgi(app, "POST", "/v1/completions", body)
        assert status == 499 and "client went away" in json.loads(text)["error"]["message"]
        status, _ = await _asgi(app, "POST", "/v1/completions", {**body, "stream": True},
                                leave=lambda sent: any(b"text" in m.get("body", b"") for m in sent))
        assert status == 200
        for _ in range(2000):  # until the worker has answered both (at most 20 s)
            got = await metrics()
            if got["treeflash_requests_running"] == got["treeflash_requests_waiting"] == 0 and \
                    sum(v for k, v in got.items() if k.startswith("treeflash_requests_total")) == 2:
                return got
            await asyncio.sleep(0.01)
        raise AssertionError("the requests never ended")
    try:
        got = asyncio.run(scenario())
    finally:
        app.state.shutdown()
    assert got['treeflash_requests_total{outcome="cancelled"}'] == 2
    assert got["treeflash_generation_tokens_total"] < 200


def test_metrics_gauge_running_and_waiting_requests(llm, monkeypatch):
    """/metrics' treeflash_requests_running and _waiting: the request in the engine and
    those queued behind it (max_batch 1), back to 0 once answered."""
    real, gate = llm.generate, threading.Event()

    def held(*args, **kw):
        gate.wait(30)
        return real(*args, **kw)
    monkeypatch.setattr(llm, "generate", held)
    with TestClient(build_app(llm, "tiny", None)) as c:
        body = {"prompt": PROMPT, "max_tokens": 2}
        threads = [threading.Thread(target=c.post, args=("/v1/completions",), kwargs={"json": body})
                   for _ in range(3)]
        for t in threads:
            t.start()
        try:
            _wait(lambda: (lambda m: (m["treeflash_requests_running"], m["treeflash_requests_waiting"]) == (1, 2))(
                scrape(c)), timeout=10)
        finally:
            gate.set()
            for t in threads:
                t.join(60)
        _wait(lambda: (lambda m: m["treeflash_requests_running"] == m["treeflash_requests_waiting"] == 0)(scrape(c)))


def test_requests_waiting_counts_only_clients_still_there(llm, monkeypatch):
    """/metrics' treeflash_requests_waiting drops as soon as a queued request's client
    leaves, not when the engine reaches it (vLLM's num_requests_waiting)."""
    gate = threading.Event()
    monkeypatch.setattr(llm, "generate", _held_until(gate, llm.generate))
    app = build_app(llm, "tiny", None)
    body = {"prompt": PROMPT, "max_tokens": 2}

    async def gauges():
        for _ in range(1000):
            got = metric_samples((await _asgi(app, "GET", "/metrics"))[1].decode())
            yield got["treeflash_requests_running"], got["treeflash_requests_waiting"]
            await asyncio.sleep(0.01)

    async def until(want):
        async for now in gauges():
            if now == want:
                return
        raise AssertionError(f"the gauges never read {want}")

    async def scenario():
        first = asyncio.ensure_future(_asgi(app, "POST", "/v1/completions", body, leave=lambda sent: False))
        await until((1, 0))
        left = asyncio.Event()
        queued = [asyncio.ensure_future(_asgi(app, "POST", "/v1/completions", body, gone=left)) for _ in range(2)]
        await until((1, 2))
        left.set()
        await until((1, 0))  # while the first still runs
        gate.set()
        assert (await first)[0] == 200 and [(await q)[0] for q in queued] == [499, 499]
    _run_scenario(app, gate, scenario)


def _answered_while_held(app, gate: threading.Event, path: str, body: dict) -> None:
    """More requests to `path` than asyncio's default pool has threads, each held at
    `gate`: a short completion is still answered meanwhile; then they all are."""
    readers = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor

    async def scenario():
        held = [asyncio.ensure_future(_asgi(app, "POST", path, body, leave=lambda sent: False))
                for _ in range(readers + 2)]
        await asyncio.sleep(0.2)
        status, _ = await asyncio.wait_for(_asgi(app, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2},
                                                 leave=lambda sent: False), 20)
        assert status == 200 and not any(t.done() for t in held)
        gate.set()
        assert {(await t)[0] for t in held} == {200}
    _run_scenario(app, gate, scenario)


def test_tokenize_calls_have_threads_of_their_own(llm, monkeypatch):
    """/tokenize has no length limit (as vLLM's), and megabytes take the tokenizer a
    minute: however many such calls wait, a completion is answered meanwhile (they held
    every thread that reads requests)."""
    import treeflash.server.app as app_module
    gate = threading.Event()
    monkeypatch.setattr(app_module, "parse_tokenize", _held_until(gate, app_module.parse_tokenize))
    _answered_while_held(build_app(llm, "tiny", None), gate, "/tokenize", {"prompt": "x = 1"})


def test_long_prompts_are_read_on_threads_of_their_own(llm, monkeypatch):
    """A prompt that truncate_prompt_tokens cuts is tokenized whole first: megabytes take
    seconds. However many such requests wait, a short completion is answered meanwhile
    (they held every thread that reads requests: 19 s for a one-token answer)."""
    import treeflash.server.app as app_module
    gate, real = threading.Event(), app_module.parse_completion

    def held(body, *args, **kw):
        if len(body.get("prompt", "")) > app_module.LONG_BODY_BYTES:
            gate.wait(30)
        return real(body, *args, **kw)
    monkeypatch.setattr(app_module, "parse_completion", held)
    long = {"prompt": "x = 1\n" * (app_module.LONG_BODY_BYTES // 6 + 1), "max_tokens": 1, "truncate_prompt_tokens": 8}
    _answered_while_held(build_app(llm, "tiny", None), gate, "/v1/completions", long)


def test_min_tokens_holds_stop_strings_back_in_a_stream_too(client, llm):
    """min_tokens: a stop string in the first min_tokens tokens' text does not end the
    answer, streamed or whole: the stream's text is the whole answer's, and the text from
    that stop string on streams as it comes (not held to the answer's end)."""
    full = llm.generate(PROMPT, SamplingParams(max_new_tokens=40, ignore_eos=True))[0].token_ids
    k = next(i for i in range(1, 30) if "\n" in llm.tokenizer.decode(full[:i]))  # its first newline
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stop": ["\n"],
            "min_tokens": k + 2}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    assert "\n" in whole["text"]  # the first newline was held back
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}))[:-1]
    assert "".join(e["choices"][0]["text"] for e in streamed) == whole["text"]
    assert streamed[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    # streamed as it comes, not held to the end as if the newline might still stop it
    assert "\n" in "".join(e["choices"][0]["text"] for e in streamed if e["choices"][0]["finish_reason"] is None)


# ----------------------------------------------------------------------------- `treeflash serve`'s options (cases a mutation review found untested)


def served(monkeypatch, llm, *argv) -> dict:
    """What `treeflash serve ARGV` builds its app and uvicorn with: `llm` stands for the
    model, and the server does not start."""
    import uvicorn

    import treeflash.cli
    import treeflash.server.app
    import treeflash.server.cli
    from treeflash.cli import main
    got = {}

    class Started(Exception):
        pass

    def build_app_(*args, **kwargs):  # its arguments by name
        got["app"] = inspect.signature(build_app).bind(*args, **kwargs).arguments
        return types.SimpleNamespace(state=types.SimpleNamespace(shutdown=lambda: None))

    def config(app, **kwargs):
        got["uvicorn"] = kwargs
        raise Started

    def make_llm(args, **kw):
        got["llm"] = kw
        if "port" in got:  # the port is held while the model loads: another server (SO_REUSEADDR) cannot take it
            with socket.socket() as other, pytest.raises(OSError):
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                other.bind(("127.0.0.1", got["port"]))
                other.listen()
        return llm

    monkeypatch.setattr(treeflash.cli, "make_llm", make_llm)
    monkeypatch.setattr(treeflash.server.cli, "warm_up", lambda *args: None)
    monkeypatch.setattr(treeflash.server.app, "build_app", build_app_)
    monkeypatch.setattr(uvicorn, "Config", config)
    if not any(a.startswith("--host") for a in argv):
        got["port"] = _free_port()
    main(["serve", "--port", str(got.get("port") or _free_port()), *argv])
    got.pop("port", None)
    return got


def test_serve_listens_on_localhost_port_8000_by_default():
    """Not on every interface unless asked (--host 0.0.0.0), on vLLM's port."""
    from treeflash.cli import build_parser
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.max_batch) == ("127.0.0.1", 8000, 1)


def test_serve_names_the_model_by_its_folder_and_the_path_given(monkeypatch, llm, chat_model, capsys):
    """Clients may send the folder's name or --model as given (as vLLM names it); the first
    --served-model-name wins, the others are aliases (each once)."""
    def names(*argv):
        app = served(monkeypatch, llm, *argv)["app"]
        return app["model_name"], tuple(app.get("aliases", ()))
    assert names("--model", str(chat_model)) == (chat_model.name, (str(chat_model),))
    assert names("--model", str(chat_model), "--served-model-name", "a", "b", "a", "b") == ("a", ("b",))
    assert names() == ("treeflash-builtin", ())
    assert f"serving '{chat_model.name}'" in capsys.readouterr().err


def test_serve_names_a_hub_model_by_its_id(monkeypatch, llm, tmp_path):
    """--model org/name read from the Hugging Face cache is served under the id, not the
    snapshot folder's hash name."""
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(builtin_paths()[0], snapshot)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    app = served(monkeypatch, llm, "--model", "org/tiny")["app"]
    assert (app["model_name"], tuple(app.get("aliases", ()))) == ("org/tiny", ())


def test_serve_takes_the_api_key_and_cors_origins(monkeypatch, llm):
    """--api-key defaults to $TREEFLASH_API_KEY (an empty one: no key); browsers of any
    origin may call the server unless --allowed-origins says otherwise."""
    monkeypatch.setenv("TREEFLASH_API_KEY", "s3cret")
    app = served(monkeypatch, llm)["app"]
    assert (app["api_key"], tuple(app["allowed_origins"])) == ("s3cret", ("*",))
    monkeypatch.setenv("TREEFLASH_API_KEY", "")
    assert served(monkeypatch, llm)["app"]["api_key"] is None
    app = served(monkeypatch, llm, "--api-key", "k", "--allowed-origins", "http://a")["app"]
    assert (app["api_key"], tuple(app["allowed_origins"])) == ("k", ("http://a",))


def test_serve_generation_config_none_leaves_the_models_defaults_out(monkeypatch, llm, tmp_path):
    """--generation-config none: requests that leave sampling values out get OpenAI's,
    not the model's generation_config.json ones."""
    from treeflash.server.protocol import SamplingDefaults
    folder = tmp_path / "m"
    shutil.copytree(builtin_paths()[0], folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))
    assert served(monkeypatch, llm, "--model", str(folder))["app"]["defaults"] == \
        SamplingDefaults(temperature=0.6, top_p=0.95)
    assert served(monkeypatch, llm, "--model", str(folder), "--generation-config", "none")["app"]["defaults"] == \
        SamplingDefaults()


def test_serve_takes_vllms_spellings_of_its_options(monkeypatch, llm, chat_model, capsys):
    """A `vllm serve` command line runs as it is: the model as its first argument,
    --max-num-seqs, --tensor-parallel-size, --seed (the seeds of requests that give
    none), $VLLM_API_KEY, --enable-auto-tool-choice (with a parser, as vLLM asks),
    --uvicorn-log-level and --root-path."""
    from treeflash.cli import build_parser
    args = build_parser().parse_args(["serve", "m", "--max-num-seqs", "3", "--tensor-parallel-size", "2"])
    assert (args.model_path, args.max_batch, args.tp) == ("m", 3, 2)
    assert build_parser().parse_args(["serve", "-tp", "4"]).tp == 4
    got = served(monkeypatch, llm, str(chat_model), "--seed", "5", "--uvicorn-log-level", "info",
                 "--root-path", "/api", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert got["app"]["model_name"] == chat_model.name and got["app"]["tool_parser"] == "hermes"
    assert got["llm"] == {"seed": 5}
    assert (got["uvicorn"]["log_level"], got["uvicorn"]["root_path"]) == ("info", "/api")
    assert served(monkeypatch, llm)["uvicorn"]["log_level"] == "warning"
    monkeypatch.delenv("TREEFLASH_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "v")
    assert served(monkeypatch, llm)["app"]["api_key"] == "v"
    monkeypatch.setenv("TREEFLASH_API_KEY", "t")  # ours first
    assert served(monkeypatch, llm)["app"]["api_key"] == "t"
    capsys.readouterr()
    assert served(monkeypatch, llm, "--enable-auto-tool-choice") == {}
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    assert served(monkeypatch, llm, str(chat_model), "--model", "other") == {}
    assert "two models given" in capsys.readouterr().err


def test_serve_takes_a_chat_template_as_a_file_or_as_text(monkeypatch, llm, tmp_path, capsys):
    """--chat-template (vLLM's) gives a model without one, the built-in pair for one, a
    chat API: a Jinja file or the template itself, with the model's special tokens."""
    from treeflash.files import tokenizer_settings
    source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ eos_token }}"
    (tmp_path / "t.jinja").write_text(source)
    eos = ChatTemplate.special_tokens_of(tokenizer_settings(builtin_paths()[0])).get("eos_token", "")
    for given in (str(tmp_path / "t.jinja"), source):
        template = served(monkeypatch, llm, "--chat-template", given)["app"]["chat_template"]
        assert template.render([{"role": "user", "content": "hi"}]) == "<user>hi" + eos
    capsys.readouterr()
    assert served(monkeypatch, llm, "--chat-template", str(tmp_path / "missing.jinja")) == {}
    assert "chat template: no file" in capsys.readouterr().err
    assert served(monkeypatch, llm, "--chat-template", "{% for %}") == {}
    assert "treeflash: error:" in capsys.readouterr().err


def test_serve_reads_sampling_defaults_from_vllms_generation_config_values(monkeypatch, llm, tmp_path, capsys):
    """--generation-config vllm is vLLM's name for none; a folder gives its own
    generation_config.json; a folder without one is refused in one line."""
    from treeflash.server.protocol import SamplingDefaults
    folder = tmp_path / "m"
    shutil.copytree(builtin_paths()[0], folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6}))
    other = tmp_path / "g"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 7}))
    assert served(monkeypatch, llm, "--model", str(folder), "--generation-config", "vllm")["app"]["defaults"] == \
        SamplingDefaults()
    assert served(monkeypatch, llm, "--model", str(folder), "--generation-config", str(other))["app"]["defaults"] \
        == SamplingDefaults(temperature=0.3, top_k=7)
    capsys.readouterr()
    assert served(monkeypatch, llm, "--generation-config", str(tmp_path)) == {}
    assert "--generation-config must be 'auto', 'none' (vLLM's 'vllm') or a folder" in capsys.readouterr().err


def test_serve_says_its_ipv6_address_in_brackets():
    from treeflash.server.cli import _url
    assert (_url("::1", 8000), _url("127.0.0.1", 80)) == ("http://[::1]:8000/v1", "http://127.0.0.1:80/v1")


def test_serve_access_log_is_on_unless_disabled(monkeypatch, llm):
    assert served(monkeypatch, llm)["uvicorn"]["access_log"] is True
    import logging
    from treeflash.server.cli import _not_polling
    keep = _not_polling("/x")  # health checks stay out of the log behind a proxy's prefix too
    line = lambda path: logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',  # noqa
                                          ("h", "GET", path, "1.1", 200), None)
    assert [keep(line(p)) for p in ("/x/health", "/x/metrics", "/x/v1/models", "/health")] == \
        [False, False, True, False]
    assert served(monkeypatch, llm, "--disable-uvicorn-access-log")["uvicorn"]["access_log"] is False


# ----------------------------------------------------------------------------- /metrics' text (cases a mutation review found untested)


def test_metrics_declare_each_familys_prometheus_type():
    """A scraper takes rate() of counters and quantiles of histograms by the # TYPE lines,
    and the exposition format ends in a line feed."""
    from treeflash.server.metrics import ServerMetrics
    text = ServerMetrics().render(running=1, waiting=2, graph_captures=3)
    types = dict(line.split()[2:4] for line in text.splitlines() if line.startswith("# TYPE "))
    counters = ["requests_total", "choices_total", "prompt_tokens_total", "generation_tokens_total",
                "generation_rounds_total", "graph_captures_total"]
    assert types == {**{f"treeflash_{n}": "counter" for n in counters},
                     **{f"treeflash_{n}": "histogram" for n in ("request_seconds", "time_to_first_token_seconds")},
                     **{f"treeflash_requests_{n}": "gauge" for n in ("running", "waiting")}}
    assert text.endswith("\n") and not text.endswith("\n\n")
    samples = metric_samples(text)
    assert (samples["treeflash_requests_running"], samples["treeflash_requests_waiting"],
            samples["treeflash_graph_captures_total"]) == (1, 2, 3)


def test_metrics_count_each_finish_reason_and_a_prompt_once():
    """Finished generations by reason (an aborted one too, at 0 before any), their tokens
    and rounds; the prompt's tokens once for its request's several choices."""
    from types import SimpleNamespace

    from treeflash.server.metrics import ServerMetrics
    m = ServerMetrics()
    assert {k: v for k, v in metric_samples(m.render(0, 0, 0)).items() if "choices" in k} == {
        f'treeflash_choices_total{{finish_reason="{r}"}}': 0 for r in ("stop", "length", "abort")}
    m.choice_done(5, SimpleNamespace(finish_reason="stop", token_ids=[1, 2, 3], stats={"rounds": 4}))
    m.choice_done(0, SimpleNamespace(finish_reason="abort", token_ids=[], stats={}))  # the request's second choice
    m.request_done("cancelled", 0.5)
    got = metric_samples(m.render(0, 0, 0))
    assert (got['treeflash_choices_total{finish_reason="stop"}'], got['treeflash_choices_total{finish_reason="abort"}'],
            got['treeflash_choices_total{finish_reason="length"}']) == (1, 1, 0)
    assert (got["treeflash_prompt_tokens_total"], got["treeflash_generation_tokens_total"],
            got["treeflash_generation_rounds_total"]) == (5, 3, 4)  # the rounds its stats count, not one a choice
    assert got['treeflash_requests_total{outcome="cancelled"}'] == 1 and got["treeflash_request_seconds_count"] == 1


def test_warm_up_fills_the_context_only_as_far_as_a_chat_may():
    """The warm-up's chat request (ended after its prefill) asks for the chat default's
    max_tokens where generation_config.json bounds it, else for what fits the context:
    what a chat request without max_tokens would ask, so its cache is the one captured."""
    from types import SimpleNamespace

    from treeflash.server.cli import warm_up
    from treeflash.server.protocol import SamplingDefaults
    asked = []
    fake = SimpleNamespace(eos_token_ids=[0], max_model_len=64,
                           generate=lambda prompt, params, on_tokens=None: asked.append(params.max_new_tokens))
    warm_up(fake)
    assert set(asked) == {4, 63}  # short requests, and the chat's whole context past the 1-token prompt
    asked.clear()
    warm_up(fake, SamplingDefaults(max_tokens=8))
    assert set(asked) == {4, 8}
    asked.clear()
    warm_up(fake, SamplingDefaults(max_tokens=1000))
    assert set(asked) == {4, 63}


# ----------------------------------------------------------------------------- the app's routes, streams and shutdown (cases a mutation review found untested)


def test_the_api_key_is_checked_before_anything_else(llm):
    """Without the key, /v1 answers 401 whatever was asked: the retrieve-model route too,
    and a bad body or an unknown model is not read first (a 400, or a 404 that lists the
    models served)."""
    with TestClient(build_app(llm, "t", api_key="s3cret")) as c:
        for r in (c.get("/v1/models/t"), c.post("/v1/completions", content=b"{not json"),
                  c.post("/v1/completions", json={"model": "gpt-4", "prompt": PROMPT})):
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
        assert c.get("/v1/models/t", headers={"Authorization": "Bearer s3cret"}).json()["id"] == "t"


def test_streamed_logprobs_cover_the_tokens_that_add_no_text(client, llm):
    """A token that adds no text (a special token, left out of it) still streams its
    logprobs: the stream has an entry for every generated token, as the whole answer."""
    eos = llm.eos_token_ids[0]
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "logit_bias": {str(eos): 100},
            "logprobs": 1}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["text"] == "" and len(whole["logprobs"]["token_logprobs"]) == 2
    streamed = events(client.post("/v1/completions", json={**body, "stream": True}))[:-1]
    parts = [e["choices"][0]["logprobs"] for e in streamed if e["choices"][0]["logprobs"]]
    assert [x for p in parts for x in p["token_logprobs"]] == whole["logprobs"]["token_logprobs"]


def test_a_body_as_large_as_the_limit_is_read(client, monkeypatch):
    """The body limit is inclusive: a body of exactly MAX_BODY_BYTES is read, one byte
    more is refused (413)."""
    import treeflash.server.app as app_module
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 1 << 20)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
    body += b" " * ((1 << 20) - len(body))
    assert client.post("/v1/completions", content=body).status_code == 200
    r = client.post("/v1/completions", content=body + b" ")
    assert r.status_code == 413 and "larger than 1 MiB" in r.json()["error"]["message"]


def test_a_body_declared_too_large_is_refused_before_it_is_read(llm):
    """A request whose Content-Length is over the limit gets its 413 at once, as nginx
    answers from the header: the server does not wait for (and buffer) 32 MiB of body
    from a client that may send it slowly or never."""
    import treeflash.server.app as app_module
    app, sent, reads = build_app(llm, "tiny", None), [], []

    async def receive():
        reads.append(1)
        if len(reads) == 1:
            return {"type": "http.request", "body": b'{"prompt": "x"', "more_body": True}
        await asyncio.Event().wait()  # the rest never comes

    async def send(message):
        sent.append(message)
    scope = _http_scope("POST", "/v1/completions", ((b"content-length", str(app_module.MAX_BODY_BYTES + 1).encode()),))
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 30))
    assert sent[0]["status"] == 413 and reads == []
    assert "larger than 32 MiB" in json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]["message"]


def test_a_body_nested_too_deeply_is_named_so(client):
    """Valid JSON nested deeper than the parser goes is refused as too deep, not as
    invalid JSON; nesting within the limit is read."""
    deep = b'{"prompt": "x", "metadata": ' + b'{"a": ' * 100000 + b"1" + b"}" * 100000 + b"}"
    r = client.post("/v1/completions", content=deep)
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body nests too deeply"
    r = client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": 1, "x": ' + b"[" * 100 + b"]" * 100 + b"}")
    assert r.status_code == 400 and "'x'" in r.json()["error"]["message"]  # read, then refused by name


def test_a_body_with_an_integer_too_long_to_convert_is_named_so(client):
    """Valid JSON whose integer has more digits than Python converts (4300) is refused
    for that number, not as invalid JSON; a long one within the limit is read and refused
    by its field's own check."""
    limit = sys.get_int_max_str_digits()
    r = client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ' + b"9" * (limit + 1) + b"}")
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        f"the request body holds an integer of more than {limit} digits"
    r = client.post("/v1/completions", content=b'{"prompt": "x", "max_tokens": ' + b"9" * limit + b"}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_request_after_the_drain_began_is_refused_unread(llm, chat_model, slow_compiles):
    """Once a shutdown has begun, a new request is answered "shutting down" at once: its
    constraint is not compiled first (seconds, for a large vocabulary)."""
    app = build_app(llm, "tiny", ChatTemplate.from_folder(chat_model))
    with TestClient(app) as c:
        app.state.drain()
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                            "structured_outputs": {"regex": "drained[0-9]*"}})
    assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down"
    assert not slow_compiles


def test_a_request_queued_after_the_drain_never_starts(fake_worker):
    """A request that reaches the engine's queue once the drain has run (it passed its
    checks meanwhile, or the engine thread had just taken it) is answered "shutting
    down" (503) and never generated: the shutdown does not wait for it."""
    fake, worker, job = fake_worker
    fake.gate.set()
    worker.drain()
    late = job([1])
    worker.jobs.put(late)
    with pytest.raises(Exception, match="shutting down") as e:
        late.future.result(30)
    assert e.value.status == 503 and fake.calls == []


def test_a_shutdown_answers_the_request_being_generated(llm):
    """app.state.shutdown (a server that exits without its lifespan's end) ends the
    request being generated at its next round, answered "shutting down" (503), not run
    to its max_tokens."""
    app = build_app(llm, "tiny", None)
    got = []
    with TestClient(app) as c:
        body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "temperature": 0}
        asking = threading.Thread(target=lambda: got.append(c.post("/v1/completions", json=body)))
        asking.start()
        _wait(lambda: scrape(c)["treeflash_requests_running"] == 1)
        app.state.shutdown()
        asking.join(60)
    assert got[0].status_code == 503 and got[0].json()["error"]["message"] == "the server is shutting down"


# ----------------------------------------------------------------------------- `treeflash serve`'s options (cases a second mutation review found untested)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="needs IPv6's loopback")
def test_serve_listens_on_an_ipv6_address(monkeypatch, llm):
    """--host ::1 (or ::, every interface of a dual-stack host) is checked as an IPv6
    address, not refused as one that cannot be listened on."""
    assert served(monkeypatch, llm, "--host", "::1")["uvicorn"]["host"] == "::1"


def test_serve_may_listen_again_on_a_port_a_server_just_closed():
    """A restarted server takes its port at once though the last one's connections are
    in TIME_WAIT, as uvicorn binds it (SO_REUSEADDR): the check before loading does not
    refuse it."""
    from treeflash.server.cli import _listening
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = listener.accept()
            conn.close()  # the server's side closes first: its port stays in TIME_WAIT
            client.recv(1)
    with _listening("127.0.0.1", port) as socks:
        assert [s.getsockname()[:2] for s in socks] == [("127.0.0.1", port)]


def test_serve_listens_on_every_address_of_its_host_name():
    """--host localhost listens where the name resolves, IPv4 included (one socket of
    the first address only would leave 127.0.0.1 unanswered where ::1 comes first)."""
    from treeflash.server.cli import _listening
    port = _free_port()
    with _listening("localhost", port) as socks:
        want = {a[4][0] for a in socket.getaddrinfo("localhost", port, type=socket.SOCK_STREAM)}
        assert {s.getsockname()[0] for s in socks} == want and "127.0.0.1" in want
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # in the backlog: the port is ours
    assert all(s.fileno() == -1 for s in socks)  # closed on the way out


def test_serve_passes_max_batch_and_a_hub_ids_served_name_on(monkeypatch, llm, tmp_path):
    """--max-batch reaches the app that batches queued requests; --served-model-name
    names a model read by its hub id too (the id is then no alias)."""
    assert served(monkeypatch, llm, "--max-batch", "4")["app"]["max_batch"] == 4
    shutil.copytree(builtin_paths()[0], tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    app = served(monkeypatch, llm, "--model", "org/tiny", "--served-model-name", "tiny")["app"]
    assert (app["model_name"], tuple(app.get("aliases", ()))) == ("tiny", ())


def test_serve_says_which_sampling_defaults_the_model_sets(monkeypatch, llm, tmp_path, capsys):
    """At startup the server says what requests that leave sampling values out get from
    generation_config.json (vLLM says so too); with none, or none asked for, nothing."""
    folder = tmp_path / "m"
    shutil.copytree(builtin_paths()[0], folder)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    capsys.readouterr()
    served(monkeypatch, llm, "--model", str(folder))
    assert "treeflash: requests that leave them out get temperature 0.6, top_p 0.95, top_k 20 " \
           "(generation_config.json; --generation-config none for OpenAI's)" in capsys.readouterr().err
    served(monkeypatch, llm, "--model", str(folder), "--generation-config", "none")
    assert "leave them out" not in capsys.readouterr().err


def test_serve_says_when_a_model_without_a_chat_template_answers_completions_only(monkeypatch, llm, chat_model,
                                                                                  capsys):
    capsys.readouterr()
    served(monkeypatch, llm)  # the built-in model has no chat template
    assert "(no chat template: /v1/completions only)" in capsys.readouterr().err
    served(monkeypatch, llm, "--model", str(chat_model))
    assert "no chat template" not in capsys.readouterr().err


def test_serve_reads_its_chat_parsers_as_a_pair(monkeypatch, llm, chat_model, capsys):
    """--tool-call-parser openai alone reads gpt-oss's Harmony answers with their
    reasoning parser (which it implies); a pair that reads different formats is refused
    before the model loads."""
    app = served(monkeypatch, llm, "--model", str(chat_model), "--tool-call-parser", "openai")["app"]
    assert (app["tool_parser"], app["reasoning_parser"]) == ("openai", "openai_gptoss")
    capsys.readouterr()
    assert served(monkeypatch, llm, "--model", str(chat_model), "--tool-call-parser", "hermes",
                  "--reasoning-parser", "openai_gptoss") == {}
    assert "read different formats" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the app, its worker and /metrics (cases a second mutation review found)


def test_a_sentencepiece_stream_keeps_its_first_space(tmp_path):
    """With a SentencePiece tokenizer (Llama 2, Mistral) a streamed answer starts with the
    space its first token carries, as the whole answer does: the stream decodes after the
    prompt (decoded alone, " ab" would lose its space)."""
    from conftest import SP_PIECES, write_sentencepiece_model
    sp = LLM(write_sentencepiece_model(tmp_path), device="cpu", dtype="float32")
    body = {"prompt": "ab ab", "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(SP_PIECES.index("\u2581ab")): 100}}  # " ab", " ab", " ab"
    with TestClient(build_app(sp, "sp", None)) as c:
        whole = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        streamed = events(c.post("/v1/completions", json={**body, "stream": True}))[:-1]
    assert whole == " ab ab ab"
    assert "".join(e["choices"][0]["text"] for e in streamed) == whole


def test_metrics_time_a_request_from_its_arrival(client):
    """treeflash_request_seconds observes each request's own time, arrival to answer (a
    scraper's mean latency and quantiles come from it): its sum grows by no more than the
    client waited, and the bucket of that time counts it, not only +Inf."""
    _wait(lambda: scrape(client)["treeflash_requests_running"] == 0)
    before = scrape(client)
    start = time.monotonic()
    assert client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    took = time.monotonic() - start
    after = scrape(client)  # counted before it was answered
    assert after["treeflash_request_seconds_count"] - before["treeflash_request_seconds_count"] == 1
    assert 0 < after["treeflash_request_seconds_sum"] - before["treeflash_request_seconds_sum"] <= took
    from treeflash.server.metrics import REQUEST_BOUNDS
    key = f'treeflash_request_seconds_bucket{{le="{float(next(b for b in REQUEST_BOUNDS if b >= took))}"}}'
    assert after[key] - before[key] == 1


def test_a_stream_whose_event_loop_is_gone_ends_at_its_next_round(fake_worker, llm):
    """A streamed request whose server's event loop has closed (the server went away
    without draining) ends at its next round, answered as cancelled: the engine is not
    held generating deltas nobody can read up to max_tokens."""
    from treeflash.server.app import Cancelled, Job
    from treeflash.server.protocol import Request
    fake, worker, _ = fake_worker
    fake.gate.set()
    closed = asyncio.new_event_loop()
    closed.close()
    gone = Job(Request("completion", [[1]], SamplingParams(max_new_tokens=100000), stream=True), closed,
               llm.tokenizer, worker.metrics)
    worker.jobs.put(gone)
    with pytest.raises(Cancelled):
        gone.future.result(30)
    assert gone.generated[0] < 100 and worker.metrics.requests["cancelled"] == 1


def test_a_drain_answers_the_queued_requests_at_once(fake_worker):
    """A shutdown that begins while the engine is inside a long step (a long prompt's
    prefill) answers the requests queued behind it "shutting down" (503) at once, not
    when that step is over; the running one ends at its next round."""
    fake, worker, job = fake_worker
    running = job([1], tokens=100000)
    worker.jobs.put(running)
    _wait(lambda: fake.calls)  # inside generate, held by the gate
    queued = [job([2]), job([3])]
    for j in queued:
        worker.jobs.put(j)
    worker.drain()
    for j in queued:
        with pytest.raises(Exception, match="shutting down") as e:
            j.future.result(5)
        assert e.value.status == 503
    fake.gate.set()
    with pytest.raises(Exception, match="shutting down"):
        running.future.result(30)
    assert fake.calls == [[1]]


def test_a_batch_takes_requests_up_to_max_batch_prompts(fake_worker):
    """The engine takes queued requests up to max_batch prompts a batch: behind a request
    of max_batch prompts the next one stays queued (/metrics counts it waiting, not
    running) and gets the engine once that batch is done."""
    fake, worker, job = fake_worker
    plug = job([9])
    worker.jobs.put(plug)
    _wait(lambda: fake.calls)  # inside generate, held by the gate
    full, behind = job([1], [2], [3], [4], tokens=100000), job([5])
    worker.jobs.put(full)
    worker.jobs.put(behind)
    fake.gate.set()
    _wait(lambda: full.started)
    assert worker.running == [full] and worker.jobs.qsize() == 1
    full.cancel()
    assert [o.text for o in behind.future.result(30)] == ["5"]
    assert fake.calls == [[9], [1, 2, 3, 4], [5]]


def test_running_requests_leave_the_gauge_as_they_end(llm, monkeypatch):
    """A batch runs until its last request ends; /metrics' requests_running counts only
    those not answered yet, not the whole batch."""
    import treeflash.server.app as app_module
    from treeflash.server.app import EngineWorker
    fake, made = FakeLLM(llm.tokenizer), []
    monkeypatch.setattr(app_module, "EngineWorker", lambda _, max_batch: made.append(EngineWorker(fake, 4)) or made[0])
    client = TestClient(build_app(llm, "m", max_batch=4))
    assert scrape(client)["treeflash_requests_running"] == 0  # (the app's worker is made here)
    worker = made[0]
    try:
        plug = _job(llm.tokenizer, [9], metrics=worker.metrics)
        worker.jobs.put(plug)
        _wait(lambda: fake.calls)  # inside generate, held by the gate
        short, long = (_job(llm.tokenizer, [1], metrics=worker.metrics),
                       _job(llm.tokenizer, [2], tokens=100000, metrics=worker.metrics))
        worker.jobs.put(short)
        worker.jobs.put(long)
        fake.gate.set()
        _wait(lambda: long.started)
        assert [o.text for o in short.future.result(30)] == ["1"]
        assert worker.running == [short, long] and scrape(client)["treeflash_requests_running"] == 1
        long.cancel()
        _wait(lambda: scrape(client)["treeflash_requests_running"] == 0)
    finally:
        worker.stop()


def test_metrics_report_the_engines_graph_captures(client, llm, monkeypatch):
    """treeflash_graph_captures_total is the engine's count of CUDA graphs captured, warm-up
    included: an operator sees recaptures while serving (a new batch shape) as it grows."""
    monkeypatch.setattr(type(llm), "graph_captures", property(lambda self: 7))
    assert scrape(client)["treeflash_graph_captures_total"] == 7


def test_a_batch_that_fails_during_a_drain_is_answered_shutting_down(fake_worker):
    """A shutdown that begins while a batch is generated, which then fails (the server's
    tensor-parallel workers stop with it), answers the batch's requests "shutting down"
    (503, what a client retries elsewhere), not with the engine's error (500)."""
    fake, worker, job = fake_worker
    failing = job([666], [2])
    worker.jobs.put(failing)
    _wait(lambda: fake.calls)  # inside generate, held by the gate
    worker.drain()
    fake.gate.set()
    with pytest.raises(Exception, match="shutting down") as e:
        failing.future.result(30)
    assert e.value.status == 503


def test_a_stop_while_a_batch_is_gathered_answers_its_requests(llm):
    """A shutdown between the worker's two reads of the queue (it holds one request and
    looks for more): the request it holds is answered "shutting down" (503), not run and
    not left waiting, and the worker ends."""
    import queue
    from treeflash.server.app import EngineWorker
    worker = EngineWorker.__new__(EngineWorker)  # no thread: the reads below are the worker's

    class DrainBetweenReads(queue.Queue):
        def get_nowait(self):
            if worker.stopping:
                return super().get_nowait()
            worker.stopping = True  # drain(): then its sentinel is the next thing queued
            return None

    worker.llm, worker.max_batch, worker.running, worker.stopping = FakeLLM(llm.tokenizer), 4, [], False
    worker.jobs = DrainBetweenReads()
    held = _job(llm.tokenizer, [1])
    worker.jobs.put(held)
    assert worker._next_batch() is None
    with pytest.raises(Exception, match="shutting down") as e:
        held.future.result(0)
    assert e.value.status == 503 and worker.llm.calls == []
