"""Rotary position embeddings at arbitrary per-token positions (tree nodes sit at
`n + depth`, not at their index in the verify block)."""
import math

import torch
from torch import nn

from treeflash.ops import fused_enabled


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv = 1.0 / powers
    if scaling is None:
        return inv
    if scaling.get("rope_type") == "yarn":
        return yarn_inv_freq(powers, head_dim, theta, scaling)
    # Llama-3 frequency-dependent scaling.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])  # config.py requires them
    old_ctx = float(scaling["original_max_position_embeddings"])  # config.py fills it in
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(powers: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by `factor`), those turning more than
    beta_fast times are kept, with a linear ramp over the dims between (`powers`:
    theta^(2i/d)). The blend is transformers' expression term by term: a shorter
    equivalent (inv / factor * ramp + ...) rounds some frequencies 1 ulp apart, and
    cos and sin far into the context with them."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])

    def dim_of(turns: float) -> float:  # the dim whose frequency turns `turns` times over old_ctx
        return head_dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(float(scaling.get("beta_fast") or 32)), dim_of(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each frequency kept as it is
    return 1.0 / (factor * powers) * (1 - kept) + 1.0 / powers * kept


def yarn_attention_factor(scaling: dict | None) -> float:
    """The factor YaRN multiplies cos and sin by (so q.k by its square): 0.1 ln(factor) + 1."""
    if scaling is None or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        # A plain float32 tensor, not a buffer: casting the model to bf16 must not touch it.
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.scale = yarn_attention_factor(scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin of shape [B, T, head_dim] for integer positions [B, T]."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        if fused_enabled(positions):
            from treeflash.ops.fused import cos_sin
            return cos_sin(positions, self.inv_freq, dtype, self.scale)
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, H, D]; cos/sin: [B, T, D]."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
