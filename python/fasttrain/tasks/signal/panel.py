"""Frozen synthetic daily asset panel with planted effects, and its time slices.

What it is: a deterministic generator (numpy PCG64 from a seed) of `n_assets` x `n_days` daily
bars (open, high, low, close, volume, returns) whose next-day returns contain small, realistic
effects a good signal can find, and a `Slice` view that precomputes everything scoring needs.
What it is not: a model of any real market; effect sizes are set so that the planted 5-day
reversal has a daily cross-sectional IC of about 0.02-0.03 in world A (academic reversal
studies report gross ICs of this order) and random expressions earn nothing before costs.

Return model for asset i on day t+1 (all known at the close of day t go into mu):
    r[t+1,i] = beta_i·m[t+1] + mu[t,i] + sigma[t+1,i]·eps[t+1,i]
    mu[t,i]  = -k_rev·(5-day idiosyncratic return)            short-term reversal
               + k_vol·clip(volume shock z, -3, 3)·sd          high-volume return premium
               + k_mom·(idiosyncratic return over days t-120..t-20)   slow momentum
    m: market factor with GARCH(1,1) variance and Student-t(4) shocks (fat tails, clustering)
    sigma^2: per-asset GARCH(1,1) on the idiosyncratic shocks; eps ~ Student-t(4), unit variance
Volume: exp(AR(1) log-volume + shock), shocks also raised by |r|; price = cumulative product.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np


@dataclass(frozen=True)
class World:
    """Knobs of one synthetic world (A and B differ in seed and effect sizes)."""

    seed: int
    n_assets: int = 200
    n_days: int = 2000
    k_rev: float = 0.010      # reversal: E[r] per unit of 5-day idio return
    k_vol: float = 0.02       # volume premium in units of idio sd per z of the volume shock
    k_mom: float = 0.002      # momentum per unit of 100-day idio return
    idio_vol: float = 0.018   # median daily idiosyncratic volatility
    market_vol: float = 0.010


WORLD_A = World(seed=20240611)
WORLD_B = World(seed=977, k_rev=0.0035, k_vol=0.008, k_mom=0.001)


def _student_t(rng: np.random.Generator, shape, df: float = 4.0) -> np.ndarray:
    return rng.standard_t(df, size=shape) / np.sqrt(df / (df - 2.0))   # unit variance, fat tails


@lru_cache(maxsize=4)
def generate_panel(world: World) -> dict[str, np.ndarray]:
    """{field: [n_days, n_assets] float32}. Deterministic in `world`; cached per process."""
    rng = np.random.default_rng(world.seed)
    T, N = world.n_days, world.n_assets
    beta = rng.normal(1.0, 0.3, N)
    sd_i = world.idio_vol * np.exp(rng.normal(0, 0.35, N))           # [N] asset vol levels
    eps = _student_t(rng, (T, N))
    eps_m = _student_t(rng, T)
    vol_noise = rng.normal(0, 1, (T, N))
    log_vol_base = rng.normal(13.0, 1.0, N)

    # GARCH(1,1): h' = w + a·shock² + b·h with a + b = 0.97, long-run variance preserved
    a_g, b_g = 0.08, 0.89
    h_i = np.ones(N)
    h_m = 1.0
    idio = np.zeros((T, N))
    ret = np.zeros((T, N))
    vshock = np.zeros((T, N))
    lvs = np.zeros((T, N))
    lv = np.zeros(N)
    cum_idio = np.zeros((T + 1, N))                                  # prefix sums of idio
    for t in range(T):
        mu = np.zeros(N)
        if t >= 1:
            rev5 = cum_idio[t] - cum_idio[max(t - 5, 0)]
            mu -= world.k_rev * rev5
            mu += world.k_vol * np.clip(vshock[t - 1], -3, 3) * sd_i
            if t >= 120:
                mu += world.k_mom * (cum_idio[t - 20] - cum_idio[t - 120])
        s_i = sd_i * np.sqrt(h_i)
        s_m = world.market_vol * np.sqrt(h_m)
        e = s_i * eps[t]
        idio[t] = mu + e
        ret[t] = beta * s_m * eps_m[t] + idio[t]
        cum_idio[t + 1] = cum_idio[t] + idio[t]
        h_i = (1 - a_g - b_g) + a_g * eps[t] ** 2 * h_i + b_g * h_i
        h_m = (1 - a_g - b_g) + a_g * eps_m[t] ** 2 * h_m + b_g * h_m
        # volume shock: persistent AR(1) plus a jump with the size of today's move
        shock = 0.6 * vol_noise[t] + 0.5 * np.clip(np.abs(eps[t]) - 0.8, -1.0, 4.0)
        vshock[t] = shock
        lv = 0.7 * lv + shock
        lvs[t] = lv
    ret = np.clip(ret, -0.5, 0.5)
    close = 50.0 * np.exp(rng.normal(0, 0.6, N)) * np.cumprod(1.0 + ret, axis=0)
    prev = np.vstack([close[:1] / (1.0 + ret[:1]), close[:-1]])
    gap = 0.3 * ret + rng.normal(0, 0.004, (T, N))                    # overnight part of the move
    open_ = prev * (1.0 + gap)
    wick = np.abs(rng.normal(0, 0.5, (T, N, 2))) * (sd_i * np.sqrt(np.maximum(h_i, 0.2)))[None, :, None]
    high = np.maximum(open_, close) * (1.0 + wick[..., 0])
    low = np.minimum(open_, close) * (1.0 - np.minimum(wick[..., 1], 0.5))
    volume = np.exp(log_vol_base + 0.3 * lvs + 0.5 * vshock)
    return {k: v.astype(np.float32) for k, v in
            dict(open=open_, high=high, low=low, close=close, volume=volume, returns=ret).items()}

