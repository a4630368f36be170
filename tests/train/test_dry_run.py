"""`fasttrain run --dry-run`: the run's checks up to its first weight, and nothing after."""
from typer.testing import CliRunner

import fasttrain.train.trainer as trainer_mod
from fasttrain.cli import app
from fasttrain.tasks.starter import write_starter


def test_dry_run_checks_data_and_rewards_and_loads_no_weights(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_starter(tmp_path / "task")
    (tmp_path / "task" / "rewards.py").write_text(
        (tmp_path / "task" / "rewards.py").read_text() + "\n\ndef wrong(completions, missing_column, **kw):\n"
        "    return [0.0 for _ in completions]\n\n\ndef broken(completions, **kw):\n"
        "    return [1 / 0 for _ in completions]\n")

    def no_weights(*a, **k):
        raise AssertionError("a dry run built the policy")
    monkeypatch.setattr(trainer_mod, "build_policy", no_weights)
    r = CliRunner()
    res = r.invoke(app, ["run", "task/recipe.toml", "--dry-run", "--set", "run.out=\"out\""])
    assert res.exit_code == 0, res.output
    assert "200 train prompts, 16 probe prompts" in res.output and "correct (x3), concise (x1)" in res.output
    assert "reward check on an empty answer to dataset/0: scored" in res.output
    assert "dry run: no weights loaded" in res.output and not (tmp_path / "out").exists()
    # a reward that needs a column the data lacks is an error; one that fails when called shows why
    def rewards(name):
        return ["--set", f'env.rewards=["task/rewards.py:correct", "task/rewards.py:{name}"]',
                "--set", "advantages.priorities={}"]
    res = r.invoke(app, ["run", "task/recipe.toml", "--dry-run", *rewards("wrong")])
    assert res.exit_code == 2 and "['missing_column']" in res.output, res.output
    res = r.invoke(app, ["run", "task/recipe.toml", "--dry-run", *rewards("broken")])
    out = " ".join(res.output.split())
    assert res.exit_code == 0 and "invalid (reward 'broken' raised ZeroDivisionError" in out, res.output
    res = r.invoke(app, ["run", "task/recipe.toml", "--dry-run", "--set", "env.dataset=\"nowhere.jsonl\""])
    assert res.exit_code == 2 and "nowhere.jsonl" in res.output
