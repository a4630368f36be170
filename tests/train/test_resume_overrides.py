"""Non-finite steps and what a resumed run may change: optim.max_skipped_steps, no checkpoint of
non-finite adapters, `--resume --set` honoured for the mid-run settings and refused for others."""

import pytest
import torch

from fasttrain.train import ConfigError, Trainer, TrainingStopped, load_config
from fasttrain.train.run_files import read_jsonl


def _metrics(run):
    return read_jsonl(run / "metrics.jsonl")


def test_max_skipped_steps_is_the_limit(tiny, tiny_recipe, monkeypatch):
    tr = Trainer(load_config(tiny_recipe(tiny, **{"run.steps": 5, "probe.every": 0, "optim.max_skipped_steps": 2})),
                 progress=False)
    real = Trainer.batch_advantages
    monkeypatch.setattr(Trainer, "batch_advantages",
                        lambda self, s: (torch.full_like(real(self, s)[0], float("nan")), real(self, s)[1]))
    with pytest.raises(TrainingStopped, match=r"2 non-finite losses in a row \(optim.max_skipped_steps = 2\)"):
        tr.train()
    assert [r["skipped"] for r in _metrics(tr.dir)] == [True, True]


def test_non_finite_adapters_are_never_checkpointed_and_a_lower_rate_resumes(tiny, tiny_recipe, monkeypatch):
    cfg = load_config(tiny_recipe(tiny, **{"run.steps": 4, "run.checkpoint_every": 2, "probe.every": 0}))
    tr = Trainer(cfg, progress=False)
    real = Trainer._train_step

    def poison_at_4(self, step):
        out = real(self, step)
        if step == 4:
            with torch.no_grad():
                next(iter(self.named_params.values()))[0, 0] = float("inf")
        return out
    monkeypatch.setattr(Trainer, "_train_step", poison_at_4)
    with pytest.raises(TrainingStopped, match=r"step 4: adapter .* is not finite, so no checkpoint was written "
                                              r"\(the last one, step_000002, is whole\).*--set optim.lr=0.001"):
        tr.train()
    assert sorted(p.name for p in (tr.dir / "checkpoints").glob("step_*")) == ["step_000002"]
    monkeypatch.setattr(Trainer, "_train_step", real)
    export = Trainer.resume(tr.dir, ["optim.lr=0.001"], progress=False).train()
    rows = _metrics(tr.dir)
    assert [(r["step"], r["lr"]) for r in rows] == [(1, 0.01), (2, 0.01), (3, 0.001), (4, 0.001)]
    assert any(w["message"] == "resumed at step 2 with optim.lr = 0.001 (was 0.01)" for w in export["warnings"])
    assert "lr = 0.001" in (tr.dir / "config.toml").read_text()


def test_resume_refuses_settings_that_make_another_run(tiny, tiny_recipe):
    tr = Trainer(load_config(tiny_recipe(tiny, **{"run.steps": 2, "probe.every": 0})), progress=False)
    tr.train()
    with pytest.raises(ConfigError, match=r"--resume: policy.rank \(4 -> 8\), loss.kind \('cispo' -> 'dapo'\) "
                                          r"cannot change in the middle of a run.*may change run.steps"):
        Trainer.resume(tr.dir, ["loss.kind=dapo", "policy.rank=8"], progress=False)
    # the same value as saved is no change
    more = Trainer.resume(tr.dir, ["loss.kind=cispo", "run.steps=3", "probe.every=3", "run.checkpoint_every=1"],
                          progress=False)
    more.train()
    assert [r["step"] for r in _metrics(tr.dir)] == [1, 2, 3]
    assert [p["step"] for p in more.probes] == [0, 2, 3]


@pytest.mark.parametrize("old_loss", ['kl_bias_correction = false', ''], ids=["explicit-false", "no-key"])
def test_resume_of_an_old_run_keeps_its_k3_estimator(tiny, tiny_recipe, old_loss):
    """A run saved before loss.kl (config.toml with kl_bias_correction = false, or older, with neither
    key) trained with k3: --resume keeps k3, refuses to switch it, and rewrites config.toml with kl."""
    from fasttrain.train.config import config_to_toml
    cfg = load_config(tiny_recipe(tiny, **{"run.steps": 1, "probe.every": 0}))
    run = tiny / "old-run"
    run.mkdir()
    text = config_to_toml(cfg)
    assert 'kl = "k3_ratio"' in text
    (run / "config.toml").write_text(text.replace('kl = "k3_ratio"', old_loss))
    with pytest.warns(FutureWarning) if old_loss else _no_warning():
        tr = Trainer.resume(run, ["run.steps=2"], progress=False)
    assert tr.cfg.loss.kl == "k3"
    with pytest.raises(ConfigError, match=r"loss.kl \('k3' -> 'k3_ratio'\) cannot change"):
        Trainer.resume(run, ["loss.kl=k3_ratio"], progress=False)
    tr.train()
    assert 'kl = "k3"' in (run / "config.toml").read_text()
    assert Trainer.resume(run, ["run.steps=3"], progress=False).cfg.loss.kl == "k3"


def _no_warning():
    import contextlib
    import warnings

    @contextlib.contextmanager
    def ctx():
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            yield
    return ctx()
