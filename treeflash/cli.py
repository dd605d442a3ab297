"""The `treeflash` command line: generate, serve, bench, train."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from treeflash import __version__
from treeflash.errors import TreeflashError, UsageError, debugging, shown
from treeflash.files import model_folder, read_text

# what generate and bench read from --prompt-file (`read_placed_prompts`)
PROMPT_FILE_HELP = ("one prompt per line (every \\n is a newline: a prompt that holds a backslash-n goes in a JSON "
                    "file; empty lines skipped), or a .jsonl / .json file of "
                    "objects with a 'prompt' field, one per line (or a .json array of prompts); - reads standard input")
PROMPT_FORMAT_HELP = ("how --prompt-file is read: auto (default) by its name (.jsonl, .json, .ndjson, .jsonlines: "
                      "JSON; else, "
                      "and standard input, text), text (a prompt per line), or json (a JSON array or object, or JSON "
                      "lines)")
PROMPT_FORMATS = ("auto", "text", "json")


class _Parser(argparse.ArgumentParser):
    """Errors in one line (exit code 2); flags spelled out, as vLLM's parser takes them:
    argparse's abbreviations read `generate --prompt "..."` as --prompt-file."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(message)


def _jsonl_prompt(line: str, where: str) -> tuple[str, list[str]]:
    """A line's prompt, and its other fields: not read (the command's flags apply to every
    prompt, whatever settings a saved request body holds), and the command says so."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise UsageError(f"{where}: malformed JSON line: {e}") from None
    except RecursionError:
        raise UsageError(f"{where}: malformed JSON line: nested too deeply") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: a JSONL line must be an object with a string 'prompt'")
    return _object_prompt(obj, where)


def _object_prompt(obj: dict, where: str) -> tuple[str, list[str]]:
    if not isinstance(obj.get("prompt"), str):
        raise UsageError(f"{where}: the object has no string 'prompt'")
    return obj["prompt"], [k for k in obj if k != "prompt"]


def _prompt_file_text(source: str) -> str:
    """A prompt file's text; "-" is standard input (`... | treeflash generate --prompt-file -`),
    read as a file is (UTF-8, newlines as "\n")."""
    if source != "-":
        return read_text(source)
    # as an unreadable file is (exit status 1)
    if sys.stdin is None:  # started with standard input closed (cron, a service)
        raise TreeflashError("cannot read standard input: it is closed")
    try:
        return sys.stdin.buffer.read().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError as e:
        raise TreeflashError(f"cannot read standard input: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TreeflashError(f"cannot read standard input: {e.strerror or e}") from None


def check_prompt_format(prompt_file: str | None, prompt_format: str) -> None:
    if prompt_format != "auto" and not prompt_file:
        raise UsageError("--prompt-format says how --prompt-file is read: give --prompt-file")


def read_placed_prompts(prompt: str | None, prompt_file: str | None,
                        prompt_format: str = "auto") -> list[tuple[str, str | None]]:
    """The prompts, each with its place ("FILE:LINE", "FILE[i]") for errors, None for the argument."""
    if prompt is not None and prompt_file:
        raise UsageError("give a PROMPT or --prompt-file, not both")
    check_prompt_format(prompt_file, prompt_format)
    if prompt is not None:
        return [(prompt, None)]
    if not prompt_file:
        raise UsageError("no prompt: give a PROMPT or --prompt-file FILE")
    # a byte-order mark (some editors write one) is not part of the first prompt
    text = _prompt_file_text(prompt_file).removeprefix("\ufeff")
    name = "stdin" if prompt_file == "-" else prompt_file
    suffix, auto = str(prompt_file).lower(), prompt_format == "auto"
    document = _json_document(text) if prompt_format == "json" or auto and suffix.endswith(".json") else None
    if document is not None:
        prompts, ignored = _json_document_prompts(document, name)
    else:
        # .jsonl, .json, .ndjson, .jsonlines (any case): one object per line; else plain text, where a
        # line starting "{" is a prompt too (a note says so when every line looks like a JSONL line)
        jsonl = prompt_format == "json" or auto and suffix.endswith((".jsonl", ".json", ".ndjson", ".jsonlines"))
        prompts, ignored = _line_prompts(text, name, jsonl, note=auto)
    if not prompts:
        raise UsageError(f"prompt file {name} holds no prompt")
    if ignored:
        named = ", ".join(shown(k, 40) for k in ignored[:10])
        named += f" and {len(ignored) - 10} more" if len(ignored) > 10 else ""
        print(f"treeflash: note: prompts of {name} hold {named}, which are not read: only 'prompt' is, "
              f"and the command's flags apply to every prompt", file=sys.stderr)
    return prompts


def _line_prompts(text: str, name: str, jsonl: bool, note: bool = True) -> tuple[list[tuple[str, str]], list[str]]:
    """One prompt a non-blank line (a JSON object's 'prompt' if jsonl), and the other
    fields the objects hold. Lines end at line feeds only (the text's line ends are made
    line feeds): a form feed in code, or U+2028 in a JSON string, is part of its line.
    `note`: say so where text lines all look like JSON ones (not when text was asked for)."""
    prompts, ignored = [], []
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if jsonl:
            prompt, settings = _jsonl_prompt(line, f"{name}:{i}")
            prompts.append((prompt, f"{name}:{i}"))
            ignored += [k for k in settings if k not in ignored]
        else:
            prompts.append((line.replace("\\n", "\n"), f"{name}:{i}"))
    if note and prompts and not jsonl and all(_looks_like_jsonl(line) for line in lines if line.strip()):
        print(f"treeflash: note: {name} is read as plain text, one prompt per line, though its lines "
              f"look like JSON objects with a 'prompt': --prompt-format json reads them as such", file=sys.stderr)
    return prompts, ignored


def _json_document(text: str):
    """A .json file's one JSON value, if it holds one (an array of prompts, or one object
    across lines); None if not, to read it as an object per line."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _json_document_prompts(document, name: str) -> tuple[list[tuple[str, str]], list[str]]:
    """The prompts of a .json file's one value, an array of strings or of objects with a
    'prompt' (or one such object), and the objects' other fields (not read, as in a JSONL
    file)."""
    if isinstance(document, dict):
        prompt, ignored = _object_prompt(document, name)
        return [(prompt, name)], ignored
    if not isinstance(document, list):
        raise UsageError(f"{name}: a JSON prompt document must hold an array of prompts or objects with a "
                         f"'prompt'")
    prompts, ignored = [], []
    for i, item in enumerate(document):
        prompt, settings = _object_prompt(item, f"{name}[{i}]") if isinstance(item, dict) else (item, [])
        if not isinstance(prompt, str):
            raise UsageError(f"{name}[{i}]: a prompt must be a string or an object with a string 'prompt'")
        prompts.append((prompt, f"{name}[{i}]"))
        ignored += [k for k in settings if k not in ignored]
    return prompts, ignored


def _looks_like_jsonl(line: str) -> bool:
    try:
        _jsonl_prompt(line, "")
        return True
    except UsageError:
        return False


def target_folder(args) -> Path:
    """The target checkpoint folder a command's --model names (the built-in one if none)."""
    from treeflash.engine.options import builtin_paths
    return Path(args.model) if args.model else builtin_paths()[0]


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target checkpoint folder, or a hub id in the Hugging Face cache (default: the "
                                   "built-in model)")
    p.add_argument("--draft-model", help="DFlash drafter checkpoint folder (default with the built-in model: its drafter)")
    p.add_argument("--method", choices=["ar", "dflash", "ddtree"],
                   help="decoding method (default: ddtree with a drafter, else ar)")
    p.add_argument("--budget", type=int, help="DDTree nodes per round (default 63 on a GPU, 16 on a CPU)")
    p.add_argument("--max-budget", type=int, default=512, help="the largest --budget accepted (default 512)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", help="auto (the default: the checkpoint's, float32 for a 16-bit one "
                                                   "on a CPU), float32, bfloat16, float16, float64")
    p.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (they are on by default on CUDA)")
    p.add_argument("--draft-mode", choices=["scaled", "coupled"],
                   help="trees at T > 0: temperature-scaled draft, or coupled to the target's noise (default coupled)")
    p.add_argument("--tp", "--tensor-parallel-size", "-tp", type=int, default=1,
                   help="tensor-parallel size: N processes, one per GPU (gloo on CPU); under torchrun, WORLD_SIZE")
    p.add_argument("--quantization", choices=["fp8"],
                   help="fp8: the target's layers in FP8 (128 x 128 blocks), quantized while loading a checkpoint "
                        "in higher precision (an FP8 checkpoint loads as it is)")


_FROM_MODEL = "; left out: the model's generation_config.json value, else "


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, help="tokens to generate at most" + _FROM_MODEL + "128")
    p.add_argument("--temperature", type=float, help="0 = greedy" + _FROM_MODEL + "0")
    p.add_argument("--top-k", type=int, help="0 or -1 = off" + _FROM_MODEL + "off")
    p.add_argument("--top-p", type=float, help="nucleus sampling, in (0, 1]" + _FROM_MODEL + "1")
    p.add_argument("--min-p", type=float, help="keep tokens at least this times as likely as the most likely one "
                                                "(0 = off)" + _FROM_MODEL + "off")
    p.add_argument("--generation-config", default="auto", metavar="auto|none|FOLDER",
                   help="auto (default): options left out take the model's generation_config.json values, as "
                        "LLM.generate, the server and vLLM do; none (vLLM's vllm): greedy, 128 tokens, no filters "
                        "or penalty; a folder: its generation_config.json's")
    p.add_argument("--seed", type=int, help="per-request seed (same seed, same tokens; -1: none, as vLLM's)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--stop-token-id", type=int, action="append", default=[], dest="stop_token_ids",
                   help="token id that ends generation as EOS does (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past EOS (stop tokens and strings still end)")
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS, stop token or stop string before this many")
    p.add_argument("--truncate-prompt-tokens", type=int, metavar="K",
                   help="keep only each prompt's last K tokens (-1: as many as fit the context)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2] (0 = off)")
    p.add_argument("--repetition-penalty", type=float, help="vLLM's, > 0 (1 = off)" + _FROM_MODEL + "off")
    p.add_argument("--bad-word", action="append", dest="bad_words", metavar="WORD",
                   help="never generated (repeatable; vLLM's bad_words)")
    p.add_argument("--logit-bias", type=_logit_bias, metavar="JSON",
                   help='added to those tokens\' logits before sampling, e.g. \'{"50256": -100}\'')
    add_structured_args(p)


def add_structured_args(p) -> None:
    """Structured outputs: the text must match one of these (`structured_from`)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", type=_schema, metavar="JSON|FILE",
                   help="the text is JSON that this schema (inline, or a file's) describes")
    g.add_argument("--regex", help="the text matches this regular expression (whole)")
    g.add_argument("--choice", action="append", help="the text is one of these strings (repeatable)")
    g.add_argument("--grammar", type=_grammar, metavar="EBNF|FILE",
                   help="the text is what this GBNF grammar's root rule derives (inline, or a file's; recursion "
                        "at most 4 deep)")
    g.add_argument("--json-object", action="store_true", help="the text is a JSON object (nesting at most 4 deep)")


def make_llm(args, seed: int | None = None):
    from treeflash import LLM
    if args.method == "ar" and args.draft_model is not None:  # it would load, and draft nothing
        raise UsageError("--draft-model drafts for --method dflash and ddtree: leave it out with --method ar")
    return LLM(args.model, draft_model=args.draft_model, method=args.method, budget=args.budget,
               device=args.device, dtype=args.dtype, max_model_len=args.max_model_len, tp=getattr(args, "tp", 1),
               draft_mode=args.draft_mode, cuda_graphs=not args.eager, max_budget=args.max_budget,
               enable_prefix_caching=getattr(args, "enable_prefix_caching", False), max_batch=args.max_batch,
               quantization=args.quantization, generation_config=getattr(args, "generation_config", "auto"),
               seed=seed)


def sampling_from(args, model_defaults: dict | None = None):
    """The options' SamplingParams; those left out of GENERATION_KEYS take `model_defaults`
    (the model's generation_config.json values) over SamplingParams' own."""
    from treeflash import SamplingParams
    from treeflash.sampling_params import GENERATION_KEYS
    base = SamplingParams(**(model_defaults or {}))
    chosen = {k: getattr(base, k) if getattr(args, k) is None else getattr(args, k) for k in GENERATION_KEYS}
    return SamplingParams(**chosen, seed=args.seed, stop=args.stop,
                          stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos,
                          min_tokens=args.min_tokens, logit_bias=args.logit_bias,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          truncate_prompt_tokens=args.truncate_prompt_tokens,
                          logprobs=getattr(args, "logprobs", None),
                          structured_outputs=structured_from(args), bad_words=args.bad_words).validate()


def model_sampling_defaults(args) -> dict:
    """The model's generation_config.json values for the options left out (with a note
    saying which apply), or none with --generation-config none."""
    from treeflash.sampling_params import SamplingParams, generation_defaults, generation_folder
    folder = generation_folder(args.generation_config, target_folder(args), "--generation-config")
    if folder is None:
        return {}
    got = generation_defaults(folder)
    applied = {k: v for k, v in got.items() if getattr(args, k) is None}
    if (args.temperature if args.temperature is not None else got.get("temperature", 0)) == 0:
        applied = {k: v for k, v in applied.items() if k not in ("top_k", "top_p", "min_p")}  # greedy: moot
    plain = SamplingParams()
    applied = {k: v for k, v in applied.items() if v != getattr(plain, k)}  # (do_sample false: greedy, as without)
    if applied:
        told = ", ".join(f"{k} {v}" for k, v in applied.items())
        whose = "the model's " if args.generation_config == "auto" else f"{folder}/"
        print(f"treeflash: note: {told} from {whose}generation_config.json (--generation-config none "
              f"leaves them out)", file=sys.stderr)
    return got


def note_moot_sampling(args, params) -> None:
    """A note when sampling options (or --draft-mode, which shapes sampled trees) were
    given but decoding is greedy (temperature 0, the default where the model sets none):
    vLLM's default temperature is 1, so its users may expect --top-p or --seed alone to
    sample."""
    given = [f"--{k.replace('_', '-')}" for k in ("top_k", "top_p", "min_p", "seed") if getattr(args, k) is not None]
    if args.draft_mode is not None and args.method != "ar":  # with ar it is refused as it loads
        given.append("--draft-mode")
    if params.temperature == 0 and given:
        print(f"treeflash: note: {', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect at "
              f"temperature 0 (greedy decoding): give --temperature to sample", file=sys.stderr)


def structured_from(args):
    if args.json_schema is None and args.regex is None and args.choice is None and args.grammar is None \
            and not args.json_object:
        return None
    from treeflash import StructuredOutputs
    return StructuredOutputs(json=args.json_schema, regex=args.regex, choice=args.choice, grammar=args.grammar,
                             json_object=args.json_object)


def _schema(text: str) -> dict:
    """--json-schema: a JSON object, or the path of a file holding one."""
    return _json_object(text if text.lstrip().startswith("{") else _argument_file(text, "json", "a JSON object"))


def _grammar(text: str) -> str:
    """--grammar: GBNF rules, or the path of a file holding them."""
    return text if "::=" in text else _argument_file(text, "grammar", "GBNF rules (name ::= ...)")


def _argument_file(path: str, kind: str, inline: str) -> str:
    """The text of a file that an option names (a regular file, at most as many bytes as
    a structured output of `kind` may have characters, times 4: a device or a FIFO
    never ends), its error one argparse line that says what else the value could have
    been (`inline`)."""
    from treeflash.structured.grammar import MAX_INPUT_CHARS
    if not path.strip():
        raise argparse.ArgumentTypeError(f"empty: give {inline} or a file holding it")
    try:
        return read_text(path, max_bytes=4 * MAX_INPUT_CHARS[kind])
    except TreeflashError as e:
        missing = not Path(path).exists()
        raise argparse.ArgumentTypeError(f"{e}{f' (nor is it {inline})' if missing else ''}") from None


def _logit_bias(text: str) -> dict[int, float]:
    """--logit-bias: a JSON object of token id -> bias, as OpenAI's logit_bias."""
    from treeflash.sampling_params import token_bias
    try:
        return token_bias(_json_object(text))
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _json_object(text: str) -> dict:
    """A JSON object on the command line (argparse turns the error into one line)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"not a JSON object: {shown(text)}")
    return value


def _json_number(x: float) -> float | None:
    """null for NaN and infinities, which JSON has no numbers for (json.dumps would write
    the bare words NaN / -Infinity, which strict parsers refuse)."""
    return x if math.isfinite(x) else None


def cmd_generate(args) -> int:
    from treeflash.chat import NO_TEMPLATE, ChatFormat, ChatTemplate
    from treeflash.tokenizer import TextStream
    prompts, places = zip(*read_placed_prompts(args.prompt, args.prompt_file, args.prompt_format))
    params = sampling_from(args, model_sampling_defaults(args))
    note_moot_sampling(args, params)
    if params.structured_outputs is not None:  # a pattern's, schema's or grammar's mistake before the model loads
        params.structured_outputs.automaton()
    if params.logprobs is not None and not args.json:
        raise UsageError("--logprobs needs --json (they are printed with the tokens)")
    if args.max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.chat_template_kwargs is not None and not args.chat:
        raise UsageError("--chat-template-kwargs needs --chat")
    folder = target_folder(args)
    if args.chat and ChatTemplate.sources(folder) is None:  # before the model loads
        raise UsageError(f"{folder.resolve()} {NO_TEMPLATE}")
    llm = make_llm(args)
    if args.chat:  # each prompt a user's message, as the chat template renders it
        fmt = ChatFormat(args.chat_template_kwargs)
        prompts = [llm.chat_prompt([{"role": "user", "content": p}], fmt) for p in prompts]

    def encoded(prompt, place):
        try:
            return llm.encode(prompt, truncate=params.truncate_prompt_tokens)
        except UsageError as e:
            raise UsageError(str(e) if place is None else f"{place}: {e}") from None

    # every prompt tokenized and fitted to the context first: one that does not fit, late
    # in a file, stops the command before it has printed anything
    prompts = [encoded(p, place) for p, place in zip(prompts, places)]

    def outputs(on_tokens=None):
        """A file of prompts goes in batches of --max-batch, each printed as it finishes."""
        for i in range(0, len(prompts), args.max_batch):
            yield from llm.generate(prompts[i:i + args.max_batch], params, on_tokens=on_tokens)

    if args.json:
        for out in outputs():
            logprobs = None if out.logprobs is None else [
                {"token_id": e.token_id, "logprob": _json_number(e.logprob), "rank": e.rank,
                 "top": [(t, _json_number(v)) for t, v in e.top]} for e in out.logprobs]
            print(json.dumps({"text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                              "stats": out.stats, **({"logprobs": logprobs} if logprobs is not None else {})}),
                  flush=True)
        return 0
    stream = len(prompts) == 1 and not params.stop
    context = prompts[0] if stream else ()  # its token ids, encoded above
    printed = TextStream(llm.tokenizer, end_ids=llm.rules.end_ids(params), context=context)
    line_open = False  # the streamed text stops mid-line: an interrupt ends the line first

    def on_tokens(_, ids):
        nonlocal line_open
        text = printed.push(ids)
        if text:
            line_open = not text.endswith("\n")
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        for i, out in enumerate(outputs(on_tokens if stream else None)):
            if stream:
                sys.stdout.write(printed.finish(out.text) + "\n")
                line_open = False
            else:
                print(("\n" if i else "") + out.text)
            s = out.stats
            cut = out.finish_reason == "length" and s["new_tokens"] < params.max_new_tokens  # by the context
            print(f"[{s['method']}: {s['new_tokens']} tokens, {s['rounds']} rounds, tau {s['tau']:.2f}, "
                  f"{s['tokens_per_s']} tok/s" + (f", stopped at the context limit of {llm.max_model_len}"
                                                  if cut else "") + "]", file=sys.stderr)
    except KeyboardInterrupt:
        if line_open:  # the shell's prompt and "interrupted" start on a line of their own
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="treeflash", description="Lossless speculative decoding with DFlash drafters "
                                                   "and DDTree verification.")
    parser.add_argument("--version", action="version", version=f"treeflash {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser)
    g = sub.add_parser("generate", help="generate text for one prompt or a file of prompts")
    g.add_argument("prompt", nargs="?", help="the prompt text")
    g.add_argument("--prompt-file", help=PROMPT_FILE_HELP)
    g.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="auto", help=PROMPT_FORMAT_HELP)
    g.add_argument("--json", action="store_true", help="one JSON object per prompt per line")
    g.add_argument("--max-batch", type=int, default=16, help="a prompt file runs in batches of at most this many "
                                                            "prompts, each printed as it finishes (default 16)")
    g.add_argument("--chat", action="store_true", help="each prompt is a user's message, rendered by the "
                                                       "model's chat template (as the server's chat API does)")
    g.add_argument("--chat-template-kwargs", type=_json_object, metavar="JSON",
                   help="with --chat: the template's own variables, e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--logprobs", type=int, metavar="N", help="with --json: each token's log-probability, "
                                                             "its rank in the vocabulary and its N most likely "
                                                             "alternatives' (N <= 20)")
    add_model_args(g)
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)
    from treeflash.bench import add_bench_parser
    from treeflash.server.cli import add_serve_parser
    from treeflash.train.cli import add_train_parser
    add_serve_parser(sub, add_model_args)
    add_train_parser(sub)
    add_bench_parser(sub)
    return parser


# What each command can be asked for instead when it runs out of memory: its own options.
LESS_MEMORY = {
    "generate": "ask for less (a shorter --max-model-len, a smaller --max-batch, shorter prompts)",
    "serve": "ask for less (a shorter --max-model-len, a smaller --max-batch)",
    "bench": "ask for less (smaller --batch-sizes or --budgets, fewer --max-new-tokens)",
    "bench --shape": "ask for less (a smaller --shape, shorter --contexts, smaller --batch-sizes or --budgets, "
                     "a larger --tp)",
    "train": "ask for less (a smaller --batch-size, --seq-len or --new-tokens, a smaller model shape)",
}


def main(argv: list[str] | None = None) -> int:
    debug = debugging()
    args = None
    try:
        args = build_parser().parse_args(argv)
        if not getattr(args, "func", None):
            raise UsageError("no command given (try: treeflash generate --help)")
        if sys.stdout is None and args.command in ("generate", "bench"):  # started with it closed (`>&-`):
            raise TreeflashError("cannot write standard output: it is closed")  # their results go there
        if getattr(args, "model_path", None):  # `treeflash serve MODEL`, as `vllm serve MODEL`
            if args.model not in (None, args.model_path):
                raise UsageError(f"two models given: {args.model_path} and --model {args.model} (give one)")
            args.model = args.model_path
        args.model_id = getattr(args, "model", None)  # as given: a hub id is served under its name
        for name in ("model", "draft_model"):  # a hub id: its Hugging Face cache's copy (`train` resolves its own)
            if getattr(args, name, None):
                setattr(args, name, str(model_folder(getattr(args, name))))
        return args.func(args)
    except UsageError as e:
        print(f"treeflash: error: {e}", file=sys.stderr)
        return 2
    except TreeflashError as e:
        print(f"treeflash: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("treeflash: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`treeflash generate ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    except UnicodeEncodeError as e:  # the text has characters that stdout's encoding lacks
        if debug:
            raise
        print(f"treeflash: error: the output's encoding ({e.encoding}) cannot write the text "
              f"({e.object[e.start:e.end]!a}): set PYTHONIOENCODING=utf-8", file=sys.stderr)
        return 1
    except OSError as e:  # files and folders the command was pointed at (permissions, a file for a folder)
        if debug:
            raise
        print(f"treeflash: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # an engine bug: still one line, unless debugging
        if debug:
            raise
        first = str(e).splitlines()[0] if str(e) else type(e).__name__  # torch appends C++ frames
        # torch's OutOfMemoryError on CUDA; its CPU allocator raises a RuntimeError
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or \
                (isinstance(e, RuntimeError) and "can't allocate memory" in first):
            command = getattr(args, "command", None)
            hint = LESS_MEMORY.get(f"{command} --shape" if getattr(args, "shape", None) else command, "ask for less")
            print(f"treeflash: error: out of memory ({first}): {hint}", file=sys.stderr)
            return 1
        print(f"treeflash: internal error: {type(e).__name__}: {first} (set TREEFLASH_DEBUG=1 for a traceback)",
              file=sys.stderr)
        return 1


def entry() -> None:
    """The `treeflash` command. After tensor-parallel workers ran (now shut down), the
    process leaves with os._exit: torch's process groups and stores, torn down in
    interpreter finalization in no set order, now and then aborted a finished run
    ("terminate called without an active exception", exit -6, CI on CPU)."""
    code = main()
    tp = sys.modules.get("treeflash.engine.tp")
    if tp is not None and tp.shutdown_runtimes():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
