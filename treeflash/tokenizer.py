"""Tokenizer files of a Hugging Face checkpoint: `tokenizer.json` plus the EOS ids from
`generation_config.json`, `config.json` and `tokenizer_config.json`."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from treeflash.errors import TreeflashError


def _json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TreeflashError(f"malformed {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _ids(value, key: str, path: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TreeflashError(f"{path}: '{key}' must be a token id or a list of token ids, got {value!r}")
    return list(values)


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise TreeflashError(f"tokenizer.json not found in {folder}")
        try:
            self.tok = _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise TreeflashError(f"cannot read {path}: {e}") from None
        config = _json(folder / "config.json")
        gen = _json(folder / "generation_config.json")
        tok_cfg = _json(folder / "tokenizer_config.json")
        eos = set(_ids(gen.get("eos_token_id"), "eos_token_id", folder / "generation_config.json")) \
            | set(_ids(config.get("eos_token_id"), "eos_token_id", folder / "config.json"))
        eos_tok = tok_cfg.get("eos_token")
        if isinstance(eos_tok, dict):
            eos_tok = eos_tok.get("content")
        if isinstance(eos_tok, str) and self.tok.token_to_id(eos_tok) is not None:
            eos.add(self.tok.token_to_id(eos_tok))
        self.eos_token_ids = sorted(eos)
        self.bos_token_id = gen.get("bos_token_id", config.get("bos_token_id"))
        self.add_bos = bool(tok_cfg.get("add_bos_token", False)) and isinstance(self.bos_token_id, int)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """With special tokens, as transformers encodes by default: the tokenizer.json
        post-processor adds what the model expects (Llama 3's <|begin_of_text|>).
        `special=False` for text that already holds them (a rendered chat template)."""
        ids = self.tok.encode(text, add_special_tokens=special).ids
        if special and self.add_bos and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
