"""The speculative round (design section 1), one code path for AR, DFlash and DDTree.

    draft  -> tree -> verify (one target forward over root + N nodes)
           -> sample (position-keyed) -> walk -> commit

AR is the empty tree, DFlash-linear the chain of top-1 draft tokens, DDTree the N
most probable prefixes. A request has `n` committed tokens (target KV and drafter
context at slots 0..n-1) and an anchor token at position n; a round commits the
anchor plus the accepted path and makes the target's bonus token the next anchor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from treeflash.engine.kv_cache import DraftContextCache, KVCache
from treeflash.engine.sampling import SamplingBatch, filter_logits, sample
from treeflash.engine.tree import DraftTree, build_chain, build_tree, empty_tree, walk
from treeflash.errors import UsageError
from treeflash.layers.attention import AttentionInputs
from treeflash.models.dflash import DFlashDraftModel
from treeflash.models.transformer import CausalLM

METHODS = ("ar", "dflash", "ddtree")


@dataclass
class BatchState:
    """Everything a batch of requests carries from one round to the next."""

    n: torch.Tensor            # [B] committed tokens
    anchor: torch.Tensor       # [B] next token to run through the target, at position n
    active: torch.Tensor       # [B] bool: finished requests stop committing
    sampling: SamplingBatch
    cache: KVCache
    draft_cache: DraftContextCache | None
    max_n: int                 # host's max of n (updated from the counts it reads back)


class SpeculativeDecoder:
    """Runs rounds of `method` ('ar', 'dflash' or 'ddtree' with `budget` nodes)."""

    def __init__(self, target: CausalLM, drafter: DFlashDraftModel | None, method: str, budget: int = 0):
        if method not in METHODS:
            raise UsageError(f"unknown method '{method}' (choose from {', '.join(METHODS)})")
        if method != "ar" and drafter is None:
            raise UsageError(f"method '{method}' needs a draft model")
        self.target, self.drafter, self.method = target, drafter, method
        self.depth = drafter.block_size - 1 if method != "ar" else 0
        self.budget = {"ar": 0, "dflash": self.depth, "ddtree": budget}[method]
        self.taps = drafter.target_layer_ids if method != "ar" else []
        self.target_forwards = 0  # counted for tests: one per round, whatever the budget

    @property
    def tree_slots(self) -> int:
        """Cache slots a round needs past the committed prefix."""
        return max(self.budget + 1, self.drafter.block_size if self.drafter is not None else 1)

    def _target(self, ids, inputs, cache):
        self.target_forwards += 1
        return self.target(ids, inputs, cache, self.taps)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], sampling: SamplingBatch, max_len: int) -> BatchState:
        """Run the prompts (padded into one batch), sample each request's first token."""
        dev = self.target.lm_head.weight.device
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, T, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        cache = self.target.new_cache(B, max_len, dev)
        positions = torch.arange(T, device=dev).expand(B, T)
        h, feats = self._target(ids, AttentionInputs.causal(positions, kv_len=T), cache)
        last = h[torch.arange(B, device=dev), lens - 1]
        first = sample(self.target.logits(last[:, None]), lens[:, None], sampling)[:, 0]
        draft_cache = None
        if self.drafter is not None and self.method != "ar":
            draft_cache = self.drafter.new_cache(B, max_len, dev)
            self.drafter.commit_context(draft_cache, feats, positions, torch.zeros_like(lens), lens)
        return BatchState(lens, first, torch.ones(B, dtype=torch.bool, device=dev), sampling,
                          cache, draft_cache, max(len(p) for p in prompts))

    def draft_scores(self, st: BatchState) -> torch.Tensor:
        """Per-depth draft scores [B, D, V] for depths 1..D: one drafter forward over
        [anchor, MASK...], log-probabilities at each request's temperature and filters."""
        d = self.drafter
        B, b = st.anchor.shape[0], d.block_size
        block = torch.full((B, b), d.mask_token_id, dtype=torch.long, device=st.anchor.device)
        block[:, 0] = st.anchor
        positions = st.n[:, None] + torch.arange(b, device=st.n.device)
        full = torch.ones(B, b, b, dtype=torch.bool, device=st.n.device)
        inputs = AttentionInputs(positions, st.n, full, kv_len=st.max_n + b)
        h = d(self.target.embed(block), inputs, st.draft_cache)
        logits = self.target.logits(h[:, 1:]).float()
        sb = st.sampling
        if sb.any_sampled:
            t = torch.where(sb.temperature > 0, sb.temperature, torch.ones_like(sb.temperature))
            logits = logits / t[:, None, None]
            if sb.any_filtered:
                logits = filter_logits(logits, sb.top_k, sb.top_p)
        return torch.log_softmax(logits, dim=-1)

    def build(self, st: BatchState) -> DraftTree:
        if self.method == "ar":
            return empty_tree(st.anchor)
        scores = self.draft_scores(st)
        if self.method == "dflash":
            return build_chain(scores, st.anchor)
        return build_tree(scores, st.anchor, self.budget)

    @torch.inference_mode()
    def round(self, st: BatchState) -> tuple[torch.Tensor, torch.Tensor]:
        """One round for the whole batch. Returns the new tokens [B, D+1] and how many
        of them each request committed ([B]; 0 for inactive requests)."""
        tree = self.build(st)
        T = tree.size + 1
        positions = st.n[:, None] + tree.depths
        inputs = AttentionInputs(positions, st.n, tree.ancestors, kv_len=st.max_n + T)
        h, feats = self._target(tree.tokens, inputs, st.cache)
        target_tokens = sample(self.target.logits(h), positions + 1, st.sampling)
        w = walk(tree, target_tokens, self.depth)
        counts = torch.where(st.active, w.accepted + 1, torch.zeros_like(w.accepted))
        if self.method == "ddtree":
            st.cache.compact(st.n, w.path)  # chains and AR are already in place
        if st.draft_cache is not None:
            idx = w.path[:, :, None].expand(-1, -1, feats.shape[-1])
            self.drafter.commit_context(st.draft_cache, feats.gather(1, idx),
                                        positions.gather(1, w.path), st.n, counts)
        path_tokens = tree.tokens.gather(1, w.path)
        new = torch.cat([path_tokens[:, 1:], w.bonus[:, None]], dim=1)
        new.scatter_(1, w.accepted[:, None], w.bonus[:, None])
        st.n = st.n + counts
        st.anchor = torch.where(st.active, w.bonus, st.anchor)
        return new, counts
