"""GDPO advantages against hand-computed groups and invariants."""
import math

import pytest
import torch

from fasttrain.rl.gdpo import EPS, gdpo_advantages, group_standardize


def test_hand_computed_group():
    # One group of 4 answers, two channels: a 0/1 flag and a cost in basis points (range 100x wider).
    flag = [0.0, 1.0, 0.0, 1.0]
    cost = [-100.0, -100.0, 0.0, 0.0]
    r = torch.tensor([flag, cost], dtype=torch.float64).T
    # flag: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 1/sqrt(3) -> z = +-0.5 / (1/sqrt(3) + eps)
    zf = 0.5 / (1 / math.sqrt(3) + EPS)
    # cost: mean -50, unbiased std sqrt(4 * 2500 / 3) = 100/sqrt(3) -> z = +-50 / (100/sqrt(3) + eps)
    zc = 50.0 / (100 / math.sqrt(3) + EPS)
    w = torch.tensor([3.0, 1.0])
    expect = [3 * -zf + -zc, 3 * zf + -zc, 3 * -zf + zc, 3 * zf + zc]
    got = gdpo_advantages(r, group_size=4, weights=w, batch_normalize=False)
    assert got.tolist() == pytest.approx(expect, rel=1e-6)
    # The narrow channel (weight 3) dominates the wide one (weight 1), as its priority says:
    # answer 1 (flag on, cost bad) beats answer 2 (flag off, cost good).
    assert got[1] > got[2]


def test_wide_channel_does_not_drown_narrow_one():
    g = torch.Generator().manual_seed(1)
    r = torch.rand(24, 3, generator=g, dtype=torch.float64)
    wide = r.clone()
    wide[:, 1] = wide[:, 1] * 1e4 - 5e3          # same ranks, 10,000x the range
    a = gdpo_advantages(r, 6, torch.tensor([1.0, 1.0, 1.0]))
    b = gdpo_advantages(wide, 6, torch.tensor([1.0, 1.0, 1.0]))
    # z-scores are scale-free up to the eps in the denominator (std ~0.3 vs ~3000)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_constant_channel_contributes_exactly_zero():
    r = torch.tensor([[0.3, 0.1], [0.3, 0.7], [0.3, 0.2]], dtype=torch.float64)  # channel 0 constant
    z = group_standardize(r, 3)
    assert (z[:, 0] == 0).all()
    with_const = gdpo_advantages(r, 3, torch.tensor([5.0, 1.0]), batch_normalize=False)
    without = gdpo_advantages(r[:, 1:], 3, torch.tensor([1.0]), batch_normalize=False)
    assert torch.equal(with_const, without)


def test_groups_are_independent_and_zero_sum():
    r = torch.tensor([[1.0], [2.0], [3.0], [10.0], [10.0], [10.0]])
    a = gdpo_advantages(r, 3, batch_normalize=False)
    assert a[3:].abs().max() == 0                 # constant second group: zeros
    assert abs(float(a[:3].sum())) < 1e-6
    assert a[0] < a[1] < a[2]


def test_batch_normalize_gives_unit_std():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(48, 4, generator=g)
    a = gdpo_advantages(r, 12, torch.tensor([3.0, 1.0, 0.3, 0.2]), batch_normalize=True)
    assert abs(float(a.mean())) < 1e-6
    assert float(a.std()) == pytest.approx(1.0, rel=1e-3)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="group_size"):
        gdpo_advantages(torch.zeros(5, 2), 2)
    with pytest.raises(ValueError, match="weights"):
        gdpo_advantages(torch.zeros(4, 2), 2, torch.ones(3))
    with pytest.raises(ValueError, match="non-finite"):
        gdpo_advantages(torch.tensor([[math.nan], [0.0]]), 2)
