"""The advantage floor guard: answers that are invalid or score at or below the floor never get a
positive advantage, and every group stays zero-sum.

The guarded advantages of one group are the Euclidean projection of A onto
    C = { a : sum(a) = 0,  a_i <= 0 for every guarded i }.
KKT gives a_i = A_i - lam for free answers and a_i = min(A_i - lam, 0) for guarded ones, with the
single lam that makes the sum zero; lam is found by sorting the guarded values (as in Duchi et
al. 2008's projection onto the simplex). A group where every answer is guarded has C = {0}.

`legacy_clamp` is the seed's fallback ("a positive advantage becomes 0 when core <= 0"). It is
not a projection: it breaks zero-sum and, when most answers are below break-even, leaves a batch
that only pushes down. It exists to reproduce that trap, never as a default.
"""
from __future__ import annotations

import torch

__all__ = ["floor_guard", "guarded_answers", "legacy_clamp", "nonzero_share"]


def guarded_answers(core: torch.Tensor, valid: torch.Tensor, floor: float,
                    guard_invalid: bool = True) -> torch.Tensor:
    """bool [B]: the answers whose advantage may not be positive (core <= floor, or invalid)."""
    g = core.to(torch.float64) <= floor
    if guard_invalid:
        g = g | ~valid.to(torch.bool)
    return g


def floor_guard(advantages: torch.Tensor, guarded: torch.Tensor, group_size: int) -> torch.Tensor:
    """advantages [B], guarded bool [B], rows grouped by prompt -> projected advantages [B]."""
    if advantages.dim() != 1 or guarded.shape != advantages.shape:
        raise ValueError(f"advantages must be [B] and guarded the same shape, got "
                         f"{tuple(advantages.shape)} and {tuple(guarded.shape)}")
    if group_size < 1 or advantages.shape[0] % group_size:
        raise ValueError(f"{advantages.shape[0]} answers are not a multiple of group_size={group_size}")
    a = advantages.to(torch.float64).reshape(-1, group_size)                 # [N, G]
    g = guarded.to(torch.bool).reshape(-1, group_size)
    n_guarded = g.sum(dim=1)                                                 # [N]
    total = a.sum(dim=1)
    # Guarded values sorted descending; P[m] = sum of the m largest (m = 0..G).
    s = torch.where(g, a, torch.full_like(a, -torch.inf)).sort(dim=1, descending=True).values
    s_fin = torch.where(torch.isfinite(s), s, torch.zeros_like(s))
    prefix = torch.cat([torch.zeros_like(a[:, :1]), s_fin.cumsum(dim=1)], dim=1)   # [N, G+1]
    # The m largest guarded values sit at 0 (A_i >= lam); every other answer is A_i - lam, so
    # lam_m = (sum(A) - P[m]) / (G - m). The solution is the smallest m whose next guarded value
    # is already <= lam_m (sum(a) is decreasing in lam, so that m is unique).
    m = torch.arange(group_size + 1, dtype=torch.float64)
    lam = (total[:, None] - prefix) / (group_size - m).clamp_min(1)                # [N, G+1]
    nxt = torch.cat([s, torch.full_like(a[:, :1], -torch.inf)], dim=1)             # s[m], -inf past the end
    ok = (nxt <= lam) | (m[None, :] >= n_guarded[:, None])
    first = ok.to(torch.int64).argmax(dim=1)                                       # smallest valid m
    lam_star = lam.gather(1, first[:, None])                                       # [N, 1]
    n_free = group_size - n_guarded
    out = a - lam_star
    out = torch.where(g, out.clamp_max(0.0), out)
    out = torch.where((n_free == 0)[:, None], torch.zeros_like(out), out)          # C = {0}
    return out.reshape(-1).to(advantages.dtype)


def legacy_clamp(advantages: torch.Tensor, core: torch.Tensor) -> torch.Tensor:
    """The seed's fallback: a positive advantage becomes 0 when core <= 0. Not zero-sum."""
    return torch.where((advantages > 0) & (core <= 0), torch.zeros_like(advantages), advantages)


def nonzero_share(advantages: torch.Tensor, tol: float = 1e-6) -> float:
    """Share of answers whose advantage is not (numerically) zero."""
    return float((advantages.abs() > tol).to(torch.float64).mean())
