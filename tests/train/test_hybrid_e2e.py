"""End to end on a Qwen3.5 hybrid: a tiny random hybrid over bytes learns a toy reward through
`fasttrain run` with a plug-in environment (tests/train/hybrid_world.py), a resumed run repeats the
uninterrupted one bit for bit, and resuming it on another family's model is refused by name."""
import json

import pytest
from typer.testing import CliRunner

from fasttrain.cli import app
from fasttrain.train import Trainer, load_config

HYBRID = {"policy.model": "hybrid_world:tiny_hybrid_policy", "env.name": "hybrid_world:make_env",
          "rollout.group_size": 8, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 8,
          "optim.lr": 0.02, "optim.micro_batch": 16, "loss.passes": 1, "probe.every": 0}


@pytest.fixture(autouse=True)
def _one_thread(one_thread_for_tiny_models):
    """Tiny models: one thread (see tests/conftest.py)."""


def recipe(tiny_recipe, out, **over):
    r = tiny_recipe(out, **{**HYBRID, **over})
    r["advantages"]["priorities"] = {"core": 1.0}
    return r


def _metrics(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def _toml(d: dict) -> str:
    from fasttrain.train.config import _toml_value
    return "\n".join(f"[{s}]\n" + "\n".join(f"{k} = {_toml_value(v)}" for k, v in kv.items()) for s, kv in d.items())


def test_a_tiny_hybrid_learns_the_toy_reward_through_fasttrain_run(tiny, tiny_recipe):
    """12 steps of 2 prompts x 8 answers: the lowercase share climbs from ~0.07 (steps 1-2) to over
    0.3 more in steps 10-12 (0.07 -> 0.56 on the machine this was written on)."""
    path = tiny / "hybrid.toml"
    path.write_text(_toml(recipe(tiny_recipe, tiny / "runs", **{"run.steps": 12})))
    res = CliRunner().invoke(app, ["run", str(path), "--no-progress"])
    assert res.exit_code == 0, res.output
    run_dir = next((tiny / "runs").iterdir())
    rows = _metrics(run_dir)
    core = [r["core"] for r in rows]
    assert len(core) == 12 and core[0] < 0.2
    assert sum(core[-3:]) / 3 - sum(core[:2]) / 2 > 0.3, core
    # the rollout and the update agree on the sampled tokens (float32: rounding only)
    assert all(0 <= r["rollout_logprob_gap"] <= r["rollout_logprob_gap_max"] < 1e-4 for r in rows)


def test_hybrid_resume_equals_uninterrupted_and_another_family_is_refused(tiny, tiny_recipe):
    full = Trainer(load_config(recipe(tiny_recipe, tiny / "a", **{"run.steps": 4})), progress=False)
    full.train()
    part = Trainer(load_config(recipe(tiny_recipe, tiny / "b", **{"run.steps": 2})), progress=False)
    part.train()
    Trainer.resume(part.dir, ["run.steps=4"], progress=False).train()
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]  # noqa: E731
    assert strip(_metrics(full.dir)) == strip(_metrics(part.dir))
    res = CliRunner().invoke(app, ["run", "--resume", str(part.dir), "--set", "run.steps=6",
                                   "--set", "policy.model=tiny_world:tiny_policy", "--no-progress"])
    assert res.exit_code != 0
    text = " ".join(res.output.split())
    assert "policy.model" in text and "tiny_world:tiny_policy" in text and "Traceback" not in text
    # the checkpoint records its family: a folder whose model changed family under the same name
    # is refused by name too
    from fasttrain.train.checkpoint import check_family, newest_checkpoint_name
    from fasttrain.train.config import ConfigError
    ckpt = part.dir / "checkpoints" / newest_checkpoint_name(part.dir / "checkpoints")
    assert json.loads((ckpt / "trainer_state.json").read_text())["family"] == "qwen3_5"
    with pytest.raises(ConfigError, match=r"'qwen3_5' model .*'llama' model .*do not carry across families"):
        check_family(ckpt, {"family": "llama", "model_type": "llama"}, part.dir)
