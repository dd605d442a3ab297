"""Reading a round's results back while the next round runs."""
from __future__ import annotations

import torch


class RoundPipeline:
    """Round results on their way to the host, one round behind the device.

    `push(*outputs)` right after launching round r queues a non-blocking copy of its
    output tensors (new tokens, counts, and logprobs if asked) into one of two sets of
    host buffers (pinned on CUDA) and records an event, then waits for round r-1's
    event only and returns its outputs as lists (None after the first push): the host
    reads round r-1 while round r runs. Two sets: the copy of round r never lands in
    the one the host is reading, and round r+1's copy into that one is queued only
    after the host has read it. On CPU the copy is a plain copy and there are no
    events. `finish()` waits for and returns the last round pushed.
    """

    def __init__(self):
        self.slots = None    # 2 x (host buffers, event), made at the first push (shapes known)
        self.pending = None  # the slot of the last round pushed, not read yet

    def push(self, *outputs: torch.Tensor):
        if self.slots is None:
            cuda = outputs[0].is_cuda
            self.slots = [([torch.empty(t.shape, dtype=t.dtype, pin_memory=cuda) for t in outputs],
                           torch.cuda.Event() if cuda else None) for _ in range(2)]
        slot = 0 if self.pending is None else 1 - self.pending
        host, event = self.slots[slot]
        for h, t in zip(host, outputs):
            h.copy_(t, non_blocking=True)
        if event is not None:
            event.record(torch.cuda.current_stream(outputs[0].device))
        previous, self.pending = self.pending, slot
        return None if previous is None else self._read(previous)

    def finish(self):
        previous, self.pending = self.pending, None
        return None if previous is None else self._read(previous)

    def _read(self, slot: int):
        host, event = self.slots[slot]
        if event is not None:
            event.synchronize()
        return tuple(h.tolist() for h in host)
