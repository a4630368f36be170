"""Tools and environment classes written for TRL's GRPOTrainer, run in the worker pool.

    [env]
    tools = ["tools.py:calculate", "my_pkg.tools:search"]   # plain functions, sync or async
    environment = "my_pkg.envs:Wordle"                       # TRL's environment class protocol
    tool_timeout = 10.0                                      # seconds per tool call

A tool is a function with a type hint on every argument and a Google-style docstring; its JSON
schema is transformers' `get_json_schema` (computed where the function lives, in a worker) and
reaches the chat template as `tools=`. An environment class follows TRL's protocol: `reset(**row)`
gets the dataset row's columns other than `prompt` and may return a string that is appended to the
last user message; its other public methods are tools; an optional `get_reward()` (sync or async)
is one more reward channel named after the class.

`ToolWorkers` is the one interface the rollout uses. It runs everything through
fasttrain.envs.worker_pool (a deadline per call, the memory watchdog, process groups killed
whole) in `shards` single-worker pools: answer slot s always goes to shard s mod shards, so its
environment instance and its calls meet in one process (the worker functions are
fasttrain.envs.tool_worker's). A slot's calls run one after the other; the shards run side by
side. A call past `timeout`, a crash or a worker over the memory limit is an error message, as is
an exception in the tool: `str({"error": str(e)})`, what TRL writes. A replaced worker takes its
environment instances with it: their later calls and rewards are errors that say so. A fresh
worker imports the tools and the environment class before its first call, within the pool's load
timeout (start-up is not the tool's work: `timeout` bounds the call alone); an import that fails
there is left to the call, which reports it.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from fasttrain.envs.reward_functions import RewardSpecError
from fasttrain.envs.tool_worker import MAX_RESULT_CHARS
from fasttrain.envs.worker_pool import Outcome, WorkerPool, WorkerSpecError, parse_spec

__all__ = ["ToolCall", "ToolWorkers", "check_arguments", "error_text", "MAX_RESULT_CHARS"]

_W = "fasttrain.envs.tool_worker:"
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
    """Why `arguments` do not fit the tool's JSON schema (get_json_schema's "function" part: an
    object, its required keys, no unknown keys, each value of its declared JSON type), or None.
    Never calls the tool."""
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


def _why(out: Outcome) -> str:
    """A pool failure in the words of a tool result ("timed out after 5 s", "crashed (...)")."""
    return out.failure.removeprefix("raised ") if out.kind == "raised" else out.failure


class ToolWorkers:
    """The run's tools and environment instances in single-worker pools (module docstring)."""

    def __init__(self, tools: Sequence[str] = (), environment: str = "", timeout: float = 10.0,
                 shards: int = 2, memory_mb: float | None = None):
        self.tool_specs = list(tools)
        self.env_spec = environment or None
        for key, spec in [("env.tools", s) for s in self.tool_specs] + [("env.environment", self.env_spec)] * bool(self.env_spec):
            try:
                parse_spec(spec)
            except WorkerSpecError as e:
                raise RewardSpecError(f"{key}: {e}") from None
        if not self.tool_specs and not self.env_spec:
            raise RewardSpecError("ToolWorkers: no tools and no environment")
        self.timeout = float(timeout)
        self.what = f"env.tools {self.tool_specs}" + (f" / env.environment {self.env_spec!r}" if self.env_spec else "")
        self.pools = [WorkerPool(memory_mb=memory_mb, max_workers=1) for _ in range(max(1, int(shards)))]
        self._threads = ThreadPoolExecutor(len(self.pools), thread_name_prefix="fasttrain-tools")
        outs = list(self._threads.map(lambda p: p.submit(_W + "describe", (self.tool_specs, self.env_spec),
                                                         timeout=max(p.load_timeout, self.timeout)).result(), self.pools))
        bad = next((o for o in outs if not o.ok), None)
        if bad is not None:
            self.close()
            raise RewardSpecError(f"{self.what}: cannot load: {_why(bad)}")
        info = outs[0].value
        self.schemas: list[dict] = info["schemas"]
        self.environment_name: str | None = info["environment"]     # the class's name
        self.has_reward: bool = info["get_reward"]
        self._tool_spec_of: dict[str, str] = info["names"]
        self.by_name = {s["function"]["name"]: s["function"] for s in self.schemas}
        self._imported_at = [p.restarts for p in self.pools]     # describe() imported everything

    @property
    def has_environment(self) -> bool:
        return self.env_spec is not None

    @property
    def restarts(self) -> int:
        return sum(p.restarts for p in self.pools)

    def close(self) -> None:
        for p in self.pools:
            p.close()
        self._threads.shutdown(wait=False)

    def _each_slot(self, work: dict[int, list[tuple[str, tuple]]]) -> dict[int, list[Outcome]]:
        """Run each slot's (function, args) list in order in its shard; slots side by side."""
        def one(slot: int) -> list[Outcome]:
            pool = self._imported(slot % len(self.pools))
            return [pool.submit(_W + fn, args, timeout=self.timeout).result() for fn, args in work[slot]]
        return dict(zip(work, self._threads.map(one, list(work))))

    def _imported(self, shard: int) -> WorkerPool:
        """The shard's pool, its worker having imported the tools: a worker replaced since the last
        import does so first, within the load timeout (a failed import is left to the call)."""
        pool = self.pools[shard]
        restarts = pool.restarts
        if self._imported_at[shard] != restarts:
            pool.submit(_W + "load", (self.tool_specs, self.env_spec), timeout=pool.load_timeout).result()
            self._imported_at[shard] = restarts
        return pool

    # ---- what the rollout and the rewards ask -----------------------------------------------------
    def reset(self, rows: Sequence[dict[str, Any]], first_slot: int = 0) -> list[tuple[str, Any]]:
        """reset(**row) of slot first_slot + i's instance for each rows[i]: ("ok", observation or
        None), or ("raised" | "failed", why)."""
        slots = range(first_slot, first_slot + len(rows))
        done = self._each_slot({s: [("reset", (self.env_spec, s, dict(r)))] for s, r in zip(slots, rows)})
        out = []
        for s in slots:
            o = done[s][0]
            out.append(("failed", _why(o)) if not o.ok else ("ok", o.value[1]) if o.value[0] else ("raised", o.value[1]))
        return out

    def call(self, calls: dict[int, Sequence[ToolCall]]) -> dict[int, list[tuple[dict[str, str], bool]]]:
        """Each slot's calls, run; {slot: [(tool message {"role": "tool", "name", "content"},
        failed)]} in call order. A call with an unknown name or arguments that do not fit its
        schema is an error message without running anything."""
        work: dict[int, list[tuple[str, tuple]]] = {}
        out: dict[int, list[tuple[dict[str, str], bool]]] = {s: [] for s in calls}
        where: dict[int, list[int]] = {}
        for slot, cs in calls.items():
            for c in cs:
                schema = self.by_name.get(c.name)
                why = f"Tool {c.name} not found." if schema is None else check_arguments(schema, c.arguments)
                out[slot].append(({"role": "tool", "name": c.name, "content": error_text(why or "")}, True))
                if why is None:
                    args = (self._tool_spec_of.get(c.name), self.env_spec, slot, c.name, c.arguments)
                    work.setdefault(slot, []).append(("run_tool", args))
                    where.setdefault(slot, []).append(len(out[slot]) - 1)
        for slot, outcomes in self._each_slot(work).items():
            for i, o in zip(where[slot], outcomes):
                ok, text = (o.value if o.ok else (False, _why(o)))
                msg = out[slot][i][0]
                out[slot][i] = ({**msg, "content": text if ok else error_text(text)}, not ok)
        return out

    def rewards(self, slots: Sequence[int]) -> list[tuple[float | None, str | None]]:
        """get_reward() of each slot's instance: (value, None) or (None, why)."""
        done = self._each_slot({s: [("get_reward", (s,))] for s in slots})
        out = []
        for s in slots:
            o = done[s][0]
            if not o.ok:
                out.append((None, f"get_reward {o.failure}"))
                continue
            try:
                out.append((float(o.value), None))
            except (TypeError, ValueError):
                out.append((None, f"get_reward returned {o.value!r:.80}, not a number"))
        return out

    def score(self, spec: str, kwargs: dict[str, list], n: int) -> Outcome:
        """A reward function that takes `environments=`, run where the instances live: each shard
        scores its own slots' answers (the kwargs' lists cut to those rows) with its instances;
        one Outcome with the values in row order, or the first failure. So the function sees a
        sub-batch per shard: per-answer rewards are unchanged, a reward that compares answers
        across the batch is not supported here."""
        groups: dict[int, list[int]] = {}
        for s in range(n):
            groups.setdefault(s % len(self.pools), []).append(s)
        work = {slots[0]: [("score", (spec, slots, {k: [v[s] for s in slots] if isinstance(v, list) and len(v) == n
                                                       else v for k, v in kwargs.items()}))]
                for slots in groups.values()}
        done = self._each_slot(work)
        values: list[Any] = [None] * n
        for slots in groups.values():
            o = done[slots[0]][0]
            if not o.ok:
                return o
            if not isinstance(o.value, (list, tuple)) or len(o.value) != len(slots):
                return o                                           # the caller reports the shape
            for s, v in zip(slots, o.value):
                values[s] = v
        return Outcome(True, values)
