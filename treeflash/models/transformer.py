"""Decoder-only targets: Qwen3, Qwen2, Llama, Mistral, Qwen3-MoE and gpt-oss are one
module (Qwen3 adds q/k norms; Qwen2 biases on q/k/v; Qwen3-MoE replaces the MLP of its
sparse layers by `models.moe.SparseMoE`; gpt-oss has experts in every layer, attention
sinks and sliding-window layers, as Qwen2, Qwen3 and Mistral may have).

`forward` runs a block of tokens against the KV cache (see `layers.attention`) and
returns the final hidden states plus the residual stream after the tapped layers,
which the DFlash drafter reads. `logits` applies the LM head separately, so a verify
pass computes logits for every tree node and a prefill only for its last token.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from treeflash.config import ModelConfig
from treeflash.distributed import TPGroup
from treeflash.errors import TreeflashError
from treeflash.layers.attention import (AttentionInputs, attention_kernel, dense_attention, within_window,
                                       write_block)
from treeflash.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from treeflash.layers.kv_cache import KVCache
from treeflash.layers.linear import ColumnParallelLinear, RowParallelLinear, ShardedLinear
from treeflash.layers.norm import RMSNorm
from treeflash.layers.rotary import RotaryEmbedding, apply_rotary
from treeflash.models.moe import Experts, SparseMoE
from treeflash.ops import fused_enabled, single_row, summed, swiglu

try:  # Triton kernels, used only when `fused_enabled` (CUDA inference)
    from treeflash.ops.fused import norm_rope, rope_into_cache
except ImportError:
    norm_rope = rope_into_cache = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, window: int | None = None):
        super().__init__()
        self.tp = tp
        self.window = window
        self.head_dim = cfg.head_dim
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        self.scale = cfg.head_dim ** -0.5
        D = cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D],
            bias=cfg.attention_bias, tp=tp, what="attention heads")
        self.o_proj = RowParallelLinear(cfg.num_heads * D, cfg.hidden_size, bias=cfg.o_proj_bias, tp=tp)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps) if cfg.qk_norm else None
        # gpt-oss: a logit per head in every softmax's denominator
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if cfg.attention_sinks else None

    def checkpoint_pieces(self, leaf: str) -> list[tuple[str, torch.Tensor, int]]:
        """The sinks (this module's only own tensor) are cut by heads, as the q rows."""
        return [(leaf, getattr(self, leaf), 0)]

    def project_qkv(self, x: torch.Tensor, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.parts, dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if fused_enabled(x):  # one kernel per tensor for norm + RoPE
            qw, kw, eps = self.qk_norms()
            return norm_rope(q, qw, eps, cos, sin), norm_rope(k, kw, eps, cos, sin), v
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def project_kv(self, x: torch.Tensor, cos, sin):
        """k (normed, rotated) and v [B, T, Hkv, D] of x, reading only the k/v rows of the
        weight: the drafter's context projection needs no q."""
        B, T, _ = x.shape
        k, v = self.qkv_proj.kv_only(x).view(B, T, 2, self.num_kv_heads, self.head_dim).unbind(2)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k, cos, sin), v

    def qk_norms(self):
        """(q_norm weight, k_norm weight, eps) for the fused kernels; (None, None, 0.0)
        without q/k norms (Qwen2, Llama, Mistral)."""
        if self.q_norm is None:
            return None, None, 0.0
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def forward(self, x, cos, sin, inputs: AttentionInputs, kv: tuple | None, prefix_kv: tuple | None = None,
                add_shares: bool = True):
        """kv: this layer's (k_cache, v_cache), or None for the cache-free (training) path,
        where `prefix_kv` optionally holds K/V [B, P, Hkv, D] placed before the block.
        `add_shares=False`: the output may be `SplitSums` (see `RowParallelLinear`)."""
        B, T, _ = x.shape
        if kv is not None and not inputs.is_prefill and fused_enabled(x):
            # decode / verify / draft: q/k norm, RoPE and the cache writes in one launch
            q = rope_into_cache(self.qkv_proj(x), self.num_heads, self.num_kv_heads, *self.qk_norms(),
                                cos, sin, kv[0], kv[1], inputs.prefix_lens)
            out = attention_kernel(inputs.backend)(q, kv[0], kv[1], inputs, self.scale,
                                                   sinks=self.sinks, window=self.window)
            return self.o_proj(out.reshape(B, T, -1), add_shares=add_shares)
        q, k, v = self.project_qkv(x, cos, sin)
        if kv is None:
            if prefix_kv is not None:
                if self.window is not None:
                    raise TreeflashError("drafter layers with a sliding window cannot be trained here")
                k, v = torch.cat([prefix_kv[0], k], 1), torch.cat([prefix_kv[1], v], 1)
                out = dense_attention(q, k, v, inputs.block_mask, self.scale, self.sinks)
            elif inputs.block_mask is None:   # causal (training)
                out = dense_attention(q, k, v, None, self.scale, self.sinks, self.window)
            else:
                mask = inputs.block_mask if self.window is None else \
                    inputs.block_mask & within_window(inputs.positions, inputs.positions, self.window)
                out = dense_attention(q, k, v, mask, self.scale, self.sinks)
        else:
            k_cache, v_cache = kv
            slots = inputs.block_slots()
            write_block(k_cache, k, slots)
            write_block(v_cache, v, slots)
            if inputs.is_prefill:
                out = dense_attention(q, k, v, None, self.scale, self.sinks, self.window)
            else:
                out = attention_kernel(inputs.backend)(q, k_cache, v_cache, inputs, self.scale,
                                                       sinks=self.sinks, window=self.window)
        return self.o_proj(out.reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU MLP; `size`/`bias` default to the dense layers' (a shared expert passes its own)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, size: int | None = None, bias: bool | None = None):
        super().__init__()
        I = size or cfg.intermediate_size
        bias = cfg.mlp_bias if bias is None else bias
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [I, I], bias=bias, tp=tp,
                                                 what="intermediate_size" if size is None else "shared expert size")
        self.down_proj = RowParallelLinear(I, cfg.hidden_size, bias=bias, tp=tp)

    def gated(self, x):
        gu = self.gate_up_proj
        return swiglu(x, gu.weight, gu.bias, gu.fp8)

    def partial(self, x):
        """This rank's share of the output, before the all-reduce (bias-free MLPs only)."""
        return self._through(x, self.down_proj.partial)

    def forward(self, x, add_shares: bool = True):
        return self._through(x, functools.partial(self.down_proj, add_shares=add_shares))

    def _through(self, x, down):
        if fused_enabled(x) and single_row(x):  # batch-1 decode: the gate is applied inside the down GEMV
            return down(self.gate_up_proj(x), gated=True)
        return down(self.gated(x))


class DecoderLayer(nn.Module):
    """Attention and MLP; with `sparse` the MLP is a mixture of experts (DFlash drafter
    layers never are)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, sparse: bool = False, window: int | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, tp, window)
        if sparse:
            shared = cfg.n_shared_experts * cfg.moe_intermediate_size
            self.mlp = SparseMoE(cfg, tp, MLP(cfg, tp, shared, bias=False) if shared else None)
        else:
            self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, pending, cos, sin, inputs, kv, prefix_kv=None):
        """The residual stream arrives as h + pending (pending: the previous layer's MLP
        output, None for the first layer) and leaves as the pair (h, MLP output): each
        residual add happens inside the next norm (`RMSNorm(x, residual)`), which also
        adds the K shares of the projections before it (`SplitSums`)."""
        if pending is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm(pending, residual=h)
        a = self.self_attn(x, cos, sin, inputs, kv, prefix_kv, add_shares=False)
        h, x = self.post_attention_layernorm(a, residual=h)
        return h, self.mlp(x, add_shares=False) if isinstance(self.mlp, MLP) else self.mlp(x)


def run_layers(layers, h, cos, sin, inputs, kvs, final_norm, taps=(), prefix_kvs=None):
    """h through `layers` (kvs[i]: layer i's cache pair or None), then `final_norm`.
    Returns (normed output, {tap: residual stream after that layer}); the stream after
    the last layer is taken after the final norm (as HF's last hidden state)."""
    pending, tapped, last = None, {}, len(layers) - 1
    for i, layer in enumerate(layers):
        h, pending = layer(h, pending, cos, sin, inputs, kvs[i], None if prefix_kvs is None else prefix_kvs[i])
        if i in taps and i != last:
            pending = summed(pending)
            tapped[i] = h + pending
    h = final_norm(h) if pending is None else final_norm(pending, residual=h)[1]
    if last in taps:
        tapped[last] = h
    return h, tapped


# Checkpoint tensors stored side by side in one of our parameters.
MERGED_WEIGHTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def to_fp8(module: nn.Module, prefix: str, cfg: ModelConfig) -> None:
    """FP8 weights (cfg.fp8_block) in every linear layer and every experts module of
    `module` (named `prefix` in the checkpoint) but those whose weights the checkpoint
    stores in higher precision (cfg.fp8_skip)."""
    for name, layer in module.named_modules(prefix=prefix):
        parent, _, local = name.rpartition(".")
        if isinstance(layer, Experts):
            names = [f"{name}.{e}.{m}" for e in range(layer.gate_up_proj.shape[0])
                     for m in ("gate_proj", "up_proj", "down_proj")]
        elif isinstance(layer, ShardedLinear):
            names = [f"{parent}.{m}" for m in MERGED_WEIGHTS.get(local, (local,))]
        else:
            continue
        kept = {f"{n}.weight" in cfg.fp8_skip for n in names}
        if len(kept) > 1:
            shown = ", ".join(names) if len(names) <= 3 else f"the experts of {name}"
            raise TreeflashError(f"the checkpoint stores some of {shown} in FP8 and some in higher precision: "
                                 f"they are one merged layer here")
        if not kept.pop():
            layer.to_fp8(cfg.fp8_block, name)


class DecoderStack(nn.Module):
    """HF's `model.*` module: embeddings, layers, final norm. An FP8 checkpoint's layers
    take their FP8 form one by one as they are made: the device never holds the whole
    model in the higher precision."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList()
        for i in range(cfg.num_layers):
            self.layers.append(DecoderLayer(cfg, tp, cfg.sparse_layer(i), cfg.attention_window(i)))
            if cfg.fp8_block is not None:
                to_fp8(self.layers[i], f"model.layers.{i}", cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """A Qwen3ForCausalLM / Qwen2ForCausalLM / LlamaForCausalLM / MistralForCausalLM /
    Qwen3MoeForCausalLM / GptOssForCausalLM target."""

    merged_weights = MERGED_WEIGHTS

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderStack(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def checkpoint_key(self, name: str) -> str:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return "model.embed_tokens.weight"
        if self.config.arch == "gpt_oss":  # its router is `mlp.router`
            return name.replace(".mlp.gate.", ".mlp.router.")
        return name

    @property
    def checkpoint_aliases(self) -> dict[str, str]:
        """Tied embeddings may be saved under the LM head's name only (transformers
        loads such checkpoints and ties them): read them from there when absent."""
        return {"model.embed_tokens.weight": "lm_head.weight"} if self.config.tie_word_embeddings else {}

    def new_cache(self, batch: int, max_len: int, device=None) -> KVCache:
        attn = self.model.layers[0].self_attn
        p = self.lm_head.weight
        return KVCache(len(self.model.layers), batch, attn.num_kv_heads, max_len, attn.head_dim,
                       p.dtype, device or p.device)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def forward(self, ids: torch.Tensor, inputs: AttentionInputs, cache: KVCache | None = None,
                taps: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns final hidden states [B, T, H] and tapped states [B, T, len(taps) * H]
        (the residual stream after each tapped layer, as HF `hidden_states[id + 1]`)."""
        h = self.embed(ids)
        cos, sin = self.rotary.cos_sin(inputs.positions, h.dtype)
        layers = self.model.layers
        kvs = [None if cache is None else (cache.k[i], cache.v[i]) for i in range(len(layers))]
        h, tapped = run_layers(layers, h, cos, sin, inputs, kvs, self.model.norm, taps)
        features = torch.cat([tapped[i] for i in taps], dim=-1) if taps else None
        return h, features

    def logits(self, h: torch.Tensor, gather: bool = True) -> torch.Tensor:
        return self.lm_head(h, gather=gather)
