"""`fasttrain filter` selection rules and the CLI commands on the tiny world."""
import json

import pytest
from typer.testing import CliRunner

from fasttrain.cli import app
from fasttrain.train import load_config
from fasttrain.train.prompt_filter import filter_prompts

from support.recipes import recipe_toml


def test_filter_keeps_mixed_prompts_or_closest_to_half(tiny, tiny_recipe, monkeypatch):
    import fasttrain.train.prompt_filter as pf
    rates = {}

    # Score with a fake verdict per prompt so the rule is checked exactly: prompt i succeeds
    # on the first i answers of 4 (rates 0, .25, .5, .75, 1, 1, ...).
    def fake_score(env, prompts, answers, data_slice, record=True, completion_ids=None, conversations=None):
        from fasttrain.envs import Score
        out = []
        for j, p in enumerate(prompts):
            i = int(p.id.rsplit("/", 1)[1])
            ok = (j % 4) < i
            out.append(Score({"core": float(ok), "action_cost": 0.0, "format": 1.0}, True, float(ok), ok))
        return out
    monkeypatch.setattr(pf, "score_answers", fake_score)
    cfg = load_config(tiny_recipe(tiny, **{"filter.samples": 4, "filter.min_keep": 2, "filter.max_prompts": 6}))
    sel = filter_prompts(cfg, tiny / "sel.json")
    assert sel["prompt_ids"] == ["letters/train/1", "letters/train/2", "letters/train/3"]
    assert not sel["fallback_closest_to_half"]
    assert json.loads((tiny / "sel.json").read_text())["rates"]["letters/train/4"] == 1.0
    cfg = load_config(tiny_recipe(tiny, **{"filter.samples": 4, "filter.min_keep": 5, "filter.max_prompts": 6}))
    sel = filter_prompts(cfg, tiny / "sel2.json")
    assert sel["fallback_closest_to_half"] and len(sel["prompt_ids"]) == 5
    assert sel["prompt_ids"][0] == "letters/train/2"        # rate 0.5 first
    assert set(sel["prompt_ids"][1:3]) == {"letters/train/1", "letters/train/3"}


def test_cli_run_resume_eval_ladder_and_errors(tiny, tiny_recipe):
    r = CliRunner()
    recipe = tiny / "tiny.toml"
    recipe.write_text(recipe_toml(tiny_recipe(tiny / "runs", **{"run.steps": 2, "probe.every": 0})))
    res = r.invoke(app, ["run", str(recipe), "--no-progress", "--set", "run.steps=1"])
    assert res.exit_code == 0, res.output
    (run_dir,) = (tiny / "runs").iterdir()
    assert "steps = 1" in (run_dir / "config.toml").read_text()
    res = r.invoke(app, ["run", "--resume", str(run_dir), "--set", "run.steps=2", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert "steps = 2" in (run_dir / "config.toml").read_text()
    res = r.invoke(app, ["eval", str(run_dir)])
    assert res.exit_code == 0 and "holdout" in res.output, res.output
    assert (run_dir / "eval.json").exists()
    res = r.invoke(app, ["ladder", str(recipe), str(recipe), "--no-progress", "--seeds", "2", "--set", "run.steps=5"])
    assert res.exit_code == 0, res.output
    (table,) = (tiny / "runs").glob("ladder-*.md")
    text = table.read_text()
    assert "| rung | configuration | shipped steps | holdout, shipped (mean [95%], 2 seeds) |" in text
    assert text.count("| tiny: cispo") == 2
    rungs = json.loads(table.with_suffix(".json").read_text())
    assert [[run["seed"] for run in rung["runs"]] for rung in rungs] == [[7, 8], [7, 8]]   # paired seeds
    # the same recipe twice on the same seeds: identical runs, so the paired change is exactly 0
    def shipped(rung):
        return [(run["shipped"]["step"], run["shipped"]["holdout_core"]) for run in rung["runs"]]
    assert shipped(rungs[0]) == shipped(rungs[1])
    assert text.splitlines()[5].endswith("| +0.000 [+0.000, +0.000] |")
    run_dir = tiny / "runs" / rungs[0]["runs"][0]["run_id"]
    assert len((run_dir / "probes.jsonl").read_text().splitlines()) == 6    # start + 5 (probe.every 0 -> 1)
    res = r.invoke(app, ["run", str(recipe), "--set", "loss.kind=ppo"])
    assert res.exit_code == 2 and "allowed values: 'cispo', 'dapo', 'grpo'" in res.output
