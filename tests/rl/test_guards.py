"""The floor guard is the Euclidean projection of the recipe (docs/design.md); the legacy clamp is the trap."""
import itertools
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fasttrain.rl.guards import floor_guard, guarded_answers, legacy_clamp, nonzero_share


def brute_force_projection(a: list[float], guarded: list[bool]) -> list[float] | None:
    """Closest point of {sum = 0, a_i <= 0 for guarded i} by enumerating which guarded entries
    sit at 0 (active constraints); on each face the projection is a mean shift of the rest.
    In exact rational arithmetic (the floats' own values as Fractions): any margin on the squared
    distances picks a wrong face somewhere. A relative one (1e-12) kept [0, 0, 0, 0] for
    a = [0, 1, -1.2e-7, 0] (answers 1-3 guarded), whose projection [6e-8, 0, -6e-8, 0] is closer by
    7e-15 of a distance of 1; an absolute one (1e-15 once) kept the first face found whenever the
    inputs were tiny (a = [0, 5.4e-9, 5.4e-9] picked a face 30% farther than the projection)."""
    n = len(a)
    x = [Fraction(v) for v in a]
    best, best_d = None, None
    gidx = [i for i in range(n) if guarded[i]]
    for k in range(len(gidx) + 1):
        for zero in itertools.combinations(gidx, k):
            rest = [i for i in range(n) if i not in zero]
            if not rest:
                cand = [Fraction(0)] * n
            else:
                lam = sum(x[i] for i in rest) / len(rest)
                cand = [Fraction(0) if i in zero else x[i] - lam for i in range(n)]
            if any(cand[i] > 0 for i in gidx):
                continue
            d = sum((u - w) ** 2 for u, w in zip(x, cand))
            if best_d is None or d < best_d:
                best, best_d = cand, d
    return None if best is None else [float(v) for v in best]


def test_hand_computed():
    # A = [2, 1, -1, -2], answer 0 guarded: lam solves min(2 - lam, 0) + (1 - lam) + (-1 - lam) + (-2 - lam) = 0.
    # With answer 0 at 0: lam = (1 - 1 - 2) / 3 = -2/3, and 2 - (-2/3) > 0 confirms the clamp.
    # a = [0, 1 + 2/3, -1 + 2/3, -2 + 2/3]
    out = floor_guard(torch.tensor([2.0, 1.0, -1.0, -2.0], dtype=torch.float64),
                      torch.tensor([True, False, False, False]), 4)
    assert out.tolist() == pytest.approx([0.0, 5 / 3, -1 / 3, -4 / 3], abs=1e-12)


def test_no_guard_is_identity_on_zero_sum_groups():
    a = torch.tensor([1.0, -0.5, -0.5, 3.0, -3.0, 0.0], dtype=torch.float64)
    assert torch.allclose(floor_guard(a, torch.zeros(6, dtype=torch.bool), 3), a)


def test_all_guarded_group_gets_zeros():
    a = torch.tensor([1.0, -0.5, -0.5, 2.0, -1.0, -1.0])
    g = torch.tensor([True, True, True, False, True, False])
    out = floor_guard(a, g, 3)
    assert out[:3].abs().max() == 0
    assert abs(float(out[3:].sum())) < 1e-6 and out[4] <= 0


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 6).flatmap(lambda n: st.tuples(
    st.lists(st.floats(-5, 5, allow_nan=False), min_size=n, max_size=n),
    st.lists(st.booleans(), min_size=n, max_size=n))))
def test_matches_brute_force_and_invariants(case):
    _check_against_brute_force(case)


def test_tiny_inputs_against_brute_force():
    """The cases hypothesis found when the brute force compared squared distances with a margin
    (absolute, then relative): the projections are [-2.7e-9, 0, 2.7e-9], not [0, 0, 0], and
    [6e-8, 0, -6e-8, 0], not [0, 0, 0, 0]."""
    _check_against_brute_force(([0.0, 5.385168749282029e-09, 5.385168749282029e-09], [True, True, False]))
    ref = brute_force_projection([0.0, 5.385168749282029e-09, 5.385168749282029e-09], [True, True, False])
    assert ref[1] == 0.0 and ref[0] < -2e-9 and ref[2] > 2e-9
    case = ([0.0, 1.0, -1.192092896e-07, 0.0], [False, True, True, True])
    _check_against_brute_force(case)
    ref = brute_force_projection(*case)
    assert ref[0] == pytest.approx(1.192092896e-07 / 2, rel=1e-12) and ref[1] == ref[3] == 0.0


def _check_against_brute_force(case):
    vals, guarded = case
    out = floor_guard(torch.tensor(vals, dtype=torch.float64), torch.tensor(guarded), len(vals)).tolist()
    ref = brute_force_projection(vals, guarded)
    assert out == pytest.approx(ref, abs=1e-9)
    assert abs(sum(out)) < 1e-9                                          # zero-sum
    assert all(o <= 1e-12 for o, g in zip(out, guarded) if g)            # guarded never positive


def test_guarded_answers_floor_and_invalid():
    core = torch.tensor([0.5, 0.0, -0.2, 0.3])
    valid = torch.tensor([True, True, True, False])
    assert guarded_answers(core, valid, 0.0).tolist() == [False, True, True, True]
    assert guarded_answers(core, valid, float("-inf")).tolist() == [False, False, False, True]
    assert guarded_answers(core, valid, float("-inf"), guard_invalid=False).tolist() == [False] * 4


def test_legacy_clamp_reproduces_the_trap():
    # A weak policy: every answer below break-even, GDPO still ranks them (zero-sum A).
    core = torch.tensor([-0.1, -0.3, -0.5, -0.9, -0.2, -0.4])
    a = torch.tensor([1.2, 0.4, -0.4, -1.2, 0.7, -0.7])
    legacy = legacy_clamp(a, core)
    # The trap: no positive advantage survives, the batch only pushes down, sums are negative.
    assert (legacy <= 0).all() and legacy.sum() < 0
    assert legacy.reshape(2, 3).sum(1).lt(0).all()
    # The projection with the same floor gives zeros (no push at all), not a one-sided push.
    proj = floor_guard(a, guarded_answers(core, torch.ones(6, dtype=torch.bool), 0.0), 3)
    assert proj.abs().max() == 0
    assert nonzero_share(legacy) == 0.5 and nonzero_share(proj) == 0.0


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="group_size"):
        floor_guard(torch.zeros(5), torch.zeros(5, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="guarded"):
        floor_guard(torch.zeros(4), torch.zeros(3, dtype=torch.bool), 2)
