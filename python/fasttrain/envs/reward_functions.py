"""Reward functions with TRL's signature, run in the worker pool (fasttrain.envs.worker_pool).

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]

`RewardFunction("pkg.module:name" | "path/to/file.py:name", timeout, pool)` imports the function in
a worker of `pool` at once (so import errors surface at start-up, not at step 1) and then scores
batches there. Why a process and not a thread: a hung reward function must not hang the run, and
a thread cannot be stopped. Python code stuck in a catastrophic regex or a C call even holds the
GIL, so it would stall the trainer too. A call past its deadline, or a worker whose resident
memory passes env.worker_memory_mb, is killed with its process group and a fresh worker takes its
place on the next call; that call's answers are invalid with the reason ("timed out after 30 s",
"used 5120 MB, over env.worker_memory_mb = 4096"). Module state (counters, caches, clients) lives
in the worker and is lost when the worker is replaced.

Validation follows the verdict rules of fasttrain.envs: a value that is None, not a number, or
not finite makes that answer invalid with a reason; an exception makes the call's answers be
scored again one at a time, so a crash spoils only the answers that crash it. `async def`
functions (and functions that return an awaitable) run on the worker's event loop.
"""
from __future__ import annotations

import math
from typing import Any

from .worker_pool import Outcome, Spec, WorkerPool, WorkerSpecError, parse_spec

__all__ = ["RewardFunction", "RewardSpecError", "parse_reward_spec"]


class RewardSpecError(ValueError):
    """A reward spec cannot be loaded; the message says which and why."""


RewardSpec = Spec


def parse_reward_spec(spec: str) -> Spec:
    """"pkg.module:function" or "path/to/file.py:function" (attributes may be dotted)."""
    try:
        return parse_spec(spec)
    except WorkerSpecError as e:
        raise RewardSpecError(f"env.rewards: {e}") from None


def _as_number(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, (int, float)):                  # bool too, as TRL's float tensor takes it
        return float(v)
    try:
        return float(v)                              # numpy / torch scalars
    except (TypeError, ValueError):
        return ("returned a non-number", repr(v)[:80])


class RewardFunction:
    """One reward function in the worker pool. `score(kwargs, n)` returns n pairs (value,
    reason): a finite float and None, or None and why the answer cannot be scored."""

    def __init__(self, spec: str, timeout: float = 30.0, pool: WorkerPool | None = None):
        self.spec = parse_reward_spec(spec)
        self.name = self.spec.name
        self.timeout = float(timeout)
        self.restarts = 0                        # this function's calls that cost their worker
        self._own_pool = pool is None
        self.pool = pool if pool is not None else WorkerPool(max_workers=1)
        try:
            self.signature = self.pool.load(self.spec.spec)
        except WorkerSpecError as e:
            self.close()
            raise RewardSpecError(f"env.rewards: {e}") from None
        self.is_async = bool(self.signature["is_async"])

    def close(self) -> None:
        if self._own_pool:
            self.pool.close()

    def submit(self, kwargs: dict[str, Any]):
        """Start a call on the batch; `finish(kwargs, n, job.result())` reads it."""
        return self.pool.submit(self.spec.spec, kwargs=kwargs, timeout=self.timeout)

    def score(self, kwargs: dict[str, Any], n: int) -> list[tuple[float | None, str | None]]:
        return self.finish(kwargs, n, self.submit(kwargs).result())

    def _failed(self, out: Outcome) -> str:
        if out.kind == "load":
            return (f"could not be restarted: env.rewards: cannot load {self.spec.spec!r}: "
                    f"{out.failure.removeprefix('could not load it: ')}")
        self.restarts += out.kind in ("timeout", "memory", "crashed")
        return out.failure

    def finish(self, kwargs: dict[str, Any], n: int, out: Outcome) -> list[tuple[float | None, str | None]]:
        """Turn a batch's Outcome into n (value, reason) pairs, rescoring one at a time after a raise."""
        who = f"reward {self.name!r}"
        if not out.ok and out.kind != "raised":
            return [(None, f"{who} {self._failed(out)}")] * n
        if not out.ok:                                 # raised: each answer on its own
            values = []
            for i in range(n):
                row = {k: v[i:i + 1] if isinstance(v, list) else v for k, v in kwargs.items()}
                one = self.submit(row).result()
                if not one.ok:
                    values.append(("raised", one.failure.removeprefix("raised ")) if one.kind == "raised"
                                  else ("", self._failed(one)))
                elif isinstance(one.value, (list, tuple)) and len(one.value) == 1:
                    values.append(_as_number(one.value[0]))
                else:
                    values.append(("returned", f"{one.value!r:.80} for one completion"))
        elif isinstance(out.value, (str, bytes, dict)) or not hasattr(out.value, "__iter__"):
            return [(None, f"{who} returned a {type(out.value).__name__}, not a list of numbers")] * n
        else:
            values = [_as_number(v) for v in out.value]
        if len(values) != n:
            return [(None, f"{who} returned {len(values)} values for {n} completions")] * n
        pairs: list[tuple[float | None, str | None]] = []
        for v in values:
            if v is None:
                pairs.append((None, f"{who} returned None"))
            elif isinstance(v, tuple):                 # ("raised", msg), ("returned a non-number", repr), ...
                pairs.append((None, f"{who} {v[0]} {v[1]}".replace(f"{who}  ", f"{who} ")))
            elif not math.isfinite(v):
                pairs.append((None, f"{who} returned {v!r}"))
            else:
                pairs.append((float(v), None))
        return pairs
