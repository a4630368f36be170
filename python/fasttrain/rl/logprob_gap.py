"""The gap between the rollout's and the update's log-probs of the sampled tokens.

The rollout decodes on a static cache (one token at a time, a recurrent state for hybrid models)
and the update scores the same tokens with a different forward (all positions at once, a shared
prompt, chunked for hybrids): two implementations of one policy. Before the first optimizer step of
a batch they should give the same log-probs up to rounding; `rollout_logprob_gap` measures how far
apart they are, per step, so a drift (a bf16 state, a wrong position, a stale cache) shows up in
the metrics instead of as a silently biased importance ratio.
"""
from __future__ import annotations

import torch

__all__ = ["logprob_gap_parts"]


def logprob_gap_parts(behaviour: torch.Tensor, update: torch.Tensor, mask: torch.Tensor) -> tuple[float, float, int]:
    """(sum of |Δ log p|, max |Δ log p|, tokens) over the tokens where mask is set; behaviour and
    update [B, T] log-probs of the same sampled tokens. Sums rather than a mean, so ranks add up."""
    if behaviour.shape != update.shape or mask.shape != update.shape:
        raise ValueError(f"logprob_gap_parts: shapes differ: behaviour {tuple(behaviour.shape)}, "
                         f"update {tuple(update.shape)}, mask {tuple(mask.shape)}")
    m = mask.bool()
    d = (behaviour.detach().double() - update.detach().double()).abs()[m]
    if d.numel() == 0:
        return 0.0, 0.0, 0
    return float(d.sum()), float(d.max()), int(d.numel())
