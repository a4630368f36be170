"""Token masks for the policy loss.

top_entropy_mask keeps the top-rho share of the batch's answer tokens by entropy: "Beyond the 80/20
rule" (Wang et al. 2025) trains on the ~20% high-entropy "forking" tokens only. Pure tensor code,
no host sync (the kept count is a tensor), so it runs inside a compiled or graph-captured step.
"""
from __future__ import annotations

import torch

__all__ = ["token_stats", "top_entropy_mask"]


def token_stats(entropy: torch.Tensor, action_mask: torch.Tensor, loss_mask: torch.Tensor) -> list[float]:
    """[model tokens, loss tokens, entropy summed over the model tokens] of a batch: what the
    step's token counts, mean length and mean entropy (the REPO-R thermostat's input) are made of.
    Both masks hold only tokens the model sampled; a multi-turn answer's tool tokens count nowhere."""
    m = action_mask.bool()
    return [float(m.sum()), float(loss_mask.bool().sum()), float((entropy * m).sum())]


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, rho: float = 0.2) -> torch.Tensor:
    """Bool [B, T]: the ceil(rho * n) active tokens of highest entropy over the whole batch, where n is
    the number of active (mask != 0) tokens. Ties are broken by position (earlier first), so exactly
    that many are kept. rho = 1 keeps every active token; inactive tokens are never kept.
    """
    if not isinstance(entropy, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise TypeError("top_entropy_mask: entropy and mask must be tensors")
    if entropy.shape != mask.shape:
        raise ValueError(f"top_entropy_mask: mask must have entropy's shape {tuple(entropy.shape)}, "
                         f"got {tuple(mask.shape)}")
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"top_entropy_mask: rho must be in (0, 1], got {rho}")
    active = (mask != 0).reshape(-1)
    ent = entropy.detach().reshape(-1).float()
    # Inactive tokens sort last; NaN entropies (should not happen) sort last too.
    key = torch.where(active & ~torch.isnan(ent), ent, torch.full_like(ent, -float("inf")))
    order = torch.argsort(key, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    n = active.sum()
    # ceil(rho * n) in float64, with a tolerance for rho * n landing a hair above an integer.
    k = torch.ceil(n.double() * rho - 1e-9).clamp(min=0).long()
    keep = (rank < k) & active
    return keep.reshape(entropy.shape)
