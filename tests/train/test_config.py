"""Config: recipes load, errors name the key and the allowed values, overrides, round trip."""
import math
import re
import tomllib
from pathlib import Path

import pytest

from fasttrain.train.config import (ConfigError, LossSection, config_hash, config_to_toml, list_recipes,
                                    load_config, load_recipe, recipe_path, saved_run_data)

LADDER = ["dapo", "cispo", "cispo_repo_r", "cispo_repo_r_filtered", "cispo_repo_r_dora", "dapo_repo_r_dora"]


def test_every_recipe_loads():
    assert set(LADDER + ["demo"]) <= set(list_recipes())
    for r in LADDER + ["demo"]:
        load_config(r)


@pytest.mark.parametrize("name", LADDER)
def test_ladder_recipes_are_the_seed_settings(name):
    c = load_config(name)
    assert (c.rollout.prompts_per_step, c.rollout.group_size, c.rollout.max_new_tokens) == (4, 12, 128)
    assert c.rollout.temperature == 1.0 and c.optim.lr == 1e-5 and c.loss.beta == 0.08
    assert (c.policy.rank, c.policy.alpha) == (32, 64.0)
    assert c.advantages.priorities == {"core": 3.0, "stability": 1.0, "pattern_guard": 0.3, "complexity": 0.2}
    assert (c.run.steps, c.probe.every, c.run.seed, c.probe.prompts) == (600, 100, 42, 50)
    bundle = "repo_r" in name
    assert c.loss.repo_r is bundle
    assert (c.loss.token_mask, c.loss.passes) == (("all", 2) if bundle else ("top_entropy", 1))
    assert c.loss.rho == 0.2
    assert c.loss.kind == name.split("_")[0]
    assert c.policy.adapter == ("dora" if name.endswith("dora") else "lora")
    assert bool(c.env.prompts) is name.endswith("filtered")


def test_unknown_key_names_key_and_allowed():
    with pytest.raises(ConfigError, match=r"unknown key 'loss.betta'.*allowed keys in \[loss\]: kind, beta"):
        load_config("cispo", ["loss.betta=0.1"])
    with pytest.raises(ConfigError, match=r"unknown section \[losss\]"):
        load_config({"losss": {"kind": "dapo"}})


def test_bad_values_name_key_and_allowed():
    with pytest.raises(ConfigError, match=r"loss.kind: 'ppo' is not allowed; allowed values: 'cispo', 'dapo', 'grpo'"):
        load_config("cispo", ["loss.kind=ppo"])
    with pytest.raises(ConfigError, match=r"rollout.group_size: 1 is not allowed; allowed: an integer >= 2"):
        load_config("cispo", ["rollout.group_size=1"])
    with pytest.raises(ConfigError, match=r"optim.lr: 'fast' is not a number"):
        load_config("cispo", ["optim.lr=fast"])
    with pytest.raises(ConfigError, match=r"loss.repo_r: 1 is not allowed; allowed values: true, false"):
        load_config("cispo", ["loss.repo_r=1"])
    for bad in ("1", "yes"):          # a switch with a third value: by type as well as by value
        with pytest.raises(ConfigError, match=r"policy.gradient_checkpointing: .* is not allowed; allowed values: "
                                              r"'auto', true, false"):
            load_config("cispo", [f"policy.gradient_checkpointing={bad}"])
    for good, want in (("auto", "auto"), ("true", True), ("false", False)):
        v = load_config("cispo", [f"policy.gradient_checkpointing={good}"]).policy.gradient_checkpointing
        assert v == want and type(v) is type(want)
    with pytest.raises(ConfigError, match=r"run.steps: 2.5 is not an integer"):
        load_config("cispo", ["run.steps=2.5"])
    with pytest.raises(ConfigError, match=r"section.key=value"):
        load_config("cispo", ["loss.kind"])
    with pytest.raises(ConfigError, match=r"zeta_min"):
        load_config("cispo", ["loss.zeta_min=0.1", "loss.zeta_max=0.01"])


def test_overrides_and_inf_floor():
    c = load_config("cispo", ["loss.kind=dapo", "rollout.group_size=8", "advantages.floor=-inf",
                              "advantages.priorities.core=2.0", 'run.name="x y"'])
    assert c.loss.kind == "dapo" and c.rollout.group_size == 8 and c.run.name == "x y"
    assert c.advantages.floor == -math.inf
    assert c.advantages.priorities["core"] == 2.0 and c.advantages.priorities["stability"] == 1.0
    with pytest.raises(ConfigError, match="advantages.floor"):
        load_config("cispo", ["advantages.floor=inf"])


def test_config_is_frozen_and_round_trips():
    c = load_config("cispo_repo_r", ["advantages.floor=-inf"])
    with pytest.raises(Exception):
        c.loss.kind = "dapo"
    again = load_config(tomllib.loads(config_to_toml(c)))
    assert again == c and config_hash(again) == config_hash(c)
    assert config_hash(load_config("cispo")) != config_hash(c)


def test_recipe_file_path(tmp_path):
    p = tmp_path / "mine.toml"
    p.write_text('[loss]\nkind = "grpo"\n')
    assert load_config(str(p)).loss.kind == "grpo"
    p.write_text("[loss\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_recipe(str(p))


def test_chat_template_kwargs_take_a_table_of_scalars_and_name_the_key():
    c = load_config("demo", ["policy.chat_template_kwargs.enable_thinking=true", "policy.chat_template_kwargs.x=2"])
    assert c.policy.chat_template_kwargs == {"enable_thinking": True, "x": 2}
    assert load_config(tomllib.loads(config_to_toml(c))) == c
    with pytest.raises(ConfigError, match=r"policy.chat_template_kwargs: 3 is not allowed; allowed: a table of name"):
        load_config("demo", ["policy.chat_template_kwargs=3"])
    with pytest.raises(ConfigError, match=r"policy.chat_template_kwargs.x: \[1\] is not allowed; allowed: true, false"):
        load_config("demo", ["policy.chat_template_kwargs={ x = [1] }"])
    with pytest.raises(ConfigError, match=r"policy.chat_template_kwargs.1x: not a template variable name"):
        load_config("demo", ['policy.chat_template_kwargs={ "1x" = true }'])


def test_sampling_knobs_parse_and_bad_values_are_one_line():
    c = load_config("cispo", ["rollout.top_p=0.95", "rollout.top_k=20", "rollout.min_p=0.05", "probe.top_p=0.9"])
    assert (c.rollout.top_p, c.rollout.top_k, c.rollout.min_p, c.probe.top_p) == (0.95, 20, 0.05, 0.9)
    assert (c.probe.top_k, c.probe.min_p, c.rollout.replay_kept_set) == (0, 0.0, True)
    for bad, msg in (("rollout.top_p=0", r"rollout.top_p: 0.0 is not allowed; allowed: a number in \(0, 1\]"),
                     ("rollout.top_p=1.5", r"rollout.top_p: 1.5 is not allowed"),
                     ("rollout.top_k=-1", r"rollout.top_k: -1 is not allowed; allowed: an integer >= 0"),
                     ("rollout.min_p=1", r"rollout.min_p: 1.0 is not allowed; allowed: a number in \[0, 1\)"),
                     ("probe.min_p=-0.5", r"probe.min_p: -0.5 is not allowed")):
        with pytest.raises(ConfigError, match=msg) as e:
            load_config("cispo", [bad])
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["rollout.repetition_penalty=1.1", "rollout.presence_penalty=0.5",
                                 "probe.repetition_penalty=1.2"])
def test_penalties_are_refused_with_the_reason(key):
    with pytest.raises(ConfigError, match=r"changes the sampled distribution in a way the update does not replay"):
        load_config("cispo", [key])


def test_kl_estimator_default_and_values():
    assert load_config("demo").loss.kl == "k3_ratio"
    assert load_config("demo", ["loss.kl=k3"]).loss.kl == "k3"
    with pytest.raises(ConfigError, match=r"loss.kl: 'k2' is not allowed; allowed values: 'k3_ratio', 'k3'"):
        load_config("demo", ["loss.kl=k2"])
    for name in list_recipes():                  # every bundled recipe says which estimator it uses
        assert re.search(r'^kl = "k3_ratio"', (Path(str(recipe_path(name)))).read_text(), re.M), name


@pytest.mark.parametrize("value,kl", [(True, "k3_ratio"), (False, "k3")])
def test_kl_bias_correction_is_a_deprecated_alias_of_kl(value, kl):
    with pytest.warns(FutureWarning, match=f'loss.kl_bias_correction is deprecated: write loss.kl = "{kl}"'):
        c = load_config("demo", [f"loss.kl_bias_correction={str(value).lower()}"])
    assert c.loss.kl == kl
    assert "kl_bias_correction" not in config_to_toml(c) and f'kl = "{kl}"' in config_to_toml(c)
    with pytest.warns(FutureWarning):
        assert LossSection(kl_bias_correction=value).kl == kl             # the dataclass takes it too
    other = "k3" if value else "k3_ratio"
    # one recipe holding both names: they must agree
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="contradicts loss.kl"):
        load_config({"loss": {"kl_bias_correction": value, "kl": other}})
    with pytest.warns(FutureWarning):
        assert load_config({"loss": {"kl_bias_correction": value, "kl": kl}}).loss.kl == kl
    # an override replaces the recipe's setting under either name (the bundled recipes write loss.kl)
    assert load_config("demo", [f"loss.kl_bias_correction={str(value).lower()}", f"loss.kl={other}"]).loss.kl == other


def test_a_saved_run_without_the_key_trained_with_k3():
    saved = tomllib.loads(config_to_toml(load_config("demo")))
    del saved["loss"]["kl"]                                  # config.toml of a run saved before loss.kl
    assert load_config(saved_run_data(saved)).loss.kl == "k3"
    saved["loss"]["kl"] = "k3_ratio"
    assert load_config(saved_run_data(saved)).loss.kl == "k3_ratio"
