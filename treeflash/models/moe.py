"""Sparse mixture-of-experts FFN (Qwen3-MoE), tensor-parallel.

A router picks k of E experts per token; the token's output is the routing-weighted
sum of those experts' SwiGLU MLPs. The router is replicated (every rank routes alike).
Tensor parallelism cuts every expert's intermediate dim over the ranks, as a dense MLP
is cut (column-parallel gate/up, row-parallel down): each rank computes its partial
sums for all experts, and the layer ends with ONE all-reduce, shared experts included.
No tokens move between ranks, and every rank reads 1/N of each picked expert.

Also here: what the bench needs to count an MoE model's memory floor
(`weight_bytes_read`) and the Kimi-K2-like shape it times (`KIMI_K2_4L`).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from treeflash.config import ModelConfig
from treeflash.distributed import TPGroup
from treeflash.errors import TreeflashError
from treeflash.layers.linear import check_fp8_cuts, fp8_parameters
from treeflash.ops import Fp8Weight, dequantized, fp8_kernels_fit, fused_enabled

try:  # Triton kernels, used only when `fused_enabled` (CUDA inference)
    from treeflash.kernels.fused_moe import fused_experts, route
except ImportError:
    fused_experts = route = None

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Router(nn.Module):
    """HF's `mlp.gate` (gpt-oss: `mlp.router`, with a bias): softmax of x W^T + b (in
    float32 at least), top-k, optionally renormalized to sum to 1 (gpt-oss's softmax over
    the top-k logits is that); weights in x's dtype, as transformers casts them. After
    the product, one Triton launch on the fused path (`kernels.fused_moe.route`)."""

    def __init__(self, hidden: int, experts: int, top_k: int, renormalize: bool, bias: bool = False):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(experts), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> routing weights [T, k], expert ids [T, k]."""
        if fused_enabled(x) and x.dtype in KERNEL_DTYPES:
            return route(F.linear(x, self.weight, self.bias), self.top_k, self.renormalize)
        probs = F.linear(x, self.weight, self.bias).softmax(-1, dtype=torch.promote_types(x.dtype, torch.float32))
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), ids


def swiglu(gate: torch.Tensor, up: torch.Tensor, clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """silu(gate) * up; with clamp = (alpha, limit), gpt-oss's form: gate clamped above and
    up on both sides at limit, then gate * sigmoid(alpha * gate) * (up + 1)."""
    if clamp is None:
        return F.silu(gate) * up
    alpha, limit = clamp
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


def experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor,
                      fp8: tuple[Fp8Weight, Fp8Weight] | None = None, every_expert: bool = False,
                      bias: tuple[torch.Tensor, torch.Tensor] | None = None,
                      clamp: tuple[float, float] | None = None) -> torch.Tensor:
    """The experts in plain torch: exact, any dtype (the CPU path, the training path under
    autocast, and the kernel's oracle). `fp8`: the scales of FP8 `gate_up` and `down` (one
    block grid per expert); each expert's weights are dequantized when it runs. `bias`:
    gate_up's [E, 2I] and down's [E, H]; `clamp`: see `swiglu`.

    Only the experts that were picked run (the host reads which), on their tokens. With
    `every_expert`, every expert runs on every token, weighted 0 where it was not picked:
    E / k times the work, but no host sync, so a CUDA graph can capture it (a float64
    model on the GPU)."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]) if every_expert else ids.unique().tolist():
        hit = ids == e
        w = (weights * hit).sum(-1)              # e's weight per token: a token picks e at most once
        rows = None if every_expert else hit.any(-1).nonzero()[:, 0]
        xe, we = (x, w) if rows is None else (x[rows], w[rows])
        w_gate_up, w_down = gate_up[e], down[e]
        if fp8 is not None:
            w_gate_up, w_down = (dequantized(m, Fp8Weight(f.scale[e], f.block), x.dtype)
                                 for m, f in ((w_gate_up, fp8[0]), (w_down, fp8[1])))
        b_gate_up, b_down = (None, None) if bias is None else (bias[0][e], bias[1][e])
        gate, up = F.linear(xe, w_gate_up, b_gate_up).chunk(2, dim=-1)
        y = F.linear(swiglu(gate, up, clamp), w_down, b_down) * we[:, None]
        out = out + y if rows is None else out.index_add_(0, rows, y)
    return out


MATRICES = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class Experts(nn.Module):
    """All experts' weights in two tensors (transformers' in-memory layout): gate_up
    [E, 2I, H] (each expert's gate rows, then its up rows) and down [E, H, I], where I is
    this rank's slice of `moe_intermediate_size`. From an FP8 checkpoint (`to_fp8`) both
    are float8 e4m3 with one float32 scale per block of every expert's matrix
    (`gate_up_proj_scale_inv`, `down_proj_scale_inv`)."""

    block: tuple[int, int] | None = None  # FP8: the rows and columns each scale covers
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # gate_up's [E, 2I], down's [E, H]
    clamp: tuple[float, float] | None = None  # `swiglu`'s gpt-oss form

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.tp = tp
        E, H = cfg.num_experts, cfg.hidden_size
        I = tp.shard(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)

    def to_fp8(self, block: tuple[int, int], name: str) -> None:
        """Hold the experts as FP8 with block scales (`name`: the module's, for errors).
        Gate and up rows, and every rank's slice of I, must start on a block boundary."""
        E, I2, H = self.gate_up_proj.shape
        I = I2 // 2
        sharded = self.tp.size > 1
        check_fp8_cuts(f"{name}.*.gate_proj and up_proj", block, [I * self.tp.size], [I] if sharded else [], [])
        check_fp8_cuts(f"{name}.*.down_proj", block, [], [], [I] if sharded else [])
        if self.gate_up_proj.is_cuda and not fp8_kernels_fit(block):
            warnings.warn(f"{name}: FP8 blocks {block[1]} columns wide do not fit the GPU kernels (a power of two "
                          f"of 16 or more): the experts run in torch, each dequantized first (in CUDA graphs every "
                          f"expert on every token), which is very slow")
        self.block = tuple(block)
        device = self.gate_up_proj.device
        self.gate_up_proj, self.gate_up_proj_scale_inv = fp8_parameters((E, 2 * I, H), block, device)
        self.down_proj, self.down_proj_scale_inv = fp8_parameters((E, H, I), block, device)

    @property
    def fp8(self) -> tuple[Fp8Weight, Fp8Weight] | None:
        if self.block is None:
            return None
        return Fp8Weight(self.gate_up_proj_scale_inv, self.block), Fp8Weight(self.down_proj_scale_inv, self.block)

    def checkpoint_pieces(self, leaf: str) -> list[tuple[str, torch.Tensor, int]]:
        """(checkpoint key below this module, the part of parameter `leaf` it fills, the
        dim the ranks slice it along): checkpoints hold one tensor per expert and matrix
        (and one scale tensor each, `*.weight_scale_inv`, in FP8)."""
        matrix, scales = leaf.removesuffix("_scale_inv"), leaf.endswith("_scale_inv")
        suffix = "weight_scale_inv" if scales else "weight"
        names = MATRICES[matrix]
        dim = 0 if matrix == "gate_up_proj" else 1
        return [(f"{e}.{n}.{suffix}", part, dim) for e, w in enumerate(getattr(self, leaf))
                for n, part in zip(names, w.chunk(len(names)))]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums [T, H] (before the all-reduce)."""
        fp8 = self.fp8
        if fused_enabled(x) and x.dtype in KERNEL_DTYPES and (fp8 is None or fp8[0].fits_kernels):
            return fused_experts(x, weights, ids, self.gate_up_proj, self.down_proj, fp8, self.bias, self.clamp)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        return experts_reference(x, weights, ids, self.gate_up_proj, self.down_proj, fp8, every_expert=capturing,
                                 bias=self.bias, clamp=self.clamp)


FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantized(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """OCP MXFP4 as gpt-oss stores it: blocks [..., G, 16] uint8 (two e2m1 values a byte,
    the low nibble first) and scales [..., G] uint8 (e8m0: 2^(s - 127) for each group of
    32 values) -> [..., G * 32] in `dtype` (exact: every value is a bf16 value)."""
    pairs = torch.tensor([(FP4_E2M1[b & 0x0F], FP4_E2M1[b >> 4]) for b in range(256)], device=blocks.device)
    values = pairs[blocks.long()].flatten(-2) * torch.exp2(scales.float() - 127)[..., None]  # [..., G, 32]
    return values.flatten(-2).to(dtype)


class GptOssExperts(Experts):
    """gpt-oss's experts: biases, the clamped SwiGLU, and its checkpoint layout, which
    holds each matrix for all experts in one tensor, transposed, with gate and up
    columns interleaved (gate_up_proj [E, H, 2I], down_proj [E, I, H]), or as published,
    in MXFP4 (`*_blocks` and `*_scales`, [E, out, in] once dequantized). They are read
    whole, dequantized and put in this class's layout (gate rows, then up rows), and
    each rank keeps its slice of I. The down bias is added once: only rank 0 holds it
    (the others hold zeros), as its partial sums are all-reduced."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__(cfg, tp)
        E, I2, H = self.gate_up_proj.shape
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, I2), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(E, H), requires_grad=False)
        self.clamp = None if cfg.swiglu_limit is None else (cfg.swiglu_alpha, cfg.swiglu_limit)

    @property
    def bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj_bias, self.down_proj_bias

    def read_checkpoint(self, leaf: str, read, name: str) -> torch.Tensor:
        """This rank's `leaf` from the checkpoint; read(key below this module, required)
        gives a stored tensor whole (None if absent and not required); `name`: this
        module's, for errors."""
        def stored(key: str, shape: tuple, value: torch.Tensor | None = None) -> torch.Tensor:
            return self._checked(read(key, True) if value is None else value, f"{name}.{key}", shape)

        dest = getattr(self, leaf)
        E, I2, H = self.gate_up_proj.shape
        I, r, n = I2 // 2, self.tp.rank, self.tp.size
        if leaf == "down_proj_bias":
            value = stored(leaf, (E, H))
            return value if r == 0 else torch.zeros_like(value)
        if leaf == "gate_up_proj_bias":
            value = stored(leaf, (E, 2 * I * n))
            gate, up = value[:, 0::2], value[:, 1::2]
            return torch.cat([gate[:, r * I:(r + 1) * I], up[:, r * I:(r + 1) * I]], 1)
        # this rank's part, [E, out, in]: gate_up's rows 2rI .. 2(r + 1)I (its gate and up rows,
        # interleaved), down's columns rI .. (r + 1)I
        mine = slice(2 * r * I, 2 * (r + 1) * I) if leaf == "gate_up_proj" else slice(r * I, (r + 1) * I)
        out_in = (E, 2 * I * n, H) if leaf == "gate_up_proj" else (E, H, I * n)
        blocks = read(f"{leaf}_blocks", False)
        if blocks is None:  # [E, in, out]
            value = stored(leaf, (out_in[0], out_in[2], out_in[1]))
            value = (value[:, :, mine] if leaf == "gate_up_proj" else value[:, mine]).transpose(1, 2)
        else:
            value = self._mxfp4_part(read, leaf, name, out_in, mine, blocks, stored, dest)
        if leaf == "down_proj":
            return value
        return torch.cat([value[:, 0::2], value[:, 1::2]], 1)

    def _mxfp4_part(self, read, leaf, name, out_in, mine, blocks, stored, dest) -> torch.Tensor:
        """This rank's part of an MXFP4 matrix ([E, out, in / 32, 16] blocks, [E, out, in / 32]
        scales), dequantized expert by expert on dest's device: the whole matrix is never
        made (gpt-oss-120b's gate_up is 11 GB in bf16)."""
        if read(leaf, False) is not None:
            raise TreeflashError(f"the checkpoint holds both {name}.{leaf} and {name}.{leaf}_blocks (MXFP4): "
                                 f"which one is meant?")
        E, rows, cols = out_in
        if cols % 32:
            raise TreeflashError(f"{name}.{leaf}_blocks: MXFP4 groups 32 input features, and {cols} is not a "
                                 f"multiple of 32")
        blocks = stored(f"{leaf}_blocks", (E, rows, cols // 32, 16), blocks)
        scales = stored(f"{leaf}_scales", (E, rows, cols // 32))
        keep = slice(None)   # columns of the dequantized part still to cut
        if leaf == "gate_up_proj":
            blocks, scales = blocks[:, mine], scales[:, mine]
        elif mine.start % 32 == 0 and mine.stop % 32 == 0:
            groups = slice(mine.start // 32, mine.stop // 32)
            blocks, scales = blocks[:, :, groups], scales[:, :, groups]
        else:
            keep = mine
        part = None
        for e in range(E):
            one = mxfp4_dequantized(blocks[e].to(dest.device), scales[e].to(dest.device), dest.dtype)[:, keep]
            if part is None:
                part = torch.empty((E, *one.shape), dtype=dest.dtype, device=dest.device)
            part[e] = one
        return part

    @staticmethod
    def _checked(value: torch.Tensor, key: str, shape: tuple) -> torch.Tensor:
        if tuple(value.shape) != tuple(shape):
            raise TreeflashError(f"weight {key} has shape {list(value.shape)}, expected {list(shape)}")
        quantized = key.endswith(("_blocks", "_scales"))
        if quantized != (value.dtype == torch.uint8) or not (quantized or value.is_floating_point()):
            raise TreeflashError(f"weight {key} has dtype {value.dtype}, expected "
                                 f"{'uint8 (MXFP4)' if quantized else 'a float dtype'}")
        return value


class SparseMoE(nn.Module):
    """HF's `mlp` of a sparse layer: `gate` (router), `experts`, and optionally
    `shared_experts`, a dense MLP every token goes through (its `partial` gives this
    rank's share, so it joins the experts' all-reduce)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, shared: nn.Module | None = None):
        super().__init__()
        self.tp = tp
        self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob,
                           bias=cfg.expert_bias)
        self.experts = (GptOssExperts if cfg.arch == "gpt_oss" else Experts)(cfg, tp)
        self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts.partial(x)
        return self.tp.all_reduce(y).view(shape)
