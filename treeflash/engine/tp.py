"""Tensor parallelism across processes: starting the ranks, the driver / worker command
loop, failure detection and shutdown (design section 7).

Processes. `LLM(..., tp=N)` makes the calling process rank 0, the *driver*. On one host
it starts the N-1 workers itself (`python -c "...worker_main()"`, a fresh interpreter:
user scripts need no `if __name__ == "__main__"` guard); they connect to a TCPStore the
driver serves. Under `torchrun` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
set; several hosts) every process calls `LLM(...)` alike: rank 0 returns as the driver,
the other ranks serve inside the constructor and exit when the driver shuts down.
Each rank makes its own process group object (ProcessGroupGloo on CPU, ProcessGroupNCCL
on cuda:LOCAL_RANK, with NVLink multicast off unless set: `NO_MULTICAST`), not torch's
default group, so engines of several sizes, or the user's own torch.distributed, can
coexist. A torchrun-launched program that runs its own lock-step code instead of engine
commands (`treeflash bench --shape --tp`) joins such a group with `join_group`.

Commands. The ranks run the same code on the same inputs in lock step. The driver
posts each command to the store (key cmd/<seq>, a pickled tuple: a few hundred bytes
for a round, the prompts for a batch's start, in parts of at most 4 MiB: `put_value`)
and then runs it itself; each worker blocks on the next key, runs the command on
its slice and so meets the driver in the collectives inside. Commands: `build` an
engine (an `LLM` built from the driver's arguments), `call` one of its methods
(`_start`: batch state + prefill; `_step`: one round), `drop` engines (piggybacked on
the next command), `shutdown`. Per round that is one small store message; the rest is
the collectives of the sharded model itself. The driver may be several commands ahead
of a worker (a pipelined round returns before the workers have read its command), so
the driver never deletes a command: the workers do, once all of them have read it
(`Runtime.next_command`). A command deleted early would leave its reader waiting on the
store while the driver's collectives wait for it: a silent hang, not an error.

Failures. A monitor thread in the driver polls its workers. When one dies it records
which rank and why (killed by a signal, exit code, or the one-line error the worker
wrote to the store before exiting), kills the other workers so that no collective waits
on them (a gloo collective then fails at once; the peer all-reduce's kernels see an
abort flag and NCCL communicators are aborted, so that kernels waiting on the dead peer
end), and the driver raises one `EngineDeadError` naming the rank, also when the command
it was in returned normally (its collectives were cut short: the results are garbage).
If the driver is still stuck 30 s later, or once the abort has hung for 8 s (NCCL's
abort never returns once CUDA graphs captured collectives on the communicator, torch
2.11), the monitor prints that line and exits the process. Workers exit when their
parent dies (a watcher thread) or the store goes away; collective and store timeouts
(TREEFLASH_TP_TIMEOUT seconds, default 600) are the backstop. Workers ignore SIGINT:
Ctrl-C interrupts the driver, which then shuts them down. Workers are shut down when the
last engine on them is closed or garbage-collected, and at exit; after a clean shutdown
each rank keeps its NCCL communicator unreleased until it exits (`Runtime.park`).
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import gc
import io
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from treeflash.distributed import TPGroup
from treeflash.errors import EngineDeadError, InStepError, TreeflashError, UsageError, debugging

WORKER_ENV = "TREEFLASH_TP_WORKER"   # set by the driver for the workers it starts
FAULT_ENV = "TREEFLASH_TP_FAULT"     # "<rank>:<command number>": that worker fails there (tests)
GRACE_S = 30.0                        # after a worker died: how long the driver may stay stuck
ABORT_S = 8.0  # NCCL's abort returns within ~2 s, or never (CUDA graphs captured collectives on it)
# NVLink multicast (NVLS) stays off: the machines these run on do not provide it
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def timeout_s() -> float:
    """TREEFLASH_TP_TIMEOUT: seconds a collective or the store may wait (default 600)."""
    text = os.environ.get("TREEFLASH_TP_TIMEOUT", "600")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise UsageError(f"TREEFLASH_TP_TIMEOUT must be a number of seconds > 0, got {text!r}")
    return seconds


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    text = text[0] if text else ""
    if isinstance(e, TreeflashError):
        return text[:400]
    return f"{type(e).__name__}: {text}"[:400] if text else type(e).__name__


COMM_HINTS = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out", "timeout",
               "processgroup", "c10d", "socket")


def is_comm_error(e: BaseException) -> bool:
    """Did `e` come from a collective or the store (a peer died or hung)?"""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return isinstance(e, RuntimeError) and any(h in str(e).lower() for h in COMM_HINTS)


# ----------------------------------------------------------------------------- store values

PART_BYTES = 4 << 20  # torch's TCP store server refuses a message over 8 MiB and drops the client


class CommandPickler(pickle.Pickler):
    """Pickles the driver's commands. A value of a class that the driver's script defines
    (its `__main__`; a worker's is not the script) goes as the built-in type it derives
    from: a `str` enum member as a choice, a dict subclass as a JSON schema (the workers
    could not unpickle it, died of it, and the engine with them). Any other object of
    such a class is refused in one line before anything is sent."""

    PLAIN = {str: str.__str__, int: int.__int__, float: float.__float__, bytes: bytes.__bytes__,
             tuple: tuple, list: list, dict: dict, set: set, frozenset: frozenset}

    def reducer_override(self, obj):  # not called for None, bools and exact built-in values
        cls = type(obj)
        if cls.__module__ != "__main__":
            return NotImplemented
        for base, plain in self.PLAIN.items():
            if isinstance(obj, base):
                return base, (plain(obj),)
        raise UsageError(f"{cls.__name__} objects cannot be sent to the tensor-parallel workers: the class is "
                         f"defined in the script (__main__), which they do not run; pass plain values")


def command_bytes(command: tuple) -> bytes:
    out = io.BytesIO()
    CommandPickler(out).dump(command)
    return out.getvalue()


def put_value(store, key: str, data: bytes) -> None:
    """Store `data` under `key` in parts of at most PART_BYTES (a batch of long prompts is
    tens of MB): the parts first, under key#1, key#2, ..., then `key` itself (the part
    count and the first part), so that a reader waiting on `key` finds every part."""
    parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
    for i in range(1, len(parts)):
        store.set(f"{key}#{i}", parts[i])
    store.set(key, len(parts).to_bytes(4, "little") + parts[0])


def read_value(store, key: str) -> tuple[bytes, list[str]]:
    """The bytes `put_value` stored under `key` (waiting for it), and the keys that hold
    them, for whoever deletes them."""
    head = store.get(key)
    keys = [key] + [f"{key}#{i}" for i in range(1, int.from_bytes(head[:4], "little"))]
    return head[4:] + b"".join(store.get(k) for k in keys[1:]), keys


def delete_keys(store, keys: list[str]) -> None:
    for k in keys:
        store.delete_key(k)


# ----------------------------------------------------------------------------- checks

def check_shardable(config, draft_config, size: int) -> None:
    """Raise the one-line error of the first head / vocabulary / feature count that does
    not divide by `size`, before any process is started (modules built on 'meta')."""
    from treeflash.models.dflash import DFlashDraftModel
    from treeflash.models.transformer import CausalLM
    group = TPGroup(0, size)
    with torch.device("meta"):
        CausalLM(config, group)
        if draft_config is not None:
            DFlashDraftModel(draft_config, group)


# ----------------------------------------------------------------------------- handles

class Single:
    """TP = 1: this process is the whole group; commands run in place."""

    rank, size, group, closed = 0, 1, TPGroup(), False

    def __init__(self, device: torch.device):
        self.device = device

    def call(self, obj, name: str, args=(), collect: bool = False):
        if self.closed:  # as at TP > 1: its caches and graphs are gone (checked every round)
            raise closed_error()
        out = getattr(obj, name)(*args)
        return [out] if collect else out

    def built(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def check(self) -> None:
        if self.closed:
            raise closed_error()


def closed_error() -> EngineDeadError:
    return EngineDeadError("this LLM has been closed; create a new one")


class WorkerEngine(Single):
    """What an `LLM` built inside a worker sees: its rank's group and device (it loads
    and closes as a single process does; the driver runs the commands)."""

    def __init__(self, rt: "Runtime"):
        self.rank, self.size, self.group, self.device = rt.rank, rt.size, rt.group, rt.device

    def call(self, obj, name: str, args=(), collect: bool = False):
        raise AssertionError("commands are run by the driver")


class Engine:
    """The driver's handle on one `LLM` built on every rank of a runtime."""

    def __init__(self, rt: "Runtime", eid: int, build_seq: int):
        self.rt, self.eid, self.build_seq = rt, eid, build_seq
        self.rank, self.size, self.group, self.device = 0, rt.size, rt.group, rt.device
        self.pending_build = True

    def call(self, obj, name: str, args=(), collect: bool = False):
        return self.rt.call(self.eid, obj, name, args, collect)

    def check(self) -> None:
        """Raise EngineDeadError if the ranks can serve no more, or this LLM was closed."""
        self.rt.check()
        if self.eid not in self.rt.engines:  # the workers have dropped it
            raise closed_error()

    def built(self) -> None:
        """Wait for the workers' slices; raise the first worker's load error."""
        self.pending_build = False
        for r, err in enumerate(self.rt.replies(self.build_seq), 1):
            if err is not None:
                raise TreeflashError(f"tensor-parallel worker rank {r} could not build the model: {err}")

    def close(self) -> None:
        rt = self.rt
        if self.pending_build and not rt.closed and rt.failure is None:
            self.pending_build = False
            try:
                rt.replies(self.build_seq)  # let the workers finish building before they drop it
            except BaseException:
                pass
        rt.drop(self.eid)


# ----------------------------------------------------------------------------- the runtime

_RUNTIMES: dict[tuple[int, str], "Runtime"] = {}
_started_any = False  # whether this process ever started a runtime (closed ones count too)


def attach(size: int, device: torch.device, kwargs: dict, config, draft_config, worker: "Runtime | None" = None):
    """The tensor-parallel handle an `LLM` is built with: rank, size, group, device, and
    `call` to run one of its methods on every rank. Starts the workers if needed and
    posts the build of this engine to them (they load while the driver loads)."""
    global _started_any
    if worker is not None:  # a worker building its shard of the driver's engine
        return WorkerEngine(worker)
    if size == 1:
        return Single(device)
    check_shardable(config, draft_config, size)
    key = (size, device.type)
    rt = _RUNTIMES.get(key)
    live = rt is not None and not rt.closed and rt.failure is None
    if not live and _started_any and torchrun_env() is not None:  # one group per launch: its store keys
        raise UsageError("under torchrun the other ranks exit when the last LLM on them closes or a rank fails: "
                         "build the next LLM before closing the last one (or launch again)")
    if not live:
        rt = start(size, device)
        _RUNTIMES[key] = rt
        _started_any = True
    return rt.new_engine(kwargs)


UNSET_LAUNCH = "unset RANK and WORLD_SIZE to let treeflash start its own workers"


def torchrun_env() -> dict | None:
    """The launch that RANK and WORLD_SIZE (> 1) describe, torchrun's or a bare one; None
    without them."""
    env = os.environ

    def number(name: str, default: str | None = None) -> int:
        try:
            return int(env.get(name, default))
        except ValueError:
            raise UsageError(f"environment variable {name}={env.get(name)!r} is not an integer (RANK and "
                             f"WORLD_SIZE describe a torchrun launch; {UNSET_LAUNCH})") from None

    if "RANK" not in env or "WORLD_SIZE" not in env or number("WORLD_SIZE") <= 1:
        return None
    return {"rank": number("RANK"), "world": number("WORLD_SIZE"), "local_rank": number("LOCAL_RANK", env["RANK"]),
            "addr": env.get("MASTER_ADDR", "127.0.0.1"), "port": number("MASTER_PORT", "29500")}


def check_devices(size: int, device: torch.device) -> None:
    """One-line errors for `size` ranks on `device` before any process is started (GPUs
    are cuda:0..size-1, as many must be visible unless torchrun placed the ranks); sets
    `NO_MULTICAST` in this process's environment, which the ranks inherit."""
    if device.type != "cuda":
        return
    if device.index is not None:
        raise UsageError(f"with tp={size} the ranks use cuda:0..{size - 1} (choose GPUs with "
                         f"CUDA_VISIBLE_DEVICES); give device 'cuda' or 'auto', not '{device}'")
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    if torchrun_env() is None and size > torch.cuda.device_count():
        raise TreeflashError(f"tp={size} needs {size} GPUs but {torch.cuda.device_count()} are visible")


def start(size: int, device: torch.device) -> "Runtime":
    check_devices(size, device)
    tr = torchrun_env()
    if tr is not None:
        return _join_torchrun(size, device, tr)
    return _spawn(size, device.type)


def _spawn(size: int, device_type: str) -> "Runtime":
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=_td(timeout_s()), wait_for_workers=False)
    env = dict(os.environ)
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no c10d warning dumps when the driver goes away
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if device_type == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // size)))
    procs: dict[int, subprocess.Popen] = {}
    rt = None
    try:
        for r in range(1, size):
            env[WORKER_ENV] = json.dumps({"rank": r, "size": size, "port": store.port, "parent": os.getpid(),
                                          "device": device_type})
            procs[r] = subprocess.Popen(
                [sys.executable, "-c", "from treeflash.engine.tp import worker_main; worker_main()"],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)  # stderr: crashes show
        rt = Runtime(size, device_type, 0, 0, store, procs)
        rt.start_monitor()
        rt.wait_keys([f"hello/{r}" for r in range(1, size)], "start", timeout_s())
        rt.connect()
    except BaseException:
        if rt is not None:
            rt.shutdown(graceful=False)
        for p in procs.values():
            p.kill()
            p.wait()
        raise
    return rt


def _torchrun_runtime(size: int, device: torch.device, tr: dict) -> "Runtime":
    if tr["world"] != size:
        raise UsageError(f"launched with WORLD_SIZE={tr['world']} processes but tp={size}")
    if device.type == "cuda" and tr["local_rank"] >= torch.cuda.device_count():
        raise TreeflashError(f"rank {tr['rank']} needs cuda:{tr['local_rank']} but "
                             f"{torch.cuda.device_count()} GPUs are visible")
    # torchrun's agent serves the store at MASTER_ADDR:MASTER_PORT; a bare launch has rank 0 serve it
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    where = f"{tr['addr']}:{tr['port']}"
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not torchrun: variables left set by mistake wait the whole timeout
        print(f"treeflash: RANK={tr['rank']} and WORLD_SIZE={tr['world']} are set: waiting up to {timeout_s():g} s "
              f"for the other ranks at {where} ({UNSET_LAUNCH})", file=sys.stderr, flush=True)
    try:
        store = dist.TCPStore(tr["addr"], tr["port"], None, tr["rank"] == 0 and not agent,
                              timeout=_td(timeout_s()), wait_for_workers=False)
        rt = Runtime(size, device.type, tr["rank"], tr["local_rank"], dist.PrefixStore("treeflash", store))
        rt.connect()
    except dist.DistError as e:  # a timeout, or the address in use: one line, not c10d's dump
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TreeflashError(f"tensor-parallel rank {tr['rank']} of {tr['world']} could not meet the other ranks "
                             f"at {where} ({type(e).__name__}: {first}); launch every rank, or "
                             f"{UNSET_LAUNCH}") from None
    return rt


def _join_torchrun(size: int, device: torch.device, tr: dict) -> "Runtime":
    rt = _torchrun_runtime(size, device, tr)
    if rt.rank != 0:
        rt.store.set_timeout(_td(10 * 365 * 86400))  # idle workers wait for commands as long as it takes
        code = rt.serve_main()
        raise SystemExit(code)
    return rt


def join_group(size: int, device: torch.device) -> "Runtime":
    """This torchrun-launched process's rank of a `size`-rank group for a program that runs
    the same code on every rank in lock step instead of serving engine commands
    (`treeflash bench --shape --tp`). Use `.group` and `.device` (cuda:LOCAL_RANK on
    GPUs); call `.leave()` at the end.

    One all-reduce runs here: NCCL creates its communicator on the first collective,
    which must not happen inside a CUDA-graph capture (and a broken NCCL setup fails here,
    not somewhere in the program)."""
    tr = torchrun_env()
    if tr is None:
        raise UsageError(f"tp={size}: not started by torchrun (RANK / WORLD_SIZE unset)")
    check_devices(size, device)
    rt = _torchrun_runtime(size, device, tr)
    rt.group.all_reduce(torch.ones(1, device=rt.device))
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)
    return rt


def worker_main() -> None:
    """Entry point of a worker process started by the driver."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    info = json.loads(os.environ.pop(WORKER_ENV))
    parent = info["parent"]

    def watch_parent():
        while True:
            time.sleep(0.2)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch_parent, daemon=True, name="treeflash-parent-watch").start()
    store = dist.TCPStore("127.0.0.1", info["port"], None, False, timeout=_td(10 * 365 * 86400),
                          wait_for_workers=False)
    rt = Runtime(info["size"], info["device"], info["rank"], info["rank"], store)
    code = 1
    try:
        store.set(f"hello/{rt.rank}", b"1")
        rt.connect()
        code = rt.serve_main()
    except BaseException as e:
        rt.report(e)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Runtime:
    """The N ranks of one tensor-parallel group, seen from this process (rank `rank`)."""

    def __init__(self, size: int, device_type: str, rank: int, local_rank: int, store, procs=None):
        self.size, self.rank = size, rank
        self.backend = "nccl" if device_type == "cuda" else "gloo"
        self.device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
        self.store = store
        self.procs: dict[int, subprocess.Popen] = procs or {}
        self.group: TPGroup | None = None
        self.seq = 0
        self.command_keys: list[str] = []  # a worker's: the store keys of command `seq`
        self.failure: str | None = None   # one line: which rank failed and why
        self.closed = False
        self.released = False
        self.abort_lock = threading.Lock()
        # one command at a time: engines on this runtime used from several threads must
        # not interleave their commands (and so their collectives) differently on the ranks
        self.command_lock = threading.Lock()
        self.stopping = False             # we are killing the workers: their exits are expected
        self.busy = False                 # the driver is inside a command
        self.engines: set[int] = set()
        self.next_engine = 0
        self.pending_drops: list[int] = []
        self.drops_lock = threading.RLock()  # drop() may run in a finalizer, on any thread, inside post()

    # ---------------------------------------------------------------- group
    def connect(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        store = dist.PrefixStore("pg", self.store)
        if self.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = _td(timeout_s())
            pg = dist.ProcessGroupNCCL(store, self.rank, self.size, opts)
            self.group = TPGroup(self.rank, self.size, pg, self._peer_all_reduce(pg))
        else:
            pg = dist.ProcessGroupGloo(store, self.rank, self.size, _td(timeout_s()))
            self.group = TPGroup(self.rank, self.size, pg)

    def _peer_all_reduce(self, pg):
        """The one-shot peer-memory all-reduce (`treeflash.kernels.all_reduce`) when every
        rank is on this host and all of them could set it up, else None (NCCL alone). The
        ranks agree in NCCL all-reduces, before the rendezvous (a rank without a buffer
        must not leave the others waiting in it) and after; the first also creates the
        communicator here, not inside a CUDA-graph capture."""
        from treeflash.kernels import all_reduce

        buffer, peer, why = None, None, None  # why: this rank's reason to fall back
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if torchrun_env() is not None and local is not None and int(local) != self.size:
            why = "the ranks span several hosts"
        else:
            try:
                buffer = all_reduce.allocate(self.device)
            except Exception as e:
                why = one_line(e)
        failed = self._first_failed(why is None, pg)
        if failed is None:
            try:
                peer = all_reduce.connect(buffer, dist.PrefixStore("peer", self.store), self.rank, self.size, pg)
            except Exception as e:
                why = one_line(e)
            failed = self._first_failed(why is None, pg)
        if failed is None:
            return peer
        if failed == self.rank:  # one line, from the lowest rank that failed
            print(f"treeflash: tensor parallelism all-reduces through NCCL only (rank {failed}: {why})",
                  file=sys.stderr)
        return None

    def _first_failed(self, ok: bool, pg) -> int | None:
        """The lowest rank where `ok` is false, None if it is true on every rank."""
        rank = torch.tensor([self.size if ok else self.rank], dtype=torch.int32, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        pg.allreduce([rank], opts).wait()
        first = int(rank.item())
        return None if first == self.size else first

    # ---------------------------------------------------------------- driver
    def check(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        if self.closed:
            raise EngineDeadError("the tensor-parallel workers have been shut down; create a new LLM")

    def post(self, op: str, eid, payload=None, collect: bool = False) -> int:
        with self.drops_lock:
            drops, self.pending_drops = self.pending_drops, []
        try:
            data = command_bytes((op, eid, payload, collect, drops))
        except BaseException:  # nothing was sent: the drops go with the next command
            with self.drops_lock:
                self.pending_drops[:0] = drops
            raise
        self.seq += 1
        put_value(self.store, f"cmd/{self.seq}", data)
        return self.seq

    def new_engine(self, kwargs: dict) -> Engine:
        with self.command_lock:
            self.check()
            eid, self.next_engine = self.next_engine, self.next_engine + 1
            self.engines.add(eid)
            # with the driver's import path, its script's folder first: the workers import
            # the module of a value whose class is defined beside the script (a str enum)
            return Engine(self, eid, self.post("build", eid, (kwargs, list(sys.path))))

    def call(self, eid: int, obj, name: str, args, collect: bool):
        with self.command_lock:
            return self._call(eid, obj, name, args, collect)

    def _call(self, eid: int, obj, name: str, args, collect: bool):
        self.check()
        if eid not in self.engines:  # the workers have dropped it: they must not be asked
            raise closed_error()
        seq = self.post("call", eid, (name, args), collect)
        self.busy = True
        try:
            out = getattr(obj, name)(*args)
            if self.failure is not None:  # a worker died and the collectives were aborted under us
                raise EngineDeadError(self.failure)
            return [out] + self.replies(seq) if collect else out
        except InStepError:  # every rank raised it at the same point: still in step
            raise
        except BaseException as e:
            err = self.fail(e)
            if err is e:
                raise
            raise err from None
        finally:
            self.busy = False

    def replies(self, seq: int) -> list:
        """The workers' answers to command `seq` (as long as they take: loading a large
        checkpoint may; a worker that dies is reported by the monitor / its error key)."""
        keys = [f"res/{seq}/{r}" for r in range(1, self.size)]
        self.wait_keys(keys, "answer")
        out = []
        for k in keys:
            data, held = read_value(self.store, k)
            out.append(pickle.loads(data))
            delete_keys(self.store, held)
        return out

    def wait_keys(self, keys: list[str], what: str, limit_s: float | None = None) -> None:
        deadline = time.monotonic() + limit_s if limit_s is not None else float("inf")
        pause = 0.001
        while not self.store.check(keys):
            self.check()
            if not self.procs:
                self._failure_from_store()
            if time.monotonic() > deadline:
                raise TreeflashError(f"tensor-parallel workers did not {what} within {limit_s:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _failure_from_store(self) -> None:
        """torchrun: the driver cannot see the workers' processes, only their reports."""
        for r in range(1, self.size):
            if self.store.check([f"err/{r}"]):
                err = json.loads(self.store.get(f"err/{r}"))
                self.failure = f"tensor-parallel worker rank {r} failed: {err['error']}"
                raise EngineDeadError(self.failure)

    def fail(self, e: BaseException) -> BaseException:
        """The driver failed inside a command: the ranks are out of step for good. Shut
        the workers down; return what to raise: a worker's failure (the cause of a broken
        collective, or of the CUDA error an aborted NCCL communicator left), else `e`."""
        comm = is_comm_error(e)
        if comm:
            deadline = time.monotonic() + 10.0
            while self.failure is None and time.monotonic() < deadline:
                if not self.procs:
                    try:
                        self._failure_from_store()
                    except TreeflashError:
                        break
                time.sleep(0.05)
        failure = self.failure
        self.shutdown(graceful=False)
        if failure is not None:
            return EngineDeadError(failure)
        if comm:
            return EngineDeadError(f"tensor-parallel communication failed: {one_line(e)}")
        return e

    def drop(self, eid: int) -> None:
        """Forget engine `eid` (its slices are freed with the next command); shut the
        workers down with the last engine. Safe to call from a finalizer."""
        if self.closed or eid not in self.engines:
            return
        self.engines.discard(eid)
        with self.drops_lock:
            self.pending_drops.append(eid)
        if not self.engines:
            self.shutdown(graceful=True)

    def shutdown(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        self.stopping = True
        if graceful and self.failure is None:
            try:
                self.post("shutdown", None)
                self.leave()  # with the workers
            except Exception:
                pass
        for p in self.procs.values():
            if graceful:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None:
                p.kill()
            p.wait()
        if graceful and self.failure is None:
            self.park()
        else:
            # waits for the monitor's abort, if that is under way, longer than the monitor's
            # grace: if the abort is stuck while a command runs (the driver was let go by
            # the peer flag), the monitor ends the process (exit code 1) before this
            # returns into an exit that would meet NCCL's abort half done
            self.abort(wait_s=GRACE_S + 15)
        for key, rt in list(_RUNTIMES.items()):
            if rt is self:
                del _RUNTIMES[key]

    def park(self) -> None:
        """Keep this rank's NCCL communicator, finished with, until the process exits. On
        the H200s (torch 2.11) both its destroy and its abort blocked for good once CUDA
        graphs had captured collectives on it, on every rank at once too, and its
        destructor (at the latest in interpreter finalization) aborts: so it is never
        destroyed. Only a failure aborts (`abort`), to unblock kernels waiting on a
        dead peer; gloo groups close with their sockets."""
        if self.backend == "nccl" and self.group is not None and not self.released:
            self.released = True
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.group.group))

    def abort(self, wait_s: float = GRACE_S) -> None:
        """Release the NCCL communicators, unblocking kernels that wait on a dead peer
        (gloo fails by itself once the peers' sockets close). Once: the monitor and a
        shutdown may both get here; the second waits for the first, `wait_s` at most."""
        if not self.abort_lock.acquire(timeout=wait_s):
            return
        try:
            if self.released:
                return
            self.released = True
            if self.backend == "nccl" and self.group is not None:
                # the peer all-reduce's kernels first: NCCL's abort waits for the device,
                # where they spin on the dead peer (set after it, the abort never returned
                # and every failure took the monitor's grace). A driver they let go raises
                # only after `shutdown`'s abort, which waits on this one (the lock).
                if self.group.peer is not None:
                    self.group.peer.abort()
                self.group.group.abort()
        except Exception:
            pass
        finally:
            self.abort_lock.release()

    # ---------------------------------------------------------------- monitor (driver)
    def start_monitor(self) -> None:
        threading.Thread(target=self._monitor, daemon=True, name="treeflash-tp-monitor").start()

    def _monitor(self) -> None:
        port = self.store.port
        client = None
        while not self.stopping:
            if any(p.poll() is not None for p in self.procs.values()):
                time.sleep(0.3)  # let the other ranks' reports land, then pick the cause
                if self.stopping:
                    return
                try:
                    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=_td(5),
                                           wait_for_workers=False)
                except Exception:
                    client = None
                self.failure = self._diagnose(client)
                self.stopping = True
                for p in self.procs.values():  # nothing may wait on a dead peer
                    if p.poll() is None:
                        p.kill()
                # in its own thread: the grace period below runs even if the abort blocks
                aborting = threading.Thread(target=self.abort, daemon=True, name="treeflash-tp-abort")
                aborting.start()
                begun = time.monotonic()
                while self.busy and time.monotonic() < begun + GRACE_S:
                    if aborting.is_alive() and time.monotonic() > begun + ABORT_S:
                        break  # the abort is stuck: the driver's kernels will never end
                    time.sleep(0.1)
                if self.busy:
                    print(f"treeflash: error: {self.failure}", file=sys.stderr, flush=True)
                    os._exit(1)
                return
            time.sleep(0.1)

    def _diagnose(self, client) -> str:
        """The most likely root cause among the dead workers: a signal or a worker's own
        error before a peer's broken collective; the lowest rank first."""
        causes = []
        for r, p in sorted(self.procs.items()):
            rc = p.poll()
            if rc is None:
                continue
            err = None
            try:
                if client is not None and client.check([f"err/{r}"]):
                    err = json.loads(client.get(f"err/{r}"))
            except Exception:
                err = None
            if err is not None:
                causes.append((err["comm"], r, f"failed: {err['error']}"))
            elif rc < 0:
                try:
                    name = signal.Signals(-rc).name
                except ValueError:
                    name = str(-rc)
                causes.append((False, r, f"was killed by signal {name}"))
            else:
                causes.append((False, r, f"exited unexpectedly with code {rc}"))
        comm, r, why = min(causes)
        return f"tensor-parallel worker rank {r} {why}"

    def leave(self) -> None:
        """End a `join_group` rank, or every rank of a graceful shutdown: once every
        rank's device work is done (no kernel of a peer can still be inside a collective),
        stop with the others; its communicator is parked (`park`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.store.set(f"left/{self.rank}", b"1")
        keys, deadline = [f"left/{r}" for r in range(self.size)], time.monotonic() + GRACE_S
        while not self.store.check(keys):  # not for a worker that died meanwhile (the driver sees it)
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs.values()):
                raise TreeflashError("the tensor-parallel ranks did not all stop together")
            time.sleep(0.005)
        self.park()

    # ---------------------------------------------------------------- worker
    def serve_main(self) -> int:
        """Serve commands until shutdown; 0 on a clean shutdown, 1 after a failure."""
        try:
            self.serve()
            return 0
        except BaseException as e:
            self.report(e)
            return 1

    def serve(self) -> None:
        from treeflash.engine.llm import LLM
        engines: dict[int, object] = {}
        fault = os.environ.get(FAULT_ENV, "")
        while True:
            op, eid, payload, collect, drops = self.next_command()
            if fault == f"{self.rank}:{self.seq}":
                raise RuntimeError(f"fault injected by {FAULT_ENV}={fault}")
            if drops:
                for d in drops:
                    engines.pop(d, None)
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            if op == "shutdown":
                self.leave()
                return
            if op == "build":
                kwargs, path = payload
                sys.path[:0] = [p for p in path if p not in sys.path]
                try:
                    engines[eid] = LLM(**kwargs, _worker=self)
                    self.reply(None)
                except Exception as e:  # the driver reports it; this worker lives on
                    self.reply(one_line(e))
            elif op == "call":
                name, args = payload
                try:
                    out = getattr(engines[eid], name)(*args)
                except InStepError:  # the driver raised it too, and reports it
                    continue
                if collect:
                    self.reply(out)

    def next_command(self) -> tuple:
        """The driver's next command (op, engine id, payload, collect, drops), once the
        previous one has run. The previous one is deleted from the store here, by the
        last worker to get to this point, as no rank reads it again."""
        if self.seq:
            if self.size == 2 or self.store.add(f"read/{self.seq}", 1) == self.size - 1:
                delete_keys(self.store, self.command_keys)
                if self.size > 2:
                    self.store.delete_key(f"read/{self.seq}")
        self.seq += 1
        data, self.command_keys = read_value(self.store, f"cmd/{self.seq}")
        return pickle.loads(data)

    def reply(self, out) -> None:
        put_value(self.store, f"res/{self.seq}/{self.rank}", pickle.dumps(out))

    def report(self, e: BaseException) -> None:
        """Leave the driver one line on why this worker stops."""
        text = one_line(e)
        try:
            self.store.set(f"err/{self.rank}", json.dumps({"error": text, "comm": is_comm_error(e)}))
        except Exception:
            pass
        if debugging():
            traceback.print_exc()
        if not self.procs and torchrun_env() is not None:  # torchrun: this rank's own log
            print(f"treeflash: tensor-parallel rank {self.rank}: {text}", file=sys.stderr, flush=True)


@atexit.register
def shutdown_runtimes() -> bool:
    """Shut down every runtime still open; True if this process ever started one (then
    its process-group objects may still be alive, closed or not, and must not be torn
    down by interpreter finalization: see `treeflash.cli.entry`)."""
    for rt in list(_RUNTIMES.values()):
        try:
            rt.shutdown(graceful=True)
        except Exception:
            pass
    return _started_any
