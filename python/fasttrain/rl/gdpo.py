"""GDPO advantages: standardise every reward channel inside its prompt group, then weight.

GDPO (Group reward-Decoupled normalisation Policy Optimisation, NVIDIA 2026) normalises each
channel on its own before the weighted sum, so a channel with a wide range (a cost in basis
points) cannot drown a narrow one (a 0/1 format flag), and a channel that is constant within a
group contributes exactly zero. This file is pure tensor code: no model, no I/O.

    z[b, k] = (r[b, k] - mean_g r[:, k]) / (std_g r[:, k] + eps)     per group g of G answers
    A[b]    = sum_k w[k] z[b, k]
    A       = (A - mean(A)) / (std(A) + eps)                         optional, over the batch

std is the unbiased (n - 1) standard deviation, as in TRL's and verl's GRPO.
"""
from __future__ import annotations

import torch

__all__ = ["gdpo_advantages", "group_standardize"]

EPS = 1e-4


def group_standardize(values: torch.Tensor, group_size: int, eps: float = EPS) -> torch.Tensor:
    """values [B, K] (or [B]) -> z-scores inside each group of `group_size` consecutive rows."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if values.shape[0] % group_size:
        raise ValueError(f"values has {values.shape[0]} rows, not a multiple of group_size={group_size}")
    squeeze = values.dim() == 1
    v = values.reshape(values.shape[0] // group_size, group_size, -1)        # [N, G, K]
    mean = v.mean(dim=1, keepdim=True)
    std = v.std(dim=1, keepdim=True, unbiased=True) if group_size > 1 else torch.zeros_like(mean)
    dev = v - mean
    # A constant channel gives dev == 0 exactly only up to rounding: force exact zeros.
    z = torch.where(std > 0, dev / (std + eps), torch.zeros_like(dev))
    z = z.reshape(values.shape[0], -1)
    return z[:, 0] if squeeze else z


def gdpo_advantages(rewards: torch.Tensor, group_size: int, weights: torch.Tensor | None = None,
                    batch_normalize: bool = True, eps: float = EPS) -> torch.Tensor:
    """rewards [B, K] (channel values per answer, rows grouped by prompt) -> advantages [B].

    weights [K] are the channel priorities (default all 1). Computed in float64, returned in
    float32."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, K], got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    if not torch.isfinite(r).all():
        raise ValueError("rewards contains non-finite values")
    w = torch.ones(r.shape[1], dtype=torch.float64) if weights is None else \
        torch.as_tensor(weights, dtype=torch.float64, device=r.device)
    if w.shape != (r.shape[1],):
        raise ValueError(f"weights must be [{r.shape[1]}], got shape {tuple(w.shape)}")
    adv = (group_standardize(r, group_size, eps) * w).sum(dim=1)            # [B]
    if batch_normalize and adv.numel() > 1:
        std = adv.std(unbiased=True)
        adv = torch.where(std > 0, (adv - adv.mean()) / (std + eps), torch.zeros_like(adv))
    return adv.to(torch.float32)
