"""The batch states an engine keeps between `generate` calls.

With CUDA graphs a batch runs on a bucketed state (`state_key`: batch size, cache
length rounded up) that is kept with every round and prefill captured over its
buffers, so that the next batch of that shape only replays: up to GRAPH_STATES of them,
the least recently used freed first, within a share of the memory. An eager engine
keeps its last state only with prefix caching. With prefix caching a kept state also
records which tokens its caches hold, and a batch whose prompts begin with them reuses
that state's K/V and prefills only the rest (`KeptStates.prefix_to_reuse`).
"""
from __future__ import annotations

import math
from collections import OrderedDict

import torch

from treeflash.distributed import TPGroup
from treeflash.engine.graphs import GraphedState
from treeflash.engine.round import PREFILL_ALIGN, BatchState, SpeculativeDecoder, prefill_width
from treeflash.engine.sampling import SamplingBatch
from treeflash.errors import InStepError, TreeflashError
from treeflash.memory import available_bytes
from treeflash.sampling_params import SamplingParams

GRAPHED_PREFILL_MAX = 512  # padded prompt tokens of a batch up to which prefills are CUDA graphs:
                           # past it compute dominates (a longer cached rest runs in such chunks)
GRAPH_STATES = 4           # batch states kept with their CUDA graphs (least recently used goes first),
GRAPH_STATES_SHARE = 0.25  # while they take at most this share of the memory free after loading

Key = tuple[int, int]


def common_prefix(a: list[int], b: list[int], chunk: int = 256) -> int:
    """How many first tokens a and b share (chunks compare in C: a long conversation's
    turn is checked against every kept state before each request)."""
    n = min(len(a), len(b))
    at = 0
    while at < n and a[at:at + chunk] == b[at:at + chunk]:
        at += chunk
    while at < n and a[at] == b[at]:
        at += 1
    return min(at, n)


def suffix_chunks(prompts: list[list[int]], starts: list[int], room: int) -> list | None:
    """Prefix caching: the prefills that run each prompt past its first starts[b] tokens
    (held in the caches), at most GRAPHED_PREFILL_MAX padded tokens of the batch at a
    time, so that each replays one of a few CUDA graphs (and no long rest needs memory
    for all of its tokens at once). Per chunk: each row's tokens and the cache slot they
    begin at. A row whose rest ended in an earlier chunk runs its last token again (the
    same K/V, the same first token), so every chunk holds every row. None if a chunk's
    padded columns would run past the `room` cache slots (rows far apart)."""
    width = max(PREFILL_ALIGN, GRAPHED_PREFILL_MAX // len(prompts) // PREFILL_ALIGN * PREFILL_ALIGN)
    begins, chunks = list(starts), []
    while True:
        pieces = [p[b:b + width] for p, b in zip(prompts, begins)]
        longest = max(map(len, pieces))
        if prefill_width(longest, room - max(begins)) < longest:
            return None
        chunks.append((pieces, begins))
        if all(b + len(x) == len(p) for p, b, x in zip(prompts, begins, pieces)):
            return chunks
        begins = [b + width if b + width < len(p) else len(p) - 1 for p, b in zip(prompts, begins)]


def state_key(batch: int, max_len: int) -> Key:
    """(batch size, cache bucket): the kept batch state a batch runs on. Cache lengths
    are rounded up to a power of two (at least 1024): a few shapes, a few graphs."""
    return batch, 1 << max(10, (max_len - 1).bit_length())


def key_of(st: BatchState) -> Key:
    """The `state_key` of a bucketed state."""
    return st.batch_size, st.cache.max_len


class KeptStates:
    """One rank's kept batch states. The driver decides (`to_drop`, `prefix_to_reuse`)
    and sends its decisions to every rank, so that all ranks keep, free and capture
    alike whatever their own free memory; `runner` and `drop` run on every rank."""

    def __init__(self, decoder: SpeculativeDecoder, device: torch.device, graphs: bool, prefix_caching: bool,
                 group: TPGroup):
        self.decoder, self.device, self.group = decoder, device, group
        self.graphs, self.prefix_caching = graphs, prefix_caching
        self.graphed: OrderedDict[Key, GraphedState] = OrderedDict()  # most recently used last
        self.kept: BatchState | None = None  # eager, with prefix caching: the last batch's state
        self.dropped_captures = 0            # captures of the graphed states freed so far
        self.memory_budget = GRAPH_STATES_SHARE * (available_bytes(device) or 0) if graphs else 0

    @property
    def captures(self) -> int:
        """Rounds and prefills captured so far (a benchmark sees recaptures). Safe to read
        from another thread (the server's /metrics): the states are listed in one step."""
        return self.dropped_captures + sum(g.captures for g in list(self.graphed.values()))

    def drop(self, keys: list[Key] | None = None) -> None:
        """Free the graphed states `keys` (all by default) with their graphs: the next
        batch of a dropped shape captures anew."""
        for key in list(self.graphed) if keys is None else keys:
            self.dropped_captures += self.graphed[key].captures  # counted before it goes: the total
            del self.graphed[key]                                 # never dips for a reader (/metrics)

    def clear(self) -> None:
        self.drop()
        self.kept = None

    def held(self) -> list[BatchState]:
        """The batch states kept now (graphed ones, or eager's last with prefix caching)."""
        return [g.st for g in list(self.graphed.values())] + ([self.kept] if self.kept is not None else [])

    def state(self, key: Key) -> BatchState:
        """The kept state of `key` (eager: the last one, whose key it is)."""
        return self.graphed[key].st if self.graphs else self.kept

    def to_drop(self, batch: int, max_len: int) -> list[Key]:
        """On the driver: the graphed states to free before this batch's state is made,
        least recently used first, to stay within GRAPH_STATES states and the memory
        budget."""
        key = state_key(batch, max_len)
        if not self.graphs or key in self.graphed:
            return []
        kept = list(self.graphed.values())  # least recently used first
        need = 0
        if kept:  # the last state's caches scaled to this shape, its graph pool to this batch
            last = kept[-1]
            need = (last.cache_bytes * math.prod(key) // math.prod(last.key)
                    + (last.nbytes - last.cache_bytes) * batch // last.key[0])
        drop = []
        while kept and (len(kept) >= GRAPH_STATES or sum(g.nbytes for g in kept) + need > max(self.memory_budget, need)):
            drop.append(kept.pop(0).key)
        return drop

    def prefix_to_reuse(self, max_len: int, prompts: list[list[int]], params: list[SamplingParams],
                        drop: list[Key], automata=None) -> tuple[Key, list[int]] | None:
        """Prefix caching, on the driver: the kept state to reuse (its key) and per request
        how many of its prompt's first tokens that state holds already (its last token is
        always prefilled: it makes the first new one); None to prefill the whole prompts.
        Of the kept states of this batch size, the one that holds most; not one that `drop`
        frees first, nor, if it is the state this batch runs on, a graphed one whose
        capture of a new sampling mode would run warm-up rounds over it from slot 0.
        Prompt logprobs need every position: no reuse. `automata`: the requests' structured
        outputs' (part of the mode). Another state's prefix is copied
        over before the rest prefills (a conversation outgrows its cache bucket)."""
        if not self.prefix_caching or any(p.prompt_logprobs is not None for p in params):
            return None
        batch = len(prompts)
        key = state_key(batch, max_len)
        if self.graphs:
            mode = SamplingBatch.mode_of(params, automata)
            kept = {k: g.st for k, g in self.graphed.items() if k not in drop and (k != key or g.captured(mode))}
        else:
            kept = {} if self.kept is None else {key_of(self.kept): self.kept}
        best = None
        for k, st in sorted(kept.items(), key=lambda item: item[0] != key):  # a tie: no copy
            if k[0] != batch or st.tokens is None:  # other batch sizes; caches in no known state
                continue
            starts = [min(common_prefix(held, p), len(p) - 1) for held, p in zip(st.tokens, prompts)]
            if any(starts) and (best is None or sum(starts) > sum(best[1])) \
                    and suffix_chunks(prompts, starts, key[1]) is not None:
                best = (k, starts)
        return best

    def runner(self, batch: int, max_len: int, sampling: SamplingBatch):
        """A batch state, the function that runs one round on it, and its `GraphedState`
        (None without CUDA graphs: eager rounds and prefill). Graphed states are kept
        with every round and prefill captured on them; the sampling values are copied
        into the captured buffers. Eager states are made for the batch, or with prefix
        caching kept (the last one). On the Triton kernel, whose splits and key tiles
        follow the cache length, an eager state takes the graphed state's bucketed length:
        `--eager` then gives the graphed tokens in bf16 too, not only in float32."""
        key = state_key(batch, max_len)
        if not self.graphs and not self.prefix_caching:
            length = key[1] if self.decoder.backend == "triton" else max_len
            st = self.allocated(lambda: self.decoder.new_state(batch, length, sampling))
            return st, self.decoder.round, None
        if not self.graphs:  # prefix caching: the last state is kept, with what it holds
            if self.kept is None or key_of(self.kept) != key:
                self.kept = None  # its caches go before the new ones are made
                self.kept = self.allocated(lambda: self.decoder.new_state(batch, key[1], sampling))
            self.kept.sampling = sampling
            return self.kept, self.decoder.round, None
        if key in self.graphed:
            self.graphed.move_to_end(key)  # now the most recently used
        else:
            self.graphed[key] = self.allocated(lambda: GraphedState(self.decoder, *key, sampling))
        g = self.graphed[key]
        return g.st, g.use(sampling), g

    def allocated(self, make):
        """make(): a new batch state, its caches allocated on every rank. If they do not
        fit on some rank, every rank raises at this point, before any collective of the
        batch: the ranks stay in step and the engine goes on (a request too large for the
        memory must not end a tensor-parallel server, as it does not end a single GPU's)."""
        try:
            made, err = make(), None
        except (TreeflashError, torch.OutOfMemoryError) as e:
            made, err = None, e
        if self.group.size == 1:
            if err is not None:
                raise err
            return made
        failed = torch.zeros(self.group.size, dtype=torch.int32, device=self.device)
        failed[self.group.rank] = err is not None
        self.group.all_reduce(failed)
        ranks = failed.nonzero().flatten().tolist()
        if not ranks:
            return made
        raise InStepError(str(err).splitlines()[0] if err is not None else
                          f"tensor-parallel rank {ranks[0]} has not enough memory for this batch's caches")
