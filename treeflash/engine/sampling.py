"""Exact, position-keyed sampling.

The token at absolute position `p` of a request is

    argmax(filter(penalize(bias(logits, p), history) / T) + g(seed, p))   (no noise when T == 0)

where `bias` adds the request's logit_bias, masks tokens outside its allowed_token_ids
and, for its first min_tokens new tokens, its stop tokens (to -inf), `penalize` applies
the repetition penalty to tokens of the prompt and of the output before p, then the
frequency and presence penalties to the output's (vLLM's order), then bans (-inf) each
bad word's last token where the output before p ends with the word's other tokens (and
structured outputs mask what the text's automaton does not allow), `filter` applies
min-p, top-k and top-p (masked to -inf) and `g(seed, p)` is a Gumbel
vector that depends only on the request's seed and `p` (a counter-based hash, the
same on every device and for every batch). Gumbel-max makes this an exact sample of
softmax(filter(penalize(bias(logits)) / T)); keying the noise (and min_tokens) by position,
and the penalties and bad words by each tree node's own history, makes a speculative round produce
exactly the tokens that autoregressive decoding produces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from treeflash.distributed import TPGroup
from treeflash.ops import fused_enabled
from treeflash.sampling_params import (BAD_WORD_TOKENS, MAX_BAD_SEQUENCES, MAX_LOGPROBS, MIN_TEMPERATURE,
                                       SamplingParams)
from treeflash.structured.grammar import TokenAutomaton

_M32 = 0xFFFFFFFF


def _table_key(p: SamplingParams, automaton: TokenAutomaton) -> tuple:
    """Which rows of a batch's table a request reads: requests of one automaton and the
    same stop tokens (its end tokens) share them."""
    return id(automaton), tuple(sorted(p.stop_token_ids))


def grammar_rows(params: list[SamplingParams], automata: list[TokenAutomaton | None]) -> int:
    """Rows of a batch's stacked token table (`SamplingBatch.grammar`): row 0 and every
    distinct table's, rounded up to a power of two, so that a captured graph serves
    later batches of up to as many states; 0 if no request of the batch is constrained."""
    blocks = {_table_key(p, a): a for p, a in zip(params, automata) if a is not None}
    return 1 << max(4, sum(a.num_states for a in blocks.values()).bit_length()) if blocks else 0


def _put(x: torch.Tensor, ids: list[list[int]], values, accumulate: bool = False) -> None:
    """x[b, t] = value (or += with `accumulate`) for every token id t of ids[b]; `values`
    one for all, or one per id in that order. Only the ids travel to x's device."""
    cols = torch.tensor([t for row in ids for t in row], dtype=torch.long)
    if not len(cols):
        return
    rows = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([len(row) for row in ids]))
    values = torch.tensor(values, dtype=x.dtype).expand(len(cols))
    x.index_put_((rows.to(x.device), cols.to(x.device)), values.to(x.device), accumulate=accumulate)


class SamplingMode(NamedTuple):
    """The host-side values of a batch that choose which code a round runs (and which
    captured graph replays it): each a `SamplingBatch` field of the same name, read and
    written by name (`SamplingBatch.mode`, `copy_`), so a new mode flag goes in both."""
    any_sampled: bool
    any_filtered: bool     # a sampled request with top-k, top-p or min-p
    any_logprobs: bool
    any_biased: bool
    any_penalized: bool
    any_banned: bool
    filter_width: int      # `filter_width_of`
    any_top_p: bool
    any_open_top_p: bool   # a top-p without a top-k
    guided_rows: int       # `grammar_rows`

    def on_table(self, held: torch.Tensor | None) -> "SamplingMode":
        """This mode on a state that holds the structured-output table `held`: a table's
        rows only grow, so a guided batch whose table fits in it reads all of it (and
        the mode names those rows). `SamplingBatch.copy_` and `GraphedState.captured`
        both go by it: a reused state must replay the graph its batch will run."""
        if not self.guided_rows or held is None or len(held) < self.guided_rows:
            return self
        return self._replace(guided_rows=len(held))


# SamplingBatch's buffers that only some modes have (None in a batch that does not need them)
OPTIONAL_BUFFERS = ("bias", "stop_mask", "min_end", "presence", "frequency", "repetition", "prompt_seen",
                    "out_counts", "ban_before", "ban_token", "recent", "grammar", "grammar_start", "grammar_state")


@dataclass
class SamplingBatch:
    """Per-request sampling parameters of a batch, as device tensors."""

    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_k: torch.Tensor        # [B] long, 0 = off
    top_p: torch.Tensor        # [B] float
    min_p: torch.Tensor        # [B] float, 0 = off
    seed: torch.Tensor         # [B] long
    any_sampled: bool
    any_filtered: bool
    filter_width: int = 0  # the largest values `filter_floor` reads (`filter_width_of`)
    any_top_p: bool = False  # a sampled request has a top-p: `filter_floor` weighs the kept tokens
    any_open_top_p: bool = False  # ... without a top-k: its nucleus may reach past the largest logits
    any_logprobs: bool = False  # rounds also return the target's log-probabilities (`logprobs_of`)
    any_biased: bool = False    # rounds apply `bias` (module doc) with the three below
    bias: torch.Tensor | None = None       # [B, V] float32: logit_bias, -inf outside allowed_token_ids
    stop_mask: torch.Tensor | None = None  # [B, V] bool: the stop tokens that min_tokens holds back
    min_end: torch.Tensor | None = None    # [B] long: the first position where they may come
    any_penalized: bool = False  # rounds apply `penalize` (module doc) with the five below
    presence: torch.Tensor | None = None     # [B] float
    frequency: torch.Tensor | None = None    # [B] float
    repetition: torch.Tensor | None = None   # [B] float, 1 = off
    prompt_seen: torch.Tensor | None = None  # [B, V] bool: the prompt's tokens
    out_counts: torch.Tensor | None = None   # [B, V] float32: the committed output's tokens, counted
    any_banned: bool = False  # rounds ban bad words' last tokens with the three below
    ban_before: torch.Tensor | None = None  # [B, W, BAD_WORD_TOKENS - 1] long: the tokens before each
                                            # banned one, right-aligned (-2: any token)
    ban_token: torch.Tensor | None = None   # [B, W] long: the banned token (-1: no sequence)
    recent: torch.Tensor | None = None      # [B, BAD_WORD_TOKENS - 1] long: the committed output's last
                                            # tokens, oldest first (-1: before the output)
    guided_rows: int = 0  # rounds mask tokens by structured-output states (`grammar_rows`; 0 = off)
    grammar: torch.Tensor | None = None        # [guided_rows, V] int32: the next state (-1: not allowed);
                                               # row 0 allows every token (unconstrained requests)
    grammar_start: torch.Tensor | None = None  # [B] long: each request's first state
    grammar_state: torch.Tensor | None = None  # [B] long: its state after the anchor token

    @classmethod
    def from_params(cls, params: list[SamplingParams], device, vocab_size: int | None = None,
                    prompts: list[list[int]] | None = None, held_ids: list[set[int]] | None = None,
                    automata: list[TokenAutomaton | None] | None = None,
                    bad_sequences: list[list[list[int]]] | None = None) -> "SamplingBatch":
        """`vocab_size`, the `prompts` and each request's `held_ids` (what its min_tokens holds
        back: EOS, even under ignore_eos, and its stop token ids) are needed if a request sets logit_bias,
        allowed_token_ids, min_tokens or a penalty; `automata` (with `held_ids`: the end
        tokens) if one sets structured outputs; `bad_sequences` (each request's bad words
        as token sequences) if one sets bad words. A sampled request must carry its seed:
        `LLM.generate` draws it once, on the driver, so that every tensor-parallel rank
        samples alike (a draw here would differ per rank). A greedy one needs none."""
        if any(p.seed is None and p.temperature > 0 for p in params):
            raise ValueError("a sampled request needs a seed here (LLM.generate draws one for each)")
        seeds = [p.seed if p.seed is not None else 0 for p in params]
        batch = cls(
            temperature=torch.tensor([float(p.temperature) for p in params], device=device),
            # a top_k past the vocabulary keeps every token, as 2^31 - 1 does (and fits the tensor)
            top_k=torch.tensor([min(p.top_k, 2 ** 31 - 1) for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([float(p.top_p) for p in params], device=device),
            min_p=torch.tensor([float(p.min_p) for p in params], device=device),
            seed=torch.tensor(seeds, dtype=torch.long, device=device),
            **cls.mode_of(params, automata)._asdict(),
        )
        B = len(params)
        if batch.any_biased:  # made on the device from the sparse entries (B x V is large)
            batch.bias = torch.zeros(B, vocab_size, device=device)
            allowed = [p.allowed_token_ids or [] for p in params]
            batch.bias[[b for b, p in enumerate(params) if p.allowed_token_ids is not None]] = float("-inf")
            _put(batch.bias, allowed, 0.0)
            _put(batch.bias, [list(p.logit_bias or {}) for p in params],
                 [v for p in params for v in (p.logit_bias or {}).values()], accumulate=True)
            batch.stop_mask = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
            _put(batch.stop_mask, [sorted(held_ids[b]) if p.min_tokens else [] for b, p in enumerate(params)], True)
            batch.min_end = torch.tensor([len(q) + p.min_tokens for q, p in zip(prompts, params)], device=device)
        if batch.any_penalized:
            for name, field_ in (("presence", "presence_penalty"), ("frequency", "frequency_penalty"),
                                 ("repetition", "repetition_penalty")):
                setattr(batch, name, torch.tensor([float(getattr(p, field_)) for p in params], device=device))
            batch.prompt_seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
            _put(batch.prompt_seen, prompts, True)
            batch.out_counts = torch.zeros(B, vocab_size, device=device)
        if batch.any_banned:
            K = BAD_WORD_TOKENS - 1
            before = torch.full((B, MAX_BAD_SEQUENCES, K), -2, dtype=torch.long)
            last = torch.full((B, MAX_BAD_SEQUENCES), -1, dtype=torch.long)
            for b, seqs in enumerate(bad_sequences):
                for w, seq in enumerate(seqs):
                    last[b, w] = seq[-1]
                    if len(seq) > 1:
                        before[b, w, K - len(seq) + 1:] = torch.tensor(seq[:-1])
            batch.ban_before, batch.ban_token = before.to(device), last.to(device)
            batch.recent = torch.full((B, K), -1, dtype=torch.long, device=device)
        if batch.guided_rows:  # every distinct table once, its state ids offset to its rows
            table = torch.zeros(batch.guided_rows, vocab_size, dtype=torch.int32, device=device)
            offsets, at, starts = {}, 1, []
            for p, a, ends in zip(params, automata, held_ids):
                key = None if a is None else _table_key(p, a)
                if key is not None and key not in offsets:
                    rows = a.table(ends, vocab_size, device)
                    table[at:at + len(rows)] = torch.where(rows >= 0, rows + at, -1)
                    offsets[key], at = at, at + len(rows)
                starts.append(offsets.get(key, 0))
            batch.grammar = table
            batch.grammar_start = torch.tensor(starts, dtype=torch.long, device=device)
            batch.grammar_state = batch.grammar_start.clone()
        return batch

    @staticmethod
    def mode_of(params: list[SamplingParams], automata: list[TokenAutomaton | None] | None = None) -> SamplingMode:
        """The `mode` of a batch of these requests (`automata`: their structured outputs')."""
        return SamplingMode(any_sampled=any(not p.greedy for p in params),
                            any_filtered=any(p.filtered for p in params),
                            any_logprobs=any(p.logprobs is not None for p in params),
                            any_biased=any(p.biased for p in params),
                            any_penalized=any(p.penalized for p in params),
                            any_banned=any(p.banned for p in params),
                            filter_width=filter_width_of(params),
                            any_top_p=any(not p.greedy and p.top_p < 1 for p in params),
                            any_open_top_p=any(not p.greedy and p.top_p < 1 and p.top_k <= 0 for p in params),
                            guided_rows=grammar_rows(params, automata or [None] * len(params)))

    @property
    def mode(self) -> SamplingMode:
        return SamplingMode(*(getattr(self, name) for name in SamplingMode._fields))

    @property
    def any_guided(self) -> bool:
        return self.guided_rows > 0

    def copy_(self, other: "SamplingBatch") -> None:
        """Take `other`'s values into these (captured) buffers, and its mode (the host-side
        flags that choose which code, or which captured graph, runs). The buffers of the
        biased, penalized and guided modes are made at the first batch that needs them and
        kept: those modes' graphs read them. A structured-output table is made anew only
        to grow (the mode then names the rows of the table held)."""
        for name, value in other.mode.on_table(self.grammar)._asdict().items():
            setattr(self, name, value)
        for name in ("temperature", "top_k", "top_p", "min_p", "seed", *OPTIONAL_BUFFERS):
            src, dst = getattr(other, name), getattr(self, name)
            if src is None:
                continue
            if name == "grammar" and dst is not None and len(dst) >= len(src):  # a table's rows only grow
                dst[:len(src)].copy_(src)
                continue
            if dst is None or dst.shape != src.shape:
                setattr(self, name, torch.empty_like(src))
            getattr(self, name).copy_(src)

    def clear_history(self) -> None:
        """Before a prefill samples each request's first token: no output yet (a kept
        state's counts are the last batch's)."""
        if self.any_penalized:
            self.out_counts.zero_()
        if self.any_banned:
            self.recent.fill_(-1)
        if self.any_guided:
            self.grammar_state.copy_(self.grammar_start)

    def extend_history(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """A round committed tokens[b, :counts[b]] ([B, K], [B])."""
        if self.any_penalized:
            keep = torch.arange(tokens.shape[1], device=tokens.device) < counts[:, None]
            self.out_counts.scatter_add_(1, tokens, keep.to(self.out_counts.dtype))
        if self.any_banned:  # the last of (recent, the new tokens): from counts[b] on
            K = self.recent.shape[1]
            both = torch.cat([self.recent, tokens], dim=1)
            self.recent.copy_(both.gather(1, counts[:, None] + torch.arange(K, device=tokens.device)))

    def grammar_next(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The structured-output states after `tokens` from `states` (same shape); a token
        the state does not allow leads to row 0, which allows all (such a tree node is
        never accepted: the target's own choice at its parent is masked)."""
        V = self.grammar.shape[1]
        return self.grammar.view(-1)[states * V + tokens].clamp_min(0).long()

    def advance_grammar(self, states: torch.Tensor, tokens: torch.Tensor, moved: torch.Tensor) -> None:
        """Where `moved` [B]: the committed state becomes the one after tokens [B] from
        states [B] (a round: the accepted path's last node and the bonus token)."""
        if self.any_guided:
            self.grammar_state.copy_(torch.where(moved, self.grammar_next(states, tokens), self.grammar_state))

    def path_states(self, candidates: torch.Tensor) -> torch.Tensor:
        """[B, D]: the structured-output state before each depth of a draft path that takes,
        at each depth, the first of its candidates [B, D, K] the state allows (the first
        candidate if none is; the state after the last depth is not needed). One launch on
        the fused path."""
        if fused_enabled(candidates):
            from treeflash.ops.structured import path_states
            return path_states(self.grammar, self.grammar_state, candidates)
        B, D, K = candidates.shape
        state, states = self.grammar_state, []
        V = self.grammar.shape[1]
        for d in range(D):
            states.append(state)
            allowed = self.grammar.view(-1)[state[:, None] * V + candidates[:, d]] >= 0        # [B, K]
            first = torch.where(allowed, torch.arange(K, device=state.device), K).min(-1).values
            token = candidates[:, d].gather(1, (first % K)[:, None])[:, 0]
            state = self.grammar_next(state, token)
        return torch.stack(states, dim=1)

    def node_states(self, tree_tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                    max_depth: int) -> torch.Tensor:
        """[B, T]: every tree node's structured-output state after its token (the root's
        is the committed state), level by level from its parent's. One launch on the fused
        path."""
        if fused_enabled(tree_tokens):
            from treeflash.ops.structured import node_states
            return node_states(self.grammar, self.grammar_state, tree_tokens, parents, depths, max_depth)
        states = self.grammar_state[:, None].expand_as(tree_tokens).clone()
        for d in range(1, max_depth + 1):
            step = self.grammar_next(states.gather(1, parents), tree_tokens)
            states = torch.where(depths == d, step, states)
        return states



NOISE_CHUNK = 16384  # vocabulary ids whose noise is hashed at once (the hash's int64 temporaries are
                    # 8 bytes per logit each: over the whole vocabulary they were 7x the logits)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (bijective avalanche mix) on int64 tensors holding uint32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def noise_key(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The per-(request, position) half of the noise hash: [B, T] int64 holding uint32,
    shared with the fused kernel (`treeflash.ops.gumbel_argmax`)."""
    s = _mix32(seed & _M32) ^ _mix32((seed >> 32) ^ 0x5BD1E995)
    return _mix32((s[:, None] + positions * 0x9E3779B9) & _M32)


def gumbel_noise(seed: torch.Tensor, positions: torch.Tensor, vocab_start: int, vocab_size: int,
                 add_to: torch.Tensor | None = None) -> torch.Tensor:
    """g(seed, p) for vocabulary ids vocab_start..+vocab_size: [B, T, V] float32, or
    `add_to` [B, T, V] plus it (in place: the sampler's peak stays a few copies of the
    logits).

    seed [B] long, positions [B, T] long. Only (seed, position, token id) enter the
    hash, so a vocabulary shard computes its own slice of the same vector.
    """
    key = noise_key(seed, positions)[..., None]
    out = torch.zeros(*positions.shape, vocab_size, dtype=torch.float32, device=seed.device) \
        if add_to is None else add_to
    for lo in range(0, vocab_size, NOISE_CHUNK):  # the int64 hashes of one chunk at a time, not [B, T, V]
        ids = torch.arange(vocab_start + lo, vocab_start + min(lo + NOISE_CHUNK, vocab_size), device=seed.device)
        u = uniform_from_hash(_mix32(key ^ _mix32((ids * 0x85EBCA6B + 0x27D4EB2F) & _M32)))
        out[..., lo:lo + len(ids)] -= u.log_().neg_().log_()
    return out


def uniform_from_hash(h: torch.Tensor) -> torch.Tensor:
    """uint32 hashes -> float32 in (0, 1). 23 bits: (2^23 - 0.5) / 2^23 is below 1 in
    float32 (24 bits would round the top value to 1.0 and make the noise infinite)."""
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


MAX_FILTER_WIDTH = 4096  # past it a top-k filter sorts the whole vocabulary


def filter_width_of(params: list[SamplingParams]) -> int:
    """How many of a row's largest logits `filter_floor` reads for a batch of these
    requests: twice the largest top_k, a power of two (few graphs), at least 16; 0 where
    no sampled request filters, or a top-k past MAX_FILTER_WIDTH / 2 needs the whole
    vocabulary sorted."""
    rows = [p for p in params if p.filtered]
    if not rows:
        return 0
    width = max(16, 1 << (2 * max(p.top_k for p in rows) - 1).bit_length())
    return width if width <= MAX_FILTER_WIDTH else 0


def filter_floor(x: torch.Tensor, sb: "SamplingBatch", tp: TPGroup = TPGroup()) -> torch.Tensor:
    """The smallest logit each row of x [B, T, V] keeps [B, T] (-inf: all; in the sampling
    dtype, `_wide`) under min-p, top-k and top-p of the temperature-scaled logits, as
    vLLM orders them: min-p keeps a token whose probability is at least min_p x the most
    likely one's, top-k the k largest (and every token tied with the k-th), top-p the
    largest whose mass before them (among what min-p and top-k left) is below p, and
    those tied with the last.

    Thresholds, not masks: they are read off the row's largest values (`filter_width`
    of them: one top-k, where sorting 152K logits per row cost ~17 us a row on an H200),
    and the sampler applies them in its one pass over the vocabulary. Top-p's total is
    the mass of every kept token, ties with the k-th past those values included, so a
    row's floor does not depend on the width its batch chose (nor do its prefix sums:
    they add in order). A top-p without top-k may reach past them: on the GPU those rows
    search the rest (`treeflash.ops.filter_floor`, which also does the rest of this in a
    few launches); here the rows are sorted, as they are for a top-k past
    MAX_FILTER_WIDTH / 2 (width 0). Under tensor parallelism x is this rank's slice and
    the largest values come from every rank (`TPGroup.topk`)."""
    fused = _fused(x)
    if sb.filter_width and (fused or not sb.any_open_top_p):
        vals = tp.topk(x, sb.filter_width)[0]
    else:
        vals = tp.all_gather(x).sort(dim=-1, descending=True).values
    if fused:
        from treeflash.ops.filter_floor import filter_floor as fused_floor
        return fused_floor(x, vals, sb, tp)
    vals = vals.to(_wide(x))
    B, T, W = vals.shape
    temp = sb.temperature.to(vals.dtype).clamp_min(MIN_TEMPERATURE)[:, None]            # [B, 1]
    k = sb.top_k.clamp(0, W)[:, None, None].expand(B, T, 1)
    kth = torch.where(k[..., 0] > 0, vals.gather(-1, (k - 1).clamp_min(0))[..., 0], float("-inf"))
    min_p = vals[..., 0] + temp * torch.log(sb.min_p.to(vals.dtype))[:, None]          # -inf when off
    floor = torch.maximum(kth, min_p)
    if not sb.any_top_p:
        return floor
    kept = vals >= floor[..., None]
    mass = ((vals - vals[..., :1]) / temp[..., None]).masked_fill(~kept, float("-inf")).exp()
    x = x.to(vals.dtype)  # every kept token's mass, past the largest values too, summed alike whatever the width
    total = tp.all_reduce(((x - vals[..., :1]) / temp[..., None]).masked_fill(x < floor[..., None], float("-inf"))
                          .exp().sum(-1))
    probs = mass / total[..., None]
    p = sb.top_p.to(vals.dtype)[:, None, None]
    nucleus = kept & ((probs.cumsum(-1) - probs) < p)
    nucleus[..., 0] = True
    cut = vals.masked_fill(~nucleus, float("inf")).amin(-1)
    return torch.where(p[..., 0] < 1, cut, floor)


def _fused(x: torch.Tensor) -> bool:
    """Sampling's Triton kernels take these logits (float64, the tests' exact dtype,
    stays on the torch path)."""
    return fused_enabled(x) and x.dtype != torch.float64


def _wide(x: torch.Tensor) -> torch.dtype:
    """The dtype sampling works in: float64 stays, anything else is float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _controlled(x: torch.Tensor, sb: SamplingBatch, bias=None, penalties=None) -> torch.Tensor:
    """`bias` then `penalize` (module doc) on logits x [B, R, C], in the sampling dtype:
    `bias` = (bias, held-back flags: [B, 1 or R, C]; positions [B, R]), `penalties` =
    (output counts, prompt flags: [B, 1 or R, C]). On the fused path one launch, the same
    kernel for every caller, so equal inputs give bit-equal outputs."""
    if _fused(x):
        from treeflash.ops.logit_controls import logit_controls
        return logit_controls(x, None if bias is None else (*bias, sb.min_end),
                              None if penalties is None else (*penalties, sb.repetition, sb.frequency, sb.presence))
    wide = _wide(x)
    x = x.to(wide)
    if bias is not None:
        add, held, positions = bias
        x = (x + add).masked_fill((positions < sb.min_end[:, None])[:, :, None] & held, float("-inf"))
    if penalties is not None:
        counts, prompt_seen = penalties
        counts = counts.to(wide)
        seen = counts > 0
        rep = sb.repetition.to(wide)[:, None, None]
        x = torch.where(seen | prompt_seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - sb.frequency.to(wide)[:, None, None] * counts - sb.presence.to(wide)[:, None, None] * seen
    return x


def apply_bias(logits: torch.Tensor, positions: torch.Tensor, sb: SamplingBatch, start: int) -> torch.Tensor:
    """`bias` (module doc) on logits [B, T, V'] (vocabulary ids start..start + V'), for the
    tokens at `positions` [B, T]: float32 (float64 stays). The drafter's logits get it
    (not the penalties, which it was not trained with)."""
    cols = slice(start, start + logits.shape[-1])
    return _controlled(logits, sb, bias=(sb.bias[:, None, cols], sb.stop_mask[:, None, cols], positions))


def apply_controls(logits: torch.Tensor, positions: torch.Tensor, sb: SamplingBatch, start: int,
                   path=None, states: torch.Tensor | None = None) -> torch.Tensor:
    """`bias` (if a request of the batch sets one) then `penalize` (if one does; module
    doc) on logits [B, T, V'] (vocabulary ids start..start + V') for the tokens at
    `positions` [B, T]: float32 (float64 stays). Then, if a request has bad words, -inf
    where one would end (`_ban_words`), and if one has structured outputs, where the row's
    state (`states` [B, T]) allows no token.

    Row t's output so far is the committed output, plus, with `path` (a round's tree:
    tokens [B, T] and ancestors [B, T, T]), the tokens of node t and of its ancestors
    but the root (the anchor, committed already): each node gets its own history. Every
    row is penalized by the committed output ([B, 1, V] counts, broadcast); a node's path
    changes only the columns of the round's T tokens, which are then recomputed and
    written over ([B, T, T] work, never a [B, T, V] count per node)."""
    B, T, V = logits.shape
    cols = slice(start, start + V)
    bias = (sb.bias[:, None, cols], sb.stop_mask[:, None, cols], positions) if sb.any_biased else None
    penalties = (sb.out_counts[:, None, cols], sb.prompt_seen[:, None, cols]) if sb.any_penalized else None
    # a new tensor either way: what follows writes into it, and the raw logits stay (logprobs)
    x = _controlled(logits, sb, bias, penalties) if bias or penalties else logits.to(_wide(logits), copy=True)
    if path is not None and penalties is not None and T > 1:  # T == 1: the root alone (AR), no path tokens
        x = _path_penalized(x, logits, positions, sb, start, path, bias is not None)
    if sb.any_banned:
        x = _ban_words(x, sb, start, path)
    if sb.any_guided:
        x = grammar_masked(x, sb, states, start, in_place=True)
    return x


def grammar_masked(x: torch.Tensor, sb: SamplingBatch, states: torch.Tensor, start: int,
                   in_place: bool = False) -> torch.Tensor:
    """x [B, R, C] (vocabulary ids start..start + C) with -inf where each row's structured-
    output state (states [B, R]) allows no token; one launch on the fused path (in place
    with `in_place`), without gathering [B, R, C] rows of the table."""
    if fused_enabled(x) and x.dtype == torch.float32 and x.is_contiguous():
        from treeflash.ops.structured import grammar_mask_
        return grammar_mask_(x if in_place else x.clone(), sb.grammar, states, start)
    return x.masked_fill(sb.grammar[:, start:start + x.shape[-1]][states] < 0, float("-inf"))


def _ban_words(x: torch.Tensor, sb: SamplingBatch, start: int, path) -> torch.Tensor:
    """-inf at each bad word's last token in the rows whose output ends with the tokens
    before it (vLLM's bad_words: the output, not the prompt). A row's output is the
    committed one, then with `path` its node's path below the root."""
    B, T, V = x.shape
    context = _recent_tokens(sb.recent, path, T)                                   # [B, T, K]
    before = sb.ban_before[:, None]                                                # [B, 1, W, K]
    hit = ((context[:, :, None] == before) | (before == -2)).all(-1)               # [B, T, W]
    col = sb.ban_token - start
    mine = (sb.ban_token >= 0) & (col >= 0) & (col < V)                            # this rank's columns
    ban = torch.where(hit & mine[:, None], float("-inf"), float("inf")).to(x.dtype)
    # the lowest of the current value and each sequence's verdict: a token several sequences
    # end in is banned if any of them is complete (a plain scatter would keep one at random)
    return x.scatter_reduce_(2, col.clamp(0, V - 1)[:, None].expand(B, T, -1), ban, "amin")


def _recent_tokens(recent: torch.Tensor, path, T: int) -> torch.Tensor:
    """[B, T, K]: each row's output's last K tokens, oldest first (-1 before the output):
    the committed output's `recent` [B, K], then (`path`: tokens and ancestors) the tokens
    of the node's path below the root, itself last."""
    B, K = recent.shape
    if path is None or T == 1:
        return recent[:, None].expand(B, T, K)
    tokens, ancestors = path
    depths = ancestors.sum(-1) - 1                                                 # [B, T]
    back = []  # the j-th token back, j = 0 (the node's own) .. K - 1
    for j in range(K):
        on_path = ancestors & (depths[:, None, :] == (depths - j)[:, :, None])      # that ancestor
        from_tree = (on_path.long() * tokens[:, None, :]).sum(-1)
        from_output = recent.gather(1, (K - 1 - (j - depths)).clamp(0, K - 1))
        back.append(torch.where(j < depths, from_tree, from_output))
    return torch.stack(back[::-1], dim=-1)


def _path_penalized(x, logits, positions, sb, start, path, biased):
    """`apply_controls`' penalties with each node's own path: the columns of the round's
    tokens recomputed and written over x."""
    B, T, V = logits.shape
    cols = slice(start, start + V)
    tokens, ancestors = path
    wide = x.dtype
    on_path = ancestors.clone()
    on_path[:, :, 0] = False  # the root
    # column of each node's token (a token of another rank's slice: this rank's first
    # column, recomputed below with its true count, so every write is the right value)
    col = torch.where((tokens >= start) & (tokens < start + V), tokens - start, 0)
    same = tokens[:, :, None] == (col + start)[:, None, :]       # [B, T(a'), T(a)]
    on_path_count = torch.bmm(on_path.to(wide), same.to(wide))  # times col[a] is on t's path

    def at(row):  # [B, V] -> the path tokens' columns, [B, 1, T]
        return row[:, cols].gather(1, col)[:, None, :]
    bias_at = (at(sb.bias), at(sb.stop_mask), positions) if biased else None
    idx = col[:, None, :].expand(B, T, T)
    vals = _controlled(logits.gather(2, idx), sb, bias_at, (at(sb.out_counts).to(wide) + on_path_count,
                                                            at(sb.prompt_seen)))
    return x.scatter_(2, idx, vals)  # equal columns get equal values


def sample(logits: torch.Tensor, positions: torch.Tensor, sb: SamplingBatch, tp: TPGroup = TPGroup(),
           path=None, states: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens [B, T] for logits [B, T, V], the sampled tokens sitting at `positions` [B, T].

    Under tensor parallelism `logits` is this rank's contiguous vocabulary slice (the
    LM head's local output): each rank takes the argmax of its slice and one small
    all-gather of (value, id) picks the winner, ties toward the lowest id exactly as
    argmax over the whole vocabulary; every rank returns the same global ids (the bias
    is added to each rank's slice). Top-k / top-p / min-p keep the logits at least
    `filter_floor` (the ranks share only the largest values for it). `path`, `states`:
    see `apply_controls`.
    """
    start = tp.rank * logits.shape[-1]
    if sb.any_biased or sb.any_penalized or sb.any_banned or sb.any_guided:
        logits = apply_controls(logits, positions, sb, start, path, states)
    if not sb.any_sampled:
        return tp.argmax(logits, start)
    dtype = _wide(logits)
    floor = filter_floor(logits, sb, tp) if sb.any_filtered else None
    if _fused(logits):
        from treeflash.ops.gumbel_argmax import gumbel_argmax
        value, index = gumbel_argmax(logits, sb.seed, positions, sb.temperature, vocab_start=start,
                                     with_values=True, floor=floor)
        return tp.pick_max(value, index + start)
    temp = sb.temperature.to(dtype)
    x = logits.to(dtype)
    noisy = x / temp.clamp_min(MIN_TEMPERATURE)[:, None, None]  # in place from here: a few copies at most
    if floor is not None:
        noisy.masked_fill_(x < floor[..., None], float("-inf"))
    gumbel_noise(sb.seed, positions, start, logits.shape[-1], add_to=noisy)
    # greedy rows (T == 0) take the plain argmax (the cast to dtype is exact and monotonic)
    return tp.argmax(torch.where(temp[:, None, None] > 0, noisy, x), start)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, tp: TPGroup = TPGroup()):
    """The target's log-probabilities at rows logits [B, T, V] (this rank's vocabulary
    slice): of `tokens` [B, T], and the MAX_LOGPROBS most likely tokens'. As vLLM
    reports them: log-softmax of the raw logits, before temperature and filters, so a
    token's figure does not depend on how it was sampled. Returns (chosen [B, T],
    top values [B, T, K], top ids [B, T, K], the tokens' ranks in the vocabulary [B, T]),
    float32 (float64 for float64 logits) and int64, identical on every rank."""
    x = logits.to(_wide(logits))
    return tp.logprobs(x, tokens, min(MAX_LOGPROBS, x.shape[-1] * tp.size), tp.rank * x.shape[-1])
