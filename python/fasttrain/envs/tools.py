"""Tools and environment classes written for TRL's GRPOTrainer, run in worker processes.

    [env]
    tools = ["tools.py:calculate", "my_pkg.tools:search"]   # plain functions, sync or async
    environment = "my_pkg.envs:Wordle"                       # TRL's environment class protocol
    tool_timeout = 10.0                                      # seconds per tool call

A tool is a function with a type hint on every argument and a Google-style docstring; its JSON
schema is transformers' `get_json_schema` (computed where the function lives, in the worker) and
reaches the chat template as `tools=`. An environment class follows TRL's protocol: `reset(**row)`
gets the dataset row's columns other than `prompt` and may return a string that is appended to the
last user message; its other public methods are tools; an optional `get_reward()` (sync or async)
is one more reward channel named after the class.

`ToolWorkers` is the one interface the rollout uses. Row slot s lives in worker s % n for the whole
rollout (its environment instance is there), a slot's calls run one after the other in its worker,
and the workers run side by side. Each call has its own deadline (`timeout`); a worker past it is
killed and started again, and the call's answer is an error message, as is an exception in the
tool: `str({"error": str(e)})`, what TRL writes. The environment instances that lived in a killed
worker are gone: their later calls and rewards are errors that say so.
"""
from __future__ import annotations

import select
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

from fasttrain.envs.reward_functions import (LOAD_TIMEOUT_MIN, RewardSpecError, _kill, _read_frame,
                                             _write_frame, parse_reward_spec, spawn_worker)
from fasttrain.envs.tool_worker import MAX_RESULT_CHARS

__all__ = ["ToolCall", "ToolWorkers", "check_arguments", "error_text", "MAX_RESULT_CHARS"]

_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
               "array": (list,), "object": (dict,), "null": (type(None),)}


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's name and its arguments (decoded JSON)."""
    name: str
    arguments: Any


def error_text(message: str) -> str:
    """A failed call's tool message content, as TRL renders it (`str({"error": str(e)})`)."""
    return str({"error": message})


def check_arguments(schema: dict, arguments: Any) -> str | None:
    """Why `arguments` do not fit the tool's JSON schema (get_json_schema's "function" part: an object, its required keys, no unknown
    keys, each value of its declared JSON type), or None. Never calls the tool."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    params = schema.get("parameters", {}) or {}
    props = params.get("properties", {}) or {}
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    unknown = [k for k in arguments if k not in props]
    if unknown:
        return f"unknown argument(s) {unknown}; the tool takes {sorted(props)}"
    for k, v in arguments.items():
        kinds = props[k].get("type")
        kinds = [kinds] if isinstance(kinds, str) else (kinds or [])
        allowed = tuple(t for kind in kinds for t in _JSON_TYPES.get(kind, (object,)))
        if allowed and (not isinstance(v, allowed) or (isinstance(v, bool) and bool not in allowed)):
            return f"argument {k!r} must be {' or '.join(kinds)}, got {type(v).__name__}"
    return None


class _Worker:
    def __init__(self, tool_specs: list[str], env_spec: str | None, load_timeout: float):
        self.proc, path = spawn_worker("fasttrain.envs.tool_worker")
        self._finalizer = weakref.finalize(self, _kill, self.proc)
        _write_frame(self.proc.stdin.fileno(), ("load", tool_specs, env_spec, path))
        self.load_deadline = time.monotonic() + load_timeout

    def ready(self, what: str) -> dict[str, Any]:
        try:
            reply = _read_frame(self.proc.stdout.fileno(), self.load_deadline)
        except TimeoutError:
            self.close()
            raise RewardSpecError(f"{what}: importing took longer than the load timeout") from None
        except (EOFError, OSError):
            code = self.proc.poll()
            self.close()
            raise RewardSpecError(f"{what}: the worker exited while loading (exit code {code}); "
                                  "see the output above") from None
        if reply[0] != "ready":
            self.close()
            raise RewardSpecError(f"{what}: cannot load: {reply[1]}")
        return reply[1]

    def close(self) -> None:
        self._finalizer()


class ToolWorkers:
    """The run's tools and environment instances in `workers` processes (module docstring)."""

    def __init__(self, tools: Sequence[str] = (), environment: str = "", timeout: float = 10.0,
                 workers: int = 2):
        self.tool_specs = list(tools)
        for spec in self.tool_specs:
            parse_reward_spec(spec, "env.tools")
        self.env_spec = environment or None
        if self.env_spec:
            parse_reward_spec(self.env_spec, "env.environment")
        if not self.tool_specs and not self.env_spec:
            raise RewardSpecError("ToolWorkers: no tools and no environment")
        self.timeout = float(timeout)
        self.what = f"env.tools {self.tool_specs}" + (f" / env.environment {self.env_spec!r}" if self.env_spec else "")
        self.restarts = 0
        self._workers: list[_Worker | None] = [None] * max(1, int(workers))
        self._lost: set[int] = set()              # slots whose environment instance died with a worker
        self._slots_seen: set[int] = set()        # slots with an environment instance
        self._start(range(len(self._workers)))
        self.schemas: list[dict] = self._loaded["schemas"]
        self.environment_name: str | None = self._loaded["environment"]      # the class's name
        self.has_reward: bool = self._loaded["get_reward"]
        names = [s["function"]["name"] for s in self.schemas]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            self.close()
            raise RewardSpecError(f"{self.what}: two tools are named {dup[0]!r}")
        self.by_name = {s["function"]["name"]: s["function"] for s in self.schemas}

    def _start(self, which) -> None:
        load = max(LOAD_TIMEOUT_MIN, self.timeout)
        started = {i: _Worker(self.tool_specs, self.env_spec, load) for i in which}   # all load side by side
        try:
            for i, w in started.items():
                self._loaded = w.ready(self.what)
                self._workers[i] = w
        except BaseException:
            for w in started.values():
                w.close()
            raise

    def close(self) -> None:
        for w in self._workers:
            if w is not None:
                w.close()
        self._workers = [None] * len(self._workers)

    @property
    def has_environment(self) -> bool:
        return self.env_spec is not None

    def worker_of(self, slot: int) -> int:
        return slot % len(self._workers)

    # ---- requests ---------------------------------------------------------------------------------
    def run(self, requests: Sequence[tuple[int, tuple]]) -> list[tuple[str, Any]]:
        """Replies to `requests` [(slot, message)] in their order: ("ok", value), ("raised", why)
        or ("failed", why) for a timeout or a dead worker. Requests of one slot run in order in
        that slot's worker; different workers run at the same time."""
        queues: dict[int, list[int]] = {}
        for k, (slot, _) in enumerate(requests):
            queues.setdefault(self.worker_of(slot), []).append(k)
        replies: list[tuple[str, Any]] = [("failed", "not run")] * len(requests)
        busy: dict[int, tuple[int, float]] = {}      # worker -> (request index, deadline)

        def send_next(w: int) -> None:
            while queues.get(w):
                k = queues[w].pop(0)
                slot, msg = requests[k]
                if slot in self._lost and msg[0] != "reset":
                    replies[k] = ("failed", "its environment instance was lost when a worker was restarted")
                    continue
                if slot in self._lost:
                    self._lost.discard(slot)
                if self._workers[w] is None:
                    try:
                        self._restart(w)
                    except RewardSpecError as e:           # cannot start again: this call fails, the run goes on
                        replies[k] = ("failed", f"its worker could not be restarted: {e}")
                        continue
                try:
                    _write_frame(self._workers[w].proc.stdin.fileno(), msg)
                except OSError:
                    replies[k] = ("failed", "its worker process died")
                    self._drop(w)
                    continue
                busy[w] = (k, time.monotonic() + self.timeout)
                return

        for w in list(queues):
            send_next(w)
        while busy:
            fds = {self._workers[w].proc.stdout.fileno(): w for w in busy}
            wait = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            ready, _, _ = select.select(list(fds), [], [], wait)
            for fd in ready:
                w = fds[fd]
                k, deadline = busy.pop(w)
                try:
                    replies[k] = _read_frame(fd, deadline)
                except TimeoutError:
                    replies[k] = ("failed", f"timed out after {self.timeout:g} s")
                    self._drop(w)
                except (EOFError, OSError):
                    replies[k] = ("failed", "its worker process exited")
                    self._drop(w)
                send_next(w)
            now = time.monotonic()
            for w, (k, deadline) in list(busy.items()):
                if now >= deadline and self._workers[w].proc.stdout.fileno() not in ready:
                    busy.pop(w)
                    replies[k] = ("failed", f"timed out after {self.timeout:g} s")
                    self._drop(w)
                    send_next(w)
        return replies

    def _drop(self, w: int) -> None:
        """Kill worker w; the environment instances it held are lost."""
        if self._workers[w] is not None:
            self._workers[w].close()
        self._workers[w] = None
        if self.env_spec:
            n = len(self._workers)
            self._lost |= {s for s in self._slots_seen if s % n == w}

    def _restart(self, w: int) -> None:
        self.restarts += 1
        self._start([w])

    # ---- what the rollout and the rewards ask -----------------------------------------------------
    def reset(self, rows: Sequence[dict[str, Any]]) -> list[tuple[str, Any]]:
        """reset(**row) of slot i's environment instance for each rows[i]; ("ok", observation)."""
        self._slots_seen |= set(range(len(rows)))
        return self.run([(i, ("reset", i, dict(r))) for i, r in enumerate(rows)])

    def call(self, calls: dict[int, Sequence[ToolCall]]) -> dict[int, list[tuple[dict[str, str], bool]]]:
        """Each slot's calls, run; {slot: [(tool message {"role": "tool", "name", "content"},
        failed)]} in call order. A call with an unknown name or arguments that do not fit its
        schema is an error message without running anything."""
        requests, where = [], []
        out: dict[int, list[tuple[dict[str, str], bool]]] = {s: [] for s in calls}
        for slot, cs in calls.items():
            for c in cs:
                schema = self.by_name.get(c.name)
                why = f"Tool {c.name} not found." if schema is None else check_arguments(schema, c.arguments)
                out[slot].append(({"role": "tool", "name": c.name, "content": error_text(why or "")}, True))
                if why is None:
                    requests.append((slot, ("call", slot, c.name, c.arguments)))
                    where.append((slot, len(out[slot]) - 1))
        for (slot, i), (kind, value) in zip(where, self.run(requests)):
            msg = out[slot][i][0]
            out[slot][i] = ({**msg, "content": value if kind == "ok" else error_text(value)}, kind != "ok")
        return out

    def score(self, spec: str, kwargs: dict[str, list], n: int) -> tuple[str, Any]:
        """A reward function that takes `environments=`, run where the instances live: each
        worker scores its own slots' answers (the kwargs' lists cut to those rows) with its
        instances; the values come back in row order as one reply ("ok", values) or the first
        failure. So the function sees a sub-batch per worker: per-answer rewards are unchanged,
        a reward that compares answers across the batch is not supported here."""
        groups: dict[int, list[int]] = {}
        for s in range(n):
            groups.setdefault(self.worker_of(s), []).append(s)
        reqs = []
        for slots in groups.values():
            part = {k: [v[s] for s in slots] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()}
            reqs.append((slots[0], ("score", spec, slots, part)))
        values: list[Any] = [None] * n
        for slots, (kind, got) in zip(groups.values(), self.run(reqs)):
            if kind != "ok":
                return kind, got
            if not isinstance(got, list) or len(got) != len(slots):
                return "ok", got                                      # the caller reports the shape
            for s, v in zip(slots, got):
                values[s] = v
        return "ok", values

    def rewards(self, slots: Sequence[int]) -> list[tuple[float | None, str | None]]:
        """get_reward() of each slot's environment instance: (value, None) or (None, why)."""
        out = []
        for kind, value in self.run([(s, ("reward", s)) for s in slots]):
            if kind != "ok":
                out.append((None, f"get_reward {'raised ' if kind == 'raised' else ''}{value}"))
                continue
            try:
                out.append((float(value), None))
            except (TypeError, ValueError):
                out.append((None, f"get_reward returned {value!r:.80}, not a number"))
        return out
