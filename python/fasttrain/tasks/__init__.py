"""fasttrain.tasks — the built-in tasks, in one home (the layer above fasttrain.envs: each task is
an environment, or a dataset plus reward functions, written against envs' protocol).

    signal       the seed task: a trading-signal expression scored on twelve channels over a frozen
                 synthetic panel, worlds A and B (`env.name = "signal-a"`, the default; `"signal-b"`);
                 the recipe defaults it brings (fasttrain.tasks.signal.ENV_NAME, PRIORITIES)
    countdown    reach a target from given numbers with + - * / (rewards `answer`, `format`);
                 data: countdown_train.jsonl, countdown_probe.jsonl; recipe: countdown.toml
    calculator   countdown with a `calculate(expression)` tool (recipe: tools.toml)
    starter      what `fasttrain init NAME` writes: arithmetic rows, reward functions, a recipe

`load_env(name, **kwargs)` is the environment a recipe's `env.name` names: a built-in task's
environment by its name, anything else through fasttrain.envs.load_env ("dataset",
"reasoning-gym", a plug-in "package.module:factory").
"""
from __future__ import annotations

from typing import Any

from fasttrain import envs

__all__ = ["BUILTIN_TASKS", "load_env"]

BUILTIN_TASKS = ("signal-a", "signal-b")


def load_env(spec: str, **kwargs: Any) -> envs.Environment:
    """"signal-a" / "signal-b" (the signal task's worlds; kwargs: train_slice, holdout_slice for B,
    which also takes "train"/"holdout" as slice aliases), else fasttrain.envs.load_env(spec, **kwargs)."""
    if spec in BUILTIN_TASKS:
        from fasttrain.tasks.signal.env import SignalEnvironment
        return SignalEnvironment(spec[-1], **kwargs)
    return envs.load_env(spec, **kwargs)
