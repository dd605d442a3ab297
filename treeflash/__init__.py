"""treeflash: lossless speculative decoding with DFlash drafters and DDTree verification."""
from treeflash.engine.llm import LLM, GenerationOutput
from treeflash.engine.sampling import SamplingParams
from treeflash.errors import TreeflashError, UsageError

__all__ = ["LLM", "GenerationOutput", "SamplingParams", "TreeflashError", "UsageError"]
__version__ = "0.1.0"
