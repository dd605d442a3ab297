"""Linear layers sharded over a `TPGroup`.

Each layer knows how its weight is cut from the full checkpoint tensors
(`shard_dim`): column-parallel layers keep a slice of the output features,
row-parallel layers a slice of the input features and all-reduce their output.
Merged layers (QKV, gate/up) hold several checkpoint tensors side by side.
"""
from __future__ import annotations

import torch
from torch import nn

from treeflash.distributed import TPGroup
from treeflash.ops import gated_linear, linear


class ColumnParallelLinear(nn.Module):
    """y = x W^T for this rank's slice of every part's output features.

    `parts` lists the output sizes of the checkpoint tensors stored side by side
    (one part for a plain layer, [q, k, v] for QKV, [gate, up] for the MLP).
    """

    shard_dim = 0

    def __init__(self, in_features: int, parts: list[int], bias: bool = False,
                 tp: TPGroup = TPGroup(), what: str = "output features"):
        super().__init__()
        self.tp = tp
        self.parts = [tp.shard(p, what) for p in parts]
        self.weight = nn.Parameter(torch.empty(sum(self.parts), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(self.parts)), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def kv_only(self, x: torch.Tensor) -> torch.Tensor:
        """The output of all parts but the first (k and v of a QKV layer), reading only
        their rows of the weight: the drafter's context projection needs no q."""
        q = self.parts[0]
        return linear(x, self.weight[q:], None if self.bias is None else self.bias[q:])


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T (+ bias once).

    The input is this rank's slice of the features (the output of a column-parallel
    layer), or, with `input_is_parallel=False`, the whole input, which the layer
    slices itself (the DFlash `fc` over replicated target features).
    """

    shard_dim = 1

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = TPGroup(), what: str = "input features", input_is_parallel: bool = True):
        super().__init__()
        self.tp = tp
        self.parts = [out_features]
        cols = tp.shard(in_features, what)
        self.input_slice = None if input_is_parallel else (tp.rank * cols, (tp.rank + 1) * cols)
        self.weight = nn.Parameter(torch.empty(out_features, cols), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, gated: bool = False) -> torch.Tensor:
        """`gated`: x is one row of [gate | up] and the input is silu(gate) * up (the
        MLP's batch-1 fused path)."""
        if self.input_slice is not None and self.tp.size > 1:
            x = x[..., self.input_slice[0]:self.input_slice[1]]
        y = self.tp.all_reduce(gated_linear(x, self.weight) if gated else linear(x, self.weight))
        return y + self.bias if self.bias is not None else y
