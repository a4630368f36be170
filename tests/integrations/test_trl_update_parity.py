"""One update, two trainers: fasttrain's policy update and TRL 1.16's GRPOTrainer on the same batch.

The same prompts and the same fixed completions go to both: TRL gets them from a `rollout_func`, so the rest is
TRL's own code path (its reward step runs the two reward functions, its normalize_then_sum advantages with
reward weights 3 and 1, its old and reference log-probs, its loss, gradient accumulation over micro-batches,
clipping and AdamW inside `trainer.train()`); fasttrain gets a Rollout of the same tokens and runs
`gdpo_advantages`, `score_batch` and `update_policy` as its Trainer does. Both start from the same tiny Llama
with the same LoRA factors (B not 0, so the reference differs from the policy). Compared, pass by pass:
the advantages, each token's loss gradient dL/d log p (what the token sends back into the model), the clipped
gradient of every LoRA factor, the gradient norm before clipping, and the factors after the optimizer step.

Settings (`loss.normalize = "trl"` and `loss.kl = "k3_ratio"`, the default, give TRL's conventions, docs/trl.md):
CISPO, DAPO and GRPO; beta 0 and 0.08; 1 and 2 passes (TRL num_iterations); 8 answers in micro-batches of 4;
max gradient norm 0.05 (active: every norm is above it); lr 0.02, so that pass 2's ratios leave the clip range.

Bounds.
- float32: both sides compute the same sums in different orders. A value reached through D nested sums of at
  most n terms each is off by at most about D·n·u·(its scale) to first order (u = 2^-24); for two
  implementations twice that. Here n = 256 (the vocabulary; hidden 64, MLP 128, 48 answer tokens are shorter)
  and D = 2·(2 layers + 2) = 8 (forward and backward through the embedding, each layer and the head), so each
  gradient is within 2·8·256·u = 2.4e-4 of its tensor's largest entry. The advantages are a few sums of 4 and 8
  terms: 2·16·u relative to their largest. AdamW's step moves an entry by lr·g/(|g| + eps) (first step): a
  gradient error e moves it by at most lr·min(2, 2e/(|g| + eps)), entry by entry, from fasttrain's own g; the
  second step's bound follows the same first-order rule through both moments (`adam_bound`). Pass 2 starts
  from adapters that already differ by the measured step-1 difference d: its gradients get a further
  4·L·|d| with L = |g2 - g1| / |theta1 - theta0| the secant of fasttrain's own two passes.
- bf16 (TRL with bf16=True autocast on a bf16 base; fasttrain's bf16 base with fp32 adapter masters): each
  side's error against the exact update (fasttrain in float64 on the same bf16-valued weights; the float32
  case pins that the two trainers compute the same update) is measured normwise; fasttrain's is at most twice
  TRL's plus two bf16 roundings of the result (2·2^-8 of its norm).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from support.tiny_grpo import tiny_llama
from support.tolerances import U32
from support.trl_parity import (CLIP, FP32_GRAD_REL, LR, TRL_CONVENTIONS, U16, adam_bound, flat, lora_init, rows,
                                run_fasttrain, run_trl)


def check_fp32(ft, trl, passes):
    scale = ft["adv"].abs().max()
    assert (ft["adv"] - trl["adv"]).abs().max() <= 2 * 16 * U32 * scale, (ft["adv"], trl["adv"])
    assert ft["adv"][4:].abs().max() > 0.1                 # the constant channel left the others' signal
    d_theta = None
    for k in range(passes):
        tg_f, tg_t = ft["token_grads"][k], trl["token_grads"][k]
        assert (tg_f - tg_t).abs().max() <= FP32_GRAD_REL * tg_f.abs().max(), (k, tg_f, tg_t)
        assert min(ft["grad_norm"][k], trl["grad_norm"][k]) > CLIP             # clipping is active
        assert abs(ft["grad_norm"][k] - trl["grad_norm"][k]) <= FP32_GRAD_REL * ft["grad_norm"][k]
        extra = 0.0
        if k == 1:                 # pass 2 starts where each side's step 1 left it
            lip = (flat(ft["grads"][1]) - flat(ft["grads"][0])).norm() / (flat(ft["after"][0]) - flat(ft["theta0"])).norm()
            extra = 4 * float(lip) * float(d_theta.norm())
        err = {}
        for name, g in ft["grads"][k].items():
            err[name] = FP32_GRAD_REL * g.abs().max() + extra
            assert (g - trl["grads"][k][name]).abs().max() <= err[name], (k, name)
        for name, th in ft["after"][k].items():
            if k == 0:
                move = LR * adam_bound(ft["grads"][0][name], err[name])
            else:
                move = LR * adam_bound(ft["grads"][0][name], err0[name], ft["grads"][1][name], err[name])
                move = move + (ft["after"][0][name] - trl["after"][0][name]).abs()
            assert ((th - trl["after"][k][name]).abs() <= move + 4 * U32 * th.abs()).all(), (k, name)
        err0 = err
        d_theta = flat(ft["after"][0]) - flat(trl["after"][0])


CASES = [("cispo", 0.0, 1), ("cispo", 0.08, 2), ("dapo", 0.0, 2), ("dapo", 0.08, 1), ("grpo", 0.0, 1),
         ("grpo", 0.08, 2)]


@pytest.mark.parametrize("kind,beta,passes", CASES)
def test_one_update_equals_trls_in_float32(tmp_path, monkeypatch, kind, beta, passes):
    base = tiny_llama()
    init = lora_init(base)
    trl = run_trl(tmp_path, base, init, kind, beta, passes, bf16=False)
    check_fp32(run_fasttrain(base, init, kind, beta, passes, torch.float32, monkeypatch, **TRL_CONVENTIONS), trl,
               passes)
    # The recipe's own settings (every token in the loss, KL "k3_ratio" by default): the same update. The old
    # default, k3 as the loss, lacks the ratio weighting TRL applies: the same update only without KL.
    check_fp32(run_fasttrain(base, init, kind, beta, passes, torch.float32, monkeypatch), trl, passes)
    k3 = run_fasttrain(base, init, kind, beta, passes, torch.float32, monkeypatch, kl="k3")
    if beta == 0:
        check_fp32(k3, trl, passes)
    else:
        with pytest.raises(AssertionError):
            check_fp32(k3, trl, passes)


def test_top_entropy_tokens_normalised_and_kl_charged_as_trl_with_normalize_trl(tmp_path, monkeypatch):
    # One micro-batch and one pass: TRL's entropy threshold is then over the same tokens and policy as the
    # recipe's (it takes it per micro-batch and pass). Half of the 32 answer tokens carry the policy term.
    base = tiny_llama()
    init = lora_init(base)
    B = len(rows())
    trl = run_trl(tmp_path, base, init, "dapo", 0.08, 1, bf16=False, micro=B, top=0.5)
    check_fp32(run_fasttrain(base, init, "dapo", 0.08, 1, torch.float32, monkeypatch, micro=B, top=0.5,
                             **TRL_CONVENTIONS), trl, 1)
    recipe = run_fasttrain(base, init, "dapo", 0.08, 1, torch.float32, monkeypatch, micro=B, top=0.5,
                           kl="k3_ratio")        # normalize = "batch": the top tokens alone count
    with pytest.raises(AssertionError):
        check_fp32(recipe, trl, 1)


def check_bf16(ft, trl, exact, passes):
    """fasttrain's bf16 error against the exact update at most twice TRL's, plus two bf16 roundings."""
    def no_worse(key, f, t, x):
        err_f, err_t = float((f - x).norm()), float((t - x).norm())
        assert err_f <= 2 * err_t + 2 * U16 * float(x.norm()), (key, err_f, err_t, float(x.norm()))
        return err_f, err_t
    assert (ft["adv"] - trl["adv"]).abs().max() <= 2 * 16 * U32 * exact["adv"].abs().max()
    out = {}
    for k in range(passes):
        out[f"token_grads/{k}"] = no_worse("token_grads", ft["token_grads"][k], trl["token_grads"][k],
                                           exact["token_grads"][k])
        out[f"grads/{k}"] = no_worse("grads", flat(ft["grads"][k]), flat(trl["grads"][k]), flat(exact["grads"][k]))
        theta0 = flat(exact["theta0"])
        out[f"step/{k}"] = no_worse("step", flat(ft["after"][k]) - theta0, flat(trl["after"][k]) - theta0,
                                    flat(exact["after"][k]) - theta0)
    return out


@pytest.mark.parametrize("kind,beta,passes", [("cispo", 0.08, 2), ("dapo", 0.08, 2)])
def test_one_update_in_bf16_is_as_close_to_the_exact_update_as_trls(tmp_path, monkeypatch, kind, beta, passes):
    base = tiny_llama().to(torch.bfloat16)
    init = lora_init(base)
    trl = run_trl(tmp_path, base, init, kind, beta, passes, bf16=True)
    ft = run_fasttrain(base, init, kind, beta, passes, torch.bfloat16, monkeypatch, **TRL_CONVENTIONS)
    exact = run_fasttrain(base, init, kind, beta, passes, torch.float64, monkeypatch, **TRL_CONVENTIONS)
    errors = check_bf16(ft, trl, exact, passes)
    assert errors["grads/0"][1] > 0                          # TRL's bf16 does round: the comparison has teeth
