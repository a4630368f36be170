"""The real model end to end: SmolLM2-135M-Instruct in NF4 with LoRA, trained
by `fasttrain.train.Trainer` for two tiny steps of CISPO + REPO-R, then the exported adapter is
loaded back into a fresh fasttrain model and into PEFT.

Lean on purpose (CI runs it): the model is loaded and trained once per module, one prompt x four
answers of 8 tokens, two steps with two passes each. The environment is the short-prompt letter
environment of tests/support/tiny_world.py, not signal-a: a signal-a prompt is ~330 tokens in the
chat template (six times the forward cost), and the untrained 135M model's short answers there are
all invalid, so every group's advantages are zero and nothing would move (measured: step 1 of a
signal-a version of this test had a non-zero-advantage share of 0). The letter environment's
length channel differs between any two answers of different length, so every group has a signal.
"""
from __future__ import annotations

import math

import pytest
import torch

from fasttrain.train.run_files import read_jsonl

pytestmark = pytest.mark.slow

STEPS = 2
ZETA = 0.02


def _recipe(out) -> dict:
    return {
        "run": {"name": "realmodel-test", "seed": 3, "steps": STEPS, "out": str(out), "device": "cpu",
                "threads": 2},
        "policy": {"model": "smollm2-135m", "dtype": "bfloat16", "quantize": "nf4", "adapter": "lora",
                   "rank": 8, "alpha": 16.0, "gradient_checkpointing": False},
        "env": {"name": "support.tiny_world:make_env"},
        "rollout": {"prompts_per_step": 1, "group_size": 4, "max_new_tokens": 8, "temperature": 1.0},
        # projection guard on invalid (too short) answers; the letter core has no floor
        "advantages": {"priorities": {"core": 3.0}, "guard": "projection", "floor": float("-inf")},
        "loss": {"kind": "cispo", "beta": 0.08, "token_mask": "all", "passes": 2, "repo_r": True,
                 "thermostat_warmup": 5},
        "optim": {"lr": 1e-3, "micro_batch": 4},
        "probe": {"every": 0, "prompts": 1, "max_new_tokens": 4},
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
    rows = read_jsonl(trainer.dir / "metrics.jsonl")
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
        assert r["nonzero_adv_share"] > 0, r       # the update had something to learn from
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
                             max_new_tokens=12, temperature=1.0, seed=11)
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


def _float64_norms_and_rotary(model) -> None:
    """Every RMSNorm and the rotary embedding of `model` computed in the model's own dtype (here
    float64) instead of HF's float32: the same formulas (w · x / sqrt(mean(x²) + eps); cos and sin
    of position · inv_freq, times the attention scaling), with no float32 rounding in between.
    Patched per instance, so every caller of the modules (fasttrain's forwards, HF's, PEFT's) runs it."""
    import types

    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    def rotary(self, x, position_ids):
        freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(device=x.device, dtype=torch.float64)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    norms = rotaries = 0
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            mod.forward = types.MethodType(norm, mod)
            norms += 1
        elif type(mod).__name__.endswith("RotaryEmbedding"):
            mod.forward = types.MethodType(rotary, mod)
            rotaries += 1
    assert norms == 2 * model.config.num_hidden_layers + 1 and rotaries == 1, (norms, rotaries)


def test_exported_adapter_loads_into_peft_and_reproduces_logprobs(trained, held_out_batch):
    """PEFT reads the exported folder onto a plain model whose projections hold the NF4-dequantised
    weights, and gives the log-probs fasttrain gives with that adapter. (The bf16 trained policy
    itself is matched bit for bit by the reload test above.)

    Both sides run in float64, so the tolerance does not depend on the host's matmul kernels: the
    two compute the same function and differ only by float64 rounding. (HF's Llama RMSNorm and
    rotary embedding compute in float32 whatever the model's dtype, and a float32 mean of squares
    is summed in an order that depends on the tensor's layout and the ISA (the row sums of a
    column-major copy differ by an ulp here): with them, one CI host saw the two sides differ by
    3.4e-7. `_float64_norms_and_rotary` makes both models compute them in float64 too.) Each dot product of length
    K has a relative error of at most K·u (u = 2^-53 = 1.1e-16), K <= 1536 here (the MLP's inner
    size; attention sums run over fewer terms), so each op is off by <= 1.7e-13 relative, whatever
    the summation order, blocking or FMA use. The 30 layers carry these into a log-prob; measured
    in float32 the same pipeline amplifies unit roundoff by ~200 (errors ~1e-5 at u = 6e-8), which
    in float64 gives ~2e-14. TOL = 1e-9 leaves a factor of 10^4 above the per-op bound and 10^5
    above that estimate, while a wrong adapter (missing layer, transposed factor, wrong scale)
    moves log-probs by more than 1e-4 (asserted below: the adapter's own effect)."""
    peft = pytest.importorskip("peft")
    from fasttrain.models import load_policy
    from fasttrain.nn import load_adapter, nf4_layers, quantize_model
    from fasttrain.train.policy_update import answer_logprobs

    TOL = 1e-9
    trainer, _ = trained
    roll, _ = held_out_batch
    adapter = _probe_adapter(trainer, STEPS)
    ours_model, _ = load_policy(None, dtype=torch.float64)
    _float64_norms_and_rotary(ours_model)
    quantize_model(ours_model)
    load_adapter(ours_model, adapter)
    with torch.no_grad():
        ours, _ = answer_logprobs(ours_model, roll.input_ids, roll.attention_mask, roll.prompt_len,
                                  roll.completion_ids, roll.completion_mask, 1.0)
    base, _ = load_policy(None, dtype=torch.float64)
    _float64_norms_and_rotary(base)
    with torch.no_grad():
        for name, layer in nf4_layers(ours_model):
            base.get_submodule(name).weight.copy_(layer.dequantized_weight(torch.float64))
    del ours_model
    model = peft.PeftModel.from_pretrained(base, str(adapter))
    model.eval()
    assert sum(1 for n, _ in model.named_parameters() if "lora_B" in n) == 7 * 30
    ref = _plain_logprobs(model, roll)
    m = roll.completion_mask.bool()
    with model.disable_adapter():
        no_lora = _plain_logprobs(model, roll)
    assert ours.dtype == torch.float64
    err = (ours - ref)[m].abs().max().item()
    effect = (no_lora - ref)[m].abs().max().item()
    print(f"\nfasttrain vs PEFT, float64: max |d log p| {err:.2e} (tolerance {TOL:.0e}); adapter effect {effect:.2e}")
    assert effect > 1e-4                 # the adapter matters far beyond the tolerance
    assert err <= TOL, err
