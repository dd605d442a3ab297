"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of
the vocabulary rows."""
from __future__ import annotations

import torch
from torch import nn

from treeflash.distributed import TPGroup
from treeflash.ops import embedding, linear


class _VocabShard(nn.Module):
    """This rank's contiguous slice of the vocabulary rows of a [vocab, dim] weight."""

    shard_dim = 0

    def __init__(self, vocab_size: int, dim: int, tp: TPGroup = TPGroup()):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows = tp.shard(vocab_size, "vocab_size")
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, dim), requires_grad=False)


class VocabParallelEmbedding(_VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = embedding(local.clamp(0, self.rows - 1), self.weight) * inside[..., None]
        return self.tp.all_reduce(out)


class ParallelLMHead(_VocabShard):
    """Logits for this rank's vocabulary slice; `gather=True` returns the full vocabulary."""

    def forward(self, h: torch.Tensor, gather: bool = True) -> torch.Tensor:
        logits = linear(h, self.weight)
        return self.tp.all_gather(logits, dim=-1) if gather else logits
