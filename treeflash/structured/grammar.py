"""A request's structured output as a token automaton the rounds run on the device.

A constraint (a regex, a choice among strings, a JSON schema, json_object or an EBNF
grammar) becomes a minimal DFA over bytes (`treeflash.structured.regex`), then a table
over the vocabulary: for every state and token, the state after the token's bytes, or
-1 where the token would leave the language. Sampling masks the logits of a row to the
tokens its state allows, and a round finds each tree node's state from its parent's with
one table lookup, so a constrained request keeps every property of the round: one
target forward, the walk, and output equal to autoregressive decoding under the same
constraint.

End tokens (EOS, stop token ids) are allowed exactly in accepting states; special
tokens never otherwise. States from which no token sequence reaches an accepting state
are removed, so every reachable state allows at least one token.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from treeflash.errors import UsageError, is_text, shown
from treeflash.structured.regex import (ByteDFA, TooComplex, compile_regex, compile_unrolled, edges, escape, live_states,
                                        prune, searched)

# vLLM's reasoning parsers, whose answers' reasoning comes before the constrained text:
# (the tag with which the answer opens it, or None where the prompt does; the tag that
# closes it). `treeflash.server.answers` splits answers with the same tags.
REASONING_TAGS = {"qwen3": ("<think>", "</think>"), "deepseek_r1": (None, "</think>")}

MAX_INPUT_CHARS = {"regex": 100_000, "grammar": 100_000, "choice": 100_000, "json": 1_000_000}


def _check_text(name: str, text: str) -> None:
    if not is_text(text):
        raise UsageError(f"structured outputs: {name} is not valid Unicode text (it holds a lone surrogate)")


@dataclass(frozen=True)
class StructuredOutputs:
    """What a request's text must be, as vLLM's StructuredOutputsParams: exactly one of a
    JSON schema (a dict, or its JSON text), a regex (full match), a choice among strings,
    an EBNF grammar (`treeflash.structured.ebnf`: recursion unrolled MAX_DEPTH deep), or
    json_object (any JSON object nesting at most JSON_OBJECT_DEPTH deep). With
    `reasoning` (a REASONING_TAGS parser's name) the constraint holds after the answer's
    reasoning and the whitespace after it, as vLLM's with a reasoning parser: the
    reasoning itself is free (for qwen3, an answer that does not open it has none)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    reasoning: str | None = None

    def validate(self) -> "StructuredOutputs":
        if not isinstance(self.json_object, bool):
            raise UsageError(f"structured outputs: json_object must be true or false, got {shown(self.json_object)}")
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(given) != 1:
            raise UsageError(f"structured outputs take exactly one of json, regex, choice, grammar and json_object, "
                             f"got {', '.join(given) or 'none'}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise UsageError(f"structured outputs: grammar must be a string, got {shown(self.grammar)}")
        if self.reasoning is not None and (not isinstance(self.reasoning, str) or self.reasoning not in REASONING_TAGS):
            raise UsageError(f"structured outputs: reasoning must be one of {', '.join(REASONING_TAGS)}, got "
                             f"{shown(self.reasoning)}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise UsageError(f"structured outputs: regex must be a string, got {shown(self.regex)}")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) for c in self.choice)):
            raise UsageError(f"structured outputs: choice must be a non-empty list of strings, got {shown(self.choice)}")
        for i, c in enumerate(self.choice or ()):
            _check_text(f"choice[{i}]", c)
        if self.grammar is not None:
            _check_text("grammar", self.grammar)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise UsageError(f"structured outputs: json must be a JSON schema (an object, or its text), "
                             f"got {shown(self.json)}")
        text = self.json if isinstance(self.json, str) else ""
        if isinstance(self.json, dict):
            try:
                text = json.dumps(self.json)
            except (TypeError, ValueError) as e:
                raise UsageError(f"structured outputs: json is not a JSON value ({e})") from None
            except RecursionError:
                raise UsageError("structured outputs: json is nested too deeply") from None
        # past these sizes compiling (or refusing) takes seconds, which a server's other
        # requests would wait for: refused before any work
        sizes = {"regex": len(self.regex or ""), "grammar": len(self.grammar or ""),
                 "choice": sum(map(len, self.choice or ())), "json": len(text)}
        for name, size in sizes.items():
            if size > MAX_INPUT_CHARS[name]:
                raise UsageError(f"structured outputs: {name} of {size} characters is over the limit of "
                                 f"{MAX_INPUT_CHARS[name]}")
        return self

    def pattern(self, recursion: int | None = None) -> str:
        """The regex of the dialect that the text must match (not for a grammar: how deep
        it unrolls is settled as it compiles, in `automaton`; a JSON schema's recursive
        $refs unroll `recursion` deep, its MAX_RECURSION without)."""
        assert self.grammar is None, "a grammar's language is its automaton's"
        if self.regex is not None:
            return self.regex
        if self.choice is not None:
            return "(?:" + "|".join(escape(c) for c in self.choice) + ")"
        from treeflash.structured.json_schema import MAX_RECURSION, json_object_regex, schema_regex
        if self.json_object:
            return json_object_regex()
        schema = self.schema()
        _check_text("json", json.dumps(schema, ensure_ascii=False))
        return schema_regex(schema, MAX_RECURSION if recursion is None else recursion)

    def schema(self):
        """The JSON schema, read from its text where given as one."""
        if not isinstance(self.json, str):
            return self.json
        try:
            return json.loads(self.json)
        except ValueError as e:
            raise UsageError(f"structured outputs: json is not valid JSON ({e})") from None
        except RecursionError:
            raise UsageError("structured outputs: json is nested too deeply") from None

    def automaton(self) -> ByteDFA:
        """The byte DFA of the whole answer: the reasoning, if any, then the pattern."""
        tags = None if self.reasoning is None else REASONING_TAGS[self.reasoning]
        try:
            if self.grammar is not None:
                from treeflash.structured.ebnf import grammar_automaton
                return grammar_automaton(self.grammar, tags)
            if self.json is None:
                return compile_regex(self.pattern(), tags)
            from treeflash.structured.json_schema import MAX_RECURSION, recurses
            return compile_unrolled(self.pattern, MAX_RECURSION if recurses(self.schema()) else 1, tags)
        except TooComplex as e:  # said of what the user wrote, not of the regex made from it
            made_from = {"json": "the JSON schema", "choice": "the choice", "grammar": "the grammar"}
            source = next((made_from[k] for k in made_from if getattr(self, k) is not None), None)
            if source is None or e.trouble is None:
                raise
            raise TooComplex(f"structured outputs: {source} {e.trouble}") from None

    def key(self) -> str:
        """One text per constraint, for caching its automaton."""
        value = self.json
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):  # refused when compiled
                pass
        # not sorted: a schema's properties are written in their order; repr, not JSON, which
        # writes a key 1 (refused) as "1" (a valid name)
        return repr([value, self.regex, None if self.choice is None else list(self.choice), self.grammar,
                     self.json_object, self.reasoning])


@dataclass(frozen=True)
class TokenAutomaton:
    """next [S, V] int32: the state after each token (-1: not allowed), state 0 first;
    accepting [S] bool: the text so far matches (end tokens may come)."""

    next: np.ndarray
    accepting: np.ndarray
    _tables: dict = field(default_factory=dict, compare=False, repr=False)  # see `table`

    @property
    def num_states(self) -> int:
        return len(self.accepting)

    @property
    def nbytes(self) -> int:
        """Its host table and the device table kept with it."""
        return self.next.nbytes + sum(t.numel() * t.element_size() for t in list(self._tables.values()))

    def check(self, end_ids, sequences, bans: str = "bad_words ban", param: str = "bad_words") -> None:
        """Raise UsageError (one line) if a request's end tokens and bad words leave the
        text no way to be finished from its start, or from some point it can reach
        (`bans`: the error's subject, which names where the bans came from, and `param` the
        request field)."""
        V = self.next.shape[1]
        ends = [e for e in end_ids if e < V and (self.next[:, e] >= 0).any()]  # also text: no longer
        self.check_bans(sequences, with_ends(self, ends, V) if ends else self.next, bans, param)

    def check_bans(self, sequences, table: np.ndarray, bans: str = "bad_words ban", param: str = "bad_words") -> None:
        """Raise UsageError if bad words (token sequences: the last token is banned where
        the output ends with the others) let the text reach a point from which it can no
        longer be finished: there no token would be allowed, and the output would break
        the constraint. `table`: the request's, with its end tokens (`with_ends`), or
        `next` if it has none. A word of several tokens bans its last one only after the others
        ("q#" written as "q", "#" leaves a choice of "q#" stuck after "q"), so the search
        runs over the pairs (state, the longest end of the output that begins a word)
        that the text can reach, which are few: any token of no word ends every begun
        word, and its edges are shared through one node per state."""
        V = self.next.shape[1]
        words = {tuple(w) for w in sequences if w and max(w) < V}
        if not words:
            return
        begun = sorted({w[:i] for w in words for i in range(len(w))}, key=len)  # () first
        index = {p: i for i, p in enumerate(begun)}
        children: dict[tuple, set] = {}  # the tokens that continue or end a word after p
        for w in words:
            for i in range(len(w)):
                children.setdefault(w[:i], set()).add(w[i])
        tokens = sorted({t for w in words for t in w})
        column = {t: j for j, t in enumerate(tokens)}
        after = np.zeros((len(begun), len(tokens)), dtype=np.int64)  # -1: banned
        for m, p in enumerate(begun):
            for t in set().union(*(children.get(p[i:], ()) for i in range(len(p) + 1))):
                q = p + (t,)
                after[m, column[t]] = -1 if any(q[i:] in words for i in range(len(q))) else \
                    next(index[q[i:]] for i in range(len(q) + 1) if q[i:] in index)
        S, M = self.num_states, len(begun)
        others = table.copy()
        others[:, tokens] = -1
        src, dst = edges(others)  # a token of no word: the output no longer begins one
        bounds = np.searchsorted(src, np.arange(S + 1))
        at_word = table[:, tokens]  # [S, words' tokens]
        hub = M * S  # node hub + s: state s, taking a token of no word
        frm, to, seen, todo = [], [], {0}, [0]
        while todo:
            node = todo.pop()
            if node >= hub:
                s = node - hub
                nxt = dst[bounds[s]:bounds[s + 1]]
            else:
                m, s = divmod(node, S)
                nxt = np.where((at_word[s] >= 0) & (after[m] >= 0), after[m] * S + at_word[s], -1)
                nxt = nxt[nxt >= 0]
                if bounds[s + 1] > bounds[s]:
                    nxt = np.append(nxt, hub + s)
            frm.append(np.full(len(nxt), node))
            to.append(nxt)
            for n in set(nxt.tolist()) - seen:
                seen.add(n)
                todo.append(n)
        frm, to = np.concatenate(frm), np.concatenate(to)
        ends = np.zeros(hub + S, dtype=bool)
        ends[:hub] = np.tile(self.accepting.astype(bool), M)
        live = searched(ends, to, frm, hub + S)
        if any(not live[n] for n in seen if n < hub):
            raise UsageError(f"{bans} every way to finish the structured output from some point of it", param=param)

    def table(self, end_ids, vocab_size: int, device) -> torch.Tensor:
        """`with_ends` on the device, kept (for the last end tokens asked): a request of a
        constraint seen before costs no host work and no upload (a JSON schema's table
        is megabytes: ~15 ms a request on the host)."""
        key = (tuple(sorted(end_ids)), vocab_size, str(device))
        if key not in self._tables:
            self._tables.clear()
            self._tables[key] = torch.from_numpy(with_ends(self, end_ids, vocab_size)).to(device)
        return self._tables[key]


def token_automaton(dfa: ByteDFA, vocab: list[bytes | None], max_bytes: int | None = None) -> TokenAutomaton:
    """The token table of `dfa` over `vocab` (each id's bytes; None for ids that never
    take part: special tokens, ids past the tokenizer's). Refused if no token sequence
    reaches an accepting state, or (after pruning) the table is over `max_bytes`."""
    V = len(vocab)
    if max_bytes is not None and dfa.num_states * V * 4 > max_bytes:  # refused before it is built
        _too_large(dfa.num_states, V, max_bytes)
    lens = np.array([len(b) if b else 0 for b in vocab], dtype=np.int64)
    order = np.argsort(-lens, kind="stable")  # longest first: tokens still walking are a prefix
    data = np.zeros((V, max(1, int(lens.max()))), dtype=np.uint8)
    for i, b in enumerate(vocab):
        if b:
            data[i, :len(b)] = np.frombuffer(b, dtype=np.uint8)
    data = data[order]
    still = [int((lens > j).sum()) for j in range(data.shape[1])]
    S = dfa.num_states
    dead = S
    # flat: a step is one gather at state * 256 + byte (int32: S <= MAX_DFA_STATES)
    trans = np.vstack([np.where(dfa.trans >= 0, dfa.trans, dead), np.full((1, 256), dead)]).astype(np.int32).ravel()
    table = np.empty((S, V), dtype=np.int32)
    chunk = max(1, (1 << 22) // max(V, 1))
    for s0 in range(0, S, chunk):
        cur = np.repeat(np.arange(s0, min(S, s0 + chunk), dtype=np.int32)[:, None], V, axis=1)
        for j, k in enumerate(still):
            step = cur[:, :k] * 256
            step += data[:k, j]
            cur[:, :k] = trans[step]
        table[s0:s0 + len(cur), order] = cur
    table[table == dead] = -1
    table[:, lens == 0] = -1  # no progress, no end: a token of no bytes could repeat forever
    table, accepting = prune(table, dfa.accepting, "the structured output cannot be written with this model's tokens")
    return TokenAutomaton(table.astype(np.int32, copy=False), accepting)


def _too_large(states: int, vocab_size: int, max_bytes: int):
    raise UsageError(f"the structured output is too complex for this vocabulary: its automaton has {states} "
                     f"states, {states * vocab_size * 4 / 2 ** 20:.0f} MiB of token table (at most "
                     f"{max_bytes / 2 ** 20:.0f} MiB; bounded lengths such as maxLength, maxItems or {{m,n}} "
                     f"multiply the states)")


def with_ends(automaton: TokenAutomaton, end_ids, vocab_size: int) -> np.ndarray:
    """The table with the end tokens allowed (staying put) in accepting states only:
    [S, vocab_size] (a model's vocabulary may be larger than its tokenizer's). An end
    token is no text: where a state's only way on was one, the edges into it are cut
    (states left that no edge reaches are never used); a UsageError if the start is
    left no way to an accepting state."""
    table = np.full((automaton.num_states, vocab_size), -1, dtype=np.int32)
    table[:, :automaton.next.shape[1]] = automaton.next
    ends = sorted(end_ids)
    states = np.arange(automaton.num_states, dtype=np.int32)
    table[:, ends] = np.where(automaton.accepting, states, -1)[:, None]
    live = live_states(table, automaton.accepting)
    if not live[0]:
        raise UsageError("the structured output cannot be written with this model's tokens without its stop "
                         "tokens (stop_token_ids end the text)", param="stop_token_ids")
    if not live.all():  # in place: a vocabulary-wide table is hundreds of MB
        table[~live[np.maximum(table, 0)]] = -1
    return table
