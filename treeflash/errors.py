"""User-facing errors: the CLI prints them as one line, without a traceback."""
import os


class TreeflashError(Exception):
    """Bad model files, bad requests, or a failed run (CLI exit code 1)."""


class UsageError(TreeflashError):
    """A bad command-line or API argument (CLI exit code 2); `param`: which, where a
    server's answer names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(UsageError):
    """A request longer than the model's context. Worded as OpenAI and vLLM word it
    ("This model's maximum context length is N tokens"), which clients such as LiteLLM
    match to fall back to a longer-context model; the server adds OpenAI's code."""

    def __init__(self, max_model_len: int, detail: str, param: str | None = None):
        super().__init__(f"This model's maximum context length is {max_model_len} tokens{detail}", param)


class InStepError(TreeflashError):
    """A failure that every tensor-parallel rank raised at the same point of a command,
    having agreed on it (a batch's caches did not fit on some rank): the ranks are still
    in step, so the engine goes on."""


class EngineDeadError(TreeflashError):
    """The engine can serve no more requests (a tensor-parallel rank failed, so the ranks
    are out of step, or its workers were shut down): only a new `LLM` can. A server
    answers 503 and reports itself unhealthy."""


def debugging() -> bool:
    """TREEFLASH_DEBUG set to anything but "" or "0": errors print their tracebacks."""
    return os.environ.get("TREEFLASH_DEBUG", "") not in ("", "0")


def is_text(s: str) -> bool:
    """Whether UTF-8 can write `s`: a lone surrogate (a client that cut a character in
    two, undecodable command-line bytes) it cannot, and no tokenizer or match takes it."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def shown(value, limit: int = 80) -> str:
    """repr(value), cut: an error message does not echo a megabyte of input back (nor
    fail on an integer too long to print)."""
    try:
        text = repr(value)
    except ValueError:  # past Python's int-to-text limit
        text = f"<a {type(value).__name__} too long to print>"
    return text if len(text) <= limit else text[:limit - 3] + "..."
