"""The OpenAI-compatible HTTP server (ASGI, Starlette): /v1/completions,
/v1/chat/completions (streamed as server-sent events or whole), /v1/models, /health,
/metrics (Prometheus).

The engine is not thread-safe and a request is a tight loop of GPU rounds, so one
`EngineWorker` thread owns the `LLM` and runs the queued requests a batch at a time
(`max_batch` prompts; 1 by default: the lowest latency per request), while the event
loop keeps accepting, validating and streaming. Every failure is answered with an
OpenAI error body and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import replace

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from treeflash import __version__
from treeflash.errors import EngineDeadError, TreeflashError
from treeflash.server.metrics import ServerMetrics
from treeflash.server.answers import chat_parsers, forced_schema_error
from treeflash.server.protocol import (STRUCTURED_KEYS, APIError, Request, SamplingDefaults, checked_id, chunk,
                                      logprobs_body, parse_chat, parse_completion, parse_detokenize, parse_tokenize,
                                      response, unknown_model, usage)
from treeflash.tokenizer import TextStream

_DONE = object()  # end of a streamed job's deltas
MAX_BODY_BYTES = 32 << 20
COMPILE_THREADS = 1  # structured outputs compiled at once: mostly Python, so a second thread would mostly
                     # take the interpreter from the others (a plain request 0.7 s -> 2.7 s behind 8 compiles)
TOKENIZE_THREADS = 2  # /tokenize and /detokenize at once: a few huge ones leave the rest of the API alone
LONG_BODY_BYTES = 1 << 18  # a request body past this (a long prompt: tens of thousands of tokens) is read
LONG_BODY_THREADS = max(2, (os.cpu_count() or 2) // 2)  # on threads of its own (the tokenizer lets go of the
                                                       # GIL), so that they keep no short request waiting
log = logging.getLogger("treeflash.server")


class Cancelled(Exception):
    """The request's client went away: its generation was stopped, or never started."""


def shutting_down() -> APIError:
    """A new one each time: one exception object raised from many tasks would keep
    rewriting its traceback."""
    return APIError("the server is shutting down", status=503, type="server_error")


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error that quotes a client's lone surrogate
    (valid JSON, not UTF-8) still encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


class Job:
    """A request on its way through the worker: a future for its outputs and, when
    streamed, a queue filled from the worker thread with (choice, text delta, logprobs
    body or None, its tokens so far) and (choice, None, None, its tokens) once that choice
    has finished."""

    def __init__(self, req: Request, loop: asyncio.AbstractEventLoop, tokenizer, metrics: ServerMetrics | None = None,
                 end_ids=()):
        self.req, self.loop, self.metrics, self.tokenizer = req, loop, metrics, tokenizer
        self.arrived = time.monotonic()
        self.settled = False    # answered (once, under settle_lock: the worker and a shutdown may race)
        self.settle_lock = threading.Lock()
        self.error: BaseException | None = None  # set when cancelled: what the request is answered
        self.started = False    # tokens have been handed to it (a retry would repeat them)
        self.runs = req.runs()  # (prompt, params) per choice
        self.outputs = [None] * len(self.runs)
        self.future: Future = Future()
        self.deltas: asyncio.Queue | None = asyncio.Queue() if req.stream else None
        self.texts = [TextStream(tokenizer, p.stop, end_ids, p.skip_special_tokens, p.include_stop_str_in_output,
                                 context=prompt, min_tokens=p.min_tokens) for prompt, p in self.runs] \
            if req.stream else None
        self.offsets = [0] * len(self.runs)  # characters of each choice's streamed token texts (text_offset)
        self.generated = [0] * len(self.runs)  # each choice's tokens so far

    @property
    def cancelled(self) -> bool:
        """Its client went away (or the server stops): end it."""
        return self.error is not None

    def cancel(self, error: BaseException | None = None) -> None:
        """End this request at its next round (any thread), answering `error`."""
        self.error = error or Cancelled()

    def on_tokens(self, i: int, ids: list[int], logprobs=None) -> bool:  # worker thread
        """Take choice i's new tokens (and their `TokenLogprob`s, if asked); True ends its
        generation (the client is gone)."""
        if not self.started and self.metrics is not None:
            self.metrics.first_token(time.monotonic() - self.arrived)
        self.started = True
        if self.texts and not self.req.echo_only:  # (echo only: the token generated is not shown)
            self.generated[i] += len(ids)
            delta = self.texts[i].push(ids)
            body = logprobs_body(self.req, logprobs, self.tokenizer, self.offsets[i]) if logprobs else None
            if body is not None and self.req.kind == "completion":
                self.offsets[i] += sum(map(len, body["tokens"]))
            if delta or body is not None:
                self._to_loop((i, delta, body, self.generated[i]))
        return self.cancelled

    def _to_loop(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.deltas.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server is gone, and its client
            self.cancel()

    def on_done(self, i: int, output) -> None:  # worker thread
        if self.req.echo_only:  # the prompt scored, the one token generated for it dropped
            output = replace(output, text="", token_ids=[], logprobs=None if output.logprobs is None else [],
                             finish_reason="length", stop_reason=None)
        self.outputs[i] = output
        if self.deltas is not None:
            self._to_loop((i, None, None, len(output.token_ids)))
        if self.metrics is not None:  # a prompt's tokens count once, however many choices it has
            self.metrics.choice_done(len(self.runs[i][0]) if i % self.req.n == 0 else 0, output)
        if all(o is not None for o in self.outputs):
            if self.cancelled:
                self.settle(error=self.error)
            else:
                self.settle(self.outputs)

    def settle(self, outputs=None, error: BaseException | None = None) -> None:  # worker thread
        with self.settle_lock:
            if self.settled:
                return
            self.settled = True
        if self.metrics is not None:
            outcome = "ok" if error is None else "cancelled" if isinstance(error, Cancelled) else "error"
            self.metrics.request_done(outcome, time.monotonic() - self.arrived)
        try:
            if error is None:
                self.future.set_result(outputs)
            else:
                self.future.set_exception(error)
        except InvalidStateError:  # its waiter cancelled it (the server is shutting down)
            pass
        if self.deltas is not None:
            self._to_loop(_DONE)


class EngineWorker:
    """The thread that owns the `LLM`: takes queued jobs oldest first, up to max_batch
    prompts per `generate` call, and settles each job's future as soon as its prompts
    are done."""

    def __init__(self, llm, max_batch: int = 1, metrics: ServerMetrics | None = None):
        self.llm, self.max_batch = llm, max_batch
        self.metrics = metrics or ServerMetrics()
        self.jobs: queue.Queue = queue.Queue()
        self.running: list[Job] = []
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, name="treeflash-engine", daemon=True)
        self.thread.start()

    def submit(self, req: Request) -> Job:
        job = Job(req, asyncio.get_running_loop(), self.llm.tokenizer, self.metrics, self.llm.rules.end_ids(req.params))
        self.jobs.put(job)
        return job

    def waiting(self) -> int:
        """Queued jobs whose clients are still there (those that left are dropped when reached)."""
        with self.jobs.mutex:
            return sum(job is not None and not job.cancelled for job in self.jobs.queue)

    def in_flight(self) -> int:
        """Requests of the running batch not answered yet (a batch runs on until its last
        request ends, keeping those that ended before it)."""
        return sum(not job.settled for job in self.running)

    def drain(self) -> None:
        """Shutting down (any thread): fail the queued jobs and end the running ones at
        their next round, all answered 503."""
        self.stopping = True
        for job in list(self.running):
            job.cancel(shutting_down())
        self._fail_queued()

    def stop(self, timeout: float = 30.0) -> None:
        """Drain, then wait for the thread: the process must not exit while it is inside
        the engine (a thread in torch at exit aborts the process)."""
        self.drain()
        self.jobs.put(None)
        self.thread.join(timeout)

    def _next_batch(self) -> list[Job] | None:
        """The oldest live job and, up to max_batch prompts, those queued behind it
        (jobs whose client went away while queued are dropped)."""
        batch, prompts = [], 0
        while not batch or prompts < self.max_batch:
            try:
                job = self.jobs.get() if not batch else self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                if self.stopping:
                    self._fail_queued()
                    for job in batch:
                        job.settle(error=shutting_down())
                    return None
                continue
            if job.cancelled or self.stopping:
                job.settle(error=job.error if job.cancelled else shutting_down())
                continue
            batch.append(job)
            prompts += len(job.runs)
        return batch

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.settle(error=shutting_down())

    def _serve(self) -> None:
        while (batch := self._next_batch()) is not None:
            self.running = batch
            self._run(batch)
            self.running = []

    def _run(self, batch: list[Job]) -> None:
        """Generate for `batch`, max_batch prompts at a time (a request whose client left
        ends at its next round; the others go on). If that fails, each job that has not
        received tokens yet runs again alone, so that a failure is its own request's."""
        owners = [(job, i) for job in batch for i in range(len(job.runs))]
        try:
            for start in range(0, len(owners), self.max_batch):
                part = [(job, i) for job, i in owners[start:start + self.max_batch] if not job.cancelled]
                if part:
                    self.llm.generate([job.runs[i][0] for job, i in part], [job.runs[i][1] for job, i in part],
                                      on_tokens=lambda k, *got, part=part: part[k][0].on_tokens(part[k][1], *got),
                                      on_done=lambda k, out, part=part: part[k][0].on_done(part[k][1], out))
        except BaseException as e:
            if isinstance(e, TreeflashError):  # known (a dead rank, a batch too large): its line says it
                log.error("generation failed: %s", e)
            else:
                log.error("generation failed", exc_info=e)
            retry = len(batch) > 1 and not isinstance(e, EngineDeadError)  # a dead engine fails them all
            for job in batch:
                if retry and not (job.started or job.cancelled or job.future.done()):
                    self._run([job])
                else:
                    job.settle(error=job.error if job.cancelled else e)
            return
        for job in batch:  # those whose prompts were skipped: cancelled before their turn
            job.settle(error=job.error)


def api_error(e: BaseException) -> APIError:
    """The answer to an engine failure: a known one is the request's (400), anything else ours (500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, Cancelled):
        return APIError("the request was cancelled: its client went away", status=499, type="server_error")
    if isinstance(e, EngineDeadError):  # not the request's fault: restart the server
        return APIError(f"the engine has failed and serves no more requests: {e}", status=503, type="server_error")
    if isinstance(e, TreeflashError):
        return APIError(str(e))
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return APIError("out of memory while generating: retry with a shorter prompt or fewer tokens",
                        status=503, type="server_error")
    return APIError(f"internal error: {type(e).__name__}: {e}", status=500, type="server_error")


def error_response(e: APIError) -> JSONResponse:
    return AsciiJSONResponse(e.body(), status_code=e.status)


def guarded(handler):
    """`handler`, answering an unexpected exception with a 500 body as a normal response:
    Starlette's handler for Exception answers too, but then re-raises, which logs a
    traceback and drops the client's keep-alive connection."""
    async def run(request: HTTPRequest):
        try:
            return await handler(request)
        except HTTPException:
            raise
        except Exception as e:
            error = api_error(e)
            log.error("%s %s: %s", request.method, request.url.path, error)
            return error_response(error)
    return run


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=True)}\n\n"


async def _read_json(request: HTTPRequest) -> tuple[dict, int]:
    """The body as a JSON object, and its size in bytes; one that says (Content-Length) or
    turns out to be over MAX_BODY_BYTES is refused before more of it is read."""
    too_large = APIError(f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise too_large
            chunks.append(part)
    except ClientDisconnect:
        raise APIError("the client went away while sending the request") from None
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError("the request body is not valid JSON") from None
    except ValueError:  # valid JSON, but an integer longer than Python converts
        raise APIError(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                       f"digits") from None
    except RecursionError:
        raise APIError("the request body nests too deeply") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body, size


async def _disconnected(request: HTTPRequest) -> None:
    """Return when the client disconnects (the body is read already, so the next ASGI
    message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _watch_disconnect(request: HTTPRequest, job: Job) -> None:
    """Mark `job` cancelled when its client disconnects."""
    await _disconnected(request)
    job.cancel()


def build_app(llm, model_name: str, chat_template=None, max_batch: int = 1,
              defaults: SamplingDefaults = SamplingDefaults(), api_key: str | None = None,
              aliases: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ("*",),
              tool_parser: str | None = None, reasoning_parser: str | None = None) -> Starlette:
    """The ASGI app serving `llm` as `model_name` (requests may also name one of
    `aliases`), with `defaults` for the sampling
    parameters a request leaves out; with `api_key`, the /v1 routes answer only requests
    that carry it ("Authorization: Bearer <key>"); browsers' cross-origin requests from
    `allowed_origins` (as vLLM: any by default); with `tool_parser` ('hermes'), chat
    requests may carry tools, and with `reasoning_parser` chat answers' reasoning comes
    back apart (`treeflash.server.answers`; 'openai' implies 'openai_gptoss'). Its worker
    starts with the app's lifespan."""
    tool_parser, reasoning_parser = chat_parsers(tool_parser, reasoning_parser)
    state = {"pools": {}}
    served = (model_name, *aliases)
    created = int(time.time())  # the model cards' time, as vLLM's: when the server took the model
    checking: dict[asyncio.Task, asyncio.AbstractEventLoop] = {}  # requests being read and checked: drain ends them

    def worker() -> EngineWorker:
        if "worker" not in state:  # apps driven without a lifespan (some test clients) start it here
            state["worker"] = EngineWorker(llm, max_batch)
        return state["worker"]

    def pool(name: str, threads: int) -> ThreadPoolExecutor:
        """Threads of their own for slow work that must not stall every client's admission,
        as it would in the pool that reads the requests: a constraint's compile
        ("compile"), tokenizing megabytes for /tokenize ("tokenize") or for a long prompt
        ("long": one that truncate_prompt_tokens cuts is tokenized whole first)."""
        if name not in state["pools"]:
            state["pools"][name] = ThreadPoolExecutor(threads, thread_name_prefix=f"treeflash-{name}")
        return state["pools"][name]

    async def stream(job: Job):
        req = job.req
        try:
            if req.kind == "chat" or req.echo:  # the chat role, or the echoed prompt, first
                for i in range(len(job.runs)):
                    yield _sse(chunk(req, model_name, text=req.echo[i // req.n] if req.echo else None, first=True,
                                     index=i))
            parts = [req.message_stream() for _ in job.runs]
            while (item := await job.deltas.get()) is not _DONE:
                i, delta, logprobs, generated = item
                if delta is None:  # choice i is done: the rest of its text, and why it ended
                    out = job.outputs[i]
                    reasoning, text, calls = parts[i].push(job.texts[i].finish(out.text), final=True)
                    reason = req.finish_reason(out.finish_reason, bool(parts[i].calls))
                    yield _sse(chunk(req, model_name, text=text, index=i, reasoning=reasoning, tool_calls=calls,
                                     finish_reason=reason, stop_reason=out.stop_reason, generated=generated))
                else:
                    reasoning, text, calls = parts[i].push(delta)
                    if reasoning or text or calls or logprobs is not None:
                        yield _sse(chunk(req, model_name, text=text, index=i, logprobs=logprobs,
                                         reasoning=reasoning, tool_calls=calls, generated=generated))
            try:
                outs = job.future.result()
            except BaseException as e:
                yield _sse(api_error(e).body())
            else:
                if req.include_usage:
                    yield _sse(chunk(req, model_name, usage_=usage(req, outs)))
            yield "data: [DONE]\n\n"
        except asyncio.CancelledError:  # the client went away, or the server is shutting down
            pass
        finally:  # also when the response stopped iterating
            job.cancel()

    def unauthorized(request: HTTPRequest) -> JSONResponse | None:
        if api_key is None:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return None
        return error_response(APIError("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                       status=401, type="authentication_error", code="invalid_api_key"))

    def check(req: Request, body: dict) -> None:
        """What only the engine checks (min_tokens against its EOS, bad words and
        structured outputs in its vocabulary, which it compiles; the rest is checked in
        `parse`), before a stream starts."""
        try:
            llm.check_sampling(req.params)
        except TreeflashError as e:
            param = getattr(e, "param", None)
            if param == "structured_outputs":  # named as the request asked for it
                param = next((k for k in (*STRUCTURED_KEYS, "tool_choice") if body.get(k) is not None
                              and not (k == "response_format" and body[k] == {"type": "text"})
                              and not (k == "tool_choice" and body[k] in ("none", "auto"))), param)
            message, forced = str(e), req.params.structured_outputs
            if param == "tool_choice" and forced is not None and isinstance(forced.json, dict):
                message = forced_schema_error(body["tools"], forced.json, message)  # the tool's own terms
            raise APIError(message, param=param or "min_tokens") from None

    async def checked(request: HTTPRequest, parse) -> Request:
        """The request, read and checked. Tokenizing a long prompt, or compiling a
        structured output, takes a while: not on the loop that serves the others."""
        body, size = await _read_json(request)
        loop = asyncio.get_running_loop()
        reader = pool("long", LONG_BODY_THREADS) if size > LONG_BODY_BYTES else None  # None: asyncio's own
        req = await loop.run_in_executor(reader, parse, body)
        if header_id := request.headers.get("x-request-id"):  # vLLM's: the answer's id
            req = replace(req, id=checked_id(header_id, "the X-Request-Id header"))
        if not llm.would_compile(req.params):
            await loop.run_in_executor(reader, check, req, body)
            return req
        # a compile waits its turn, dropped if its client leaves first (one under way ends)
        compiled, gone = loop.run_in_executor(pool("compile", COMPILE_THREADS), check, req, body), \
            asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((compiled, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not compiled.done():
            compiled.cancel()
            raise APIError("the client disconnected while its structured output waited to be compiled", status=499)
        compiled.result()
        return req

    async def serve(request: HTTPRequest, parse) -> JSONResponse | StreamingResponse:
        if (refused := unauthorized(request)) is not None:
            return refused
        task = asyncio.current_task()
        checking[task] = asyncio.get_running_loop()
        try:
            if state.get("closing"):
                raise shutting_down()
            req = await checked(request, parse)
            if state.get("closing"):  # drained while it was checked
                raise shutting_down()
        except APIError as e:
            return error_response(e)
        except asyncio.CancelledError:  # the server is shutting down (`drain`)
            return error_response(shutting_down())
        finally:
            checking.pop(task, None)
        job = worker().submit(req)
        if req.stream:
            return StreamingResponse(stream(job), media_type="text/event-stream")
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        try:
            outs = await asyncio.wrap_future(job.future)
            # n choices' texts and logprobs: built off the loop, as the request was checked
            answer = await asyncio.get_running_loop().run_in_executor(None, response, req, model_name, outs,
                                                                      llm.tokenizer)
        except asyncio.CancelledError:  # the server is shutting down and stops this request's task
            job.cancel(shutting_down())
            return error_response(shutting_down())
        except Exception as e:
            return error_response(api_error(e))
        finally:
            watcher.cancel()
        return AsciiJSONResponse(answer)

    async def completions(request: HTTPRequest):
        return await serve(request, lambda body: parse_completion(body, served, llm.encode, llm.max_model_len,
                                                                  defaults, llm.config.vocab_size,
                                                                  llm.tokenizer.decode))

    async def chat(request: HTTPRequest):
        return await serve(request, lambda body: parse_chat(body, served, chat_template, llm.encode,
                                                            llm.max_model_len, defaults, llm.config.vocab_size,
                                                            tool_parser, reasoning_parser))

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "treeflash",
                "max_model_len": llm.max_model_len}

    async def models(request: HTTPRequest):
        if (refused := unauthorized(request)) is not None:
            return refused
        return AsciiJSONResponse({"object": "list", "data": [model_card(name) for name in served]})

    async def model(request: HTTPRequest):  # OpenAI's retrieve-model route
        if (refused := unauthorized(request)) is not None:
            return refused
        name = request.path_params["name"]
        if name not in served:  # here "" names no model: it is not a request body's null
            return error_response(unknown_model(name, served))
        return AsciiJSONResponse(model_card(name))

    async def health(_):
        """200 while the engine can serve; 503 once it has failed for good (a dead
        tensor-parallel rank), so that a supervisor restarts the server."""
        try:
            llm.check_healthy()
        except EngineDeadError as e:
            return error_response(api_error(e))
        return AsciiJSONResponse({"status": "ok"})

    async def version(_):
        """vLLM's /version: the engine's version, for clients that probe it."""
        return AsciiJSONResponse({"version": __version__})

    def tokenized(body: dict) -> dict:
        ids, strs = parse_tokenize(body, served, chat_template, llm.tokenizer)
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids,
                **({"token_strs": llm.tokenizer.vocab_spellings(ids)} if strs else {})}

    def detokenized(body: dict) -> dict:
        ids = parse_detokenize(body, served, llm.config.vocab_size)
        return {"prompt": llm.tokenizer.decode(ids, skip_special=False)}  # as vLLM: all of them

    async def tokenize(request: HTTPRequest):
        return await answered_off_loop(request, tokenized)

    async def detokenize(request: HTTPRequest):
        return await answered_off_loop(request, detokenized)

    async def answered_off_loop(request: HTTPRequest, answer) -> JSONResponse:
        """answer(body) in a thread of its own: a long text or id list keeps no other
        client waiting, nor do many of them (/tokenize has no length limit, as vLLM's)."""
        try:
            body, _ = await _read_json(request)
            return AsciiJSONResponse(await asyncio.get_running_loop().run_in_executor(
                pool("tokenize", TOKENIZE_THREADS), answer, body))
        except APIError as e:
            return error_response(e)

    async def metrics(_):
        w = worker()
        text = w.metrics.render(running=w.in_flight(), waiting=w.waiting(), graph_captures=llm.graph_captures)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def http_error(_, exc: HTTPException):  # unknown paths, wrong methods: OpenAI bodies too
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        response = error_response(APIError(str(exc.detail), status=exc.status_code, type=kind))
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    async def internal_error(_, exc: Exception):
        return error_response(api_error(exc))

    def shutdown() -> None:
        state["closing"] = True
        for executor in state["pools"].values():
            executor.shutdown(wait=False, cancel_futures=True)
        state["pools"].clear()
        if "worker" in state:
            state.pop("worker").stop()

    def drain() -> None:
        """Shutting down (any thread): requests being checked, queued or generated are
        answered 503, and new ones too."""
        state["closing"] = True
        for task, loop in list(checking.items()):  # those still being checked when the loop gets to it
            loop.call_soon_threadsafe(lambda t=task: t in checking and t.cancel())
        if "worker" in state:
            state["worker"].drain()

    @contextlib.asynccontextmanager
    async def lifespan(_):
        state["closing"] = False  # an app may be started again after a shutdown
        worker()
        yield
        shutdown()

    routes = [Route("/health", guarded(health)), Route("/metrics", guarded(metrics)),
              Route("/version", guarded(version)), Route("/v1/models", guarded(models)),
              Route("/v1/models/{name:path}", guarded(model)),
              Route("/v1/completions", guarded(completions), methods=["POST"]),
              Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
              Route("/tokenize", guarded(tokenize), methods=["POST"]),
              Route("/detokenize", guarded(detokenize), methods=["POST"])]
    cors = Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"], allow_headers=["*"])
    app = Starlette(routes=routes, lifespan=lifespan, middleware=[cors] if allowed_origins else [],
                    exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.shutdown = shutdown  # for a server that ends without its lifespan's end (a forced exit)
    app.state.drain = drain        # for the signal that starts a shutdown
    return app
