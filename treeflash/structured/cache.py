"""Compiled structured outputs, kept per engine: a constraint compiles once (its token
table takes seconds for a large vocabulary), however many requests or threads ask."""
from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager
from functools import cached_property

from treeflash.errors import UsageError
from treeflash.sampling_params import StructuredOutputs
from treeflash.structured.grammar import TokenAutomaton, token_automaton
from treeflash.tokenizer import Tokenizer

AUTOMATA_KEPT = 32                # compiled automata kept,
AUTOMATA_BYTES = 4 << 30          # and their tables (host and device) at most (those in use always)
REFUSALS_KEPT = 256               # constraints that failed to compile, remembered: a retry is refused at once
MAX_AUTOMATON_BYTES = 512 << 20   # one constraint's token table (states x vocabulary) at most


class AutomatonCache:
    """Token automata by constraint, least recently used dropped past AUTOMATA_KEPT /
    AUTOMATA_BYTES, except those `pinned` by a batch being generated. Thread-safe: a
    server's requests come from its threads; one compiles a constraint, the others that
    ask for it wait for that compile, the rest go on."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.kept: OrderedDict[str, TokenAutomaton] = OrderedDict()
        self.compiling: dict[str, Future] = {}        # being compiled, by key
        self.refused: OrderedDict[str, str] = OrderedDict()  # keys that failed to compile: why
        self._pins: Counter[str] = Counter()          # keys of the batches being generated
        self._lock = threading.Lock()

    @cached_property
    def vocab(self) -> list[bytes | None]:
        """Each model token id's bytes; None for special tokens and ids that name no token."""
        tok = self.tokenizer
        special = {i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special}
        named = set(tok.tok.get_vocab(with_added_tokens=True).values()) - special
        return [tok.token_bytes(i) if i in named else None for i in range(self.vocab_size)]

    @contextmanager
    def pinned(self, constraints: list[StructuredOutputs]):
        """Keep these constraints' automata while a batch generates with them."""
        keys = [c.key() for c in constraints]
        with self._lock:
            self._pins.update(keys)
        try:
            yield
        finally:
            with self._lock:
                for key in keys:
                    self._pins[key] -= 1
                    if not self._pins[key]:
                        del self._pins[key]

    def known(self, constraint: StructuredOutputs) -> bool:
        """Whether `get` answers at once: compiled and kept, or refused."""
        key = constraint.key()
        with self._lock:
            return key in self.kept or key in self.refused

    def get(self, constraint: StructuredOutputs) -> TokenAutomaton:
        key = constraint.key()
        with self._lock:
            if key in self.kept:
                self.kept.move_to_end(key)
                return self.kept[key]
            if key in self.refused:  # a compile that took seconds to fail fails the same way again
                self.refused.move_to_end(key)
                raise UsageError(self.refused[key], param="structured_outputs")
            pending, mine = self.compiling.get(key), key not in self.compiling
            if mine:
                pending = self.compiling[key] = Future()
        if not mine:
            return pending.result()
        try:
            made = token_automaton(constraint.automaton(), self.vocab, MAX_AUTOMATON_BYTES)
        except BaseException as e:  # every waiter gets the error: none waits for good
            failed = e
            if isinstance(e, (UsageError, RecursionError, TypeError, ValueError)):  # one line, never a crash
                failed = UsageError(str(e) if isinstance(e, UsageError) else f"the structured output cannot be "
                                    f"compiled: {type(e).__name__}: {e}", param="structured_outputs")
            with self._lock:
                del self.compiling[key]
                if isinstance(failed, UsageError):  # the input's fault, not memory's or an interrupt's
                    self.refused[key] = str(failed)
                    while len(self.refused) > REFUSALS_KEPT:
                        self.refused.popitem(last=False)
            pending.set_exception(failed)
            if failed is e:
                raise
            raise failed from None
        with self._lock:
            del self.compiling[key]
            self.kept[key] = made
            for old in list(self.kept):
                if len(self.kept) <= AUTOMATA_KEPT and sum(a.nbytes for a in self.kept.values()) <= AUTOMATA_BYTES:
                    break
                if not self._pins[old] and old != key:
                    del self.kept[old]
        pending.set_result(made)
        return made
