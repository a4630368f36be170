"""The one pool of worker processes that runs user code: reward functions, and the tools of agent
environments. The trainer never imports or calls user code in its own process.

    pool = WorkerPool(memory_mb=4096)                   # default: env.worker_memory_mb's rule
    pool.load("rewards.py:correct")                     # import now: a bad spec fails at start-up
    job = pool.submit("rewards.py:correct", kwargs={"completions": [...]}, timeout=30.0)
    out = job.result()                                  # blocks; never raises for the user code's sake
    if out.ok:
        value = out.value                               # whatever the function returned
    else:
        why = out.failure                               # "timed out after 30 s", "raised ValueError: ...",
                                                        # "used 5120 MB, over env.worker_memory_mb = 4096",
                                                        # "crashed (its worker process exited with code -11)",
                                                        # "could not load it: ..."
        out.kind                                        # "raised" | "timeout" | "memory" | "crashed" | "load"
    pool.close()                                        # kills every worker (also at exit)

Specs are "package.module:function" or "path/to/file.py:function" (dotted attributes allowed), the
syntax of `env.rewards`. The callable is called as `fn(*args, **kwargs)`; `async def` functions
(or ones that return an awaitable) run on the worker's event loop. Arguments and results travel
pickled between the trainer and its own worker processes (never from model output: the answer
text is a string argument, not code).

What the pool guarantees, whatever the user code does:
- `Job.result()` returns an `Outcome` within `timeout` seconds (plus the kill), never raises for a
  failure of the call, and its `failure` says why in one line.
- Each worker is the leader of its own process group. A call past its timeout, or a worker whose
  group's resident memory (measured: the sum of VmRSS over the group's processes, sampled every
  `poll_s`) passes `memory_mb`, is killed with its whole group (SIGKILL), so a function that forks
  leaves nothing behind. A fresh worker replaces it on the next call; the other workers go on.
  Not RLIMIT_AS (it breaks workers that import torch: they reserve address space they never
  touch) and not RLIMIT_NPROC (it counts every process of the user, not the worker's).
- A worker dies with the trainer (PR_SET_PDEATHSIG), even when it hangs in C code.
- The worker's stdout is the function's stderr: prints never corrupt the protocol.

Scheduling: at most `max_workers` calls run at once (more wait in `submit`'s order); an idle worker
that has already imported the spec is preferred, so a function usually keeps its worker and its
module state (caches, clients) between calls. Module state is not guaranteed: it is lost when
its worker is replaced, and the checkpoint does not hold it.

`load(spec)` returns what the trainer checks before a run starts: the function's parameters
(name -> whether it has a default) and whether it takes **kwargs. Counters (`restarts`,
`timeouts`, `killed_for_memory`) are plain ints in `state_dict()` so checkpoints hold them.

The worker side (`python -m fasttrain.envs.worker_pool`) reads length-prefixed pickle frames on
its stdin and writes them on a copy of its stdout; nothing but the trainer writes to its stdin.
"""
from __future__ import annotations

import inspect
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["WorkerPool", "Job", "Outcome", "Spec", "WorkerSpecError", "parse_spec", "default_memory_mb"]

# Start-up (a fresh interpreter importing the user's module, which may import torch or
# transformers: seconds on a quiet host, several times that on a loaded one) is waited for within
# a bound that only a hang passes; a call's own `timeout` never counts it.
LOAD_TIMEOUT_MIN = 600.0
_HEADER = struct.Struct("<Q")


class WorkerSpecError(ValueError):
    """A spec cannot be loaded (bad syntax, no such file or module, import error, not callable);
    the message names the spec and why."""


@dataclass(frozen=True)
class Outcome:
    """One call's end: ok with the function's return value, or not ok with a one-line reason and
    its kind ("raised", "timeout", "memory", "crashed", "load")."""
    ok: bool
    value: Any = None
    failure: str | None = None
    kind: str = "ok"


@dataclass(frozen=True)
class Spec:
    spec: str          # as written
    name: str          # the function's own name
    module: str        # importable module name, or "" for a file
    file: str          # absolute path of a .py file, or "" for a module
    attr: str          # dotted attribute path inside the module


def parse_spec(spec: str) -> Spec:
    """"pkg.module:function" or "path/to/file.py:function" (attributes may be dotted)."""
    shape = f"{spec!r} must look like 'package.module:function' or 'path/to/file.py:function'"
    if not isinstance(spec, str) or ":" not in spec:
        raise WorkerSpecError(shape)
    where, _, attr = spec.rpartition(":")
    if not where or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise WorkerSpecError(shape)
    name = attr.split(".")[-1]
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise WorkerSpecError(f"{spec!r}: no such file {str(path)!r}")
        return Spec(spec, name, "", str(path), attr)
    if not all(p.isidentifier() for p in where.split(".")):
        raise WorkerSpecError(f"{spec!r}: {where!r} is neither a module name nor a .py file")
    return Spec(spec, name, where, "", attr)


def default_memory_mb() -> int:
    """env.worker_memory_mb's default: a quarter of the host's memory, in MB (4096 if unknown)."""
    from fasttrain.host import meminfo_bytes
    total = meminfo_bytes("MemTotal")
    return max(256, total // 4 // 2**20) if total else 4096


# ---- framing (both sides) ----------------------------------------------------------------------
def _write_frame(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """n bytes from fd, or None at EOF; raises TimeoutError past `deadline` (time.monotonic)."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:           # a reply already waiting is read even past the deadline
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int, deadline: float | None = None) -> Any:
    head = _read_exact(fd, _HEADER.size, deadline)
    if head is None:
        raise EOFError
    body = _read_exact(fd, _HEADER.unpack(head)[0], deadline)
    if body is None:
        raise EOFError
    return pickle.loads(body)


# ---- measuring and killing a worker's process group --------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _descendants(pid: int) -> list[int]:
    """pid and every process below it (Linux /proc/PID/task/TID/children; on a kernel without
    that file, every process of the worker's process group)."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return _group_members(pid)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return out


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


def group_rss_mb(pid: int) -> float:
    """Resident memory of a worker and every process it started, in MB (measured, not reserved)."""
    total = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            pass
    return total * _PAGE / 2**20


def _kill_group(proc: subprocess.Popen) -> int | None:
    """SIGKILL the worker's process group (the worker leads it) and reap the worker."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        code = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover (a process that survives SIGKILL)
        code = None
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass
    return code


# ---- parent side ---------------------------------------------------------------------------------
@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    loaded: set[str] = field(default_factory=set)
    busy: bool = False
    dead: bool = False
    why: tuple[str, str] = ("crashed", "")   # how the last exchange failed


class Job:
    """A submitted call; `result()` waits for its Outcome (at most its timeout, then the kill)."""

    def __init__(self):
        self._done = threading.Event()
        self._outcome: Outcome | None = None

    def _finish(self, outcome: Outcome) -> None:
        self._outcome = outcome
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> Outcome:
        self._done.wait()
        assert self._outcome is not None
        return self._outcome


class WorkerPool:
    """Worker processes for user callables (see the module docstring)."""

    def __init__(self, memory_mb: float | None = None, max_workers: int = 4, poll_s: float = 0.05,
                 load_timeout: float = LOAD_TIMEOUT_MIN):
        if max_workers < 1:
            raise ValueError("WorkerPool: max_workers must be >= 1")
        self.memory_mb = float(memory_mb) if memory_mb else float(default_memory_mb())
        self.max_workers, self.poll_s, self.load_timeout = max_workers, poll_s, load_timeout
        self.restarts = self.timeouts = self.killed_for_memory = 0
        self._workers: list[_Worker] = []
        self._specs: dict[str, Spec] = {}
        self._cond = threading.Condition()
        self._finalizer = weakref.finalize(self, WorkerPool._kill_all, self._workers)

    # ---- workers ------------------------------------------------------------------------
    def _start_worker(self) -> _Worker:
        env = dict(os.environ)
        path = [p or os.getcwd() for p in sys.path]
        env["PYTHONPATH"] = os.pathsep.join(path)
        proc = subprocess.Popen([sys.executable, "-m", "fasttrain.envs.worker_pool"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, close_fds=True, start_new_session=True)
        _write_frame(proc.stdin.fileno(), ("path", path))
        w = _Worker(proc)
        self._workers.append(w)
        return w

    @staticmethod
    def _kill_all(workers: list[_Worker]) -> None:
        for w in workers:
            if not w.dead:
                w.dead = True
                _kill_group(w.proc)

    def _acquire(self, spec: str) -> _Worker:
        """An idle worker for `spec`: one that has loaded it, else a new one (up to max_workers),
        else any idle one; waits while all are busy."""
        with self._cond:
            while True:
                self._workers[:] = [w for w in self._workers if not w.dead]
                idle = [w for w in self._workers if not w.busy]
                pick = next((w for w in idle if spec in w.loaded), None)
                if pick is None and len(self._workers) < self.max_workers:
                    pick = self._start_worker()
                if pick is None and idle:
                    pick = idle[0]
                if pick is not None:
                    pick.busy = True
                    return pick
                self._cond.wait()

    def _release(self, w: _Worker) -> None:
        with self._cond:
            w.busy = False
            self._cond.notify_all()

    def _replace(self, w: _Worker) -> int | None:
        """Kill a worker's group; the next call starts a fresh worker in its place."""
        w.dead = True
        code = _kill_group(w.proc)
        with self._cond:
            self.restarts += 1
        return code

    # ---- the API --------------------------------------------------------------------------
    def load(self, spec: str) -> dict[str, Any]:
        """Import `spec` in a worker now; returns {"params": {name: has_default}, "var_keyword":
        bool, "is_async": bool}. WorkerSpecError names what is wrong."""
        job = self._start(spec, None)
        out = job.result()
        if not out.ok:
            raise WorkerSpecError(f"cannot load {spec!r}: {out.failure.removeprefix('could not load it: ')}")
        return out.value

    def submit(self, spec: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
               timeout: float = 30.0) -> Job:
        """Start `spec(*args, **kwargs)` in a worker; returns at once unless max_workers are busy.
        A worker that has not imported the spec yet does so first, within load_timeout (not
        counted in `timeout`)."""
        return self._start(spec, (tuple(args), dict(kwargs or {}), float(timeout)))

    def _start(self, spec: str, call: tuple | None) -> Job:
        parsed = self._specs.get(spec) or parse_spec(spec)
        self._specs[spec] = parsed
        job = Job()
        w = self._acquire(spec)
        threading.Thread(target=self._serve_job, args=(w, job, parsed, call), daemon=True,
                         name="fasttrain-worker-call").start()
        return job

    def _serve_job(self, w: _Worker, job: Job, spec: Spec, call: tuple | None) -> None:
        """In its own thread: import the spec where needed, then the call; every reply is waited
        for with the memory watchdog on."""
        try:
            if call is None or spec.spec not in w.loaded:
                reply = self._exchange(w, ("load", spec), max(self.load_timeout, 1.0))
                if reply is None or reply[0] != "ready" or call is None:
                    return self._done(w, job, reply)
                w.loaded.add(spec.spec)
            args, kwargs, timeout = call
            self._done(w, job, self._exchange(w, ("call", spec, args, kwargs), timeout))
        except BaseException as e:                    # pragma: no cover (a bug here must not hang result())
            self._after_kill(w, job, "crashed", f"the pool failed: {_describe(e)}")

    def _exchange(self, w: _Worker, msg: tuple, timeout: float) -> tuple | None:
        """Send msg and wait for the reply; None after killing the worker (self._why says why)."""
        fd = w.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        try:
            _write_frame(w.proc.stdin.fileno(), msg)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if select.select([fd], [], [], min(self.poll_s, left))[0]:
                    return _read_frame(fd, time.monotonic() + max(1.0, left))
                used = group_rss_mb(w.proc.pid)
                if used > self.memory_mb:
                    w.why = ("memory", f"used {used:.0f} MB, over env.worker_memory_mb = {self.memory_mb:.0f} "
                                       f"(killed with its processes)")
                    return None
        except TimeoutError:
            w.why = ("timeout", f"timed out after {timeout:g} s")
        except (EOFError, OSError, pickle.UnpicklingError):
            w.why = ("crashed", "")
        return None

    def _done(self, w: _Worker, job: Job, reply: tuple | None) -> None:
        if reply is None:
            return self._after_kill(w, job, *w.why)
        kind, payload = reply
        self._release(w)
        if kind in ("ready", "ok"):
            job._finish(Outcome(True, payload))
        elif kind == "raised":
            job._finish(Outcome(False, failure=f"raised {payload}", kind="raised"))
        else:
            job._finish(Outcome(False, failure=f"could not load it: {payload}", kind="load"))

    def _after_kill(self, w: _Worker, job: Job, kind: str, why: str) -> None:
        code = self._replace(w)
        if kind == "timeout":
            self.timeouts += 1
        elif kind == "memory":
            self.killed_for_memory += 1
        elif not why:
            why = f"crashed (its worker process exited with code {code})"
        self._release(w)
        job._finish(Outcome(False, failure=why, kind=kind))

    def pids(self) -> list[int]:
        """The live workers' process ids (each leads its process group)."""
        with self._cond:
            return [w.proc.pid for w in self._workers if not w.dead]

    def state_dict(self) -> dict[str, int]:
        return {"restarts": self.restarts, "timeouts": self.timeouts, "killed_for_memory": self.killed_for_memory}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.restarts = int(state.get("restarts", 0))
        self.timeouts = int(state.get("timeouts", 0))
        self.killed_for_memory = int(state.get("killed_for_memory", 0))

    def close(self) -> None:
        """Kill every worker (with its processes); a later call starts fresh ones."""
        with self._cond:
            WorkerPool._kill_all(self._workers)
            self._workers.clear()
            self._cond.notify_all()


# ---- worker side ---------------------------------------------------------------------------------
def import_spec(spec: Spec):
    import importlib
    import importlib.util

    if spec.file:
        folder = str(Path(spec.file).parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)               # the file may import its neighbours
        mod_name = Path(spec.file).stem
        loader_spec = importlib.util.spec_from_file_location(mod_name, spec.file)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules.setdefault(mod_name, module)
        loader_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(spec.module)
    fn: Any = module
    for part in spec.attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{spec.attr} is a {type(fn).__name__}, not a function")
    return fn


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def _signature(fn) -> dict[str, Any]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {"params": {}, "var_keyword": True, "is_async": False}
    params = {n: p.default is not inspect.Parameter.empty for n, p in sig.parameters.items()
              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    return {"params": params, "var_keyword": var_kw, "is_async": is_async}


def _serve() -> None:
    import asyncio
    import ctypes

    try:                                             # die with the trainer, even if hung
        ctypes.CDLL(None).prctl(1, 9)                # PR_SET_PDEATHSIG, SIGKILL (Linux)
    except (OSError, AttributeError):
        pass
    fd_in, fd_out = 0, os.dup(1)
    os.dup2(2, 1)                                    # the function's prints go to stderr
    sys.stdout = sys.stderr
    loop = asyncio.new_event_loop()
    fns: dict[str, Any] = {}

    def function(spec: Spec):
        if spec.spec not in fns:
            fns[spec.spec] = import_spec(spec)
        return fns[spec.spec]

    while True:
        try:
            msg = _read_frame(fd_in)
        except EOFError:
            return
        if msg[0] == "path":
            sys.path[:0] = [p for p in msg[1] if p not in sys.path]
            continue
        try:
            fn = function(msg[1])
        except BaseException as e:                   # noqa: BLE001 (report any import failure)
            _write_frame(fd_out, ("error", _describe(e)))
            continue
        if msg[0] == "load":
            _write_frame(fd_out, ("ready", _signature(fn)))
            continue
        _, _, args, kwargs = msg
        try:
            out = fn(*args, **kwargs)
            if inspect.isawaitable(out):
                out = loop.run_until_complete(out)
        except Exception as e:                       # noqa: BLE001
            _write_frame(fd_out, ("raised", _describe(e)))
            continue
        try:
            _write_frame(fd_out, ("ok", out))
        except Exception as e:                       # noqa: BLE001 (an unpicklable result)
            _write_frame(fd_out, ("raised", f"its result cannot be sent back ({_describe(e)})"))


if __name__ == "__main__":
    _serve()
