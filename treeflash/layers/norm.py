import torch
from torch import nn

from treeflash.ops import SplitSums, fused_enabled


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as Hugging Face Qwen3 and Llama do."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor | SplitSums, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, (s, norm(s)) for s = x + residual (one launch on the
        fused path: the residual add of a decoder layer costs no kernel of its own, nor
        do the K shares of a projection that comes as `SplitSums`, fused path only)."""
        if isinstance(x, SplitSums) or fused_enabled(x):
            from treeflash.ops.fused import add_rms_norm
            return add_rms_norm(x, self.weight, self.eps, residual=residual)
        if residual is not None:
            x = x + residual
            return x, self.forward(x)
        dtype = x.dtype
        h = x.to(torch.float32) if dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)
