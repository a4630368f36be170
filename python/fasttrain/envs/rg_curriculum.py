"""The level controller of the reasoning-gym environment's curriculum (`env.curriculum = true`).

One global level per generator, the level of reasoning-gym's own curriculum for it
(`create_curriculum(name).set_global_level(level)`; every attribute moves together, capped at its
last level). Level 0 at the start. After each step the generator's mean score over that step's
answers (core clipped to [0, 1], an invalid answer 0) joins a window of the last `window` steps
that drew its rows. When the window is full:

    mean(window) >= upper  and level < top  ->  level + 1, window emptied
    mean(window) <  lower  and level > 0    ->  level - 1, window emptied

The bounds (defaults: window 8 steps, upper 0.75, lower 0.25) are the recipe's
env.curriculum_window, env.curriculum_upper, env.curriculum_lower. The state (levels and windows)
is a small JSON dict saved in every checkpoint, so a resumed run moves its levels as the
uninterrupted one did.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

__all__ = ["Curriculum", "top_level"]


def top_level(name: str) -> int:
    """The highest global level of a generator's reasoning-gym curriculum (ValueError: none)."""
    from reasoning_gym.factory import create_curriculum, has_curriculum
    if not has_curriculum(name):
        raise ValueError(f"env.curriculum: reasoning-gym has no curriculum for {name!r}")
    cur = create_curriculum(name)
    return max((len(a.levels) - 1 for a in cur.attributes.values()), default=0)


class Curriculum:
    def __init__(self, names: Sequence[str], window: int = 8, upper: float = 0.75, lower: float = 0.25):
        if window < 1:
            raise ValueError(f"env.curriculum_window: {window} is not an integer >= 1")
        if not 0 <= lower < upper <= 1:
            raise ValueError(f"env.curriculum_lower ({lower}) and env.curriculum_upper ({upper}) must satisfy "
                             "0 <= lower < upper <= 1")
        self.window, self.upper, self.lower = int(window), float(upper), float(lower)
        self.top = {n: top_level(n) for n in names}
        self.levels: dict[str, int] = {n: 0 for n in names}
        self.scores: dict[str, list[float]] = {n: [] for n in names}

    def observe(self, step_means: Mapping[str, float | None]) -> dict[str, float]:
        """Each generator's mean score this step (None: none of its rows were drawn). Returns the
        step's metrics: the level its rows were drawn at, the window's mean, the next level."""
        out: dict[str, float] = {}
        for n, m in step_means.items():
            level = self.levels[n]
            out[f"curriculum_level_{n}"] = level
            if m is not None:
                self.scores[n].append(float(m))
                self.scores[n] = self.scores[n][-self.window:]
            w = self.scores[n]
            mean = sum(w) / len(w) if w else math.nan
            out[f"curriculum_window_score_{n}"] = mean
            if len(w) == self.window:
                if mean >= self.upper and level < self.top[n]:
                    self.levels[n], self.scores[n] = level + 1, []
                elif mean < self.lower and level > 0:
                    self.levels[n], self.scores[n] = level - 1, []
            out[f"curriculum_next_level_{n}"] = self.levels[n]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"levels": dict(self.levels), "scores": {n: list(v) for n, v in self.scores.items()}}

    def load_state_dict(self, st: Mapping[str, Any]) -> None:
        self.levels = {n: int(st["levels"][n]) for n in self.levels}
        self.scores = {n: [float(x) for x in st["scores"][n]] for n in self.scores}
