"""Programmatic dependent launch: a kernel's programs start while the kernel before it
in the stream is still running, and wait on the device for its results.

A graphed decode step is a chain of ~330 small launches (9 per layer of an 8B model),
each waiting for the one before it. Between two dependent kernels the GPU otherwise
idles while the next grid is launched and its programs are placed on the SMs. With the
launch attribute set (Hopper and later), a kernel is launched once every program of
the one before it has started and called `griddepcontrol.launch_dependents` (or has
finished); its programs then sit on the SMs at `griddepcontrol.wait` until the previous
kernel has finished and its writes are visible. On an H200 this took the 8B shape's AR
step from 1.22x to 1.18x its memory floor (BENCHMARKS.md section 13).

Every kernel launched this way waits before it touches memory, so nothing is read or
written early: only the launch overlaps. Completion stays ordered (a kernel finishes
only after its wait returned, so after the previous one finished), and kernels
launched without the attribute (torch's, cuBLAS's, NCCL's) wait for everything before
them as usual.

Most kernels let the next one launch at once (`start_after_previous`). The two next to
the attention pass hold that back, so that no kernel's programs are placed beside a
running one-wave kernel:
- The attention merge only waits (`wait_for_previous`). It is itself launched while the
  prefix pass runs; if it let the o-projection launch too, that GEMV's programs would
  sit beside the running pass (the 8B AR step was 1.6% slower than with no dependent
  launch at all). A pass that writes the output itself (one part, no merge) only waits too.
- RoPE-into-cache lets the attention launch once its own wait returns
  (`wait_then_start_next`). Launched at once, the attention's programs were placed on
  the SMs the QKV product left free, two to an SM, and 16 requests' decode step was 8%
  slower (kernels/NOTES.md).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


def chained(device: torch.device) -> dict:
    """Launch keywords for a kernel that begins with `start_after_previous(PDL)` or
    `wait_for_previous(PDL)`: the dependent launch where the GPU has it (sm_90+), else
    the plain launch (CPUs, the Triton interpreter, older GPUs, where the wait would not
    compile). Known once per device: eager launches ask on every call."""
    return _chained(device.type, device.index)


@functools.cache
def _chained(kind: str, index: int | None) -> dict:
    if kind != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" or \
            torch.cuda.get_device_capability(index)[0] < 9:
        return {"PDL": False}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait until the previous kernel has finished (its writes visible). The next
    kernel launches when this one's programs have all finished."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def start_after_previous(PDL: tl.constexpr):
    """`wait_for_previous`, and let the next kernel launch at once, so that its
    programs are placed while this one runs (every kernel but the attention merge)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def wait_then_start_next(PDL: tl.constexpr):
    """`wait_for_previous`, then let the next kernel launch: its programs are placed
    while this one runs, but not beside the kernel before it (RoPE into the cache, whose
    next kernel is the attention pass)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
