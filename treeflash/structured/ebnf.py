"""EBNF grammars (llama.cpp's GBNF, the dialect xgrammar and vLLM take) to regexes.

A grammar is rules `name ::= expression`, `root` first to match: string literals "...",
character classes [...] and [^...], `.` (any character), rule names, grouping ( ),
alternation |, and the quantifiers * + ? {m} {m,} {m,n}; `#` starts a comment. Rules
may span lines: a rule ends where the next `name ::=` begins.

The engine constrains text with finite automata, so a recursive rule (a nested
expression, a JSON value) is unrolled: a text's derivation may be inside one rule at
most MAX_DEPTH times at once (a parenthesised expression in an expression in an
expression in an expression), and deeper nesting is not allowed, as `json_object`
bounds JSON's. Where that automaton is too large (`TooComplex`), the grammar is
unrolled less deep, down to 1 (no recursion), before it is refused.
"""
from __future__ import annotations

import re

from treeflash.errors import UsageError, shown
from treeflash.structured.regex import (MAX_PATTERN_CHARS, NOTHING, ByteDFA, TooComplex, char_class, compile_unrolled,
                                        escape, repeat_bounds)

MAX_DEPTH = 4            # times one derivation may be inside a rule at once

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_RULE_START = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_-]*)\s*::=")
# how a Lark grammar's lines open: a rule `name:`, `?name:`, `!name:` or `name.2:`, a
# `%import` or `%ignore`, a `//` comment
_LARK = re.compile(r"\s*(?:[?!]?\w+(?:\.-?[0-9]+)?\s*:(?!:=)|%[a-z]+\b|//)")
_BOUNDS = re.compile(r"\{\s*([0-9]*)\s*(,?)\s*([0-9]*)\s*\}")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]", "-": "-",
            "/": "/", "0": "\0", "f": "\f", "v": "\v", "^": "^"}


class _Parser:
    """Recursive descent to a tree: ("lit", text), ("class", negated, [(lo, hi)]), ("any",),
    ("ref", name), ("cat", items), ("alt", items), ("rep", item, min, max or None)."""

    def __init__(self, text: str):
        self.s, self.i = text, 0

    def fail(self, why: str):
        line = self.s.count("\n", 0, self.i) + 1
        raise UsageError(f"grammar: {why} (line {line})")

    def space(self):
        while self.i < len(self.s):
            if self.s[self.i].isspace():
                self.i += 1
            elif self.s[self.i] == "#":
                end = self.s.find("\n", self.i)
                self.i = len(self.s) if end < 0 else end
            else:
                return

    def rules(self) -> dict[str, tuple]:
        rules: dict[str, tuple] = {}
        self.space()
        while self.i < len(self.s):
            m = _RULE_START.match(self.s, self.i)
            if not m:
                self.fail("expected a rule `name ::= ...`" + (" (Lark's `name: ...` is not this dialect)"
                                                              if _LARK.match(self.s, self.i) else ""))
            name = m.group(1)
            if name in rules:
                self.fail(f"rule {name!r} is defined twice")
            self.i = m.end()
            rules[name] = self.alternation()
            self.space()
        return rules

    def alternation(self):
        items = [self.sequence()]
        while True:
            self.space()
            if self.peek() != "|":
                return items[0] if len(items) == 1 else ("alt", items)
            self.i += 1
            items.append(self.sequence())

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def sequence(self):
        items = []
        while True:
            self.space()
            c = self.peek()
            if not c or c in "|)" or _RULE_START.match(self.s, self.i):
                return ("cat", items)
            items.append(self.quantified(self.atom()))

    def quantified(self, node):
        while True:
            self.space()
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (m := _BOUNDS.match(self.s, self.i)) and (m.group(1) or m.group(2)):
                self.i = m.end()
                lo, hi = repeat_bounds(*m.group(1, 2, 3), self.fail)
            else:
                return node
            node = ("rep", node, lo, hi)

    def atom(self):
        c = self.peek()
        if c in ('"', "'"):
            return ("lit", self.string(c))
        if c == "[":
            return self.class_node()
        if c == ".":
            self.i += 1
            return ("any",)
        if c == "(":
            self.i += 1
            node = self.alternation()
            self.space()
            if self.peek() != ")":
                self.fail("missing ')'")
            self.i += 1
            return node
        m = _NAME.match(self.s, self.i)
        if not m:
            self.fail(f"unexpected {shown(c)}")
        self.i = m.end()
        return ("ref", m.group(0))

    def char(self, end: str) -> str:
        """One character of a literal or class, escapes read."""
        c = self.peek()
        if not c or c == "\n" and end != "]":
            self.fail(f"missing closing {end}")
        self.i += 1
        if c != "\\":
            return c
        e = self.peek()
        self.i += 1
        if e in _ESCAPES:
            return _ESCAPES[e]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        digits = self.s[self.i:self.i + (width or 0)]
        if width and len(digits) == width and all(d in "0123456789abcdefABCDEF" for d in digits):
            self.i += width
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                self.fail(f"\\{e}{digits} is not a character")
            return chr(code)
        self.fail(f"unknown escape \\{e}")

    def string(self, quote: str) -> str:
        self.i += 1
        out = []
        while self.peek() != quote:
            out.append(self.char(quote))
        self.i += 1
        return "".join(out)

    def class_node(self):
        self.i += 1
        negated = self.peek() == "^"
        self.i += negated
        ranges = []
        while self.peek() != "]":
            lo = self.char("]")
            if self.peek() == "-" and self.s[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self.char("]")
                if hi < lo:
                    self.fail("a class range out of order")
                ranges.append((ord(lo), ord(hi)))
            else:
                ranges.append((ord(lo), ord(lo)))
        self.i += 1
        if not ranges:
            self.fail("an empty character class")
        return ("class", negated, ranges)


def grammar_automaton(text: str, reasoning: tuple[str | None, str] | None = None) -> ByteDFA:
    """The byte DFA of the grammar (after `reasoning`, as `compile_regex`'s), unrolled
    MAX_DEPTH deep, or as deep as fits the automaton's limits."""
    rules = _rules(text)
    return compile_unrolled(lambda depth: _unrolled(rules, depth), MAX_DEPTH if _recursive(rules) else 1, reasoning)


def grammar_regex(text: str, depth: int = MAX_DEPTH) -> str:
    """The regex (of `treeflash.structured.regex`'s dialect) of the texts that the
    grammar's `root` derives inside no rule more than `depth` times at once."""
    return _unrolled(_rules(text), depth)


def _rules(text: str) -> dict[str, tuple]:
    """The grammar's rules, checked: a root, and every rule used defined."""
    if not isinstance(text, str) or not text.strip():
        raise UsageError(f"grammar must be a non-empty string, got {shown(text)}")
    try:
        rules = _Parser(text).rules()
    except RecursionError:
        raise UsageError("grammar nests too deeply") from None
    if "root" not in rules:
        raise UsageError("grammar has no `root` rule (the rule the whole text must match)")
    for name, body in rules.items():
        for ref in _refs(body):
            if ref not in rules:
                raise UsageError(f"grammar: rule {name!r} uses {ref!r}, which no rule defines")
    return rules


def _reach(rules: dict[str, tuple]) -> dict[str, set[str]]:
    """The rules each rule's derivations use (itself, where it is recursive)."""
    uses = {name: set(_refs(body)) for name, body in rules.items()}
    reach = {}
    for start in rules:
        seen, todo = set(), list(uses[start])
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += uses[name]
        reach[start] = seen
    return reach


def _recursive(rules: dict[str, tuple]) -> bool:
    return any(name in used for name, used in _reach(rules).items())


def _unrolled(rules: dict[str, tuple], depth: int) -> str:
    # a rule's text depends on the nesting of the rules it uses only: written once per such
    # nesting, however often it is used
    memo: dict[tuple, str] = {}
    reach = _reach(rules)

    def joined(items, nesting: dict[str, int], sep: str) -> str:
        parts, size = [], 0
        for item in items:  # the size is checked as it grows (100 uses of a large rule were 54 s)
            parts.append(written(item, nesting))
            size += len(parts[-1]) + len(sep)
            if size > MAX_PATTERN_CHARS:
                too_large()
        return sep.join(parts)

    def too_large():
        raise TooComplex(f"grammar is too large once its recursion is unrolled {depth} deep (over "
                         f"{MAX_PATTERN_CHARS} characters of pattern)")

    def written(node, nesting: dict[str, int]) -> str:
        kind = node[0]
        if kind == "lit":
            out = escape(node[1])
        elif kind == "any":
            out = r"[\s\S]"
        elif kind == "class":
            out = char_class(node[2], negated=node[1])
        elif kind == "cat":
            out = joined(node[1], nesting, "")
        elif kind == "alt":
            out = "(?:" + joined(node[1], nesting, "|") + ")"
        elif kind == "rep":
            _, item, lo, hi = node
            bounds = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
            if bounds is None:
                bounds = "{%d}" % lo if hi == lo else "{%d,%s}" % (lo, "" if hi is None else hi)
            out = "(?:" + written(item, nesting) + ")" + bounds
        else:  # a rule: inlined, unless this derivation is already `depth` deep in it
            name = node[1]
            if nesting.get(name, 0) >= depth:
                return NOTHING
            key = (name, tuple(sorted((k, n) for k, n in nesting.items() if k in reach[name] or k == name)))
            if key not in memo:
                memo[key] = "(?:" + written(rules[name], {**nesting, name: nesting.get(name, 0) + 1}) + ")"
            out = memo[key]
        if len(out) > MAX_PATTERN_CHARS:
            too_large()
        return out

    try:
        return written(("ref", "root"), {})
    except RecursionError:  # a chain of rules longer than Python's stack: a shallower unrolling may fit
        raise TooComplex(f"grammar nests too deeply once its recursion is unrolled {depth} deep") from None


def _refs(node):
    kind = node[0]
    if kind == "ref":
        yield node[1]
    elif kind in ("cat", "alt"):
        for item in node[1]:
            yield from _refs(item)
    elif kind == "rep":
        yield from _refs(node[1])

