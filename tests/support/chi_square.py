"""Pearson's chi-square test of sampled counts against a distribution, with its power: the quantiles
in float64 from the regularised incomplete gamma, and the smallest total variation the test detects
(`detectable_tv`). Shared by the sampler's distribution tests."""
from __future__ import annotations

import math

import torch

ALPHA = 1e-4


def chi2_sf(x: float, k: float) -> float:
    return float(torch.special.gammaincc(torch.tensor(k / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def chi2_quantile(alpha: float, k: int) -> float:
    """c with P(chi2_k > c) = alpha (bisection on the survival function)."""
    lo, hi = 0.0, 10.0 * k + 200.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, k) > alpha else (lo, mid)
    return hi


def ncx2_sf(x: float, k: int, lam: float) -> float:
    """P(chi2_k(lam) > x): the Poisson(lam / 2) mixture of central chi-squares with k + 2j degrees."""
    h = lam / 2
    if h == 0:
        return chi2_sf(x, k)
    terms = int(h + 40 * math.sqrt(h) + 60)
    return sum(math.exp(-h + j * math.log(h) - math.lgamma(j + 1)) * chi2_sf(x, k + 2 * j) for j in range(terms))


def detectable_tv(n: int, k: int, alpha: float = ALPHA, power: float = 0.95) -> float:
    """The smallest total variation the chi-square test at `alpha` detects with probability `power`."""
    c = chi2_quantile(alpha, k)
    lo, hi = 0.0, 1e4
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ncx2_sf(c, k, mid) < power else (lo, mid)
    return math.sqrt(hi / (4 * n))


def chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic with the bins of expected count < 5 merged; (statistic, degrees of freedom)."""
    e = p * counts.sum()
    if bool((counts[e == 0] > 0).any()):
        return math.inf, max(int((e > 0).sum()) - 1, 1)      # a draw the distribution gives no mass
    counts, e = counts[e > 0], e[e > 0]
    small = e < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)]) if small.any() else counts
    exp = torch.cat([e[~small], e[small].sum().reshape(1)]) if small.any() else e
    return float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1
