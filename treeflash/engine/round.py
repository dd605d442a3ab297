"""The speculative round (design section 1), one code path for AR, DFlash and DDTree.

    draft  -> tree -> verify (one target forward over root + N nodes)
           -> sample (position-keyed) -> walk -> commit

AR is the empty tree, DFlash-linear the chain of top-1 draft tokens, DDTree the N
most probable prefixes. A request has `n` committed tokens (target KV and drafter
context at slots 0..n-1) and an anchor token at position n; a round commits the
anchor plus the accepted path and makes the target's bonus token the next anchor.

Every tensor of a round has a static shape for a given (batch, budget), and the
round updates its `BatchState` in place, so the whole round can be captured in one
CUDA graph (`engine.graphs`); the host only reads back the committed tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from treeflash.engine.sampling import SamplingBatch, apply_bias, grammar_masked, gumbel_noise, logprobs_of, sample
from treeflash.engine.tree import DraftTree, build_chain, build_tree, walk
from treeflash.errors import TreeflashError, UsageError
from treeflash.layers.attention import AttentionInputs
from treeflash.layers.kv_cache import DraftContextCache, KVCache
from treeflash.memory import available_bytes
from treeflash.models.dflash import DFlashDraftModel
from treeflash.models.transformer import CausalLM
from treeflash.ops import fused_enabled
from treeflash.sampling_params import MAX_LOGPROBS, MIN_TEMPERATURE

try:  # Triton, used only when `fused_enabled` (CUDA inference)
    from treeflash.kernels.tree_build import build_tree_fused, fits
except ImportError:
    build_tree_fused = fits = None

METHODS = ("ar", "dflash", "ddtree")
DRAFT_MODES = ("scaled", "coupled")
PREFILL_ALIGN = 32  # prompts are padded to a multiple of this: a few prefill shapes (and graphs)
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose [positions, vocab] logits are made at a time
GUIDE_CANDIDATES = 64  # draft tokens per depth the structured-output guide may take (`guided_draft`)
SAMPLER_COPIES = 3     # float32 copies of a round's logits that sampling on the torch path (CPU) holds


def prefill_width(longest: int, room: int) -> int:
    """Columns of a padded prefill whose longest prompt has `longest` tokens, with `room`
    cache slots for it: a multiple of PREFILL_ALIGN, or all the room."""
    return min(-(-longest // PREFILL_ALIGN) * PREFILL_ALIGN, room)


@dataclass
class BatchState:
    """Everything a batch of requests carries from one round to the next (static buffers)."""

    n: torch.Tensor            # [B] committed tokens
    anchor: torch.Tensor       # [B] next token to run through the target, at position n
    active: torch.Tensor       # [B] bool: finished requests stop committing
    sampling: SamplingBatch
    cache: KVCache
    draft_cache: DraftContextCache | None
    tokens: list[list[int]] | None = None  # the driver's record, per request, of the tokens whose
                                           # K/V and drafter context the caches hold (prefix caching)
    chain: DraftTree | None = None  # ar's and dflash's chain: fixed fields made once, read by the graphs

    @property
    def batch_size(self) -> int:
        return self.n.shape[0]

    def copy_prefix(self, src: "BatchState", n: int) -> None:
        """The K/V (target and drafter) of every request's first n positions <- src's."""
        self.cache.copy_prefix(src.cache, n)
        if self.draft_cache is not None:
            self.draft_cache.copy_prefix(src.draft_cache, n)

    @property
    def cache_bytes(self) -> int:
        """Bytes of its caches (target and drafter K/V)."""
        caches = [c for c in (self.cache, self.draft_cache) if c is not None]
        return sum(t.numel() * t.element_size() for c in caches for t in (c.k, c.v))


class SpeculativeDecoder:
    """Runs rounds of `method` ('ar', 'dflash' or 'ddtree' with `budget` nodes).

    draft_mode (sampling only): 'scaled' builds trees from the temperature-scaled
    draft distributions; 'coupled' from scores with the target's own Gumbel noise
    g(seed, p), so that each depth's best is argmax(logits / T + g), the very sample the
    target draws where the drafter is right: the draft logits + T g up to T = 1 (the
    tree then weighs depths by the drafter's own confidence; logits / T + g, 1 / T
    times as sharp, made the tree at T = 0.3 a near-chain and overflowed at 1e-40),
    logits / T + g past it. Either way the output is the AR stream: the tree only sets
    the speed. 'coupled' is the default: on the built-in pair it gave the higher tau
    (BENCHMARKS.md).
    """

    def __init__(self, target: CausalLM, drafter: DFlashDraftModel | None, method: str, budget: int = 0,
                 draft_mode: str = "coupled", attention_backend: str = "sdpa"):
        if method not in METHODS:
            raise UsageError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
        if method != "ar" and drafter is None:
            raise UsageError(f"method '{method}' needs a draft model")
        if draft_mode not in DRAFT_MODES:
            raise UsageError(f"unknown draft mode '{draft_mode}' (choose from {', '.join(DRAFT_MODES)})")
        self.target, self.method, self.draft_mode = target, method, draft_mode
        self.tp = target.tp  # the LM head's logits are this rank's vocabulary slice
        self.drafter = drafter if method != "ar" else None
        self.depth = drafter.block_size - 1 if method != "ar" else 0
        self.budget = {"ar": 0, "dflash": self.depth, "ddtree": budget}[method]
        self.taps = drafter.target_layer_ids if method != "ar" else []
        self.backend = attention_backend

    @property
    def tree_slots(self) -> int:
        """Cache slots a round needs past the committed prefix."""
        return max(self.budget + 1, self.drafter.block_size if self.drafter is not None else 1)

    def new_state(self, batch: int, max_len: int, sampling: SamplingBatch) -> BatchState:
        dev = self.target.lm_head.weight.device
        zeros = torch.zeros(batch, dtype=torch.long, device=dev)
        st = BatchState(zeros, zeros.clone(), torch.ones(batch, dtype=torch.bool, device=dev), sampling,
                        self.target.new_cache(batch, max_len, dev),
                        self.drafter.new_cache(batch, max_len, dev) if self.drafter is not None else None)
        self.check_round_memory(batch, max_len, dev, sampling.any_sampled)
        return st

    def check_round_memory(self, batch: int, max_len: int, device: torch.device, sampled: bool) -> None:
        """Refuse a batch whose round cannot fit beside its caches, rather than be killed
        by the OS mid-round (a budget of 100000 asked for a 10 GB ancestor matrix per
        request). Counted per request for T = budget + 1 tokens: the T x T ancestor
        matrix and the copy it is built from (bool), the reference attention's T x
        max_len mask (bool, and the one SDPA makes of it in the query's dtype, counted at 4
        bytes: 5 an entry), and this rank's T rows of logits; where a sampled batch
        samples on the torch path (not CUDA's fused kernels), SAMPLER_COPIES more of them
        in float32 (the noisy copy, its noise, the pick between it and the greedy rows;
        top-p's sort of the vocabulary adds about 2.5 more, uncounted). It bites only far
        past the default budget (the logits of 64 requests at budget 512 and a 152K
        vocabulary are 10 GB, and real)."""
        T = self.budget + 1
        need, have = self.round_bytes(batch, max_len, device, sampled), available_bytes(device)
        if have is not None and need > have:
            raise TreeflashError(f"not enough {device.type} memory for a round of {T} tokens per request "
                                 f"(budget {self.budget}) over {batch} requests: about {need / 2**30:.1f} GiB "
                                 f"of masks and logits, {have / 2**30:.1f} GiB free: lower the budget or the "
                                 f"batch size")

    def round_bytes(self, batch: int, max_len: int, device: torch.device, sampled: bool) -> int:
        """What `check_round_memory` counts for a round."""
        T = self.budget + 1
        head = self.target.lm_head.weight
        row = head.shape[0] * (head.element_size() + (4 * SAMPLER_COPIES if sampled and device.type != "cuda" else 0))
        return batch * T * (2 * T + (5 * max_len if self.backend == "sdpa" else 0) + row)

    def prefill_inputs(self, st: BatchState, prompts: list[list[int]],
                       starts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts as one padded batch: ids [B, T] on the device, T the longest prompt
        rounded up to a multiple of PREFILL_ALIGN (within the cache past `starts`, the
        slots a suffix prefill begins at), and lens [B]."""
        dev = st.n.device
        T = prefill_width(max(len(p) for p in prompts), st.cache.max_len - max(starts or [0]))
        ids = torch.zeros(len(prompts), T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        return ids.to(dev), torch.tensor([len(p) for p in prompts], device=dev)

    @torch.inference_mode()
    def prefill(self, st: BatchState, prompts: list[list[int]]):
        """Run the prompts into the caches and sample each request's first token into
        `st.anchor` (eager; written in place). Returns what `prefill_tokens` does."""
        return self.prefill_tokens(st, *self.prefill_inputs(st, prompts))

    @torch.inference_mode()
    def prefill_tokens(self, st: BatchState, ids: torch.Tensor, lens: torch.Tensor,
                       prompt_logprobs: list[tuple[int, int]] = (), begin: torch.Tensor | None = None,
                       kv_len: int | None = None):
        """`prefill` of padded ids [B, T] with lengths lens [B]: device work only, static
        shapes, so `GraphedPrefill` can capture it. Causal attention keeps the padding
        out of every real token; its K/V land past the prompt, where the rounds write.
        With `begin` [B] (prefix caching) the caches already hold request b's first
        begin[b] prompt tokens and ids are the rest: they attend to those as to a
        committed prefix (a chain verify, through the rounds' attention kernel), at
        positions begin[b] on; `kv_len` bounds what a reference kernel reads (eager only:
        None reads the whole cache, masked).
        Returns the first tokens' `logprobs_of` ([B, 1] rows) if the batch asks for
        them, and with `prompt_logprobs` ((row, prompt length) of the requests that ask;
        eager only, no begin) their prompt tokens': one [N] / [N, K] row per token but
        the first, request after request (token t+1 given tokens 0..t); each None if not."""
        B, T = ids.shape
        dev = ids.device
        if begin is None:
            begin = torch.zeros_like(lens)
            inputs = AttentionInputs.causal(torch.arange(T, device=dev).expand(B, T), kv_len=T)
        else:
            assert not prompt_logprobs, "a prompt's logprobs need all of its positions"
            inputs = AttentionInputs.causal(begin[:, None] + torch.arange(T, device=dev), prefix_lens=begin,
                                            kv_len=kv_len, backend=self.backend)
        h, feats = self.target(ids, inputs, st.cache, self.taps)
        last = h[torch.arange(B, device=dev), lens - 1]
        logits = self.target.logits(last[:, None], gather=False)
        sb = st.sampling
        sb.clear_history()
        states = sb.grammar_state[:, None] if sb.any_guided else None
        first = sample(logits, (begin + lens)[:, None], sb, self.tp, states=states)
        sb.extend_history(first, torch.ones_like(lens))
        sb.advance_grammar(sb.grammar_start, first[:, 0], torch.ones_like(st.active))
        st.anchor.copy_(first[:, 0])
        st.n.copy_(begin + lens)
        st.active.fill_(True)
        if st.draft_cache is not None:
            self.drafter.commit_context(st.draft_cache, feats, inputs.positions, begin)
        lp = logprobs_of(logits, first, self.tp) if st.sampling.any_logprobs else None
        return lp, (self._prompt_logprobs(h, ids, prompt_logprobs) if prompt_logprobs else None)

    def _prompt_logprobs(self, h: torch.Tensor, ids: torch.Tensor, rows: list[tuple[int, int]]):
        """`logprobs_of` each prompt token but the first of the requests `rows`
        ((row, length) pairs), from the prefill's hidden states h [B, T, H] at the positions
        before them: only those positions (not the padding, nor other requests'), and
        PROMPT_LOGPROB_ROWS of them at a time (a long prompt's logits over the whole
        vocabulary would not fit at once)."""
        T = ids.shape[1]
        at = torch.tensor([b * T + t for b, n in rows for t in range(n - 1)], dtype=torch.long, device=ids.device)
        states, tokens = h.flatten(0, 1)[at], ids.flatten()[at + 1]
        if not len(at):  # one-token prompts: nothing predicts their only token
            k = min(MAX_LOGPROBS, self.target.lm_head.vocab_size)
            empty = torch.empty(0, k, device=ids.device)
            return empty[:, 0], empty, empty.long(), empty[:, 0].long()
        parts = [logprobs_of(self.target.logits(states[s:s + PROMPT_LOGPROB_ROWS, None], gather=False),
                             tokens[s:s + PROMPT_LOGPROB_ROWS, None], self.tp)
                 for s in range(0, len(at), PROMPT_LOGPROB_ROWS)]
        return tuple(torch.cat(x, dim=0).flatten(0, 1) for x in zip(*parts))

    def draft_logits(self, st: BatchState, max_n: int | None = None) -> torch.Tensor:
        """This rank's vocabulary slice of the per-depth draft scores [B, D, V/N] for
        depths 1..D: float32 logits; for sampled requests at their temperature (scaled
        mode), or plus their temperature x the target's noise (coupled mode, T <= 1;
        past it logits / T + noise). `max_n` as in `round`."""
        d = self.drafter
        B, b = st.batch_size, d.block_size
        block = torch.full((B, b), d.mask_token_id, dtype=torch.long, device=st.n.device)
        block[:, 0] = st.anchor
        positions = st.n[:, None] + torch.arange(b, device=st.n.device)
        full = torch.ones(B, b, b, dtype=torch.bool, device=st.n.device)
        kv_len = None if max_n is None else max_n + b
        inputs = AttentionInputs(positions, st.n, full, kv_len=kv_len, backend=self.backend)
        h = d(self.target.embed(block), inputs, st.draft_cache)
        logits = d.scaled_logits(self.target.logits(h[:, 1:], gather=False).float())
        sb = st.sampling
        if sb.any_biased:  # the target's bias on the draft too: its tokens stay ones the target may take
            logits = apply_bias(logits, positions[:, 1:], sb, self.tp.rank * logits.shape[-1])
        # No top-k/top-p/min-p here: the filters act on the target's law; cutting the
        # draft to its own nucleus would only turn tree nodes into dead padding.
        start = self.tp.rank * logits.shape[-1]
        if sb.any_sampled and self.draft_mode == "coupled" and fused_enabled(logits):
            from treeflash.ops.gumbel_argmax import coupled_scores
            logits = coupled_scores(logits, sb.seed, positions[:, 1:], sb.temperature, start)
        elif sb.any_sampled and self.draft_mode == "coupled":  # T = 0: + 0 (the noise is finite)
            t = sb.temperature[:, None, None]
            noise = gumbel_noise(sb.seed, positions[:, 1:], start, logits.shape[-1])
            logits = torch.where(t > 1, logits / t.clamp_min(1) + noise, logits + t * noise)
        elif sb.any_sampled:  # as the target's sampler: T at least MIN_TEMPERATURE
            t = torch.where(sb.temperature > 0, sb.temperature.clamp_min(MIN_TEMPERATURE),
                            torch.ones_like(sb.temperature))
            logits = logits / t[:, None, None]
        if sb.any_guided:
            logits = self.guided_draft(logits, sb)
        return logits

    def guided_draft(self, logits: torch.Tensor, sb) -> torch.Tensor:
        """Draft scores [B, D, V/N] masked, depth by depth, to the tokens that the state
        after the drafter's own path allows; the path takes at each depth the best of its
        GUIDE_CANDIDATES top tokens that the state allows. Exact for a chain whose tokens
        are among them, a guide for the tree's other branches (the output stays AR's: the
        target's sampling is masked). Top-k and the mask are parallel; only the walk
        along the candidates is sequential (`SamplingBatch.path_states`)."""
        start = self.tp.rank * logits.shape[-1]
        _, ids = self.tp.topk(logits, min(GUIDE_CANDIDATES, logits.shape[-1] * self.tp.size), start)
        return grammar_masked(logits, sb, sb.path_states(ids), start)

    @torch.inference_mode()
    def build(self, st: BatchState, max_n: int | None = None) -> DraftTree:
        """The round's tree. Draft decisions are made on vocabulary slices (local
        argmax / top-k, one all-gather of the candidates): every rank builds the same tree."""
        if self.method == "ar":
            return self.chain(st, st.anchor.new_zeros(st.batch_size, 0))
        return self.tree_from_logits(self.draft_logits(st, max_n), st)

    def chain(self, st: BatchState, draft: torch.Tensor) -> DraftTree:
        """The chain of draft tokens [B, D] below st's anchor (D = 0: AR's root alone).
        Its parents, depths, ancestors and validity are the same every round: made once
        per batch state (and gone with it), so that a round launches only the
        concatenation (not ~10 kernels)."""
        anchor = st.anchor
        if st.chain is None:  # a capture's warm-up rounds come first: made outside the graph
            assert not (draft.is_cuda and torch.cuda.is_current_stream_capturing()), "chain made during a capture"
            st.chain = build_chain(draft, anchor)
        assert st.chain.tokens.shape == (draft.shape[0], draft.shape[1] + 1), "a batch state of another decoder"
        return replace(st.chain, tokens=torch.cat([anchor[:, None], draft], dim=1))

    def tree_from_logits(self, logits: torch.Tensor, st: BatchState) -> DraftTree:
        """The chain (dflash) or the DDTree of `budget` nodes below st's anchor, from this
        rank's slice of the draft logits [B, D, V/N]."""
        tp = self.tp
        start = tp.rank * logits.shape[-1]
        anchor = st.anchor
        if self.method == "dflash":
            return self.chain(st, tp.argmax(logits, start))
        k = min(self.budget, self.target.lm_head.vocab_size)
        vals, ids = tp.topk(logits, k, start, log_softmax=True)
        if fused_enabled(vals) and fits(self.budget, self.depth):  # one launch instead of ~100 (the same tree)
            return build_tree_fused(vals, ids, anchor, self.budget)
        return build_tree(vals, ids, anchor, self.budget)

    def verify(self, st: BatchState, tree: DraftTree, max_n: int | None = None):
        """The target over the root and every node of `tree` in one pass (each node sees
        the prefix and its ancestors): (logits [B, T, this rank's vocabulary slice], the
        drafter's tapped features, the nodes' positions). `max_n` as in `round`."""
        positions = st.n[:, None] + tree.depths
        kv_len = None if max_n is None else max_n + tree.size + 1
        inputs = AttentionInputs(positions, st.n, tree.ancestors, kv_len=kv_len, backend=self.backend)
        h, feats = self.target(tree.tokens, inputs, st.cache, self.taps)
        return self.target.logits(h, gather=False), feats, positions

    @torch.inference_mode()
    def round(self, st: BatchState, max_n: int | None = None):
        """One round for the whole batch, updating `st` in place. Returns the new tokens
        [B, D+1], how many of them each request committed ([B]; 0 if inactive) and, if
        the batch asks for them, the new tokens' `logprobs_of` (else None): the target's
        logits at the nodes of the accepted path are those AR would have sampled from.
        `max_n` (at least every request's n) bounds the attention's reads to the cache
        slots below max_n plus the round's; None reads the whole cache, as a CUDA graph
        must (its shapes cannot depend on the data)."""
        tree = self.build(st, max_n)
        logits, feats, positions = self.verify(st, tree, max_n)
        sb = st.sampling
        states = sb.node_states(tree.tokens, tree.parents, tree.depths, self.depth) if sb.any_guided else None
        target_tokens = sample(logits, positions + 1, sb, self.tp, path=(tree.tokens, tree.ancestors),
                               states=states)
        w = walk(tree, target_tokens, self.depth)
        counts = torch.where(st.active, w.accepted + 1, torch.zeros_like(w.accepted))
        sb.extend_history(w.new, counts)
        if sb.any_guided:  # the bonus was sampled at the deepest accepted node
            sb.advance_grammar(states.gather(1, w.best[:, None])[:, 0], w.bonus, st.active)
        if self.method == "ddtree":
            st.cache.compact(st.n, w.path)  # chains and AR are already in place
        if st.draft_cache is not None:
            idx = w.path[:, :, None].expand(-1, -1, feats.shape[-1])
            self.drafter.commit_context(st.draft_cache, feats.gather(1, idx),
                                        positions.gather(1, w.path), st.n)
        st.n += counts
        st.anchor.copy_(torch.where(st.active, w.bonus, st.anchor))
        logprobs = None
        if st.sampling.any_logprobs:  # w.new[:, i] (i <= accepted) is the target's token at node path[:, i]
            rows = logits.gather(1, w.path[:, :, None].expand(-1, -1, logits.shape[-1]))
            logprobs = logprobs_of(rows, target_tokens.gather(1, w.path), self.tp)
        return w.new, counts, logprobs
