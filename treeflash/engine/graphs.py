"""CUDA graphs of the round and the prefill (design section 6): captured once per batch
state and sampling mode over the state's static buffers, then replayed, so the host's
work per round is one replay and reading the committed tokens."""
from __future__ import annotations

from contextlib import contextmanager

import torch

from treeflash.engine.round import BatchState, SpeculativeDecoder
from treeflash.engine.sampling import SamplingBatch, SamplingMode


def capture(fn, warmup: int, pool=None, reset=None):
    """(CUDA graph of fn(), what the captured call returned). fn runs `warmup` times on a
    side stream first, so lazy set-up (Triton compiles, cuBLAS workspaces, one-time
    device copies) happens outside the graph. `pool`: a memory pool shared with other
    graphs (see `GraphedState`); `reset`: run before each call (benchmarks put their
    state back)."""
    reset = reset or (lambda: None)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            reset()
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class GraphedRound:
    """`decoder.round(st)` captured once as a CUDA graph over the static buffers of `st`,
    then replayed: the only host work per round is the replay and reading the tokens.

    Capture it before `prefill`: the warm-up rounds only scribble on cache slots and
    counters that the prefill then rewrites (they start from n = 0, so that a state
    left at its end by an earlier batch stays within its cache). So prefix caching
    reuses a graphed state's caches only in a mode captured there already.
    """

    def __init__(self, decoder: SpeculativeDecoder, st: BatchState, pool=None):
        self.st = st
        st.n.zero_()
        self.graph, self.out = capture(lambda: decoder.round(st), 2, pool)  # 2 warm-up rounds: lazy set-up done

    def __call__(self, st: BatchState, max_n: int | None = None):
        """One round; `max_n` is not used: the graph reads the whole cache."""
        assert st is self.st, "a graph replays on the buffers it was captured with"
        self.graph.replay()
        return self.out


class GraphedPrefill:
    """`decoder.prefill_tokens` for one padded shape [B, T], captured as a CUDA graph
    over static (ids, lens) buffers of `st`, and with prefix caching a `begin` buffer (a
    suffix prefill): a short prompt's eager prefill is ~150 launches, host-bound
    (built-in pair on an H200: ~5 ms for ~0.3 ms of kernels). Capturing also prefills:
    the graph is replayed once, which fills its outputs (the first tokens' logprobs) as
    well as the state (a captured graph has run nothing). The warm-up that capturing
    runs first is a prefill of the same tokens: it writes what the replay rewrites."""

    def __init__(self, decoder: SpeculativeDecoder, st: BatchState, ids: torch.Tensor, lens: torch.Tensor,
                 begin: torch.Tensor | None = None, pool=None):
        self.st, self.ids, self.lens = st, ids.clone(), lens.clone()
        self.begin = None if begin is None else begin.clone()
        self.graph, self.out = capture(lambda: decoder.prefill_tokens(st, self.ids, self.lens, begin=self.begin),
                                       1, pool)
        self.graph.replay()

    def __call__(self, st: BatchState, ids: torch.Tensor, lens: torch.Tensor, begin: torch.Tensor | None = None):
        assert st is self.st and ids.shape == self.ids.shape and (begin is None) == (self.begin is None), \
            "a graph replays on the buffers it was captured with"
        self.ids.copy_(ids)
        self.lens.copy_(lens)
        if begin is not None:
            self.begin.copy_(begin)
        self.graph.replay()
        return self.out


class GraphedState:
    """One bucketed batch state and every graph captured over its buffers: per sampling
    mode (greedy, sampled, sampled with top-k/top-p/min-p; each with or without logprobs,
    logit bias / allowed tokens / min_tokens, penalties, bad words, and structured outputs
    by their table's rows: `SamplingBatch.mode`) a round and the prefills by padded prompt
    shape. A server whose requests alternate
    between modes replays them instead of recapturing (a capture runs the round three
    times and re-records it).

    The graphs share one memory pool. That is safe here because replays never overlap
    and each graph's outputs are consumed (queued to the host, or written into the
    state's own buffers, which live outside the pool) before another graph of the state
    replays: what one replay leaves in the pool is dead by the next.
    """

    def __init__(self, decoder: SpeculativeDecoder, batch: int, bucket: int, sampling: SamplingBatch):
        self.decoder, self.key = decoder, (batch, bucket)
        self.captures = 0
        self.st = decoder.new_state(batch, bucket, sampling)
        self.cache_bytes = self.nbytes = self.st.cache_bytes  # the caches; captures add their pool
        self.pool = torch.cuda.graph_pool_handle()
        self.rounds: dict[SamplingMode, GraphedRound] = {}
        self.prefills: dict[tuple, GraphedPrefill] = {}

    @contextmanager
    def _counted(self):
        """Add what the allocator reserves meanwhile to `nbytes`, the memory the state
        holds (an upper bound: warm-up temporaries outside the graph pool count too)."""
        device = self.decoder.target.lm_head.weight.device
        before = torch.cuda.memory_reserved(device)
        yield
        self.nbytes += max(0, torch.cuda.memory_reserved(device) - before)

    def use(self, sampling: SamplingBatch) -> GraphedRound:
        """Take the batch's sampling values and mode; the mode's round (captured now if new)."""
        table = self.st.sampling.grammar
        with self._counted():  # the first batch of a mode with its own buffers makes them
            self.st.sampling.copy_(sampling)
        mode = self.st.sampling.mode
        if table is not None and self.st.sampling.grammar is not table:  # a larger structured-output
            fresh = (0, mode.guided_rows)                                # table: graphs of the old one go
            self.rounds = {m: g for m, g in self.rounds.items() if m.guided_rows in fresh}
            self.prefills = {k: g for k, g in self.prefills.items() if k[0].guided_rows in fresh}
            if not self.rounds and not self.prefills:  # torch shares a pool only while one of its graphs
                self.pool = torch.cuda.graph_pool_handle()  # lives: a released pool's id asserts at capture
        if mode not in self.rounds:
            self.st.tokens = None  # the capture's warm-up rounds write the caches from slot 0
            with self._counted():
                self.rounds[mode] = GraphedRound(self.decoder, self.st, pool=self.pool)
            self.captures += 1
        return self.rounds[mode]

    def captured(self, mode: SamplingMode) -> bool:
        """Whether a batch of `mode` (`SamplingBatch.mode_of`) replays a round captured
        already (a capture's warm-up rounds would write over the caches)."""
        return mode.on_table(self.st.sampling.grammar) in self.rounds

    def prefill(self, ids: torch.Tensor, lens: torch.Tensor, begin: torch.Tensor | None = None):
        """The prefill of padded ids [B, T] (after `begin` cached tokens per request, if
        given) in the current mode: replayed, or captured now (capturing also prefills).
        Returns what `prefill_tokens` does."""
        sb = self.st.sampling
        key = (sb.mode, begin is not None, *ids.shape)
        if key in self.prefills:
            return self.prefills[key](self.st, ids, lens, begin)
        with self._counted():
            self.prefills[key] = GraphedPrefill(self.decoder, self.st, ids, lens, begin, pool=self.pool)
        self.captures += 1
        return self.prefills[key].out
