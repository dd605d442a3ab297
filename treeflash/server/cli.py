"""`treeflash serve`: load the model pair once, then answer OpenAI API requests."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import replace

from treeflash.errors import UsageError
from treeflash.server.answers import REASONING_PARSERS, TOOL_PARSERS, chat_parsers


def add_serve_parser(subparsers, add_model_args) -> argparse.ArgumentParser:
    s = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                                            "/v1/chat/completions, /v1/models)")
    s.add_argument("model_path", nargs="?", metavar="MODEL", help="the target, as in vLLM's `vllm serve MODEL` "
                                                                   "(the same as --model)")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    s.add_argument("--served-model-name", nargs="+", help="the model names clients may send, the first one in "
                   "responses (default: the model folder's name, treeflash-builtin for the built-in "
                        "pair, and --model as given)")
    s.add_argument("--max-batch", "--max-num-seqs", type=int, default=1,
                   help="prompts generated together when requests queue up (default 1: lowest latency); a batch "
                        "runs until all its requests end: requests that come meanwhile wait for the next one")
    s.add_argument("--api-key", default=os.environ.get("TREEFLASH_API_KEY") or os.environ.get("VLLM_API_KEY"),
                   help="answer /v1 requests only with 'Authorization: Bearer <key>' (default: $TREEFLASH_API_KEY, "
                        "else vLLM's $VLLM_API_KEY; none: no key)")
    s.add_argument("--seed", type=int, dest="engine_seed",
                   help="where the seeds of sampled requests that give none come from, so that a server's answers "
                        "repeat from start to start (default: fresh)")
    s.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                   help="the chat template: a Jinja file, or the template itself (default: the model's own)")
    s.add_argument("--enable-prefix-caching", action="store_true",
                   help="a chat's next turn prefills only its new tokens (the conversation so far stays in the "
                        "caches; see README)")
    s.add_argument("--allowed-origins", nargs="*", default=["*"],
                   help="origins whose browser pages may call the server (CORS; default: any, as vLLM; "
                        "none given: no CORS headers)")
    s.add_argument("--generation-config", default="auto", metavar="auto|none|FOLDER",
                   help="sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty) for requests that "
                        "leave them out: "
                        "auto takes the model's generation_config.json, as vLLM does; none (vLLM's vllm): OpenAI's "
                        "(temperature 1, top_p 1); a folder: its generation_config.json's")
    s.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="chat answers' <think>...</think> as the message's reasoning_content, apart from its "
                        "content (qwen3: when the answer opens the block, as Qwen3's hybrid models; deepseek_r1: "
                        "the prompt opened it, as DeepSeek-R1 and Qwen3-Thinking-2507; openai_gptoss: gpt-oss's "
                        "Harmony answers, analysis channel as reasoning_content, final as content)")
    s.add_argument("--tool-call-parser", choices=TOOL_PARSERS,
                   help="let chat requests carry tools (OpenAI's 'tools', tool_choice 'auto' or 'none'): the "
                        "chat template writes them into the prompt and the answer's calls come back as "
                        "tool_calls (hermes: <tool_call>{...}</tool_call>, as Qwen2.5, Qwen3 and Hermes write them; "
                        "llama3_json: an answer of JSON calls, as Llama 3.1-3.3; openai: gpt-oss's Harmony messages "
                        "to functions.NAME, with --reasoning-parser openai_gptoss, which it implies). A "
                        "tool_choice that forces a call ('required' or a named function) needs no parser: the "
                        "answer is constrained to the calls")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="vLLM's switch for tool_choice 'auto': here --tool-call-parser alone allows it, and this "
                        "flag needs one")
    s.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no line per request on stdout (as vLLM's flag; /health and /metrics are never logged)")
    s.add_argument("--uvicorn-log-level", choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's messages, its access log's included, as vLLM's flag (default: warnings, and "
                        "the access log unless --disable-uvicorn-access-log)")
    s.add_argument("--root-path", default="", help="the path prefix a proxy in front of the server strips "
                                                   "(ASGI's root_path, as vLLM's flag)")
    s.set_defaults(func=cmd_serve)
    return s


@contextlib.contextmanager
def _listening(host: str, port: int):
    """The listening sockets (one per address `host` names, as uvicorn's own bind made them:
    localhost's IPv4 and IPv6, IPv6 ones IPv6-only), made before the model loads: an
    address that cannot be used fails now, not after, and no other process takes the port
    meanwhile (one bound alone is not enough: a second socket with SO_REUSEADDR, as every
    server sets, binds it too). Clients that connect during the load wait in the backlog.
    uvicorn serves on them; they are closed on the way out."""
    if not 1 <= port <= 65535:
        raise UsageError(f"--port must be in 1..65535, got {port}")
    socks = []
    try:
        try:
            addresses = dict.fromkeys((family, address[:2]) for family, _, _, _, address in socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
            for family, address in addresses:
                socks.append(sock := socket.socket(family, socket.SOCK_STREAM))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                sock.listen(2048)  # uvicorn's backlog
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _url(host: str, port: int) -> str:
    """The server's address as a URL (an IPv6 host in brackets)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def warm_up(llm, defaults=None) -> None:
    """Compile the kernels and capture the rounds' CUDA graphs before the first client
    comes, not during its request (a cold Triton cache is many seconds): greedy, sampled,
    sampled with top-p, and what a request that gives no sampling values gets
    (`defaults`, a `SamplingDefaults`: the model's filters are a mode of their own, each
    top-k width one), each for a short request (run for a few rounds: with --eager that
    is what compiles the kernels) and for a chat request without max_tokens, which may
    fill the context (the defaults' bound), ended after its prefill."""
    from treeflash import SamplingParams
    prompt = [llm.eos_token_ids[0] if llm.eos_token_ids else 0]
    room = llm.max_model_len - len(prompt)
    chat_max_tokens = defaults.max_tokens if defaults is not None else None
    modes = [SamplingParams(temperature=t, top_p=p) for t, p in ((0.0, 1.0), (1.0, 1.0), (1.0, 0.9))]
    if defaults is not None:
        modes.append(SamplingParams(temperature=defaults.temperature, top_p=defaults.top_p, top_k=defaults.top_k,
                                    min_p=defaults.min_p, repetition_penalty=defaults.repetition_penalty))
    for mode in modes:
        params = replace(mode, max_new_tokens=4, seed=0, ignore_eos=True)
        llm.generate(prompt, params)
        llm.generate(prompt, replace(params, max_new_tokens=min(chat_max_tokens or room, room)),
                     on_tokens=lambda *_: True)


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from treeflash.server.app import build_app
        from treeflash.chat import ChatTemplate
        from treeflash.server.protocol import SamplingDefaults
        from treeflash.sampling_params import generation_folder
    except ImportError as e:
        raise UsageError(f"treeflash serve needs the server packages ({e.name} is missing): "
                         f"pip install 'treeflash[serve]'") from None
    from treeflash.cli import make_llm, target_folder
    if args.max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise UsageError("--enable-auto-tool-choice needs --tool-call-parser (the format of the answer's calls)")
    args.tool_call_parser, args.reasoning_parser = chat_parsers(args.tool_call_parser, args.reasoning_parser)
    if args.served_model_name and not all(n.strip() for n in args.served_model_name):
        raise UsageError("--served-model-name: a model name cannot be empty (clients send it as \"model\")")
    folder = target_folder(args)
    # a broken template fails here, before the load
    template = ChatTemplate.from_folder(folder) if args.chat_template is None else \
        ChatTemplate.given(args.chat_template, folder)
    for flag, given in (("--tool-call-parser", args.tool_call_parser), ("--reasoning-parser", args.reasoning_parser)):
        if given and template is None:
            raise UsageError(f"{flag} needs a model with a chat template (it acts on chat answers)")
    defaults_from = generation_folder(args.generation_config, folder, "--generation-config")
    defaults = SamplingDefaults.from_folder(defaults_from) if defaults_from else SamplingDefaults()
    if args.model and args.model != args.model_id:  # a hub id, read from its cache: served under the id (vLLM)
        names = args.served_model_name or [args.model_id]
    else:
        names = args.served_model_name or [folder.resolve().name if args.model else "treeflash-builtin",
                                           *([args.model] if args.model else [])]
    name, aliases = names[0], tuple(n for n in dict.fromkeys(names[1:]) if n != names[0])
    with _listening(args.host, args.port) as socks:  # held while the model loads: the port stays ours
        llm = make_llm(args, seed=args.engine_seed)
        warm_up(llm, defaults)
        print(f"treeflash: serving '{name}' ({llm.method}) on {_url(args.host, args.port)}"
              f"{'' if template else ' (no chat template: /v1/completions only)'}", file=sys.stderr, flush=True)
        if defaults != SamplingDefaults():
            print(f"treeflash: requests that leave them out get {defaults.describe()} (generation_config.json; "
                  f"--generation-config none for OpenAI's)", file=sys.stderr, flush=True)
        app = build_app(llm, name, template, args.max_batch, defaults, args.api_key or None, aliases,
                        tuple(args.allowed_origins), args.tool_call_parser, args.reasoning_parser)
        try:
            _run_uvicorn(uvicorn, app, socks, args)
        finally:
            app.state.shutdown()
    return 0


def _not_polling(root_path: str):
    """An access-log filter that leaves out /health and /metrics, which monitors poll (the
    path as logged begins with the root path)."""
    def keep(record) -> bool:
        path = str(record.args[2] if len(record.args) > 2 else "").removeprefix(root_path)
        return not path.startswith(("/health", "/metrics"))
    return keep


def _run_uvicorn(uvicorn, app, socks: list[socket.socket], args) -> None:
    """Serve `app` on `socks` with `uvicorn` (the module) until a signal ends the server."""
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM / Ctrl-C: running and queued requests end now (503)
            if self.should_exit and sig == signal.SIGINT:  # a second Ctrl-C: exit now, as uvicorn does,
                self.force_exit = True  # with no traceback: the signal is not raised again after the first
                # (asyncio's handler), and the lifespan it cuts short is not reported as failed (Starlette's)
                logging.getLogger("uvicorn.error").disabled = True
                return
            # from a thread: this handler interrupts the event loop's thread anywhere, maybe
            # inside a lock that draining takes (the metrics', the queue's)
            threading.Thread(target=app.state.drain, name="treeflash-drain", daemon=True).start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level or "warning",
                            timeout_graceful_shutdown=5, access_log=not args.disable_uvicorn_access_log,
                            root_path=args.root_path)
    if config.access_log:  # one line per API request, as vLLM prints; not uvicorn's other info lines
        access = logging.getLogger("uvicorn.access")
        if args.uvicorn_log_level is None:
            access.setLevel(logging.INFO)
        access.addFilter(_not_polling(args.root_path))
    Server(config).run(sockets=socks)
