"""User-facing errors: the CLI prints them as one line, without a traceback."""


class TreeflashError(Exception):
    """Bad model files, bad requests, or a failed run (CLI exit code 1)."""


class UsageError(TreeflashError):
    """A bad command-line or API argument (CLI exit code 2)."""
