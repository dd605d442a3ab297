"""`treeflash train tokenizer|corpus|target|generate|drafter`.

`add_train_parser(subparsers)` registers `train` on the `treeflash` CLI; every leaf sets
`args.func`, which the CLI calls with the parsed args (errors are `TreeflashError`, bad
arguments `UsageError`). `python -m treeflash.train <command> ...` runs the same commands
without the `train` level.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from treeflash.errors import UsageError
from treeflash.train.common import DEFAULT_OPTIONS, TrainOptions

DESCRIPTION = ("Train a tokenizer and a tokenized corpus of local Python code, a Qwen3-architecture "
               "target LM, and DFlash drafters for any target (see TRAINING.md).")
_SUFFIXES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (powers of 1024): `64M`."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = _SUFFIXES.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if scale > 1 else t) * scale)
    except (ValueError, OverflowError):  # not a number, nan; inf
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 65000000 or 62M)") from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None


def _corpus_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("corpus (Python files of the local installation, or your own text)")
    g.add_argument("--roots", nargs="+", metavar="DIR",
                   help="folders to read files from, in priority order (default: the standard "
                        "library, then site-packages)")
    g.add_argument("--suffixes", nargs="+", default=[".py"], metavar="SUFFIX",
                   help="which files are documents (default .py; e.g. .txt .md, or .jsonl: one document "
                        "per line, its 'text' field)")
    g.add_argument("--heldout-fraction", type=float, default=0.02,
                   help="share of files held out, chosen by a hash of the path (default 0.02)")
    g.add_argument("--max-bytes", type=_size, help="cap on the source bytes read (e.g. 64M)")


def _train_args(p: argparse.ArgumentParser, defaults: dict) -> None:
    """The training flags, with `defaults` for their help. Their argparse default is None
    (unset), so that a resumed run can tell what was given: unset options take the
    defaults in a fresh run, the run's values on resume."""
    g = p.add_argument_group("training (with --resume, unset options keep the run's values)")
    g.add_argument("--run", required=True, metavar="DIR",
                   help="run folder: resumable state, run.json, log.jsonl, loss.png, summary.json")
    g.add_argument("--out", metavar="DIR", help="where to export the checkpoint (default RUN/model)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --run, with its options; only the budget, the intervals, "
                        "--device and the export may change (a drafter's also --tau-prompts / --tau-new-tokens "
                        "and a moved --generated file; TRAINING.md)")
    g.add_argument("--max-steps", type=int, help="stop after this many optimizer steps in total")
    g.add_argument("--max-minutes", type=float, help="stop after this much training time in total")
    for name, kind, text in (
            ("batch_size", int, "sequences per step"), ("seq_len", int, "tokens per sequence"),
            ("lr", float, "peak learning rate"), ("min_lr_ratio", float, "final LR as a fraction of the peak"),
            ("warmup_steps", int, "linear LR warmup steps"), ("weight_decay", float, "AdamW weight decay"),
            ("grad_clip", float, "gradient norm clip (0: off)"), ("eval_every", int, "steps between evaluations"),
            ("eval_tokens", int, "held-out tokens per evaluation"),
            ("save_every", int, "steps between saves of the training state"),
            ("log_every", int, "steps between log lines"), ("seed", int, "random seed")):
        g.add_argument("--" + name.replace("_", "-"), type=kind, help=f"{text} (default {defaults[name]})")
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N (default auto)")
    g.add_argument("--max-shard-mb", type=float, help="largest safetensors file written (default 16)")


def _options(args) -> TrainOptions:
    return TrainOptions(**{k: getattr(args, k) for k in TrainOptions.__dataclass_fields__})


def _shape(cls, args):
    """The shape flags as given (None: unset, i.e. the default or the resumed run's)."""
    return cls(**{k: getattr(args, k, None) for k in cls.__dataclass_fields__})


def _records_tokenizer(corpus_json: Path) -> bool:
    try:
        return "tokenizer_sha256" in json.loads(corpus_json.read_text())
    except (OSError, ValueError, TypeError):
        return False


def run_tokenizer(args) -> int:
    from tokenizers import Tokenizer

    from treeflash.train.common import check_out_dir, refuse_model_folder
    from treeflash.train.corpus import check_out_outside_roots, collect
    from treeflash.train.tokenizer import check_vocab_size, train_tokenizer
    check_vocab_size(args.vocab_size)
    check_out_dir(args.out)
    refuse_model_folder(args.out, "a new tokenizer.json")
    check_out_outside_roots(args.out, args.roots, tuple(args.suffixes))
    existing = Path(args.out) / "corpus.json"
    if existing.exists() and not _records_tokenizer(existing):
        # a corpus that records its tokenizer refuses a new one at load; an older one could not tell
        raise UsageError(f"output folder {args.out} holds a tokenized corpus that does not record its tokenizer: "
                         f"a new tokenizer.json there would silently no longer match its ids; write the "
                         f"tokenizer to another folder (or re-make the corpus after it)")
    corpus = collect(args.roots, args.heldout_fraction, args.max_bytes, tuple(args.suffixes))
    print(f"[tokenizer] training on {corpus.stats['train_files']} files, "
          f"{corpus.stats['train_bytes'] / 1e6:.1f} MB", flush=True)
    out = train_tokenizer(corpus.train, args.out, args.vocab_size)
    size = Tokenizer.from_file(str(out / "tokenizer.json")).get_vocab_size()
    short = f" (asked for {args.vocab_size}: the corpus has fewer merges)" if size < args.vocab_size else ""
    print(f"[tokenizer] vocabulary of {size} written to {out}{short}")
    return 0


def run_corpus(args) -> int:
    from treeflash.train.corpus import write_corpus
    meta = write_corpus(args.tokenizer, args.out, args.roots, args.heldout_fraction, args.max_bytes,
                        args.compress, tuple(args.suffixes))
    print(json.dumps(meta, indent=2))
    if not meta["heldout_tokens"]:  # a corpus, but not one to train on: target and drafter evaluate on it
        print(f"treeflash: note: the held-out split is empty ({meta['train_files']} documents at a held-out "
              f"fraction of {args.heldout_fraction}): training a target or drafter on this corpus needs a "
              f"larger corpus or --heldout-fraction", file=sys.stderr)
    return 0


def run_target(args) -> int:
    from treeflash.train.target import TargetShape, train_target
    train_target(args.data, args.run, args.out, _shape(TargetShape, args), _options(args), args.resume,
                 args.dtype, args.max_shard_mb)
    return 0


def run_generate(args) -> int:
    from treeflash.train.drafter import generate_continuations
    generate_continuations(args.target, args.data, args.out, args.num_prompts, args.prompt_len,
                           args.new_tokens, args.batch_size, args.seed, args.device, args.heldout_prompts)
    return 0


def run_drafter(args) -> int:
    from treeflash.train.drafter import DrafterShape, train_drafter
    train_drafter(args.target, args.data, args.run, args.out, _shape(DrafterShape, args), _options(args),
                  args.resume, args.generated, args.gamma, args.blocks_per_seq, args.dtype,
                  args.tau_prompts, args.tau_new_tokens, args.max_shard_mb)
    return 0


def _add_commands(sub) -> None:
    from treeflash.train.drafter import DRAFTER_OPTIONS

    p = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer on the Python corpus")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for tokenizer.json + tokenizer_config.json")
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary size (default 4096)")
    _corpus_args(p)
    p.set_defaults(func=run_tokenizer)

    p = sub.add_parser("corpus", help="tokenize the Python corpus into train.npy / heldout.npy")
    p.add_argument("--tokenizer", required=True, metavar="DIR",
                   help="folder with tokenizer.json (any target's), or a hub id in the Hugging Face cache")
    p.add_argument("--out", required=True, metavar="DIR", help="corpus folder (also gets a copy of the tokenizer)")
    p.add_argument("--compress", action="store_true",
                   help="store the ids zlib-compressed (.npz): ~2.8x smaller for Python code")
    _corpus_args(p)
    p.set_defaults(func=run_corpus)

    p = sub.add_parser("target", help="train a Qwen3-architecture LM; export a Hugging Face checkpoint")
    p.add_argument("--data", required=True, metavar="DIR", help="tokenized corpus folder (`train corpus`)")
    g = p.add_argument_group("model shape (default: 384 wide, 8 layers, 6x64 heads, 2 KV heads, MLP 1024, tied)")
    for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
        g.add_argument("--" + name.replace("_", "-"), type=int)
    g.add_argument("--rope-theta", type=float, help="RoPE base (default 10000)")
    g.add_argument("--untied", dest="tie_word_embeddings", action="store_false", default=None,
                   help="a separate LM head instead of tied embeddings")
    p.add_argument("--dtype", help="export dtype: bfloat16, float16 or float32 (default bfloat16)")
    _train_args(p, DEFAULT_OPTIONS)
    p.set_defaults(func=run_target)

    p = sub.add_parser("generate", help="greedy target continuations of corpus prompts, for drafter training")
    p.add_argument("--target", required=True, metavar="DIR",
                   help="target checkpoint folder, or a hub id in the Hugging Face cache")
    p.add_argument("--data", required=True, metavar="DIR", help="tokenized corpus folder (prompts)")
    p.add_argument("--out", required=True, metavar="FILE", help="output .npz")
    p.add_argument("--num-prompts", type=int, default=512, help="training prompts (default 512)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default 64)")
    p.add_argument("--new-tokens", type=int, default=448, help="greedy tokens per continuation (default 448)")
    p.add_argument("--heldout-prompts", type=int,
                   help="continuations of held-out prompts, for the drafter's evaluation (default num/32, >= 16)")
    p.add_argument("--batch-size", type=int, default=128, help="prompts per forward (default 128)")
    p.add_argument("--seed", type=int, default=0, help="which corpus prompts are drawn (default 0)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.set_defaults(func=run_generate)

    p = sub.add_parser("drafter", help="train a DFlash drafter for a frozen target")
    p.add_argument("--target", required=True, metavar="DIR",
                   help="target checkpoint folder, or a hub id in the Hugging Face cache")
    p.add_argument("--data", required=True, metavar="DIR",
                   help="tokenized corpus folder, in the target's tokenizer (held-out eval, default training text)")
    p.add_argument("--generated", metavar="FILE", help="train on target-generated sequences (`train generate`)")
    g = p.add_argument_group("drafter shape (default: 2 layers, block 16, published default taps, <|mask|>)")
    g.add_argument("--num-layers", type=int)
    g.add_argument("--block-size", type=int)
    g.add_argument("--target-layer-ids", type=_int_list, metavar="I,J,...", help="target layers to tap")
    g.add_argument("--mask-token-id", type=int)
    p.add_argument("--gamma", type=float, help="slot k's loss weight is exp(-(k-1)/gamma) (default 7)")
    p.add_argument("--blocks-per-seq", type=int, help="anchors drawn per sequence (default 32)")
    p.add_argument("--dtype", help="export dtype (default: the target's)")
    p.add_argument("--tau-prompts", type=int,
                   help="held-out prompts for the final engine τ measurement (0: skip; at most 65536; default 16)")
    p.add_argument("--tau-new-tokens", type=int, help="new tokens per τ prompt (default 128)")
    _train_args(p, {**DEFAULT_OPTIONS, **DRAFTER_OPTIONS,
                    "seq_len": f"{DRAFTER_OPTIONS['seq_len']}, at most the target's context"})
    p.set_defaults(func=run_drafter)


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register `train` and its commands on the `treeflash` CLI's subparsers."""
    p = subparsers.add_parser("train", help="train a tokenizer, a target LM or a DFlash drafter",
                              description=DESCRIPTION)
    _add_commands(p.add_subparsers(dest="train_command", required=True, metavar="COMMAND"))
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m treeflash.train ...` is `treeflash train ...` (same errors, same exit codes)."""
    import sys

    from treeflash.cli import main as treeflash_main
    return treeflash_main(["train", *(sys.argv[1:] if argv is None else argv)])
