"""A training step's advantages from its scores: GDPO over the channels (fasttrain.rl.gdpo), then
the floor guard (advantages.guard), with the shares the metrics row logs; and the alarm when the
share of answers that carry a signal stays low for advantages.warn_steps steps."""
from __future__ import annotations

import torch

from fasttrain.rl import floor_guard, gdpo_advantages, guarded_answers, legacy_clamp, nonzero_share

__all__ = ["step_advantages", "low_share_warning"]


def step_advantages(scores, channel_names, weights: torch.Tensor, group_size: int,
                    a_cfg) -> tuple[torch.Tensor, dict[str, float]]:
    """(float32 advantages, one per answer of `scores` in order; their nonzero_adv_share,
    guarded_share and adv_abs_mean). `a_cfg`: the recipe's advantages section."""
    G = group_size
    rewards = torch.tensor([[s.channels[c] for c in channel_names] for s in scores], dtype=torch.float64)
    core = torch.tensor([s.core for s in scores], dtype=torch.float64)
    valid = torch.tensor([s.valid for s in scores])
    adv = gdpo_advantages(rewards, G, weights, a_cfg.batch_normalize).double()
    guarded = guarded_answers(core, valid, a_cfg.floor, a_cfg.guard_invalid)
    if a_cfg.guard == "projection":
        adv = floor_guard(adv, guarded, G)
    elif a_cfg.guard == "legacy_clamp":
        adv = legacy_clamp(adv, core)
    info = {"nonzero_adv_share": nonzero_share(adv), "guarded_share": float(guarded.double().mean()),
            "adv_abs_mean": float(adv.abs().mean())}
    return adv.to(torch.float32), info


def low_share_warning(a_cfg, share: float, in_row: int) -> tuple[int, str | None]:
    """(the steps in a row whose share of answers with a non-zero advantage is under
    advantages.warn_share, counting this one; the warning on the advantages.warn_steps-th)."""
    a = a_cfg
    in_row = in_row + 1 if share < a.warn_share else 0
    if in_row != a.warn_steps:
        return in_row, None
    return in_row, (f"the share of answers with a non-zero advantage has stayed under "
                    f"{a.warn_share:.0%} for {a.warn_steps} steps (now {share:.0%}): the floor guard "
                    f"(advantages.guard={a.guard!r}, advantages.floor={a.floor}, "
                    f"guard_invalid={a.guard_invalid}) zeroes every group whose answers are all "
                    f"invalid or at or below the floor. Lower the floor (advantages.floor=-inf), "
                    f"filter prompts (fasttrain filter), or raise rollout.group_size.")
