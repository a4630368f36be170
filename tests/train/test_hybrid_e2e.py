"""End to end on a Qwen3.5 hybrid: a tiny random hybrid over bytes learns a toy reward through
`fasttrain run` with a plug-in environment (tests/support/hybrid_world.py), a resumed run repeats the
uninterrupted one bit for bit, and resuming it on another family's model is refused by name."""
import json

import pytest
from typer.testing import CliRunner

from fasttrain.cli import app
from fasttrain.train import Trainer, load_config

from support.recipes import recipe_toml

pytestmark = pytest.mark.one_thread         # tiny models (tests/conftest.py)

HYBRID = {"policy.model": "support.hybrid_world:tiny_hybrid_policy", "env.name": "support.hybrid_world:make_env",
          "rollout.group_size": 8, "rollout.prompts_per_step": 2, "rollout.max_new_tokens": 8,
          "optim.lr": 0.02, "optim.micro_batch": 16, "loss.passes": 1, "probe.every": 0}


def recipe(tiny_recipe, out, **over):
    r = tiny_recipe(out, **{**HYBRID, **over})
    r["advantages"]["priorities"] = {"core": 1.0}
    return r


def _metrics(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def test_a_tiny_hybrid_learns_the_toy_reward_through_fasttrain_run(tiny, tiny_recipe):
    """12 steps of 2 prompts x 8 answers, seeds 1-5 (chosen before any run): the lowercase share of
    steps 10-12 over that of steps 1-2, averaged over the seeds, gains more than 0.15. One seed is
    not a learning claim: this recipe learns on some seeds and not others (measured per seed, gains
    of 0.89, 0.32, 0.0, 0.31, 0.03 with the inverse-CDF sampler and 0.65, 0.05, 0.78, 0.07, 0.64
    with the Gumbel-max one it replaced; a run that does not learn gains 0.0 +- 0.03)."""
    gains = []
    for seed in range(1, 6):
        path = tiny / f"hybrid{seed}.toml"
        out = tiny / f"runs{seed}"
        path.write_text(recipe_toml(recipe(tiny_recipe, out, **{"run.steps": 12, "run.seed": seed})))
        res = CliRunner().invoke(app, ["run", str(path), "--no-progress"])
        assert res.exit_code == 0, res.output
        rows = _metrics(next(out.iterdir()))
        core = [r["core"] for r in rows]
        assert len(core) == 12 and core[0] < 0.2
        gains.append(sum(core[-3:]) / 3 - sum(core[:2]) / 2)
        # the rollout and the update agree on the sampled tokens (float32: rounding only)
        assert all(0 <= r["rollout_logprob_gap"] <= r["rollout_logprob_gap_max"] < 1e-4 for r in rows)
    assert sum(gains) / len(gains) > 0.15, gains


def test_hybrid_resume_equals_uninterrupted_and_another_family_is_refused(tiny, tiny_recipe):
    full = Trainer(load_config(recipe(tiny_recipe, tiny / "a", **{"run.steps": 4})), progress=False)
    full.train()
    part = Trainer(load_config(recipe(tiny_recipe, tiny / "b", **{"run.steps": 2})), progress=False)
    part.train()
    Trainer.resume(part.dir, ["run.steps=4"], progress=False).train()
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("seconds_")} for r in rows]  # noqa: E731
    assert strip(_metrics(full.dir)) == strip(_metrics(part.dir))
    res = CliRunner().invoke(app, ["run", "--resume", str(part.dir), "--set", "run.steps=6",
                                   "--set", "policy.model=support.tiny_world:tiny_policy", "--no-progress"])
    assert res.exit_code != 0
    text = " ".join(res.output.split())
    assert "policy.model" in text and "support.tiny_world:tiny_policy" in text and "Traceback" not in text
    # the checkpoint records its family: a folder whose model changed family under the same name
    # is refused by name too
    from fasttrain.train.checkpoint import check_family, newest_checkpoint_name
    from fasttrain.train.config import ConfigError
    ckpt = part.dir / "checkpoints" / newest_checkpoint_name(part.dir / "checkpoints")
    assert json.loads((ckpt / "trainer_state.json").read_text())["family"] == "qwen3_5"
    with pytest.raises(ConfigError, match=r"'qwen3_5' model .*'llama' model .*do not carry across families"):
        check_family(ckpt, {"family": "llama", "model_type": "llama"}, part.dir)
