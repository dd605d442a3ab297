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

import torch
import torch.nn.functional as F
from torch import nn

from treeflash.config import ModelConfig
from treeflash.distributed import TPGroup
from treeflash.ops import fused_enabled

try:  # Triton kernel, used only when `fused_enabled` (CUDA inference)
    from treeflash.kernels.fused_moe import fused_experts
except ImportError:
    fused_experts = None

KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Router(nn.Module):
    """HF's `mlp.gate`: softmax of x W^T (in float32 at least), top-k, optionally
    renormalized to sum to 1; weights in x's dtype, as transformers casts them."""

    def __init__(self, hidden: int, experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.weight = nn.Parameter(torch.empty(experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> routing weights [T, k], expert ids [T, k]."""
        probs = F.linear(x, self.weight).softmax(-1, dtype=torch.promote_types(x.dtype, torch.float32))
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), ids


def experts_reference(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The experts in plain torch: exact, any dtype (the CPU path and the kernel's oracle).

    On the CPU only the experts that were picked run (the host reads which), on their
    tokens. Elsewhere every expert runs on every token, weighted 0 where it was not
    picked: slow, but without a host sync, so a float64 GPU model can still be captured."""
    out = torch.zeros_like(x)
    cpu = x.device.type == "cpu"
    for e in ids.unique().tolist() if cpu else range(gate_up.shape[0]):
        hit = ids == e
        w = (weights * hit).sum(-1)              # e's weight per token: a token picks e at most once
        rows = hit.any(-1).nonzero()[:, 0] if cpu else None
        xe, we = (x, w) if rows is None else (x[rows], w[rows])
        gate, up = F.linear(xe, gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * we[:, None]
        out = out + y if rows is None else out.index_add_(0, rows, y)
    return out


class Experts(nn.Module):
    """All experts' weights in two tensors (transformers' in-memory layout): gate_up
    [E, 2I, H] (each expert's gate rows, then its up rows) and down [E, H, I], where I is
    this rank's slice of `moe_intermediate_size`."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.tp = tp
        E, H = cfg.num_experts, cfg.hidden_size
        I = tp.shard(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(E, H, I), requires_grad=False)

    def checkpoint_pieces(self, leaf: str) -> list[tuple[str, torch.Tensor, int]]:
        """(checkpoint key below this module, the part of parameter `leaf` it fills, the
        dim the ranks slice it along): checkpoints hold one tensor per expert and matrix."""
        if leaf == "gate_up_proj":
            I = self.gate_up_proj.shape[1] // 2
            return [piece for e, w in enumerate(self.gate_up_proj)
                    for piece in ((f"{e}.gate_proj.weight", w[:I], 0), (f"{e}.up_proj.weight", w[I:], 0))]
        return [(f"{e}.down_proj.weight", w, 1) for e, w in enumerate(self.down_proj)]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums [T, H] (before the all-reduce)."""
        if fused_enabled(x) and x.dtype in KERNEL_DTYPES:
            return fused_experts(x, weights, ids, self.gate_up_proj, self.down_proj)
        return experts_reference(x, weights, ids, self.gate_up_proj, self.down_proj)


class SparseMoE(nn.Module):
    """HF's `mlp` of a sparse layer: `gate` (router), `experts`, and optionally
    `shared_experts`, a dense MLP every token goes through (its `partial` gives this
    rank's share, so it joins the experts' all-reduce)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, shared: nn.Module | None = None):
        super().__init__()
        self.tp = tp
        self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        self.experts = Experts(cfg, tp)
        self.shared_experts = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.gate(x)
        y = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts.partial(x)
        return self.tp.all_reduce(y).view(shape)


# ----------------------------------------------------------------------------- bench support

def expected_experts(experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts `tokens` tokens pick, each k of E uniformly."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def weight_bytes_read(model: nn.Module, tokens: int) -> float:
    """Bytes of weights a forward of `model` over `tokens` tokens (all requests of the
    batch together) must read, embedding and LM head left out: every parameter, except
    that each MoE layer's routed experts count only the expected number of distinct
    experts picked under uniform routing. Under TP, this rank's bytes (its slices)."""
    skip = {"model.embed_tokens.weight", "lm_head.weight"}
    total = float(sum(p.numel() * p.element_size() for name, p in model.named_parameters() if name not in skip))
    for m in model.modules():
        if isinstance(m, SparseMoE):
            gu, dn = m.experts.gate_up_proj, m.experts.down_proj
            E = gu.shape[0]
            per_expert = (gu[0].numel() * gu.element_size() + dn[0].numel() * dn.element_size())
            total -= (E - expected_experts(E, m.gate.top_k, tokens)) * per_expert
    return total


# Kimi-K2's shape, cut to 4 layers: the dense first layer and 3 MoE layers, 108 GB of
# bf16 weights (each MoE layer is 34 GB), so one H200 holds it with a drafter and KV.
# Kimi-K2 has MLA attention, which treeflash does not implement: this uses GQA with 64
# query heads, 8 KV heads of 128 (and Qwen3's q/k norms). Routing is Qwen3-MoE's
# (softmax, top-8, renormalized), not K2's sigmoid scores with group-limited top-k and
# a scaling factor; RoPE without K2's YaRN scaling. For timing: the bytes are K2's.
KIMI_K2_4L = ModelConfig(
    "qwen3_moe", vocab_size=163840, hidden_size=7168, intermediate_size=18432, num_layers=4,
    num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=50000.0, max_position_embeddings=131072,
    num_experts=384, num_experts_per_tok=8, moe_intermediate_size=2048, norm_topk_prob=True,
    mlp_only_layers=[0], n_shared_experts=1)
