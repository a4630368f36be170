"""One training step through the trainer's own functions, on any device (a real CPU or fake CUDA):
the policy as `build_policy` builds it (NF4 base, the family's 16-bit projections, LoRA or DoRA,
gradient checkpointing), a rollout of `sample` (the prefill and one decode step over the rollout's
dense merged weights, as `rollout.base_weights = "auto"` gives where the copy fits), the no-grad
scores of the reference policy (`score_batch`), and one pass of `update_policy`
(the fused log-prob, the policy loss with the KL term, the backward, gradient clipping, AdamW).

The families, tiny and random (transformers' own config classes): Llama (one layer; NF4 + DoRA)
and the Qwen3.5 hybrid (a Gated DeltaNet layer and a gated full-attention layer; NF4 + LoRA,
in_proj_a/b 16-bit), both bfloat16 as `policy.dtype` defaults. The update's first pass gives the
old log-probs (`need_old=False`, as with `loss.token_mask = "all"`).
"""
from __future__ import annotations

import types

import torch

from support.fake_cuda import host_unwatched
from fasttrain.models.tiny import tiny_llama, tiny_qwen3_5

VOCAB = 96
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12]]            # two prompts of unequal length (left padding)
GROUP, NEW_TOKENS = 2, 2                              # the prefill, then one decode step


def llama(dtype: str = "bfloat16"):
    """The policy factory (`policy.model = "support.trace_step:llama"`): (model, tokenizer), built on the
    host as a checkpoint is read there; build_policy moves it to the device."""
    with host_unwatched():
        return tiny_llama(vocab_size=VOCAB, hidden=64, layers=1, heads=4, kv_heads=2, seed=3,
                          dtype=getattr(torch, dtype)), types.SimpleNamespace(chat_template="")


def qwen3_5(dtype: str = "bfloat16"):
    # conv channels 2·2·16 + 4·16 = 128, a multiple of 8 (causal-conv1d's channels-last layout)
    with host_unwatched():
        return tiny_qwen3_5(vocab_size=VOCAB, hidden=64, layers=2, interval=2, heads=4, kv_heads=2, head_dim=16,
                            linear_k_heads=2, value_heads_per_key=2, linear_head_dim=16, seed=3,
                            dtype=getattr(torch, dtype)), types.SimpleNamespace(chat_template="")


FAMILIES = {"llama": ("support.trace_step:llama", "dora"), "qwen3_5": ("support.trace_step:qwen3_5", "lora")}


def config(family: str):
    from fasttrain.train.config import load_config
    spec, adapter = FAMILIES[family]
    return load_config({"run": {"seed": 7}, "policy": {"model": spec, "quantize": "nf4", "adapter": adapter,
                                                       "rank": 4, "alpha": 8.0},
                        "loss": {"kind": "cispo", "beta": 0.04, "token_mask": "all", "passes": 1}})


def step(family: str, device: str) -> dict:
    """Build the policy on `device` and run the rollout, the scores and one update pass; returns
    what the checks read (the model, its adapter parameters, the optimizer, the rollout, the result)."""
    from fasttrain.nn.rollout_weights import RolloutWeights
    from fasttrain.rollout.sampling import sample
    from fasttrain.train.policy import build_policy
    from fasttrain.train.policy_update import score_batch, update_policy

    cfg = config(family)
    dev = torch.device(device)
    model, _, named = build_policy(cfg, dev)
    params = list(named.values())
    weights = RolloutWeights(model)
    weights.refresh()
    with torch.no_grad():
        roll = sample(model, PROMPTS, group_size=GROUP, max_new_tokens=NEW_TOKENS, temperature=1.0,
                      eos_token_ids=[2], seed=[11, 12], weights=weights)
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=False)      # as the trainer makes it
    scores = score_batch(model, roll, micro_batch=4, temperature=1.0, need_ref=True, need_old=False)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5], device=dev)
    loss_mask = roll.completion_mask.bool()
    result = update_policy(model, params, optimizer, roll, scores, advantages, loss_mask, cfg.loss, zeta=0.01,
                           micro_batch=4, grad_clip=1.0, temperature=1.0)
    return {"model": model, "params": named, "optimizer": optimizer, "roll": roll, "result": result}
