"""End to end on a tiny random Llama and a tiny environment: every output file, resume equality."""
import json

import pytest

from fasttrain.train import Trainer, load_config

TIMING_KEYS = ("seconds_",)


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING_KEYS)} for r in rows]


def _metrics(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_end_to_end_writes_every_output(tiny, tiny_recipe):
    import matplotlib.pyplot  # noqa: F401  (import time is not the trainer's: ~10 s on a loaded box)
    from transformers import LlamaForCausalLM  # noqa: F401
    cfg = load_config(tiny_recipe(tiny / "runs"))
    tr = Trainer(cfg, progress=False)
    export = tr.train()
    d = tr.dir
    for f in ("config.toml", "metrics.jsonl", "probes.jsonl", "samples.jsonl", "export.json", "report.md",
              "training_curves.png", "zeta_and_share.png", "probe_scores.png", "shipped/adapter/adapter_config.json",
              "shipped/adapter/adapter_model.safetensors", "shipped/shipped.json", "checkpoints/latest.json"):
        assert (d / f).exists(), f
    rows = _metrics(d)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("reward", "reward_core", "reward_action_cost", "reward_format", "core", "cost", "kl", "entropy",
                "nonzero_adv_share", "zeta", "clip_low_frac", "cap_frac", "tokens", "seconds_rollout",
                "seconds_update", "verifier_batch_failures"):
        assert key in rows[0], key
    # one KL metric, the loss op's own estimate (the trainer kept a second one, "kl_loss_mean")
    assert not any(k.startswith("kl") and k != "kl" for k in rows[0])
    assert [p["step"] for p in export["probes"]] == [0, 2, 4]
    assert export["run_id"] == d.name and export["shipped"]["step"] in (0, 2, 4)
    best = max(export["probes"], key=lambda p: p["train_core"])
    assert export["shipped"]["train_core"] == best["train_core"]
    assert "| step | train core" in (d / "report.md").read_text()
    assert any(r["loss"] != 0 for r in rows)


def test_resume_equals_uninterrupted(tiny, tiny_recipe):
    full = Trainer(load_config(tiny_recipe(tiny / "a", **{"run.steps": 6, "probe.every": 0})), progress=False)
    full.train()
    part = Trainer(load_config(tiny_recipe(tiny / "b", **{"run.steps": 3, "probe.every": 0})), progress=False)
    part.train()
    Trainer.resume(part.dir, ["run.steps=6"], progress=False).train()
    a, b = _strip(_metrics(full.dir)), _strip(_metrics(part.dir))
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert a == b                    # every metric, to the last bit
