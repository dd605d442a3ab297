"""Regular expressions to minimal DFAs over UTF-8 bytes.

Structured outputs constrain a request's text to a regular language. The engine needs
it as a deterministic automaton over the bytes that tokens stand for, so that every
token's effect on every state can be tabulated once (`treeflash.structured.grammar`).
Python's `re` has no automaton to give, so this module parses a subset of its syntax
and builds one: Thompson NFA, subset construction over byte classes, Moore minimisation.

The dialect (a pattern always matches the whole text):
literals and escaped punctuation; \\n \\t \\r \\f \\v \\0 \\xHH \\uHHHH \\UHHHHHHHH;
\\d \\w \\s and their negations (ECMA-262's meanings, which JSON Schema's patterns use:
\\d and \\w ASCII, \\s Unicode's white space and line terminators); `.` (any character
but newline); classes [...] and [^...]; groups ( ), (?: ), (?P<name> );
alternation; quantifiers * + ? {m} {m,} {,n} {m,n}, greedy or lazy (the same language),
one per atom (a second is "multiple repeat", as in Python's re).
A leading ^ and a trailing $ are allowed and mean nothing more. Refused, with the
reason: other anchors, backreferences, lookarounds, inline flags, possessive quantifiers.

A thinking model's answer may put its reasoning before the constrained text
(`compile_regex`'s `reasoning`): free text up to the first closing tag, a language no
pattern of this dialect can write without lookarounds, built as its own automaton.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from treeflash.errors import UsageError, shown

MAX_CODE = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: UTF-8 has no encoding for them
MAX_REPEAT = 1000              # a bound past this in {m,n} is refused (the automaton copies the item)
MAX_DFA_STATES = 20000         # a pattern whose automaton grows past this is refused
MAX_NFA_STATES = 200000        # and one whose repetitions expand past this, before any is built
# and one that would take seconds to build (deterministic budgets, in units of NFA states
# visited per byte class, and of DFA cells compared per minimisation round)
MAX_SUBSET_WORK = 20_000_000
MAX_MINIMIZE_WORK = 25_000_000
MAX_PATTERN_CHARS = 1_000_000  # a longer pattern is refused before it is parsed (10M took 22 s)

_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
# ECMA-262's \s (JSON Schema's patterns are ECMA's): white space and line terminators, Unicode's
# too, so that \S never takes a no-break or ideographic space for a letter
_SPACE = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000), (0xFEFF, 0xFEFF)]
# what str.lstrip removes (Unicode whitespace): the reasoning parser drops it after the closing tag
_PY_SPACE = [(0x09, 0x0D), (0x1C, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
             (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]
_ECMA_LINE_ENDS = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]  # what `.` is not, in ECMA-262
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
_SPECIAL = set("\\.^$*+?()[]{}|-/")
_QUANTIFIER = re.compile(r"\{([0-9]*)(,?)([0-9]*)\}")  # ASCII digits: a{٣} is the text a{٣}


def repeat_bounds(low: str, comma: str, high: str, fail) -> tuple[int, int | None]:
    """(m, n or None) of a quantifier {m}, {m,}, {,n} or {m,n} from its digits, or
    `fail(why)`. A bound of more than 6 digits is past MAX_REPEAT unread (int() refuses
    over 4300 digits, with advice about sys.set_int_max_str_digits)."""
    def bound(digits: str) -> int:
        return int(digits) if len(digits) <= 6 else MAX_REPEAT + 1
    lo = bound(low or "0")
    hi = lo if not comma else (bound(high) if high else None)
    if max(lo, hi or 0) > MAX_REPEAT:
        fail(f"a repetition bound above {MAX_REPEAT}")
    if hi is not None and hi < lo:
        fail("a repetition {m,n} with n < m")
    return lo, hi


NOTHING = "[^\\s\\S]"  # a class no character is in: the empty language (a recursion cut off, say)


class TooComplex(UsageError):
    """A pattern past the automaton's size limits (a grammar unrolls less deep, then).
    `trouble` says what is wrong without quoting the pattern, for the error of a
    constraint the pattern was made from (a schema, a choice, a grammar), which the user
    never saw as a regex."""

    def __init__(self, message: str, trouble: str | None = None):
        super().__init__(message)
        self.trouble = trouble


def _too_complex(pattern: str, detail: str) -> TooComplex:
    return TooComplex(f"regex {shown(pattern, 60)} is too complex ({detail})", f"is too complex ({detail})")


def _normal(ranges) -> list[tuple[int, int]]:
    """Sorted, merged code point intervals, surrogates taken out."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
    return [(a, b) for a, b in out]


def _complement(ranges) -> list[tuple[int, int]]:
    out, at = [], 0
    for lo, hi in _normal(ranges):
        if lo > at:
            out.append((at, lo - 1))
        at = hi + 1
    if at <= MAX_CODE:
        out.append((at, MAX_CODE))
    return _normal(out)


class _Parser:
    """Recursive descent to a small tree: ("set", ranges), ("cat", items),
    ("alt", items), ("rep", item, min, max or None). (`compile_regex` adds ("until",
    text): any text up to and with the first `text`.) `ecma`: a JSON Schema pattern, read
    as ECMA-262 reads it where that differs from Python's re: `.` is no line terminator
    (\\n \\r U+2028 U+2029), `[]` matches nothing and `[^]` any character (Python reads a
    `]` there as a member), and {,n} (text in ECMA, a repetition in Python) is refused."""

    def __init__(self, pattern: str, ecma: bool = False):
        self.p, self.i, self.ecma = pattern, 0, ecma

    def fail(self, why: str):
        raise UsageError(f"regex {shown(self.p, 60)}: {why} (at character {self.i})")

    def peek(self, k: int = 0) -> str:
        return self.p[self.i + k] if self.i + k < len(self.p) else ""

    def parse(self):
        if self.peek() == "^":
            self.i += 1
        node = self.alternation()
        if self.i < len(self.p):
            self.fail("unbalanced ')'")
        return node

    def alternation(self):
        items = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            items.append(self.sequence())
        return items[0] if len(items) == 1 else ("alt", items)

    def sequence(self):
        items = []
        while self.peek() not in ("", "|", ")"):
            if self.peek() == "$" and self.i == len(self.p) - 1:  # the trailing anchor
                self.i += 1
                break
            items.append(self.quantified(self.atom()))
        return ("cat", items)

    def quantified(self, node):
        """`node` under its quantifier, if one follows. One only: a second ("a**",
        "a{2}*") is an error, as in Python's re and ECMAScript (group it to repeat a
        repetition)."""
        if not (q := self.quantifier()):
            return node
        if self.peek() == "?":    # lazy: the same language
            self.i += 1
        elif self.peek() == "+":
            self.fail("possessive quantifiers are not supported")
        if self.quantifier():
            self.fail("multiple repeat (put the repeated part in a group)")
        return ("rep", node, *q)

    def quantifier(self):
        """(min, max or None) of the quantifier at the cursor, consumed; None if none."""
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        if c == "{" and (m := _QUANTIFIER.match(self.p, self.i)) and (m.group(1) or m.group(2)):
            if self.ecma and not m.group(1):
                self.fail("{,n} is text in a JSON Schema pattern (ECMA-262), not a repetition: write {0,n}")
            bounds = repeat_bounds(*m.group(1, 2, 3), self.fail)
            self.i = m.end()
            return bounds
        return None

    def atom(self):
        c = self.peek()
        self.i += 1
        if c == "(":
            if self.peek() == "?":
                if self.p.startswith("?:", self.i):
                    self.i += 2
                elif (m := re.compile(r"\?P<[A-Za-z_]\w*>").match(self.p, self.i)):
                    self.i = m.end()
                else:
                    self.fail("only (?: ) and (?P<name> ) groups are supported (no lookaround or flags)")
            node = self.alternation()
            if self.peek() != ")":
                self.fail("missing ')'")
            self.i += 1
            return node
        if c in ("*", "+", "?") or (c == "{" and (m := _QUANTIFIER.match(self.p, self.i - 1))
                                    and (m.group(1) or m.group(2))):
            self.fail("nothing to repeat")
        if c in ("^", "$"):
            self.fail("anchors are only allowed at the start (^) and the end ($)")
        if c == "[":
            return ("set", self.char_class())
        if c == ".":
            return ("set", _complement(_ECMA_LINE_ENDS if self.ecma else [(0x0A, 0x0A)]))
        if c == "\\":
            return ("set", self.escape(in_class=False))
        return ("set", self.char(ord(c)))

    def char(self, code: int) -> list[tuple[int, int]]:
        """One code point as a set; a surrogate is no character (UTF-8 cannot write it)."""
        if SURROGATES[0] <= code <= SURROGATES[1]:
            self.fail(f"U+{code:04X} is a surrogate, not a character")
        return [(code, code)]

    def escape(self, in_class: bool) -> list[tuple[int, int]]:
        c = self.peek()
        self.i += 1
        if not c:
            self.fail("a trailing backslash")
        if c.lower() in _CLASS_ESCAPES:
            ranges = _CLASS_ESCAPES[c.lower()]
            return ranges if c.islower() else _complement(ranges)
        if c == "0" and self.peek().isdigit():
            self.fail("octal escapes are not supported (write \\xHH)")
        if c in _CHAR_ESCAPES:
            return [(ord(_CHAR_ESCAPES[c]),) * 2]
        if c == "b" and in_class:
            return [(8, 8)]
        if c in ("x", "u", "U"):
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.p[self.i:self.i + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{c} needs {width} hex digits")
            self.i += width
            code = int(digits, 16)
            if code > MAX_CODE:
                self.fail(f"\\{c}{digits} is not a character")
            return self.char(code)
        if c.isdigit():
            self.fail("backreferences and octal escapes are not supported (write \\xHH for a character)")
        if c.isalnum():
            why = ("word boundaries and other anchors are not regular here" if c in "AbBGZz" else
                   "Unicode properties, names and control escapes are not read here: write the characters "
                   "or \\uHHHH" if c in "pPNce" else "not an escape of this dialect")
            self.fail(f"\\{c} is not supported ({why})")
        return self.char(ord(c))

    def char_class(self) -> list[tuple[int, int]]:
        negate = self.peek() == "^"
        self.i += negate
        ranges, first = [], not self.ecma  # ECMA-262: [] matches nothing and [^] any character
        while True:
            c = self.peek()
            if not c:
                self.fail("missing ']'")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            item = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                end = self.class_item()
                if len(item) != 1 or len(end) != 1 or item[0][0] != item[0][1] or end[0][0] != end[0][1]:
                    self.fail("a class range needs single characters at both ends")
                if end[0][0] < item[0][0]:
                    self.fail("a class range out of order")
                item = [(item[0][0], end[0][0])]
            ranges += item
        return _complement(ranges) if negate else _normal(ranges)

    def class_item(self) -> list[tuple[int, int]]:
        c = self.peek()
        self.i += 1
        if c == "\\":
            return self.escape(in_class=True)
        return self.char(ord(c))


def _size(node) -> int:
    """About how many NFA states `node` builds (a set: a few per range; a repetition: its
    item times its largest count)."""
    kind = node[0]
    if kind == "set":
        return 1 + 4 * len(node[1])
    if kind in ("cat", "alt"):
        return 1 + sum(_size(item) for item in node[1])
    if kind == "until":
        return (len(node[1]) + 1) * (6 + 4 * len(set(node[1])))
    _, item, lo, hi = node
    return 2 + _size(item) * max(lo, hi or 0, 1)


# --- code points to UTF-8 byte ranges ---

def _utf8(code: int) -> list[int]:
    if code < 0x80:
        return [code]
    if code < 0x800:
        return [0xC0 | code >> 6, 0x80 | code & 0x3F]
    if code < 0x10000:
        return [0xE0 | code >> 12, 0x80 | code >> 6 & 0x3F, 0x80 | code & 0x3F]
    return [0xF0 | code >> 18, 0x80 | code >> 12 & 0x3F, 0x80 | code >> 6 & 0x3F, 0x80 | code & 0x3F]


def _byte_sequences(lo: int, hi: int):
    """Sequences of byte ranges whose products are exactly the encodings of lo..hi."""
    for a, b in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CODE)):
        if lo <= b and hi >= a:
            yield from _same_length(max(lo, a), min(hi, b))


def _same_length(lo: int, hi: int):
    """lo..hi encode to the same length: split until each piece is a product of ranges
    (the free low bits of a piece span whole continuation bytes)."""
    for tail in range(1, len(_utf8(lo))):
        mask = (1 << 6 * tail) - 1
        if lo & ~mask != hi & ~mask:
            if lo & mask:
                yield from _same_length(lo, lo | mask)
                yield from _same_length((lo | mask) + 1, hi)
                return
            if hi & mask != mask:
                yield from _same_length(lo, (hi & ~mask) - 1)
                yield from _same_length(hi & ~mask, hi)
                return
    yield list(zip(_utf8(lo), _utf8(hi)))


# --- NFA, DFA ---

class _NFA:
    """Thompson construction: byte-range edges and epsilon edges."""

    def __init__(self):
        self.edges: list[list[tuple[int, int, int]]] = []
        self.eps: list[list[int]] = []

    def state(self) -> int:
        self.edges.append([])
        self.eps.append([])
        return len(self.eps) - 1

    def build(self, node, start: int) -> int:
        """Add `node` from `start`; its end state."""
        kind = node[0]
        if kind == "set":
            end = self.state()
            for lo, hi in node[1]:
                for seq in _byte_sequences(lo, hi):
                    at = start
                    for k, (a, b) in enumerate(seq):
                        nxt = end if k == len(seq) - 1 else self.state()
                        self.edges[at].append((a, b, nxt))
                        at = nxt
            return end
        if kind == "cat":
            for item in node[1]:
                start = self.build(item, start)
            return start
        if kind == "alt":
            end = self.state()
            for item in node[1]:
                self.eps[self.build(item, start)].append(end)
            return end
        if kind == "until":  # Knuth-Morris-Pratt: state i = the text ends with word[:i], and not before
            word = node[1]
            here = [self.state() for _ in word] + [self.state()]
            self.eps[start].append(here[0])  # its own first state: the loops back must not reach start's
            others = _complement([(ord(c), ord(c)) for c in set(word)])
            for i in range(len(word)):
                for c in set(word):
                    seen = word[:i] + c
                    k = next(k for k in range(len(seen), -1, -1) if seen.endswith(word[:k]))
                    self.eps[self.build(("set", [(ord(c), ord(c))]), here[i])].append(here[k])
                self.eps[self.build(("set", others), here[i])].append(here[0])
            return here[-1]
        _, item, lo, hi = node
        for _ in range(lo):
            start = self.build(item, start)
        if hi is None:  # a loop: start -> item -> start
            loop = self.state()
            self.eps[start].append(loop)
            self.eps[self.build(item, loop)].append(loop)
            return loop
        end = self.state()
        for _ in range(hi - lo):
            self.eps[start].append(end)
            start = self.build(item, start)
        self.eps[start].append(end)
        return end

    def closure(self, states) -> frozenset[int]:
        seen, todo = set(states), list(states)
        while todo:
            for t in self.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)


@dataclass(frozen=True)
class ByteDFA:
    """trans [S, 256] int32 (-1: no match can continue), accepting [S] bool; start 0.
    Minimal, and every state can still reach an accepting one."""

    trans: np.ndarray
    accepting: np.ndarray

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    def matches(self, data: bytes) -> bool:
        s = 0
        for byte in data:
            s = int(self.trans[s, byte])
            if s < 0:
                return False
        return bool(self.accepting[s])


def compile_unrolled(regex_at, depth: int, reasoning: tuple[str | None, str] | None = None) -> "ByteDFA":
    """`compile_regex` of `regex_at(depth)`: a recursive grammar or schema unrolled `depth`
    deep, or less deep where that is too large (TooComplex), so that its depth alone never
    refuses it (pass 1 where nothing recurses: depth then changes nothing)."""
    for d in range(depth, 0, -1):
        try:
            return compile_regex(regex_at(d), reasoning)
        except TooComplex:
            if d == 1:
                raise


def compile_regex(pattern: str, reasoning: tuple[str | None, str] | None = None) -> ByteDFA:
    """The minimal DFA of texts that `pattern` matches whole. With `reasoning` (opening,
    closing tag): texts that first hold reasoning, then whitespace, then a match: the
    reasoning is any text up to and with the first closing tag; with an opening tag it
    must start with that tag, and a text that does not is a match alone."""
    if not isinstance(pattern, str):
        raise UsageError(f"a regex must be a string, got {shown(pattern)}")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise TooComplex(f"regex {shown(pattern, 60)} is too long ({len(pattern)} characters, over "
                         f"{MAX_PATTERN_CHARS})", f"is too complex (a pattern of {len(pattern)} characters, over "
                                                f"{MAX_PATTERN_CHARS})")
    try:
        tree = _Parser(pattern).parse()
        if reasoning is not None:
            opening, closing = reasoning
            thought = ("cat", [*(("set", [(ord(c), ord(c))]) for c in opening or ""), ("until", closing),
                               ("rep", ("set", _PY_SPACE), 0, None)])
            tree = ("cat", [thought if opening is None else ("rep", thought, 0, 1), tree])
        if _size(tree) > MAX_NFA_STATES:  # repetitions nest: the automaton would copy items past any bound
            raise _too_complex(pattern, f"it expands past {MAX_NFA_STATES} states: repetitions and alternatives "
                                        f"multiply them")
    except RecursionError:
        raise TooComplex(f"regex {shown(pattern, 60)} nests too deeply", "nests too deeply") from None
    nfa = _NFA()
    start = nfa.state()
    final = nfa.build(tree, start)
    # byte classes: bytes no edge tells apart move alike
    cuts = sorted({0, 256} | {x for edges in nfa.edges for a, b, _ in edges for x in (a, b + 1)})
    reps = cuts[:-1]  # one byte per class
    first = nfa.closure([start])
    index, sets, rows, work = {first: 0}, [first], [], 0
    while len(rows) < len(sets):
        here = sets[len(rows)]
        work += len(here) * len(reps)
        if work > MAX_SUBSET_WORK:
            raise _too_complex(pattern, "its automaton takes too long to build")
        row = []
        for byte in reps:
            moved = [t for s in here for a, b, t in nfa.edges[s] if a <= byte <= b]
            if not moved:
                row.append(-1)
                continue
            nxt = nfa.closure(moved)
            if nxt not in index:
                if len(sets) >= MAX_DFA_STATES:
                    raise _too_complex(pattern, f"over {MAX_DFA_STATES} states")
                index[nxt] = len(sets)
                sets.append(nxt)
            row.append(index[nxt])
        rows.append(row)
    by_class = np.array(rows, dtype=np.int64).reshape(len(sets), len(reps))
    accepting = np.array([final in s for s in sets])
    trans, accepting = _minimal(by_class, accepting, pattern)
    owner = np.searchsorted(np.array(cuts), np.arange(256), side="right") - 1  # byte -> class
    return ByteDFA(trans[:, owner].astype(np.int32), accepting)


def edges(trans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct edges (sources, targets) of a transition table [S, C] (-1: none),
    sorted by source. A token table's rows repeat a few targets over the whole
    vocabulary: sorted a block of rows at a time (all at once, 16384 states x 4096
    tokens took 2 GB of indices)."""
    S, C = trans.shape
    keys = [np.empty(0, dtype=np.int64)]
    step = max(1, (1 << 22) // max(C, 1))
    for r0 in range(0, S, step):
        block = trans[r0:r0 + step]
        src, col = np.nonzero(block >= 0)
        keys.append(np.unique((src + r0).astype(np.int64) * S + block[src, col]))
    key = np.concatenate(keys)
    return key // S, key % S


def searched(start: np.ndarray, frm: np.ndarray, to: np.ndarray, n: int) -> np.ndarray:
    """[n] bool: the states that edges frm -> to lead to from `start` (a graph search, each
    state's edges once)."""
    order = np.argsort(frm, kind="stable")
    frm, to = frm[order], to[order]
    bounds = np.searchsorted(frm, np.arange(n + 1)).tolist()
    to = to.tolist()
    seen = start.tolist()
    todo = np.nonzero(start)[0].tolist()
    while todo:
        s = todo.pop()
        for t in to[bounds[s]:bounds[s + 1]]:
            if not seen[t]:
                seen[t] = True
                todo.append(t)
    return np.array(seen, dtype=bool)


def live_states(trans: np.ndarray, accepting: np.ndarray) -> np.ndarray:
    """[S] bool: the states from which some path of transitions reaches an accepting one."""
    src, dst = edges(trans)
    return searched(accepting.astype(bool), dst, src, len(trans))


def reachable_states(trans: np.ndarray) -> np.ndarray:
    """[S] bool: the states some path from state 0 reaches."""
    src, dst = edges(trans)
    start = np.zeros(len(trans), dtype=bool)
    start[0] = True
    return searched(start, src, dst, len(trans))


def prune(trans: np.ndarray, accepting: np.ndarray,
          empty: str = "the structured output's pattern matches no text") -> tuple[np.ndarray, np.ndarray]:
    """Drop the states that are unreachable or cannot reach an accepting one (edges to
    them become -1) and renumber, state 0 first. An empty language is refused (`empty`)."""
    live = live_states(trans, accepting)
    if not live[0]:
        raise UsageError(empty)
    if not live.all():
        trans = np.where((trans >= 0) & live[np.maximum(trans, 0)], trans, -1)
    keep = live & reachable_states(trans)
    if keep.all():  # as often for a token table: no copy of its S x V entries to renumber
        return trans, accepting
    new = (np.cumsum(keep) - 1).astype(trans.dtype)
    kept = trans[keep]
    return np.where(kept >= 0, new[np.maximum(kept, 0)], -1).astype(trans.dtype, copy=False), accepting[keep]


def _minimal(trans: np.ndarray, accepting: np.ndarray, pattern: str) -> tuple[np.ndarray, np.ndarray]:
    """Moore's partition refinement on the pruned automaton; the start state stays 0.
    A round per length of the longest run of states only a suffix tells apart: a
    bounded repetition of n items takes n rounds (MAX_MINIMIZE_WORK bounds them)."""
    trans, accepting = prune(trans, accepting)
    part = np.unique(accepting, return_inverse=True)[1].reshape(-1)
    work = 0
    while True:
        work += trans.size + len(trans)
        if work > MAX_MINIMIZE_WORK:
            raise _too_complex(pattern, "its automaton takes too long to minimise: long bounded repetitions")
        target = np.where(trans >= 0, part[np.maximum(trans, 0)], -1)
        refined = np.unique(np.concatenate([part[:, None], target], axis=1), axis=0,
                            return_inverse=True)[1].reshape(-1)
        if refined.max() == part.max():  # refinement only splits blocks: no new block, done
            break
        part = refined
    key = np.arange(part.max() + 1)
    key[part[0]] = -1
    relabel = np.empty_like(key)
    relabel[np.argsort(key)] = np.arange(key.size)
    block = relabel[part]
    reps = np.empty(key.size, dtype=np.int64)
    reps[block] = np.arange(len(part))  # any member stands for its block
    return np.where(trans[reps] >= 0, block[np.maximum(trans[reps], 0)], -1), accepting[reps]


# --- patterns rewritten ---

def restricted(pattern: str, excluded: list[tuple[int, int]]) -> tuple[str, bool]:
    """`pattern` with the characters `excluded` (code point intervals) taken out of every
    character set, written back in the dialect: it matches the texts `pattern` matches
    that hold none of them (a JSON string's pattern, generated without escapes). Also
    says whether its top level is an alternation (what `^a|b$` means depends on the
    anchors). A set left empty is refused: the pattern named an excluded character. Read
    as ECMA-262, as JSON Schema's patterns are (`_Parser`'s `ecma`)."""
    parser = _Parser(pattern, ecma=True)
    tree = parser.parse()
    return _written(tree, _normal(excluded), parser), tree[0] == "alt"


def escape(text: str) -> str:
    """`text` as a literal of the dialect."""
    return "".join("\\" + c if c in _SPECIAL else c if c.isprintable() else f"\\U{ord(c):08x}" for c in text)


def _written(node, excluded, parser) -> str:
    kind = node[0]
    if kind == "set":
        ranges = _normal(node[1])
        kept = _normal(r for r in _complement(excluded) for r in [(max(r[0], a), min(r[1], b)) for a, b in ranges]
                       if r[0] <= r[1])
        if ranges and not kept:
            raise UsageError(f"regex {shown(parser.p, 60)} names a character that is not allowed here "
                             f"({shown(chr(ranges[0][0]))})")
        return char_class(kept)
    if kind == "cat":
        return "".join(_written(item, excluded, parser) for item in node[1])
    if kind == "alt":
        return "(?:" + "|".join(_written(item, excluded, parser) for item in node[1]) + ")"
    _, item, lo, hi = node
    return f"(?:{_written(item, excluded, parser)}){{{lo},{'' if hi is None else hi}}}"


def char_class(ranges, negated: bool = False) -> str:
    """The dialect's set of the code point intervals `ranges` (all others with
    `negated`): one character as itself, an empty set as a class nothing is in."""
    ranges = _complement(ranges) if negated else _normal(ranges)
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _class_char(ranges[0][0])
    return "[" + "".join(_class_char(a) if a == b else f"{_class_char(a)}-{_class_char(b)}"
                         for a, b in ranges) + "]" if ranges else NOTHING


def _class_char(code: int) -> str:
    c = chr(code)
    return c if c.isalnum() and c.isascii() else f"\\U{code:08x}"
