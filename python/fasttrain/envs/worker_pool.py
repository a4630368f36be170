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
                                                        # "crashed (exit code -11)", "could not load: ..."
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

Counters (`restarts`, `killed_for_memory`, `timeouts`) are plain ints in `state_dict()` so the
trainer's checkpoint holds them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["WorkerPool", "Job", "Outcome", "WorkerSpecError", "default_memory_mb"]


class WorkerSpecError(ValueError):
    """A spec cannot be loaded (bad syntax, no such file or module, import error, not callable);
    the message names the spec and why."""


@dataclass(frozen=True)
class Outcome:
    """One call's end: ok with the function's return value, or not ok with a one-line reason."""
    ok: bool
    value: Any = None
    failure: str | None = None


def default_memory_mb() -> int:
    """env.worker_memory_mb's default: a quarter of the host's memory, in MB."""
    raise NotImplementedError


class Job:
    """A submitted call; `result()` waits for its Outcome (at most its timeout, then the kill)."""

    def result(self) -> Outcome:
        raise NotImplementedError


class WorkerPool:
    """Worker processes for user callables (see the module docstring)."""

    def __init__(self, memory_mb: float | None = None, max_workers: int = 4, poll_s: float = 0.05,
                 load_timeout: float = 60.0):
        raise NotImplementedError

    def load(self, spec: str) -> None:
        """Import `spec` in a worker now; WorkerSpecError names what is wrong."""
        raise NotImplementedError

    def submit(self, spec: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
               timeout: float = 30.0) -> Job:
        """Start `spec(*args, **kwargs)` in a worker; returns at once unless max_workers are busy."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, int]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, int]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
