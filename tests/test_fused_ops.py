"""Fused Triton layer ops (GPU only) against the torch layers they replace."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_ops_match_torch(dtype, tol):
    from treeflash.layers.norm import RMSNorm
    from treeflash.layers.rotary import RotaryEmbedding, apply_rotary
    from treeflash.ops.fused import add_rms_norm, norm_rope, silu_mul
    torch.manual_seed(0)
    dev, H, D = "cuda", 384, 128
    with torch.device(dev):
        norm = RMSNorm(H).to(dtype)
        norm.weight.data.normal_()
        x, r = torch.randn(2, 5, H, dtype=dtype), torch.randn(2, 5, H, dtype=dtype)
        with torch.enable_grad():  # the torch reference path
            ref_s, ref_n = x + r, norm(x + r)
        s, n = add_rms_norm(x, norm.weight, norm.eps, residual=r)
        assert (s - ref_s).abs().max() <= tol and (n - ref_n).abs().max() <= tol * 4
        qkv = torch.randn(2, 5, 8 * D, dtype=dtype)
        q = qkv[..., :4 * D].view(2, 5, 4, D)
        cos, sin = RotaryEmbedding(D, 1e6).cos_sin(torch.randint(0, 9000, (2, 5)), dtype)
        qn = RMSNorm(D).to(dtype)
        qn.weight.data.normal_()
        with torch.enable_grad():
            ref = apply_rotary(qn(q), cos, sin)
        assert (norm_rope(q, qn.weight, qn.eps, cos, sin) - ref).abs().max() <= tol * 8
        assert (norm_rope(q, None, 0.0, cos, sin) - apply_rotary(q, cos, sin)).abs().max() <= tol * 8
        gu = torch.randn(3, 2 * 1000, dtype=dtype)
        g, u = gu.chunk(2, -1)
        assert (silu_mul(gu) - F.silu(g) * u).abs().max() <= tol * 4
