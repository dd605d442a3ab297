"""Byte-level BPE tokenizer for Python code, trained with Hugging Face `tokenizers`.

Pre-tokenization splits letters, single digits, punctuation runs, newline runs and
space runs apart (so indentation becomes its own tokens), then maps bytes to the
byte-level alphabet, as Qwen/Llama-3 tokenizers do. Every byte is in the vocabulary,
so any text round-trips. Special tokens: EOS `<|endoftext|>` (between files),
`<|pad|>`, and `<|mask|>`, the DFlash drafter's MASK token.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Iterable

from treeflash.errors import UsageError

EOS, PAD, MASK = "<|endoftext|>", "<|pad|>", "<|mask|>"
SPECIAL_TOKENS = [EOS, PAD, MASK]
SPLIT_PATTERN = (r"[^\r\n\p{L}\p{N}]?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                 r"|\s+(?!\S)|\s+")


MAX_VOCAB = 1 << 20  # 4x the largest vocabularies in use; the BPE trainer allocates per entry


def check_vocab_size(vocab_size) -> None:
    """Before the corpus is read: at least the bytes and special tokens, at most MAX_VOCAB
    (a size off by a few zeros made the trainer abort on a failed allocation)."""
    floor = 256 + len(SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not floor <= vocab_size <= MAX_VOCAB:
        raise UsageError(f"vocab size must be an integer from {floor} (bytes + special tokens) to {MAX_VOCAB:,}, "
                         f"got {vocab_size!r}")


def _interruptible(fn) -> None:
    """fn() on a thread of its own, waited for here: the BPE trainer runs in Rust, which
    lets go of the GIL but takes no Ctrl-C (it held one off for 27 s on 200 MB); the main
    thread takes it and leaves. The training itself goes on until the process ends (a
    daemon thread: the CLI's process ends at once)."""
    failed = []

    def run():
        try:
            fn()
        except BaseException as e:  # raised again on the waiting thread
            failed.append(e)
    worker = threading.Thread(target=run, name="treeflash-bpe", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(0.1)
    if failed:
        raise failed[0]


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 4096,
                    model_max_length: int = 1024) -> Path:
    """Train on `texts`, write `tokenizer.json` and `tokenizer_config.json` into `out_dir`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    _interruptible(lambda: tok.train_from_iterator(texts, trainer))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS, "pad_token": PAD, "mask_token": MASK,
        "bos_token": None, "unk_token": None, "add_bos_token": False,
        "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
    }, indent=2))
    return out
