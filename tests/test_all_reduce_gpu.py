"""The one-shot peer-memory all-reduce of tensor parallelism (`treeflash.kernels.all_reduce`),
on every visible GPU (at least 2) under torchrun, each rank in its own process:

- a TP group on one host takes it (`TPGroup.peer`), and it sums the ranks' tensors in
  rank order in fp32, rounded once: equal to that sum bit for bit, on every rank, for
  bf16, fp16 and fp32 and sizes from one element to its limit (1 MiB read per rank);
- replayed in a CUDA graph, over new inputs each replay, it stays exact (its barrier
  flags are consumed and re-armed every call);
- a larger tensor goes to NCCL;
- a rank waiting on a peer that never comes is released by `abort()` (a dead peer);
- a rank that cannot set it up sends every rank to NCCL at once, with one line naming it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RANK_SCRIPT = textwrap.dedent('''
    import os, sys, threading, time
    import torch
    from treeflash.engine.tp import join_group
    from treeflash.kernels.all_reduce import PULL_BYTES

    size = int(os.environ["WORLD_SIZE"])
    rt = join_group(size, torch.device("cuda"))
    log = open(os.path.join(sys.argv[1], f"rank{rt.rank}.log"), "w", buffering=1)  # one file per rank: no interleaving
    g, dev = rt.group, rt.device
    assert g.peer is not None, "no peer all-reduce on one host"

    def everyone(x):
        """[size, *x.shape]: every rank's x, by NCCL."""
        out = torch.empty((size,) + tuple(x.shape), dtype=x.dtype, device=dev)
        g.group._allgather_base(out, x.contiguous()).wait()
        return out

    def expected(x):
        parts = everyone(x).float()
        acc = parts[0].clone()
        for r in range(1, size):
            acc += parts[r]
        return acc.to(x.dtype)

    def check(y, want, what):
        assert torch.equal(y, want), f"{what}: max diff {(y.float() - want.float()).abs().max().item()}"
        mine = everyone(y)
        assert all(torch.equal(mine[0], mine[r]) for r in range(size)), f"{what}: ranks differ"

    gen = torch.Generator(device=dev).manual_seed(100 + rt.rank)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        limit = PULL_BYTES // size // (torch.finfo(dtype).bits // 8)
        for n in (1, 7, 4096, 3 * 4096 + 5, limit // 2 + 3, limit):
            x = torch.randn(n, generator=gen, device=dev, dtype=torch.float32).to(dtype)
            want = expected(x)
            assert g.peer.fits(x)
            check(g.all_reduce(x.clone()), want, f"{dtype} n={n}")
    print("eager exact", file=log)

    # a CUDA graph of three all-reduces of different sizes, replayed over new inputs
    xs = [torch.zeros(n, device=dev, dtype=torch.bfloat16) for n in (4096, 16 * 4096, 5)]
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x in xs:
            g.all_reduce(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x in xs:
            g.all_reduce(x)
    for replay in range(20):
        inputs = [torch.randn(x.shape, generator=gen, device=dev).to(x.dtype) for x in xs]
        wants = [expected(i) for i in inputs]
        for x, i in zip(xs, inputs):
            x.copy_(i)
        graph.replay()
        for x, w in zip(xs, wants):
            check(x, w, f"graph replay {replay}")
    print("graph exact", file=log)

    big = torch.randn(PULL_BYTES // size // 2 + 8, generator=gen, device=dev).to(torch.bfloat16)
    assert not g.peer.fits(big)
    want = everyone(big).float().sum(0)
    got = g.all_reduce(big.clone()).float()
    assert torch.allclose(got, want, atol=0.05 * size, rtol=0.02), "NCCL path"
    print("large via NCCL", file=log)

    # rank 0 all-reduces alone: its peer never comes; abort() must release it
    torch.cuda.synchronize()
    g.group.allreduce([torch.ones(1, device=dev)]).wait(); torch.cuda.synchronize()
    if rt.rank == 0:
        x = torch.ones(4096, device=dev, dtype=torch.bfloat16)
        t0 = time.monotonic()
        threading.Timer(1.0, g.peer.abort).start()
        g.all_reduce(x)
        torch.cuda.synchronize()
        waited = time.monotonic() - t0
        assert 0.9 < waited < 30, waited
        print("released by abort after", round(waited, 2), "s", file=log)
    print("done", file=log)
    os._exit(0)   # the abandoned barrier leaves this group unusable: no clean leave
''')


FALLBACK_SCRIPT = textwrap.dedent('''
    import os, sys, time
    import torch
    import treeflash.kernels.all_reduce as all_reduce
    from treeflash.engine.tp import join_group

    def broken(device):
        raise RuntimeError("no symmetric memory here (test)")

    if os.environ["RANK"] == "1":
        all_reduce.allocate = broken
    size = int(os.environ["WORLD_SIZE"])
    rt = join_group(size, torch.device("cuda"))
    assert rt.group.peer is None, "rank 1 has no buffer: every rank must take NCCL"
    x = torch.full((4096,), float(rt.rank + 1), device=rt.device, dtype=torch.bfloat16)
    rt.group.all_reduce(x)
    assert torch.all(x == size * (size + 1) // 2)
    print("summed through NCCL", flush=True)
    os._exit(0)
''')


def torchrun(tmp_path, script: str, timeout: int):
    path = tmp_path / "rank.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": REPO, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(torch.cuda.device_count()), str(path), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[out.find("Traceback"):][:3000]
    return proc


def test_peer_all_reduce_is_exact_graphed_and_abortable(tmp_path):
    torchrun(tmp_path, RANK_SCRIPT, timeout=300)
    size = torch.cuda.device_count()
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in range(size)]
    for log in logs:
        lines = log.splitlines()
        assert lines[:3] == ["eager exact", "graph exact", "large via NCCL"] and lines[-1] == "done", log
    assert logs[0].splitlines()[3].startswith("released by abort"), logs[0]


def test_one_rank_without_symmetric_memory_sends_all_to_nccl(tmp_path):
    """The ranks agree before the rendezvous: the others do not wait in it for the rank
    that has no buffer (the store's timeout is 600 s; this must take seconds)."""
    proc = torchrun(tmp_path, FALLBACK_SCRIPT, timeout=240)
    assert proc.stdout.count("summed through NCCL") == torch.cuda.device_count()
    notes = [line for line in proc.stderr.splitlines() if "all-reduces through NCCL only" in line]
    assert notes == ["treeflash: tensor parallelism all-reduces through NCCL only "
                     "(rank 1: RuntimeError: no symmetric memory here (test))"], proc.stderr
