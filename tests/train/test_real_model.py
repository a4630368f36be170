"""The real model end to end (issue 8, item 4): SmolLM2-135M-Instruct in NF4 with LoRA, trained
by `fasttrain.train.Trainer` for two tiny steps of CISPO + REPO-R on signal-a, then the exported
adapter is loaded back into a fresh fasttrain model and into PEFT.

Lean on purpose (CI runs it): the model is loaded and trained once per module, one prompt x four
answers of 16 tokens, two steps with two passes each.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

pytestmark = pytest.mark.slow

STEPS = 2
ZETA = 0.02


def _recipe(out) -> dict:
    return {
        "run": {"name": "realmodel-test", "seed": 3, "steps": STEPS, "out": str(out), "device": "cpu",
                "threads": 2},
        "policy": {"model": "smollm2-135m", "dtype": "bfloat16", "quantize": "nf4", "adapter": "lora",
                   "rank": 8, "alpha": 16.0, "gradient_checkpointing": False},
        "env": {"name": "signal-a"},
        "rollout": {"prompts_per_step": 1, "group_size": 4, "max_new_tokens": 16, "temperature": 1.0},
        # Truncated 16-token answers are mostly invalid; guard nothing so every group carries a signal
        # (the floor guard itself is tested in tests/rl and in the trainer's tests).
        "advantages": {"guard": "none", "floor": float("-inf")},
        "loss": {"kind": "cispo", "beta": 0.08, "token_mask": "all", "passes": 2, "repo_r": True,
                 "thermostat_warmup": 5},
        "optim": {"lr": 1e-3, "micro_batch": 4},
        "probe": {"every": 0, "prompts": 1, "max_new_tokens": 8},
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from fasttrain.train.config import load_config
    from fasttrain.train.trainer import Trainer

    out = tmp_path_factory.mktemp("runs")
    trainer = Trainer(load_config(_recipe(out)), progress=False)
    trainer._setup()
    # The thermostat holds its initial zeta through its warm-up; start it at ZETA so that both steps
    # rescale tokens (from zeta 0 it would take more than two steps to switch REPO-R on).
    trainer.thermostat.zeta = ZETA
    trainer.train()
    rows = [json.loads(line) for line in (trainer.dir / "metrics.jsonl").read_text().splitlines()]
    return trainer, rows


def _probe_adapter(trainer, step: int):
    return trainer.dir / "probes" / f"step_{step:06d}" / "adapter"


def test_losses_finite_and_kl_positive_after_first_update(trained):
    _, rows = trained
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert not r["skipped"], r
        assert len(r["pass_losses"]) == 2 and all(math.isfinite(v) for v in r["pass_losses"]), r
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r
        # with guard "none" a group has a signal unless all four answers score alike on every channel
        assert r["nonzero_adv_share"] > 0, r
    # Step 1 scores the untouched policy: LoRA B starts at zero, so policy == reference exactly.
    assert rows[0]["kl"] == 0.0
    # Step 2 scores the policy after step 1's two updates against the frozen base.
    assert rows[1]["kl"] > 0.0
    # REPO-R was on: the factors (1 -+ zeta log p) moved away from 1 on tokens with an advantage.
    for r in rows:
        assert r["zeta"] == ZETA
        assert math.isfinite(r["repo_r_factor_mean"]) and r["repo_r_factor_mean"] != 1.0, r


def test_adapters_change(trained):
    from safetensors.torch import load_file

    trainer, _ = trained
    before = load_file(str(_probe_adapter(trainer, 0) / "adapter_model.safetensors"))
    after = load_file(str(_probe_adapter(trainer, STEPS) / "adapter_model.safetensors"))
    assert before.keys() == after.keys() and len(before) == 2 * 7 * 30     # A and B of 7 projections x 30 layers
    b_keys = [k for k in before if k.endswith("lora_B.weight")]
    assert all(torch.count_nonzero(before[k]) == 0 for k in b_keys)        # PEFT init: B = 0
    changed_b = sum(bool(torch.count_nonzero(after[k])) for k in b_keys)
    assert changed_b == len(b_keys)                                        # every layer moved
    a_keys = [k for k in before if k.endswith("lora_A.weight")]
    assert sum(not torch.equal(before[k], after[k]) for k in a_keys) == len(a_keys)
    # the in-memory adapters are the exported ones
    for name, p in trainer.named_params.items():
        key = "base_model.model." + name.replace("lora_A", "lora_A.weight").replace("lora_B", "lora_B.weight")
        assert torch.equal(p.detach().cpu(), after[key]), name
    assert (trainer.dir / "shipped" / "adapter" / "adapter_model.safetensors").exists()


@pytest.fixture(scope="module")
def held_out_batch(trained):
    """Two fresh answers of the trained policy to a probe prompt, and the trained policy's log-probs."""
    from fasttrain.train.answers import sample_answers
    from fasttrain.train.policy_update import answer_logprobs

    trainer, _ = trained
    prompt = trainer.env.prompts("probe")[1:2]
    roll, _ = sample_answers(trainer.model, trainer.tokenizer, trainer.env, prompt, group_size=2,
                             max_new_tokens=16, temperature=1.0, seed=11)
    with torch.no_grad():
        logp, _ = answer_logprobs(trainer.model, roll.input_ids, roll.attention_mask, roll.prompt_len,
                                  roll.completion_ids, roll.completion_mask, 1.0)
    return roll, logp


def test_exported_adapter_reloads_into_fasttrain(trained, held_out_batch):
    from fasttrain.models import load_policy
    from fasttrain.nn import load_adapter, quantize_model
    from fasttrain.train.policy_update import answer_logprobs

    trainer, _ = trained
    roll, logp = held_out_batch
    model, _ = load_policy(None, dtype=torch.bfloat16)
    quantize_model(model)
    load_adapter(model, _probe_adapter(trainer, STEPS))
    with torch.no_grad():
        again, _ = answer_logprobs(model, roll.input_ids, roll.attention_mask, roll.prompt_len,
                                   roll.completion_ids, roll.completion_mask, 1.0)
    # Same NF4 codes (quantisation is deterministic), same adapter, same kernels: bit for bit.
    assert torch.equal(again, logp)


def _plain_logprobs(model, roll) -> torch.Tensor:
    """log p of the answer tokens from full logits (the textbook way), in the model's dtype."""
    position_ids = (roll.attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=roll.input_ids, attention_mask=roll.attention_mask,
                       position_ids=position_ids, use_cache=False).logits
    P, T = roll.prompt_len, roll.completion_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1: P - 1 + T].double(), dim=-1)
    out = lp.gather(-1, roll.completion_ids[..., None]).squeeze(-1)
    return out * roll.completion_mask


def test_exported_adapter_loads_into_peft_and_reproduces_logprobs(trained, held_out_batch):
    """PEFT reads the exported folder onto a plain model whose projections hold the NF4-dequantised
    weights. Reference: that PEFT model in float64. Tolerance: fasttrain's bf16 NF4 path may be off
    the float64 reference by at most 2x what the same PEFT model run in bf16 (PyTorch's own
    low-precision error) is off it."""
    peft = pytest.importorskip("peft")
    from fasttrain.models import load_policy
    from fasttrain.nn import nf4_layers

    trainer, _ = trained
    roll, logp = held_out_batch
    base, _ = load_policy(None, dtype=torch.float64)
    with torch.no_grad():
        for name, layer in nf4_layers(trainer.model):
            base.get_submodule(name).weight.copy_(layer.dequantized_weight(torch.float64))
    model = peft.PeftModel.from_pretrained(base, str(_probe_adapter(trainer, STEPS)))
    model.eval()
    n_lora = sum(1 for n, _ in model.named_parameters() if "lora_B" in n)
    assert n_lora == 7 * 30
    ref = _plain_logprobs(model, roll)
    low = _plain_logprobs(model.to(torch.bfloat16), roll)
    m = roll.completion_mask.bool()
    torch_err = (low - ref)[m].abs()
    ours_err = (logp.double() - ref)[m].abs()
    # the adapter matters: without it the reference differs by far more than the tolerance
    with model.disable_adapter():
        no_lora = _plain_logprobs(model.to(torch.float64), roll)
    assert (no_lora - ref)[m].abs().max() > 2 * torch_err.max()
    assert ours_err.mean() <= 2 * torch_err.mean(), (ours_err.mean(), torch_err.mean())
    assert ours_err.max() <= 2 * torch_err.max(), (ours_err.max(), torch_err.max())
