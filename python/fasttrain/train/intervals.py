"""95% intervals for learning claims: Student-t intervals of a mean over seeds, of a paired
difference (two recipes on the same seeds), and of the grand mean of a seeds x prompts table.

What this file is: pure arithmetic on lists of floats (no numpy, no scipy, no I/O), with the t
quantile computed here from the regularized incomplete beta function, so the ladder and the
learning benchmark need no statistics package. What it is not: a hypothesis-testing library; an
interval "excludes 0" is the only decision it makes.

Formulas (n values x_i, mean m, sample standard deviation s with n - 1 in the denominator):
    mean interval            m +- t(0.975, n - 1) * s / sqrt(n)
    paired difference        the mean interval of d_i = b_i - a_i (same seed i on both sides)
    seeds x prompts table    y[s][p], S seeds by P prompts, every cell filled (a crossed design
                             without replication: two-way random effects). With row means r_s,
                             column means c_p and grand mean m:
                               MS_seed   = P * sum_s (r_s - m)^2 / (S - 1)
                               MS_prompt = S * sum_p (c_p - m)^2 / (P - 1)
                               MS_error  = sum_sp (y - r_s - c_p + m)^2 / ((S - 1)(P - 1))
                             Var(m) = sigma_seed^2 / S + sigma_prompt^2 / P + sigma_error^2 / (S P)
                             is estimated without bias by (MS_seed + MS_prompt - MS_error) / (S P),
                             and its degrees of freedom by Satterthwaite's formula
                               (MS_s + MS_p - MS_e)^2 / (MS_s^2/(S-1) + MS_p^2/(P-1) + MS_e^2/((S-1)(P-1))).
                             So the interval covers both a new draw of seeds and a new draw of
                             held-out prompts. When the estimate is not positive (the seeds or
                             prompts vary less than the noise), MS_error / (S P) is used instead
                             with (S - 1)(P - 1) degrees of freedom.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Interval", "t_quantile", "mean_interval", "paired_difference", "crossed_mean_interval"]


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int                      # values (seeds; for a table: seeds x prompts)
    df: float                   # degrees of freedom of the t quantile (nan when n < 2)

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    @property
    def excludes_zero(self) -> bool:
        """True when the whole interval lies on one side of 0 (nan bounds: False)."""
        return self.low > 0 or self.high < 0

    def show(self, spec: str = "+.3f") -> str:
        """"+0.120 [+0.020, +0.220]"; a single value has no interval: "+0.120 (n=1)"."""
        if not math.isfinite(self.low):
            return f"{format(self.mean, spec)} (n={self.n})"
        return f"{format(self.mean, spec)} [{format(self.low, spec)}, {format(self.high, spec)}]"


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta: no convergence for a={a}, b={b}, x={x}")  # pragma: no cover


def _betainc(a: float, b: float, x: float, y: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1 and y = 1 - x given
    separately (for large df, x = df / (df + t^2) rounds to 1 while y keeps its digits)."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, y) / b


def _t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t), t * t / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with `df` (> 0, not necessarily whole) degrees of freedom,
    by bisection on the CDF to double precision."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p={p} must lie in (0, 1)")
    if not df > 0:
        raise ValueError(f"t_quantile: df={df} must be > 0")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    return (lo + hi) / 2.0


def _mean_var(xs: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    m = math.fsum(xs) / n
    return m, (math.fsum((x - m) ** 2 for x in xs) / (n - 1) if n > 1 else math.nan)


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """The t-interval of the mean of `values` (one per seed); one value gives nan bounds."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("mean_interval: no values")
    m, var = _mean_var(xs)
    n = len(xs)
    if n < 2:
        return Interval(m, math.nan, math.nan, n, math.nan)
    half = t_quantile(0.5 + level / 2.0, n - 1) * math.sqrt(var / n)
    return Interval(m, m - half, m + half, n, float(n - 1))


def paired_difference(before: Sequence[float], after: Sequence[float], level: float = 0.95) -> Interval:
    """The t-interval of mean(after_i - before_i): both lists in the same seed order."""
    if len(before) != len(after):
        raise ValueError(f"paired_difference: {len(before)} values before, {len(after)} after; "
                         "a paired difference needs the same seeds on both sides")
    return mean_interval([float(b) - float(a) for a, b in zip(before, after)], level)


def crossed_mean_interval(table: Sequence[Sequence[float]], level: float = 0.95) -> Interval:
    """The interval of the grand mean of `table[seed][prompt]` over a new draw of seeds and of
    prompts (module header); one seed falls back to the t-interval over prompts."""
    rows = [[float(v) for v in r] for r in table]
    S = len(rows)
    if S == 0 or not rows[0]:
        raise ValueError("crossed_mean_interval: empty table")
    P = len(rows[0])
    if any(len(r) != P for r in rows):
        raise ValueError("crossed_mean_interval: every seed must score the same prompts")
    if S == 1:
        return mean_interval(rows[0], level)
    if P == 1:
        return mean_interval([r[0] for r in rows], level)
    m = math.fsum(v for r in rows for v in r) / (S * P)
    rmean = [math.fsum(r) / P for r in rows]
    cmean = [math.fsum(r[p] for r in rows) / S for p in range(P)]
    ms_s = P * math.fsum((x - m) ** 2 for x in rmean) / (S - 1)
    ms_p = S * math.fsum((x - m) ** 2 for x in cmean) / (P - 1)
    df_e = (S - 1) * (P - 1)
    ms_e = math.fsum((rows[s][p] - rmean[s] - cmean[p] + m) ** 2 for s in range(S) for p in range(P)) / df_e
    combo = ms_s + ms_p - ms_e
    if combo > 0:
        var = combo / (S * P)
        df = combo ** 2 / (ms_s ** 2 / (S - 1) + ms_p ** 2 / (P - 1) + ms_e ** 2 / df_e)
    else:
        var, df = ms_e / (S * P), float(df_e)
    if var == 0:
        return Interval(m, m, m, S * P, df)
    half = t_quantile(0.5 + level / 2.0, df) * math.sqrt(var)
    return Interval(m, m - half, m + half, S * P, df)
