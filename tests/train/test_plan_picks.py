"""`fasttrain run` and the plan's picks: a recipe that fits at no wave size is refused before any
weight is read, naming the setting to change; one that fits only in waves runs its rollout in the
waves the plan picked (the device's memory is set small so the tiny world needs them)."""
import dataclasses

import pytest

import fasttrain.plan.gpus as gpus
import fasttrain.train.trainer as trainer_module
from fasttrain.train import ConfigError, Trainer, load_config

MIB = 2**20


def _never_load(*a, **k):
    raise AssertionError("the model was loaded")


@pytest.mark.parametrize("mode", ["apply", "warn"])
def test_a_recipe_that_fits_at_no_wave_size_is_refused_before_the_model_loads(tiny, tiny_recipe, monkeypatch, mode):
    """SmolLM2-135M (its bundled config.json: nothing is read) with 8K-token answers: one group of 4
    answers needs 4 x 8K x 30 layers x 2 x 192 x 4 bytes = 1.4 GiB of KV alone, more than the
    600 MiB this host is said to have."""
    monkeypatch.setattr(gpus, "_host_memory", lambda: 600 * MIB)
    monkeypatch.setattr(trainer_module, "build_policy", _never_load)
    cfg = load_config(tiny_recipe(tiny, **{"policy.model": "smollm2-135m", "rollout.max_new_tokens": 8192,
                                           "run.plan": mode}))
    t = Trainer(cfg, progress=False)
    if mode == "warn":
        with pytest.raises(AssertionError, match="was loaded"):
            t._setup()
        return
    with pytest.raises(ConfigError) as e:
        t._setup()
    msg = str(e.value)
    assert "rollout.max_new_tokens" in msg and "does not fit" in msg and 'run.plan = "warn"' in msg


def test_a_run_that_fits_only_in_waves_decodes_in_the_waves_the_plan_picked(tiny, tiny_recipe, monkeypatch):
    from fasttrain.plan import meta_policy, run_shape
    from fasttrain.plan.memory import probe_phase, rollout_phase, scores_phase, update_phase
    from fasttrain.plan.load import load_phase
    from fasttrain.plan.report import device_for
    from fasttrain.train.answers import prompt_token_ids

    cfg = load_config(tiny_recipe(tiny, **{"rollout.prompts_per_step": 3, "rollout.group_size": 8,
                                           "rollout.max_new_tokens": 128, "optim.micro_batch": 1}))
    t = Trainer(cfg, progress=False)
    t._setup()                                    # with the host's memory: one wave, nothing changed
    assert t.sizes == {"rollout": None, "scores": 1, "update": 1}
    # a memory between one wave of 1 prompt and one of 3 (every other phase fits)
    P = max(len(i) for i in prompt_token_ids(t.tokenizer, t.env, t.train_prompts[:16], ""))
    m = meta_policy(t.model.config, dtype="float32", rank=4, alpha=8.0)
    s = run_shape(cfg, P)
    dev = device_for(gpus.gpu_spec("cpu"))
    need = {w: sum(rollout_phase(m, s.with_(wave=w, prefill_chunk=1), dev).values()) for w in (1, 2, 3)}
    others = max(sum(p.values()) for p in (load_phase(m), scores_phase(m, s, dev), update_phase(m, s, dev),
                                           probe_phase(m, s.with_(probe_wave=1, probe_prefill_chunk=1), dev)))
    memory = int(max(need[1], others) * 1.05) + 1
    assert need[2] * 1.05 > memory                # so the plan must pick waves of one prompt
    monkeypatch.setattr(gpus, "gpu_for_device", lambda device: dataclasses.replace(gpus.gpu_spec("cpu"),
                                                                                    memory_bytes=memory))
    waves = []
    real = trainer_module.sample_answers

    def counting(*a, **k):
        waves.append(len(a[3]))
        return real(*a, **k)
    monkeypatch.setattr(trainer_module, "sample_answers", counting)
    t2 = Trainer(cfg, progress=False)
    t2._setup()
    assert t2.sizes["rollout"] == 1
    t2._train_step(1)
    assert waves == [1, 1, 1]
