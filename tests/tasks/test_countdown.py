"""Countdown: the generator is a pure function of its seed, the parser computes exact values with
the usual precedence and refuses hostile input with a CountdownError, and the rewards score hand
cases as documented."""
import json
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fasttrain.tasks import countdown as cd
from fasttrain.tasks.countdown import CountdownError, check, parse
from fasttrain.train.run_files import read_jsonl

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- generator --------------------------------------------------------------------------------

def test_generator_is_a_pure_function_of_the_seed():
    a, b = cd.generate(40, seed=3), cd.generate(40, seed=3)
    assert a == b
    assert a != cd.generate(40, seed=4)
    assert [len(r["nums"]) for r in a[:4]] == [3, 4, 3, 4]


def test_packaged_files_are_the_generators_output(tmp_path):
    train, probe = cd.write_dataset(tmp_path)
    assert train.read_bytes() == cd.TRAIN_FILE.read_bytes()
    assert probe.read_bytes() == cd.PROBE_FILE.read_bytes()


def test_every_packaged_problem_is_solvable_and_the_probe_is_unseen():
    train = read_jsonl(cd.TRAIN_FILE)
    probe = read_jsonl(cd.PROBE_FILE)
    assert (len(train), len(probe)) == (1000, 100)
    for r in train + probe:
        assert check(r["solution"], r["nums"], r["target"]) == (True, "solved"), r
        assert 1 <= r["target"] <= 100 and r["target"] not in r["nums"]
        assert f"{r['nums']}" in r["prompt"] and f"equals {r['target']}." in r["prompt"]
    assert not {cd.problem_key(r) for r in train} & {cd.problem_key(r) for r in probe}
    assert len({cd.problem_key(r) for r in train}) == len(train)
    assert len({r["id"] for r in train + probe}) == len(train) + len(probe)


# ---- parser -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value, numbers", [
    ("2 + 3 * 4", 14, (2, 3, 4)),              # * binds tighter
    ("(2 + 3) * 4", 20, (2, 3, 4)),
    ("8 - 3 - 2", 3, (8, 3, 2)),               # left-associative (right would give 7)
    ("16 / 4 / 2", 2, (16, 4, 2)),             # left-associative (right would give 8)
    ("1/10 + 2/10", Fraction(3, 10), (1, 10, 2, 10)),   # exact: floats give 0.30000000000000004
    ("((7))", 7, (7,)),
    ("3 × 4 ÷ 2 − 1", 5, (3, 4, 2, 1)),        # the unicode signs models write
    ("25 + 14 = 39", 39, (25, 14)),
])
def test_parser_hand_cases(text, value, numbers):
    e = parse(text)
    assert e.value == value and e.numbers == numbers


@pytest.mark.parametrize("text, why", [
    ("", "empty"), ("2 ** 3", "expected a number"), ("-3 + 5", "unary minus"), ("5 / (3 - 3)", "division by zero"),
    ("1234567", "digits"), ("007", "leading zero"), ("1.5 * 2", "whole numbers"), ("(1 + 2", "missing ')'"),
    ("1 2", "operator is missing"), ("3 + 4 = 7 = 7", "'='"), ("import os", "unexpected character"),
    ("(" * 17 + "1" + ")" * 17, "deeper"), ("999999 * 999999 * 999999", "exceeds"),
    ("1+" * 50 + "1", "tokens"), ("1" * 201, "characters"),
])
def test_parser_refuses_with_a_reason(text, why):
    with pytest.raises(CountdownError) as e:
        parse(text)
    assert why in str(e.value)


def test_check_hand_cases():
    assert check("(25 - 5) * 2", [25, 5, 2], 40) == (True, "solved")
    assert check("25 + 5", [25, 5, 2], 30)[0]                      # at most once: not every number
    assert check("5 * 5", [25, 5, 2], 25)[1].startswith("uses [5]")  # 5 given once, used twice
    assert check("5 * 5", [5, 5, 2], 25)[0]                        # given twice: fine
    assert not check("3 + 4", [25, 5, 2], 7)[0]                    # numbers not given
    assert check("25 + 5 = 31", [25, 5], 30)[1] == "states 31 but the expression equals 30"
    assert check("25 - 5", [25, 5], 30)[1] == "equals 20, not 30"
    assert check("(25 + 5", [25, 5], 30)[1].startswith("not an expression")


# ---- rewards (TRL's signature) ----------------------------------------------------------------

def test_rewards_hand_cases():
    completions = ["<answer>(25 - 5) * 2</answer>", "<answer>25 + 2</answer>", "<answer>25 +</answer>",
                   "the answer is 40", "<answer>1</answer> then <answer>25*2-5*2</answer>",
                   [{"role": "assistant", "content": "<answer>2 * (25 - 5)</answer>"}]]
    cols = {"nums": [[25, 5, 2]] * 6, "target": [40] * 6, "solution": ["x"] * 6}
    assert cd.answer(prompts=["p"] * 6, completions=completions, completion_ids=[[1]] * 6, **cols) \
        == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]          # the 5th's last block uses 2 twice
    assert cd.format(prompts=["p"] * 6, completions=completions, completion_ids=[[1]] * 6, **cols) \
        == [1.0, 1.0, 0.5, 0.0, 1.0, 1.0]
    # the last block counts
    assert cd.answer(completions=["<answer>1</answer><answer>(25 - 5) * 2</answer>"], nums=[[25, 5, 2]],
                     target=[40]) == [1.0]


# ---- fuzzing: hostile input ends in CountdownError, values match a float64-free reference ------

ALPHABET = "0123456789+-*/()= ×÷x.,abc<>\n\t" + "\u00e9\U0001f600"


@FUZZ
@given(st.text(alphabet=ALPHABET, max_size=400) | st.text(max_size=400))
def test_any_text_parses_or_is_refused(text):
    try:
        e = parse(text)
    except CountdownError:
        return
    assert isinstance(e.value, Fraction) and all(0 <= n <= 999_999 for n in e.numbers)


def trees():
    leaf = st.integers(0, 999_999)
    return st.recursive(leaf, lambda kids: st.tuples(kids, st.sampled_from("+-*/"), kids), max_leaves=12)


def render(t):
    return str(t) if isinstance(t, int) else f"({render(t[0])} {t[1]} {render(t[2])})"


def reference(t):
    """Exact value of a tree, or None when it divides by zero (computed without the parser)."""
    if isinstance(t, int):
        return Fraction(t)
    a, b = reference(t[0]), reference(t[2])
    if a is None or b is None or (t[1] == "/" and b == 0):
        return None
    return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[t[1]]


def too_big(t):
    """Does any intermediate value of the tree pass the parser's magnitude limit?"""
    if isinstance(t, int):
        return False
    v = reference(t)
    cap = cd.DEFAULT_LIMITS.max_magnitude
    big = v is not None and (abs(v.numerator) > cap or v.denominator > cap)
    return big or too_big(t[0]) or too_big(t[2])


@FUZZ
@given(trees())
def test_parser_equals_the_exact_reference_on_random_trees(t):
    text, want = render(t), reference(t)
    if len(text) > cd.DEFAULT_LIMITS.max_chars or too_big(t):
        with pytest.raises(CountdownError):
            parse(text)
        return
    if want is None:
        with pytest.raises(CountdownError, match="division by zero"):
            parse(text)
        return
    assert parse(text).value == want


@FUZZ
@given(st.integers(17, 5000), st.sampled_from(["(", "((1+", "(-"]))
def test_deep_nesting_is_refused_without_recursion(n, unit):
    with pytest.raises(CountdownError):
        parse(unit * n + "1" + ")" * n)


@FUZZ
@given(st.lists(st.text(max_size=60) | st.sampled_from(["<answer>", "</answer>", "1+2", "9" * 40]), max_size=30))
def test_rewards_never_raise_and_stay_in_range(parts):
    text = "".join(parts)
    assert cd.answer(completions=[text], nums=[[1, 2, 3]], target=[3])[0] in (0.0, 1.0)
    assert cd.format(completions=[text])[0] in (0.0, 0.5, 1.0)


def test_a_megabyte_of_text_is_refused_unread():
    with pytest.raises(CountdownError, match="characters"):
        parse("(" * 1_000_000)
    assert cd.answer(completions=["<answer>" + "1+" * 500_000 + "1</answer>"], nums=[[1]], target=[1]) == [0.0]


def test_small_variant_files_are_the_generators_output_and_within_its_bounds(tmp_path):
    train, probe = cd.write_dataset(tmp_path, variant="countdown_small")
    assert (train.name, probe.name) == ("countdown_small_train.jsonl", "countdown_small_probe.jsonl")
    for made, packaged in zip((train, probe), cd.variant_files("countdown_small")):
        assert made.read_bytes() == packaged.read_bytes()
    rows = [json.loads(l) for f in (train, probe) for l in f.read_text().splitlines()]
    assert len(rows) == 1100 and len({cd.problem_key(r) for r in rows}) == 1100    # probe unseen
    for r in rows:
        assert len(r["nums"]) == 3 and max(r["nums"]) <= 10 and 1 <= r["target"] <= 20
        assert check(r["solution"], r["nums"], r["target"]) == (True, "solved"), r
    with pytest.raises(ValueError, match="known variants are countdown, countdown_small"):
        cd.variant_files("countdown_tiny")
