"""REPO-R entropy thermostat: the controller of the REPO-R strength zeta (the recipe: docs/design.md).

REPO-R rescales advantages by the token's log-prob (fasttrain.ops.policy_loss, `zeta`): positive
advantages weigh rare tokens more, negative ones weigh them less, which holds entropy up. The
thermostat sets zeta from the policy's entropy: the target is the mean entropy of the first
`warmup` updates (zeta stays at its initial value meanwhile); after each later update zeta doubles
when entropy is below target (from 0 it restarts at zeta_min), halves when above (under zeta_min it
becomes 0), is capped at zeta_max and never negative. Every update is recorded in `history`.
"""
from __future__ import annotations

import math

__all__ = ["Thermostat"]


class Thermostat:
    def __init__(self, zeta_min: float = 1e-4, zeta_max: float = 0.05, warmup: int = 5, zeta: float = 0.0):
        if not 0.0 < zeta_min <= zeta_max:
            raise ValueError(f"Thermostat: need 0 < zeta_min <= zeta_max, got {zeta_min}, {zeta_max}")
        if warmup < 1:
            raise ValueError(f"Thermostat: warmup must be >= 1 update, got {warmup}")
        if not 0.0 <= zeta <= zeta_max:
            raise ValueError(f"Thermostat: zeta must be in [0, zeta_max={zeta_max}], got {zeta}")
        self.zeta_min, self.zeta_max, self.warmup = float(zeta_min), float(zeta_max), int(warmup)
        self.zeta = float(zeta)
        self.target: float | None = None
        self._warmup_entropies: list[float] = []
        self.history: list[dict] = []  # one entry per update: update, entropy, target, zeta, action

    def update(self, mean_entropy: float) -> float:
        """Record the mean entropy of the update just made; return the zeta for the next one."""
        entropy = float(mean_entropy)
        if not math.isfinite(entropy):
            raise ValueError(f"Thermostat.update: mean_entropy must be finite, got {mean_entropy}")
        action = "warmup"
        if self.target is None:
            self._warmup_entropies.append(entropy)
            if len(self._warmup_entropies) == self.warmup:
                self.target = sum(self._warmup_entropies) / self.warmup
        elif entropy < self.target:
            self.zeta = min(self.zeta_max, self.zeta_min if self.zeta == 0.0 else 2.0 * self.zeta)
            action = "double"
        elif entropy > self.target:
            half = self.zeta / 2.0
            self.zeta = 0.0 if half < self.zeta_min else half
            action = "halve"
        else:
            action = "hold"
        self.history.append({"update": len(self.history) + 1, "entropy": entropy, "target": self.target,
                             "zeta": self.zeta, "action": action})
        return self.zeta

    def state_dict(self) -> dict:
        """Plain Python values (JSON-serialisable), for the trainer's checkpoint."""
        return {"zeta_min": self.zeta_min, "zeta_max": self.zeta_max, "warmup": self.warmup, "zeta": self.zeta,
                "target": self.target, "warmup_entropies": list(self._warmup_entropies),
                "history": [dict(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        missing = {"zeta_min", "zeta_max", "warmup", "zeta", "target", "warmup_entropies", "history"} - set(state)
        if missing:
            raise KeyError(f"Thermostat.load_state_dict: missing keys {sorted(missing)}")
        self.zeta_min, self.zeta_max = float(state["zeta_min"]), float(state["zeta_max"])
        self.warmup, self.zeta = int(state["warmup"]), float(state["zeta"])
        self.target = None if state["target"] is None else float(state["target"])
        self._warmup_entropies = [float(e) for e in state["warmup_entropies"]]
        self.history = [dict(h) for h in state["history"]]
