"""The plan against real training steps on the CPU: each phase's planned peak within 15% of the
peak of allocated bytes measured during the step.

Measured (tests/plan/measured_step.py): every allocation and free through torch's CPU allocator
during two real `Trainer._train_step` calls (profiler memory events), on top of the parameters and
buffers resident when profiling starts; the phases of step 2 (rollout = sample_answers, scores =
score_batch, update = update_policy with its optimizer step) are compared. Step 1 warms up: it
creates the AdamW moments and the NF4 kernels' reusable scratch, which the plan counts as resident.
Not measured: the probe phase (the rollout's formula with the probe's shape), and any CUDA
allocation (tools/gpu_check.sh compares against torch.cuda.max_memory_allocated on a GPU).
Prompts have different lengths and answers run to max_new_tokens (EOS disabled), as the plan
assumes; micro-batches span two prompts, so attention runs with a padding mask, as in real batches.
"""
import pytest
import torch

from fasttrain.plan import Device, meta_policy, plan_memory, run_shape

TOL = 0.15


def _compare(trainer, monkeypatch):
    from measured_step import measure_steps

    measured = measure_steps(trainer, monkeypatch)
    cfg = trainer.cfg
    m = meta_policy(trainer.model.config, dtype=cfg.policy.dtype, adapter=cfg.policy.adapter,
                    rank=cfg.policy.rank, alpha=cfg.policy.alpha)
    from fasttrain.ops.nf4_linear import _cpu_bf16_compute
    plan = plan_memory(m, run_shape(cfg, measured["prompt_tokens"]),
                       Device("cpu", cpu_bf16=_cpu_bf16_compute(), threads=torch.get_num_threads()))
    resident = sum(plan.phases["update"][k] for k in ("nf4_base", "dense_parts", "adapter_masters", "dora_norms"))
    assert resident == measured["resident"]          # the meta build counts the real model's bytes exactly
    out = {}
    for phase in ("rollout", "scores", "update"):
        out[phase] = (plan.total(phase), measured[phase])
        print(f"{trainer.cfg.policy.model} {phase}: planned {out[phase][0]} measured {out[phase][1]} "
              f"ratio {out[phase][0] / out[phase][1]:.3f}; above the resident bytes: ratio "
              f"{(out[phase][0] - resident) / (out[phase][1] - resident):.3f}")
    return out


@pytest.mark.parametrize("n,G,T,mb", [(2, 2, 4, 3), (2, 4, 8, 6), (3, 4, 16, 12)])
def test_tiny_model_phases_match_measured_peaks(worlds, tmp_path, monkeypatch, n, G, T, mb):
    from conftest_recipe import tiny_recipe
    from fasttrain.train import Trainer, load_config

    cfg = load_config(tiny_recipe(tmp_path, n, G, T, mb))
    got = _compare(Trainer(cfg, progress=False), monkeypatch)
    for phase, (planned, measured) in got.items():
        assert abs(planned - measured) <= TOL * measured, (phase, planned, measured)


@pytest.mark.slow
@pytest.mark.parametrize("n,G,T,mb", [(2, 2, 3, 3), (2, 3, 4, 4), (3, 2, 6, 6)])
def test_smollm2_phases_match_measured_peaks(worlds, tmp_path, monkeypatch, n, G, T, mb):
    """SmolLM2-135M (fp32, tiny shapes: a few rows and tokens keep each step under a few seconds on
    2 shared cores; the model load, ~25 s, is paid once per shape)."""
    from conftest_recipe import tiny_recipe
    from fasttrain.train import Trainer, load_config

    r = tiny_recipe(tmp_path, n, G, T, mb)
    r["policy"]["model"] = "smollm2-135m"
    got = _compare(Trainer(load_config(r), progress=False), monkeypatch)
    for phase, (planned, measured) in got.items():
        assert abs(planned - measured) <= TOL * measured, (phase, planned, measured)
