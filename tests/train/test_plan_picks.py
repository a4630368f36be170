"""`fasttrain run` and the plan's picks: a recipe that fits at no wave size is refused before any
weight is read, naming the setting to change; one that fits only in waves runs its rollout in the
waves the plan picked (the device's memory is set small so the tiny world needs them)."""
import dataclasses

import pytest

import fasttrain.plan.gpus as gpus
import fasttrain.train.trainer as trainer_module
from fasttrain.train import ConfigError, Trainer, load_config
from fasttrain.train.policy import checkpointing_on

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
    from fasttrain.train import answers     # the rollout's chunks are sampled there
    real = answers.sample_answers

    def counting(*a, **k):
        waves.append(len(a[3]))
        return real(*a, **k)
    monkeypatch.setattr(answers, "sample_answers", counting)
    t2 = Trainer(cfg, progress=False)
    t2._setup()
    assert t2.sizes["rollout"] == 1
    t2._train_step(1)
    assert waves == [1, 1, 1]


def test_auto_checkpointing_is_off_where_the_update_fits_without_it(tiny, tiny_recipe):
    cfg = load_config(tiny_recipe(tiny, **{"policy.gradient_checkpointing": "auto"}))
    t = Trainer(cfg, progress=False)
    t._setup()
    assert not checkpointing_on(t.model)
    t._train_step(1)                                   # the update runs without the recompute
    forced = Trainer(load_config(tiny_recipe(tiny, **{"policy.gradient_checkpointing": True})), progress=False)
    forced._setup()
    assert checkpointing_on(forced.model)                 # true keeps it on whatever the plan says


def test_auto_checkpointing_is_on_where_only_that_fits(tiny, tiny_recipe, monkeypatch):
    """A memory between the update's peak with checkpointing and its peak without (every other
    phase fits): "auto" turns it on, false is refused naming the setting."""
    from fasttrain.plan import meta_policy, run_shape
    from fasttrain.plan.load import load_phase
    from fasttrain.plan.memory import probe_phase, rollout_phase, scores_phase, update_phase
    from fasttrain.plan.report import device_for
    from fasttrain.train.answers import prompt_token_ids

    over = {"rollout.prompts_per_step": 1, "rollout.max_new_tokens": 96, "optim.micro_batch": 1,
            "policy.gradient_checkpointing": "auto"}
    cfg = load_config(tiny_recipe(tiny, **over))
    t = Trainer(cfg, progress=False)
    t._setup()
    P = max(len(i) for i in prompt_token_ids(t.tokenizer, t.env, t.train_prompts[:16], ""))
    m = meta_policy(t.model.config, dtype="float32", rank=4, alpha=8.0)
    s = run_shape(cfg, P)
    assert s.gradient_checkpointing is False           # "auto" starts off; the picks turn it on
    dev = device_for(gpus.gpu_spec("cpu"))
    on, off = (sum(update_phase(m, s.with_(gradient_checkpointing=c), dev).values()) for c in (True, False))
    others = max(sum(p.values()) for p in (load_phase(m), scores_phase(m, s, dev), update_phase(m, s.with_(
        gradient_checkpointing=True), dev), rollout_phase(m, s.with_(wave=1, prefill_chunk=1), dev),
        probe_phase(m, s.with_(probe_wave=1, probe_prefill_chunk=1), dev)))
    memory = int(others * 1.05) + 1                     # every phase fits with checkpointing...
    assert off * 1.05 > memory, (on, off, others)       # ...and the update does not without it
    monkeypatch.setattr(gpus, "gpu_for_device", lambda device: dataclasses.replace(gpus.gpu_spec("cpu"),
                                                                                    memory_bytes=memory))
    t2 = Trainer(cfg, progress=False)
    t2._setup()
    assert checkpointing_on(t2.model)
    t2._train_step(1)
    off_cfg = load_config(tiny_recipe(tiny, **{**over, "policy.gradient_checkpointing": False}))
    with pytest.raises(ConfigError, match="policy.gradient_checkpointing = true"):
        Trainer(off_cfg, progress=False)._setup()
