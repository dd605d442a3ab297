"""treeflash: lossless speculative decoding with DFlash drafters and DDTree verification."""
from treeflash.errors import ContextLengthError, EngineDeadError, TreeflashError, UsageError

__all__ = ["LLM", "GenerationOutput", "TokenLogprob", "SamplingParams", "StructuredOutputs", "TreeflashError", "UsageError",
           "ContextLengthError", "EngineDeadError"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """The engine, and torch with it, loads on first use (PEP 562): the command line
    imports it inside its error handling, so Ctrl-C during the seconds of `import torch`
    is "interrupted", not a traceback."""
    if name == "LLM":
        from treeflash.engine.llm import LLM
        return LLM
    if name in ("GenerationOutput", "TokenLogprob"):
        from treeflash.engine import requests
        return getattr(requests, name)
    if name == "SamplingParams":
        from treeflash.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputs":
        from treeflash.structured.grammar import StructuredOutputs
        return StructuredOutputs
    raise AttributeError(f"module 'treeflash' has no attribute {name!r}")
