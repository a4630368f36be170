"""End to end on a tiny random Llama and a tiny environment: every output file, resume equality."""
import json
import typing

import pytest
import torch

from fasttrain.safe_json import json_safe
from fasttrain.train import Trainer, load_config
from fasttrain.train.run_files import read_jsonl

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


@pytest.mark.parametrize("policy", [{}, {"policy.quantize": "none", "policy.adapter": "dora"}, {"policy.quantize": "none"}, {"policy.adapter": "dora"}],
                         ids=["nf4-lora", "16bit-dora", "16bit-lora", "nf4-dora"])
def test_resume_equals_uninterrupted(tiny, tiny_recipe, policy):
    full = Trainer(load_config(tiny_recipe(tiny / "a", **{"run.steps": 6, "probe.every": 0}, **policy)),
                   progress=False)
    full.train()
    part = Trainer(load_config(tiny_recipe(tiny / "b", **{"run.steps": 3, "probe.every": 0}, **policy)),
                   progress=False)
    part.train()
    Trainer.resume(part.dir, ["run.steps=6"], progress=False).train()
    a, b = _strip(_metrics(full.dir)), _strip(_metrics(part.dir))
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert a == b                    # every metric, to the last bit
    assert any(r["loss"] != 0 for r in a) and len({r["kl"] for r in a}) > 1      # the adapters moved


def test_a_16bit_run_trains_its_adapters_on_the_models_own_weights(tiny, tiny_recipe):
    """policy.quantize = "none": the projections keep the model's weights (DenseLinear), the dense
    rollout copy follows the same rule as for NF4, and the shipped adapter loads back."""
    from fasttrain.nn import DenseLinear, NF4Linear, load_adapter
    from support.tiny_world import tiny_policy
    cfg = load_config(tiny_recipe(tiny / "runs", **{"policy.quantize": "none", "run.steps": 2, "probe.every": 2,
                                                   "rollout.base_weights": "dequantized"}))
    tr = Trainer(cfg, progress=False)
    tr.train()
    layers = [m for m in tr.model.modules() if isinstance(m, (DenseLinear, NF4Linear))]
    assert len(layers) == 14 and all(isinstance(m, DenseLinear) for m in layers)
    assert tr.rollout_weights is not None and tr.rollout_weights.nbytes() == sum(m.weight.nbytes for m in layers)
    plain, _ = tiny_policy()
    q = tr.model.model.layers[0].self_attn.q_proj
    assert torch.equal(q.weight, plain.model.layers[0].self_attn.q_proj.weight)      # the base never moved
    assert q.lora_B.abs().max() > 0
    from fasttrain.nn import adaptable_model
    again = adaptable_model(plain)
    load_adapter(again, tr.dir / "shipped" / "adapter")
    assert again.model.layers[0].self_attn.q_proj.lora_A.shape == q.lora_A.shape


def _conforms(value, hint) -> bool:
    """Whether `value` is of the annotation `hint` (tuple[...], dict[K, V], list[T], Any, classes)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if origin is tuple:
        return (isinstance(value, tuple) and len(value) == len(args)
                and all(_conforms(v, a) for v, a in zip(value, args)))
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(k, args[0]) and _conforms(v, args[1])
                                               for k, v in value.items())
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    return isinstance(value, hint)


def test_a_step_returns_what_its_annotation_says(tiny, tiny_recipe, monkeypatch):
    """Trainer._train_step returns its annotation's (metrics row, samples record), and they are the
    two lines the step adds to metrics.jsonl and samples.jsonl, in that order."""
    hint = typing.get_type_hints(Trainer._train_step)["return"]
    assert hint == tuple[dict[str, typing.Any], dict[str, typing.Any]]
    assert not _conforms(({"step": 1},), hint) and not _conforms(({1: 0}, {}), hint)    # the check can fail
    returned, real = [], Trainer._train_step

    def recording(self, step):
        returned.append(real(self, step))
        return returned[-1]
    monkeypatch.setattr(Trainer, "_train_step", recording)
    tr = Trainer(load_config(tiny_recipe(tiny, **{"run.steps": 2, "probe.every": 0})), progress=False)
    tr.train()
    metrics, samples = read_jsonl(tr.dir / "metrics.jsonl"), read_jsonl(tr.dir / "samples.jsonl")
    assert len(returned) == len(metrics) == len(samples) == 2
    for step, out in enumerate(returned, 1):
        assert _conforms(out, hint), [type(v) for v in out]
        row, record = (json.loads(json.dumps(json_safe(d))) for d in out)
        assert row["step"] == record["step"] == step
        assert row == metrics[step - 1] and record == samples[step - 1]
