"""What a request's sampling parameters mean for one model and its tokenizer (whether
they fit, the ids that end it, its bad words and structured output as tokens, where its
output stops), and the output a finished request gets."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from treeflash.errors import UsageError, is_text, shown
from treeflash.sampling_params import BAD_WORD_TOKENS, MAX_BAD_SEQUENCES, SamplingParams
from treeflash.structured.cache import AutomatonCache
from treeflash.structured.grammar import TokenAutomaton
from treeflash.tokenizer import CONTEXT_TOKENS, Tokenizer, stop_cut


@dataclass(frozen=True)
class TokenLogprob(Mapping):
    """A generated token's log-probability under the target model (softmax of its raw
    logits, before temperature and filters), with the request's `logprobs` most likely
    tokens as (id, log-probability), most likely first."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None  # its rank in the vocabulary (1: the most likely; ties: the last)
    texts: dict[int, str] = field(default_factory=dict, repr=False, compare=False)  # its and top's token texts

    # vLLM's form of it, a read-only {token id: Logprob}: the token first (vLLM's samplers
    # put it there, and `next(iter(d))` is read as the chosen token), then its alternatives
    # (Mapping gives keys, values, items and `in` from these three), made once
    @cached_property
    def _as_vllm(self) -> dict[int, "Logprob"]:
        found = {self.token_id: Logprob(self.logprob, self.rank, self.texts.get(self.token_id))}
        return found | {t: Logprob(lp, r, self.texts.get(t)) for r, (t, lp) in enumerate(self.top, 1) if t not in found}

    def __getitem__(self, token_id: int) -> "Logprob":
        return self._as_vllm[token_id]

    def __iter__(self):
        return iter(self._as_vllm)

    def __len__(self) -> int:
        return len(self._as_vllm)


@dataclass(frozen=True)
class Logprob:
    """vLLM's: one token's log-probability, rank and text."""
    logprob: float
    rank: int | None
    decoded_token: str | None = None


@dataclass
class GenerationOutput:
    """A finished request: its text, token ids (the end token kept), why it ended, and
    the engine's stats of it (method, new tokens, rounds, tau, seconds, ...)."""
    text: str
    token_ids: list[int]
    finish_reason: str           # "stop" (EOS or stop string), "length", or "abort" (ended by on_tokens)
    stats: dict = field(default_factory=dict)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None: EOS, or not stopped)
    logprobs: list[TokenLogprob] | None = None  # one per token id, if SamplingParams.logprobs asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None), if asked
    prompt_token_ids: list[int] | None = None  # the prompt as the model read it (after any truncation)
    prompt: str | None = None  # the prompt's text, as given (None: given as token ids), as vLLM's
    request_id: str = ""  # vLLM's: the engine's requests numbered in the order given, from "0"

    @property
    def outputs(self) -> list["GenerationOutput"]:
        """vLLM's `RequestOutput.outputs`: this output as its request's one completion (a
        request here has one), so that vLLM's `out.outputs[0].text` reads as `out.text`."""
        return [self]

    # vLLM's RequestOutput and CompletionOutput fields that a finished output of one completion has
    finished = True
    index = 0
    metrics = None  # vLLM's per-request timings: `stats` holds this engine's

    @property
    def num_cached_tokens(self) -> int:
        """vLLM's: the prompt tokens found in the caches (prefix caching; else 0)."""
        return self.stats.get("cached_tokens", 0)

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the tokens' log-probabilities (None unless logprobs were asked for)."""
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


def token_logprobs(tokens: list[int], rows, k: int, text_of) -> list[TokenLogprob]:
    """The `TokenLogprob`s of `tokens` from one request's logprobs read back as lists
    (chosen [T], top values [T][K], top ids [T][K], ranks [T]; `tokens` are its first
    T' <= T); `k` alternatives each, every token named by `text_of(id)`."""
    chosen, top_vals, top_ids, ranks = rows
    out = []
    for i, t in enumerate(tokens):
        top = list(zip(top_ids[i][:k], top_vals[i][:k]))
        out.append(TokenLogprob(t, chosen[i], top, ranks[i], {j: text_of(j) for j in (t, *(j for j, _ in top))}))
    return out


def prompt_token_logprobs(prompts: list[list[int]], params: list[SamplingParams], plp: list, text_of):
    """Per request, its prompt's `TokenLogprob`s (None for requests that did not ask)
    from `prefill_tokens`' flat rows read back as lists (chosen [N], top values
    [N][K], top ids [N][K], ranks [N]: the asking requests' tokens but their first, in
    order); the first token's entry is None, as vLLM's (nothing predicts it)."""
    out, at = [], 0
    for ids, p in zip(prompts, params):
        if p.prompt_logprobs is None:
            out.append(None)
            continue
        rows = [x[at:at + len(ids) - 1] for x in plp]
        at += len(ids) - 1
        out.append([None] + token_logprobs(ids[1:], rows, p.prompt_logprobs, text_of))
    return out


def _dead_end(sequences: list[list[int]], allowed: set[int]) -> list[int] | None:
    """An output of allowed tokens, none banned as it was written, after which the bad
    words (token sequences) ban every allowed token, or None. Only a bad word's beginning
    can be one: an output bans what its longest end that begins a bad word bans. The
    sampler would then have no token left (it took token 0, allowed or not)."""
    def banned(out):
        return {w[-1] for w in sequences if len(w) <= len(out) + 1 and w[:-1] == out[len(out) + 1 - len(w):]}
    for w in sequences:
        for k in range(1, len(w)):
            out = w[:k]
            if all(t in allowed and t not in banned(out[:i]) for i, t in enumerate(out)) and allowed <= banned(out):
                return out
    return None


class RequestRules:
    """A model's rules for its requests: checks of their `SamplingParams`, and what the
    host does with the tokens a round commits (ends, stop strings, the final text).
    `eos_token_ids`: the end ids of the tokenizer, config.json and generation_config.json;
    `automata` compiles each structured-output constraint once (an engine and its
    `with_method` copies share it)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.automata = AutomatonCache(tokenizer, vocab_size)

    def check(self, p: SamplingParams) -> None:
        """Raise UsageError (one line) if p does not fit this model."""
        p.validate(self.vocab_size)
        held = self.held_ids(p)
        allowed = None if p.allowed_token_ids is None else set(p.allowed_token_ids)
        biased_out = p.bias_bans
        # min_tokens must leave a token to sample: of allowed_token_ids, or of the vocabulary (held ids lie in it)
        if p.min_tokens and (allowed <= held | biased_out if allowed is not None
                             else len(held | biased_out) >= self.vocab_size):
            pool = "one of allowed_token_ids" if allowed is not None else "token of the vocabulary"
            raise UsageError(f"invalid sampling parameters: min_tokens holds back every {pool} (EOS and stop tokens"
                             f"{', with logit_bias -inf' if biased_out else ''})")
        # tokenized once for the checks below; a -inf bias bans its token as a one-token bad word does
        sequences = self.bad_sequences(p) + [[t] for t in sorted(biased_out)]
        banned = {seq[0] for seq in sequences if len(seq) == 1}
        bans = "bad_words and logit_bias -inf ban" if p.bad_words and biased_out else \
            "bad_words ban" if p.bad_words else "logit_bias -inf bans"  # (the errors' subject)
        param = "bad_words" if p.bad_words else "logit_bias"
        pool, every = allowed, "every one of allowed_token_ids"
        if pool is None and len(sequences) + len(held) >= self.vocab_size:  # only then can they ban every token
            pool, every = set(range(self.vocab_size)), "every token of the vocabulary"
        if pool is not None and pool <= banned | (held if p.min_tokens else set()):
            raise UsageError(f"invalid sampling parameters: {bans} {every}"
                             + (" that min_tokens does not hold back" if p.min_tokens else ""), param=param)
        if pool is not None and (dead := _dead_end(sequences, pool)) is not None:
            raise UsageError(f"invalid sampling parameters: {bans} {every} after "
                             f"{shown(self.tokenizer.decode(dead, skip_special=False))}", param=param)
        if p.structured_outputs is not None and not held:
            raise UsageError("structured outputs need an end token: this model has no EOS, give stop_token_ids")
        if (automaton := self.automaton(p)) is not None:
            automaton.check(held, sequences, bans, param)

    def automaton(self, p: SamplingParams) -> TokenAutomaton | None:
        """p's structured output as a token automaton (None without one), compiled once
        per constraint (see `AutomatonCache`)."""
        return None if p.structured_outputs is None else self.automata.get(p.structured_outputs)

    def bad_sequences(self, p: SamplingParams) -> list[list[int]]:
        """p's bad words as token sequences, as vLLM's: each word as the tokenizer writes
        it, and after a space where that gives another first token and as many tokens (a
        word inside a text)."""
        out = []
        for word in p.bad_words or []:
            if not is_text(word):
                raise UsageError(f"invalid sampling parameters: bad word {shown(word)} is not valid Unicode text",
                                 param="bad_words")
            for prefix in ("", " "):
                ids = self.tokenizer.encode(prefix + word.lstrip(), special=False)
                if not ids and not prefix:  # its text is all what the normalizer drops, or blank
                    raise UsageError(f"invalid sampling parameters: bad word {shown(word)} has no tokens "
                                     f"(the tokenizer leaves none of its text)", param="bad_words")
                if prefix and (not ids or ids[0] == out[-1][0] or len(ids) != len(out[-1])):
                    continue
                if len(ids) > BAD_WORD_TOKENS:
                    raise UsageError(f"invalid sampling parameters: bad word {shown(word)} is {len(ids)} tokens "
                                     f"(at most {BAD_WORD_TOKENS})", param="bad_words")
                out.append(ids)
        if len(out) > MAX_BAD_SEQUENCES:
            raise UsageError(f"invalid sampling parameters: bad_words make {len(out)} token sequences "
                             f"(at most {MAX_BAD_SEQUENCES})", param="bad_words")
        return out

    def held_ids(self, p: SamplingParams) -> set[int]:
        """The token ids that min_tokens holds back: EOS (even with ignore_eos, as vLLM)
        and p's stop token ids."""
        return set(p.stop_token_ids) | set(self.eos_token_ids)

    def end_ids(self, p: SamplingParams) -> set[int]:
        """The token ids that end request p (its stop token ids, and EOS unless ignored):
        kept in its tokens, left out of its text (as vLLM does)."""
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))

    def append_until_end(self, got: list[int], out: list[int], p: SamplingParams, limit: int) -> str | None:
        """Append committed tokens up to EOS / the token limit; return the stop reason."""
        ends = self.end_ids(p)
        for t in got:
            out.append(t)
            if t in ends:
                return "stop"
            if len(out) >= limit:
                return "length"
        return None

    def cut_at_stop_string(self, out: list[int], before: int, p: SamplingParams, prompt: list[int] = ()) -> bool:
        """If one of p's stop strings appeared among the tokens added after `before`, drop
        every token after the one that completed it (as AR would have stopped there).
        Not before p.min_tokens tokens, and then only one that ends past their text. Only
        whole characters count (a stop string U+FFFD is not half a character), and only a
        window of the text is decoded: the new tokens' and enough before it for the longest
        stop string (decoding the whole output for each stop string, every round, made a
        2000-token answer with 64 stop strings take 15 s)."""
        first = max(before, p.min_tokens)  # a stop string must end in the text of out[first:]
        if first >= len(out):
            return False
        lo, longest = first, max(map(len, p.stop))
        prompt_tail = list(prompt[-CONTEXT_TOKENS:])

        def text(k: int) -> str:  # whole characters of out[lo:k], decoded after what precedes them
            context = (prompt_tail + out[max(0, lo - CONTEXT_TOKENS):lo])[-CONTEXT_TOKENS:]
            return self.tokenizer.decode_continuation(out[lo:k], context, p.skip_special_tokens)

        while lo > 0 and len(text(first)) < longest + 3:  # + the orphan bytes of a character cut at lo
            lo = max(0, lo - max(16, first - lo))
        after = len(text(first))  # what out[:first] wrote: a stop string there came too early
        if not stop_cut(text(len(out)), p.stop, False, ends_after=after):
            return False
        for k in range(first + 1, len(out) + 1):
            if stop_cut(text(k), p.stop, False, ends_after=after):
                del out[k:]
                return True
        return False

    def output(self, ids: list[int], reason: str, p: SamplingParams, prompt: list[int],
               logprobs: list[TokenLogprob] | None, prompt_logprobs: list[TokenLogprob] | None,
               stats: dict) -> GenerationOutput:
        """A finished request's output: its text (decoded after the prompt, see
        `Tokenizer.decode_continuation`) cut at the first stop string (at its start, or
        its end with include_stop_str_in_output) or without the token that ended it (kept
        with include_stop_str_in_output, as vLLM does), and the engine's `stats` of it."""
        ended_by_token = reason == "stop" and bool(ids) and ids[-1] in self.end_ids(p)
        in_text = ids[:-1] if ended_by_token and not p.include_stop_str_in_output else ids
        text = self.tokenizer.decode_continuation(in_text, prompt, p.skip_special_tokens)
        cut = None
        # as while generating (`cut_at_stop_string`); an end token that completes a stop
        # string ends the request as an end token (vLLM checks those first), its text kept
        # whole with include_stop_str_in_output
        if p.stop and not ended_by_token:
            floor = self.tokenizer.min_tokens_floor(ids, p.min_tokens, prompt, p.skip_special_tokens)
            cut = stop_cut(text, p.stop, p.include_stop_str_in_output, ends_after=floor)
        if cut:
            text = text[:cut[0]]
        # as vLLM: the tokenizer's EOS has no stop_reason (even if stop_token_ids lists it);
        # another end id (generation_config.json's) is reported as a stop token id is
        model_eos = self.eos_token_ids if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        by_eos = ended_by_token and not p.ignore_eos and ids[-1] in model_eos
        stop_reason = cut[1] if cut else ids[-1] if ended_by_token and not by_eos else None
        return GenerationOutput(text, ids, reason, stats, stop_reason=stop_reason, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs, prompt_token_ids=list(prompt))
