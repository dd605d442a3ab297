"""Structured outputs: a request's text matches its regex, choice or JSON schema.

- the regex dialect's automaton accepts exactly what Python's `re` full-matches, as
  UTF-8 bytes, and refuses what it cannot do with a one-line reason;
- the token table is the byte automaton run over each token's bytes, without tokens
  that lead where no text can be finished;
- every method gives AR's tokens under the constraint (float32, CPU), greedy and
  sampled, alone and beside unconstrained or penalized requests, and the text
  matches; CUDA-graph states recapture when a larger table comes;
- the API, the server and the command line take it as vLLM's users send it.
"""
from __future__ import annotations

import itertools
import json
import random
import re

import numpy as np
import pytest
from cpu_graphs import cpu_graphs

from treeflash import LLM, SamplingParams, StructuredOutputs, UsageError
from treeflash.engine.options import builtin_paths
from treeflash.structured.grammar import REASONING_TAGS, token_automaton
from treeflash.structured.regex import compile_regex, escape

PATTERNS = [r"[a-c]+x?", r"(ab|a)*b{2,3}", r"a{,}b{}", r"\d{3}-\d{4}", r"[^a]*", r".{0,3}", r"héllo|wörld[α-ω]+",
            r"(?:yes|no)", r"a{,2}b", r"\w+@\w+\.(com|org)", r"[\u0100-\uFFFF]\U0001F600", r"^(?P<x>[ab])c?$",
            r"[\s\S]{2}", r"(a|)+b*?", r"[-a\]]+", r"\.\*\x41"]
ALPHABET = list("abcxyz-0123@.comorg_ \n]*A") + ["é", "ö", "α", "ω", "\u0100", "\uffff", "\U0001F600", "\U0001F601"]


def _strings(rng, n):
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7))) for _ in range(n)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_the_automaton_matches_what_python_re_matches(pattern):
    dfa = compile_regex(pattern)
    rng = random.Random(pattern)
    samples = _strings(rng, 3000) + ["abbb", "555-1234", "wörldαβ", "a@b.com", "Ā\U0001F600", "ac", "-]a",
                                     ".*A", "aab", "bb", "yes", "no", "Ab", "b", "aab{}"]
    hits = 0
    for s in samples:
        want = re.fullmatch(pattern, s, flags=re.ASCII) is not None
        assert dfa.matches(s.encode()) == want, (pattern, s)
        hits += want
    assert hits > 0, "no sample matched: the test would not notice a wrong automaton"


def test_white_space_escapes_mean_what_ecma_and_json_schema_mean():
    """\\s is ECMA-262's white space (Unicode's, as JSON Schema patterns mean it), so \\S
    and [^\\s] never take a no-break or ideographic space for a visible character."""
    spaces = " \t\n\u00a0\u1680\u2003\u2028\u202f\u3000\ufeff"
    for pattern in (r"\S+", r"[^\s]+"):
        dfa = compile_regex(pattern)
        assert dfa.matches("aé日-".encode())
        assert not any(dfa.matches(f"a{c}b".encode()) for c in spaces)
    dfa = compile_regex(r"\s")
    assert all(dfa.matches(c.encode()) for c in spaces)
    assert not any(dfa.matches(c.encode()) for c in "a\u200b\x1c\x85")  # not white space to ECMA


def test_quantifier_bounds_are_ascii_digits():
    """a{٣} (an Arabic-Indic three) is no quantifier, as in Python and ECMA: the text itself
    (it was read as a{3})."""
    dfa = compile_regex("a{\u0663}")
    assert dfa.matches("a{\u0663}".encode()) and not dfa.matches(b"aaa")
    with pytest.raises(UsageError, match="unexpected '{'"):  # GBNF has no literal braces outside strings
        StructuredOutputs(grammar='root ::= "a"{\u0663}').validate().automaton()


def test_the_automaton_reads_utf8_bytes():
    dfa = compile_regex(".*")
    assert dfa.matches("é€😀".encode())
    for bad in (b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80"):  # invalid UTF-8
        assert not dfa.matches(bad), bad


def test_the_automaton_is_minimal():
    assert compile_regex("(a|b)*c").num_states == 2
    assert compile_regex("a{3}").num_states == 4
    assert compile_regex("(?:yes|no)").num_states == compile_regex("yes|no").num_states == 5


@pytest.mark.parametrize("pattern,reason", [
    ("(a", "missing '\\)'"), ("a)", "unbalanced"), ("a{3,2}", "n < m"), ("(?=a)", "lookaround"),
    (r"(a)\1", "backreferences"), (r"\bword", "word boundaries"), (r"\p{L}", "Unicode properties"),
    (r"\N{BULLET}", "Unicode properties, names"), (r"\cJ", "control escapes"), (r"\q", "not an escape of this dialect"), ("a*+", "possessive"), ("*a", "nothing to repeat"),
    ("a**", "multiple repeat"), ("a{2}*", "multiple repeat"), ("a?*", "multiple repeat"), ("a+?*", "multiple repeat"),
    ("[a", "missing '\\]'"), ("[z-a]", "out of order"), ("a^b", "anchors"), ("a{2000}", "above 1000"), ("a{" + "9" * 5000 + "}", "above 1000"),
    ("(?i)a", "flags"), (r"\x4", "hex digits"), ("[^\\s\\S]", "matches no text"), ("a\\", "trailing backslash"),
    ("(?:(?:a{1000}){1000}){1000}", "expands past"), (r"\012", "octal"), (r"\ud800", "surrogate"),
    ("\ud800", "surrogate"), (r"\udfff", "surrogate"), ("(" * 2000 + ")" * 2000, "nests too deeply"), (r"a|\U00110000", "not a character"),
    ("(" + "a?" * 5000 + ")", "takes too long to build"),  # each within the NFA's size, seconds to compile
    ("(?:, ?-?(?:0|[1-9][0-9]*)){999}", "takes too long to minimise"),
])
def test_bad_patterns_are_refused_in_one_line(pattern, reason):
    with pytest.raises(UsageError, match=reason) as err:
        compile_regex(pattern)
    assert "\n" not in str(err.value)


def test_choices_are_matched_literally():
    choices = ["a.b", "(x)", "1+1", "[y]", "a|b", "c\\d", "new\nline", "ünï"]
    dfa = compile_regex("(?:" + "|".join(escape(c) for c in choices) + ")")
    for c in choices:
        assert dfa.matches(c.encode()), c
    for other in ("aXb", "x", "11", "a", "cd", "c\\\\d"):
        assert not dfa.matches(other.encode()), other


def test_the_token_table_walks_each_tokens_bytes():
    """Against a brute-force walk, over tokens of several lengths, an empty one and a
    special one (None); tokens that lead only where no text can end are not allowed."""
    vocab = [b"a", b"b", b"ab", b"ba", b"abc", b"c", b"", None, b"cc", b"x"]
    dfa = compile_regex("(ab)+c?")
    auto = token_automaton(dfa, vocab)

    def walk(state_text: str, token: bytes) -> bool:  # can text + token still grow into a match?
        text = state_text + token.decode()
        return any(re.fullmatch("(ab)+c?", text + tail) for tail in ("", "b", "c", "bc", "ab", "abc"))

    texts = {0: ""}  # a text that reaches each state, found breadth first
    todo = [0]
    while todo:
        s = todo.pop(0)
        for t, b in enumerate(vocab):
            nxt = int(auto.next[s, t])
            want = bool(b) and walk(texts[s], b)
            assert (nxt >= 0) == want, (texts[s], b)
            if nxt >= 0 and nxt not in texts:
                texts[nxt] = texts[s] + b.decode()
                todo.append(nxt)
    assert len(texts) == auto.num_states
    assert [bool(re.fullmatch("(ab)+c?", texts[s])) for s in range(auto.num_states)] == auto.accepting.tolist()


def test_a_constraint_the_tokens_cannot_spell_is_refused():
    with pytest.raises(UsageError, match="cannot be written with this model's tokens"):
        token_automaton(compile_regex("z+"), [b"a", b"b", None])
    with pytest.raises(UsageError, match="too complex"):
        token_automaton(compile_regex("[ab]{0,50}"), [b"a", b"b"] * 100, max_bytes=1000)


def test_a_stop_token_that_is_also_text_cuts_the_ways_only_it_went_on():
    """Under "ab|c" with "b" a stop token (no longer text), "a" leads nowhere: it is not
    allowed, so no state the text reaches is left without a token to take."""
    from treeflash.structured.grammar import with_ends
    table = with_ends(token_automaton(compile_regex("ab|c"), [b"a", b"b", b"c"]), [1], 3)
    assert table[0, 0] == -1 and table[0, 2] >= 0


def test_a_bad_word_stays_banned_inside_another_begun_one():
    """bad_words "a b" and "c" under the regex "ac": after "a" (which begins "a b") the only
    way on is "c", banned too, so the request is refused up front, not left stuck."""
    auto = token_automaton(compile_regex("ac"), [b"a", b"b", b"c"])
    with pytest.raises(UsageError, match="ban every way to finish"):
        auto.check_bans([[0, 1], [2]], auto.next)


def test_constraints_that_differ_in_any_field_are_cached_apart():
    """The cache key tells every field apart, the reasoning parser included: a qwen3
    request never gets the automaton of the same regex without reasoning."""
    constraints = [StructuredOutputs(regex="a"), StructuredOutputs(regex="a", reasoning="qwen3"),
                   StructuredOutputs(regex="a", reasoning="deepseek_r1"), StructuredOutputs(choice=["a"]),
                   StructuredOutputs(grammar='root ::= "a"'), StructuredOutputs(json={"const": "a"}),
                   StructuredOutputs(json_object=True)]
    assert len({c.key() for c in constraints}) == len(constraints)


# --- the engine ---

@pytest.fixture(scope="module")
def engines():
    target, drafter = builtin_paths()
    return {m: LLM(target, draft_model=None if m == "ar" else drafter, method=m, device="cpu", dtype="float32",
                   **({"budget": b} if m == "ddtree" else {}))
            for m, b in (("ar", None), ("dflash", None), ("ddtree", 24))}


CONSTRAINTS = [StructuredOutputs(regex=r"(    [a-z_]+ = [a-z0-9_.()]+\n){2,4}"),
               StructuredOutputs(choice=["yes", "no", "maybe so"]),
               StructuredOutputs(regex=r"[0-9]{3}(\.[0-9]+)?"),
               StructuredOutputs(json={"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                                      "n": {"type": "integer"}},
                                       "required": ["name", "n"]}),
               StructuredOutputs(json={"type": "object", "additionalProperties": {"type": "integer"}})]  # a map


def _pattern(so: StructuredOutputs) -> str:
    return so.pattern()


def test_every_method_gives_ar_tokens_under_a_constraint(engines):
    """Greedy and sampled, constrained requests beside unconstrained and penalized ones
    in one batch: DFlash and DDTree give AR's tokens, and each finished text matches."""
    params = []
    for i, so in enumerate(CONSTRAINTS):
        for t in (0.0, 1.0):
            params.append(SamplingParams(max_new_tokens=40, structured_outputs=so, temperature=t, seed=i))
    params += [SamplingParams(max_new_tokens=20, temperature=1.0, seed=5),
               SamplingParams(max_new_tokens=20, repetition_penalty=1.3, structured_outputs=CONSTRAINTS[0])]
    for prompt in ("def add(a, b):\n", "import os\n"):
        outs = {m: e.generate([prompt] * len(params), params) for m, e in engines.items()}
        ar = [o.token_ids for o in outs["ar"]]
        for m in ("dflash", "ddtree"):
            assert [o.token_ids for o in outs[m]] == ar, m
        for o, p in zip(outs["ar"], params):
            so = p.structured_outputs
            if so is None:
                continue
            assert o.finish_reason in ("stop", "length")
            if o.finish_reason == "stop":
                assert re.fullmatch(_pattern(so), o.text, flags=re.ASCII), (so, o.text)
                if so.json is not None:
                    value = json.loads(o.text)
                    if "properties" in so.json:
                        assert isinstance(value["name"], str) and isinstance(value["n"], int)
                    else:  # the map: any names, integers
                        assert all(type(v) is int for v in value.values())
            else:  # cut by max_new_tokens: still a prefix of a match
                dfa = compile_regex(_pattern(so))
                s = 0
                for byte in o.text.encode():
                    s = int(dfa.trans[s, byte])
                    assert s >= 0, o.text
        free = engines["ar"].generate(prompt, SamplingParams(max_new_tokens=40, temperature=0, seed=0))[0]
        assert free.text != outs["ar"][0].text, "the constraint changed nothing"


def test_a_choice_ends_at_the_choice(engines):
    out = engines["ddtree"].generate("def f(x):\n", SamplingParams(
        max_new_tokens=30, structured_outputs=StructuredOutputs(choice=["return x", "pass"])))[0]
    assert out.text in ("return x", "pass") and out.finish_reason == "stop"


def test_automata_are_compiled_once_per_constraint(engines):
    llm = engines["ar"]
    a = llm.rules.automaton(SamplingParams(structured_outputs=StructuredOutputs(json={"type": "integer"})))
    b = llm.rules.automaton(SamplingParams(structured_outputs=StructuredOutputs(json='{ "type":"integer"}')))
    assert a is not None and a.next.shape[1] == llm.config.vocab_size
    assert b is a  # the schema as text is the same constraint
    c = llm.rules.automaton(SamplingParams(structured_outputs=StructuredOutputs(regex="-?(?:0|[1-9][0-9]*)")))
    assert c is not a
    np.testing.assert_array_equal(a.next, c.next)


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


DEEP = _nested(100_000)  # deeper than json.dumps recurses (Python 3.12+ went past 5000)


@pytest.mark.parametrize("kw,message", [
    (dict(structured_outputs=StructuredOutputs()), "exactly one of json, regex, choice, grammar and json_object, got none"),
    (dict(structured_outputs=StructuredOutputs(regex="a", json_object=True)), "got regex, json_object"),
    (dict(structured_outputs=StructuredOutputs(regex="a", choice=["b"])), "got regex, choice"),
    (dict(structured_outputs=StructuredOutputs(choice=[])), "non-empty list of strings"),
    (dict(structured_outputs=StructuredOutputs(choice=["a", 3])), "non-empty list of strings"),
    (dict(structured_outputs=StructuredOutputs(regex=5)), "regex must be a string"),
    (dict(structured_outputs=StructuredOutputs(grammar=5)), "grammar must be a string"),
    (dict(structured_outputs=StructuredOutputs(json=[1])), "json must be a JSON schema"),
    (dict(structured_outputs=StructuredOutputs(json={"type": object})), "not a JSON value"),
    (dict(structured_outputs={"regex": "a"}), "must be StructuredOutputs"),
    (dict(structured_outputs=StructuredOutputs(regex="a"), min_tokens=2), "combined with min_tokens"),
    (dict(structured_outputs=StructuredOutputs(regex="a"), allowed_token_ids=[1]), "combined with allowed_token_ids"),
    (dict(structured_outputs=StructuredOutputs(choice=["yes"]), ignore_eos=True), "combined with ignore_eos"),
    (dict(structured_outputs=StructuredOutputs(json={"type": "object", "default": DEEP})), "nested too deeply"),
    # sizes past which compiling takes seconds (a server's other requests wait): refused first
    (dict(structured_outputs=StructuredOutputs(regex="a" * 100_001)), "regex of 100001 characters is over the limit"),
    (dict(structured_outputs=StructuredOutputs(choice=["abcdefghij"] * 10_001)), "choice of 100010 characters"),
    (dict(structured_outputs=StructuredOutputs(grammar='root ::= "' + "a" * 100_000 + '"')), "grammar of 100011"),
    (dict(structured_outputs=StructuredOutputs(json={"type": "string", "pattern": "^" + "a" * 10 ** 6 + "$"})),
     "json of 1000035 characters is over the limit of 1000000"),
])
def test_bad_structured_outputs_are_refused(kw, message):
    with pytest.raises(UsageError, match=message):
        SamplingParams(**kw)


@pytest.mark.parametrize("so,message", [
    (StructuredOutputs(regex="(a"), "missing"), (StructuredOutputs(json='{"type": '), "not valid JSON"),
    (StructuredOutputs(json={"type": "integer", "multipleOf": 3}), "multipleOf"),
    (StructuredOutputs(regex="[ab]*a[ab]{16}"), "too complex"),  # 2^17 states
])
def test_the_engine_refuses_what_it_cannot_compile(engines, so, message):
    llm = engines["ar"]
    with pytest.raises(UsageError, match=message) as err:
        llm.generate("x", SamplingParams(structured_outputs=so))
    assert err.value.param == "structured_outputs"


@pytest.mark.parametrize("so,message", [
    (StructuredOutputs(choice=["ok", "\ud800"]), r"structured outputs: choice\[1\] is not valid Unicode text"),
    (StructuredOutputs(json={"enum": ["a", "\ud800"]}), "structured outputs: json is not valid Unicode text"),
    (StructuredOutputs(json='{"const": "\\ud800"}'), "structured outputs: json is not valid Unicode text"),
    (StructuredOutputs(grammar='root ::= "\ud800"'), "structured outputs: grammar is not valid Unicode text"),
    (StructuredOutputs(json={"type": "object", "properties": {f"k{i}": {"type": "string", "maxLength": 60}
                                                              for i in range(8)}}),
     r"structured outputs: the JSON schema is too complex \(it expands past"),
    (StructuredOutputs(grammar='root ::= ("a" | "b")* "a"' + ' ("a" | "b")' * 16),  # 2^17 states, as the regex's
     "structured outputs: the grammar is too complex"),
])
def test_a_constraint_made_into_a_regex_is_refused_in_its_own_terms(so, message):
    """A schema, choice or grammar is refused naming what the client wrote, never the
    internal regex made from it (which it never saw, and whose character positions
    point nowhere in its request)."""
    with pytest.raises(UsageError, match=message) as err:
        so.validate().automaton()
    assert "regex" not in str(err.value)


def test_graphed_states_recapture_for_a_larger_table(monkeypatch):
    """A graphed state's table grows with the batch's automata: graphs that read the
    smaller one are dropped and the mode recaptured; the tokens stay AR's."""
    target, drafter = builtin_paths()
    llm = cpu_graphs(monkeypatch, LLM(target, draft_model=drafter, method="ddtree", budget=16, device="cpu",
                                       dtype="float32"))
    ar = LLM(target, method="ar", device="cpu", dtype="float32")
    small = SamplingParams(max_new_tokens=12, structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    large = SamplingParams(max_new_tokens=12, structured_outputs=StructuredOutputs(regex=r"[a-z ]{1,40}"))
    rows = []
    for params in (small, large, small, SamplingParams(max_new_tokens=12), large, small):
        assert llm.generate("def f(x):", params)[0].token_ids == ar.generate("def f(x):", params)[0].token_ids
        (state,) = llm.states.graphed.values()
        rows.append(sorted(mode.guided_rows for mode in state.rounds))
    # small's table (16 rows) is dropped when large's (64) comes; small then runs in the larger
    assert rows == [[16], [64], [64], [0, 64], [0, 64], [0, 64]]


# --- server and command line ---

def test_the_server_takes_vllm_and_openai_forms(engines):
    TestClient = pytest.importorskip("starlette.testclient").TestClient

    from treeflash.server.app import build_app
    client = TestClient(build_app(engines["ddtree"], "m"))
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    forms = [({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
             ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
             ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
             ({"guided_json": schema}, lambda t: json.loads(t) in ({"ok": True}, {"ok": False})),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
              lambda t: json.loads(t) in ({"ok": True}, {"ok": False})),
             ({"response_format": {"type": "json_object"}, "max_tokens": 200}, lambda t: isinstance(json.loads(t), dict)),
             ({"structured_outputs": {"json_object": True}, "max_tokens": 200},
              lambda t: isinstance(json.loads(t), dict))]
    for extra, ok in forms:
        r = client.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 30, "seed": 1, **extra})
        assert r.status_code == 200, r.text
        assert ok(r.json()["choices"][0]["text"]), (extra, r.json())
    r = client.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 30, "stream": True,
                                             "guided_choice": ["alpha", "beta"]})
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])
    assert text in ("alpha", "beta")


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "must be"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs", "json_object must be true or false"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "not both"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "'x', which no rule defines"),
    ({"structured_outputs": {"grammar_x": "root ::= x"}}, "structured_outputs", "not supported"),
    ({"structured_outputs": "a"}, "structured_outputs", "must be an object"),
    ({"guided_grammar": "start: \"x\""}, "guided_grammar", "Lark"),
    ({"guided_regex": "(a"}, "guided_regex", "missing"),
    ({"guided_json": {"type": "object", "required": ["a"]}}, "guided_json", "without 'properties'"),
    ({"guided_json": {"type": "text"}}, "guided_json", "'type' at $ must be one of"),  # once never answered
    ({"guided_choice": "yes"}, "guided_choice", "list of strings"),
    ({"guided_json": None, "guided_regex": "(a"}, "guided_regex", "missing"),  # the key set, not a null one
])
def test_the_server_refuses_bad_constraints_and_keeps_serving(engines, extra, param, message):
    TestClient = pytest.importorskip("starlette.testclient").TestClient

    from treeflash.server.app import build_app
    client = TestClient(build_app(engines["ar"], "m"))
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_the_command_line_constrains_its_text(capsys):
    from treeflash.cli import main
    assert main(["generate", "def f(x):", "--device", "cpu", "--choice", "pass", "--choice", "return x",
                 "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out.strip() in ("pass", "return x")
    assert main(["generate", "x", "--device", "cpu", "--regex", "(a"]) == 2
    assert "missing ')'" in capsys.readouterr().err


def test_the_table_is_int32_and_its_limit_is_in_those_bytes():
    vocab = [bytes([c]) for c in b"ab"] * 8
    auto = token_automaton(compile_regex("[ab]{0,20}"), vocab)
    assert auto.next.dtype == np.int32 and auto.nbytes == auto.num_states * len(vocab) * 4
    token_automaton(compile_regex("[ab]{0,20}"), vocab, max_bytes=auto.nbytes)  # exactly at the limit: taken


def test_json_object_is_any_object_nesting_at_most_four_deep():
    from treeflash.structured.json_schema import json_object_regex
    dfa = compile_regex(json_object_regex())
    for text, ok in [('{}', True), ('{"a": 1, "b": "x\\"y"}', True), ('{"a": {"b": [1, {"c": null}]}}', True),
                     ('{"a":{"b":{"c":[]}}}', True), ('{"a":{"b":{"c":{"d":[]}}}}', False),
                     ('{"a":{"b":{"c":{"d":{"e":1}}}}}', False),
                     ('{"a": [[[[1]]]]}', False), ('[1]', False), ('"x"', False), ('{"a": 01}', False),
                     ('{"a" : 1}', False), ('{"a": 1,}', False)]:
        assert dfa.matches(text.encode()) == ok, text
        assert not ok or isinstance(json.loads(text), dict)


def test_requests_of_one_constraint_share_its_rows(engines):
    """A batch holds each distinct table once (the table would grow with the batch)."""
    from treeflash.engine.sampling import SamplingBatch
    llm = engines["ar"]
    so = StructuredOutputs(regex="[a-z]{1,30}")
    params = [SamplingParams(structured_outputs=so)] * 8 + [SamplingParams(structured_outputs=so, stop_token_ids=[5])]
    automata = [llm.rules.automaton(p) for p in params]
    sb = SamplingBatch.from_params(params, "cpu", llm.config.vocab_size, [[1]] * 9, [llm.rules.held_ids(p) for p in params],
                                   automata)
    S = automata[0].num_states
    assert sb.guided_rows == 1 << (1 + 2 * S).bit_length() and sb.grammar_start.tolist() == [1] * 8 + [1 + S]


def test_a_schema_keeps_its_property_order(engines):
    """Two schemas that differ only in the order of their properties are two constraints
    (the text follows the order given)."""
    llm = engines["ar"]
    props = {"answer": {"type": "integer"}, "reason": {"type": "boolean"}}
    first = {"type": "object", "properties": props, "required": ["answer", "reason"]}
    second = {**first, "properties": dict(reversed(list(props.items())))}
    texts = [llm.generate("x = ", SamplingParams(max_new_tokens=30, structured_outputs=StructuredOutputs(json=s)))[0]
             .text for s in (first, second)]
    assert [list(json.loads(t)) for t in texts] == [["answer", "reason"], ["reason", "answer"]]


def test_a_stop_token_that_is_also_text(engines):
    """Stop tokens end the text: where one was a constraint's only way on, it may not be
    taken as text, and a constraint only they can finish is refused up front."""
    llm = engines["ar"]
    x = llm.tokenizer.encode("x", special=False)
    assert len(x) == 1
    with pytest.raises(UsageError, match="without its stop tokens") as err:
        llm.generate("a", SamplingParams(structured_outputs=StructuredOutputs(regex="x"), stop_token_ids=x))
    assert err.value.param == "stop_token_ids"
    out = llm.generate("a", SamplingParams(max_new_tokens=12, structured_outputs=StructuredOutputs(regex="x*y"),
                                           stop_token_ids=x))[0]
    assert out.finish_reason == "length" or re.fullmatch("x*y", out.text), out.text


def test_one_constraint_compiling_does_not_hold_up_another(engines, monkeypatch):
    """A server's requests compile their constraints on their own threads: a slow one
    (a large vocabulary's table takes seconds) does not hold up one compiled already,
    and a second request of the slow one waits for the same compile."""
    import threading
    import time

    import treeflash.structured.cache as cache_module
    llm = engines["ar"]
    fast = SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]"))
    llm.rules.automaton(fast)
    slow = SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]{2}"))
    compiled, plain = [], cache_module.token_automaton

    def slow_compile(dfa, *args):
        compiled.append(dfa)
        time.sleep(3.0)
        return plain(dfa, *args)
    monkeypatch.setattr(cache_module, "token_automaton", slow_compile)
    got = []
    threads = [threading.Thread(target=lambda: got.append(llm.rules.automaton(slow))) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    start = time.perf_counter()
    assert llm.rules.automaton(fast) is not None and time.perf_counter() - start < 2.0
    for t in threads:
        t.join()
    assert len(compiled) == 1 and got[0] is got[1]


def test_vllm_clients_send_unset_fields(engines):
    TestClient = pytest.importorskip("starlette.testclient").TestClient

    from treeflash.server.app import build_app
    client = TestClient(build_app(engines["ar"], "m"))
    so = {"json": None, "regex": "[0-9]{3}", "choice": None, "grammar": None, "json_object": None,
          "disable_fallback": False, "disable_any_whitespace": False, "whitespace_pattern": None}
    r = client.post("/v1/completions", json={"prompt": "x = ", "max_tokens": 8, "structured_outputs": so})
    assert r.status_code == 200 and re.fullmatch("[0-9]{3}", r.json()["choices"][0]["text"]), r.text


# --- reasoning before the constrained text ---

@pytest.mark.parametrize("tags", [(None, "</think>"), ("<think>", "</think>"), (None, "abac")])
def test_reasoning_is_free_text_up_to_the_first_closing_tag(tags):
    """The answer's reasoning is any text (not only what the pattern allows) up to and
    with the first closing tag (also one that overlaps itself, as abac in ababac), then whitespace
    (what str.lstrip drops), then a match; with an opening tag, an answer that does not
    open it is a match alone. The same texts as Python's re with a lookahead."""
    opening, closing = tags
    space = "[\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]*"
    thought = "(?:(?!" + re.escape(closing) + ").)*" + re.escape(closing) + space
    if opening is not None:
        thought = "(?:" + re.escape(opening) + thought + ")?"
    pattern = "[0-9a]{1,3}"
    dfa = compile_regex(pattern, tags)
    want = re.compile(thought + pattern, re.S)
    rng = random.Random(str(tags))
    alphabet = list("<>/thinkabc0 \n\xa0é") + ["</think>", "<think>", "ab", "abac"]
    text = lambda n: "".join(rng.choice(alphabet) for _ in range(rng.randint(0, n)))  # noqa: E731
    samples = [text(12) for _ in range(10000)]
    samples += [rng.choice(["", opening or "", "<th"]) + text(4) + rng.choice(["", closing, closing[:-1]])
                + rng.choice(["", " ", "\n\xa0"]) + "".join(rng.choice("0ab") for _ in range(rng.randint(0, 4)))
                for _ in range(10000)]
    hits = 0
    for s in samples + ["<think>a</think>\n\n12", "x</think>12", "</think>ab", "ababac0", "aba0abac 1"]:
        assert dfa.matches(s.encode()) == (want.fullmatch(s) is not None), (tags, s)
        hits += dfa.matches(s.encode()) and not re.fullmatch(pattern, s)
    assert hits > 50, "too few samples reasoned first: the test would not notice a wrong automaton"
    assert not dfa.matches(f"a{closing}b{closing}0".encode())  # the reasoning ends at the first tag


# prompts on which the built-in model writes a <think> block, then text (found by trying)
REASONING_PROMPTS = {"<think>a</think>\n# x = 1\n<think>b</think>\n# y = 2\n<think>c</think>\n# z = 3\n":
                     ("c", "# z = 3"),
                     "<think>\nok\n</think>\n# x = 1\n<think>\nok\n</think>\n# y = 2\n<think>\nok\n</think>\n# z = 3\n":
                     ("\n<think>\n\n", "# x = 1")}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_constraint_holds_after_the_reasoning(engines, parser):
    """With a reasoning parser's tags, the model reasons freely first and the text after
    it matches the constraint: every method gives AR's tokens, and the parser splits the
    answer into that reasoning and a match. Without them the constraint holds from the
    first token."""
    from treeflash.server.answers import MessageStream
    pattern = r"# [a-z] = [0-9]"
    for prompt, (thought, content) in REASONING_PROMPTS.items():
        params = SamplingParams(max_new_tokens=40, structured_outputs=StructuredOutputs(regex=pattern,
                                                                                          reasoning=parser))
        outs = {m: e.generate(prompt, params)[0] for m, e in engines.items()}
        assert outs["dflash"].token_ids == outs["ddtree"].token_ids == outs["ar"].token_ids
        out = outs["ar"]
        reasoning, text, _ = MessageStream(parser).push(out.text, final=True)
        assert (out.finish_reason, reasoning, text) == ("stop", thought, content), out.text
        free = engines["ar"].generate(prompt, SamplingParams(max_new_tokens=40))[0].text
        assert not re.fullmatch(pattern, MessageStream(parser).push(free, final=True)[1]), "the constraint did nothing"
        plain = engines["ar"].generate(prompt, SamplingParams(max_new_tokens=40, structured_outputs=StructuredOutputs(
            regex=pattern)))[0]
        assert re.fullmatch(pattern, plain.text), plain.text
    with pytest.raises(UsageError, match="reasoning must be one of qwen3, deepseek_r1"):
        StructuredOutputs(regex="a", reasoning="o1").validate()


def test_the_server_constrains_chat_after_the_reasoning(engines):
    """A server with --reasoning-parser: a chat answer reasons, then its content is
    what the constraint asks for (whole and streamed); completions, and answers whose
    prompt closed the reasoning, are constrained from the first token."""
    TestClient = pytest.importorskip("starlette.testclient").TestClient

    from treeflash.chat import ChatTemplate
    from treeflash.server.app import build_app
    prompt, (thought, content) = next(iter(REASONING_PROMPTS.items()))
    app = build_app(engines["ddtree"], "m", ChatTemplate("{{ messages[0].content }}"), reasoning_parser="deepseek_r1")
    client = TestClient(app)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 40, "temperature": 0,
            "guided_regex": r"# [a-z] = [0-9]"}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thought, content)
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == thought
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0,
                                             "guided_regex": r"# [a-z] = [0-9]"})
    assert re.fullmatch(r"# [a-z] = [0-9]", r.json()["choices"][0]["text"]), r.text
    # a prompt that closed the reasoning block itself (Qwen3 with enable_thinking false):
    # the answer is content, constrained from its first token, with either parser
    for parser in ("deepseek_r1", "qwen3"):
        closed = ChatTemplate("{{ messages[0].content }}<think>\n\n</think>\n\n")
        client = TestClient(build_app(engines["ddtree"], "m", closed, reasoning_parser=parser))
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert message["reasoning_content"] is None and re.fullmatch(r"# [a-z] = [0-9]", message["content"]), message


def test_a_forced_call_waits_for_the_reasoning_too(engines):
    """tool_choice 'required' on a server with a reasoning parser: the JSON list of calls
    is constrained after the reasoning, unless the prompt closed it."""
    from treeflash.chat import ChatTemplate
    from treeflash.server.protocol import parse_chat
    llm = engines["ar"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "required"}
    for template, reasoned in (("{{ messages[0].content }}", True), ("{{ messages[0].content }}</think>\n", False)):
        req = parse_chat(body, "m", ChatTemplate(template), llm.encode, llm.max_model_len, reasoning_parser="qwen3")
        so = req.params.structured_outputs
        assert so.json is not None and so.reasoning == ("qwen3" if reasoned else None) and req.reasoned == reasoned


# --- EBNF grammars ---

ARITHMETIC = """
# an expression; rules may span lines
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor
           (("*" | "/") factor)*
factor ::= [0-9]{1,3} | "(" expr ")" | 'x'
"""


def _arithmetic(text: str, depth: int) -> bool:
    """Whether `text` is an ARITHMETIC expression with at most depth - 1 nested parentheses."""
    pos, deepest, level = 0, 0, 0

    def operands(ops: str, operand):  # operand (op operand)*
        nonlocal pos
        operand()
        while pos < len(text) and text[pos] in ops:
            pos += 1
            operand()

    def expr():
        operands("+-", lambda: operands("*/", factor))

    def factor():
        nonlocal pos, deepest, level
        m = re.match(r"[0-9]{1,3}|x", text[pos:])
        if m:
            pos += m.end()
        elif text[pos:pos + 1] == "(":
            pos, level = pos + 1, level + 1
            deepest = max(deepest, level)
            expr()
            if text[pos:pos + 1] != ")":
                raise ValueError
            pos, level = pos + 1, level - 1
        else:
            raise ValueError
    try:
        expr()
    except (ValueError, IndexError):
        return False
    return pos == len(text) and deepest < depth


def test_a_grammar_matches_what_it_derives_up_to_its_depth():
    """GBNF rules (comments, rules over several lines, 'single' and "double" quotes,
    classes, {m,n}) whose recursion is unrolled: an expression nests parentheses
    MAX_DEPTH - 1 deep at most (the outer expression counts), every such text matches."""
    from treeflash.structured.ebnf import MAX_DEPTH, grammar_regex
    dfa = StructuredOutputs(grammar=ARITHMETIC).validate().automaton()
    assert dfa.num_states < 40  # nesting is counted in states: the unrolled copies minimise away
    rng = random.Random(7)
    samples = ["".join(rng.choice("0123x+-*/()") for _ in range(rng.randint(1, 14))) for _ in range(20000)]
    samples += ["(" * k + "1" + ")" * k for k in range(6)] + ["1000", "12*(3+x)/4", "((1)+(2))"]
    hits = 0
    for t in samples:
        assert dfa.matches(t.encode()) == _arithmetic(t, MAX_DEPTH), t
        hits += dfa.matches(t.encode())
    assert hits > 200
    assert dfa.matches(b"(((1)))") and not dfa.matches(b"((((1))))")
    assert compile_regex(grammar_regex(ARITHMETIC, 1)).matches(b"1+2") and \
        not compile_regex(grammar_regex(ARITHMETIC, 1)).matches(b"(1)")
    other = StructuredOutputs(grammar='root ::= "a" [^a-c\\n]+ . ("b"? "\\x41"){2}').validate().automaton()
    assert other.matches("adé\nAbA".encode()) and not other.matches(b"aaxAA")


JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
"""


def test_a_grammar_too_large_to_unroll_deep_unrolls_less_deep():
    """llama.cpp's JSON grammar: 4 levels would pass the automaton's limits, so it is
    unrolled 3 deep (values nest 3 deep), never refused for it."""
    dfa = StructuredOutputs(grammar=JSON_GBNF).validate().automaton()
    for text, ok in (('{"a": [1, {"b": null}]}', True), ("{}", True), ('{"a": [[1]]}', True),
                     ('{"a": [[[1]]]}', False), ('{"a":1,}', False)):
        assert dfa.matches(text.encode()) == ok, text


_EXPR = {"oneOf": [{"$ref": "#/$defs/Num"}, {"$ref": "#/$defs/Bin"}, {"$ref": "#/$defs/Neg"}]}  # pydantic's form
EXPRESSION_SCHEMA = {"$defs": {
    "Num": {"type": "object", "properties": {"kind": {"const": "num"}, "value": {"type": "number"}}, "required": ["kind", "value"]},
    "Bin": {"type": "object", "properties": {"kind": {"const": "bin"}, "op": {"enum": ["+", "-", "*", "/"]},
                                             "left": _EXPR, "right": _EXPR}, "required": ["kind", "op", "left", "right"]},
    "Neg": {"type": "object", "properties": {"kind": {"const": "neg"}, "arg": _EXPR}, "required": ["kind", "arg"]}},
    **_EXPR}


def test_a_recursive_schema_too_large_to_unroll_deep_unrolls_less_deep(monkeypatch):
    """An expression tree of three recursive kinds passes the automaton's limits unrolled 3
    deep: it is unrolled 2 deep, never refused for it; a schema without recursion that is
    too large is refused after one attempt."""
    from treeflash.structured import regex
    calls = []
    real = regex.compile_regex
    monkeypatch.setattr(regex, "compile_regex", lambda *a: calls.append(1) or real(*a))
    dfa = StructuredOutputs(json=EXPRESSION_SCHEMA).validate().automaton()
    assert len(calls) == 2
    num = {"kind": "num", "value": 1}
    two = {"kind": "bin", "op": "+", "left": {"kind": "neg", "arg": {"kind": "neg", "arg": num}}, "right": num}
    assert dfa.matches(json.dumps(two).encode())
    assert not dfa.matches(json.dumps({"kind": "neg", "arg": {"kind": "neg", "arg": {"kind": "neg", "arg": num}}}).encode())
    calls.clear()
    with pytest.raises(UsageError, match="the JSON schema is too complex"):
        StructuredOutputs(json={"type": "string", "maxLength": 900}).validate().automaton()
    assert len(calls) == 1


def test_a_recursive_schema_whose_regex_is_too_long_unrolls_less_deep():
    """A tree node of four optional strings and two optional children makes a regex past
    the schema compiler's own limit unrolled 3 deep, not only past the automaton's: it
    is unrolled 2 deep too (it was refused)."""
    node = {"type": "object", "properties": {**{f"s{i}": {"type": "string"} for i in range(4)},
                                             "left": {"$ref": "#/$defs/N"}, "right": {"$ref": "#/$defs/N"}}}
    dfa = StructuredOutputs(json={"$defs": {"N": node}, "$ref": "#/$defs/N"}).validate().automaton()
    assert dfa.matches(b'{"left": {"s0": "a"}, "right": {}}')
    assert not dfa.matches(b'{"left": {"right": {"left": {}}}}')


def test_every_method_gives_ar_tokens_under_a_recursive_schema(engines):
    """pydantic's tree (children: list[Tree]) below a root that must have children: every
    method gives AR's tokens, and a finished answer nests Trees, at most three deep."""
    tree = {"type": "object", "required": ["value"], "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Tree"}, "default": []}}}
    root = {"$defs": {"Tree": tree}, "type": "object", "required": ["children"],
            "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/Tree"}, "minItems": 1}}}
    params = [SamplingParams(max_new_tokens=96, structured_outputs=StructuredOutputs(json=root), temperature=t, seed=s)
              for t, s in ((0.0, 0), (1.0, 1), (1.0, 2), (1.0, 3))]
    outs = {m: e.generate(["{"] * len(params), params) for m, e in engines.items()}
    for m in ("dflash", "ddtree"):
        assert [o.token_ids for o in outs[m]] == [o.token_ids for o in outs["ar"]], m

    def depth(value) -> int:  # Trees inside one another
        return max((1 + depth(child) for child in value.get("children", [])), default=0)
    finished = [json.loads(o.text) for o in outs["ar"] if o.finish_reason == "stop"]
    assert finished and all(1 <= depth(v) <= 3 for v in finished), finished


def test_a_grammar_without_recursion_compiles_once_and_its_rules_once():
    """Unrolling depth changes nothing without recursion: one attempt (four took 18 s to
    refuse root ::= [^\\n]{1000}); and a rule used many times is written once (100 uses
    of a rule doubling 16 times took 54 s to refuse)."""
    import time

    from treeflash.structured import ebnf, regex
    from treeflash.structured.regex import TooComplex
    calls = []
    real = regex.compile_regex
    regex.compile_regex = lambda *a: calls.append(1) or real(*a)
    try:
        with pytest.raises(TooComplex):
            StructuredOutputs(grammar='root ::= [ab]* "a" [ab]{16}').validate().automaton()
        assert len(calls) == 1
        calls.clear()
        # recursive: unrolled less deep on each attempt, down to no recursion (the text "x")
        dfa = StructuredOutputs(grammar='root ::= "(" root ")" [ab]* "a" [ab]{16} | "x"').validate().automaton()
        assert len(calls) == ebnf.MAX_DEPTH and dfa.matches(b"x") and not dfa.matches(b"(x)" + b"a" * 17)
    finally:
        regex.compile_regex = real
    doubling = "".join(f"r{i} ::= r{i + 1} r{i + 1}\n" for i in range(16)) + 'r16 ::= "a"'
    start = time.perf_counter()
    with pytest.raises(TooComplex, match="too large once its recursion is unrolled"):
        StructuredOutputs(grammar="root ::= " + " | ".join(["r0"] * 100) + "\n" + doubling).validate().automaton()
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("grammar,message", [
    ('expr ::= "a"', "no `root` rule"),
    ("root ::= x", "'x', which no rule defines"),
    ('start: "a"', "Lark"),
    ('?start: value\nvalue: "a"', "Lark"),  # Lark's usual openings: an inlined rule, a priority, an import, a comment
    ('start.2: "a"', "Lark"),
    ("%import common.WS\nstart: WS", "Lark"),
    ('// a Lark grammar\nstart: "a"', "Lark"),
    ('root ::= "a', "missing closing"),
    ("root ::= []", "empty character class"),
    ('root ::= "b" | [z-a]', "class range out of order"),
    ('root ::= "\\udc00"', "\\udc00 is not a character"),  # a surrogate: said in the grammar's terms
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "a"\nroot ::= "b"', "defined twice"),
    ('root ::= "a" | (', "missing ')'"),
    ('root ::= "a"{3,1}', "n < m"),
    ("", "non-empty string"),
    ('root ::= "a" "b" {2000}', "above 1000"),
    ('root ::= "a"{' + "9" * 5000 + "}", "above 1000"),  # int() refused 5000 digits: "set_int_max_str_digits"
    ("root ::= root", "matches no text"),
    # a chain of rules deeper than Python's stack (no recursion): refused, not a RecursionError
    ("root ::= r0\n" + "".join(f'r{i} ::= r{i + 1} "x"\n' for i in range(3000)) + 'r3000 ::= "y"', "nests too deeply"),
])
def test_bad_grammars_are_refused_in_one_line(grammar, message):
    with pytest.raises(UsageError, match=re.escape(message)) as e:
        StructuredOutputs(grammar=grammar).validate().automaton()
    assert "\n" not in str(e.value)


def test_every_method_gives_ar_tokens_under_a_grammar(engines):
    """Greedy and sampled: DFlash and DDTree give AR's tokens, and the text is one the
    grammar derives (or, cut by max_new_tokens, the start of one)."""
    so = StructuredOutputs(grammar=ARITHMETIC)
    dfa = so.automaton()
    params = [SamplingParams(max_new_tokens=30, structured_outputs=so, temperature=t, seed=3) for t in (0.0, 1.0)]
    outs = {m: e.generate(["x = ", "def f(a):\n    return "], params * 1) for m, e in engines.items()}
    for m in ("dflash", "ddtree"):
        assert [o.token_ids for o in outs[m]] == [o.token_ids for o in outs["ar"]], m
    for o in outs["ar"]:
        if o.finish_reason == "stop":
            assert dfa.matches(o.text.encode()), o.text
        state = 0
        for byte in o.text.encode():
            state = int(dfa.trans[state, byte])
            assert state >= 0, o.text


def test_the_server_and_command_line_take_grammars(engines, capsys, tmp_path):
    TestClient = pytest.importorskip("starlette.testclient").TestClient

    from treeflash.cli import main
    from treeflash.server.app import build_app
    client = TestClient(build_app(engines["ar"], "m"))
    for extra in ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, {"guided_grammar": 'root ::= "yes" | "no"'}):
        r = client.post("/v1/completions", json={"prompt": "ok? ", "max_tokens": 5, **extra})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
    (tmp_path / "g.gbnf").write_text('root ::= "pass" | "return x"\n')
    for given in (str(tmp_path / "g.gbnf"), 'root ::= "pass" | "return x"'):
        assert main(["generate", "def f(x):", "--device", "cpu", "--grammar", given, "--max-new-tokens", "10"]) == 0
        assert capsys.readouterr().out.strip() in ("pass", "return x")


def test_a_failed_compile_leaves_no_request_waiting(engines, monkeypatch):
    """A compile that fails in an unexpected way raises in the request that compiled and
    leaves nothing pending: the next request of that constraint compiles again (and
    fails the same), instead of waiting for good."""
    import treeflash.structured.cache as cache_module
    llm = engines["ar"]
    calls = []

    def broken(*args):
        calls.append(1)
        raise KeyError("boom")
    monkeypatch.setattr(cache_module, "token_automaton", broken)
    p = SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]{5}"))
    for _ in range(2):
        with pytest.raises(KeyError):
            llm.rules.automaton(p)
    assert len(calls) == 2 and not llm.rules.automata.compiling


def test_a_refused_constraint_is_refused_at_once_when_asked_again(engines, monkeypatch):
    """A constraint whose compile took seconds to refuse (a table past its limit) is not
    compiled again by every retry: the same one-line error comes back at once. An error
    that is not the input's fault (KeyError above, memory) is not remembered."""
    import treeflash.structured.cache as cache_module
    llm = engines["ar"]
    calls, plain = [], cache_module.token_automaton

    def counted(dfa, vocab, max_bytes):
        calls.append(1)
        return plain(dfa, vocab, 1000)  # a small table limit: [0-9]{6} is over it
    monkeypatch.setattr(cache_module, "token_automaton", counted)
    p = SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]{6}"))
    errors = []
    for _ in range(3):
        with pytest.raises(UsageError) as e:
            llm.rules.automaton(p)
        errors.append((str(e.value), e.value.param))
    assert len(calls) == 1 and errors[0] == errors[1] == errors[2] and "structured output" in errors[0][0]
    assert not llm.rules.automata.compiling
    monkeypatch.setattr(cache_module, "token_automaton", plain)  # an engine's own limit: compiles
    assert llm.rules.automaton(SamplingParams(structured_outputs=StructuredOutputs(regex="[0-9]{7}"))) is not None
    llm.rules.automata.refused.clear()  # the shared engine forgets this test's small limit


def test_a_schema_is_cached_as_itself(engines):
    """A property named 1 (refused: names are strings) and one named "1" are two schemas:
    neither's answer, remembered, is given to the other, in either order."""
    llm = engines["ar"]
    bad, good = ({"type": "object", "properties": {name: {"type": "null"}}, "required": ["1"]} for name in (1, "1"))
    for first, second in ((bad, good), (good, bad)):
        llm.rules.automata.kept.clear()
        llm.rules.automata.refused.clear()
        for schema in (first, second):
            p = SamplingParams(max_new_tokens=12, structured_outputs=StructuredOutputs(json=schema))
            if schema is bad:
                with pytest.raises(UsageError, match="must be named by strings"):
                    llm.rules.automaton(p)
            else:
                assert json.loads(llm.generate("x = ", p)[0].text) == {"1": None}
    llm.rules.automata.refused.clear()


def test_an_automaton_in_use_by_one_engine_is_kept_when_another_compiles(engines, monkeypatch):
    """Engines made by `with_method` share the compiled constraints, and what a batch of
    one of them generates with stays compiled while the other compiles new ones past the
    cache's limit (it was dropped: only the compiling engine's own batch was kept)."""
    import treeflash.structured.cache as cache_module
    monkeypatch.setattr(cache_module, "AUTOMATA_KEPT", 1)
    llm = engines["ddtree"]
    other = llm.with_method("dflash")
    assert other.rules.automata is llm.rules.automata
    used = StructuredOutputs(regex="[0-9]{2}[a-c]{3}")
    seen = []

    def meanwhile(i, new):  # while `other` generates: `llm` compiles two others (a server's other requests)
        for regex in (f"x{len(seen)}[0-9]", f"y{len(seen)}[0-9]"):
            llm.rules.automaton(SamplingParams(structured_outputs=StructuredOutputs(regex=regex)))
        seen.append(used.key() in llm.rules.automata.kept)
    out = other.generate("a = ", SamplingParams(max_new_tokens=8, structured_outputs=used), on_tokens=meanwhile)[0]
    assert re.fullmatch("[0-9]{2}[a-c]{3}", out.text) and seen and all(seen)
    llm.rules.automaton(SamplingParams(structured_outputs=StructuredOutputs(regex="z[0-9]")))
    assert used.key() not in llm.rules.automata.kept  # unpinned after the batch: dropped as the limit says


# ----------------------------------------------------------------------------- grammar and choice escapes (cases a mutation review found untested)

def _grammar_automaton(g):
    from treeflash.structured.grammar import StructuredOutputs
    return StructuredOutputs(grammar=g).validate().automaton()


def test_a_dash_before_the_closing_bracket_is_a_dash():
    dfa = _grammar_automaton("root ::= [a-z_-]+ [+-]")
    assert dfa.matches(b"ab-c_+") and dfa.matches(b"x-") and not dfa.matches(b"x*")


def test_m_repeats_exactly_m_times():
    dfa = _grammar_automaton('root ::= [0-9]{3} ("ab"){2}')
    assert dfa.matches(b"123abab") and not dfa.matches(b"1234abab") and not dfa.matches(b"123ababab")


def test_plus_repeats_at_least_once_and_star_may_be_empty():
    """GBNF's `+` needs one item at least, `*` and `?` none."""
    dfa = _grammar_automaton('root ::= [0-9]+ "x"* "y"?')
    assert dfa.matches(b"1") and dfa.matches(b"12xxy") and not dfa.matches(b"") and not dfa.matches(b"xy")


def test_grammar_escapes_are_the_characters_they_name():
    """In literals and classes, \\t \\r \\n \\\\ \\" \\xHH \\uHHHH are those characters (a TSV line's tab)."""
    dfa = _grammar_automaton('root ::= "a\\tb\\r\\n\\\\\\"\\x41\\u00e9" [\\t]')
    assert dfa.matches('a\tb\r\n\\"Aé\t'.encode())
    assert not dfa.matches('atbrn\\"Aét'.encode()) and not dfa.matches(b'a\\tb\\r\\n\\\\\\"\\x41\\u00e9\\t')


def test_choices_are_matched_literally_through_structured_outputs():
    from treeflash.structured.grammar import StructuredOutputs
    dfa = StructuredOutputs(choice=["a.b", "1+1", "(x)", "[y]"]).validate().automaton()
    for c in ("a.b", "1+1", "(x)", "[y]"):
        assert dfa.matches(c.encode()), c
    for other in ("aXb", "11", "x", "y"):
        assert not dfa.matches(other.encode()), other


# ----------------------------------------------------------------------------- the compiled-constraint cache (cases a mutation review found untested)

def _fresh_cache(llm):
    """An empty cache of `llm`'s vocabulary (the shared engines' cache holds other tests' constraints)."""
    from treeflash.structured.cache import AutomatonCache
    return AutomatonCache(llm.tokenizer, llm.config.vocab_size)


def test_the_cache_drops_the_least_recently_used_constraint(engines, monkeypatch):
    """Past AUTOMATA_KEPT the constraint asked for longest ago goes, not the one compiled
    first: one that every request uses stays compiled; the limit itself is kept."""
    import treeflash.structured.cache as cache_module
    monkeypatch.setattr(cache_module, "AUTOMATA_KEPT", 2)
    cache = _fresh_cache(engines["ar"])
    a, b, c = (StructuredOutputs(regex=r) for r in ("[0-9]", "[a-c]", "x[0-9]"))
    first = cache.get(a)
    cache.get(b)
    assert list(cache.kept) == [a.key(), b.key()]  # two, as the limit allows
    assert cache.get(a) is first  # asked again: now the most recent
    cache.get(c)
    assert list(cache.kept) == [a.key(), c.key()] and cache.get(a) is first


def test_the_cache_keeps_its_tables_within_its_byte_limit(engines, monkeypatch):
    import treeflash.structured.cache as cache_module
    monkeypatch.setattr(cache_module, "AUTOMATA_BYTES", 1)  # any two tables are past it: the newest stays
    cache = _fresh_cache(engines["ar"])
    for regex in ("[0-9]", "[a-c]", "x[0-9]"):
        cache.get(StructuredOutputs(regex=regex))
    assert list(cache.kept) == [StructuredOutputs(regex="x[0-9]").key()]


def test_tables_that_fill_the_byte_limit_exactly_are_kept(engines, monkeypatch):
    """The byte limit is inclusive: constraints whose tables add up to exactly
    AUTOMATA_BYTES are all kept (none compiled again when asked for)."""
    import treeflash.structured.cache as cache_module
    a, b = StructuredOutputs(regex="x[0-9]"), StructuredOutputs(regex="y[0-9]{2}")
    sizes = _fresh_cache(engines["ar"])
    monkeypatch.setattr(cache_module, "AUTOMATA_BYTES", sizes.get(a).nbytes + sizes.get(b).nbytes)
    cache = _fresh_cache(engines["ar"])
    first = cache.get(a)
    cache.get(b)
    assert list(cache.kept) == [a.key(), b.key()] and cache.get(a) is first


def test_a_constraint_compiled_while_the_others_are_in_use_is_kept(engines, monkeypatch):
    """The cache is full of constraints that batches generate with: the one just compiled
    stays too (it was dropped at once, so every request compiled it again)."""
    import treeflash.structured.cache as cache_module
    monkeypatch.setattr(cache_module, "AUTOMATA_KEPT", 1)
    cache = _fresh_cache(engines["ar"])
    used, new = StructuredOutputs(regex="[0-9]{2}"), StructuredOutputs(regex="[a-c]{2}")
    with cache.pinned([used]):
        cache.get(used)
        made = cache.get(new)
        assert list(cache.kept) == [used.key(), new.key()] and cache.get(new) is made


def test_a_failed_compile_fails_every_request_waiting_for_it(engines, monkeypatch):
    """Requests that wait for another's compile of their constraint get its error when it
    fails (they waited for good), and the error is the one-line refusal."""
    import threading
    import time

    import treeflash.structured.cache as cache_module
    cache = _fresh_cache(engines["ar"])

    def failing(*args):
        time.sleep(1.0)
        raise UsageError("the structured output's token table is too large", param="structured_outputs")
    monkeypatch.setattr(cache_module, "token_automaton", failing)
    so, errors = StructuredOutputs(regex="[0-9]{3}"), []

    def ask():
        try:
            cache.get(so)
        except UsageError as e:
            errors.append(str(e))
    threads = [threading.Thread(target=ask, daemon=True) for _ in range(3)]
    threads[0].start()
    time.sleep(0.3)  # the others come while it compiles
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a request still waits for the failed compile"
    assert errors == ["the structured output's token table is too large"] * 3 and not cache.compiling


@pytest.mark.parametrize("error", [RecursionError("maximum recursion depth exceeded"), ValueError("bad state")])
def test_a_compile_that_crashes_on_the_input_is_refused_in_one_line(engines, monkeypatch, error):
    """An input that drives the compiler too deep (RecursionError) or into a ValueError is
    the input's fault: a one-line UsageError on structured_outputs, remembered."""
    import treeflash.structured.cache as cache_module
    cache = _fresh_cache(engines["ar"])

    def crash(*args):
        raise error
    monkeypatch.setattr(cache_module, "token_automaton", crash)
    so = StructuredOutputs(regex="[0-9]{4}")
    with pytest.raises(UsageError, match=f"cannot be compiled: {type(error).__name__}") as err:
        cache.get(so)
    assert err.value.param == "structured_outputs" and so.key() in cache.refused


def test_a_refusal_is_said_in_its_own_words(engines):
    """The compiler's one-line refusal reaches the user as it is, not wrapped in 'cannot be
    compiled: UsageError: ...'."""
    cache = _fresh_cache(engines["ar"])
    with pytest.raises(UsageError) as err:
        cache.get(StructuredOutputs(regex="[ab]*a[ab]{16}"))  # 2^17 states
    assert "too complex" in str(err.value) and "UsageError" not in str(err.value)
    assert "cannot be compiled" not in str(err.value)


def test_a_table_over_the_byte_limit_is_refused(engines, monkeypatch):
    """MAX_AUTOMATON_BYTES bounds one constraint's token table (states x vocabulary x 4
    bytes): a table of exactly that size compiles, a larger one is refused as too complex
    (before it takes the memory)."""
    import treeflash.structured.cache as cache_module
    llm = engines["ar"]
    so = StructuredOutputs(regex="[0-9]{3}")
    need = so.automaton().num_states * llm.config.vocab_size * 4
    monkeypatch.setattr(cache_module, "MAX_AUTOMATON_BYTES", need)
    assert _fresh_cache(llm).get(so).next.shape[1] == llm.config.vocab_size
    monkeypatch.setattr(cache_module, "MAX_AUTOMATON_BYTES", need - 1)
    with pytest.raises(UsageError, match="too complex"):
        _fresh_cache(llm).get(so)


def test_remembered_refusals_are_bounded(engines, monkeypatch):
    import treeflash.structured.cache as cache_module
    monkeypatch.setattr(cache_module, "REFUSALS_KEPT", 2)
    cache = _fresh_cache(engines["ar"])
    bad = [StructuredOutputs(regex="(" * (i + 1)) for i in range(3)]
    for so in bad:
        with pytest.raises(UsageError):
            cache.get(so)
    assert list(cache.refused) == [bad[1].key(), bad[2].key()]


def test_a_refusal_asked_for_again_is_remembered_longest(engines, monkeypatch):
    """Past REFUSALS_KEPT the refusal asked for longest ago goes: a bad constraint that a
    client keeps retrying stays refused at once, not compiled again (seconds) each time."""
    import treeflash.structured.cache as cache_module
    monkeypatch.setattr(cache_module, "REFUSALS_KEPT", 2)
    cache = _fresh_cache(engines["ar"])
    a, b, c = (StructuredOutputs(regex="(" * (i + 1)) for i in range(3))
    for so in (a, b, a, c):
        with pytest.raises(UsageError):
            cache.get(so)
    assert list(cache.refused) == [a.key(), c.key()]


def test_special_tokens_are_never_text(engines):
    """A constraint's text is spelled by ordinary tokens: <|mask|>, <|pad|>, <|endoftext|>
    are not its bytes, whatever the pattern allows."""
    llm = engines["ar"]
    specials = [i for i, t in llm.tokenizer.tok.get_added_tokens_decoder().items() if t.special]
    automaton = _fresh_cache(llm).get(StructuredOutputs(regex=r"[<|>a-z]{1,20}"))
    assert specials and (automaton.next[:, specials] == -1).all()


def test_added_tokens_that_are_not_special_are_text():
    """An added token that is not special (Qwen3's <think> and </think>, <tool_call>) is
    text: a constraint may spell its text with it, as the model writes it, in one token."""
    from treeflash.structured.cache import AutomatonCache
    from treeflash.tokenizer import Tokenizer
    tok = Tokenizer(builtin_paths()[0])
    tok.tok.add_tokens(["</think>"])
    added = tok.tok.token_to_id("</think>")
    automaton = AutomatonCache(tok, tok.vocab_size).get(StructuredOutputs(regex="</think>[a-z]+"))
    assert added not in tok.special_ids and automaton.next[0, added] != -1


def test_ids_a_vocabulary_leaves_unused_are_never_allowed(tmp_path):
    """A vocabulary with unused ids (a WordLevel one's words at 1000+): those ids name no
    text, so no constraint allows them (an empty token would hold a state forever)."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, models, pre_tokenizers

    from treeflash.structured.cache import AutomatonCache
    from treeflash.tokenizer import Tokenizer
    hf = HFTokenizer(models.WordLevel(vocab={"<|endoftext|>": 0, "[UNK]": 1, "a": 2, "b": 1000}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = Tokenizer(tmp_path)
    assert tok.vocab_size == 1001
    automaton = AutomatonCache(tok, 1024).get(StructuredOutputs(regex="[ab]*"))
    allowed = set((automaton.next[0] != -1).nonzero()[0].tolist())
    assert {2, 1000} <= allowed and not allowed & (set(range(3, 1000)) | set(range(1001, 1024)))


def test_a_constrained_chain_is_the_best_one_the_constraint_allows(engines):
    """DFlash's chain under a constraint takes, depth by depth, the best draft token
    that the state after the chain so far allows (exact while those tokens are among the
    drafter's GUIDE_CANDIDATES best): the chain the target can accept."""
    from treeflash.engine.round import GUIDE_CANDIDATES
    llm = engines["dflash"]
    dec, seen = llm.decoder, []
    guided = dec.guided_draft

    def recorded(logits, sb):
        masked = guided(logits, sb)
        seen.append((logits.clone(), masked.argmax(-1), sb.grammar_state.clone(), sb.grammar))
        return masked

    dec.guided_draft = recorded
    try:
        params = [SamplingParams(max_new_tokens=30, structured_outputs=so) for so in CONSTRAINTS]
        llm.generate(["def add(a, b):\n"] * len(params), params)
    finally:
        del dec.guided_draft
    checked = 0
    for logits, chain, state, table in seen:
        best = logits.topk(GUIDE_CANDIDATES, dim=-1).indices
        for b in range(len(chain)):
            s = int(state[b])
            for d in range(logits.shape[1]):
                allowed = table[s, :logits.shape[-1]] >= 0
                if not allowed.any():
                    break
                want = int(logits[b, d].masked_fill(~allowed, float("-inf")).argmax())
                if want not in best[b, d]:
                    break  # past the candidates: the guide is no longer exact
                assert int(chain[b, d]) == want
                s, checked = int(table[s, want]), checked + 1
    assert checked > 100


# ----------------------------------------------------------------------------- cases a second mutation review found untested

def test_characters_where_utf8_grows_a_byte_match_as_in_python_re():
    """The last and first characters of each UTF-8 length (U+007F/0080, U+07FF/0800,
    U+FFFF/10000) and the last two code points, alone, as the ends of a class and of a
    negated class: each automaton accepts exactly what Python's re full-matches."""
    ends = [0x7F, 0x80, 0x7FF, 0x800, 0xFFFF, 0x10000, 0x10FFFE, 0x10FFFF]
    samples = [chr(c + d) for c in ends for d in (-1, 0, 1) if c + d <= 0x10FFFF]
    patterns = [f"\\U{c:08x}" for c in ends]
    for lo, hi in itertools.combinations_with_replacement(ends, 2):
        patterns += [f"[\\U{lo:08x}-\\U{hi:08x}]", f"[^\\U{lo:08x}-\\U{hi:08x}]"]
    for pattern in patterns:
        dfa = compile_regex(pattern)
        for s in samples:
            assert dfa.matches(s.encode()) == bool(re.fullmatch(pattern, s)), (pattern, hex(ord(s)))
    assert compile_regex("[^\\x00-\\U0010fffe]").matches("\U0010ffff".encode())


def test_class_escapes_and_ranges_read_as_python_re_reads_them():
    """[\\b] is the backspace (outside a class \\b is a boundary, refused); [a-a] is the one
    character; the last code point \\U0010FFFF is a character; a bound written with leading
    zeros is its value."""
    for pattern, good, bad in [(r"[\b]x", ["\bx"], ["bx", "x"]), ("[a-a]b", ["ab"], ["b", "aab"]),
                               (r"\U0010ffff|[\U0010fffe-\U0010ffff]", ["\U0010ffff", "\U0010fffe"], ["\uffff"]),
                               ("a{000002}b{0,000001}", ["aa", "aab"], ["a", "aabb"])]:
        dfa = compile_regex(pattern)
        for s in good + bad:
            assert dfa.matches(s.encode()) == (s in good) == bool(re.fullmatch(pattern, s)), (pattern, s)


@pytest.mark.parametrize("pattern,reason", [
    ("[a-", "missing '\\]'"), ("[a-\\", "trailing backslash"),
    (r"[\w-z]", "single characters at both ends"), (r"[a-\d]", "single characters at both ends"),
])
def test_bad_classes_are_refused_in_one_line(pattern, reason):
    """A class cut off after its dash, and a range from or to a class escape (Python's re
    calls it a bad range too), are refused with the reason, not a crash or a guessed range."""
    with pytest.raises(UsageError, match=reason) as err:
        compile_regex(pattern)
    assert "\n" not in str(err.value)


def test_braces_in_a_choice_are_text():
    """A choice is matched literally, braces included: "a{2}" is not "aa", nor "b{,}" any b's."""
    choices = ["a{2}", "b{,}", "{x}", "c{1,3}d"]
    dfa = StructuredOutputs(choice=choices).validate().automaton()
    for c in choices:
        assert dfa.matches(c.encode()), c
    for other in ("aa", "b", "bbb", "x", "cd", "ccd"):
        assert not dfa.matches(other.encode()), other


def test_any_white_space_lstrip_drops_may_follow_the_reasoning():
    """After the closing tag, each character str.lstrip drops (str.isspace: the ASCII
    separators U+001C-U+001F and U+0085 too) may come before the constrained text, and no other."""
    dfa = compile_regex("0", REASONING_TAGS["deepseek_r1"])
    for code in [*range(0x3001), 0xFEFF, 0x10FFFF]:
        c = chr(code)
        if code not in range(0xD800, 0xE000):
            assert dfa.matches(f"x</think>{c}0".encode()) == c.isspace(), hex(code)


def test_a_table_built_a_block_of_states_at_a_time():
    """A vocabulary wide enough that the token table is walked, and its edges sorted, a
    block of states at a time (as a real model's always is): every entry is still the byte
    automaton's step, in the first block, the last and across the seams."""
    vocab = [b"a", b"b", b"c"] * 2730
    dfa = compile_regex("[ab]{0,520}c")
    assert dfa.num_states * len(vocab) > 1 << 22  # over one block of the builder and of `edges` (4M entries)
    auto = token_automaton(dfa, vocab)
    np.testing.assert_array_equal(auto.next, dfa.trans[:, [t[0] for t in vocab]])
    assert auto.accepting.tolist() == dfa.accepting.tolist()


def test_a_regex_of_exactly_the_size_limit_is_taken():
    """The input limits are inclusive: a regex, grammar or choice of exactly that many
    characters is taken (only a longer one is refused)."""
    from treeflash.structured.grammar import MAX_INPUT_CHARS
    SamplingParams(structured_outputs=StructuredOutputs(regex="a" * MAX_INPUT_CHARS["regex"]))
    body = "a" * (MAX_INPUT_CHARS["grammar"] - len('root ::= ""'))
    SamplingParams(structured_outputs=StructuredOutputs(grammar=f'root ::= "{body}"'))
    SamplingParams(structured_outputs=StructuredOutputs(choice=["ab"] * (MAX_INPUT_CHARS["choice"] // 2)))


@pytest.mark.parametrize("grammar,good,bad", [
    ('root ::= "a" # a comment on the last line, no newline after it', ["a"], ["", "aa"]),
    ('root ::= [0-9]{ 2 , 3 }', ["12", "123"], ["1", "1234"]),  # llama.cpp allows spaces inside the braces
    ('root ::= [^\\]]+ "]"', ["ab]", "[x]"], ["a]]", "]"]),  # \\] in a class
    ("root ::= 'it\\'s'", ["it's"], ["its"]),  # \\' in a single-quoted literal
    ('root ::= [a-a] "\\U0010ffff"', ["a\U0010ffff"], ["b\U0010ffff"]),  # a one-character range; the last code point
])
def test_grammar_syntax_llama_cpp_takes(grammar, good, bad):
    """GBNF as llama.cpp writes it: a final comment, spaced bounds, escaped brackets and quotes."""
    dfa = _grammar_automaton(grammar)
    for text in good:
        assert dfa.matches(text.encode()), (grammar, text)
    for text in bad:
        assert not dfa.matches(text.encode()), (grammar, text)


@pytest.mark.parametrize("grammar,message", [
    ('root ::= ("a" | z)+', "rule 'root' uses 'z', which no rule defines"),  # used only under a quantifier
    ('root ::= "a\nb"', "missing closing \" (line 1)"),  # a literal does not run past its line
])
def test_grammar_mistakes_under_quantifiers_and_across_lines_are_refused(grammar, message):
    """An undefined rule used only under a quantifier, and a literal left open at the end of
    its line, are one-line errors that say where."""
    with pytest.raises(UsageError, match=re.escape(message)) as e:
        StructuredOutputs(grammar=grammar).validate().automaton()
    assert "\n" not in str(e.value)
