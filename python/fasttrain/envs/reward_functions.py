"""Reward functions with TRL's signature, each run in its own worker process with a deadline.

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]

`RewardFunction("pkg.module:name" | "path/to/file.py:name", timeout)` starts one worker process
that imports the function once and then scores batches. Why a process and not a thread: a hung
reward function must not hang the run, and a thread cannot be stopped. Python code stuck in a
catastrophic regex or a C call even holds the GIL, so it would stall the trainer too. A worker
past its deadline is killed (SIGKILL) and a fresh one is started on the next call; the answers of
that call are invalid with the reason "timed out". The cost is one Python start-up and the
module's import per worker (plus again after each timeout), and pickling each batch's inputs
(kilobytes) to the worker. Module state (counters, caches, clients) lives in the worker process.

Validation follows the verdict rules of fasttrain.envs: a value that is None, not a number, or
not finite makes that answer invalid with a reason; an exception makes the call's answers be
scored again one at a time in the worker, so a crash spoils only the answers that crash it.
`async def` functions (and functions that return an awaitable) run on the worker's event loop.

The worker side (`python -m fasttrain.envs.reward_functions`) speaks length-prefixed pickle frames
on its stdin and on a copy of its stdout; the function's own prints go to stderr.
"""
from __future__ import annotations

import math
import os
import pickle
import select
import struct
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RewardFunction", "RewardSpecError", "parse_reward_spec"]

LOAD_TIMEOUT_MIN = 60.0      # importing a reward module may import torch or transformers
_HEADER = struct.Struct("<Q")


class RewardSpecError(ValueError):
    """A reward spec cannot be loaded; the message says which and why."""


@dataclass(frozen=True)
class RewardSpec:
    spec: str          # as written in the recipe
    name: str          # the function's name: its channel name
    module: str        # importable module name, or "" for a file
    file: str          # path of a .py file, or "" for a module
    attr: str          # dotted attribute path inside the module


def parse_reward_spec(spec: str, key: str = "env.rewards") -> RewardSpec:
    """"pkg.module:function" or "path/to/file.py:function" (attributes may be dotted); errors
    name the recipe `key` the spec came from."""
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardSpecError(f"{key}: {spec!r} must look like 'package.module:function' or "
                              "'path/to/file.py:function'")
    where, _, attr = spec.rpartition(":")
    if not where or not attr or not all(p.isidentifier() for p in attr.split(".")):
        raise RewardSpecError(f"{key}: {spec!r} must look like 'package.module:function' or "
                              "'path/to/file.py:function'")
    name = attr.split(".")[-1]
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise RewardSpecError(f"{key}: {spec!r}: no such file {str(path)!r}")
        return RewardSpec(spec, name, "", str(path), attr)
    if not all(p.isidentifier() for p in where.split(".")):
        raise RewardSpecError(f"{key}: {spec!r}: {where!r} is neither a module name nor a .py file")
    return RewardSpec(spec, name, where, "", attr)


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


# ---- parent side ---------------------------------------------------------------------------------
def spawn_worker(module: str) -> tuple[subprocess.Popen, list[str]]:
    """A worker process `python -m module` with the trainer's sys.path (returned too, for its
    "load" message); its stdin and stdout are the frame pipes."""
    env = dict(os.environ)
    path = [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(path)
    proc = subprocess.Popen([sys.executable, "-m", module],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
    return proc, path


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover (a process that survives SIGKILL)
        pass
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


class RewardFunction:
    """One reward function in its worker process. `score(kwargs, n)` returns n pairs
    (value, reason): a finite float and None, or None and why the answer cannot be scored."""

    def __init__(self, spec: str, timeout: float = 30.0):
        self.spec = parse_reward_spec(spec)
        self.name = self.spec.name
        self.timeout = float(timeout)
        self.is_async = False
        self.takes_environments = False      # names an `environments` parameter (TRL passes the instances)
        self.restarts = 0
        self._proc: subprocess.Popen | None = None
        self._failure: str | None = None
        self._finalizer: weakref.finalize | None = None
        self._start()                                   # import errors surface now, not at step 1

    # the worker's life
    def _start(self) -> None:
        proc, path = spawn_worker("fasttrain.envs.reward_functions")
        self._proc = proc
        self._finalizer = weakref.finalize(self, _kill, proc)
        try:
            _write_frame(proc.stdin.fileno(), ("load", self.spec, path))
            reply = _read_frame(proc.stdout.fileno(), time.monotonic() + max(LOAD_TIMEOUT_MIN, self.timeout))
        except TimeoutError:
            self.close()
            raise RewardSpecError(f"env.rewards: importing {self.spec.spec!r} took longer than "
                                  f"{max(LOAD_TIMEOUT_MIN, self.timeout):.0f} s") from None
        except (EOFError, OSError):
            code = proc.poll()
            self.close()
            raise RewardSpecError(f"env.rewards: the worker for {self.spec.spec!r} exited while loading it "
                                  f"(exit code {code}); see the output above") from None
        if reply[0] != "ready":
            self.close()
            raise RewardSpecError(f"env.rewards: cannot load {self.spec.spec!r}: {reply[1]}")
        self.is_async = bool(reply[1])
        self.takes_environments = bool(reply[2])

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()                           # kills the worker (once)
        self._proc, self._finalizer = None, None

    # calls
    def ensure_started(self) -> None:
        """Start a fresh worker if the last one was killed or died. A worker that cannot start
        again mid-run makes this call's answers invalid (`receive` says why), not the run fail."""
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self.restarts += 1
            try:
                self._start()
            except RewardSpecError as e:
                self._failure = f"could not be restarted: {e}"

    def send(self, mode: str, kwargs: dict[str, Any]) -> float:
        """Start a call ("batch" or "rows"); returns its deadline. Use `receive` for the result."""
        self.ensure_started()
        if self._proc is not None:
            try:
                _write_frame(self._proc.stdin.fileno(), (mode, kwargs))
            except OSError:                # died since; `receive` reports it
                pass
        return time.monotonic() + self.timeout

    def receive(self, deadline: float) -> tuple[str, Any]:
        """("ok", values) | ("raised", message) | ("failed", reason): failed covers timeouts and
        a dying worker (both restart it on the next call)."""
        if self._proc is None:
            why, self._failure = self._failure or "has no worker process", None
            return "failed", why
        try:
            return _read_frame(self._proc.stdout.fileno(), deadline)
        except TimeoutError:
            self.close()
            return "failed", f"timed out after {self.timeout:g} s"
        except (EOFError, OSError):
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            self.close()
            return "failed", f"crashed (its worker process exited with code {code})"

    def score(self, kwargs: dict[str, Any], n: int) -> list[tuple[float | None, str | None]]:
        return self.finish(kwargs, n, self.receive(self.send("batch", kwargs)))

    def finish(self, kwargs: dict[str, Any], n: int, reply: tuple[str, Any]) -> list[tuple[float | None, str | None]]:
        """Turn a batch reply into n (value, reason) pairs, rescoring one at a time after a raise."""
        who = f"reward {self.name!r}"
        kind, payload = reply
        if kind == "failed":
            return [(None, f"{who} {payload}")] * n
        if kind == "raised":
            kind, payload = self.receive(self.send("rows", kwargs))
            if kind != "ok":
                why = payload if kind == "failed" else f"raised {payload}"
                return [(None, f"{who} {why}")] * n
        if not isinstance(payload, list):
            return [(None, f"{who} returned {payload}, not a list of numbers")] * n
        if len(payload) != n:
            return [(None, f"{who} returned {len(payload)} values for {n} completions")] * n
        out: list[tuple[float | None, str | None]] = []
        for v in payload:
            if v is None:
                out.append((None, f"{who} returned None"))
            elif isinstance(v, tuple):                 # ("raised", msg) or ("not a number", repr)
                out.append((None, f"{who} {v[0]} {v[1]}"))
            elif not math.isfinite(v):
                out.append((None, f"{who} returned {v!r}"))
            else:
                out.append((float(v), None))
        return out


# ---- worker side ---------------------------------------------------------------------------------
def _load(spec: RewardSpec, path: list[str]):
    import importlib
    import importlib.util
    import inspect

    sys.path[:0] = [p for p in path if p not in sys.path]
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
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    return fn, is_async


def _names_parameter(fn, name: str) -> bool:
    import inspect
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _as_number(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, (int, float)):                  # bool too, as TRL's float tensor takes it
        return float(v)
    try:
        return float(v)                              # numpy / torch scalars
    except (TypeError, ValueError):
        return ("returned a non-number", repr(v)[:80])


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def _serve() -> None:
    import asyncio
    import ctypes
    import inspect

    try:                                             # die with the trainer, even if hung
        ctypes.CDLL(None).prctl(1, 9)                # PR_SET_PDEATHSIG, SIGKILL (Linux)
    except (OSError, AttributeError):
        pass
    fd_in, fd_out = 0, os.dup(1)
    os.dup2(2, 1)                                    # the function's prints go to stderr
    sys.stdout = sys.stderr
    loop = asyncio.new_event_loop()

    def call(fn, kwargs):
        out = fn(**kwargs)
        if inspect.isawaitable(out):
            out = loop.run_until_complete(out)
        return out

    fn = None
    while True:
        try:
            msg = _read_frame(fd_in)
        except EOFError:
            return
        if msg[0] == "load":
            try:
                fn, is_async = _load(msg[1], msg[2])
                _write_frame(fd_out, ("ready", is_async, _names_parameter(fn, "environments")))
            except BaseException as e:               # noqa: BLE001 (report any import failure)
                _write_frame(fd_out, ("error", _describe(e)))
            continue
        mode, kwargs = msg
        if mode == "batch":
            try:
                out = call(fn, kwargs)
                if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
                    values: Any = f"a {type(out).__name__}"          # not a list of numbers
                else:
                    values = [_as_number(v) for v in out]
                _write_frame(fd_out, ("ok", values))
            except Exception as e:                   # noqa: BLE001
                _write_frame(fd_out, ("raised", _describe(e)))
            continue
        n = len(kwargs["completions"])               # "rows": one answer at a time
        values = []
        for i in range(n):
            row = {k: v[i:i + 1] if isinstance(v, list) else v for k, v in kwargs.items()}
            try:
                out = call(fn, row)
                values.append(_as_number(out[0]) if isinstance(out, (list, tuple)) and len(out) == 1
                              else ("returned", f"{out!r:.80} for one completion"))
            except Exception as e:                   # noqa: BLE001
                values.append(("raised", _describe(e)))
        _write_frame(fd_out, ("ok", values))


if __name__ == "__main__":
    _serve()
