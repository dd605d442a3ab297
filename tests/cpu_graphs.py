"""CUDA graphs' path on the CPU: tests drive an engine through kept graphed states and
per-mode captures (warm-up rounds on the live state, as on a GPU) without a GPU."""
import torch

import treeflash.engine.graphs as graphs_module
from treeflash import LLM


class _Replayed:
    """A stand-in for a CUDA graph on the CPU: a replay reruns the captured function and
    copies its results into the outputs the capture returned."""

    def __init__(self, fn, out):
        self.fn, self.out = fn, out

    def replay(self):
        with torch.inference_mode():
            for dst, src in zip(_flat(self.out), _flat(self.fn())):
                dst.copy_(src)


def _flat(x):
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for part in (x or ()) for t in _flat(part)]


def cpu_graphs(monkeypatch, llm: LLM) -> LLM:
    """Drive `llm` (CPU) down the CUDA-graph path: kept graphed states, rounds captured per
    sampling mode, whose warm-ups run on the live state as on a GPU."""
    def capture(fn, warmup, pool=None):
        for _ in range(warmup):
            fn()
        out = fn()
        return _Replayed(fn, out), out
    monkeypatch.setattr(graphs_module, "capture", capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    llm.states.graphs = True
    llm.states.memory_budget = float("inf")
    return llm
