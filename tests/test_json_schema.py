"""JSON Schema to regex (`treeflash.structured.json_schema`), for structured outputs.

What a client relies on: every JSON text a supported schema accepts, written compactly
or with a space after `:` and `,`, matches the regex, and texts the schema rejects do
not; the regex stays in the dialect the DFA compiler reads; a keyword that constrains
values and is not supported is refused, naming the keyword and where it is.
"""
from __future__ import annotations

import itertools
import json
import math
import random
import re

import pytest

from treeflash.errors import UsageError
from treeflash.structured.grammar import StructuredOutputs
from treeflash.structured.json_schema import MAX_REGEX_CHARS, json_object_regex, schema_regex


def in_dialect(regex: str) -> None:
    """Fails on what the DFA compiler's dialect lacks: anchors, lookarounds, named groups,
    flags, backreferences, lazy quantifiers."""
    i, after_quantifier = 0, False
    while i < len(regex):
        c, quantifier = regex[i], False
        if c == "\\":
            assert not regex[i + 1].isdigit(), f"backreference at {i} in {regex!r}"
            i += 2
        elif c == "[":  # to its ']', past a leading ^ and a leading literal ]
            i += 1
            i += regex[i] == "^"
            i += regex[i] == "]"
            while regex[i] != "]":
                i += 2 if regex[i] == "\\" else 1
            i += 1
        elif regex.startswith("(?", i):
            assert regex[i + 2] == ":", f"(?{regex[i + 2]} at {i} in {regex!r}"
            i += 3
        else:
            assert c not in "^$", f"anchor at {i} in {regex!r}"
            assert not (c == "?" and after_quantifier), f"lazy quantifier at {i} in {regex!r}"
            quantifier = c in "*+?}"
            i += 1
        after_quantifier = quantifier


@pytest.mark.parametrize("regex, ok", [("a*", True), ("[^]^$]+", True), ("\\^\\$\\??", True), ("(?:a|b){2}", True),
                                       ("^a", False), ("a$", False), ("a*?", False), ("a{2}?", False),
                                       ("(?=a)", False), ("(?P<x>a)", False), ("(a)\\1", False)])
def test_the_dialect_check(regex, ok):
    if ok:
        in_dialect(regex)
    else:
        with pytest.raises(AssertionError):
            in_dialect(regex)


def regex_of(schema) -> str:
    regex = schema_regex(schema)
    in_dialect(regex)
    re.compile(regex)
    return regex


def texts(value) -> list[str]:
    """`value` as JSON, compact and with the optional spaces."""
    return [json.dumps(value, separators=(",", ":"), ensure_ascii=False),
            json.dumps(value, separators=(", ", ": "), ensure_ascii=False)]


def check(schema, good=(), bad=(), bad_texts=()):
    """Values in `good` match in both spacings; values in `bad` and texts in `bad_texts` do not."""
    regex = regex_of(schema)
    for value in good:
        for text in texts(value):
            assert re.fullmatch(regex, text), (text, regex)
    for value in bad:
        for text in texts(value):
            assert not re.fullmatch(regex, text), (text, regex)
    for text in bad_texts:
        assert not re.fullmatch(regex, text), (text, regex)
    return regex


def refused(schema, *words):
    with pytest.raises(UsageError) as info:
        schema_regex(schema)
    message = str(info.value)
    assert message.startswith("json schema: ") and "\n" not in message
    for word in words:
        assert word in message, message
    return message


# --- scalars ---

def test_string():
    check({"type": "string"},
          good=["", "abc", 'say "hi"', "back\\slash", "tab\tnew\nline", "\x00\x1f", "é ü 日本 🎉", "a/b"],
          bad=[1, None, True, ["a"]],
          bad_texts=['"a"b"', '"a\\"', '"\\x41"', '"\\u12"', '"\\u12g4"', '"a\nb"', '"\t"', '"abc', 'abc"',
                     "'abc'", ' "a"', '"a" '])
    regex = regex_of({"type": "string"})
    for text in ['"\\u00e9\\uD83D\\uDE00"', '"\\/\\b\\f\\n\\r\\t\\"\\\\"']:
        assert re.fullmatch(regex, text)
    # a surrogate escape is half a character: only a high and a low one together (strict
    # parsers, serde_json's for one, refuse a lone one)
    for text in ['"\\uD800"', '"\\udc00"', '"\\uD83Dx"', '"\\uDE00\\uD83D"', '"\\uD83D\\uD83D"']:
        assert not re.fullmatch(regex, text), text


def test_string_length_counts_characters_and_escapes_as_one():
    check({"type": "string", "minLength": 2, "maxLength": 3},
          good=["ab", "abc", "\n\n", "日本", '""'], bad=["a", "abcd", "", "\n\n\n\n"],
          bad_texts=['"\\u00e9"'])
    regex = regex_of({"type": "string", "minLength": 2, "maxLength": 3})
    assert re.fullmatch(regex, '"\\u00e9\\u00e9"') and re.fullmatch(regex, '"\\t\\u00e9x"')
    assert not re.fullmatch(regex, '"\\uD83D\\uDE00"')  # a pair is one character (U+1F600)
    assert re.fullmatch(regex_of({"type": "string", "maxLength": 1}), '"\\uD83D\\uDE00"')
    check({"type": "string", "minLength": 1}, good=["a", "a" * 50], bad=[""])
    check({"type": "string", "maxLength": 0}, good=[""], bad=["a"])
    check({"type": "string", "maxLength": 1}, good=["", "x"], bad=["xy"])


@pytest.mark.parametrize("fmt, good, bad", [
    ("date", ["2024-02-29", "1999-12-31", "0001-01-01", "2000-02-29", "2023-04-30", "0400-02-29", "9999-12-31"],
     ["2024-13-01", "2024-1-01", "2024-01-32", "24-01-01", "", "2023-02-29", "1900-02-29", "2024-04-31", "2024-02-30",
      "0000-02-29", "0000-01-01"]),  # year 0: RFC 3339's, not Python's datetime (nor validators built on it)
    ("time", ["23:59:59Z", "00:00:00.123Z", "12:30:00Z", "12:30:00+05:30", "12:30:00.5-08:00"],
     ["24:00:00Z", "12:60:00Z", "12:30", "12:30:00+5:30", "12:30:00 Z", "12:30:00", "12:30:00+24:00",
      "12:30:00-23:60"]),
    ("date-time", ["2024-02-29T12:30:00Z", "2024-02-29T12:30:00.25+01:00"],
     ["2024-02-29 12:30:00", "2024-02-29T12:30", "2024-02-29", "2024-02-29T12:30:00"]),
    ("uuid", ["123e4567-e89b-12d3-a456-426614174000", "123E4567-E89B-12D3-A456-426614174000"],
     ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400", "g23e4567-e89b-12d3-a456-426614174000"]),
])
def test_string_formats(fmt, good, bad):
    check({"type": "string", "format": fmt}, good=good, bad=bad)


def test_times_are_what_python_and_pydantic_read():
    """No leap second: RFC 3339 has 23:59:60, but Python's datetime, Pydantic's datetime and
    time, and jsonschema's date-time check refuse it (a model's :60 failed model_validate_json)."""
    import datetime
    for fmt, prefix in (("time", ""), ("date-time", "2016-12-31T")):
        regex = regex_of({"type": "string", "format": fmt})
        for text in ("23:59:60Z", "12:30:60+01:00", "00:00:60.5Z"):
            assert not re.fullmatch(regex, f'"{prefix}{text}"'), text
        for text in ("23:59:59Z", "00:00:00.5-08:00"):
            assert re.fullmatch(regex, f'"{prefix}{text}"'), text
            datetime.datetime.fromisoformat("2016-12-31T" + text.replace("Z", "+00:00"))


def test_dates_are_the_calendars():
    """A date matches exactly when Python's calendar has that day: every day of 400 years
    (the Gregorian cycle) and the days past each month's end."""
    import datetime
    from treeflash.structured.json_schema import DATE
    day, end = datetime.date(1600, 1, 1), datetime.date(2001, 1, 1)
    while day < end:
        assert re.fullmatch(DATE, day.isoformat())
        day += datetime.timedelta(days=1)
    for y in range(1600, 2001):
        for m in range(1, 13):
            for d in range(28, 32):
                text = f"{y:04d}-{m:02d}-{d:02d}"
                try:
                    datetime.date(y, m, d)
                except ValueError:
                    assert not re.fullmatch(DATE, text), text
    import calendar
    for y in range(0, 10000):  # every year Python's datetime has, and its leap days
        assert bool(re.fullmatch(DATE, f"{y:04d}-01-01")) == (y > 0)
        assert bool(re.fullmatch(DATE, f"{y:04d}-02-29")) == (y > 0 and calendar.isleap(y)), y


def test_string_pattern():
    check({"type": "string", "pattern": "^[a-z]+-\\d{3}$"}, good=["abc-123"], bad=["abc-12", "ABC-123", "abc123"])
    # the same language with lazy quantifiers, which the dialect does not have
    check({"type": "string", "pattern": "^a+?b*?c??$"}, good=["ab", "aaabbbc", "a"], bad=["", "b"])
    # alternation inside a group; escaped metacharacters; braces that are not quantifiers
    check({"type": "string", "pattern": "^(?:cat|dog)s?\\.(x|y){1,2}\\{z}$"},
          good=["cat.x{z}", "dogs.yx{z}"], bad=["cat", "cats.xyz{z}", "bird.x{z}"])
    check({"type": "string", "pattern": "^a{0,2}$"}, good=["", "a", "aa"], bad=["aaa"])
    # ECMA-262, not Python: `.` is no line terminator, and {,n} is text (refused below)
    check({"type": "string", "pattern": "^.$"}, good=["a", "\u0085", "日"], bad=["\u2028", "\u2029"])
    check({"type": "string", "pattern": "^$"}, good=[""], bad=["a"])
    # as JSON Schema reads a pattern: anywhere in the string unless anchored (they were refused)
    check({"type": "string", "pattern": "[0-9]{2}"}, good=["12", "ab12cd", "x 99"], bad=["", "a1b2"])
    check({"type": "string", "pattern": "^ab"}, good=["ab", "abc"], bad=["cab"])
    check({"type": "string", "pattern": "cd$"}, good=["cd", "abcd"], bad=["cde"])
    check({"type": "string", "pattern": "^abc\\$"}, good=["abc$", "abc$x"], bad=["abc"])
    check({"type": "string", "pattern": "cat|dog"}, good=["a dog", "cats"], bad=["cow"])


def test_pattern_never_produces_what_json_must_escape():
    """Wildcards and negated classes leave out quote, backslash and control characters,
    so every text the regex allows is valid JSON whose value matches the pattern."""
    for pattern in ["^.{1,3}$", "^[^@]+@[^@]+$", "^\\D\\W\\S$", "^[ -~]+$", "^[^]a]+$", "^[^a-]+$"]:
        regex = regex_of({"type": "string", "pattern": pattern})
        for text in ['"\\""', '"\\\\"', '"\\n"', '"a"b"', '"\n"', '"\x01"']:
            assert not re.fullmatch(regex, text), (pattern, text)
    check({"type": "string", "pattern": "^[^@]+@[^@]+$"}, good=["me@example.org"], bad=["me@", "a@b@c"])
    check({"type": "string", "pattern": "^[ -~]+$"}, good=["Hello, World!"], bad=["é"])
    # ECMA-262: [^] is any character and [] none (Python would read a ']' there as a member)
    check({"type": "string", "pattern": "^[^]a]+$"}, good=["xa]", "ba]]"], bad=["bcd", "a", "b]"])
    check({"type": "string", "pattern": "^x[]?y$"}, good=["xy"], bad=["x]y", "x"])
    check({"type": "string", "pattern": "^[^a-]+$"}, good=["bcd"], bad=["-", "a"])
    check({"type": "string", "pattern": "^\\w+\\s\\w+$"}, good=["hello world"], bad=["hello\tworld"])
    check({"type": "string", "pattern": "^[\\s\\d]+$"}, good=["1 2"], bad=["1\t2"])
    check({"type": "string", "pattern": "^\\S+$"}, good=["a-b", "日本"], bad=["a\u00a0b", "a\u3000b", "a b"])
    check({"type": "string", "pattern": "^\\s$"}, good=[" ", "\u3000"], bad=["a"])
    check({"type": "string", "pattern": "^\\x41\\u00e9[\\x00-\\x7f]$"}, good=["Aéz"], bad=["Aé\x01", 'Aé"'])


@pytest.mark.parametrize("pattern, words", [
    ("^a|b$", ["alternatives in a group"]),
    ("^a|b", ["alternatives in a group"]),
    ("a|b$", ["alternatives in a group"]),
    ("^(?=a)a$", ["no lookaround or flags"]),
    ("^(?!a)b$", ["no lookaround or flags"]),
    ("^(?<=a)b$", ["no lookaround or flags"]),
    ("^(?i)a$", ["no lookaround or flags"]),
    ("^(a)\\1$", ["backreferences"]),
    ("^\\bword$", ["\\b is not supported"]),
    ("^\\p{L}$", ["\\p is not supported"]),
    ("^a^b$", ["anchors are only allowed"]),
    ("^a$b$", ["anchors are only allowed"]),
    ("^a)(b$", ["unbalanced ')'"]),
    ("^(a$", ["missing ')'"]),
    ("^[ab$", ["missing ']'"]),
    ("^*a$", ["nothing to repeat"]),
    ("^(*a)$", ["nothing to repeat"]),
    ('^say "hi"$', ["not allowed here"]),
    ("^a\\nb$", ["not allowed here"]),
    ("^\\\\$", ["not allowed here"]),
    ("^\\x22$", ["not allowed here"]),
    ("^[\\n\\t]$", ["not allowed here"]),
    ("^[z-a]$", ["out of order"]),
    ("^a{,2}$", ["{,n} is text in a JSON Schema pattern", "write {0,n}"]),
])
def test_pattern_refusals(pattern, words):
    refused({"type": "string", "pattern": pattern}, "'pattern' at $", *words)


def test_a_pattern_is_refused_in_its_own_terms():
    """A pattern that matches anywhere is put inside a larger regex: its mistakes are still
    said of what the client wrote, at its own positions, and a stray ')' or a trailing
    backslash cannot close or escape the group it is put in (`a)(b` was taken as `ab`)."""
    for pattern, words in [("a)(b", ["regex 'a)(b': unbalanced ')' (at character 1)"]),
                           ("x)|(y", ["regex 'x)|(y': unbalanced ')'"]),
                           ("[a-z]+)$", ["regex '[a-z]+)$': unbalanced ')' (at character 6)"]),
                           ("ab\\", ["a trailing backslash"]),
                           ("(?i)abc", ["regex '(?i)abc': only (?: )", "(at character 1)"]),
                           ("\\bfoo\\b", ["regex '\\\\bfoo\\\\b': \\b is not supported", "(at character 2)"])]:
        message = refused({"type": "string", "pattern": pattern}, "'pattern' at $", *words)
        assert "[\\s\\S]" not in message, message


def test_many_optional_properties_compile():
    """An extraction model of 30 optional strings (Pydantic's Optional[str] = None fields)
    compiles, to a DFA with states per member: the alternatives are by the last member
    written, settled at the '}' (by the first one written, 24 were the most)."""
    props = {f"field_{i}": {"type": "string"} for i in range(30)}
    regex = check({"type": "object", "properties": props},
                  good=[{}, {"field_0": "a"}, {"field_29": "z"}, {"field_3": "x", "field_17": "y", "field_29": ""},
                        {name: "v" for name in props}],
                  bad=[{"field_17": "y", "field_3": "x"}, {"other": "x"}],
                  bad_texts=['{"field_0": "a",}', '{, "field_0": "a"}', '{"field_0": "a" "field_1": "b"}'])
    dfa = StructuredOutputs(json={"type": "object", "properties": props}).validate().automaton()
    assert dfa.num_states < 40 * len(props), dfa.num_states
    assert len(regex) < MAX_REGEX_CHARS
    # optional members before and after a required one: one chain
    mixed = {"type": "object", "required": ["b"], "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                                 "c": {"type": "integer"}}}
    check(mixed, good=[{"b": 1}, {"a": 0, "b": 1}, {"b": 1, "c": 2}, {"a": 0, "b": 1, "c": 2}],
          bad=[{}, {"a": 0}, {"a": 0, "c": 2}, {"b": 1, "a": 0}], bad_texts=['{"a":0,}', '{"a":0,,"b":1}'])


def test_openapi_number_formats_and_extension_keys():
    """Tool schemas made from typed code (OpenAPI, FastAPI): an int32 stays in its range,
    an int64 within +-10^18, float and double are any number, and `x-` extension keys are
    annotations; another format is refused, not ignored."""
    check({"type": "integer", "format": "int32"}, good=[0, -2 ** 31, 2 ** 31 - 1], bad=[2 ** 31, -2 ** 31 - 1, 10 ** 12])
    check({"type": "integer", "format": "int32", "minimum": 5, "exclusiveMaximum": 2 ** 40}, good=[5, 2 ** 31 - 1],
          bad=[4, 2 ** 31])
    check({"type": "integer", "format": "int64"}, good=[-10 ** 18, 10 ** 18, 7], bad=[10 ** 18 + 1, 2 ** 63 - 1])
    for fmt in ("float", "double"):
        assert schema_regex({"type": "number", "format": fmt}) == schema_regex({"type": "number"})
    assert schema_regex({"type": "integer", "x-go-type": "int", "x-nullable": False}) == schema_regex({"type": "integer"})
    refused({"type": "integer", "format": "uint8"}, "'format' at $: 'uint8' is not supported with type 'integer'",
            "int32, int64")
    refused({"type": "number", "format": "decimal"}, "'format' at $", "float, double")
    # a string's format beside a number type is the string's, as before numbers had formats
    check({"type": ["integer", "string"], "format": "date"}, good=[7, "2024-02-29"], bad=["x", "2023-02-29"])


def test_integer():
    check({"type": "integer"}, good=[0, 7, -7, 1234567890123456789], bad=[1.5, "1", True, None],
          bad_texts=["01", "-01", "00", "+1", "1.0", "1e3", "", " 1", "1 ", "-"])
    check({"type": "integer", "minimum": 0}, good=[0, 1, 10], bad=[-1, -10], bad_texts=["-0", "01"])
    check({"type": "integer", "exclusiveMinimum": -1}, good=[0, 5], bad=[-1])
    check({"type": "integer", "minimum": 1}, good=[1, 10, 20], bad=[0, -1])
    check({"type": "integer", "exclusiveMinimum": 0}, good=[1, 100], bad=[0])
    check({"type": "integer", "minimum": 0.5}, good=[1], bad=[0])
    check({"type": "integer", "minimum": 1, "maximum": 5}, good=[1, 3, 5], bad=[0, 6, -1, 10, 15])
    check({"type": "integer", "minimum": -3, "exclusiveMaximum": 3}, good=[-3, 0, 2], bad=[-4, 3, -30],
          bad_texts=["-0", "-03"])
    check({"type": "integer", "maximum": -1}, good=[-1, -10, -123456], bad=[0, 1], bad_texts=["-0"])
    check({"type": "integer", "exclusiveMinimum": 16.5}, good=[17, 99, 100, 10 ** 12], bad=[16, 9, 1, 0])
    check({"type": "integer", "minimum": -10 ** 18, "maximum": 10 ** 18}, good=[-10 ** 18, 0, 10 ** 18],
          bad=[-10 ** 18 - 1, 10 ** 18 + 1])


def test_integer_bounds_match_exactly_the_integers_between_them():
    """Random bounds (one, the other, both or none, inclusive or not): the regex takes every
    integer from -1300 to 1300 that meets them, no other, and no other spelling; so does
    the automaton the engine builds from it."""
    from treeflash.structured.regex import compile_regex
    gen = random.Random(7)
    for _ in range(150):
        a, b = sorted(gen.uniform(-1200, 1200) if gen.random() < 0.3 else gen.randint(-1200, 1200)
                      for _ in range(2))
        schema, low, high = {"type": "integer"}, -math.inf, math.inf
        if gen.random() < 0.8:
            key = gen.choice(["minimum", "exclusiveMinimum"])
            schema[key] = a
            low = math.ceil(a) if key == "minimum" else math.floor(a) + 1
        if gen.random() < 0.8:
            key = gen.choice(["maximum", "exclusiveMaximum"])
            schema[key] = b
            high = math.floor(b) if key == "maximum" else math.ceil(b) - 1
        if low > high:
            continue
        regex = re.compile(regex_of(schema))
        dfa = compile_regex(regex.pattern)
        for n in range(-1300, 1301):
            assert bool(regex.fullmatch(str(n))) == dfa.matches(str(n).encode()) == (low <= n <= high), (schema, n)
        for text in ("-0", "00", "01", "-01", "+1")[len(schema) == 1:]:  # unbounded: -0 is JSON's zero
            assert not regex.fullmatch(text) and not dfa.matches(text.encode()), (schema, text)


def test_number():
    check({"type": "number"}, good=[0, -0.5, 3.25, 1e100, -1.5e-7, 10, 0.001],
          bad=["1", None], bad_texts=[".5", "1.", "01.5", "1e", "1e+", "NaN", "Infinity", "-", "+1", "0x10"])
    regex = regex_of({"type": "number"})
    assert all(re.fullmatch(regex, t) for t in ["1E5", "1e+5", "-0", "0.0e-0"])
    check({"type": "number", "minimum": 0, "maximum": 1}, good=[0, 0.5, 1, 0.999, 1.0], bad=[-0.5, 1.5, 2, -1],
          bad_texts=["1.01", "1e0", "-0", "-0.0", "01"])
    check({"type": "number", "exclusiveMinimum": 0}, good=[0.001, 5, 123.25], bad=[0, -0.5], bad_texts=["0.0", "1e3"])
    check({"type": ["integer", "number"], "maximum": -2}, good=[-2, -2.5, -1000], bad=[-1.5, 0, 2])


def test_number_bounds_hold_for_every_spelling_of_a_value():
    """Random whole-number bounds (one, the other or both, inclusive or not) against
    numerals with and without fractions from -123.999 to 123.999: a text matches, in
    Python's re and in the engine's automaton, exactly when its value is within them
    (never as -0); a bounded number has no exponent."""
    from decimal import Decimal
    from treeflash.structured.regex import compile_regex
    texts = sorted({f"{sign}{n}{f}" for sign in ("", "-") for n in [*range(13), 99, 100, 101, 123]
                    for f in ("", ".0", ".00", ".5", ".05", ".50", ".001", ".9", ".999")})
    gen = random.Random(3)
    for _ in range(120):
        a, b = sorted(gen.randint(-12, 12) for _ in range(2))
        schema = {"type": "number"}
        lower, upper = gen.choice(["minimum", "exclusiveMinimum"]), gen.choice(["maximum", "exclusiveMaximum"])
        if gen.random() < 0.8:
            schema[lower] = a if gen.random() < 0.5 else float(a)
        if gen.random() < 0.8 or len(schema) == 1:
            schema[upper] = b

        def within(v):
            return ((lower not in schema or (v > a if lower == "exclusiveMinimum" else v >= a))
                    and (upper not in schema or (v < b if upper == "exclusiveMaximum" else v <= b)))
        if not any(within(Decimal(t)) for t in texts if t[0] != "-" or Decimal(t) != 0):
            refused(schema, "leave no number")
            continue
        regex = re.compile(regex_of(schema))
        dfa = compile_regex(regex.pattern)
        for text in texts:
            value = Decimal(text)
            want = within(value) and not (text[0] == "-" and value == 0)
            assert bool(regex.fullmatch(text)) == dfa.matches(text.encode()) == want, (schema, text)
        for text in ("1e3", "-1E0", "01", "1.", ".5", "-"):
            assert not regex.fullmatch(text), (schema, text)


def test_boolean_null_and_type_lists():
    check({"type": "boolean"}, good=[True, False], bad=[None, 0, "true"], bad_texts=["True", "tru", "truefalse"])
    check({"type": "null"}, good=[None], bad=[False, 0, "null"])
    check({"type": ["string", "null"]}, good=["x", None], bad=[0, False])
    check({"type": ["integer", "boolean"]}, good=[1, True], bad=[1.5, None])
    check({"type": ["string", "integer"], "minLength": 2}, good=["ab", 1], bad=["a"])
    check({"type": "string", "nullable": True, "maxLength": 1}, good=["a", None], bad=["ab"])


# --- enum, const ---

def test_enum_and_const():
    values = ["red", "a.b", "(x)|[y]", "c++", "^$", 'say "hi"', "tab\there", "日本", "a b #", 1, 2.5, -3, None, True,
              {"k": [1, {"z": None}]}, [], {}]
    check({"enum": values}, good=values,
          bad=["aXb", "Red", "red ", "x", 0, 2, 2.50001, False, {"k": [1]}, [None], {"k": [1, {"z": 0}]}],
          bad_texts=['"a\\u002eb"', "2.50"])
    check({"const": "yes"}, good=["yes"], bad=["no", "yes!"])
    check({"const": {"a": 1, "b": [True]}}, good=[{"a": 1, "b": [True]}], bad=[{"b": [True], "a": 1}])
    # the type, when given, filters the values; null by nullable
    check({"enum": ["a", 1, None], "type": "string"}, good=["a"], bad=[1, None])
    check({"enum": ["a", 1, 2.0, 2.5], "type": "integer"}, good=[1, 2.0], bad=["a", 2.5])
    check({"enum": ["a", "b"], "nullable": True}, good=["a", "b", None], bad=["c"])


def test_enum_refusals():
    refused({"enum": []}, "'enum' at $", "non-empty list")
    refused({"enum": "a"}, "'enum' at $")
    refused({"enum": [1, 2], "type": "string"}, "no value of 'enum' at $")
    refused({"enum": [float("nan")]}, "is not JSON")
    refused({"enum": [{1: 2}]}, "not a string")
    refused({"enum": ["a"], "minLength": 3}, "'minLength' at $ next to 'enum'")
    refused({"enum": ["a"], "const": "a"}, "'const' at $ next to 'enum'")


# --- arrays ---

def test_array():
    schema = {"type": "array", "items": {"type": "integer"}}
    check(schema, good=[[], [1], [1, 2, 3], list(range(30))], bad=[[1.5], ["1"], {}, None, [[1]]],
          bad_texts=["[1,]", "[,1]", "[1 ,2]", "[ 1]", "[1,  2]", "[1 2]", "[", "[1,2", "[] "])
    check({**schema, "minItems": 2, "maxItems": 3}, good=[[1, 2], [1, 2, 3]], bad=[[], [1], [1, 2, 3, 4]])
    check({**schema, "minItems": 1}, good=[[1], [1, 2, 3, 4, 5]], bad=[[]])
    check({**schema, "maxItems": 2}, good=[[], [1], [1, 2]], bad=[[1, 2, 3]])
    check({**schema, "maxItems": 0}, good=[[]], bad=[[1]])
    check({**schema, "minItems": 3, "maxItems": 3}, good=[[1, 2, 3]], bad=[[1, 2], [1, 2, 3, 4]])
    check({**schema, "uniqueItems": False}, good=[[1, 1]])
    nested = {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}
    check(nested, good=[[], [[]], [[True], [False, True], []]], bad=[[[True, True, True]], [True]])


def test_no_items_allowed_is_the_empty_array_only():
    """maxItems 0: the automaton's one text is [] (two edges, '[' then ']'), no item in any form."""
    from treeflash.structured.regex import compile_regex
    dfa = compile_regex(regex_of({"type": "array", "items": {"type": "boolean"}, "maxItems": 0}))
    assert dfa.matches(b"[]") and int((dfa.trans >= 0).sum()) == 2


def test_counts_up_to_the_largest_supported_are_kept():
    """A count of 1000, the largest supported (maxLength: 1000 is common), is enforced, not refused."""
    check({"type": "string", "maxLength": 1000}, good=["a" * 1000], bad=["a" * 1001])


def test_array_refusals():
    refused({"type": "array", "items": [{"type": "string"}]}, "'items' at $", "tuple form")
    refused({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "'uniqueItems' at $")
    refused({"type": "array", "items": {"type": "string"}, "contains": {"const": "a"}}, "'contains' at $")
    refused({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "string"}}, "'prefixItems' at $")
    refused({"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 2}, "'maxItems' at $")
    refused({"type": "array", "items": {"type": "string"}, "minItems": -1}, "'minItems' at $")
    refused({"type": "array", "items": {"type": "string"}, "maxItems": 2.5}, "'maxItems' at $")
    refused({"type": "array", "items": {"type": "string"}, "minItems": True}, "'minItems' at $")  # not read as 1


# --- objects ---

def test_object_order_and_required():
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    check(schema, good=[{"name": "Ann", "age": 30}],
          bad=[{"age": 30, "name": "Ann"}, {"name": "Ann"}, {"name": "Ann", "age": 30, "x": 1}, {"name": 1, "age": 30},
               {}, [], None],
          bad_texts=['{"name":"Ann","age":30,}', '{ "name":"Ann","age":30}', '{"name" :"Ann","age":30}',
                     '{"name":"Ann" ,"age":30}', '{"name":  "Ann","age":30}', '{"name":"Ann","age":30} '])


@pytest.mark.parametrize("required", [set(), {"a"}, {"b"}, {"d"}, {"a", "d"}, {"b", "c"}, {"a", "b", "c", "d"}])
def test_object_optional_properties_every_subset(required):
    """Every subset of the properties, in order, matches exactly when it holds the
    required ones; commas sit only between the present ones."""
    names = ["a", "b", "c", "d"]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": sorted(required)}
    regex = regex_of(schema)
    for k in range(len(names) + 1):
        for present in itertools.combinations(names, k):
            value = {n: i for i, n in enumerate(present)}
            for text in texts(value):
                assert bool(re.fullmatch(regex, text)) == required.issubset(present), (text, regex)
            if len(present) > 1:  # out of order
                swapped = dict(reversed(list(value.items())))
                assert not re.fullmatch(regex, json.dumps(swapped)), swapped
    for text in ['{,"a":1}', '{"a":1,}', '{"a":1,,"b":2}', '{"b":1"c":2}']:
        assert not re.fullmatch(regex, text)


def test_object_keys_are_escaped():
    odd = {"a.b": {"type": "null"}, 'q"uote': {"type": "null"}, "(x)": {"type": "null"}, "日本": {"type": "null"}}
    check({"type": "object", "properties": odd, "required": list(odd)},
          good=[{k: None for k in odd}], bad_texts=['{"aXb":null,"q\\"uote":null,"(x)":null,"日本":null}'])
    check({"type": "object", "properties": {}}, good=[{}], bad=[{"a": 1}])


def test_many_optional_properties():
    """Quadratic, not exponential: 40 optional properties are fine, 400 are refused."""
    props = {f"p{i}": {"type": "boolean"} for i in range(40)}
    regex = regex_of({"type": "object", "properties": props})
    assert len(regex) < 100_000
    assert re.fullmatch(regex, json.dumps({"p3": True, "p39": False}))
    assert not re.fullmatch(regex, json.dumps({"p39": True, "p3": False}))
    refused({"type": "object", "properties": {f"p{i}": {"type": "boolean"} for i in range(400)}},
            "too many optional properties", "$")


def test_free_objects_maps_and_lists():
    """An object without 'properties' (a free-form field, Pydantic's dict[str, X] as
    additionalProperties), a list without 'items' and any value (Pydantic's Any: {}) are
    generated, nesting at most as deep as json_object's at the root (they were refused)."""
    deep = {"a": {"b": {"c": [1]}}}  # 4 deep, the object itself included
    check({"type": "object"}, good=[{}, {"k": [1, "x", None]}, deep], bad=[[], "x", {"a": {"b": {"c": [[1]]}}}],
          bad_texts=['{"a":1,}'])
    check({"type": "object", "additionalProperties": True}, good=[{}, {"k": 1.5}])
    check({"type": "object", "additionalProperties": False}, good=[{}], bad=[{"k": 1}])
    check({"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}},
          good=[{}, {"a": 1, "b": 22}], bad=[{"a": -1}, {"a": "1"}, {"a": 1, "b": None}])
    check({"type": "array"}, good=[[], [1, "x", {"k": [2]}, None], [[[[1]]]]], bad=[{}, [[[[[1]]]]]])
    check({"type": "array", "minItems": 1, "maxItems": 2}, good=[[{}], [1, 2]], bad=[[], [1, 2, 3]])
    # below the root one level less (3 deep, the field's own object included): a schema of
    # several free fields stays within the regex's size limit
    fields = {"type": "object", "properties": {"meta": {"type": "object"}, "tags": {"type": "array"},
                                               "extra": {"type": "object"}}, "required": ["meta"]}
    check(fields, good=[{"meta": {}}, {"meta": {"a": {"b": {"c": 1}}}, "tags": ["a", 2]}],
          bad=[{"tags": []}, {"meta": {"a": {"b": {"c": {}}}}}, {"meta": {}, "tags": [[[[1]]]]}])
    StructuredOutputs(json=fields).automaton()
    assert schema_regex({"type": "object"}) == json_object_regex()
    # any value ({}, true, annotations only): its containers one level less deep again
    for anything in ({}, {"title": "x", "description": "y"}, {"nullable": True}):
        check(anything, good=[1, -2.5, "a", None, True, [1, {"a": [2]}], {"a": {"b": []}}], bad=[[[[[1]]]]])
    assert schema_regex({"type": "array", "items": True}) == schema_regex({"type": "array"})
    check({"type": "object", "properties": {"v": {}}, "required": ["v"]}, good=[{"v": 1}, {"v": [[2]]}],
          bad=[{"v": [[[2]]]}])
    refused({"type": "object", "additionalProperties": {"type": "string", "format": "email"}},
            "at $.additionalProperties")


def test_object_refusals():
    props = {"a": {"type": "string"}}
    refused({"type": "object", "required": ["a"]}, "'required' at $", "without 'properties'")
    refused({"type": "object", "properties": ["a"]}, "'properties' at $ must be an object")
    refused({"type": "object", "properties": props, "additionalProperties": True}, "'additionalProperties' at $")
    refused({"type": "object", "properties": props, "additionalProperties": {"type": "string"}},
            "'additionalProperties' at $", "only the listed properties")
    refused({"type": "object", "properties": props, "required": ["b"]}, "'required' at $", "'b'")
    refused({"type": "object", "properties": props, "required": "a"}, "'required' at $")
    refused({"type": "object", "properties": props, "patternProperties": {}}, "'patternProperties' at $")
    refused({"type": "object", "properties": props, "minProperties": 1}, "'minProperties' at $")
    refused({"type": "object", "properties": {"a": {"type": "integer", "maximum": 10 ** 19}}},
            "'maximum' at $.properties.a is not supported beyond")
    refused({"type": "object", "properties": {"my key": {"type": "integer", "multipleOf": 3}}},
            "'multipleOf' at $.properties[\"my key\"]")


# --- combinations, references ---

def test_any_of_one_of_all_of_nullable():
    two = [{"type": "integer"}, {"type": "string", "maxLength": 1}]
    for kw in ("anyOf", "oneOf"):
        check({kw: two}, good=[1, "a"], bad=["ab", None, 1.5])
    check({"allOf": [{"type": "integer"}]}, good=[1], bad=["1"])
    check({"anyOf": two, "nullable": True, "description": "ignored"}, good=[1, None], bad=[False])
    check({"type": "object", "properties": {"x": {"type": "integer", "nullable": True}}, "required": ["x"]},
          good=[{"x": None}, {"x": 3}], bad=[{}])


def test_one_of_only_where_no_value_fits_two_branches():
    """oneOf compiles as anyOf, which generates the same texts only if no value can satisfy
    two branches; any other oneOf is refused, since a text that fits two would break it."""
    check({"oneOf": [{"type": "string"}, {"type": "null"}]}, good=["a", None], bad=[1])
    check({"oneOf": [{"const": 1}, {"const": True}, {"enum": ["1", None]}]}, good=[1, True, "1", None], bad=[2])
    cat = {"type": "object", "properties": {"pet": {"const": "cat"}, "lives": {"type": "integer"}},
           "required": ["pet", "lives"]}
    dog = {"type": "object", "properties": {"pet": {"enum": ["dog", "wolf"]}, "good": {"type": "boolean"}},
           "required": ["pet"]}
    union = {"$defs": {"Cat": cat, "Dog": dog}, "oneOf": [{"$ref": "#/$defs/Cat"}, {"allOf": [{"$ref": "#/$defs/Dog"}]}],
             "discriminator": {"propertyName": "pet"}}  # as pydantic writes a discriminated union
    check(union, good=[{"pet": "cat", "lives": 9}, {"pet": "wolf"}], bad=[{"pet": "cat"}, {"pet": "dog", "lives": 1}])
    a, b = ({"type": "object", "properties": {k: {"type": "integer"}}, "required": [k]} for k in "ab")
    check({"oneOf": [a, b]}, good=[{"a": 1}, {"b": 2}], bad=[{"a": 1, "b": 2}])
    for branches in ([{"type": "string"}, {"type": "string", "maxLength": 3}],  # "" fits both
                     [{"type": "integer"}, {"type": "number"}],
                     [{"type": "integer", "minimum": 0}, {"type": "integer"}],
                     [{"const": 1}, {"const": 1.0}],  # one value in JSON
                     [{"const": "a"}, {"type": "string", "maxLength": 1}],
                     [{"type": ["string", "null"]}, {"type": "null"}],
                     [{"type": "integer", "nullable": True}, {"type": "string", "nullable": True}],
                     [cat, {**dog, "properties": {**dog["properties"], "pet": {"type": "string"}}}],
                     [a, {**a, "properties": {**a["properties"], "b": {"type": "integer"}}}]):
        refused({"oneOf": branches}, "'oneOf' at $: branches 0 and 1 may both match one value", "anyOf allows both")
    nullable = [{"allOf": [{"$ref": "#/$defs/Cat"}], "nullable": True},  # OpenAPI's nullable reference: null fits both
                {"$ref": "#/$defs/Dog", "nullable": True}]
    refused({"$defs": {"Cat": cat, "Dog": dog}, "oneOf": nullable}, "'oneOf' at $: branches 0 and 1")
    refused({"$defs": {"Cat": cat}, "oneOf": [nullable[0], {"type": "null"}]}, "'oneOf' at $: branches 0 and 1")
    refused({"type": "array", "items": {"oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "number"}]}},
            "'oneOf' at $.items: branches 0 and 2")


def test_refs():
    defs = {"Point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                      "required": ["x", "y"]}}
    schema = {"$defs": defs, "type": "array", "items": {"$ref": "#/$defs/Point"}}
    check(schema, good=[[{"x": 1, "y": 2.5}, {"x": 0, "y": 0}]], bad=[[{"x": 1}]])
    check({"definitions": defs, "$ref": "#/definitions/Point"}, good=[{"x": 1, "y": 2}])
    check({"$defs": {"a/b~c": {"type": "null"}}, "$ref": "#/$defs/a~1b~0c"}, good=[None])


def test_a_recursive_ref_unrolls_three_deep():
    """A recursive $ref (pydantic's trees, linked lists, threads) is unrolled: a value is
    inside one definition at most three times at once; deeper, an optional member or a
    list's items are left out, and a definition that cannot end is refused."""
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}
    nested = [{}, {"next": {}}, {"next": {"next": {}}}, {"next": {"next": {"next": {}}}}]
    check({"$defs": {"Node": node}, "$ref": "#/$defs/Node"}, good=nested[:3], bad=nested[3:])
    tree = {"type": "object", "required": ["v"],
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/definitions/T"}}}}
    leaf = {"v": 1, "kids": []}
    check({"definitions": {"T": tree}, "type": "array", "items": {"$ref": "#/definitions/T"}},
          good=[[leaf, {"v": 2, "kids": [{"v": 3, "kids": [leaf]}, {"v": 4}]}]],
          bad=[[{"v": 2, "kids": [{"v": 3, "kids": [{"v": 4, "kids": [leaf]}]}]}]])
    # mutual recursion: A in B in A in B ... counts each definition's own nesting
    pair = {"$defs": {"A": {"type": "object", "properties": {"b": {"$ref": "#/$defs/B"}}},
                      "B": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}}, "$ref": "#/$defs/A"}
    check(pair, good=[{"b": {"a": {"b": {"a": {"b": {}}}}}}], bad=[{"b": {"a": {"b": {"a": {"b": {"a": {}}}}}}}])
    endless = {"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}, "required": ["n"]}},
               "$ref": "#/$defs/N"}
    with pytest.raises(UsageError, match="matches no text"):
        StructuredOutputs(json=endless).validate().automaton()


def test_reference_and_combination_refusals():
    # an embedded resource's references resolve from it, not from the root: refused, not misread
    inner = {"$id": "https://example.com/a", "$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}
    refused({"$defs": {"x": {"type": "string"}}, "type": "object", "properties": {"a": inner}},
            "'$id' at $.properties.a")
    check({"$id": "https://example.com/root", "type": "integer"}, good=[1])  # the root's own is descriptive
    refused({"$ref": "#/$defs/Missing"}, "'$ref' at $", "not defined")
    refused({"$ref": "https://example.org/schema.json"}, "'$ref' at $", "only '#/$defs/NAME'")
    refused({"$ref": "#/properties/a"}, "'$ref' at $")
    refused({"$defs": {"A": {"type": "null"}}, "$ref": "#/$defs/A", "type": "null"}, "'type' at $ next to '$ref'")
    refused({"anyOf": [{"type": "null"}], "minLength": 1}, "'minLength' at $ next to 'anyOf'")
    refused({"allOf": [{"type": "null"}, {"type": "null"}]}, "'allOf' at $", "more than one")
    refused({"anyOf": []}, "'anyOf' at $")
    refused({"oneOf": [{"type": "null"}, {}]}, "'oneOf' at $: branches 0 and 1 may both match")  # {}: any value
    refused({"not": {"type": "null"}, "type": "string"}, "'not' at $")
    refused({"if": {"type": "null"}, "type": "string"}, "'if' at $")


@pytest.mark.parametrize("schema, words", [
    ({"minLength": 1}, ["without 'type'"]),
    ({"type": "string", "format": "email"}, ["'format' at $", "'email'"]),
    ({"type": "string", "format": "date", "maxLength": 3}, ["'maxLength' at $ next to 'format'"]),
    ({"type": "string", "pattern": "^a$", "minLength": 3}, ["'minLength' at $ next to 'pattern'"]),
    ({"type": "string", "minLength": 3, "maxLength": 2}, ["'maxLength' at $"]),
    ({"type": "string", "minimum": 1}, ["'minimum' at $", "with type 'string'"]),
    ({"type": "integer", "minimum": 5, "maximum": 4}, ["the bounds at $ leave no integer"]),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, ["the bounds at $ leave no integer"]),
    ({"type": "integer", "minimum": 0.2, "maximum": 0.8}, ["the bounds at $ leave no integer"]),
    ({"type": "integer", "minimum": 0, "exclusiveMinimum": True}, ["'exclusiveMinimum' at $", "must be a number"]),
    ({"type": "integer", "minimum": float("inf")}, ["'minimum' at $", "must be a number"]),
    ({"type": "integer", "exclusiveMinimum": float("nan")}, ["'exclusiveMinimum' at $", "must be a number"]),
    ({"type": "integer", "minimum": 10 ** 400}, ["'minimum' at $", "beyond +-10^18"]),
    ({"type": "integer", "maximum": -1e19}, ["'maximum' at $", "beyond +-10^18"]),
    ({"type": "integer", "exclusiveMaximum": "10"}, ["'exclusiveMaximum' at $", "must be a number"]),
    ({"type": "integer", "multipleOf": 2}, ["'multipleOf' at $"]),
    ({"type": "number", "minimum": 0.5}, ["'minimum' at $", "whole number"]),
    ({"type": ["integer", "number"], "maximum": 2.5}, ["'maximum' at $", "whole number"]),
    ({"type": "number", "exclusiveMaximum": 1.5, "minimum": 0}, ["'exclusiveMaximum' at $", "whole number"]),
    ({"type": "number", "minimum": 2, "exclusiveMaximum": 2}, ["the bounds at $ leave no number"]),
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 0}, ["the bounds at $ leave no number"]),
    ({"type": "decimal"}, ["'type' at $"]),
    ({"type": []}, ["'type' at $"]),
    ({"type": "string", "nullable": "yes"}, ["'nullable' at $"]),
    ({"type": "string", "contentEncoding": "base64"}, ["'contentEncoding' at $"]),
    (True, ["must be an object"]),
    (None, ["must be an object"]),
    ([{"type": "string"}], ["must be an object"]),
    ("{not json", ["not valid JSON"]),
    ("true", ["must be an object"]),
])
def test_refusals(schema, words):
    refused(schema, *words)


def test_large_schemas_are_refused_as_they_grow():
    """Optional properties, alternatives and nested arrays multiply a regex: the size is
    checked as it grows (700 optional properties of a nested array took 22 GB before), and
    a count past the regex's repetition bound names its keyword, not an internal regex."""
    import time
    defs = {"X0": {"type": "string", "format": "date-time"}}
    for k in range(1, 10):
        defs[f"X{k}"] = {"type": "array", "items": {"$ref": f"#/$defs/X{k - 1}"}, "minItems": 2, "maxItems": 2}
    start = time.perf_counter()
    refused({"$defs": defs, "type": "object", "properties": {f"p{i}": {"$ref": "#/$defs/X9"} for i in range(700)}},
            "makes a regex over 100000 characters")
    refused({"$defs": defs, "anyOf": [{"type": "array", "items": {"$ref": "#/$defs/X8"}, "maxItems": 2 + i}
                                      for i in range(20000)]}, "makes a regex over 100000 characters")
    assert time.perf_counter() - start < 10
    refused({"type": "string", "minLength": 2000}, "'minLength' at $ is 2000: counts above 1000")
    refused({"type": "array", "items": {"type": "integer"}, "maxItems": 10 ** 6}, "'maxItems' at $ is 1000000")


def test_deep_nesting_is_refused_not_a_crash():
    deep = {"type": "null"}
    for _ in range(2000):
        deep = {"type": "array", "items": deep}
    refused(deep, "nested too deeply")
    deep = {"type": "null"}
    for _ in range(30):  # each level writes its items twice: 2**30 would not fit in memory
        deep = {"type": "array", "items": deep}
    refused(deep, "over 100000 characters")
    defs = {"L0": {"type": "null"}}
    for i in range(1, 40):  # each definition used twice: the same growth through $ref
        defs[f"L{i}"] = {"anyOf": [{"type": "array", "items": {"$ref": f"#/$defs/L{i - 1}"}},
                                   {"type": "object", "properties": {"a": {"$ref": f"#/$defs/L{i - 1}"}}}]}
    refused({"$defs": defs, "$ref": "#/$defs/L39"}, "over 100000 characters")


def test_descriptive_keywords_are_ignored_and_json_text_is_accepted():
    schema = {"type": "string", "title": "T", "description": "d", "examples": ["x"], "default": "x", "deprecated": False,
              "readOnly": True, "writeOnly": False, "$comment": "c", "$id": "urn:x", "example": "x",
              "$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert schema_regex(schema) == schema_regex({"type": "string"})
    assert schema_regex(json.dumps(schema)) == schema_regex({"type": "string"})


# --- a realistic schema, as pydantic writes one ---

ORDER = {
    "$defs": {
        "Status": {"enum": ["pending", "shipped", "delivered"], "title": "Status", "type": "string"},
        "Item": {"properties": {"sku": {"pattern": "^[A-Z]{3}-\\d{4}$", "title": "Sku", "type": "string"},
                                "quantity": {"exclusiveMinimum": 0, "title": "Quantity", "type": "integer"},
                                "price": {"title": "Price", "type": "number"}},
                 "required": ["sku", "quantity", "price"], "title": "Item", "type": "object"},
    },
    "properties": {
        "id": {"format": "uuid", "title": "Id", "type": "string"},
        "customer": {"maxLength": 40, "minLength": 1, "title": "Customer", "type": "string"},
        "status": {"$ref": "#/$defs/Status"},
        "items": {"items": {"$ref": "#/$defs/Item"}, "minItems": 1, "title": "Items", "type": "array"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Note"},
        "gift": {"default": False, "title": "Gift", "type": "boolean"},
        "placed": {"format": "date-time", "title": "Placed", "type": "string"},
    },
    "required": ["id", "customer", "status", "items", "placed"],
    "title": "Order", "type": "object", "additionalProperties": False,
}
GOOD_ORDER = {"id": "123e4567-e89b-12d3-a456-426614174000", "customer": 'Zoë "Z" Müller',
              "status": "shipped",
              "items": [{"sku": "ABC-1234", "quantity": 2, "price": 9.99}, {"sku": "XYZ-0001", "quantity": 1, "price": 100}],
              "note": "leave at the door\nplease", "gift": True, "placed": "2024-05-01T10:00:00Z"}


def bad_orders():
    def changed(**kw):
        return {k: v for k, v in {**GOOD_ORDER, **kw}.items() if v is not ...}
    item = GOOD_ORDER["items"][0]
    return [changed(status="lost"), changed(items=[]), changed(items=[{**item, "quantity": 0}]),
            changed(items=[{**item, "sku": "abc-1234"}]), changed(items=[{**item, "quantity": -1}]),
            changed(customer=""), changed(customer="x" * 41), changed(id="not-a-uuid"), changed(placed=...),
            changed(note=3), changed(gift="yes"), changed(extra=1), {"customer": "A", **GOOD_ORDER}]


def test_realistic_schema():
    good = [GOOD_ORDER, {k: v for k, v in GOOD_ORDER.items() if k not in ("note", "gift")},
            {**GOOD_ORDER, "note": None}, {k: v for k, v in GOOD_ORDER.items() if k != "note"}]
    check(ORDER, good=good, bad=bad_orders())
    check(json.dumps(ORDER), good=good)


def test_the_dfa_compiler_reads_the_regexes():
    """The engine's own compiler agrees with Python's `re` on the realistic schema."""
    compile_regex = pytest.importorskip("treeflash.structured.regex").compile_regex
    schema = {"type": "object", "properties": {"status": ORDER["$defs"]["Status"],
                                               "sku": ORDER["$defs"]["Item"]["properties"]["sku"],
                                               "n": {"type": "integer", "minimum": 0}, "x": {"type": "number"},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}},
                                               "when": {"type": "string", "format": "date", "nullable": True}},
              "required": ["status", "tags"]}
    regex = regex_of(schema)
    dfa = compile_regex(regex)
    samples = [{"status": "pending", "tags": []}, {"status": "pending", "sku": "ABC-1234", "n": 3, "tags": ["a", "日本"]},
               {"status": "delivered", "x": -1.5e3, "tags": ["\n"], "when": None},
               {"status": "shipped", "tags": [], "when": "2024-01-31"},
               {"status": "lost", "tags": []}, {"tags": [], "status": "pending"}, {"status": "pending", "n": -1, "tags": []},
               {"status": "pending", "tags": ["abcd"]}, {"status": "pending", "sku": "AB-1234", "tags": []}]
    for value in samples:
        for text in texts(value):
            assert dfa.matches(text.encode()) == bool(re.fullmatch(regex, text)), text


def test_a_pydantic_model():
    """pydantic's own schema for a model: what pydantic writes matches, and whatever the
    regex accepts, pydantic validates."""
    pydantic = pytest.importorskip("pydantic")
    import datetime
    import typing
    import uuid

    class Cat(pydantic.BaseModel):
        kind: typing.Literal["cat"]
        lives: int = pydantic.Field(ge=0)

    class Dog(pydantic.BaseModel):
        kind: typing.Literal["dog"]
        good: bool

    class Line(pydantic.BaseModel):
        sku: str = pydantic.Field(pattern=r"^[A-Z]{3}-\d{4}$")
        quantity: int = pydantic.Field(gt=0)

    class Order(pydantic.BaseModel):
        id: uuid.UUID
        customer: str = pydantic.Field(min_length=1, max_length=20)
        lines: list[Line] = pydantic.Field(min_length=1, max_length=3)
        note: typing.Optional[str] = None
        placed: datetime.datetime
        pet: typing.Union[Cat, Dog] = pydantic.Field(discriminator="kind")

    regex = regex_of(Order.model_json_schema())
    order = Order(id=uuid.UUID(int=7), customer='Zoë "Z"', lines=[Line(sku="ABC-1234", quantity=2)],
                  placed=datetime.datetime(2024, 5, 1, 10, 0, 0, 250000, tzinfo=datetime.timezone.utc),
                  pet=Cat(kind="cat", lives=9))
    good = [order, order.model_copy(update={"note": "a\nb", "pet": Dog(kind="dog", good=True)})]
    for value in good:
        text = value.model_dump_json()
        assert re.fullmatch(regex, text), text
        assert re.fullmatch(regex, json.dumps(json.loads(text), separators=(", ", ": "), ensure_ascii=False))
    text = good[0].model_dump_json()
    without_note = text.replace('"note":null,', "")
    assert re.fullmatch(regex, without_note) and Order.model_validate_json(without_note)
    assert not re.fullmatch(regex, text.replace('"note":null,', '"note":null,"extra":1,'))  # pydantic ignores extras
    for old, new in [("ABC-1234", "ABC-12345"), ('"quantity":2', '"quantity":0'), ('"lives":9', '"lives":-1'),
                     ('"kind":"cat"', '"kind":"cow"'), ('"note":null', '"note":3'), ('"customer":"Zoë \\"Z\\""', '"customer":""')]:
        assert old in text
        assert not re.fullmatch(regex, text.replace(old, new)), new
        with pytest.raises(pydantic.ValidationError):
            Order.model_validate_json(text.replace(old, new))


# --- cases a second mutation review found untested ---

def test_unicode_escapes_in_either_case_are_one_character():
    """A \\uXXXX escape of a character that is no surrogate is accepted whatever the case of
    its hex digits (json.dumps writes lowercase, other writers uppercase), and counts as one
    character; a surrogate pair, in either case, too."""
    regex, one = regex_of({"type": "string"}), regex_of({"type": "string", "minLength": 1, "maxLength": 1})
    for code in (0x00E9, 0x0ABC, 0x7FFF, 0xABCD, 0xC0DE, 0xD7FF, 0xE000, 0xFEFF, 0xFFFD, 0x1F600):
        lower = json.dumps(chr(code))  # ensure_ascii: "\\u00e9", "\\ud83d\\ude00"
        for text in (lower, re.sub(r"\\u([0-9a-f]{4})", lambda m: "\\u" + m.group(1).upper(), lower)):
            assert re.fullmatch(regex, text) and re.fullmatch(one, text), text
            assert json.loads(text) == chr(code)


def test_the_stricter_of_two_lower_bounds_holds():
    """minimum and exclusiveMinimum together: an integer must meet both, whichever is listed first."""
    for schema in ({"type": "integer", "minimum": 1, "exclusiveMinimum": -1},
                   {"type": "integer", "exclusiveMinimum": -1, "minimum": 1},
                   {"type": "integer", "minimum": 0, "exclusiveMinimum": 0}):
        check(schema, good=[1, 25], bad=[0, -1])
    check({"type": "integer", "minimum": -1, "exclusiveMinimum": -1}, good=[0, 3], bad=[-1])


def test_a_count_just_past_the_largest_supported_names_its_keyword():
    """maxLength or maxItems one past the largest supported count is refused as the
    schema's keyword, not as an internal regex the client never wrote."""
    from treeflash.structured.regex import MAX_REPEAT
    refused({"type": "string", "maxLength": MAX_REPEAT + 1}, f"'maxLength' at $ is {MAX_REPEAT + 1}")
    refused({"type": "array", "items": {"type": "null"}, "minItems": MAX_REPEAT + 1},
            f"'minItems' at $ is {MAX_REPEAT + 1}")


def test_pattern_repeated_no_times():
    """{0} in a pattern repeats its item no times (the item may not appear), as ECMA-262 reads it."""
    check({"type": "string", "pattern": "^xa{0}y$"}, good=["xy"], bad=["xay", "xaay", "x"])
    check({"type": "string", "pattern": "^x(?:ab){0,0}y$"}, good=["xy"], bad=["xaby"])


def test_references_to_escaped_names():
    """$ref as JSON Pointer and URI escape a name: ~0 is ~ and ~1 is / (~01 is the text ~1),
    %XX a character."""
    defs = {"a~1": {"type": "null"}, "a/": {"type": "boolean"}, "my type": {"type": "integer"}}
    check({"$defs": defs, "$ref": "#/$defs/a~01"}, good=[None], bad=[True])
    check({"$defs": defs, "$ref": "#/$defs/a~1"}, good=[True], bad=[None])
    check({"$defs": defs, "$ref": "#/$defs/my%20type"}, good=[3], bad=[None])


def test_one_of_refused_where_a_null_fits_both_branches():
    """nullable adds null to a branch's listed values: a oneOf of that branch and a null
    one would give a text fitting both, so it is refused (an enum, and an anyOf of values)."""
    for first in ({"enum": ["a", "b"], "nullable": True}, {"anyOf": [{"const": "a"}], "nullable": True},
                  {"const": "a", "nullable": True}):
        refused({"oneOf": [first, {"const": None}]}, "'oneOf' at $: branches 0 and 1 may both match one value")
        refused({"oneOf": [first, {"enum": [None, 1]}]}, "'oneOf' at $: branches 0 and 1")
    check({"oneOf": [{"enum": ["a", "b"], "nullable": True}, {"const": 1}]}, good=["a", None, 1], bad=[2])


def test_one_of_tells_listed_values_apart_as_json_does():
    """Listed values are compared as JSON values: 0, false, "", null and [] are five (a oneOf
    of them is taken), and objects equal but for their key order are one (refused)."""
    falsy = [0, False, "", None, []]
    check({"oneOf": [{"const": v} for v in falsy]}, good=falsy, bad=[1, True, "0", [0]])
    refused({"oneOf": [{"const": {"a": 1, "b": 2}}, {"const": {"b": 2, "a": 1}}]},
            "'oneOf' at $: branches 0 and 1 may both match one value")
