"""REPO-R thermostat over a scripted entropy sequence: the zeta trace a hand would write down."""
import json

import pytest

from fasttrain.rl.repo_r import Thermostat


def test_scripted_trace():
    t = Thermostat()  # zeta_min 1e-4, zeta_max 0.05, warmup 5
    warm = [2.0, 2.2, 1.8, 2.1, 1.9]  # target = 2.0
    for e in warm:
        assert t.update(e) == 0.0
    assert t.target == pytest.approx(2.0)
    script = [1.5, 1.5, 1.5, 2.5, 1.0, 2.0] + [1.0] * 12 + [3.0] * 12
    got = [t.update(e) for e in script]
    want = [1e-4, 2e-4, 4e-4, 2e-4, 4e-4, 4e-4]  # below, below, below, above, below, equal (hold)
    z = 4e-4
    for _ in range(12):  # doubling up to the cap 0.05: 8e-4 ... 0.0256, then 0.05 and stays
        z = min(0.05, 2 * z)
        want.append(z)
    for _ in range(12):  # halving down: under zeta_min the next half becomes 0, and 0 stays 0
        z = z / 2 if z / 2 >= 1e-4 else 0.0
        want.append(z)
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert max(got) == 0.05 and got[-1] == 0.0 and min(got) >= 0.0
    assert [h["zeta"] for h in t.history] == [0.0] * 5 + got
    assert [h["action"] for h in t.history[:7]] == ["warmup"] * 5 + ["double", "double"]


def test_warmup_keeps_the_initial_zeta_and_state_round_trips():
    t = Thermostat(warmup=3, zeta=0.01)
    assert [t.update(e) for e in (1.0, 1.0, 1.0)] == [0.01] * 3
    t.update(0.5)
    state = json.loads(json.dumps(t.state_dict()))  # checkpoint-safe: plain values
    u = Thermostat()
    u.load_state_dict(state)
    assert (u.zeta, u.target, u.warmup, u.history) == (t.zeta, t.target, t.warmup, t.history)
    assert u.update(2.0) == t.update(2.0) == 0.01
    # Restoring mid-warmup continues the warmup.
    w = Thermostat()
    w.update(1.0)
    v = Thermostat()
    v.load_state_dict(w.state_dict())
    for e in (3.0, 3.0, 3.0, 3.0):
        v.update(e)
    assert v.target == pytest.approx(2.6)


def test_bad_values():
    with pytest.raises(ValueError, match="mean_entropy"):
        Thermostat().update(float("nan"))
    with pytest.raises(ValueError, match="zeta_min"):
        Thermostat(zeta_min=0.1, zeta_max=0.05)
    with pytest.raises(KeyError, match="missing"):
        Thermostat().load_state_dict({"zeta": 0.1})
