import logging
import math

import pytest

from fasttrain.envs import GuardedEnvironment, INVALID_CORE, Score, load_env


def test_plugin_loads_and_scores():
    env = load_env("support.toy_plugin:make_env")
    assert isinstance(env, GuardedEnvironment)
    assert [c.name for c in env.channels] == ["core", "format"]
    p = env.prompts("train")[0]
    s = env.score(p, "6")
    assert s.valid and s.success and math.isclose(s.core, 1 - 1 / 7)
    assert s.channels == {"core": pytest.approx(6 / 7), "format": 1.0}
    # the verifier's own invalid verdict passes through unchanged
    bad = env.score(p, "seven")
    assert not bad.valid and bad.reason == "not an integer"


@pytest.mark.parametrize("mode,needle", [
    ("raise", "RuntimeError: verifier exploded"),
    ("missing", "missing ['format']"),
    ("extra", "unknown ['bonus']"),
    ("nan", "non-finite"),
    ("wrongtype", "not Score"),
])
def test_broken_verifier_becomes_invalid_answer(mode, needle):
    env = load_env("support.toy_plugin:make_env", mode=mode)
    p = env.prompts("train")[0]
    for s in [env.score(p, "7"), *env.score_many([p, p], ["7", "3"])]:
        assert isinstance(s, Score)
        assert not s.valid and not s.success
        assert s.core == INVALID_CORE and needle in s.reason
        assert set(s.channels) == {"core", "format"}
        assert all(math.isfinite(v) for v in s.channels.values())


def test_one_raising_answer_spoils_only_itself_in_a_batch():
    env = load_env("support.toy_plugin:make_env", mode="raise_on_boom")
    p = env.prompts("train")[0]
    out = env.score_many([p, p, p], ["7", "boom", "5"])
    assert [s.valid for s in out] == [True, False, True]
    assert out[0].core == 1.0 and out[2].core == pytest.approx(5 / 7)


def test_bad_specs_fail_loudly_at_load_time():
    with pytest.raises(ValueError):
        load_env("no_colon_here")
    with pytest.raises(ModuleNotFoundError):
        load_env("surely_missing_module_xyz:make")
    with pytest.raises(AttributeError):
        load_env("support.toy_plugin:nope")
    with pytest.raises(TypeError):
        load_env("support.toy_plugin:broken_factory")


@pytest.mark.parametrize("mode,needle", [("batch_raise", "raised RuntimeError: batch verifier exploded"),
                                         ("batch_short", "returned 1 scores for 2 answers")])
def test_a_failing_batch_verifier_is_reported_not_silent(mode, needle, caplog):
    """score_many that raises or returns the wrong number of scores: logged once, counted, and each
    answer is still scored on its own."""
    env = load_env("support.toy_plugin:make_env", mode=mode)
    p = env.prompts("train")[0]
    with caplog.at_level(logging.WARNING, logger="fasttrain.envs"):
        for _ in range(3):
            out = env.score_many([p, p], ["7", "3"])
            assert [s.valid for s in out] == [True, True] and out[0].core == 1.0
    assert env.batch_failures == 3
    logged = [r.getMessage() for r in caplog.records if r.name == "fasttrain.envs"]
    assert len(logged) == 1 and needle in logged[0] and "verifier_batch_failures" in logged[0]


def test_record_reaches_a_stateful_plugin():
    """A plug-in whose score_many takes `record` is stateful: record=False (probes) leaves it as it
    was, record=True (training, and the replay on resume) changes it; the trainer sees it as stateful."""
    from fasttrain.train.answers import is_stateful, score_answers
    env = load_env("support.toy_plugin:make_novelty_env")
    assert is_stateful(env) and not is_stateful(load_env("support.toy_plugin:make_env"))
    p = env.prompts("train")[0]
    score_answers(env, [p, p], ["1", "2"], "train", record=False)
    assert env.inner.seen == []
    first = score_answers(env, [p], ["1"], "train", record=True)
    again = score_answers(env, [p], ["1"], "train", record=False)
    assert first[0].core == 1.0 and again[0].core == 0.0 and env.inner.seen == ["1"]
    # a failing batch falls back to one answer per call, still with `record` honoured
    broken = load_env("support.toy_plugin:make_novelty_env", mode="batch_raise")
    out = broken.score_many([p, p], ["5", "6"], record=False)
    assert [s.valid for s in out] == [True, True] and broken.batch_failures == 1
