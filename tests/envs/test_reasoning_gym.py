"""The reasoning-gym environment: rows deterministic per seed, the probe disjoint from the train rows
by question text, scores equal to the generator's own score_answer, a weighted mixture split by
weight, and unknown generators or settings refused with the close names."""
import sys

import pytest
import reasoning_gym

from fasttrain.envs import load_env
from fasttrain.envs.reasoning_gym import ReasoningGymError, extract_rg_answer, row_seed
from fasttrain.train.config import ConfigError, load_config

GENS = {"gcd": {"weight": 1.0}, "basic_arithmetic": {"weight": 2.0, "min_terms": 2, "max_terms": 3},
        "spell_backward": {"weight": 1.0}}


def _env(**kw):
    return load_env("reasoning-gym", generators=GENS, train_rows=80, probe_rows=20, **kw)


def _key(p):
    return (p.id, p.spec, p.fields["entry"]["answer"])


def test_rows_deterministic_per_seed_and_weighted():
    a, b, c = _env(data_seed=5), _env(data_seed=5), _env(data_seed=6)
    assert [_key(p) for p in a.prompts("train")] == [_key(p) for p in b.prompts("train")]
    assert [_key(p) for p in a.prompts("probe")] == [_key(p) for p in b.prompts("probe")]
    assert [p.spec for p in a.prompts("train")] != [p.spec for p in c.prompts("train")]
    counts = {}
    for p in a.prompts("train"):
        counts[p.fields["generator"]] = counts.get(p.fields["generator"], 0) + 1
    assert counts == {"gcd": 20, "basic_arithmetic": 40, "spell_backward": 20}       # 80 split 1:2:1
    probe = {}
    for p in a.prompts("probe"):
        probe[p.fields["generator"]] = probe.get(p.fields["generator"], 0) + 1
    assert probe == {"gcd": 5, "basic_arithmetic": 10, "spell_backward": 5}
    # the rows are reasoning-gym's own rows for the seed row_seed(...) gives
    ds = reasoning_gym.create_dataset("gcd", seed=row_seed(5, "gcd", "train", 0), size=10)
    first = [p for p in a.prompts("train") if p.fields["generator"] == "gcd"][0]
    assert first.spec == ds[0]["question"] and first.fields["entry"]["answer"] == ds[0]["answer"]


def test_probe_disjoint_and_no_duplicates():
    env = _env(data_seed=1)
    train, probe = env.prompts("train"), env.prompts("probe")
    tq = [p.spec for p in train]
    assert len(set(tq)) == len(tq)
    assert not set(tq) & {p.spec for p in probe}
    assert len({p.id for p in train + probe}) == len(train) + len(probe)
    # a generator with few distinct questions: duplicates and probe questions are dropped, and said
    small = load_env("reasoning-gym", generators={"gcd": {"min_value": 1, "max_value": 3, "min_numbers": 2,
                                                          "max_numbers": 2}}, train_rows=30, probe_rows=3)
    sq = [p.spec for p in small.prompts("train")]
    assert len(set(sq)) == len(sq) < 30
    assert not set(sq) & {p.spec for p in small.prompts("probe")}
    assert any("distinct questions" in r for r in small.short_rows)


def test_score_equals_reasoning_gyms_score_answer():
    env = _env(data_seed=2)
    rows = env.prompts("train")[::7] + env.prompts("probe")[::5]
    for p in rows:
        name, entry = p.fields["generator"], p.fields["entry"]
        own = reasoning_gym.get_score_answer_fn(name)
        gold = entry["answer"]
        for text, inner, fmt in [(f"<answer>{gold}</answer>", gold, 1.0),
                                 (f"think\n<answer> {gold}x </answer>", f"{gold}x", 1.0),
                                 (f"<answer>1</answer> then <answer>{gold}</answer>", gold, 0.5),
                                 (f"reasoning...\nAnswer: {gold}", gold, 0.0),
                                 ("no idea\n7", "7", 0.0),
                                 (f"<answer> {gold}\nmore", gold, 0.0)]:
            s = env.score(p, text)
            want = own(inner, entry)
            assert s.valid and s.channels["core"] == want == s.core and s.channels["format"] == fmt, (name, text)
            assert s.success == (want > 0)
        assert env.score(p, f"<answer>{gold}</answer>").core == 1.0
        bad = env.score(p, "  \n ")
        assert not bad.valid and bad.core == -1.0 and bad.channels == {"core": -1.0, "format": 0.0}
    many = env.score_many(rows, [f"<answer>{p.fields['entry']['answer']}</answer>" for p in rows])
    assert [s.core for s in many] == [1.0] * len(rows)


def test_extraction_rule():
    assert extract_rg_answer("a <answer> 12 </answer> b") == ("12", 1.0)
    assert extract_rg_answer("<answer>1</answer><answer>2</answer>") == ("2", 0.5)
    assert extract_rg_answer("so\nFinal answer: 9\n\n") == ("9", 0.0)
    assert extract_rg_answer("") == (None, 0.0)
    assert extract_rg_answer("<answer>2\n\nThere are 2 legs") == ("2", 0.0)          # never closed
    assert extract_rg_answer("<answer>") == (None, 0.0)


def test_unknown_generator_and_setting_refused_with_close_names():
    with pytest.raises(ReasoningGymError, match="no generator 'gdc'; close names: gcd"):
        load_env("reasoning-gym", generators={"gdc": {}})
    with pytest.raises(ReasoningGymError, match="'max_valu' is not a setting of gcd; close names: max_value"):
        load_env("reasoning-gym", generators={"gcd": {"max_valu": 10}})
    with pytest.raises(ReasoningGymError, match="weight"):
        load_env("reasoning-gym", generators={"gcd": {"weight": 0}})
    # through the trainer: a ConfigError before any weights load (Trainer loads the env first)
    from fasttrain.train import Trainer
    cfg = load_config({"env": {"name": "reasoning-gym", "generators": {"gcd": {"max_valu": 10}}},
                       "policy": {"model": "no-such-model-is-loaded"}, "advantages": {"priorities": {}}})
    with pytest.raises(ConfigError, match="max_value"):
        Trainer(cfg, progress=False)


def test_recipe_keys_and_missing_extra(monkeypatch):
    with pytest.raises(ConfigError, match="env.generators is read only with env.name = \"reasoning-gym\""):
        load_config({"env": {"name": "signal-a", "generators": {"gcd": {}}}})
    with pytest.raises(ConfigError, match="env.curriculum_lower"):
        load_config({"env": {"name": "reasoning-gym", "curriculum_lower": 0.8, "curriculum_upper": 0.5}})
    with pytest.raises(ConfigError, match="env.generators.gcd.x"):
        load_config({"env": {"name": "reasoning-gym", "generators": {"gcd": {"x": {"y": 1}}}}})
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ImportError, match=r"pip install 'fasttrain\[reasoning-gym\]'"):
        load_env("reasoning-gym", generators={"gcd": {}})
