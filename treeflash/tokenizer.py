"""Tokenizer files of a Hugging Face checkpoint: `tokenizer.json` plus the EOS ids from
`generation_config.json`, `config.json` and `tokenizer_config.json`."""
from __future__ import annotations

import codecs
import json
import re
from functools import cached_property, lru_cache
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from treeflash.config import token_id_list
from treeflash.errors import TreeflashError
from treeflash.files import SPECIAL_TOKENS, check_regular_file, read_json_object, tokenizer_settings


@lru_cache(maxsize=1)
def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, as Qwen and Llama 3 use): each byte is written
    as one printable character, itself for printable Latin-1 bytes and 256 + k for the
    k-th of the others. Maps the character back to its byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


def _byte_level_decoder(decoder) -> bool:
    """Whether a tokenizer.json decoder maps byte-level BPE's characters back to bytes:
    ByteLevel, alone or in a Sequence (as some tokenizers write it)."""
    def holds(d: dict) -> bool:
        return d.get("type") == "ByteLevel" or any(holds(e) for e in d.get("decoders") or [] if isinstance(e, dict))
    return decoder is not None and holds(json.loads(decoder.__getstate__()))


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece-style byte tokens (Llama 2, Mistral)
# A context's last tokens decoded ahead of generated ones (Tokenizer.continuation_context): 4, and up to
# 3 more where the 4 begin inside a character; callers pass at least CONTEXT_TOKENS of them.
CONTEXT_TOKENS = 7


def stop_cut(text: str, stops: list[str], include: bool, start: int = 0,
             ends_after: int = 0) -> tuple[int, str] | None:
    """Where `text` ends for its stop strings (searched from `start`, and ending past
    `ends_after`: min_tokens' text does not count): the first listed of those that
    appear, cut at its start, or at its end with `include`. Returns (end, that stop
    string), or None if none appears. The engine ends a request at the first token whose
    text holds a stop string, so those that appear were all completed by that token, and
    vLLM, which checks them in order after each token, takes the first listed ("is"
    before "n is" in " # n is", though "n is" begins first)."""
    for stop in stops:
        if (at := text.find(stop, max(start, ends_after - len(stop) + 1))) >= 0:
            return at + (len(stop) if include else 0), stop
    return None


class Tokenizer:
    def __init__(self, folder: str | Path):
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if folder.is_file():
            raise TreeflashError(f"{folder} is a file: give the folder that holds tokenizer.json")
        if not path.exists():
            raise TreeflashError(f"tokenizer.json not found in {folder}")
        check_regular_file(path)
        try:
            self.tok = _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise TreeflashError(f"cannot read {path}: {e}") from None
        # as transformers: the truncation and padding saved in the file apply only when asked
        # for (a prompt is never cut or padded by them); special tokens split if configured
        self.tok.no_truncation()
        self.tok.no_padding()
        self.byte_level = _byte_level_decoder(self.tok.decoder)  # see token_bytes
        config = read_json_object(folder / "config.json")
        gen = read_json_object(folder / "generation_config.json")
        tok_cfg = tokenizer_settings(folder)
        split = tok_cfg.get("split_special_tokens", False)
        if not isinstance(split, bool):
            raise TreeflashError(f"{folder / 'tokenizer_config.json'}: 'split_special_tokens' must be true or "
                                 f"false, got {split!r}")
        self.tok.encode_special_tokens = split
        self._declared_tokens(tok_cfg, folder / "tokenizer_config.json")
        # each end token id, and the file that names it (for errors)
        self.eos_sources = {i: "config.json" for i in token_id_list(config.get("eos_token_id"), "eos_token_id",
                                                                    str(folder / "config.json"))}
        self.eos_sources |= {i: "generation_config.json" for i in token_id_list(
            gen.get("eos_token_id"), "eos_token_id", str(folder / "generation_config.json"))}
        # the tokenizer's own EOS (vLLM's model EOS: ending on it has no stop_reason; the
        # others listed end a request as its stop token ids do), or None
        self.eos_token_id = self._named_token(tok_cfg, "eos_token")
        if self.eos_token_id is not None:
            self.eos_sources[self.eos_token_id] = "tokenizer_config.json"  # or special_tokens_map.json
        self.eos_token_ids = sorted(self.eos_sources)
        # the BOS that add_bos_token prepends: the tokenizer's bos_token, as transformers'
        # tokenizers take it, else the bos_token_id of generation_config.json or config.json
        self.named_bos_id = self.bos_token_id = self._named_token(tok_cfg, "bos_token")  # (the first: transformers')
        bos_source = "tokenizer_config.json"
        if self.bos_token_id is None:
            self.bos_token_id = gen.get("bos_token_id", config.get("bos_token_id"))
            bos_source = "generation_config.json" if "bos_token_id" in gen else "config.json"
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):  # bool("false") would be true
            raise TreeflashError(f"{folder / 'tokenizer_config.json'}: 'add_bos_token' must be true or false, "
                                 f"got {add_bos!r}")
        self.add_bos = bool(add_bos) and self.bos_token_id is not None
        if self.add_bos:
            self._check_bos(folder, bos_source)
        self._tokens: dict[int, tuple[str, bytes]] = {}  # see _token

    def _named_token(self, cfg: dict, key: str) -> int | None:
        """The id of the token tokenizer_config.json names as `key` ("eos_token", "bos_token":
        its text, or an AddedToken object holding it), or None."""
        name = cfg.get(key)
        if isinstance(name, dict):
            name = name.get("content")
        return self.tok.token_to_id(name) if isinstance(name, str) else None

    def _declared_tokens(self, cfg: dict, where: Path) -> None:
        """tokenizer_config.json's tokens, as transformers loads them. added_tokens_decoder's
        entries, in id order: one that tokenizer.json lacks is added at the id it declares
        (else refused: the model's rows would mean other tokens); one it has as a plain
        added token but declares special is special here too (decoding with
        skip_special_tokens leaves it out; not the other way: the tokenizers library goes
        on skipping a token once it was special); one its vocabulary has at that id but
        not as an added token becomes one (a chat template's "<|im_start|>" is then that
        token, not its characters' pieces). Then the special tokens it names (eos_token,
        additional_special_tokens, ...): added to the vocabulary's end where it lacks them,
        made added special tokens where it has them as plain vocabulary."""
        decoder = cfg.get("added_tokens_decoder")
        entries = sorted((int(k), e) for k, e in decoder.items() if str(k).isdigit() and isinstance(e, dict)
                         and isinstance(e.get("content"), str)) if isinstance(decoder, dict) else []
        added = self.tok.get_added_tokens_decoder()
        for token_id, e in entries:
            special, t = e.get("special") is True, added.get(token_id)
            at = self.tok.token_to_id(e["content"])
            if t is not None and t.content == e["content"]:
                if special:
                    self._make_special(t)
            elif at is None or (t is None and at == token_id):  # absent, or a plain vocabulary token
                self.tok.add_tokens([AddedToken(e["content"], single_word=e.get("single_word", False) is True,
                                                lstrip=e.get("lstrip", False) is True,
                                                rstrip=e.get("rstrip", False) is True,
                                                normalized=e.get("normalized", not special) is True,
                                                special=special)])
                if self.tok.token_to_id(e["content"]) != token_id:
                    raise TreeflashError(f"{where}: added token {e['content']!r} is declared as id {token_id}, "
                                         f"but tokenizer.json's vocabulary gives it id "
                                         f"{self.tok.token_to_id(e['content'])}")
        extra = cfg.get("additional_special_tokens")
        named = [cfg.get(k) for k in SPECIAL_TOKENS] + (extra if isinstance(extra, list) else [])
        for t in named:
            content = t.get("content") if isinstance(t, dict) else t
            if not (isinstance(content, str) and content):
                continue
            added = {a.content: a for a in self.tok.get_added_tokens_decoder().values()}
            if content in added:
                self._make_special(added[content])
            else:
                self.tok.add_special_tokens([AddedToken(content, normalized=False, special=True)])

    def _make_special(self, t: AddedToken) -> None:
        if not t.special:
            self.tok.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip,
                                                    rstrip=t.rstrip, normalized=t.normalized, special=True)])

    def _check_bos(self, folder: Path, source: str) -> None:
        """The BOS id prepended to every prompt must be a token of this vocabulary (a
        negative or too large one would fail at the first request, not at load)."""
        bos = self.bos_token_id
        if isinstance(bos, bool) or not isinstance(bos, int) or not 0 <= bos < self.vocab_size:
            raise TreeflashError(f"{folder / source}: 'bos_token_id' must be a token id from 0 to "
                                 f"{self.vocab_size - 1} (tokenizer_config.json sets add_bos_token), got {bos!r}")

    def same_vocabulary(self, other: "Tokenizer") -> bool:
        """Token ids mean the same text under both (a corpus' tokenizer and a model's)."""
        return self.tok.get_vocab() == other.tok.get_vocab()

    @property
    def vocab_size(self) -> int:
        """The ids' range, largest + 1: a vocabulary may leave ids unused (a WordLevel
        tokenizer's, an added token far past the rest), so its count may be smaller."""
        return max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @cached_property
    def longest_token_bytes(self) -> int:
        """At most how many bytes of text one token stands for: the longest vocabulary
        string in UTF-8 (byte-level BPE, SentencePiece and WordPiece spell a token's text
        with at least as many bytes: Ġ, ▁, ##). A text of more than k times this many
        characters has more than k tokens, whatever it says."""
        return max((len(t.encode("utf-8")) for t in self.tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """With special tokens, as transformers encodes by default: the tokenizer.json
        post-processor adds what the model expects (Llama 3's <|begin_of_text|>).
        `special=False` for text that already holds them (a rendered chat template).
        Through `encode_batch`, which lets go of the GIL while it works: a server request
        with megabytes of prompt then tokenizes on its worker thread while the event
        loop and the engine go on (`encode` held it: 9 s of stalled streams)."""
        ids = self.tok.encode_batch([text], add_special_tokens=special)[0].ids
        if special and self.add_bos and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def decode_continuation(self, ids: list[int], context: list[int] = (), skip_special: bool = True) -> str:
        """The text `ids` add after `context` (the prompt's last tokens), less the part of
        a character at its end, which no later token finishes once a request has ended
        (vLLM leaves it out too; a stream never shows it). Decoded alone, a
        SentencePiece continuation would lose its first space (the decoder strips a
        text's first one: " Paris" became "Paris"); byte-level BPE gives the same either
        way. `TextStream` decodes the same way, so streamed deltas add up to this."""
        start = self.continuation_context(context, ids, skip_special)
        if start is None:  # ids only go on with a character the context began
            return ""
        context, read = start
        head = self._text_of(context[:read], skip_special)[0]
        whole = self.decode(context + list(ids), skip_special)
        text = whole[len(head):] if whole.startswith(head) else self.decode(ids, skip_special)
        if "\ufffd" not in text:
            return text
        # Part of a character somewhere: a byte-fallback decoder (Llama 2, Mistral) turns a
        # whole run of byte tokens into U+FFFD when the run ends in part of a character, so
        # "你" and half of "好" decode to five of them, though "你" was whole (and streamed).
        # Character by character instead, as TextStream takes them.
        return self.whole_text(context + list(ids), 0, read, skip_special)[0]

    def whole_text(self, ids: list[int], prefix: int, read: int, skip_special: bool = True) -> tuple[str, int, int]:
        """The text ids[read:] add after ids[prefix:read], taken token by token up to its last
        whole character, and the (prefix, read) after it (see `whole_piece`)."""
        text = ""
        for n in range(read + 1, len(ids) + 1):
            piece = self.whole_piece(ids, prefix, read, n, skip_special)
            if piece is None:  # part of a character at the end: the text before that character is whole
                n = prefix + self.unfinished_from(ids[prefix:n], skip_special)
                piece = self.whole_piece(ids, prefix, read, n, skip_special, final=True) if n > read else ""
            if piece:
                text, prefix, read = text + piece, read, n
        return text, prefix, read

    def whole_piece(self, ids: list[int], prefix: int, read: int, n: int, skip_special: bool = True,
                    final: bool = False) -> str | None:
        """The text ids[read:n] add after ids[prefix:read] (whose text is known), or None if it
        ends in part of a character (unless `final`: the bytes after it, not a character's
        rest, end it). Decoded after ids[prefix:read] (SentencePiece strips a text's first
        space), or alone where that text is not kept whole (a byte-fallback run)."""
        window, open_end = self._text_of(ids[prefix:n], skip_special)
        if open_end and not final:
            return None
        known = self._text_of(ids[prefix:read], skip_special)[0]
        return window[len(known):] if window.startswith(known) else self.decode(ids[read:n], skip_special)

    def _text_of(self, ids: list[int], skip_special: bool) -> tuple[str, bool]:
        """decode(ids), and whether it ends in part of a character that begins at a token,
        which a later token may finish. A character begun inside a token, after the last
        bytes of the one before (byte-level BPE merges bytes across characters: one token
        may end "こ" and begin "ん"), is left out, its U+FFFD with it: the text before it is
        whole, though no token boundary falls between them."""
        text = self.decode(ids, skip_special)
        if not text.endswith("\ufffd") or (start := self._unfinished(ids, skip_special)) is None:
            return text, False
        return (text[:-1], False) if start[1] else (text, True)

    def min_tokens_floor(self, ids: list[int], min_tokens: int, context: list[int] = (),
                         skip_special: bool = True) -> int:
        """Where stop strings may end from (`stop_cut`'s ends_after): past the text of the
        first min_tokens of `ids`, less a character that those only begin (a stop string
        that the next token completes counts)."""
        if not min_tokens:
            return 0
        return len(self.decode_continuation(ids[:min_tokens], context, skip_special))

    def continuation_context(self, context: list[int], ids: list[int],
                             skip_special: bool = True) -> tuple[list[int], int] | None:
        """The tokens to decode `ids` after, and how many of them hold text that is the
        context's; or None while `ids` only go on with a character the context ends
        inside. The last tokens of `context`: four, or up to CONTEXT_TOKENS where the four
        begin inside a character (a byte-fallback decoder turns a whole run of byte tokens
        that starts there into U+FFFD, and a continuation then decoded without its context
        lost its first space). A character the context ends inside (a prompt of token ids,
        or a stop-string window that starts in one) is the continuation's where `ids`
        finish it, as vLLM streams it; where they begin another, its tokens are left out,
        as are bytes at the end that no token can finish. Skipped special tokens are left
        out first: they add no text, and a prompt ending in four of them left none to
        decode after (SentencePiece's continuation then lost its first space)."""
        context = self._last_with_text(context, CONTEXT_TOKENS) if skip_special else list(context[-CONTEXT_TOKENS:])
        start = max(0, len(context) - 4)
        while start > max(0, len(context) - CONTEXT_TOKENS) and self._continues_a_character(context[start]):
            start -= 1
        context = context[start:]
        pending, sizes = self._open_bytes(context, skip_special)
        if pending:
            special, more = self.special_ids if skip_special else (), b""
            for i in ids:
                if len(more) >= 3:  # 3 bytes at most are missing
                    break
                more += self.token_bytes(i) if i not in special else b""
            text = codecs.getincrementaldecoder("utf-8")("replace").decode(pending + more)
            if not text:
                return None
            if not text.startswith("\ufffd"):  # finished: a token that also ends an earlier character is whole
                token, after_whole = self._open_start(pending, sizes)
                return context, token + after_whole
        while context and self.decode(context, skip_special).endswith("\ufffd"):
            context.pop()
        return context, len(context)

    def _last_with_text(self, ids: list[int], n: int) -> list[int]:
        """The last `n` of `ids` that are not special tokens, in order (read from the end:
        a long prompt is not copied for each continuation)."""
        kept = []
        for i in reversed(ids):
            if len(kept) == n:
                break
            if i not in self.special_ids:
                kept.append(i)
        return kept[::-1]

    def unfinished_from(self, ids: list[int], skip_special: bool = True) -> int | None:
        """Where in `ids` the unfinished UTF-8 character at their end begins (the token
        that holds its first byte), which a later token may finish; None if they end with
        a whole character, or in bytes that no token can finish (a stray continuation
        byte, a lead byte that another lead followed): those decode to U+FFFD for good,
        and text that waited on them would wait forever."""
        start = self._unfinished(ids, skip_special)
        return None if start is None else start[0]

    def _unfinished(self, ids: list[int], skip_special: bool) -> tuple[int, bool] | None:
        """`unfinished_from`'s token, and whether bytes of an earlier character come before
        the unfinished one's first byte in it."""
        return self._open_start(*self._open_bytes(ids, skip_special))

    @staticmethod
    def _open_start(pending: bytes, sizes: list[tuple[int, int]]) -> tuple[int, bool] | None:
        """`_unfinished` from `_open_bytes`' answer."""
        pending = len(pending)
        for k, size in sizes:  # back from the end to the token of its first byte
            pending -= size
            if pending <= 0 < pending + size:
                return k, pending < 0
        return None

    def _open_bytes(self, ids: list[int], skip_special: bool) -> tuple[bytes, list[tuple[int, int]]]:
        """The bytes of the unfinished character at the end of `ids` (b"" if none), and
        (index, byte count) of the last tokens read for it, from the end."""
        tail, sizes, special = b"", [], self.special_ids if skip_special else ()
        for k in range(len(ids) - 1, -1, -1):
            if ids[k] not in special:  # a skipped token adds no bytes: those around it join
                raw = self.token_bytes(ids[k])
                tail, sizes = raw + tail, sizes + [(k, len(raw))]
                if len(tail) >= 4:  # an unfinished character has at most 3
                    break
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(tail)
        return decoder.getstate()[0], sizes

    def _continues_a_character(self, token_id: int) -> bool:
        first = self.token_bytes(token_id)[:1]
        return bool(first) and 0x80 <= first[0] < 0xC0

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids that skip_special_tokens leaves out of a decoded text."""
        return frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (half a character shows as U+FFFD):
        how logprobs name a token, as vLLM does."""
        return self._token(token_id)[0]

    def vocab_spellings(self, ids: list[int]) -> list[str]:
        """The tokens as the vocabulary spells them (byte-level BPE's 'Ġ' for a space), as
        transformers' convert_ids_to_tokens gives them (vLLM's /tokenize token_strs)."""
        return [self.tok.id_to_token(i) for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, exact where its text is not (a token may hold
        part of a UTF-8 character): byte-level BPE and byte-fallback tokens map back to
        their bytes; any other token gives its text's UTF-8."""
        return self._token(token_id)[1]

    def _token(self, token_id: int) -> tuple[str, bytes]:
        """(text, bytes) of one token, worked out once per id (logprobs name k + 1
        tokens per generated token, on the thread that drives the rounds)."""
        if token_id in self._tokens:
            return self._tokens[token_id]
        text = self.tok.decode([token_id], skip_special_tokens=False)
        piece = self.tok.id_to_token(token_id) or ""
        spaces = len(piece) - len(piece.lstrip("\u2581"))  # SentencePiece's spaces: its decoder strips
        if spaces > len(text) - len(text.lstrip(" ")):      # a text's first one
            text = " " + text
        chars = _byte_level_chars()
        if m := _BYTE_FALLBACK.fullmatch(piece):
            raw = bytes([int(m.group(1), 16)])
        elif piece and self.byte_level and all(c in chars for c in piece):
            raw = bytes(chars[c] for c in piece)
        else:
            raw = text.encode("utf-8")
        self._tokens[token_id] = text, raw
        return text, raw


class TextStream:
    """Committed tokens as text deltas that are final: never half a UTF-8 character,
    never text that a stop string may still cut off, never the text of a token in
    `end_ids` that ended the request (the engine ends a request at the first one, so it
    is the last of its push); with `include_stop`, the text runs to the end of the stop
    string (or token) instead of its start. Decoding is incremental (a window of the last
    tokens, as the text's start depends on where decoding starts), so a long output is not
    decoded again at every round; it starts after `context` (the prompt's last tokens),
    as `Tokenizer.decode_continuation` does, so the deltas add up to the engine's text."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] = (), end_ids=(), skip_special: bool = True,
                 include_stop: bool = False, context: list[int] = (), min_tokens: int = 0):
        self.tokenizer, self.stop = tokenizer, list(stop)
        # min_tokens: no stop string in the text of the first min_tokens tokens counts; they
        # must end past `floor`, known once min_tokens tokens came (`pushed` until then)
        self.context, self.min_tokens, self.pushed = list(context), min_tokens, []
        self.floor: int | None = 0 if min_tokens == 0 else None
        self.end_ids = set() if include_stop else set(end_ids)
        self.skip_special, self.include_stop = skip_special, include_stop
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        # the context's last tokens and the output's (None while the output only goes on
        # with a character the context ends inside: `waiting` holds it)
        self.ids: list[int] | None = None
        self.waiting: list[int] = []
        self._start([])
        self.prefix = 0              # ids[prefix:read] decode to the end of self.text
        self.text = ""               # the text of ids[:read]
        self.sent = 0                # characters handed out

    def push(self, ids: list[int]) -> str:
        if self.floor is None:
            self.pushed += ids
            if len(self.pushed) >= self.min_tokens:
                self.floor = self.tokenizer.min_tokens_floor(self.pushed, self.min_tokens, self.context,
                                                             self.skip_special)
        ids = ids[:-1] if ids and ids[-1] in self.end_ids else ids
        if self.skip_special:  # left out of the window: a long run of them made every decode longer
            ids = [i for i in ids if i not in self.tokenizer.special_ids]
        if self.ids is None:
            if not self._start(ids):
                return ""
        else:
            self.ids += ids
        piece = self.tokenizer.whole_piece(self.ids, self.prefix, self.read, len(self.ids), self.skip_special)
        if piece is not None and "\ufffd" not in piece:
            if piece:  # a whole character more
                self.text += piece
                self.prefix, self.read = self.read, len(self.ids)
        else:  # part of a character in the new text: token by token, as Tokenizer.decode_continuation
            piece, self.prefix, self.read = self.tokenizer.whole_text(self.ids, self.prefix, self.read,
                                                                      self.skip_special)
            self.text += piece
        # a stop string can only start at or after `sent` (text before it was checked)
        cut = None if self.floor is None else stop_cut(self.text, self.stop, self.include_stop, self.sent, self.floor)
        end = cut[0] if cut else len(self.text) - self.hold
        delta = self.text[self.sent:end] if end > self.sent else ""
        self.sent += len(delta)
        return delta

    def finish(self, text: str) -> str:
        """The rest of the final text (the engine's, stop strings cut)."""
        return text[self.sent:]

    def _start(self, ids: list[int]) -> bool:
        """Take the output's first `ids` after the context, as decode_continuation does;
        False while they only go on with a character the context ends inside."""
        self.waiting += ids
        start = self.tokenizer.continuation_context(self.context, self.waiting, self.skip_special)
        if start is None:
            return False
        context, self.read = start
        self.ids, self.waiting = context + self.waiting, []
        return True
