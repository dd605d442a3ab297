"""The tensor-parallel group a model is sharded over.

`TPGroup()` is the single-process group (rank 0 of 1): every collective is a no-op.
Layers take the group explicitly, so a sharded model and a whole one run the same code.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def shard(self, n: int, what: str) -> int:
        """Size of this rank's slice of `n` items; they must divide evenly."""
        if n % self.size:
            from treeflash.errors import TreeflashError
            raise TreeflashError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}")
        return n // self.size
