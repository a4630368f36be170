"""Training on a dataset with reward functions: the `fasttrain init` starter end to end on the tiny
model, recipe paths read next to the recipe, and a run whose rewards fail that still finishes."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("datasets")

from fasttrain.cli import app  # noqa: E402
from fasttrain.tasks.starter import write_starter  # noqa: E402
from fasttrain.train import ConfigError, Trainer, load_config  # noqa: E402
from fasttrain.train.run_files import read_jsonl

TESTS = Path(__file__).parent.parent
TINY = ["--set", "policy.model=support.tiny_world:tiny_policy", "--set", "policy.dtype=float32", "--set", "run.threads=1"]


def _jsonl(path):
    return read_jsonl(path)


def test_init_starter_trains_three_steps_on_the_tiny_model(tiny, monkeypatch):
    monkeypatch.chdir(tiny)
    r = CliRunner()
    res = r.invoke(app, ["init", "my_task"])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tiny / "my_task").iterdir()) == ["data.jsonl", "recipe.toml", "rewards.py"]
    assert len(_jsonl(tiny / "my_task" / "data.jsonl")) == 300
    res = r.invoke(app, ["init", "my_task"])
    assert res.exit_code == 2 and "already exists" in res.output
    res = r.invoke(app, ["run", "my_task/recipe.toml", "--no-progress", "--set", "run.steps=3", *TINY])
    assert res.exit_code == 0, res.output
    (run,) = (tiny / "runs").iterdir()
    rows = _jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2, 3]
    for m in rows:
        # `concise` reads completion_ids: 1 - (len - 1) / 31 per answer (every answer <= 16 tokens), so
        # its mean pins the ids passed to the sampled ones, EOS included
        assert m["reward_concise"] == pytest.approx(1 - (m["mean_length"] - 1) / 31, abs=1e-12)
        assert 0.0 <= m["reward_correct"] <= 1.0 and m["valid"] == 1.0
    export = json.loads((run / "export.json").read_text())
    assert export["env"] == {"name": "dataset:data.jsonl", "train_prompts": 200, "probe_prompts": 16, "channels": [
        {"name": "correct", "priority": 1.0, "description": f"reward function {tiny / 'my_task' / 'rewards.py'}:correct"},
        {"name": "concise", "priority": 1.0, "description": f"reward function {tiny / 'my_task' / 'rewards.py'}:concise"}]}
    trained = {i for s in _jsonl(run / "samples.jsonl") for i in s["prompt_ids"]}
    assert trained and trained <= {f"dataset/{i}" for i in range(200)}
    assert [p["step"] for p in _jsonl(run / "probes.jsonl")] == [0, 3]
    assert (run / "shipped" / "adapter" / "adapter_model.safetensors").exists()
    assert "holdout -" in (run / "report.md").read_text()           # no holdout slice: shown as "-"
    res = r.invoke(app, ["eval", str(run)])                          # the saved config finds the data again
    assert res.exit_code == 0, res.output
    assert json.loads((run / "eval.json").read_text())["prompts"] == 16


def test_the_probe_rows_are_never_drawn_for_training(tiny):
    write_starter(tiny / "task")
    cfg = load_config(str(tiny / "task" / "recipe.toml"), ["policy.model=support.tiny_world:tiny_policy"])
    tr = Trainer(cfg, progress=False)
    probe = [p.id for p in tr.probe_prompts]
    assert probe == [f"dataset/{i}" for i in range(200, 216)]      # the probe's first 16 of the last 100
    drawn = {p.id for step in range(1, 301) for p in tr._prompts_for_step(step)}   # 3 epochs of 200 prompts
    assert drawn == {f"dataset/{i}" for i in range(200)}
    tr.env.close()


def test_env_paths_are_read_next_to_the_recipe(tmp_path, monkeypatch):
    write_starter(tmp_path / "task")
    (tmp_path / "task" / "here.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(str(tmp_path / "task" / "recipe.toml"), ["env.probe_dataset=here.jsonl", "env.probe_rows=0"])
    folder = (tmp_path / "task").resolve()
    assert cfg.env.dataset == str(folder / "data.jsonl")
    assert cfg.env.rewards == (f"{folder / 'rewards.py'}:correct", f"{folder / 'rewards.py'}:concise")
    assert cfg.env.probe_dataset == "here.jsonl"                     # an override is read from the current folder
    with pytest.raises(ConfigError, match=r'env.dataset is read only with env.name = "dataset"'):
        load_config("demo", ["env.dataset=x.jsonl"])
    with pytest.raises(ConfigError, match=r"env.reward_timeout: 0.0 is not allowed"):
        load_config(str(tmp_path / "task" / "recipe.toml"), ["env.reward_timeout=0"])


def test_a_run_whose_rewards_fail_or_hang_still_finishes(tiny, tiny_recipe):
    write_starter(tiny / "task")
    rewards = str(TESTS / "support" / "dataset_rewards.py")
    recipe = tiny_recipe(tiny / "runs", **{
        "run.steps": 2, "probe.every": 0, "probe.prompts": 4,
        "env.name": "dataset", "env.dataset": str(tiny / "task" / "data.jsonl"), "env.probe_rows": 4,
        "env.rewards": [f"{tiny / 'task' / 'rewards.py'}:correct", f"{rewards}:unreliable",
                        f"{rewards}:hangs_on_big_batches"],
        "env.reward_timeout": 0.5, "advantages.priorities": {"correct": 3.0}})
    tr = Trainer(load_config(recipe), progress=False)
    tr.train()
    rows = _jsonl(tr.dir / "metrics.jsonl")
    assert [m["step"] for m in rows] == [1, 2]
    # every training call (8 answers) hangs one reward: all answers invalid, so the guard zeroes them all
    assert [m["valid"] for m in rows] == [0.0, 0.0] and [m["nonzero_adv_share"] for m in rows] == [0.0, 0.0]
    allowed = ("reward 'unreliable' raised RuntimeError: unreliable", "reward 'unreliable' returned None",
               "reward 'unreliable' returned nan", "reward 'hangs_on_big_batches' timed out after 0.5 s")
    for s in _jsonl(tr.dir / "samples.jsonl"):
        for reason in s["reasons"]:
            parts = reason.split("; ")
            assert parts[-1] == allowed[-1] and all(p in allowed for p in parts), reason
    assert len(_jsonl(tr.dir / "probes.jsonl")) == 2                   # probe batches (4 answers) do not hang
    assert tr.env.rewards[2].restarts >= 1
    tr.env.close()


def test_a_priority_for_no_reward_is_an_error(tiny):
    write_starter(tiny / "task")
    cfg = load_config(str(tiny / "task" / "recipe.toml"), ["advantages.priorities.corect=2.0"])
    with pytest.raises(ConfigError, match=r"unknown channel\(s\) \['corect'\]; the channels of dataset:data.jsonl "
                                          r"are correct, concise"):
        Trainer(cfg, progress=False)
