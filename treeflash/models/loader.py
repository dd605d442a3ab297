"""Load Hugging Face safetensors checkpoints (single file or sharded with an index;
`checkpoint_files` picks the files as transformers does).

Each parameter names the checkpoint tensors it is made of (merged QKV and gate/up
hold several, MoE experts one per expert) and copies each into its own part; each
rank reads only its own slice of each tensor, so memory per rank is about 1/N of the
weights.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from treeflash.config import ModelConfig
from treeflash.errors import TreeflashError
from treeflash.files import read_json
from treeflash.ops import fp8_blocks


def checkpoint_files(folder: str | Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it. The files are chosen
    as transformers chooses them: `model.safetensors` if present (a stale index next to
    it is ignored), else the shards `model.safetensors.index.json` lists; with neither,
    every *.safetensors file, where a tensor in two files is refused (which copy is
    meant? reading both silently let the later one win)."""
    folder = Path(folder)
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        with _open(single) as st:
            return {name: single for name in st.keys()}
    if index.exists():
        return _indexed_files(folder, index)
    candidates = sorted(f for f in folder.glob("*.safetensors") if f.is_file())  # not a folder, not a FIFO
    if not candidates:
        raise TreeflashError(f"no safetensors weights (model.safetensors) found in {folder}")
    files: dict[str, Path] = {}
    for f in candidates:
        with _open(f) as st:
            for name in st.keys():
                if name in files:
                    raise TreeflashError(f"weight {name} is in both {files[name].name} and {f.name} in {folder}, "
                                         f"which has no model.safetensors.index.json to say which one to read")
                files[name] = f
    return files


_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def stored_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the checkpoint in `folder`, from the files' headers (one
    open per file): what the size checks below compare config.json with."""
    return {name: shape for name, _, shape in _stored(folder)}


def check_sizes(folder: str | Path, config: ModelConfig, shapes: dict, embedding: bool = True) -> None:
    """Refuse, before any layer is built, a config.json that says more layers, or (with
    `embedding`) a larger embedding [vocab, hidden], than the checkpoint in `folder`
    (`shapes`: its `stored_shapes`) holds: one that says a million layers would otherwise
    allocate until memory ran out. (Fewer layers, or any other shape that differs, are
    refused while loading.)"""
    held = 1 + max((int(m.group(1)) for name in shapes if (m := _LAYER_KEY.search(name))), default=-1)
    if config.num_layers > held:
        raise TreeflashError(f"config.json in {folder} says {config.num_layers} layers, but the checkpoint holds "
                             f"{held}")
    key = next((name for name in shapes if name.endswith("embed_tokens.weight")), None) if embedding else None
    if key is not None:
        stored = shapes[key]
        if len(stored) == 2 and (config.vocab_size > stored[0] or config.hidden_size > stored[1]):
            raise TreeflashError(f"config.json in {folder} says vocab_size {config.vocab_size} and hidden_size "
                                 f"{config.hidden_size}, but the checkpoint's {key} is {list(stored)}")


def check_model_size(folder: str | Path, shell: nn.Module, shapes: dict) -> None:
    """Refuse a config.json whose model (`shell`, built on the meta device: no memory)
    has far more parameters than the checkpoint in `folder` (`shapes`: its
    `stored_shapes`) holds, before the real one is built: an intermediate_size or head
    count of 2^30 would otherwise allocate terabytes (sizes that fit are refused by shape
    while loading). The slack covers what loading legitimately grows: an untied copy of a
    tied head, MXFP4 bytes that hold two weights each."""
    held = sum(torch.Size(shape).numel() for shape in shapes.values())
    wanted = sum(p.numel() for p in shell.parameters())
    if wanted > 2.5 * held + (1 << 20):
        raise TreeflashError(f"config.json in {folder} describes a model of {wanted:,} parameters, but the "
                             f"checkpoint holds {held:,} (does config.json match the weights?)")


SAFETENSORS_FLOATS = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def _stored(folder: str | Path):
    """(name, safetensors dtype, shape) of every tensor of the checkpoint in `folder`,
    from the files' headers (one open per file); a sharded checkpoint's index that lists
    a weight its shard does not hold is refused once they are read (an index out of
    step with its shards, not config.json with the weights)."""
    files = checkpoint_files(folder)
    found = set()
    for path in set(files.values()):
        with _open(path) as st:
            for name in st.keys():
                if files.get(name) == path:
                    found.add(name)
                    piece = _slice(st, name)
                    yield name, piece.get_dtype(), tuple(piece.get_shape())
    if lost := sorted(files.keys() - found):
        raise TreeflashError(f"model.safetensors.index.json in {Path(folder)} lists weight {lost[0]} in "
                             f"{files[lost[0]].name}, which does not hold it")


def weights_dtype(folder: str | Path) -> str | None:
    """The floating dtype that most of a checkpoint's weights (by elements) are stored
    in: what dtype "auto" means when config.json does not say (as in transformers)."""
    sizes: dict[str, int] = {}
    for _, dtype, shape in _stored(folder):
        if dtype in SAFETENSORS_FLOATS:
            kind = SAFETENSORS_FLOATS[dtype]
            sizes[kind] = sizes.get(kind, 0) + max(1, torch.Size(shape).numel())
    return max(sizes, key=sizes.get) if sizes else None


def stored_unquantized(folder: str | Path) -> frozenset[str]:
    """The `*.weight` tensors that the FP8 checkpoint in `folder` stores in a float dtype
    (not float8): the layers it left unquantized (`ModelConfig.fp8_skip`)."""
    return frozenset(name for name, dtype, _ in _stored(folder)
                     if name.endswith(".weight") and dtype in SAFETENSORS_FLOATS)


def _indexed_files(folder: Path, index: Path) -> dict[str, Path]:
    try:
        weight_map = read_json(index)["weight_map"]
    except (KeyError, TypeError) as e:
        raise TreeflashError(f"malformed {index}: no weight_map ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise TreeflashError(f"malformed {index}: weight_map must map tensor names to file names")
    files = {name: folder / f for name, f in weight_map.items()}
    checked: set[Path] = set()
    for name, f in files.items():
        if f in checked:
            continue
        if not f.exists():
            raise TreeflashError(f"checkpoint shard {f.name} listed in {index.name} (for weight {name}) "
                                 f"is missing from {folder}")
        # "" or "." name the folder itself: exists(), but not a file to read
        if not f.is_file():
            raise TreeflashError(f"{index.name} in {folder} lists {weight_map[name]!r} as the file of weight "
                                 f"{name}, which is not a safetensors file")
        checked.add(f)
    return files


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises several error types for bad headers
        raise TreeflashError(f"cannot read {path}: {e}") from None


def _pieces(model: nn.Module, name: str, param: torch.Tensor) -> tuple[list[tuple], object]:
    """The checkpoint tensors making up parameter `name`: (key, the part of `param` it
    fills, the dim the ranks slice it along), and the TP group of the owning module."""
    module_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(module_name) if module_name else model
    tp = getattr(owner, "tp", None)
    if hasattr(owner, "checkpoint_pieces"):  # e.g. MoE experts: one tensor per expert
        return [(model.checkpoint_key(f"{module_name}.{key}"), dest, dim)
                for key, dest, dim in owner.checkpoint_pieces(leaf)], tp
    prefix, _, local = module_name.rpartition(".")
    merged = getattr(model, "merged_weights", {}).get(local)
    keys = [f"{prefix}.{m}.{leaf}" if prefix else f"{m}.{leaf}" for m in merged] if merged else [name]
    shard_dim = getattr(owner, "shard_dim", None)
    if shard_dim == 1 and param.dim() == 1:
        shard_dim = None  # a row-parallel bias is added once, after the all-reduce
    dests = param.split(owner.parts_of(leaf) if hasattr(owner, "parts_of") else owner.parts) if len(keys) > 1 \
        else [param]
    return [(model.checkpoint_key(k), d, shard_dim) for k, d in zip(keys, dests)], tp


# safetensors dtype names of the weights we can load; integer or float8 tensors are
# quantized data that a plain cast would silently turn into garbage (float8 goes only
# into the FP8 weights of an FP8 checkpoint's layers, as it is).
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
FP8 = "F8_E4M3"


def _slice(st, key: str):
    try:
        return st.get_slice(key)
    except Exception as e:  # e.g. an index naming the wrong shard for this tensor
        raise TreeflashError(f"cannot read weight {key}: {e}") from None


def _read_slice(st, key: str, full_shape: tuple, shard_dim: int | None, rank: int, size: int,
                fp8: bool = False) -> torch.Tensor:
    sl = _slice(st, key)
    shape = tuple(sl.get_shape())
    if shape != full_shape:
        raise TreeflashError(f"weight {key} has shape {list(shape)}, expected {list(full_shape)}")
    if fp8 and sl.get_dtype() != FP8:
        raise TreeflashError(f"weight {key} has dtype {sl.get_dtype()}: an FP8 checkpoint's layers hold {FP8} "
                             f"or a float dtype")
    if not fp8 and sl.get_dtype() not in FLOAT_DTYPES:
        raise TreeflashError(f"weight {key} has dtype {sl.get_dtype()}; only float16, bfloat16, float32 "
                             f"and float64 weights are supported here (quantized weights only where "
                             f"config.json's quantization_config says: block-scaled FP8)")
    if shard_dim is None or size == 1:
        return sl[:]
    n = full_shape[shard_dim] // size
    lo, hi = rank * n, (rank + 1) * n
    return sl[lo:hi] if shard_dim == 0 else sl[:, lo:hi]


def _read_piece(st, key: str, dest: torch.Tensor, shard_dim: int | None, tp, stored_fp8: bool | None = None
                ) -> torch.Tensor:
    """This rank's slice of checkpoint tensor `key`, the shape of `dest` (stored in FP8
    where `dest` is FP8, unless `stored_fp8` says otherwise)."""
    rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
    full = list(dest.shape)
    if shard_dim is not None and size > 1:
        full[shard_dim] *= size
    fp8 = dest.dtype == torch.float8_e4m3fn if stored_fp8 is None else stored_fp8
    return _read_slice(st, key, tuple(full), shard_dim, rank, size, fp8=fp8)


def load_weights(model: nn.Module, folder: str | Path, quantize: bool = False) -> None:
    """Fill every parameter of `model` from the checkpoint in `folder`, and refuse a
    checkpoint with tensors the model has no place for: a config.json that says fewer
    layers than the weights hold would otherwise run a different model.

    `quantize`: the model's FP8 weights come from a checkpoint in higher precision, each
    tensor (this rank's slice of it) quantized to blocks as it is read, its scales made
    alongside (vLLM's `--quantization fp8`, with DeepSeek-V3's blocks)."""
    files = checkpoint_files(folder)
    # a tensor the checkpoint may store under another name (tied embeddings saved only
    # as lm_head.weight, which transformers loads and ties)
    aliases = getattr(model, "checkpoint_aliases", {})
    params = dict(model.named_parameters())
    used: set[str] = set()
    handles: dict[Path, object] = {}

    def handle(key: str):
        """The open file holding `key` (its stored name: an alias if only that exists)."""
        if key not in files and aliases.get(key) in files:
            key = aliases[key]
        if key not in files:
            raise TreeflashError(f"weight {key} is missing from the checkpoint in {folder}")
        used.add(key)
        if files[key] not in handles:
            handles[files[key]] = _open(files[key])
        return handles[files[key]], key

    try:
        for name, param in params.items():
            module_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(module_name)
            if hasattr(owner, "read_checkpoint"):  # a layout that is more than slices (gpt-oss experts)
                def read(key: str, required: bool, prefix=f"{module_name}."):
                    if not required and prefix + key not in files:
                        return None
                    return _read_whole(*handle(prefix + key))
                with torch.no_grad():
                    param.copy_(owner.read_checkpoint(leaf, read, module_name))
                _check_finite(param, name, folder)
                handles.clear()
                continue
            online = quantize and param.dtype == torch.float8_e4m3fn
            if quantize and name.endswith("_scale_inv"):
                continue   # made with its weight
            pieces, tp = _pieces(model, name, param)
            scales = [s for _, s, _ in _pieces(model, name + "_scale_inv", params[name + "_scale_inv"])[0]] \
                if online else [None] * len(pieces)
            for (key, dest, shard_dim), scale in zip(pieces, scales):
                st, key = handle(key)
                with torch.no_grad():
                    value = _read_piece(st, key, dest, shard_dim, tp, stored_fp8=False if online else None)
                    if online:
                        block = owner.block
                        value, blocks = fp8_blocks(value.to(dest.device), block)
                        scale.copy_(blocks)
                    dest.copy_(value)
                _check_finite(dest, key, folder)
            # Unmap the files after every parameter: pages a read touched stay resident (and
            # counted in RSS) while mapped, and a row-parallel slice touches the whole tensor.
            handles.clear()
        _check_unused(model, folder, files, used)
    finally:
        handles.clear()


def _read_whole(st, key: str) -> torch.Tensor:
    try:
        return st.get_tensor(key)
    except Exception as e:
        raise TreeflashError(f"cannot read weight {key}: {e}") from None


def _check_finite(dest: torch.Tensor, key: str, folder) -> None:
    """NaN weights decode as a normal early stop (NaN logits pick token 0), and a float32
    value past the float16 range becomes inf in the cast. Through the extremes (NaN
    propagates): no bool copy of a GB-sized slab."""
    if dest.dtype == torch.float8_e4m3fn:  # no infinity; NaN is every bit of 0x7f set
        bad = dest.numel() and bool(((dest.view(torch.uint8) & 0x7F) == 0x7F).any())
    else:
        bad = dest.numel() and not all(torch.isfinite(x) for x in torch.aminmax(dest))
    if bad:
        raise TreeflashError(f"weight {key} in {folder} holds NaN or infinite values "
                             f"(a corrupt checkpoint, or values too large for {dest.dtype})")


def _check_unused(model: nn.Module, folder, files: dict[str, Path], used: set[str]) -> None:
    """Tensors of the checkpoint that no parameter read. Rotary inverse frequencies (old
    checkpoints store them) are recomputed; tensors the model says belong to another
    (a drafter's copy of its target's embeddings) are skipped; a parameter loaded from
    another key (tied: the LM head from the embeddings) may also be stored under its own
    name, if equal."""
    skip = getattr(model, "foreign_checkpoint_keys", ())
    unused = sorted(k for k in files if k not in used and not k.endswith("rotary_emb.inv_freq")
                    and k.rpartition(".")[0].rpartition(".")[2] not in skip)  # the module's own name
    params = dict(model.named_parameters())
    for name in [k for k in unused if k in params]:
        pieces, tp = _pieces(model, name, params[name])
        (key, dest, shard_dim), = pieces  # a parameter named as a checkpoint key has one piece
        with _open(files[name]) as st:
            stored = _read_piece(st, name, dest, shard_dim, tp)
        if not torch.equal(stored.to(dest.dtype), dest.detach()):
            raise TreeflashError(f"config.json in {folder} ties {name} to {key} (tie_word_embeddings), but "
                                 f"the checkpoint's {name} differs from it: set tie_word_embeddings to false")
        unused.remove(name)
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise TreeflashError(f"the checkpoint in {folder} has tensors this config.json has no place for: "
                             f"{', '.join(unused[:3])}{more} (does config.json match the weights?)")


@contextmanager
def build_on(device: torch.device | str, dtype: torch.dtype):
    """Create modules directly on `device` in `dtype` (no float32 copy on the host).
    torch's default dtype is process-wide: while this runs, tensors that another thread
    makes without a dtype get `dtype` too (an engine loads on the thread that calls
    `LLM`; the server loads before it serves)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)
