"""The DFlash block-diffusion drafter, in the published checkpoint layout.

A few Qwen3-style layers with no embedding or LM head of their own. The target's
tapped hidden states of each committed position are projected once (`fc`,
`hidden_norm`, then every layer's k/v projection) into a `DraftContextCache`; a
draft is one forward of the block `[anchor, MASK...]` whose queries see that
context (its last `sliding_window` positions in a sliding layer) and the whole block
(non-causal).
"""
from __future__ import annotations

import torch
from torch import nn

from treeflash.config import DraftConfig
from treeflash.distributed import TPGroup
from treeflash.layers.attention import AttentionInputs, write_block
from treeflash.layers.kv_cache import DraftContextCache
from treeflash.layers.linear import RowParallelLinear
from treeflash.layers.norm import RMSNorm
from treeflash.layers.rotary import RotaryEmbedding
from treeflash.models.transformer import MERGED_WEIGHTS, DecoderLayer, run_layers
from treeflash.ops import fused_enabled

try:  # Triton kernels, used only when `fused_enabled` (CUDA inference)
    from treeflash.ops.fused import rope_into_cache
except ImportError:
    rope_into_cache = None


class DFlashDraftModel(nn.Module):
    merged_weights = MERGED_WEIGHTS

    def __init__(self, cfg: DraftConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.config = cfg
        c = cfg.layers
        self.block_size = cfg.block_size
        self.mask_token_id = cfg.mask_token_id
        self.target_layer_ids = list(cfg.target_layer_ids)
        # a sliding layer's block queries see the context's last keys within the window (and the whole block)
        self.layers = nn.ModuleList([DecoderLayer(c, tp, window=c.attention_window(i)) for i in range(c.num_layers)])
        # row-parallel over the concatenated target features (replicated on every rank)
        self.fc = RowParallelLinear(len(self.target_layer_ids) * c.hidden_size, c.hidden_size, tp=tp,
                                    what="DFlash fc input features", input_is_parallel=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_scaling)

    # A drafter checkpoint may carry a copy of its target's embeddings / LM head (some
    # training code saves them): the drafter uses the target's own, so they are not read.
    foreign_checkpoint_keys = ("embed_tokens", "lm_head")

    def checkpoint_key(self, name: str) -> str:
        return name

    def new_cache(self, batch: int, max_len: int, device=None) -> DraftContextCache:
        attn = self.layers[0].self_attn
        p = self.fc.weight
        return DraftContextCache(len(self.layers), batch, attn.num_kv_heads, max_len, attn.head_dim,
                                 p.dtype, device or p.device)

    def _context(self, features: torch.Tensor, positions: torch.Tensor):
        """Target features [B, P, taps*H] at positions [B, P] as every layer's context
        input, with their RoPE (cos, sin)."""
        ctx = self.hidden_norm(self.fc(features))
        return ctx, *self.rotary.cos_sin(positions, ctx.dtype)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor):
        """Per-layer (k, v) [B, P, Hkv, D] of target features [B, P, taps*H] at positions [B, P]."""
        ctx, cos, sin = self._context(features, positions)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    def commit_context(self, cache: DraftContextCache, features: torch.Tensor, positions: torch.Tensor,
                       start: torch.Tensor) -> None:
        """Project features of positions [B, P] into cache slots start + 0..P-1.

        Only a request's committed rows matter; the rest land in free space past its
        prefix (static shapes) and are overwritten later.
        """
        if fused_enabled(features):  # k/v rows of the weights only; k norm, RoPE, cache writes in one launch
            ctx, cos, sin = self._context(features, positions)
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                rope_into_cache(attn.qkv_proj.kv_only(ctx), attn.num_heads, attn.num_kv_heads, *attn.qk_norms(),
                                cos, sin, cache.k[i], cache.v[i], start, with_q=False)
        else:
            slots = start[:, None] + torch.arange(features.shape[1], device=start.device)
            for i, (k, v) in enumerate(self.context_kv(features, positions)):
                write_block(cache.k[i], k, slots)
                write_block(cache.v[i], v, slots)

    def forward(self, block_embeds: torch.Tensor, inputs: AttentionInputs,
                cache: DraftContextCache) -> torch.Tensor:
        """Hidden states [B, b, H] (after the final norm) of the draft block, from the
        target's embeddings of its tokens."""
        cos, sin = self.rotary.cos_sin(inputs.positions, block_embeds.dtype)
        kvs = [(cache.k[i], cache.v[i]) for i in range(len(self.layers))]
        return run_layers(self.layers, self._scaled_input(block_embeds), cos, sin, inputs, kvs, self.norm)[0]

    def _scaled_input(self, embeds: torch.Tensor) -> torch.Tensor:
        scale = self.config.input_embedding_scale  # some published drafters' (checkpoint's config)
        return embeds if scale == 1.0 else embeds * scale

    def scaled_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The target LM head's logits of the drafter's hidden states, as the checkpoint's
        config says its drafts are read: times output_multiplier, then soft-capped."""
        c = self.config
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping is not None:
            logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
        return logits

    def forward_dense(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                      features: torch.Tensor, feature_positions: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
        """Cache-free forward for training: blocks [B, M, H] at block_positions [B, M]
        attend to target features [B, P, taps*H] at feature_positions [B, P] and to the
        blocks themselves, as `mask` [B, M, P + M] allows. Returns normed hidden [B, M, H]."""
        cos, sin = self.rotary.cos_sin(block_positions, block_embeds.dtype)
        inputs = AttentionInputs(block_positions, None, mask)
        return run_layers(self.layers, self._scaled_input(block_embeds), cos, sin, inputs, [None] * len(self.layers),
                          self.norm, prefix_kvs=self.context_kv(features, feature_positions))[0]
