"""Reasoning in chat answers (vLLM's `--reasoning-parser`): a thinking model's
`<think>...</think>` comes back as the message's `reasoning_content`, the rest as its
content, whole or streamed.

- `qwen3`: Qwen3's hybrid models open the block themselves when thinking (with
  enable_thinking false their template writes an empty block into the prompt and the
  answer has none): reasoning only if the answer starts with `<think>`.
- `deepseek_r1`: the template's generation prompt opens the block, so the answer starts
  inside it (a `<think>` it writes anyway is skipped): reasoning up to `</think>`.

An answer cut off before `</think>` is all reasoning. Decoding is not touched.
"""
from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


class ReasoningStream:
    """Splits a choice's text, fed in pieces, into (reasoning, content): `push` returns
    what can be sent now; text that may be the start of a tag is held until it is known.
    The whitespace between `</think>` and the content is dropped."""

    def __init__(self, parser: str):
        assert parser in PARSERS
        self.parser, self.held = parser, ""
        self.state = "start"  # start (is there an opening tag?), thinking, answer, lead (whitespace after </think>)

    def push(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                if len(self.held) < len(OPEN) and OPEN.startswith(self.held):
                    return reasoning, content  # not yet known
                opened = self.held.startswith(OPEN)
                if opened:
                    self.held = self.held[len(OPEN):]
                self.state = "thinking" if opened or self.parser == "deepseek_r1" else "answer"
            elif self.state == "thinking":
                at = self.held.find(CLOSE)
                if at < 0:
                    keep = next((k for k in range(min(len(CLOSE) - 1, len(self.held)), 0, -1)
                                 if CLOSE.startswith(self.held[-k:])), 0)
                    reasoning += self.held[:len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep:]
                    return reasoning, content
                reasoning += self.held[:at]
                self.held, self.state = self.held[at + len(CLOSE):], "lead"
            elif self.state == "lead":
                self.held = self.held.lstrip()
                if not self.held:
                    return reasoning, content
                self.state = "answer"
            else:
                content, self.held = content + self.held, ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held at the end: a partial tag is text of the part it was in."""
        rest, self.held = self.held, ""
        if self.state == "start":
            return ("", rest) if self.parser == "qwen3" else (rest, "")
        return (rest, "") if self.state == "thinking" else ("", rest if self.state == "answer" else "")


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.push(text)
    more, rest = stream.finish()
    return (reasoning + more) or None, content + rest
