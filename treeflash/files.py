"""The small text files of a model folder (config.json, tokenizer_config.json, a chat
template, ...), read with one line of error for every way they can be wrong: missing
where required, not a file, unreadable, not UTF-8, not JSON, nested past the parser."""
from __future__ import annotations

import json
from pathlib import Path

from treeflash.errors import TreeflashError


def read_text(path: str | Path) -> str:
    """The UTF-8 text of `path`."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TreeflashError(f"cannot read {_named(path)}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:  # a folder, a permission, a vanished file
        raise TreeflashError(f"cannot read {_named(path)}: {e.strerror or e}") from None


def read_json(path: str | Path):
    """The JSON value in `path` (of any type: the caller checks it)."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TreeflashError(f"malformed {_named(path)}: {e}") from None
    except RecursionError:
        raise TreeflashError(f"malformed {_named(path)}: nested too deeply") from None


def read_json_object(path: str | Path, missing_ok: bool = True) -> dict:
    """The JSON object in `path`; {} if it does not exist and `missing_ok`."""
    path = Path(path)
    if missing_ok and not path.exists():
        return {}
    data = read_json(path)
    if not isinstance(data, dict):
        raise TreeflashError(f"malformed {_named(path)}: expected a JSON object")
    return data


def _named(path: str | Path) -> str:
    path = Path(path)
    return f"{path.name} in {path.parent}"
