"""treeflash: lossless speculative decoding with DFlash drafters and DDTree verification."""
from treeflash.engine.llm import LLM, GenerationOutput, TokenLogprob
from treeflash.engine.sampling import SamplingParams
from treeflash.errors import TreeflashError, UsageError

__all__ = ["LLM", "GenerationOutput", "TokenLogprob", "SamplingParams", "TreeflashError", "UsageError"]
__version__ = "0.1.0"
