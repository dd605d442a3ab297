"""The training corpus: Python source files of the local Python installation, or the
text files a user gives.

`collect` walks the roots (default: the standard library, then site-packages), keeps
UTF-8 files with the chosen suffixes (default `.py`; a `.jsonl` file holds one document
per line, in its "text" field), drops exact duplicates by content hash, splits train /
held-out by a hash of each document's path relative to its root (and line, in a
`.jsonl`: stable across machines and corpus caps), and stops at an optional byte cap. Files are taken root by root (so a cap keeps the whole
standard library first), in a pseudo-random order within a root (a second hash of the
path), so a capped corpus is a sample of each root, not its alphabetical head.

`write_corpus` tokenizes both splits into flat id arrays (`train.npy`, `heldout.npy`:
uint16 when the vocabulary allows, EOS after every document) beside a copy of the tokenizer
and `corpus.json`, so a GPU machine is given compact, pre-tokenized data. With
`compress`, the arrays go into zlib-compressed `.npz` files instead: Python code is
repetitive (licenses, boilerplate), so that holds ~2.8x more tokens in the same bytes.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from treeflash.errors import TreeflashError, UsageError, is_text
from treeflash.files import model_folder
from treeflash.train.common import Progress, check_out_dir, refuse_model_folder, to_device, within

HELDOUT_FRACTION = 0.02
MAX_FILE_BYTES = 512 * 1024    # larger .py files are mostly generated tables
MAX_LINE_CHARS = 2000          # longer lines are data blobs, not code
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def default_roots() -> list[Path]:
    """The standard library and the installed packages of the running Python."""
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "purelib", "platlib"):
        p = Path(paths[key]).resolve()
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots


@dataclass
class Corpus:
    train: list[str]
    heldout: list[str]
    stats: dict = field(default_factory=dict)
    # per split, the documents that are .jsonl lines: rendered chats, whose special-token
    # text (<|im_start|>) is tokenized into special tokens, as the target reads a prompt
    rendered: dict[str, list[bool]] = field(default_factory=lambda: {"train": [], "heldout": []})


def resolve_roots(roots: list[str | Path] | None) -> list[Path]:
    return [Path(r).resolve() for r in roots] if roots else default_roots()


WRITTEN = ("tokenizer.json", "corpus.json", "train.npy", "train.npz")  # what tokenizer / corpus write


def check_out_outside_roots(out: str | Path, roots: list[str | Path] | None,
                            suffixes: tuple[str, ...] = (".py",)) -> None:
    """An output folder inside a corpus root whose --suffixes match what is written there
    (.json) would be read back by the next run, a tokenizer among the texts it trains on."""
    if not any(name.endswith(tuple(suffixes)) for name in WRITTEN):
        return
    where = Path(out).resolve()
    for root in resolve_roots(roots):
        if within(where, root):
            raise UsageError(f"output folder {out} is inside the corpus root {root}: a later run would read "
                             f"its files as documents; choose another --out")


def _list_files(roots: list[Path], suffixes: tuple[str, ...] = (".py",)) -> list[tuple]:
    """(root index, order key, relative path, path, split key in [0, 1)) for every file
    with one of `suffixes`."""
    entries = []
    for i, root in enumerate(roots):
        others = {r for r in roots if r != root}
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and here / d not in others)
            for name in filenames:
                path = here / name
                if not name.endswith(suffixes) or not path.is_file():  # a FIFO or device would block the read
                    continue
                rel = path.relative_to(root).as_posix()
                h = hashlib.sha1(rel.encode("utf-8", "surrogateescape")).digest()  # (a name of undecodable bytes)
                entries.append((i, h[8:16], rel, path, int.from_bytes(h[:8], "big") / 2 ** 64))
    entries.sort(key=lambda e: e[:3])
    return entries


def _read_source(path: Path) -> str | None:
    """The file's text, or None when it is not plausible source code (or text)."""
    code = path.suffix == ".py"  # huge files and long lines in code are data; in prose, books and paragraphs
    try:
        if code and path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_bytes().decode("utf-8-sig")  # less a byte-order mark
    except (OSError, UnicodeDecodeError):
        return None
    text = text.replace("\r\n", "\n")
    if not text.strip() or "\x00" in text or (code and max(map(len, text.splitlines()), default=0) > MAX_LINE_CHARS):
        return None
    return text


def _documents(path: Path, rel: str, split_key: float):
    """(text or None when unusable, split key) of each document in a file: the file, or each
    line's "text" of a `.jsonl` (a line that is not such an object is an error: a wrong
    field name would otherwise give an empty corpus, or a corpus of JSON)."""
    if path.suffix != ".jsonl":
        yield _read_source(path), split_key
        return
    try:
        with path.open(encoding="utf-8-sig") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    text = None
                if not isinstance(text, str):
                    raise UsageError(f"{path}:{i}: a .jsonl corpus line must be an object with a string 'text'")
                h = hashlib.sha1(f"{rel}:{i}".encode("utf-8", "surrogateescape")).digest()
                usable = text.strip() and "\x00" not in text and is_text(text)  # (JSON may hold a lone surrogate)
                yield (text if usable else None), int.from_bytes(h[:8], "big") / 2 ** 64
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None
    except OSError as e:
        raise TreeflashError(f"cannot read {path}: {e.strerror}") from None


def collect(roots: list[str | Path] | None = None, heldout_fraction: float = HELDOUT_FRACTION,
            max_bytes: int | None = None, suffixes: tuple[str, ...] = (".py",)) -> Corpus:
    """Read, de-duplicate, split and cap the documents in the files under `roots` whose
    names end with one of `suffixes`."""
    suffixes = tuple(suffixes)
    if not suffixes or not all(isinstance(x, str) and x.startswith(".") and len(x) > 1 for x in suffixes):
        raise UsageError(f"--suffixes must look like .py or .txt, got {list(suffixes)}")
    if not 0 <= heldout_fraction < 1:
        raise UsageError(f"--heldout-fraction must be in [0, 1), got {heldout_fraction}")
    if max_bytes is not None and max_bytes < 1:
        raise UsageError(f"--max-bytes must be >= 1, got {max_bytes}")
    roots = resolve_roots(roots)
    for r in roots:
        if not r.is_dir():
            raise UsageError(f"corpus root is not a folder: {r}")
    corpus = Corpus([], [])
    seen: set[bytes] = set()
    stats = {"roots": [str(r) for r in roots], "suffixes": list(suffixes), "files_seen": 0, "skipped": 0,
             "duplicates": 0,
             "train_files": 0, "heldout_files": 0, "train_bytes": 0, "heldout_bytes": 0, "capped": False}
    total = 0
    for _, _, rel, path, file_key in _list_files(roots, suffixes):
        stats["files_seen"] += 1
        for text, split_key in _documents(path, rel, file_key):
            if text is None:
                stats["skipped"] += 1
                continue
            data = text.encode()
            digest = hashlib.sha1(data).digest()
            if digest in seen:
                stats["duplicates"] += 1
                continue
            if max_bytes is not None and total + len(data) > max_bytes:
                stats["capped"] = True
                break
            seen.add(digest)
            total += len(data)
            split = "heldout" if split_key < heldout_fraction else "train"
            getattr(corpus, split).append(text)
            corpus.rendered[split].append(path.suffix == ".jsonl")
            stats[f"{split}_files"] += 1
            stats[f"{split}_bytes"] += len(data)
        if stats["capped"]:
            break
    if not corpus.train:
        why = (f": max_bytes {max_bytes} was reached after {len(corpus.heldout)} held-out document(s) and no "
               f"training one" if stats["capped"] else
               f": all {len(corpus.heldout)} went to the held-out split (fraction {heldout_fraction})"
               if corpus.heldout else "")
        raise TreeflashError(f"empty corpus: no usable {'/'.join(suffixes)} documents for training under "
                             f"{', '.join(map(str, roots))}{why}")
    corpus.stats = stats
    return corpus


def tokenize(texts: list[str], tokenizer, eos_id: int, dtype, desc: str = "tokenize",
             rendered: list[bool] | None = None) -> np.ndarray:
    """Flat ids of all texts, each followed by EOS. Special-token text inside a source file
    (a string "<|endoftext|>" in a tokenizer's code) is tokenized as plain text: the only
    EOS ids are the file ends, and MASK never appears. A `rendered` document (a .jsonl
    line: a chat rendered with the target's template) keeps its special tokens, which the
    target reads as single ids (<|im_start|>) in every chat it is given."""
    rendered = rendered or [False] * len(texts)
    bar = Progress(desc, len(texts), 0)
    parts, step = [], 512
    plain = tokenizer.encode_special_tokens
    try:
        for i in range(0, len(texts), step):
            ids = [None] * len(texts[i:i + step])
            for keep in (False, True):
                picked = [j for j, r in enumerate(rendered[i:i + step]) if r == keep]
                tokenizer.encode_special_tokens = not keep  # True: split special tokens' text like other text
                for j, enc in zip(picked, tokenizer.encode_batch([texts[i + j] for j in picked],
                                                                 add_special_tokens=False)):
                    ids[j] = enc.ids
            parts += [np.asarray(x + [eos_id], dtype=dtype) for x in ids]
            bar.step(len(ids))
    finally:
        tokenizer.encode_special_tokens = plain
    bar.close()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def write_corpus(tokenizer_dir: str | Path, out_dir: str | Path, roots: list[str | Path] | None = None,
                 heldout_fraction: float = HELDOUT_FRACTION, max_bytes: int | None = None,
                 compress: bool = False, suffixes: tuple[str, ...] = (".py",)) -> dict:
    """Tokenize the corpus with the tokenizer in `tokenizer_dir` into `out_dir`
    (train.npy / heldout.npy, or .npz when `compress`; corpus.json; the tokenizer files)."""
    from treeflash.tokenizer import Tokenizer
    check_out_dir(out_dir)
    refuse_model_folder(out_dir, "a corpus (its ids and tokenizer files)")
    check_out_outside_roots(out_dir, roots, suffixes)
    tokenizer_dir = model_folder(tokenizer_dir)  # a hub id: its Hugging Face cache's copy, as LLM reads one
    tok = Tokenizer(tokenizer_dir)
    if not tok.eos_token_ids:
        raise TreeflashError(f"the tokenizer in {tokenizer_dir} defines no EOS token")
    eos = tok.eos_token_ids[0]
    corpus = collect(roots, heldout_fraction, max_bytes, suffixes)
    vocab = tok.vocab_size
    dtype = np.uint16 if vocab <= 1 << 16 else np.int32
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = tokenize(corpus.train, tok.tok, eos, dtype, "tokenize train", corpus.rendered["train"])
    heldout = tokenize(corpus.heldout, tok.tok, eos, dtype, "tokenize held-out", corpus.rendered["heldout"])
    for split, ids in (("train", train), ("heldout", heldout)):
        for stale in (out / f"{split}.npy", out / f"{split}.npz"):
            stale.unlink(missing_ok=True)
        if compress:
            np.savez_compressed(out / f"{split}.npz", ids=ids)
        else:
            np.save(out / f"{split}.npy", ids)
    src = Path(tokenizer_dir).resolve()
    if src != out.resolve():
        for name in TOKENIZER_FILES:
            if (src / name).exists():
                shutil.copy(src / name, out / name)
    s = corpus.stats
    meta = {**s, "vocab_size": vocab, "eos_token_id": eos, "dtype": np.dtype(dtype).name,
            "tokenizer_sha256": tokenizer_hash(out),
            "train_tokens": int(train.size), "heldout_tokens": int(heldout.size),
            "bytes_per_token": round(s["train_bytes"] / max(train.size, 1), 3),
            "heldout_fraction": heldout_fraction, "max_bytes": max_bytes, "compressed": compress}
    (out / "corpus.json").write_text(json.dumps(meta, indent=2))
    return meta


def tokenizer_hash(folder: Path) -> str:
    """What ties token ids to the tokenizer that made them: a hash of its tokenizer.json
    (the corpus keeps a copy; a target trained on it exports that copy)."""
    return hashlib.sha256((Path(folder) / "tokenizer.json").read_bytes()).hexdigest()[:16]


def file_hash(path: str | Path) -> str:
    """A hash of a file's bytes (a resumed run checks that its training file is the same)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()[:16]


@dataclass
class TokenData:
    """A tokenized corpus folder, as written by `write_corpus`."""

    path: Path
    meta: dict
    train: np.ndarray
    heldout: np.ndarray

    @property
    def sizes(self) -> str:
        """Its splits' token counts: a resumed run refuses a corpus re-made from other text."""
        return f"{self.train.size}+{self.heldout.size}"


# What reading a damaged or foreign .npy / .npz raises (EOFError: an empty file)
NPY_ERRORS = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error)


def npy_error(e: Exception) -> str:
    """One line on why a numpy file could not be read (numpy's messages can be several
    lines, or suggest unpickling)."""
    if isinstance(e, EOFError):
        return "empty file"
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    if isinstance(e, KeyError):  # NpzFile: "ids is not a file in the archive"
        return f"no array '{str(e.args[0]).split()[0]}'" if e.args else "an array is missing"
    text = str(e)
    if "pickle" in text:  # not the numpy format, so numpy tried it as a pickle
        return "not a numpy array file"
    return text.splitlines()[0] if text else type(e).__name__


def _load_ids(folder: Path, split: str) -> np.ndarray:
    """One split's ids; a damaged or foreign file is a one-line error naming it."""
    path = folder / f"{split}.npz"
    if not path.exists():
        path = folder / f"{split}.npy"
    try:
        f = np.load(path)
        if isinstance(f, np.lib.npyio.NpzFile):
            with f:
                f = f["ids"]
    except NPY_ERRORS as e:
        raise TreeflashError(f"cannot read {path}: {npy_error(e)}") from None
    if f.ndim != 1 or not np.issubdtype(f.dtype, np.integer):
        raise TreeflashError(f"{path} is not a flat array of token ids ({f.dtype}, shape {f.shape})")
    return f


def load_corpus(data_dir: str | Path) -> TokenData:
    folder = Path(data_dir)
    if not (folder / "train.npy").exists() and not (folder / "train.npz").exists():
        raise UsageError(f"no tokenized corpus in {folder} (train.npy not found; "
                         f"run `treeflash train corpus` first)")
    try:
        meta = json.loads((folder / "corpus.json").read_text())
        vocab = meta.get("vocab_size")
    except (OSError, ValueError, AttributeError) as e:
        raise TreeflashError(f"cannot read {folder / 'corpus.json'}: {e}") from None
    for key in ("vocab_size", "eos_token_id"):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TreeflashError(f"{folder / 'corpus.json'}: '{key}' must be a token count or id, got {value!r} "
                                 f"(write the corpus with treeflash train corpus)")
    if not (folder / "tokenizer.json").exists():
        raise TreeflashError(f"no tokenizer.json in {folder}: a corpus keeps the tokenizer its ids were made "
                             f"with (treeflash train corpus copies it there)")
    recorded = meta.get("tokenizer_sha256")
    if recorded is not None and recorded != tokenizer_hash(folder):
        raise TreeflashError(f"the tokenizer.json in {folder} is not the one its ids were made with "
                             f"(corpus.json records another): put that one back, or re-tokenize the corpus")
    train, heldout = _load_ids(folder, "train"), _load_ids(folder, "heldout")
    if train.size == 0:
        raise TreeflashError(f"empty corpus: the train split in {folder} holds no tokens")
    for split, ids in (("train", train), ("heldout", heldout)):
        if ids.size and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            raise TreeflashError(f"the {split} split in {folder} holds token ids outside its vocabulary "
                                 f"of {vocab} (corpus.json): re-tokenize it")
    return TokenData(folder, meta, train, heldout)


class TokenWindows:
    """Random windows of a flat id array, kept on the training device (a few tens of MB)."""

    def __init__(self, ids: np.ndarray, length: int, device: torch.device, what: str = "corpus"):
        if ids.size < length:
            raise UsageError(f"the {what} has {ids.size} tokens, fewer than one window of {length}; "
                             f"lower the sequence length")
        self.ids = torch.from_numpy(ids.astype(np.int32)).to(device)
        self.length = length
        self.offsets = torch.arange(length, device=device)

    def sample(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        starts = torch.randint(0, self.ids.numel() - self.length + 1, (batch,), generator=gen)
        return self.ids[to_device(starts, self.ids.device)[:, None] + self.offsets].long()


def fixed_windows(ids: np.ndarray, length: int, max_tokens: int) -> torch.Tensor:
    """Non-overlapping windows [N, length] spread evenly over `ids` (held-out evaluation:
    every root is represented, not only the first); one shorter window when `ids` is
    shorter than `length`."""
    if ids.size < 2:
        raise UsageError("the held-out split is empty: use a larger corpus or held-out fraction")
    length = min(length, ids.size)
    n = max(1, min(ids.size // length, max_tokens // length))
    starts = np.linspace(0, ids.size - length, n).astype(np.int64)
    return torch.from_numpy(np.stack([ids[s:s + length] for s in starts]).astype(np.int64))
