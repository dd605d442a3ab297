"""The tensor-parallel group a model is sharded over.

`TPGroup()` is the single-process group (rank 0 of 1): every collective is a no-op.
Layers take the group explicitly, so a sharded model and a whole one run the same code.

`group` is a c10d process group (or backend) object: `ProcessGroupGloo` on CPU,
`ProcessGroupNCCL` on GPUs (see `treeflash.engine.tp`, which creates them without a
default process group). Collectives are called on it directly, so NCCL ones can be
captured in a CUDA graph. On GPUs of one host `peer` (a
`treeflash.kernels.all_reduce.PeerAllReduce`) takes the small all-reduces (up to 1 MiB
read per rank): decode steps and verify rounds, in one launch instead of NCCL's
ring.

Decisions over a vocabulary sharded in contiguous, equal slices (rank r holds ids
r*V/N ..) are made so that every rank gets bit-identical results: `argmax` and
`topk` all-gather each rank's candidates (values and global ids) and reduce them in
rank order. `argmax` so resolves ties toward the lowest global id exactly as
`torch.argmax` over the whole vocabulary does; `topk` orders tied values as no rule
says (as `torch.topk` does): the same on every rank, maybe not as one rank would.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from treeflash.ops import argmax, topk, topk_logsumexp


def _wait(work, x: torch.Tensor, driver: bool) -> None:
    """Wait for a collective. The driver (rank 0) on the CPU (gloo) polls, so that Ctrl-C
    still reaches it while a peer hangs (a blocking wait would hold the signal back until
    the collective timeout; workers ignore SIGINT). NCCL's wait only orders the stream."""
    if driver and not x.is_cuda:
        pause = 0.0
        while not work.is_completed():
            time.sleep(pause)
            pause = min(2 * pause + 1e-5, 0.01)
    work.wait()


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None
    peer: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place (x must be contiguous)."""
        if self.size > 1:
            if self.peer is not None and self.peer.fits(x):
                return self.peer(x)
            _wait(self.group.allreduce([x]), x, self.rank == 0)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        _wait(self.group._allgather_base(out, x), x, self.rank == 0)
        parts = out.view((self.size,) + tuple(x.shape))                  # [size, *x.shape]
        dim = dim % x.dim()
        return parts.movedim(0, dim).reshape(x.shape[:dim] + (-1,) + x.shape[dim + 1:])

    def shard(self, n: int, what: str) -> int:
        """Size of this rank's slice of `n` items; they must divide evenly."""
        if n % self.size:  # a usage error: another tensor-parallel size fits
            from treeflash.errors import UsageError
            raise UsageError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}")
        return n // self.size

    # ----------------------------------------------------------------- vocabulary-sharded decisions
    def pick_max(self, value: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Global ids of the best candidates: each rank offers (value, global id) [...];
        the largest value wins, ties (and NaNs, as torch.argmax) go to the lowest rank."""
        if self.size == 1:
            return index
        packed = torch.stack([value.double(), index.double()], dim=-1)[None]   # exact for ids < 2^53
        cand = self.all_gather(packed, dim=0)                                  # [size, ..., 2]
        best = cand[..., 0].argmax(0, keepdim=True)
        return cand[..., 1].gather(0, best)[0].long()

    def argmax(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Global argmax over the last dim of `x`, this rank's vocabulary slice starting at
        id `start`: the same ids as `torch.argmax` over the whole (gathered) vocabulary."""
        idx = argmax(x)
        if self.size == 1:
            return idx + start if start else idx
        return self.pick_max(x.gather(-1, idx[..., None])[..., 0], idx + start)

    def topk(self, x: torch.Tensor, k: int, start: int = 0, log_softmax: bool = False):
        """Top-k over the last dim of `x` (this rank's vocabulary slice from id `start`):
        (values, global ids) [..., k], values descending, identical on every rank. With
        `log_softmax`, values are log-probabilities over the whole vocabulary."""
        vals, ids, lse, _ = self._top(x, k, start, log_softmax)
        return (vals - lse if log_softmax else vals), ids

    def logprobs(self, x: torch.Tensor, tokens: torch.Tensor, k: int, start: int = 0):
        """Log-probabilities over the whole vocabulary of x [..., V/N] (this rank's slice
        from id `start`): of the global ids `tokens` [...], and the top k (values and
        global ids [..., k]), and each token's rank [...] in the vocabulary: how many ids
        have a logit at least as large, itself included (vLLM's: a tie ranks after every
        id it ties with), identical on every rank. The rank holding a token offers its
        logit, the others -inf, in the same all-gather as the top-k candidates; the ranks
        take one more all-reduce."""
        if self.size == 1:
            picked = x.gather(-1, tokens[..., None])
        else:
            local = tokens - start
            mine = (local >= 0) & (local < x.shape[-1])
            picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1)[..., None])
            picked = picked.masked_fill(~mine[..., None], float("-inf"))
        vals, ids, lse, picked = self._top(x, k, start, True, picked)
        at_least = (x >= picked).sum(-1)
        return (picked - lse)[..., 0], vals - lse, ids, self.all_reduce(at_least) if self.size > 1 else at_least

    def _top(self, x: torch.Tensor, k: int, start: int, log_softmax: bool, picked: torch.Tensor | None = None):
        """(top-k values, global ids, log-sum-exp [..., 1] (with log_softmax, else None),
        `picked` [..., 1]'s max) over every rank.

        Local top-k, one all-gather of every rank's candidates (and its slice's
        log-sum-exp and picked value), top-k; the ranks' log-sum-exps are combined in
        rank order, so every rank gets the same bits.
        """
        if log_softmax:
            vals, ids, lse = topk_logsumexp(x, min(k, x.shape[-1]))
        else:
            (vals, ids), lse = topk(x, min(k, x.shape[-1])), None
        ids = ids + start if start else ids
        if self.size > 1:
            extra = [t.double() for t in (lse, picked) if t is not None]
            cand = self.all_gather(torch.cat([vals.double(), ids.double()] + extra, dim=-1)[None], dim=0)
            kl = vals.shape[-1]                                                # cand: [size, ..., 2k(+2)]
            all_vals = cand[..., :kl].movedim(0, -2).flatten(-2).to(vals.dtype)
            all_ids = cand[..., kl:2 * kl].movedim(0, -2).flatten(-2).long()
            vals, j = all_vals.topk(min(k, all_vals.shape[-1]), dim=-1)
            ids = all_ids.gather(-1, j)
            col = 2 * kl
            if lse is not None:
                lse = torch.logsumexp(cand[..., col:col + 1].to(x.dtype), dim=0)  # [..., 1]
                col += 1
            if picked is not None:
                picked = cand[..., col:col + 1].amax(0).to(x.dtype)
        return vals, ids, lse, picked
