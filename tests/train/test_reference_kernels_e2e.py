"""`run.kernels = "reference"` trains the tiny end-to-end run to the same metrics as the fused kernels.

Tolerance. Both runs start from the same weights and seeds and compute in float32. Every value a
token meets passes through at most n_ops = 7·layers + 1 ops (seven adapted projections per layer,
then the fused log-prob), and each op's result differs between the two implementations by at most
about (V + D)·u relative to its magnitude (u = 2^-24; a float32 sum over D, the longer of the hidden
and MLP sizes, and the log-softmax's sum over the vocabulary V), so a metric of the first step differs
by at most ε = n_ops·(V + D)·u times its scale.
Each optimizer pass moves the adapters by AdamW's normalised step, which carries a relative
gradient difference over as the same relative difference in the update, so the bound grows by ε per
pass: step s is within (1 + s·passes)·ε of the metric's scale (its largest magnitude over the run).
Sampled tokens, rewards and every count are equal exactly: a sample flips only when a probability
moves across a uniform draw: at most about (tokens sampled)·ε = 128·3.5e-4 ≈ 0.04 at this size, and
not happening with these seeds (the test would show it as a different answer)."""

import pytest

from fasttrain.train import Trainer, load_config
from fasttrain.train.run_files import read_jsonl

EXACT = ("reward", "reward_core", "reward_action_cost", "reward_format", "core", "success", "valid", "cost",
         "nonzero_adv_share", "guarded_share", "adv_abs_mean", "tokens", "loss_tokens", "mean_length", "skipped")
CLOSE = ("loss", "grad_norm", "kl", "entropy", "ratio_mean", "repo_r_factor_mean", "zeta_next",
         "clip_low_frac", "clip_high_frac", "cap_frac")


def _run(tiny, tiny_recipe, kernels):
    """One tiny run; also counts the calls that reached fasttrain.ops.reference."""
    from fasttrain.ops import reference as R
    calls = []
    cfg = load_config(tiny_recipe(tiny / kernels, **{"run.kernels": kernels, "run.steps": 2, "probe.every": 0}))
    with pytest.MonkeyPatch.context() as mp:
        for name in ("fused_logprob", "policy_loss", "nf4_linear"):
            real = getattr(R, name)
            mp.setattr(R, name, lambda *a, _n=name, _f=real, **k: (calls.append(_n), _f(*a, **k))[1])
        tr = Trainer(cfg, progress=False)
        tr.train()
    rows = read_jsonl(tr.dir / "metrics.jsonl")
    samples = read_jsonl(tr.dir / "samples.jsonl")
    return cfg, rows, samples, set(calls)


@pytest.mark.slow
def test_reference_kernels_reach_the_same_metrics(tiny, tiny_recipe):
    cfg, fused, fused_samples, fused_calls = _run(tiny, tiny_recipe, "fused")
    _, ref, ref_samples, ref_calls = _run(tiny, tiny_recipe, "reference")
    assert fused_calls == set() and ref_calls == {"fused_logprob", "policy_loss", "nf4_linear"}
    from support.tiny_world import tiny_policy
    mc = tiny_policy()[0].config
    eps = (7 * mc.num_hidden_layers + 1) * (mc.vocab_size + max(mc.hidden_size, mc.intermediate_size)) * 2.0**-24
    assert [r["step"] for r in ref] == [1, 2]
    assert [s["answers"] for s in ref_samples] == [s["answers"] for s in fused_samples]
    worst = 0.0
    for key in CLOSE:
        scale = max(abs(r[key]) for r in fused)
        for a, b in zip(fused, ref):
            tol = (1 + a["step"] * cfg.loss.passes) * eps * scale
            assert abs(a[key] - b[key]) <= tol, f"step {a['step']} {key}: fused {a[key]!r}, reference {b[key]!r}"
            worst = max(worst, abs(a[key] - b[key]) / max(tol, 1e-300))
    scale = max(abs(x) for r in fused for x in r["pass_losses"])
    for a, b in zip(fused, ref):
        for pa, pb in zip(a["pass_losses"], b["pass_losses"]):
            assert abs(pa - pb) <= (1 + a["step"] * cfg.loss.passes) * eps * scale, (a["step"], pa, pb)
    for a, b in zip(fused, ref):
        for key in EXACT:
            assert a[key] == b[key], f"step {a['step']} {key}: fused {a[key]!r}, reference {b[key]!r}"
    print(f"largest difference: {worst:.2g} of its tolerance")
