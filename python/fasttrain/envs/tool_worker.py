"""The worker process that holds a run's tools and environment instances and runs their calls.

`python -m fasttrain.envs.tool_worker` speaks the length-prefixed pickle frames of
fasttrain.envs.reward_functions on its stdin and a copy of its stdout (prints of user code go to
stderr). The parent side is fasttrain.envs.tools.ToolWorkers; this file is only the loop that
answers it. Messages:

    ("load", tool_specs, environment_spec | None, sys_path)
        -> ("ready", {"schemas", "environment": class name | None, "get_reward": bool}) | ("error", why)
    ("reset", slot, row_kwargs)       -> ("ok", observation str | None) | ("raised", why)
    ("call", slot, name, arguments)   -> ("ok", text) | ("raised", why)
    ("reward", slot)                  -> ("ok", value) | ("raised", why)
    ("score", spec, slots, kwargs)    -> ("ok", [value, ...]) | ("raised", why): the reward function
                                         `spec` on these slots' answers, with environments= their instances

Only the tools named at load time (and the public methods of the environment class) can be
called: a name the model writes is looked up in that table, never with getattr on a module. A
tool's result goes back as `str(result)`, as TRL renders it, cut at MAX_RESULT_CHARS + 1
characters so a tool that returns 10 MB costs the pipe no more than that.

What it is not: a sandbox. User code runs with the trainer's permissions; the process boundary is
there so that a hung or crashing tool can be killed without taking the trainer with it.
"""
from __future__ import annotations

import os
import sys
from typing import Any

from fasttrain.envs.reward_functions import _as_number, _describe, _load, _read_frame, _write_frame, parse_reward_spec

MAX_RESULT_CHARS = 1 << 20          # 1 Mi characters; longer results are over any rollout budget here
RESERVED_METHODS = ("reset", "get_reward")


def environment_methods(cls: type) -> dict[str, Any]:
    """The tools of an environment class as TRL takes them: its public functions other than
    `reset` and `get_reward` (listed on the class, so properties are not evaluated)."""
    import inspect
    return {n: f for n, f in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not n.startswith("_") and n not in RESERVED_METHODS}


def _schema(fn) -> dict:
    from transformers.utils import get_json_schema
    return get_json_schema(fn)


class _Served:
    """The worker's state: the tool table, the environment class and its instances by slot."""

    def __init__(self, tool_specs: list[str], env_spec: str | None):
        import asyncio
        self.loop = asyncio.new_event_loop()
        self.tools: dict[str, Any] = {}
        self.schemas: list[dict] = []
        for spec in tool_specs:
            fn, _ = _load(parse_reward_spec(spec), [])
            if fn.__name__ in self.tools:
                raise ValueError(f"two tools are named {fn.__name__!r}")
            self.tools[fn.__name__] = fn
            self.schemas.append(_schema(fn))
        self.env_cls = None
        self.methods: dict[str, Any] = {}
        self.instances: dict[int, Any] = {}
        self.scorers: dict[str, Any] = {}                  # reward functions that take environments=
        if env_spec:
            cls, _ = _load(parse_reward_spec(env_spec), [])
            if not callable(getattr(cls, "reset", None)):
                raise TypeError(f"{env_spec}: the environment class must define reset(**row)")
            self.env_cls = cls
            self.methods = environment_methods(cls)
            for name, fn in self.methods.items():
                if name in self.tools:
                    raise ValueError(f"the environment method {name!r} has the name of a tool")
                self.schemas.append(_schema(fn))

    def run(self, out: Any) -> Any:
        import inspect
        return self.loop.run_until_complete(out) if inspect.isawaitable(out) else out

    def handle(self, msg: tuple) -> tuple:
        kind = msg[0]
        try:
            if kind == "reset":
                _, slot, row = msg
                if slot not in self.instances:            # constructed once, reset for every row
                    self.instances[slot] = self.env_cls()
                obs = self.run(self.instances[slot].reset(**row))
                return "ok", None if obs is None else str(obs)
            if kind == "call":
                _, slot, name, args = msg
                if name in self.tools:
                    fn = self.tools[name]
                elif name in self.methods and slot in self.instances:
                    fn = getattr(self.instances[slot], name)
                else:
                    raise ValueError(f"Tool {name} not found.")
                text = str(self.run(fn(**args)))
                return "ok", text[:MAX_RESULT_CHARS + 1]
            if kind == "score":
                _, spec, slots, kwargs = msg
                if spec not in self.scorers:
                    self.scorers[spec] = _load(parse_reward_spec(spec), [])[0]
                envs = [self.instances.get(s) for s in slots]
                out = self.run(self.scorers[spec](**kwargs, environments=envs))
                if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
                    return "ok", f"a {type(out).__name__}"
                return "ok", [_as_number(v) for v in out]
            if kind == "reward":
                inst = self.instances.get(msg[1])
                if inst is None or not callable(getattr(inst, "get_reward", None)):
                    raise ValueError("no environment instance with get_reward for this row")
                return "ok", self.run(inst.get_reward())
        except Exception as e:                               # noqa: BLE001 (the tool's error is the reply)
            return "raised", (_describe(e) if kind == "score" else str(e)[:MAX_RESULT_CHARS])
        return "raised", f"unknown request {kind!r}"


def _serve() -> None:
    import ctypes
    try:                                             # die with the trainer, even if hung
        ctypes.CDLL(None).prctl(1, 9)                # PR_SET_PDEATHSIG, SIGKILL (Linux)
    except (OSError, AttributeError):
        pass
    fd_in, fd_out = 0, os.dup(1)
    os.dup2(2, 1)                                    # the tools' prints go to stderr
    sys.stdout = sys.stderr
    served = None
    while True:
        try:
            msg = _read_frame(fd_in)
        except EOFError:
            return
        if msg[0] == "load":
            _, tool_specs, env_spec, path = msg
            sys.path[:0] = [p for p in path if p not in sys.path]
            try:
                served = _Served(tool_specs, env_spec)
                cls = served.env_cls
                _write_frame(fd_out, ("ready", {"schemas": served.schemas,
                                                "environment": cls.__name__ if cls is not None else None,
                                                "get_reward": callable(getattr(cls, "get_reward", None))}))
            except BaseException as e:               # noqa: BLE001 (report any import failure)
                _write_frame(fd_out, ("error", _describe(e)))
            continue
        _write_frame(fd_out, served.handle(msg))


if __name__ == "__main__":
    _serve()
