
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fasttrain.tasks.signal.lang import (FIELDS, FUNCTIONS, Node, SignalError, count_nodes, evaluate,
                                        lookback, parse)


def tiny_data(t=8, n=3, seed=0):
    rng = np.random.default_rng(seed)
    return {f: rng.normal(10, 3, (t, n)).astype(np.float32) for f in FIELDS}


def test_parse_precedence_and_canonical_text():
    assert str(parse("1 + 2 * close")) == "(1.0+(2.0*close))"
    assert str(parse("(1 + 2) * close")) == "((1.0+2.0)*close)"
    assert str(parse("close - open - high")) == "((close-open)-high)"     # left-associative
    assert str(parse("rank(ts_delta(close, 5)) * -1")) == "(rank(ts_delta(close,5))*-1.0)"
    assert str(parse("-volume")) == "(-volume)"
    assert count_nodes(parse("rank(-ts_delta(close,5))")) == 4
    assert lookback(parse("ts_mean(delay(close, 3), 10)")) == 3 + 9
    assert lookback(parse("ts_corr(close, ts_delta(volume, 4), 20)")) == 4 + 19


@pytest.mark.parametrize("text,stage", [
    ("", "tokenize"), ("   ", "tokenize"), ("closee", "tokenize"), ("__import__('os')", "tokenize"),
    ("clos\u00e9", "tokenize"), ("close ; volume", "tokenize"), ("1" * 30, "tokenize"),
    ("close +", "parse"), ("rank(close", "parse"), ("rank close", "parse"), ("close volume", "parse"),
    ("ts_mean(close, n)", "tokenize"), ("ts_mean(close, -3)", "parse"), ("ts_mean(close, close)", "parse"), ("()", "parse"),
    ("1e999 * close", "limits"), ("1e7 * close", "limits"), ("ts_mean(close, 61)", "limits"),
    ("ts_mean(close, 2.5)", "limits"), ("ts_std(close, 1)", "limits"), ("ts_delta(close, 0)", "limits"),
    ("ts_mean(ts_mean(ts_mean(close, 60), 60), 60)", "limits"),   # lookback 177 > 120
    ("(" * 10_000 + "close" + ")" * 10_000, "tokenize"),          # longer than max_chars
    ("(" * 60 + "close" + ")" * 60, "limits"),                   # depth, inside max_chars
    ("+".join(["close"] * 45), "limits"),                          # node count
])
def test_rejections_name_their_stage(text, stage):
    with pytest.raises(SignalError) as e:
        parse(text)
    assert e.value.stage == stage


def test_evaluator_matches_hand_computed_values():
    d = {f: np.zeros((4, 3), np.float32) for f in FIELDS}
    d["close"] = np.array([[1, 2, 3], [2, 2, 6], [4, 2, 3], [8, 2, 0]], np.float32)
    d["volume"] = np.array([[3, 1, 2], [1, 1, 1], [0, 5, 5], [2, 2, 9]], np.float32)
    ev = lambda s: evaluate(parse(s), d)
    np.testing.assert_allclose(ev("ts_mean(close, 2)")[1:], [[1.5, 2, 4.5], [3, 2, 4.5], [6, 2, 1.5]])
    np.testing.assert_allclose(ev("ts_mean(close, 2)")[0], [1, 2, 3])        # partial warm-up window
    np.testing.assert_allclose(ev("ts_delta(close, 1)")[1:], [[1, 0, 3], [2, 0, -3], [4, 0, -3]])
    np.testing.assert_allclose(ev("delay(close, 2)")[2:], d["close"][:2])
    np.testing.assert_allclose(ev("rank(close)")[1], [0.0, 0.5, 1.0])        # 2 < 2 (tie) < 6
    np.testing.assert_allclose(ev("rank(volume)")[0], [1.0, 0.0, 0.5])
    z = ev("zscore(close)")[0]
    np.testing.assert_allclose(z, [-np.sqrt(1.5), 0, np.sqrt(1.5)], rtol=1e-6)
    np.testing.assert_allclose(ev("zscore(volume)")[1], 0)                  # flat day -> 0
    np.testing.assert_allclose(ev("close / volume")[2], [0, 0.4, 0.6])       # x / 0 -> 0
    np.testing.assert_allclose(ev("log(-3 + close * 0)")[0], -np.log(4.0), rtol=1e-6)  # signed log
    np.testing.assert_allclose(ev("ts_std(close, 2)")[3], [2, 0, 1.5], rtol=1e-6)
    # ts_rank over 3 days: share of the window's other days strictly below today
    np.testing.assert_allclose(ev("ts_rank(close, 3)")[3], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(ev("ts_rank(close, 3)")[2], [1.0, 0.0, 0.0])   # 3 in (3, 6, 3): none below
    # ts_corr: close column 0 (1,2,4,8) vs volume column 0 (3,1,0,2) over the last 3 days
    want = np.corrcoef([2, 4, 8], [1, 0, 2])[0, 1]
    np.testing.assert_allclose(ev("ts_corr(close, volume, 3)")[3, 0], want, rtol=1e-6)
    assert ev("ts_corr(close, volume, 3)")[3, 1] == 0.0                      # flat column -> 0


def test_rolling_ops_against_loop_reference():
    d = tiny_data(t=40, n=4, seed=3)
    x, y = d["close"].astype(np.float64), d["volume"].astype(np.float64)
    w = 7
    got_mean = evaluate(parse(f"ts_mean(close, {w})"), d)
    got_std = evaluate(parse(f"ts_std(close, {w})"), d)
    got_rank = evaluate(parse(f"ts_rank(close, {w})"), d)
    got_corr = evaluate(parse(f"ts_corr(close, volume, {w})"), d)
    for t in range(w - 1, 40):
        xs, ys = x[t - w + 1:t + 1], y[t - w + 1:t + 1]
        np.testing.assert_allclose(got_mean[t], xs.mean(0), rtol=1e-5)
        np.testing.assert_allclose(got_std[t], xs.std(0), rtol=1e-4)
        np.testing.assert_allclose(got_rank[t], (xs < xs[-1]).sum(0) / (w - 1), rtol=1e-6)
        ref = [np.corrcoef(xs[:, i], ys[:, i])[0, 1] for i in range(4)]
        np.testing.assert_allclose(got_corr[t], ref, rtol=1e-4, atol=1e-5)


def test_evaluate_is_finite_on_overflowing_expressions():
    d = tiny_data()
    out = evaluate(parse("volume*volume*volume*volume*1000000*volume*volume*volume*volume*volume"), d)
    assert out.dtype == np.float32 and np.isfinite(out).all()


# ----------------------------------------------------------------------------- fuzzing

ADVERSARIAL = ["", " ", "(" * 10_000, ")" * 10_000, "(" * 10_000 + ")" * 10_000, "9" * 5000,
               "1e308*1e308", "-" * 5000 + "close", "rank(" * 200 + "close" + ")" * 200,
               "\u0000", "\ud7ff\uffff", "close\u200b", "ｃｌｏｓｅ", "<signal>", "ts_corr(,,)",
               "ts_mean(close, 99999999999999999999)", "0x10", "1_000", "close**2", "__class__",
               "lambda: 0", "import os", "close[0]", "\n".join(["close"] * 300)]


def _check_bounded(text: str) -> None:
    # parses to a tree or raises SignalError, never anything else (how fast: bench/bench_env.py)
    try:
        tree = parse(text)
        assert isinstance(tree, Node)
    except SignalError:
        pass


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_adversarial_strings_fail_cleanly(text):
    _check_bounded(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=600))
def test_fuzz_random_text(text):
    _check_bounded(text)


_ALPHABET = list(FIELDS) + list(FUNCTIONS) + ["(", ")", ",", "+", "-", "*", "/", " ", "5", "1e9",
                                              "0.5", "60", "61"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(_ALPHABET), max_size=120))
def test_fuzz_token_soup(parts):
    _check_bounded("".join(parts))


def _exprs():
    leaf = st.one_of(st.sampled_from(FIELDS),
                     st.floats(-1e6, 1e6, allow_nan=False).map(lambda v: f"({v!r})"))
    def extend(inner):
        win = st.integers(3, 10)
        return st.one_of(
            st.tuples(inner, st.sampled_from("+-*/"), inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(st.sampled_from(["abs", "log", "sign", "rank", "zscore"]), inner)
              .map(lambda t: f"{t[0]}({t[1]})"),
            st.tuples(st.sampled_from(["ts_mean", "ts_std", "ts_delta", "ts_rank", "delay"]), inner, win)
              .map(lambda t: f"{t[0]}({t[1]}, {t[2]})"),
            st.tuples(inner, inner, win).map(lambda t: f"ts_corr({t[0]}, {t[1]}, {t[2]})"),
        )
    return st.recursive(leaf, extend, max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_exprs())
def test_fuzz_valid_grammar_evaluates_finite(text):
    d = tiny_data(t=60, n=5)
    try:
        tree = parse(text)
    except SignalError as e:
        assert e.stage == "limits"   # grammatical by construction; only a limit may refuse it
        return
    out = evaluate(tree, d)
    assert out.shape == (60, 5) and out.dtype == np.float32 and np.isfinite(out).all()
