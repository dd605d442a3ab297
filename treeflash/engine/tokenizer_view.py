"""`LLM.get_tokenizer()`: the model's tokenizer under transformers' names.

vLLM's get_tokenizer() returns a transformers tokenizer, and scripts written for it call
`apply_chat_template(..., tokenize=False, add_generation_prompt=True)`, `encode`,
`decode(ids, skip_special_tokens=True)` and read `eos_token_id`. This view gives those
calls transformers' arguments and defaults (decode keeps special tokens unless told; a
chat template is rendered without the generation prompt unless asked) over treeflash's
own `Tokenizer` and chat template, so the ids and text are the engine's.
"""
from __future__ import annotations

import numbers

from treeflash.chat import ChatFormat, checked_tools
from treeflash.errors import UsageError, is_text, shown


# transformers' apply_chat_template keywords for forms this view does not return, at their defaults
UNSUPPORTED = {"return_tensors": None, "return_dict": False, "padding": False, "truncation": False,
               "max_length": None, "return_assistant_tokens_mask": False, "tokenizer_kwargs": None}


def _one_or_many(values, is_one, fits) -> tuple[list, bool] | None:
    """(values as a list, whether one was given), as transformers takes them: one item or
    any iterable of items; None if that is not what they are or an item does not `fits`."""
    one = is_one(values)
    try:
        items = [values] if one else list(values)
    except TypeError:
        return None
    return (items, one) if all(map(fits, items)) else None


def _token_ids(token_ids, what: str) -> tuple[list[int], bool]:
    """Ids as transformers takes them (one, a list, a tensor or an array of them), checked,
    and whether one was given."""
    got = _one_or_many(token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids,
                       lambda v: isinstance(v, numbers.Integral),
                       lambda i: isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < 2 ** 32)
    if got is None:
        raise UsageError(f"{what} takes token ids (integers from 0 to 2^32 - 1), got {shown(token_ids)}")
    return [int(i) for i in got[0]], got[1]


class TokenizerView:
    def __init__(self, llm):
        self._llm, self._tok = llm, llm.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not (isinstance(text, str) and is_text(text)):
            raise UsageError(f"encode takes a text, got {shown(text)}")
        return self._tok.encode(text, special=add_special_tokens)

    def __call__(self, text, add_special_tokens: bool = True) -> dict:
        """{"input_ids", "attention_mask"} of a text, or of each of a list of texts."""
        one = isinstance(text, str)
        ids = [self.encode(t, add_special_tokens) for t in ([text] if one else text)]
        out = {"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]}
        return {k: v[0] for k, v in out.items()} if one else out

    def decode(self, token_ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode(_token_ids(token_ids, "decode")[0], skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(s, skip_special_tokens) for s in sequences]

    def convert_ids_to_tokens(self, ids):
        """A token's spelling (None past the vocabulary, as transformers), or a list of them."""
        ids, one = _token_ids(ids, "convert_ids_to_tokens")
        spellings = self._tok.vocab_spellings(ids)
        return spellings[0] if one else spellings

    def convert_tokens_to_ids(self, tokens):
        """A spelling's id (None if the vocabulary has no such token), or a list of them."""
        got = _one_or_many(tokens, lambda v: isinstance(v, str), lambda t: isinstance(t, str))
        if got is None:
            raise UsageError(f"convert_tokens_to_ids takes a token's spelling or a list of them, got {shown(tokens)}")
        ids = [self._tok.tok.token_to_id(t) for t in got[0]]
        return ids[0] if got[1] else ids

    def get_vocab(self) -> dict[str, int]:
        return self._tok.tok.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tok.tok.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """transformers': the vocabulary without added tokens."""
        return self._tok.tok.get_vocab_size(with_added_tokens=False)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def eos_token(self) -> str | None:
        return self._spelling(self.eos_token_id)

    @property
    def bos_token_id(self) -> int | None:
        """tokenizer_config.json's bos_token (the engine's BOS may come from config.json)."""
        return self._tok.named_bos_id

    @property
    def bos_token(self) -> str | None:
        return self._spelling(self.bos_token_id)

    def _spelling(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.tok.id_to_token(token_id)

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self._tok.special_ids)

    def apply_chat_template(self, conversation: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool = False,
                            tokenize: bool = True, chat_template: str | None = None, **template_variables):
        """The conversation as the model's chat template (or `chat_template`, Jinja
        source) renders it: its text, or with `tokenize` its token ids (no special tokens
        added: the template writes them), as transformers' returns them. transformers'
        own keywords for other forms (tensors, padding, ...) are refused, not passed to
        the template as variables."""
        if asked := sorted(k for k, default in UNSUPPORTED.items() if template_variables.pop(k, default) != default):
            raise UsageError(f"apply_chat_template returns the text or a list of token ids: "
                             f"{', '.join(asked)} not supported")
        fmt = ChatFormat(template_variables or None, add_generation_prompt, continue_final_message).checked()
        llm = self._llm
        text = llm._chat_text(conversation, fmt, checked_tools(tools), llm._given_template(chat_template))
        return self._tok.encode(text, special=False) if tokenize else text
