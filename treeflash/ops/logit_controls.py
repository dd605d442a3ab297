"""A request's logit controls (`bias` and `penalize` in `treeflash.engine.sampling`) in
one pass: each logit is read with its bias, stop flag, output count and prompt flag, and
written once as float32. torch makes about four float32 passes over [rows, V] for the
bias and eight for the penalties: for 256 tree rows of a 152K vocabulary on an H200 the
penalties alone took 0.9 ms of a 9 ms verify round (a model whose generation_config sets
repetition_penalty pays them every round)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeflash.kernels.chained import chained, start_after_previous

BLOCK = 1024


@triton.jit
def _controls_kernel(x_ptr, out_ptr, R, C, x_b, x_r,
                     bias_ptr, stop_ptr, pos_ptr, min_end_ptr, bias_b, bias_r, stop_b, stop_r,
                     count_ptr, seen_ptr, rep_ptr, freq_ptr, pres_ptr, count_b, count_r, seen_b, seen_r,
                     BIASED: tl.constexpr, PENALIZED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row b * R + r, chunk of C): out[b, r, :] from the entries of x and of the
    per-entry inputs at their strides (stride 0 broadcasts a request's [V] row over its
    round's rows)."""
    start_after_previous(PDL)
    row = tl.program_id(0)
    b = (row // R).to(tl.int64)
    r = (row % R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < C
    x = tl.load(x_ptr + b * x_b + r * x_r + cols, mask=inside, other=0.0).to(tl.float32)
    if BIASED:
        x = x + tl.load(bias_ptr + b * bias_b + r * bias_r + cols, mask=inside, other=0.0)
        early = tl.load(pos_ptr + b * R + r) < tl.load(min_end_ptr + b)
        held = tl.load(stop_ptr + b * stop_b + r * stop_r + cols, mask=inside, other=0) != 0
        x = tl.where(early & held, float("-inf"), x)
    if PENALIZED:
        count = tl.load(count_ptr + b * count_b + r * count_r + cols, mask=inside, other=0.0)
        prompt = tl.load(seen_ptr + b * seen_b + r * seen_r + cols, mask=inside, other=0) != 0
        rep = tl.load(rep_ptr + b)
        seen = count > 0
        x = tl.where(seen | prompt, tl.where(x > 0, x / rep, x * rep), x)
        x = x - tl.load(freq_ptr + b) * count - tl.load(pres_ptr + b) * seen.to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * C + cols, x, mask=inside)


def logit_controls(x: torch.Tensor, bias=None, penalties=None) -> torch.Tensor:
    """float32 [B, R, C]: x [B, R, C] with `bias` = (bias float32, stop flags bool, both
    [B, 1 or R, C]; positions [B, R], min_end [B]) and then `penalties` = (output counts
    float32, prompt flags bool, both [B, 1 or R, C]; repetition, frequency, presence [B]
    float32) applied; the per-entry inputs' last dimension contiguous."""
    B, R, C = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(B, R, C, device=x.device, dtype=torch.float32)
    if out.numel() == 0:
        return out

    def entries(t):  # [B, 1 or R, C] -> (tensor, stride of b, stride of r)
        t = t.expand(B, R, C)
        t = t.view(torch.uint8) if t.dtype == torch.bool else t
        assert t.stride(-1) == 1 and t.dtype in (torch.float32, torch.uint8)
        return t, t.stride(0), t.stride(1)

    bias_args, pen_args = [x, x, x, x, 0, 0, 0, 0], [x, x, x, x, x, 0, 0, 0, 0]
    if bias is not None:
        (b, b_b, b_r), (stop, s_b, s_r) = entries(bias[0]), entries(bias[1])
        bias_args = [b, stop, bias[2].contiguous(), bias[3], b_b, b_r, s_b, s_r]
    if penalties is not None:
        (count, c_b, c_r), (seen, p_b, p_r) = entries(penalties[0]), entries(penalties[1])
        pen_args = [count, seen, *penalties[2:], c_b, c_r, p_b, p_r]
    _controls_kernel[(B * R, triton.cdiv(C, BLOCK))](
        x, out, R, C, x.stride(0), x.stride(1), *bias_args, *pen_args,
        BIASED=bias is not None, PENALIZED=penalties is not None, BLOCK=BLOCK, **chained(x.device))
    return out
