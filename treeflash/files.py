"""The small text files of a model folder (config.json, tokenizer_config.json, a chat
template, ...), read with one line of error for every way they can be wrong: missing
where required, not a file, unreadable, not UTF-8, not JSON, nested past the parser;
and where a model folder is, when it is named by a Hugging Face hub id (`model_folder`)."""
from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from pathlib import Path

from treeflash.errors import TreeflashError


def read_text(path: str | Path, max_bytes: int | None = None) -> str:
    """The UTF-8 text of `path` (newlines as "\n"); a file past `max_bytes` is refused
    before it is read."""
    path = Path(path)
    check_regular_file(path)
    try:
        if max_bytes is not None and path.is_file() and (size := path.stat().st_size) > max_bytes:
            raise TreeflashError(f"cannot read {_named(path)}: {size:,} bytes, more than the {max_bytes:,} it may hold")
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TreeflashError(f"cannot read {_named(path)}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:  # a folder, a permission, a vanished file
        raise TreeflashError(f"cannot read {_named(path)}: {e.strerror or e}") from None


def check_regular_file(path: Path) -> None:
    """Refuse a FIFO, socket or device where a file is read (reading a FIFO waits for a
    writer forever); a missing path or a folder is left to the read's own error."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode) and not stat.S_ISDIR(mode):
        raise TreeflashError(f"cannot read {_named(path)}: not a regular file")


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


def probe_write(folder: str | Path) -> None:
    """Make and drop a file in `folder` (OSError if that fails): os.access can be wrong
    (root "accesses" /proc and read-only mounts; network mounts, root squashing, ACLs)."""
    tempfile.TemporaryFile(dir=folder).close()


def _named(path: str | Path) -> str:
    path = Path(path)
    return f"{path.name} in {path.parent}"


def is_hub_id(name) -> bool:
    """Whether `name` reads as a Hugging Face hub id ("org/name")."""
    return isinstance(name, str) and re.fullmatch(r"[\w-][\w.-]*/[\w-][\w.-]*", name) is not None  # not ./x


def hub_snapshot(name: str) -> Path | None:
    """The local copy of hub id `name` in the Hugging Face cache (HF_HUB_CACHE, or the
    older HUGGINGFACE_HUB_CACHE, or HF_HOME/hub, or $XDG_CACHE_HOME or ~/.cache, then
    /huggingface/hub, as huggingface_hub finds it), where `hf
    download` (`huggingface-cli download`) and transformers put it: the snapshot its
    refs/main names, else the newest; None if none.
    Nothing is downloaded: the machines that serve models often cannot."""
    if not is_hub_id(name):
        return None
    env = os.environ.get
    home = env("HF_HOME") or str(Path(env("XDG_CACHE_HOME") or "~/.cache") / "huggingface")
    cache = env("HF_HUB_CACHE") or env("HUGGINGFACE_HUB_CACHE") or str(Path(os.path.expandvars(home)) / "hub")
    repo = Path(os.path.expandvars(cache)).expanduser() / ("models--" + name.replace("/", "--"))
    try:
        main = (repo / "refs" / "main").read_text().strip() if (repo / "refs" / "main").is_file() else ""
        if main and (repo / "snapshots" / main / "config.json").is_file():
            return repo / "snapshots" / main
        snapshots = [p for p in (repo / "snapshots").iterdir() if (p / "config.json").is_file()]
    except OSError:
        return None
    return max(snapshots, key=lambda p: p.stat().st_mtime, default=None)


def model_folder(path):
    """`path` if it exists (or is None), else the cached snapshot of the hub id it names
    (`hub_snapshot`), else `path` (whose loading then says it was not found)."""
    if path is None or Path(path).exists():
        return path
    return hub_snapshot(str(path)) or path


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def tokenizer_settings(folder: str | Path) -> dict:
    """tokenizer_config.json, with the special tokens (bos_token, eos_token, ...) that
    only special_tokens_map.json names, as older transformers saved them, filled in:
    transformers reads both, and the config wins."""
    folder = Path(folder)
    config = read_json_object(folder / "tokenizer_config.json")
    tokens = read_json_object(folder / "special_tokens_map.json")
    names = (*SPECIAL_TOKENS, "additional_special_tokens")
    return {**{k: v for k, v in tokens.items() if k in names}, **config}
