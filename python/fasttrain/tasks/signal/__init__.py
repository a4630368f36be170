"""The built-in signal task, worlds A and B: a frozen synthetic asset panel (`panel`), the signal
language the answers are written in (`lang`: parsed, never executed), the prompts (`prompts`) and
the environment that scores an answer on twelve channels (`env`, loaded as
fasttrain.tasks.load_env("signal-a") or `"signal-b"`).

The task's defaults for a recipe live here, and fasttrain.train.config reads them: ENV_NAME is the
environment a recipe gets when it names none (`env.name`), PRIORITIES the channel priorities it
gets when it sets none (`advantages.priorities`: the seed recipe's GDPO weights of the signal
channels; another environment, left at this default, keeps its own). Importing this package loads
no environment code.
"""
from __future__ import annotations

__all__ = ["ENV_NAME", "PRIORITIES"]

ENV_NAME = "signal-a"
PRIORITIES = {"core": 3.0, "stability": 1.0, "pattern_guard": 0.3, "complexity": 0.2}
