"""Linear layers sharded over a `TPGroup`.

Each layer knows how its weight is cut from the full checkpoint tensors
(`shard_dim`): column-parallel layers keep a slice of the output features,
row-parallel layers a slice of the input features and all-reduce their output.
Merged layers (QKV, gate/up) hold several checkpoint tensors side by side.

A layer of an FP8 checkpoint (`to_fp8`) holds its weight in float8 e4m3 and one
float32 scale per block of (rows, columns), `weight_scale_inv` as the checkpoint names
it (the weight is `fp8 * scale`, the name notwithstanding): half the bytes a decode
step streams. Activations stay in the model's dtype.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from treeflash.distributed import TPGroup
from treeflash.errors import TreeflashError
from treeflash.ops import Fp8Weight, SplitSums, fp8_kernels_fit, gated_linear, linear


def check_fp8_cuts(name: str, block: tuple[int, int], merged_rows: list[int], rank_rows: list[int],
                   rank_cols: list[int]) -> None:
    """Every checkpoint tensor merged into one weight, and every rank's slice, must start
    on a scale block's boundary: a block may not straddle two of them. `merged_rows`: the
    output sizes of the merged tensors but the last (whole, as the checkpoint has them);
    `rank_rows` / `rank_cols`: the output / input sizes of this rank's slices."""
    bn, bk = block
    for n in merged_rows:
        if n % bn:
            raise TreeflashError(f"{name}: FP8 block size {bn} does not divide its {n} output features of one "
                                 f"merged part: a scale block would straddle two tensors")
    for what, n, b in [("output features", n, bn) for n in rank_rows] + [("input features", n, bk) for n in rank_cols]:
        if n % b:
            raise TreeflashError(f"{name}: FP8 block size {b} does not divide its {n} {what} per rank: the scales "
                                 f"cannot be cut there (choose another tensor-parallel size)")


def fp8_parameters(shape: tuple[int, ...], block: tuple[int, int], device) -> tuple[nn.Parameter, nn.Parameter]:
    """An FP8 weight of `shape` (its last two dims a matrix, or one per expert) and its
    float32 scales, one per block of (rows, columns) of each matrix."""
    *lead, n, k = shape
    weight = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    scale = torch.empty(*lead, -(-n // block[0]), -(-k // block[1]), dtype=torch.float32, device=device)
    return nn.Parameter(weight, requires_grad=False), nn.Parameter(scale, requires_grad=False)


class ShardedLinear(nn.Module):
    """What both kinds share: weight [N, K] (this rank's), `parts`, optional bias, and
    the FP8 form."""

    shard_dim: int
    block: tuple[int, int] | None = None  # FP8: the rows and columns each scale covers

    def to_fp8(self, block: tuple[int, int], name: str) -> None:
        """Hold the weight as FP8 with block scales (`name`: the layer's, for errors)."""
        N, K = self.weight.shape
        sharded = self.tp.size > 1
        check_fp8_cuts(name, block, [p * self.tp.size for p in self.parts[:-1]],
                       self.parts if sharded and self.shard_dim == 0 else [],
                       [K] if sharded and self.shard_dim == 1 else [])
        if self.weight.is_cuda and not fp8_kernels_fit(block):
            warnings.warn(f"{name}: FP8 blocks {block[1]} columns wide do not fit the GPU kernels (a power of two "
                          f"of 16 or more): each product dequantizes the weight first, which is slow")
        self.block = tuple(block)
        self.weight, self.weight_scale_inv = fp8_parameters((N, K), block, self.weight.device)

    def parts_of(self, leaf: str) -> list[int]:
        """How parameter `leaf` splits into the checkpoint tensors merged in it."""
        return [-(-p // self.block[0]) for p in self.parts] if leaf == "weight_scale_inv" else self.parts

    @property
    def fp8(self) -> Fp8Weight | None:
        return None if self.block is None else Fp8Weight(self.weight_scale_inv, self.block)


class ColumnParallelLinear(ShardedLinear):
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
        return linear(x, self.weight, self.bias, self.fp8)

    def kv_only(self, x: torch.Tensor) -> torch.Tensor:
        """The output of all parts but the first (k and v of a QKV layer), reading only
        their rows of the weight: the drafter's context projection needs no q."""
        q = self.parts[0]
        fp8 = self.fp8 and Fp8Weight(self.fp8.scale[q // self.block[0]:], self.block)
        return linear(x, self.weight[q:], None if self.bias is None else self.bias[q:], fp8)


class RowParallelLinear(ShardedLinear):
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

    def partial(self, x: torch.Tensor, gated: bool = False, add_shares: bool = True) -> torch.Tensor | SplitSums:
        """This rank's x_r W_r^T, before the all-reduce and the bias. `gated`: x is one
        row of [gate | up] and the input is silu(gate) * up (the MLP's batch-1 fused path).
        `add_shares`: see `linear`."""
        if self.input_slice is not None and self.tp.size > 1:
            x = x[..., self.input_slice[0]:self.input_slice[1]]
        if gated:
            return gated_linear(x, self.weight, self.fp8)
        return linear(x, self.weight, None, self.fp8, add_shares=add_shares)

    def forward(self, x: torch.Tensor, gated: bool = False, add_shares: bool = True) -> torch.Tensor | SplitSums:
        """`add_shares=False` (the caller's next step is a fused RMSNorm): on one rank and
        without a bias, the output may be `SplitSums`, whose shares that norm adds."""
        if not add_shares and self.tp.size == 1 and self.bias is None:
            return self.partial(x, gated, add_shares=False)
        y = self.tp.all_reduce(self.partial(x, gated))
        return y + self.bias if self.bias is not None else y
