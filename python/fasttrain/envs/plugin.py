"""Loading environments by name, and the safety wrapper around user verifiers.

`load_env("dataset", ...)`, `load_env("reasoning-gym", ...)` or
`load_env("package.module:factory", **kwargs)`: the factory is called with the kwargs and must
return an object with the `Environment` protocol (the built-in tasks' names, "signal-a" and
"signal-b", are fasttrain.tasks.load_env's, which passes every other name here). Plug-ins are wrapped in `GuardedEnvironment`,
which turns every broken verdict (exception, wrong or missing channel, non-finite value,
wrong type) into an invalid `Score` whose `reason` says what happened, so a bad verifier costs
one answer's reward, never the run. Nothing is silent: a batch verifier (`score_many`) that
raises or returns the wrong number of scores is logged (once per environment) and counted in
`batch_failures` (the trainer writes it to metrics.jsonl) before the batch is scored one answer at
a time; a stateful plug-in (its `score_many` takes `record`) gets `record` passed through, so
probes leave it unchanged and resume can replay it. The wrapper's counters, and the plug-in's own
`state_dict()` when it has one (JSON-serialisable; given back through `load_state_dict`), are
saved in every checkpoint, so a resumed run counts on from where the checkpoint was.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
from typing import Any, Sequence

from .protocol import Channel, Environment, Prompt, Score, check_score, invalid_score

BUILTINS = ("dataset", "reasoning-gym")
log = logging.getLogger("fasttrain.envs")


def takes_record(score_many: Any) -> bool:
    """Whether a score_many accepts `record` (the mark of a stateful environment)."""
    try:
        return "record" in inspect.signature(score_many).parameters
    except (TypeError, ValueError):
        return False


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
        self.invalid_count = 0      # verdicts turned invalid because the verifier broke the protocol
        self.batch_failures = 0     # score_many calls that raised or returned the wrong length
        batch = getattr(inner, "score_many", None)
        self.stateful = batch is not None and takes_record(batch)

    def prompts(self, split: str) -> list[Prompt]:
        return list(self.inner.prompts(split))

    def counters(self) -> dict[str, int]:
        """Run totals for metrics.jsonl."""
        return {"verifier_batch_failures": self.batch_failures, "verifier_invalid": self.invalid_count}

    def state_dict(self) -> dict[str, Any]:
        """What carries over steps: the counters, and the plug-in's own state_dict() if it has one."""
        st: dict[str, Any] = {"invalid_count": self.invalid_count, "batch_failures": self.batch_failures}
        inner = getattr(self.inner, "state_dict", None)
        if callable(inner):
            st["inner"] = inner()
        return st

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.invalid_count, self.batch_failures = int(st["invalid_count"]), int(st["batch_failures"])
        if "inner" in st and callable(getattr(self.inner, "load_state_dict", None)):
            self.inner.load_state_dict(st["inner"])

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
                   data_slice: str = "train", record: bool = True) -> list[Score]:
        """Score a batch. `record` goes to a stateful plug-in (ignored by a stateless one). When the
        batch verifier fails, the failure is reported and each answer is scored on its own, so one
        bad answer spoils only itself."""
        if len(prompts) != len(answers):
            raise ValueError("prompts and answers differ in length")
        batch = getattr(self.inner, "score_many", None)
        if batch is not None:
            kw = {"record": record} if self.stateful else {}
            try:
                out = list(batch(prompts, answers, data_slice, **kw))
            except Exception as e:  # a user verifier's bug must not end the run
                self._batch_failed(f"raised {type(e).__name__}: {str(e)[:200]}")
            else:
                if len(out) == len(answers):
                    return [self._check(s) for s in out]
                self._batch_failed(f"returned {len(out)} scores for {len(answers)} answers")
            if self.stateful:  # one answer per call, still through score_many, so `record` holds
                return [self._score_one_recorded(p, a, data_slice, record) for p, a in zip(prompts, answers)]
        return [self.score(p, a, data_slice) for p, a in zip(prompts, answers)]

    def _score_one_recorded(self, prompt: Prompt, answer: str, data_slice: str, record: bool) -> Score:
        try:
            out = list(self.inner.score_many([prompt], [answer], data_slice, record=record))
        except Exception as e:
            self.invalid_count += 1
            return invalid_score(self.channels, f"verifier raised {type(e).__name__}: {str(e)[:200]}")
        if len(out) != 1:
            self.invalid_count += 1
            return invalid_score(self.channels, f"verifier returned {len(out)} scores for 1 answer")
        return self._check(out[0])

    def _batch_failed(self, why: str) -> None:
        self.batch_failures += 1
        if self.batch_failures == 1:
            log.warning("environment %s: score_many %s; scoring those answers one at a time (each "
                        "further failure is counted in metrics.jsonl as verifier_batch_failures)",
                        self.name, why)


def load_env(spec: str, **kwargs: Any) -> Environment:
    """"dataset" (kwargs: see fasttrain.envs.dataset.DatasetEnvironment), "reasoning-gym" (kwargs:
    fasttrain.envs.reasoning_gym.ReasoningGymEnvironment's) or a plug-in "package.module:factory"
    (kwargs go to the factory). The built-in tasks load through fasttrain.tasks.load_env."""
    if spec == "dataset":
        from .dataset import DatasetEnvironment
        return DatasetEnvironment(**kwargs)
    if spec == "reasoning-gym":
        from .reasoning_gym import ReasoningGymEnvironment
        return ReasoningGymEnvironment(**kwargs)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown environment {spec!r}: use one of {BUILTINS}, a built-in task's name "
                         f"(fasttrain.tasks.load_env) or 'package.module:factory'")
    factory = importlib.import_module(module_name)
    for part in attr.split("."):
        factory = getattr(factory, part)
    if not callable(factory):
        raise TypeError(f"{spec!r} is not callable")
    return GuardedEnvironment(factory(**kwargs), spec)
