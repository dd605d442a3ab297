"""Training for treeflash's own models: a BPE tokenizer and a tokenized corpus of local Python
source, a Qwen3-architecture target LM, and a DFlash drafter for any target (TRAINING.md)."""
from treeflash.train.common import TrainOptions
from treeflash.train.corpus import collect, load_corpus, write_corpus
from treeflash.train.drafter import DrafterShape, generate_continuations, measure_tau, train_drafter
from treeflash.train.target import TargetShape, train_target
from treeflash.train.tokenizer import train_tokenizer

__all__ = ["TrainOptions", "collect", "load_corpus", "write_corpus", "DrafterShape", "generate_continuations",
           "measure_tau", "train_drafter", "TargetShape", "train_target", "train_tokenizer"]
