"""End to end on both MoE families: a tiny random MoE over bytes learns a toy reward (the lowercase
share of tests/support/hybrid_world.py) through `fasttrain run` with NF4 experts, LoRA on the experts
and routing replay, logging the router disagreement and expert load; a resumed run repeats the
uninterrupted one bit for bit."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fasttrain.cli import app
from fasttrain.train import Trainer, load_config

from support.recipes import recipe_toml

pytestmark = pytest.mark.one_thread      # the one-thread default (tests/conftest.py)

POLICIES = {"qwen3_moe": "support.moe_world:tiny_qwen3_moe_policy", "qwen3_5_moe": "support.moe_world:tiny_qwen3_5_moe_policy"}


def recipe(out: Path, family: str, steps: int, group: int = 8, tokens: int = 8) -> dict:
    return {
        "run": {"name": family, "seed": 7, "steps": steps, "out": str(out), "device": "cpu", "threads": 1},
        "policy": {"model": POLICIES[family], "dtype": "float32", "quantize": "nf4", "rank": 4, "alpha": 8.0,
                   "gradient_checkpointing": True},
        "env": {"name": "support.hybrid_world:make_env"},
        "rollout": {"prompts_per_step": 2, "group_size": group, "max_new_tokens": tokens},
        "advantages": {"priorities": {"core": 1.0}, "floor": -1e9},
        "loss": {"kind": "cispo", "passes": 1, "token_mask": "all"},
        "optim": {"lr": 0.04, "micro_batch": 16},
        "probe": {"every": 0, "prompts": 4},
    }


def _metrics(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", list(POLICIES))
def test_a_tiny_moe_learns_through_fasttrain_run(family, tmp_path):
    path = tmp_path / "moe.toml"
    path.write_text(recipe_toml(recipe(tmp_path / "runs", family, 12)))
    res = CliRunner().invoke(app, ["run", str(path), "--no-progress"])
    assert res.exit_code == 0, res.output
    rows = _metrics(next((tmp_path / "runs").iterdir()))
    core = [r["core"] for r in rows]
    assert len(core) == 12 and sum(core[-3:]) / 3 - sum(core[:2]) / 2 > 0.3, core
    for r in rows:                                   # replayed: the update scores what the rollout ran
        assert 0 <= r["moe_router_disagreement"] <= 1 and r["moe_expert_load_max_over_mean"] >= 1
        assert r["rollout_logprob_gap_max"] < 1e-4


@pytest.mark.parametrize("family", list(POLICIES))
def test_moe_resume_equals_uninterrupted(family, tmp_path):
    full = Trainer(load_config(recipe(tmp_path / "a", family, 3, group=4, tokens=5)), progress=False)
    full.train()
    part = Trainer(load_config(recipe(tmp_path / "b", family, 2, group=4, tokens=5)), progress=False)
    part.train()
    Trainer.resume(part.dir, ["run.steps=3"], progress=False).train()
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]  # noqa: E731
    assert strip(_metrics(full.dir)) == strip(_metrics(part.dir))
