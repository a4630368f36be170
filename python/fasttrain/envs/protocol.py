"""The verifier protocol: channels, prompts, scores, and what an environment must offer.

This file is types only; it imports nothing from the rest of fasttrain, so user verifiers can
depend on it without pulling in the built-in environment's data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

# Core value given to an answer that could not be scored (no tags, unparseable, crashed verifier).
# Valid built-in answers have core in (-1, 1), so an invalid answer is never above a valid one.
INVALID_CORE = -1.0


class DatasetError(ValueError):
    """The dataset or the probe set cannot be used; the message names the key and the fix."""


@dataclass(frozen=True)
class Channel:
    """One reward channel: `name` (snake_case), GDPO `priority` (weight of its z-score),
    and a one-line `description` with the formula and range."""

    name: str
    priority: float = 1.0
    description: str = ""


@dataclass(frozen=True)
class Prompt:
    """One task shown to the policy. `spec` is the full text to show the model (it already
    contains the answer format); `fields` holds whatever the environment needs to score it."""

    id: str
    spec: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Score:
    """Verdict on one answer. `channels` maps every declared channel name to a finite float.
    `valid` is False for answers that could not be scored (then `reason` says why and `core`
    is INVALID_CORE). `success` is `core > 0` (above break-even) for the prompt filter."""

    channels: dict[str, float]
    valid: bool
    core: float
    success: bool
    reason: str | None = None

    def total(self, channels: Sequence[Channel]) -> float:
        """Priority-weighted sum of the raw channel values (a log-friendly scalar reward;
        GDPO itself standardises each channel within a group before weighting)."""
        return float(sum(c.priority * self.channels[c.name] for c in channels))


@runtime_checkable
class Environment(Protocol):
    """What the trainer needs from an environment (built-in or plug-in)."""

    name: str
    channels: list[Channel]
    data_slices: tuple[str, ...]
    answer_format: str

    def prompts(self, split: str) -> list[Prompt]: ...

    def score(self, prompt: Prompt, answer_text: str, data_slice: str = "train") -> Score: ...

    def score_many(
        self, prompts: Sequence[Prompt], answers: Sequence[str], data_slice: str = "train"
    ) -> list[Score]: ...


def invalid_score(channels: Sequence[Channel], reason: str,
                  worst: Mapping[str, float] | None = None, **known: float) -> Score:
    """An invalid verdict: every channel at its `worst` value (default 0.0, core INVALID_CORE),
    overridden by `known` (e.g. partial format/syntax credit)."""
    values: dict[str, float] = {}
    for c in channels:
        v = (worst or {}).get(c.name, INVALID_CORE if c.name == "core" else 0.0)
        values[c.name] = float(known.get(c.name, v))
    return Score(channels=values, valid=False, core=INVALID_CORE, success=False, reason=reason)


def check_score(score: object, channels: Sequence[Channel]) -> str | None:
    """Why `score` breaks the protocol for these channels, or None if it is well formed."""
    if not isinstance(score, Score):
        return f"verifier returned {type(score).__name__}, not Score"
    if not isinstance(score.channels, Mapping):
        return "Score.channels is not a mapping"
    declared = [c.name for c in channels]
    missing = [n for n in declared if n not in score.channels]
    extra = [n for n in score.channels if n not in declared]
    if missing or extra:
        return f"channel mismatch: missing {missing}, unknown {extra}"
    for n in declared:
        v = score.channels[n]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return f"channel {n!r} has non-finite or non-numeric value {v!r}"
    if isinstance(score.core, bool) or not isinstance(score.core, (int, float)) \
            or not math.isfinite(score.core):
        return f"core is non-finite or non-numeric: {score.core!r}"
    if not isinstance(score.valid, bool) or not isinstance(score.success, bool):
        return "valid/success must be bool"
    return None
