"""The ladder's and the learning benchmark's intervals against values computed by hand: the t
quantile from its closed forms (1, 2 and 3 degrees of freedom, and the normal limit), the mean
and paired intervals of small lists, and the seeds x prompts table's variance components."""
import math

import pytest

from fasttrain.train.intervals import crossed_mean_interval, mean_interval, paired_difference, t_quantile

T2 = 0.95 / math.sqrt(2 * 0.975 * 0.025)        # df = 2: t = (2p - 1) / sqrt(2 p (1 - p))


def test_t_quantile_matches_the_closed_forms():
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-12)   # Cauchy
    assert t_quantile(0.975, 2) == pytest.approx(T2, rel=1e-12)
    t3 = t_quantile(0.975, 3)                   # df = 3: F(t) = 1/2 + (u/(1+u^2) + atan u)/pi, u = t/sqrt 3
    u = t3 / math.sqrt(3)
    assert 0.5 + (u / (1 + u * u) + math.atan(u)) / math.pi == pytest.approx(0.975, abs=1e-13)
    z, nu = 1.959963984540054, 1e5              # large df: Cornish-Fisher, z + (z^3 + z) / (4 nu) + O(nu^-2)
    assert t_quantile(0.975, nu) == pytest.approx(z + (z ** 3 + z) / (4 * nu), abs=1e-8)
    assert t_quantile(0.025, 2) == pytest.approx(-T2, rel=1e-12)
    assert t_quantile(0.975, 1) > t_quantile(0.975, 1.5) > t_quantile(0.975, 2)       # falls with df


def test_mean_interval_of_three_seeds():
    iv = mean_interval([1.0, 2.0, 3.0])         # mean 2, s = 1
    assert (iv.mean, iv.n, iv.df) == (2.0, 3, 2.0)
    assert iv.half_width == pytest.approx(T2 / math.sqrt(3), rel=1e-12)
    assert not iv.excludes_zero and iv.show() == "+2.000 [-0.484, +4.484]"   # 2 -+ 4.303/sqrt 3
    one = mean_interval([0.25])
    assert one.mean == 0.25 and math.isnan(one.low) and not one.excludes_zero and one.show() == "+0.250 (n=1)"


def test_paired_difference_uses_the_per_seed_differences():
    iv = paired_difference([1.0, 2.0, 3.0], [2.0, 4.0, 5.0])    # d = 1, 2, 2: mean 5/3, var 1/3
    assert iv.mean == pytest.approx(5 / 3, rel=1e-15)
    assert iv.half_width == pytest.approx(T2 / 3, rel=1e-12)
    assert iv.excludes_zero                     # 5/3 - 4.303/3 = 0.232 > 0
    assert iv.low == pytest.approx(5 / 3 - T2 / 3, rel=1e-12)
    # a shift every seed shares has zero spread: the interval is the point and excludes 0
    assert paired_difference([0.1, 0.5], [0.3, 0.7]).excludes_zero
    with pytest.raises(ValueError, match="same seeds"):
        paired_difference([1.0], [1.0, 2.0])


def test_crossed_interval_of_a_two_by_three_table():
    # y = [[1, 0, 1], [0, 0, 1]]: m = 1/2; MS_seed = 1/6, MS_prompt = 1/2, MS_error = 1/6 (by hand),
    # Var(m) = (1/6 + 1/2 - 1/6) / 6 = 1/12, Satterthwaite df = (1/2)^2 / (1/36 + 1/8 + 1/72) = 1.5
    iv = crossed_mean_interval([[1, 0, 1], [0, 0, 1]])
    assert iv.mean == 0.5 and iv.n == 6
    assert iv.df == pytest.approx(1.5, rel=1e-12)
    assert iv.half_width == pytest.approx(t_quantile(0.975, 1.5) * math.sqrt(1 / 12), rel=1e-12)


def test_crossed_interval_falls_back_to_the_error_term_and_to_one_axis():
    # seeds identical, prompts differ only by noise-free columns: MS_seed = 0, MS_error = 0,
    # MS_prompt = 2 * var([0, 1]) = 1 -> Var = 1 / 4, df = 1 / (1 / 1) = 1
    iv = crossed_mean_interval([[0, 1], [0, 1]])
    assert iv.df == pytest.approx(1.0) and iv.half_width == pytest.approx(math.tan(math.pi * 0.475) / 2, rel=1e-12)
    # one seed: the t-interval over prompts
    assert crossed_mean_interval([[1, 2, 3]]) == mean_interval([1, 2, 3])
    with pytest.raises(ValueError, match="same prompts"):
        crossed_mean_interval([[1, 2], [1]])
