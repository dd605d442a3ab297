"""JSON Schema to a regular expression, for structured outputs (vLLM's `guided_json`,
OpenAI's `response_format: {"type": "json_schema"}`).

The engine constrains text to a regex (`treeflash.structured.regex`), so a schema must
become one; only what a regex can express exactly is supported, and every keyword that
constrains values and is not supported is refused, never ignored (ignoring it would
generate text the schema rejects). Descriptive keywords (title, description, examples,
default, ...) are ignored.

The text accepted is compact JSON: one optional space after each `:` and `,`, and no
other whitespace. Objects hold exactly their `properties` in the order the schema lists
them; absent `additionalProperties` is treated as false. Numbers are written as JSON
writes them (no leading zeros); enum and const values as `json.dumps` writes them
(non-ASCII characters raw). Strings take any JSON string, escapes included.

Supported: `type` (one or a list); string `minLength`, `maxLength`, `format` (date,
time, date-time, uuid; a date is a day of the Gregorian calendar in the years 1-9999, a
time has no leap second, as Python's datetime and Pydantic read them) and `pattern`;
integer and number `minimum`, `exclusiveMinimum`, `maximum` and `exclusiveMaximum` (up
to 10^18 in magnitude; a number's must be whole numbers, and a bounded number is written
without an exponent) and OpenAPI's `format` (int32; int64, within 10^18; float and double,
any number); array `items`,
`minItems`, `maxItems` (without `items`, any values); object `properties`, `required`
(without `properties`, any members, or members of the `additionalProperties` schema; free
parts nest as deep as json_object's at the root, one level less below it); any value for
{} or true (one level less again); `enum`, `const`, `anyOf`,
`oneOf` whose branches no value can satisfy twice (different types, listed values that
differ, objects with a required property whose const or enum differs: a discriminated
union, or objects that each require a property the other does not have; other oneOf is
refused, since exclusivity is not enforced), `allOf`
of one schema, `$ref`
to `#/$defs/...` or `#/definitions/...` (a `$id` below the root is refused; a recursive
one is unrolled: a value is inside one definition at most MAX_RECURSION times at once,
fewer where that automaton would be too large, as a grammar's), OpenAPI's `nullable`;
OpenAPI's extension keys (`x-...`) are ignored, as annotations are.

A `pattern` matches anywhere in the string unless anchored with ^ and / or $ (then no
alternation outside a group: ^a|b$ anchors each one separately), and uses the regex
dialect (no lookarounds, backreferences or flags), read as ECMA-262 where it
differs from Python's re: `.` is no line terminator, and {,n} is refused. Its characters are generated
unescaped: `.`, negated classes and \\D \\W \\S leave out `"`, `\\` and control characters,
\\s stands for a space (or another white space character that is no control character),
classes lose those characters, and a pattern that names one elsewhere is refused.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from urllib.parse import unquote

from treeflash.errors import UsageError, shown
from treeflash.structured.regex import MAX_REPEAT, NOTHING, TooComplex, escape, restricted

MAX_REGEX_CHARS = 100_000  # optional properties and nested arrays multiply a regex's size

DESCRIPTIVE = {"title", "description", "examples", "default", "deprecated", "readOnly", "writeOnly",
               "$schema", "$id", "$comment", "$defs", "definitions",
               "discriminator", "example"}  # OpenAPI's: a hint, and its one example (FastAPI's json_schema_extra)
BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")  # in the order they are read
MAX_RECURSION = 3  # a recursive $ref is unrolled: a value may be inside one definition this many times at once
MAX_BOUND = 10 ** 18  # integer bounds beyond this (in magnitude) are refused: their regex grows with their digits
# OpenAPI's number formats (tool schemas made from typed code): an int32's range, an
# int64's within +-MAX_BOUND (2^63 is past it); float and double are any JSON number
INTEGER_FORMATS = {"int32": (-2 ** 31, 2 ** 31 - 1), "int64": (-MAX_BOUND, MAX_BOUND)}
NUMBER_FORMATS = ("float", "double")
# the keywords each type supports (some values of them are still refused)
TYPE_KEYWORDS = {"string": {"minLength", "maxLength", "pattern", "format"},
                 "integer": {*BOUNDS, "format"}, "number": {*BOUNDS, "format"},
                 "boolean": set(), "null": set(), "array": {"items", "minItems", "maxItems", "uniqueItems"},
                 "object": {"properties", "required", "additionalProperties"}}
COMBINATORS = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")

UNSAFE = '"\\\\\\x00-\\x1f'  # class members for what a JSON string must escape: " \ U+0000-U+001F
HEX = "[0-9a-fA-F]"
# a \u escape of a character: one outside the surrogates, or a high and a low surrogate
# together (a lone one is no character: strict parsers refuse it, and a pair is one
# character to minLength / maxLength)
UNICODE_ESCAPE = (f"\\\\u(?:[0-9a-cA-Ce-fE-F]{HEX}{{3}}|[dD](?:[0-7]{HEX}{{2}}"
                  f"|[89abAB]{HEX}{{2}}\\\\u[dD][c-fC-F]{HEX}{{2}}))")
STRING_CHAR = f'(?:[^{UNSAFE}]|\\\\["\\\\/bfnrt]|{UNICODE_ESCAPE})'
NATURAL = "(?:0|[1-9][0-9]*)"
INTEGER = "-?" + NATURAL
NUMBER = INTEGER + "(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
# years 0001-9999: RFC 3339 also has 0000, which Python's datetime and validators built on it refuse
_YEAR = "(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
DATE = ("(?:" + _YEAR + "-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)"
        "|(?:0[13578]|1[02])-31)|" + _LEAP_YEAR + "-02-29)")  # the calendar's days: 29-30 but in February, 31 in 7 months
# RFC 3339's, with its offset, but no leap second (:60): Python's datetime, Pydantic and
# jsonschema's RFC 3339 check refuse it, as they do the year 0000
TIME = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
FORMATS = {"date": DATE, "time": TIME, "date-time": DATE + "T" + TIME,
           "uuid": "-".join(f"[0-9a-fA-F]{{{n}}}" for n in (8, 4, 4, 4, 12))}
JSON_ESCAPED = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # what a JSON string must escape


JSON_OBJECT_DEPTH = 4  # `json_object`: objects and lists nest at most this deep (the answer's own included)


def _map_regex(value: str) -> str:
    """A JSON object of any keys, each holding a `value`."""
    string = f'"{STRING_CHAR}*"'
    return f"\\{{(?:{string}: ?{value}(?:, ?{string}: ?{value})*)?\\}}"


def _list_regex(item: str, lo: int = 0, hi: int | None = None) -> str:
    """A JSON list of `lo` to `hi` (None: any number of) `item`s."""
    if hi == 0:
        return "\\[\\]"
    body = item + _repeat(f"(?:, ?{item})", max(lo - 1, 0), None if hi is None else hi - 1)
    return "\\[" + (body if lo else f"(?:{body})?") + "\\]"


def any_json_regex(depth: int = JSON_OBJECT_DEPTH) -> tuple[str, str]:
    """(any JSON value, any JSON object) whose objects and lists nest at most `depth` deep
    in the object (the object itself included) and `depth - 1` in the value: what an
    object's or a list's members may be, where a schema leaves them free (nesting
    without a bound is not regular). OpenAI's json_object is the object."""
    scalars = [f'"{STRING_CHAR}*"', NUMBER, "true", "false", "null"]
    value = _alt(scalars)
    for level in range(depth):  # containers one level deeper than the last
        obj = _map_regex(value)
        if level < depth - 1:
            value = _alt([*scalars, obj, _list_regex(value)])
    return value, obj


def _free_depth(path: str) -> int:
    """How deep a schema's free object or list (no 'properties', no 'items') nests, itself
    included: as json_object's at the answer's root, one level less below it (a schema of
    several such fields stays within MAX_REGEX_CHARS: 13K characters each, not 54K). Any
    value ({}, true) nests one level less again: its own regex is the members'."""
    return JSON_OBJECT_DEPTH if path == "$" else JSON_OBJECT_DEPTH - 1


def json_object_regex(depth: int = JSON_OBJECT_DEPTH) -> str:
    """Any JSON object whose objects and lists nest at most `depth` deep (OpenAI's json_object)."""
    return any_json_regex(depth)[1]


def schema_regex(schema, recursion: int = MAX_RECURSION) -> str:
    """The regex (treeflash's dialect, always matched whole) for the JSON texts that
    satisfy `schema`: a dict, or the JSON text of one; inside no definition more than
    `recursion` times at once."""
    try:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                _refuse(f"not valid JSON ({e})")
        if not isinstance(schema, dict):
            _refuse(f"a schema must be an object, got {shown(schema)}")
        return _Compiler(schema, recursion).node(schema, "$")
    except RecursionError:
        _refuse("nested too deeply")


def _refuse(message: str):
    raise UsageError(f"json schema: {message}")


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_$][\w$]*", key) else f"{path}[{json.dumps(key)}]"


def _alt(options, path: str = "$") -> str:
    """The alternation of `options` (an iterable: refused as soon as their regexes grow
    past MAX_REGEX_CHARS, not after all are written)."""
    kept, size = {}, 0
    for option in options:
        if option not in kept:
            kept[option] = None
            size += len(option) + 1
            _check_size(size, path)
    return next(iter(kept)) if len(kept) == 1 else "(?:" + "|".join(kept) + ")"


def _refuse_size(message: str):
    """A schema too large for the automaton (TooComplex: a recursive one unrolls less deep)."""
    raise TooComplex(f"json schema: {message}")


def _check_size(chars: int, path: str):
    if chars > MAX_REGEX_CHARS:
        _refuse_size(f"the schema at {path} makes a regex over {MAX_REGEX_CHARS} characters "
                     "(optional properties, alternatives and nested arrays multiply it)")


def _repeat(atom: str, lo: int, hi: int | None) -> str:
    """`atom` (a group) lo to hi times (None: no limit)."""
    if hi is None:
        return atom + ("*" if lo == 0 else "+" if lo == 1 else f"{{{lo},}}")
    if lo == hi:
        return "" if lo == 0 else atom if lo == 1 else f"{atom}{{{lo}}}"
    return atom + ("?" if (lo, hi) == (0, 1) else f"{{{lo},{hi}}}")


def _count(schema: dict, key: str, path: str) -> int | None:
    value = schema.get(key)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        _refuse(f"'{key}' at {path} must be a non-negative integer, got {shown(value)}")
    if value is not None and value > MAX_REPEAT:  # a regex {m,n} copies its item: bounded
        _refuse(f"'{key}' at {path} is {value}: counts above {MAX_REPEAT} are not supported")
    return value


def _literal(value, path: str) -> str:
    """An enum or const value as JSON, with the optional spaces of every generated text."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            _refuse(f"a value at {path} has a key that is not a string")
        return "\\{" + ", ?".join(_literal(k, path) + ": ?" + _literal(v, path) for k, v in value.items()) + "\\}"
    if isinstance(value, (list, tuple)):
        return "\\[" + ", ?".join(_literal(v, path) for v in value) + "\\]"
    try:
        return escape(json.dumps(value, ensure_ascii=False, allow_nan=False))
    except (TypeError, ValueError):
        _refuse(f"the value {shown(value)} at {path} is not JSON")


def _ref_target(ref) -> tuple[str, str] | None:
    """('$defs' or 'definitions', NAME) of a `$ref` to '#/$defs/NAME' or '#/definitions/NAME'
    (NAME unescaped, as JSON Pointer and URI write it); None for any other."""
    match = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
    return None if match is None else (match.group(1), unquote(match.group(2)).replace("~1", "/").replace("~0", "~"))


def recurses(schema) -> bool:
    """Whether a definition of the schema refers to itself, directly or through others
    (its $refs are then unrolled, MAX_RECURSION deep or less)."""
    if not isinstance(schema, dict):
        return False
    compiler = _Compiler(schema)
    return any((defs, name) in compiler.reach(target)
               for defs in ("$defs", "definitions") if isinstance(schema.get(defs), dict)
               for name, body in schema[defs].items()
               for target in map(_ref_target, _refs(body)) if target is not None)


def _refs(node):
    """Every `$ref` string in a schema, its values' included (a superset does no harm)."""
    todo = [node]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            todo += node.values()
        elif isinstance(node, list):
            todo += node


def _canonical(value):
    """A JSON value as a hashable key, equal for equal JSON values: 1 and 1.0 alike, true
    unlike 1, objects whatever their key order. Its first item is the value's kind."""
    if value is None:
        return ("null", None)
    if isinstance(value, bool):
        return ("boolean", value)
    if isinstance(value, (int, float)):
        return ("number", int(value) if isinstance(value, float) and value.is_integer() else value)
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, dict):
        return ("object", tuple(sorted((str(k), _canonical(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("array", tuple(_canonical(v) for v in value))
    return ("other", repr(value))


def _json_types(value) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, (int, float)):
        return {"number", "integer"} if isinstance(value, int) or value.is_integer() else {"number"}
    return {str: {"string"}, list: {"array"}, tuple: {"array"}, dict: {"object"}}.get(type(value), set())


class _Compiler:
    """One schema's compilation: its root (for $ref) and the definitions compiled so far."""

    def __init__(self, root: dict, recursion: int = MAX_RECURSION):
        self.root, self.recursion, self.done, self.expanding, self.reached = root, recursion, {}, [], {}

    def node(self, schema, path: str) -> str:
        if schema is True:  # any value
            return any_json_regex(_free_depth(path))[0]
        if not isinstance(schema, dict):
            _refuse(f"the schema at {path} must be an object, got {shown(schema)}")
        if "$id" in schema and schema is not self.root:  # $ref inside it would resolve from it
            _refuse(f"'$id' at {path} is not supported: a schema's references resolve from its root")
        nullable = schema.get("nullable", False)
        if not isinstance(nullable, bool):
            _refuse(f"'nullable' at {path} must be true or false")
        keys = [k for k in schema if k not in DESCRIPTIVE and k != "nullable" and not k.startswith("x-")]
        regex = self.value(schema, keys, path)
        regex = _alt([regex, "null"]) if nullable else regex
        _check_size(len(regex), path)
        return regex

    def value(self, schema: dict, keys: list[str], path: str) -> str:
        combinators = [k for k in keys if k in COMBINATORS]
        if combinators:
            kw = combinators[0]
            extra = [k for k in keys if k != kw and not (k == "type" and kw in ("enum", "const"))]
            if extra:
                _refuse(f"'{extra[0]}' at {path} next to '{kw}' is not supported")
            return self.combined(schema, kw, path)
        if not keys:  # {} or annotations only: any value
            return any_json_regex(_free_depth(path))[0]
        if "type" not in keys:
            _refuse(f"a schema without 'type' at {path} is not supported: give a type")
        types = _types(schema, path)
        for k in keys:
            if k != "type" and not any(k in TYPE_KEYWORDS[t] for t in types):
                known = any(k in words for words in TYPE_KEYWORDS.values())
                _refuse(f"'{k}' at {path} is not supported" + (f" with type {shown(schema['type'])}" if known else ""))
        return _alt([self.typed(t, schema, path) for t in types])

    def combined(self, schema: dict, kw: str, path: str) -> str:
        arg = schema[kw]
        if kw == "$ref":
            return self.ref(arg, path)
        if kw in ("enum", "const"):
            values = [arg] if kw == "const" else arg
            if not isinstance(values, list) or not values:
                _refuse(f"'enum' at {path} must be a non-empty list")
            types = set(_types(schema, path)) if "type" in schema else None
            fitting = [v for v in values if types is None or _json_types(v) & types]
            if not fitting:
                _refuse(f"no value of '{kw}' at {path} has the type {shown(schema['type'])}")
            return _alt((_literal(v, _at(path, kw)) for v in fitting), path)
        if not isinstance(arg, list) or not arg:
            _refuse(f"'{kw}' at {path} must be a non-empty list of schemas")
        if kw == "allOf" and len(arg) > 1:
            _refuse(f"'allOf' at {path} with more than one schema is not supported")
        regex = _alt((self.node(sub, f"{_at(path, kw)}[{i}]") for i, sub in enumerate(arg)), path)
        if kw == "oneOf":  # as anyOf, which is only the same where no value fits two branches
            facts = [(sub, self.values(sub), self.kinds(sub)) for sub in arg]  # once per branch, not per pair
            for (i, a), (j, b) in itertools.combinations(enumerate(facts), 2):
                if not self.disjoint(a, b):
                    _refuse(f"'oneOf' at {path}: branches {i} and {j} may both match one value, and exclusivity is "
                            f"not enforced (supported: branches of different types or values, or objects told "
                            f"apart by a required property); anyOf allows both")
        return regex

    def resolved(self, schema):
        """schema with its `$ref`s followed and an allOf of one schema opened (as compiled);
        a `nullable` met on the way stays, as an anyOf with null."""
        nullable = False
        for _ in range(64):
            if not isinstance(schema, dict):
                break
            if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
                nullable, schema = nullable or schema.get("nullable") is True, schema["allOf"][0]
            elif (target := _ref_target(schema.get("$ref"))) is not None:
                defs = self.root.get(target[0])
                nullable = nullable or schema.get("nullable") is True
                schema = defs.get(target[1]) if isinstance(defs, dict) else None
            else:
                break
        return {"anyOf": [schema, {"type": "null"}]} if nullable else schema

    def values(self, schema) -> set | None:
        """The values `schema` allows if it lists them (const, enum, unions of those), as
        `_canonical` keys; None if it does not."""
        schema = self.resolved(schema)
        if not isinstance(schema, dict):
            return None
        nulls = {_canonical(None)} if schema.get("nullable") is True else set()
        if "const" in schema:
            return {_canonical(schema["const"])} | nulls
        if isinstance(schema.get("enum"), list):
            return {_canonical(v) for v in schema["enum"]} | nulls
        for kw in ("anyOf", "oneOf"):
            if isinstance(schema.get(kw), list):
                parts = [self.values(sub) for sub in schema[kw]]
                return None if None in parts else set().union(nulls, *parts)
        return None

    def kinds(self, schema) -> set[str]:
        """The JSON kinds of value `schema` may take (integer is a number); all if unclear."""
        every = {"null", "boolean", "number", "string", "array", "object"}
        schema = self.resolved(schema)
        if not isinstance(schema, dict):
            return every
        out = {"null"} if schema.get("nullable") is True else set()
        if (listed := self.values(schema)) is not None:
            return out | {key[0] for key in listed}
        for kw in ("anyOf", "oneOf"):
            if isinstance(schema.get(kw), list):
                return out.union(*(self.kinds(sub) for sub in schema[kw]))
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else None
        if types is None:
            return every
        return out | {"number" if t == "integer" else t for t in types}

    def disjoint(self, a: tuple, b: tuple) -> bool:
        """No JSON value satisfies both schemas (as far as can be told from their types, listed
        values and discriminating properties; unsure is False); each is (schema, its
        `values`, its `kinds`)."""
        (a, va, ka), (b, vb, kb) = a, b
        if va is not None and vb is not None:
            return va.isdisjoint(vb)
        common = ka & kb
        if not common:
            return True
        ra, rb = self.resolved(a), self.resolved(b)
        if common != {"object"} or not (isinstance(ra, dict) and isinstance(rb, dict)):
            return False
        pa, pb = ra.get("properties"), rb.get("properties")
        if not (isinstance(pa, dict) and isinstance(pb, dict)):
            return False
        qa, qb = ra.get("required") or [], rb.get("required") or []
        if any(p not in pa for p in qb) and any(p not in pb for p in qa):
            return True  # an object holds only its own properties: neither has all the other requires
        both = [p for p in qa if p in qb and p in pa and p in pb]
        return any((x := self.values(pa[p])) is not None and (y := self.values(pb[p])) is not None
                   and x.isdisjoint(y) for p in both)

    def ref(self, ref, path: str) -> str:
        where = f"'$ref' at {path}"
        if (target := _ref_target(ref)) is None:
            _refuse(f"{where} is not supported: only '#/$defs/NAME' and '#/definitions/NAME' are, got {shown(ref)}")
        defs, name = target
        if not isinstance(self.root.get(defs), dict) or name not in self.root[defs]:
            _refuse(f"{where}: {shown(ref)} is not defined")
        if self.expanding.count(target) >= self.recursion:  # unrolled as deep as it goes: no value here
            return NOTHING
        # its regex depends on how deep the definitions it reaches are unrolled already
        key = (target, tuple(sorted((t, self.expanding.count(t)) for t in self.reach(target) if t in self.expanding)))
        if key not in self.done:
            self.expanding.append(target)
            self.done[key] = self.node(self.root[defs][name], _at(_at("$", defs), name))
            self.expanding.pop()
        return self.done[key]

    def reach(self, target: tuple[str, str]) -> set[tuple[str, str]]:
        """The definitions (as `_ref_target`s) that a definition's references lead to, itself among them."""
        if target not in self.reached:
            seen, todo = set(), [target]
            while todo:
                t = todo.pop()
                table = self.root.get(t[0]) if t is not None else None
                if t not in seen and isinstance(table, dict) and t[1] in table:
                    seen.add(t)
                    todo += [_ref_target(ref) for ref in _refs(table[t[1]])]
            self.reached[target] = seen
        return self.reached[target]

    def typed(self, kind: str, schema: dict, path: str) -> str:
        if kind == "string":
            return '"' + _string_contents(schema, path) + '"'
        if kind == "integer":
            return _integer(schema, path)
        if kind == "number":
            return _number(schema, path)
        if kind == "array":
            return self.array(schema, path)
        if kind == "object":
            return self.object(schema, path)
        return "(?:true|false)" if kind == "boolean" else "null"

    def array(self, schema: dict, path: str) -> str:
        if isinstance(schema.get("items"), list):
            _refuse(f"'items' at {path} as a list (tuple form) is not supported")
        if schema.get("uniqueItems", False) is not False:
            _refuse(f"'uniqueItems' at {path} is not supported")
        lo, hi = _count(schema, "minItems", path) or 0, _count(schema, "maxItems", path)
        items = schema.get("items", True)  # without 'items' (or true), any values: a free list
        item = any_json_regex(_free_depth(path))[0] if items is True else self.node(items, _at(path, "items"))
        if hi is not None and hi < lo:
            _refuse(f"'maxItems' at {path} is below 'minItems'")
        return _list_regex(item, lo, hi)

    def object(self, schema: dict, path: str) -> str:
        props, required = schema.get("properties"), schema.get("required", [])
        if props is None and not required:  # any keys: free members (json_object's), or each of a schema
            extra = schema.get("additionalProperties", True)
            if extra is True:
                return any_json_regex(_free_depth(path))[1]
            if extra is False:
                return "\\{\\}"
            return _map_regex(self.node(extra, _at(path, "additionalProperties")))
        if props is None:
            _refuse(f"'required' at {path} names properties of an object without 'properties'")
        if not isinstance(props, dict):
            _refuse(f"'properties' at {path} must be an object, got {shown(props)}")
        if not all(isinstance(name, str) for name in props):
            _refuse(f"'properties' at {path} must be named by strings")
        if schema.get("additionalProperties", False) is not False:
            _refuse(f"'additionalProperties' at {path} is not supported: only the listed properties are generated")
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            _refuse(f"'required' at {path} must be a list of names")
        for name in required:
            if name not in props:
                _refuse(f"'required' at {path} names {shown(name)}, which is not in 'properties'")
        members = [(_literal(name, path) + ": ?" + self.node(sub, _at(_at(path, "properties"), name)),
                    name in required) for name, sub in props.items()]
        # The members written before the first required one are each followed by a comma,
        # those after it each preceded by one: with a required member, the regex is one chain.
        first_needed = next((i for i, (_, needed) in enumerate(members) if needed), None)
        if first_needed is not None:
            regex = "".join(f"(?:{member}, ?)?" for member, _ in members[:first_needed]) + members[first_needed][0]
            regex += "".join(f", ?{member}" if needed else f"(?:, ?{member})?"
                             for member, needed in members[first_needed + 1:])
            _check_size(len(regex), path)
            return "\\{" + regex + "\\}"
        # All optional: one alternative per member that may be the last written (or none: the
        # empty object), the members before it each with its comma. Which one is last is
        # settled only at the '}', so the DFA reads the alternatives at once and has states
        # per member (where alternatives by the first member written made states per pair of
        # members: 24 optional strings were the most that compiled); the text is N^2.
        before, alternatives, size = "", [], 0
        for member, _ in members:
            alternatives.append(before + member)
            size += len(alternatives[-1])
            before += f"(?:{member}, ?)?"
            if size + len(before) > MAX_REGEX_CHARS:
                _refuse_size(f"the object at {path} has too many optional properties "
                             f"(its regex grows past {MAX_REGEX_CHARS} characters)")
        return "\\{" + (f"(?:{_alt(alternatives, path)})?" if alternatives else "") + "\\}"


def _types(schema: dict, path: str) -> list[str]:
    types = schema["type"]
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types or not all(isinstance(t, str) and t in TYPE_KEYWORDS for t in types):
        _refuse(f"'type' at {path} must be one of {sorted(TYPE_KEYWORDS)} or a list of them, got {shown(types)}")
    return types


def _bounds(schema: dict, path: str) -> tuple[float, bool, float, bool]:
    """(low, low exclusive, high, high exclusive): the tightest of `minimum` /
    `exclusiveMinimum` and of `maximum` / `exclusiveMaximum` (+-inf where none), each a
    finite number of magnitude up to MAX_BOUND."""
    low, low_open, high, high_open = -math.inf, False, math.inf, False
    for key in BOUNDS:
        if key in schema:
            bound = schema[key]
            if not (isinstance(bound, int) and not isinstance(bound, bool)
                    or isinstance(bound, float) and math.isfinite(bound)):
                _refuse(f"'{key}' at {path} must be a number, got {shown(bound)}")
            if abs(bound) > MAX_BOUND:
                _refuse(f"'{key}' at {path} is not supported beyond +-10^18, got {shown(bound)}")
            opened = key.startswith("exclusive")
            if key in ("minimum", "exclusiveMinimum"):
                if bound > low or bound == low and opened:
                    low, low_open = bound, opened
            elif bound < high or bound == high and opened:
                high, high_open = bound, opened
    return low, low_open, high, high_open


def _number_format(schema: dict, kind: str, path: str) -> str | None:
    """An integer's or a number's OpenAPI `format`, if it has one we read."""
    fmt, known = schema.get("format"), INTEGER_FORMATS if kind == "integer" else NUMBER_FORMATS
    if fmt is None or isinstance(fmt, str) and fmt in known:
        return fmt
    if isinstance(fmt, str) and fmt in FORMATS and "string" in _types(schema, path):  # the string's (a date or a count)
        return None
    _refuse(f"'format' at {path}: {shown(fmt)} is not supported with type '{kind}' (only {', '.join(known)})")


def _integer(schema: dict, path: str) -> str:
    """Integers within the schema's bounds (`_bounds`) and its format's range."""
    low, low_open, high, high_open = _bounds(schema, path)
    if (fmt := _number_format(schema, "integer", path)) is not None:
        least, most = INTEGER_FORMATS[fmt]
        low, low_open = (least, False) if low < least else (low, low_open)
        high, high_open = (most, False) if high > most else (high, high_open)
    if low == -math.inf and high == math.inf:
        return INTEGER
    low = low if low == -math.inf else math.floor(low) + 1 if low_open else math.ceil(low)
    high = high if high == math.inf else math.ceil(high) - 1 if high_open else math.floor(high)
    if low > high:
        _refuse(f"the bounds at {path} leave no integer")
    parts = []
    if high >= 0:  # 0 .. high
        parts.append(_naturals(max(low, 0), None if high == math.inf else high))
    if low < 0:  # -|low| .. -1: a minus sign and 1 .. |low| (never -0)
        parts.append("-" + _naturals(max(-high, 1), None if low == -math.inf else -low))
    return _alt(parts, path)


ANY_FRACTION, ZERO_FRACTION, NONZERO_FRACTION = "(?:\\.[0-9]+)?", "(?:\\.0+)?", "\\.[0-9]*[1-9][0-9]*"


def _number(schema: dict, path: str) -> str:
    """Numbers within the schema's bounds, which must be whole numbers; a bounded number is
    written without an exponent (a regex cannot bound one), and never as -0."""
    _number_format(schema, "number", path)
    low, low_open, high, high_open = _bounds(schema, path)
    if low == -math.inf and high == math.inf:
        return NUMBER
    for key in (k for k in BOUNDS if k in schema):  # in BOUNDS' order: the same one named every run
        if schema[key] != math.floor(schema[key]):
            _refuse(f"'{key}' at {path} is not supported on a number unless it is a whole number, "
                    f"got {shown(schema[key])}")
    low, high = (b if math.isinf(b) else int(b) for b in (low, high))
    # values >= 0, written without a sign; values < 0: a minus sign and a magnitude above 0
    plus = _magnitudes(max(low, 0), low_open and low >= 0, high, high_open)
    minus = _magnitudes(max(-high, 0), high_open or high >= 0, -low, low_open)
    parts = [p for p in (plus, minus and "-" + minus) if p]
    if not parts:
        _refuse(f"the bounds at {path} leave no number")
    return _alt(parts, path)


def _magnitudes(a: int, a_open: bool, b: float, b_open: bool) -> str | None:
    """Unsigned numerals with an optional fraction ("n" or "n.ddd") of a value v with
    a <= v <= b (a strict where *_open; b may be inf), 0 <= a; None if there is none."""
    if a > b or a == b and (a_open or b_open):
        return None
    pieces = []  # (integer part's regex, fraction's regex)
    if a == b:
        pieces.append((str(a), ZERO_FRACTION))
    else:
        pieces.append((str(a), NONZERO_FRACTION if a_open else ANY_FRACTION))
        if b == math.inf or a + 1 <= b - 1:
            pieces.append((_naturals(a + 1, None if b == math.inf else b - 1), ANY_FRACTION))
        if b != math.inf and not b_open:
            pieces.append((str(b), ZERO_FRACTION))
    return _alt(n + f for n, f in pieces)


def _naturals(low: int, high: int | None) -> str:
    """The numerals, without leading zeros, of low <= n <= high (no upper bound: None)."""
    if high is None and low <= 1:
        return NATURAL if low == 0 else "[1-9][0-9]*"
    top = len(str(high)) if high is not None else len(str(low))
    parts = []
    for digits in range(len(str(low)), top + 1):  # by length: each a range of equal-length numerals
        first = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        last = 10 ** digits - 1 if high is None else min(high, 10 ** digits - 1)
        if first <= last:
            parts += _equal_length_numerals(str(first), str(last))
    if high is None:  # every longer numeral
        parts.append("[1-9]" + _repeat("[0-9]", top, None))
    return _alt(parts)


def _equal_length_numerals(first: str, last: str) -> list[str]:
    """Alternatives that match exactly the numerals first..last, all of len(first) digits."""
    if not first:
        return [""]
    rest = len(first) - 1
    if first[1:] == "0" * rest and last[1:] == "9" * rest:  # whole blocks of the leading digit
        return [_digits(first[0], last[0]) + _repeat("[0-9]", rest, rest)]
    if first[0] == last[0]:
        return [first[0] + _alt(_equal_length_numerals(first[1:], last[1:]))]
    # first..x99..9, then whole blocks of leading digits, then y00..0..last (a part that is
    # a whole block joins the middle)
    lead, end = int(first[0]), int(last[0])
    mid_lo = lead if first[1:] == "0" * rest else lead + 1
    mid_hi = end if last[1:] == "9" * rest else end - 1
    parts = [] if mid_lo == lead else _equal_length_numerals(first, first[0] + "9" * rest)
    if mid_lo <= mid_hi:
        parts += _equal_length_numerals(str(mid_lo) + "0" * rest, str(mid_hi) + "9" * rest)
    return parts + ([] if mid_hi == end else _equal_length_numerals(last[0] + "0" * rest, last))


def _digits(a: str, b: str) -> str:
    return a if a == b else f"[{a}-{b}]"


def _string_contents(schema: dict, path: str) -> str:
    given = [k for k in ("format", "pattern", "minLength", "maxLength") if k in schema]
    if given and given[0] in ("format", "pattern") and len(given) > 1:
        _refuse(f"'{given[1]}' at {path} next to '{given[0]}' is not supported")
    if "format" in schema:
        if not isinstance(schema["format"], str) or schema["format"] not in FORMATS:
            _refuse(f"'format' at {path}: {shown(schema['format'])} is not supported (only {', '.join(FORMATS)})")
        return FORMATS[schema["format"]]
    if "pattern" in schema:
        return _pattern(schema["pattern"], f"'pattern' at {path}")
    lo, hi = _count(schema, "minLength", path) or 0, _count(schema, "maxLength", path)
    if hi is not None and hi < lo:
        _refuse(f"'maxLength' at {path} is below 'minLength'")
    return _repeat(STRING_CHAR, lo, hi)


ANY = r"[\s\S]*"  # any text, less what a JSON string escapes (`restricted` takes it out)


def _pattern(pattern, where: str) -> str:
    """A `pattern` as the regex of a JSON string's contents: its texts without the
    characters a JSON string must escape, so that they are written as they are."""
    if not isinstance(pattern, str):
        _refuse(f"{where} must be a string, got {shown(pattern)}")
    written, starts = pattern, pattern.startswith("^")
    ends = pattern.endswith("$") and (len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))) % 2 == 0
    if not starts and not ends:  # it matches anywhere in the string, as JSON Schema reads it
        pattern = f"^{ANY}(?:{pattern}){ANY}$"
    else:  # anchored on one side: the other side may hold anything
        pattern = ("" if starts else f"^{ANY}") + pattern + ("" if ends else f"{ANY}$")
    try:
        restricted(written, JSON_ESCAPED)  # alone first: refused in its own terms, and a stray ')' closes none of ours
        regex, alternatives = restricted(pattern, JSON_ESCAPED)
    except UsageError as e:
        _refuse(f"{where}: {e}")
    if alternatives:
        _refuse(f"{where}: put alternatives in a group, ^(?:a|b)$ (^a|b$ anchors each one separately)")
    return regex
