"""What runs inside a worker of fasttrain.envs.worker_pool for tools and environment classes.

The pool calls these functions by spec ("fasttrain.envs.tool_worker:run_tool", ...); each keeps
what it loaded, and the environment instances by slot, in this module's state, which lives as
long as the worker process. fasttrain.envs.tools pins a slot to one single-worker pool, so a
slot's instance and its calls always meet in the same process.

Only the tools named at load time and the public methods of the environment class can be called:
a name the model writes is looked up in those tables, never with getattr on a module. A result
goes back as `str(result)` (as TRL renders it), cut at MAX_RESULT_CHARS + 1 characters, so a tool
that returns 10 MB costs the pipe no more than that; an exception goes back as `str(e)` (TRL's
`{"error": str(e)}` is built by the caller).

What it is not: a sandbox. User code runs with the trainer's permissions; the pool's process
boundary, deadline and memory watchdog are there so that it cannot take the trainer down.
"""
from __future__ import annotations

import inspect
from typing import Any

MAX_RESULT_CHARS = 1 << 20          # 1 Mi characters; longer results are over any rollout budget here
RESERVED_METHODS = ("reset", "get_reward")

_loaded: dict[str, Any] = {}        # spec -> the function or class it names
_instances: dict[int, Any] = {}     # slot -> this worker's environment instance
_loops: list = []


def _get(spec: str):
    if spec not in _loaded:
        from fasttrain.envs.worker_pool import import_spec, parse_spec
        _loaded[spec] = import_spec(parse_spec(spec))
    return _loaded[spec]


def _run(out: Any) -> Any:
    if not inspect.isawaitable(out):
        return out
    if not _loops:
        import asyncio
        _loops.append(asyncio.new_event_loop())
    return _loops[0].run_until_complete(out)


def load(tool_specs: list[str], env_spec: str | None) -> None:
    """Import the tools and the environment class now (fasttrain.envs.tools calls this in a fresh
    worker under the pool's load timeout, so a tool call's deadline never pays for the import)."""
    for spec in [*tool_specs, *([env_spec] if env_spec else [])]:
        _get(spec)


def environment_methods(cls: type) -> dict[str, Any]:
    """The tools of an environment class as TRL takes them: its public functions other than
    `reset` and `get_reward` (listed on the class, so properties are not evaluated)."""
    return {n: f for n, f in inspect.getmembers(cls, predicate=inspect.isfunction)
            if not n.startswith("_") and n not in RESERVED_METHODS}


def describe(tool_specs: list[str], env_spec: str | None) -> dict[str, Any]:
    """{"schemas": transformers' get_json_schema of each tool and environment method, "names":
    the spec of each plain tool by name, "environment": the class's name or None, "get_reward":
    whether it has one}. Raises (the caller reports it) on a bad tool."""
    from transformers.utils import get_json_schema
    schemas, names = [], {}
    for spec in tool_specs:
        fn = _get(spec)
        if fn.__name__ in names:
            raise ValueError(f"two tools are named {fn.__name__!r}")
        names[fn.__name__] = spec
        schemas.append(get_json_schema(fn))
    cls = None
    if env_spec:
        cls = _get(env_spec)
        if not callable(getattr(cls, "reset", None)):
            raise TypeError(f"{env_spec}: the environment class must define reset(**row)")
        for name, fn in environment_methods(cls).items():
            if name in names:
                raise ValueError(f"the environment method {name!r} has the name of a tool")
            schemas.append(get_json_schema(fn))
    return {"schemas": schemas, "names": names, "environment": cls.__name__ if cls is not None else None,
            "get_reward": cls is not None and callable(getattr(cls, "get_reward", None))}


def reset(env_spec: str, slot: int, row: dict[str, Any]) -> tuple[bool, str | None]:
    """reset(**row) of slot's instance (constructed on first use, then reused as TRL's pool does):
    (True, observation or None), or (False, str(e))."""
    try:
        if slot not in _instances:
            _instances[slot] = _get(env_spec)()
        obs = _run(_instances[slot].reset(**row))
        return True, None if obs is None else str(obs)
    except Exception as e:                            # noqa: BLE001 (the environment's error is the reply)
        _instances.pop(slot, None)
        return False, str(e)[:MAX_RESULT_CHARS]


def run_tool(tool_spec: str | None, env_spec: str | None, slot: int, name: str,
             arguments: dict[str, Any]) -> tuple[bool, str]:
    """One call: the plain tool `tool_spec`, or (tool_spec None) the method `name` of slot's
    environment instance. (True, str(result) cut at MAX_RESULT_CHARS + 1) or (False, str(e))."""
    try:
        if tool_spec is not None:
            fn = _get(tool_spec)
        else:
            if env_spec is None or name not in environment_methods(_get(env_spec)):
                raise ValueError(f"Tool {name} not found.")
            if slot not in _instances:
                raise LookupError("its environment instance was lost (its worker was restarted or its reset failed)")
            fn = getattr(_instances[slot], name)
        return True, str(_run(fn(**arguments)))[:MAX_RESULT_CHARS + 1]
    except Exception as e:                            # noqa: BLE001
        return False, str(e)[:MAX_RESULT_CHARS]


def get_reward(slot: int) -> Any:
    """get_reward() of slot's instance (raises when there is none: the caller reports it)."""
    if slot not in _instances:
        raise LookupError("no environment instance for this answer (its worker was restarted or its reset failed)")
    return _run(_instances[slot].get_reward())


def score(reward_spec: str, slots: list[int], kwargs: dict[str, Any]) -> Any:
    """The reward function `reward_spec` on these slots' answers, with environments= their
    instances (None where an instance is missing)."""
    return _run(_get(reward_spec)(**kwargs, environments=[_instances.get(s) for s in slots]))
