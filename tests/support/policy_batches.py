"""Batches for the policy-loss kernels' tests (the emulator's op tests and its real-shape cases): random
log-probs with no token on a clip edge, a row with no active token, and each token's magnitude, the scale
that the derived bounds multiply."""
from __future__ import annotations

import math

import torch

LOSS = {"cispo": 0, "dapo": 1, "grpo": 2}
KL = {"k3": 0, "k3_ratio": 1}
EPS_LOW, EPS_HIGH, CAP, ZETA = 0.2, 0.28, 1.2, 0.02


def batch(B, T, seed, per_token):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 6 - 0.01).float().double()
    log_ratio = (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 1.4
    for edge in (math.log(1 - EPS_LOW), math.log(1 + EPS_HIGH), math.log(CAP)):  # no token on a clip edge
        log_ratio = torch.where((log_ratio - edge).abs() < 1e-3, log_ratio + 3e-3, log_ratio)
    old = (logp - log_ratio).float().double()
    ref = (logp + (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5)).float().double()
    adv = torch.randn(B, T, generator=g) if per_token else torch.randn(B, generator=g)
    mask = torch.rand(B, T, generator=g) < 0.8
    mask[-1] = False  # a row with no active token (GRPO counts the rows that have one)
    return logp, old, adv.double(), mask, ref


def token_magnitude(logp, old, adv, ref, beta, kl_type=0):
    r = torch.exp(logp - old)
    a = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)
    d = ref - logp
    kl_scale = r.clamp(min=1) if kl_type == KL["k3_ratio"] else 1
    return a.abs() * (1 + 20 * ZETA) * torch.maximum(r, torch.full_like(r, CAP)) * (1 + logp.abs()) + beta * (
        d.exp() + d.abs() + 1) * kl_scale


def expected_rowscale(mask, loss: str) -> torch.Tensor:
    """Each row's gradient scale [B] in float64: 1 / active tokens of the batch (CISPO, DAPO), or GRPO's
    1 / (the row's active tokens x the rows with one), 0 for a row with none."""
    w = mask.double()
    if loss == "grpo":
        row_w = w.sum(1)
        rows = float((row_w > 0).sum())
        return torch.where(row_w > 0, 1 / (row_w.clamp(min=1) * rows), torch.zeros(()).double())
    return torch.full((mask.shape[0],), 1 / float(w.sum())).double()
