"""Loading environments by name, and the safety wrapper around user verifiers.

`load_env("signal-a")`, `load_env("signal-b", train_slice="slice1")`, or
`load_env("package.module:factory", **kwargs)`: the factory is called with the kwargs and must
return an object with the `Environment` protocol. Plug-ins are wrapped in `GuardedEnvironment`,
which turns every broken verdict (exception, wrong or missing channel, non-finite value,
wrong type) into an invalid `Score` whose `reason` says what happened, so a bad verifier costs
one answer's reward, never the run.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Sequence

from .protocol import Channel, Environment, Prompt, Score, check_score, invalid_score

BUILTINS = ("signal-a", "signal-b", "dataset")


class GuardedEnvironment:
    """Wraps a user environment; same protocol, but `score`/`score_many` never raise."""

    def __init__(self, inner: Any, spec: str = ""):
        for attr in ("name", "channels", "prompts", "score"):
            if not hasattr(inner, attr):
                raise TypeError(f"environment from {spec!r} has no {attr!r} (see fasttrain.envs.Environment)")
        channels = list(inner.channels)
        names = [c.name for c in channels if isinstance(c, Channel)]
        if len(names) != len(channels) or len(set(names)) != len(names) or not names:
            raise TypeError(f"environment from {spec!r}: channels must be a non-empty list of "
                            "fasttrain.envs.Channel with unique names")
        for c in channels:
            if not math.isfinite(c.priority) or c.priority < 0:
                raise TypeError(f"channel {c.name!r}: priority must be finite and >= 0")
        self.inner = inner
        self.name = str(inner.name)
        self.channels: list[Channel] = channels
        self.data_slices = tuple(getattr(inner, "data_slices", ("train",)))
        self.answer_format = str(getattr(inner, "answer_format", ""))
        self.invalid_count = 0

    def prompts(self, split: str) -> list[Prompt]:
        return list(self.inner.prompts(split))

    def _check(self, s: object) -> Score:
        why = check_score(s, self.channels)
        if why is not None:
            self.invalid_count += 1
            return invalid_score(self.channels, why)
        assert isinstance(s, Score)
        values = {c.name: float(s.channels[c.name]) for c in self.channels}  # declared order
        return Score(channels=values, valid=s.valid, core=float(s.core), success=s.success,
                     reason=s.reason)

    def score(self, prompt: Prompt, answer_text: str, data_slice: str = "train") -> Score:
        try:
            s = self.inner.score(prompt, answer_text, data_slice)
        except Exception as e:  # a user verifier's bug must not end the run
            self.invalid_count += 1
            return invalid_score(self.channels, f"verifier raised {type(e).__name__}: {str(e)[:200]}")
        return self._check(s)

    def score_many(self, prompts: Sequence[Prompt], answers: Sequence[str],
                   data_slice: str = "train") -> list[Score]:
        if len(prompts) != len(answers):
            raise ValueError("prompts and answers differ in length")
        batch = getattr(self.inner, "score_many", None)
        if batch is not None:
            try:
                out = list(batch(prompts, answers, data_slice))
                if len(out) == len(answers):
                    return [self._check(s) for s in out]
            except Exception:
                pass  # fall back to one at a time, so one bad answer spoils only itself
        return [self.score(p, a, data_slice) for p, a in zip(prompts, answers)]


def load_env(spec: str, **kwargs: Any) -> Environment:
    """Built-in "signal-a" / "signal-b" (kwargs: train_slice, holdout_slice for B), "dataset"
    (kwargs: see fasttrain.envs.dataset.DatasetEnvironment) or a plug-in "package.module:factory"
    (kwargs go to the factory)."""
    if spec == "dataset":
        from .dataset import DatasetEnvironment
        return DatasetEnvironment(**kwargs)
    if spec in BUILTINS:
        from .signal_env import SignalEnvironment
        return SignalEnvironment(spec[-1], **kwargs)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown environment {spec!r}: use one of {BUILTINS} or 'package.module:factory'")
    factory = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    if not callable(factory):
        raise TypeError(f"{spec!r} is not callable")
    return GuardedEnvironment(factory(**kwargs), spec)
