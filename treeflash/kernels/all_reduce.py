"""One-shot all-reduce through peer memory, for tensor parallelism on one host (CUDA).

Under TP every layer all-reduces its attention and MLP outputs: at batch 1 a [1, 4096]
bf16 vector, 8 KB. NCCL's ring takes ~12 us for that on two H200s over NVLink and ~16 us
on four, about what it takes for 16 rows: it is latency, two per layer, 25% of a TP = 2
and 37% of a TP = 4 decode step of an 8B model (BENCHMARKS.md section 6). Here each rank
copies its tensor into a buffer that every rank can read, the ranks meet at a barrier of
flags in that memory, and each one reads every rank's copy and sums them itself: one
launch, no ring.

- Memory. torch's symmetric memory allocates the buffers and exchanges their handles
  (`torch.distributed._symmetric_memory`); its own reduction kernels are not used.
  NVLink multicast is never needed.
- Same bits on every rank. Each rank sums the ranks' values in rank order in fp32 and
  rounds once, so the ranks' hidden states stay identical (NCCL's ring also gives every
  rank the same bits); the sum differs from NCCL's in the last bit, as NCCL's differs
  between ring sizes.
- Barriers. Program p of every rank covers the same slice of the tensor. It stores its
  slice, then signals program p of each peer and waits for theirs (flags in the
  symmetric signal pads: a set flag is 1, the waiter consumes it back to 0, and a
  signaller waits until its previous flag was consumed). After reading the peers' slices
  it meets them again, so that no rank overwrites its buffer (the next all-reduce)
  while a peer still reads it. All inside one kernel, so a CUDA graph replays it as is.
- Abort. A waiting program also polls a flag in pinned host memory every few hundred
  spins: when a peer died, `abort()` sets it and the waiting kernels end (their result
  is garbage; the engine is dead), as NCCL kernels end when their communicator is
  aborted. Without it a replayed graph would spin forever on a dead peer.
"""
from __future__ import annotations

import ctypes
import uuid

import torch
import torch.distributed as dist
import triton
import triton.language as tl

PULL_BYTES = 1 << 20                  # what a rank reads from all ranks at most: larger tensors take NCCL
MAX_PROGRAMS = 128                    # programs per launch (each has barrier slots in the signal pads)
BLOCK = 512                           # elements per program and step
ABORT_EVERY = tl.constexpr(256)       # spins between two polls of the host flag (a PCIe read)


@triton.jit
def _signal_all(pads_ptr, rank, slot, spare, abort_ptr, WS: tl.constexpr, WS_P2: tl.constexpr, PUT: tl.constexpr):
    """PUT: set flag [slot * WS + rank] in every rank's pad once it is 0 (release);
    else: consume flags [slot * WS + r] of this rank's pad, for every r, once they are 1
    (acquire). One lane per rank; a lane that is done keeps issuing a compare-and-swap
    that cannot change the flag (1 -> 1 for PUT, 0 -> 0 else), and padding lanes one on
    the spare slot (0 -> 0). Returns 1 if aborted."""
    lanes = tl.arange(0, WS_P2)
    real = lanes < WS
    if PUT:
        pad = tl.load(pads_ptr + lanes, mask=real, other=0)
        ptrs = (pad + (slot * WS + rank) * 4).to(tl.pointer_type(tl.int32))
    else:
        pad = tl.load(pads_ptr + rank)
        ptrs = (pad + (slot * WS + lanes) * 4).to(tl.pointer_type(tl.int32))
    ptrs = tl.where(real, ptrs, (tl.load(pads_ptr + rank) + spare * 4).to(tl.pointer_type(tl.int32)))
    done = lanes >= WS
    pending = tl.sum((~done).to(tl.int32), 0) > 0
    spins = 0
    aborted = 0
    while pending:
        if PUT:
            old = tl.atomic_cas(ptrs, tl.where(done, 1, 0), tl.full([WS_P2], 1, tl.int32), sem="release", scope="sys")
            done = done | (old == 0)
        else:
            old = tl.atomic_cas(ptrs, tl.where(done, 0, 1), tl.zeros([WS_P2], tl.int32), sem="acquire", scope="sys")
            done = done | (old == 1)
        pending = tl.sum((~done).to(tl.int32), 0) > 0
        spins += 1
        if spins % ABORT_EVERY == 0:
            # every thread reads the flag; the block-wide max makes one decision for all
            # warps (left to each warp, a flag set between two warps' reads would send them
            # out of the loop at different spins, past the barriers inside tl.sum)
            flag = tl.load(abort_ptr.to(tl.pointer_type(tl.int32)) + tl.zeros([256], tl.int32), volatile=True)
            if tl.max(flag, 0) != 0:
                aborted = 1
                pending = False
    return aborted


@triton.jit
def _one_shot_all_reduce(x_ptr, bufs_ptr, pads_ptr, abort_ptr, n, rank, spare,
                         WS: tl.constexpr, WS_P2: tl.constexpr, BLOCK: tl.constexpr):
    """x[slice] = sum over ranks r (in order) of rank r's x[slice], in place; see module doc."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    own = tl.load(bufs_ptr + rank).to(tl.pointer_type(x_ptr.dtype.element_ty))
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(own + offs, tl.load(x_ptr + offs, mask=ok), mask=ok)
    tl.debug_barrier()  # every thread's stores before the release below
    aborted = _signal_all(pads_ptr, rank, pid, spare, abort_ptr, WS, WS_P2, True)
    if aborted == 0:
        aborted = _signal_all(pads_ptr, rank, pid, spare, abort_ptr, WS, WS_P2, False)
    tl.debug_barrier()
    if aborted == 0:
        for start in range(pid * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < n
            acc = tl.zeros([BLOCK], tl.float32)
            for r in tl.static_range(WS):
                peer = tl.load(bufs_ptr + r).to(tl.pointer_type(x_ptr.dtype.element_ty))
                acc += tl.load(peer + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)  # not L1
            tl.store(x_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=ok)
        tl.debug_barrier()  # every thread done reading the peers' buffers
        aborted = _signal_all(pads_ptr, rank, pid, spare, abort_ptr, WS, WS_P2, True)
        if aborted == 0:
            _signal_all(pads_ptr, rank, pid, spare, abort_ptr, WS, WS_P2, False)


class PeerAllReduce:
    """The one-shot all-reduce of one TP group (see module doc): its symmetric buffer,
    the peers' addresses, and the abort flag. `fits(x)` says whether it takes `x`."""

    def __init__(self, buffer: torch.Tensor, handle, rank: int, size: int):
        self.buffer, self.handle = buffer, handle  # the handle keeps the peers' mappings alive
        self.rank, self.size = rank, size
        self.bufs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=buffer.device)
        self.pads = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=buffer.device)
        # program p uses flags p * size .. p * size + size - 1; one spare flag after them all
        self.max_programs = min(MAX_PROGRAMS, (handle.signal_pad_size // 4 - 1) // size)
        if self.max_programs < 1:
            raise RuntimeError(f"symmetric memory signal pads of {handle.signal_pad_size} bytes are too small")
        self.abort_flag = torch.zeros(1, dtype=torch.int32).pin_memory()
        self.spare = self.max_programs * size  # the flag padding lanes use (0 -> 0)

    def fits(self, x: torch.Tensor) -> bool:
        """Up to PULL_BYTES read per rank (H200s, NVLink, [rows, 4096] bf16, µs per
        all-reduce, NCCL -> this: TP 2 at 1 / 16 / 64 rows 12.1 -> 6.8, 13.0 -> 8.8,
        15.8 -> 12.8; TP 4 at 1 / 16 rows 16.1 -> 7.8, 16.9 -> 11.4, but 64 rows
        19.9 -> 21.1, where NCCL's ring moves less)."""
        nbytes = x.numel() * x.element_size()
        return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.is_contiguous()
                and 0 < nbytes * self.size <= PULL_BYTES and nbytes <= self.buffer.numel())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place. Many small programs: the peers' slices are
        latency-bound NVLink reads, so the more of them in flight the better (a sweep of
        1-128 programs x 512-8192 elements x 4 / 8 warps put 512 elements and 8 warps
        first at every size on 2 and 4 H200s)."""
        n = x.numel()
        programs = min(self.max_programs, triton.cdiv(n, BLOCK))
        _one_shot_all_reduce[(programs,)](x, self.bufs, self.pads, self.abort_flag.data_ptr(), n, self.rank,
                                          self.spare, WS=self.size, WS_P2=triton.next_power_of_2(self.size),
                                          BLOCK=BLOCK, num_warps=8)
        return x

    def abort(self) -> None:
        """End every all-reduce that waits on a peer, now and later (a peer died)."""
        self.abort_flag[0] = 1


def allocate(device: torch.device) -> torch.Tensor:
    """This rank's symmetric buffer (no collective step: the ranks agree that all of them
    have one before `connect`, so that a rank that could not never leaves the others
    waiting in the rendezvous). Raises if symmetric memory is not available here."""
    import torch.distributed._symmetric_memory as symm

    c10d = torch._C._distributed_c10d
    needed = [(dist.ProcessGroup, "_register_backend"), (dist.ProcessGroup, "_set_group_name"),
              (c10d, "_register_process_group"), (c10d, "_unregister_process_group"), (symm, "rendezvous")]
    missing = [name for owner, name in needed if not hasattr(owner, name)]
    if missing:
        raise RuntimeError(f"this torch has no {', '.join(missing)}")
    return symm.empty(PULL_BYTES // 2, dtype=torch.uint8, device=device)  # the most that fits at size 2


def connect(buffer: torch.Tensor, store, rank: int, size: int, nccl) -> PeerAllReduce:
    """The peer all-reduce of the group whose NCCL backend is `nccl`, over every rank's
    `allocate`d buffer (collective: every rank calls it).

    torch's symmetric memory finds the group's ranks through a process group registered
    by name; treeflash's groups are bare NCCL backends (no default group, see
    `treeflash.engine.tp`), so one is wrapped and registered under a name that rank 0
    makes unique and the others read from the store, for the rendezvous only.

    The wrapper, which holds the NCCL backend, and the symmetric memory are never
    destroyed, as `Runtime.park` never destroys the backend (its teardown can block once
    CUDA graphs captured its collectives). A process holds them until it exits: 512 KiB
    of buffer per TP runtime."""
    import torch.distributed._symmetric_memory as symm

    c10d = torch._C._distributed_c10d
    if rank == 0:
        store.set("peer/name", f"treeflash-tp-{uuid.uuid4().hex}")
    name = store.get("peer/name").decode()
    pg = dist.ProcessGroup(dist.PrefixStore("peer", store), rank, size)
    pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, nccl)
    pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
    pg._set_group_name(name)
    c10d._register_process_group(name, pg)
    try:
        handle = symm.rendezvous(buffer, name)
    finally:
        c10d._unregister_process_group(name)
    for obj in (pg, handle, buffer):
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return PeerAllReduce(buffer, handle, rank, size)
