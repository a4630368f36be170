"""Non-finite losses, the non-zero-advantage warning, Ctrl-C, config errors at start-up."""
import json

import pytest
import torch

from fasttrain.train import ConfigError, Trainer, TrainingStopped, load_config
from fasttrain.train.run_files import read_jsonl


def test_three_non_finite_losses_stop_the_run(tiny, tiny_recipe, monkeypatch):
    tr = Trainer(load_config(tiny_recipe(tiny, **{"run.steps": 5, "probe.every": 0})), progress=False)
    real = Trainer.batch_advantages
    monkeypatch.setattr(Trainer, "batch_advantages",
                        lambda self, s: (torch.full_like(real(self, s)[0], float("nan")), real(self, s)[1]))
    with pytest.raises(TrainingStopped, match="3 non-finite losses in a row"):
        tr.train()
    rows = read_jsonl(tr.dir / "metrics.jsonl")
    assert [r["skipped"] for r in rows] == [True, True, True]
    assert tr.nonfinite_in_row == 3 and len(tr.warnings) == 3


def test_low_nonzero_share_warns_naming_guard_and_floor(tiny, tiny_recipe):
    # floor above every core: every answer is guarded, every group all-zero
    cfg = load_config(tiny_recipe(tiny, **{"run.steps": 3, "probe.every": 0, "advantages.floor": 5.0,
                                           "advantages.warn_steps": 2}))
    tr = Trainer(cfg, progress=False)
    export = tr.train()
    assert [r["nonzero_adv_share"] for r in export["steps"]] == [0.0, 0.0, 0.0]
    (w,) = export["warnings"]
    assert w["step"] == 2
    assert "advantages.guard='projection'" in w["message"] and "advantages.floor=5.0" in w["message"]


def test_ctrl_c_saves_a_checkpoint_and_resume_finishes(tiny, tiny_recipe, monkeypatch):
    cfg = load_config(tiny_recipe(tiny, **{"run.steps": 4, "probe.every": 0}))
    tr = Trainer(cfg, progress=False)
    real = Trainer._train_step

    def interrupt_at_3(self, step):
        if step == 3:
            raise KeyboardInterrupt
        return real(self, step)
    monkeypatch.setattr(Trainer, "_train_step", interrupt_at_3)
    export = tr.train()
    assert export["interrupted"] and export["steps_done"] == 2
    assert json.loads((tr.dir / "checkpoints" / "latest.json").read_text())["step"] == 2
    monkeypatch.setattr(Trainer, "_train_step", real)
    done = Trainer.resume(tr.dir, progress=False).train()
    assert not done["interrupted"] and [r["step"] for r in done["steps"]] == [1, 2, 3, 4]


def test_start_up_errors_name_the_key(tiny, tiny_recipe):
    with pytest.raises(ConfigError, match="env.prompts"):
        Trainer(load_config(tiny_recipe(tiny, **{"env.prompts": str(tiny / "missing.json")})), progress=False)
    with pytest.raises(ConfigError, match="policy.model"):
        Trainer(load_config(tiny_recipe(tiny, **{"policy.model": "no_such_module:f"})), progress=False).train()
    with pytest.raises(FileNotFoundError, match="config.toml"):
        Trainer.resume(tiny / "nowhere")
    # a priority for a channel the environment does not have is an error for every environment
    # (here a plug-in), not only for the built-in signal ones
    with pytest.raises(ConfigError, match=r"advantages.priorities: unknown channel\(s\) \['stability'\]"):
        Trainer(load_config(tiny_recipe(tiny, **{"advantages.priorities": {"core": 3.0, "stability": 1.0}})),
                progress=False)


def test_ctrl_c_in_the_middle_of_an_update_writes_no_checkpoint_of_half_a_step(tiny, tiny_recipe, monkeypatch):
    import fasttrain.train.trainer as trainer_mod
    recipe = tiny_recipe(tiny / "full", **{"run.steps": 4, "run.checkpoint_every": 2, "probe.every": 0})
    full = Trainer(load_config(recipe), progress=False)
    full.train()
    tr = Trainer(load_config({**recipe, "run": {**recipe["run"], "out": str(tiny / "cut")}}), progress=False)
    real, calls = trainer_mod.update_policy, [0]

    def update(*a, **kw):
        calls[0] += 1
        out = real(*a, **kw)                 # the adapters and moments have moved ...
        if calls[0] == 3:
            raise KeyboardInterrupt          # ... when Ctrl-C lands in step 3
        return out
    monkeypatch.setattr(trainer_mod, "update_policy", update)
    export = tr.train()
    assert export["interrupted"] and export["steps_done"] == 2
    monkeypatch.undo()
    Trainer.resume(tr.dir, progress=False).train()           # from the untouched step-2 checkpoint
    rows = [[{k: v for k, v in json.loads(l).items() if not k.startswith("seconds")}
             for l in (d / "metrics.jsonl").read_text().splitlines()] for d in (full.dir, tr.dir)]
    assert rows[0] == rows[1]
