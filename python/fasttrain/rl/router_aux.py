"""The load-balancing auxiliary loss of a mixture of experts, as transformers computes it.

    aux = load_balancing_loss(logits, weight, num_experts, top_k)   # logits: per MoE layer [N, E]

This is the Switch Transformer loss in the form transformers' `load_balancing_loss_func` gives it
(Qwen3-MoE and Qwen3.5-MoE share the function): per layer p = softmax(logits) and its top-k
experts; summed over the layers, c_e = the (weighted) count of top-k picks of expert e and
q_e = the (weighted) sum of p_e, both divided by the total weight R over every layer's tokens;
aux = E · Σ_e c_e · q_e. The counts carry no gradient; q reaches the router and, through the hidden
states, everything before it. `weight` [N] says how often each token counts: 0 for pads, and in
fasttrain's shared-prefix forward a prompt token computed once for its G answers counts G times,
so the loss equals transformers' over the update's rows. It is computed in the logits' dtype
(float64 for float64; transformers sums in float32).

moe.router_aux_loss_coef (default 0) scales it into the update's loss (fasttrain.train.policy_update).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["load_balancing_loss"]


def load_balancing_loss(logits: list[Tensor], weight: Tensor, num_experts: int, top_k: int) -> Tensor:
    """The auxiliary loss (a 0-dim tensor) over the MoE layers' router logits [N, E] (see the header)."""
    ct = torch.float64 if logits[0].dtype == torch.float64 else torch.float32
    w = weight.to(ct)
    counts = torch.zeros(num_experts, dtype=ct, device=w.device)
    probs = torch.zeros(num_experts, dtype=ct, device=w.device)
    rows = torch.zeros((), dtype=ct, device=w.device)
    for z in logits:
        p = z.to(ct).softmax(dim=-1)
        chosen = p.topk(top_k, dim=-1)[1]
        counts = counts + torch.zeros_like(counts).scatter_add_(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        probs = probs + (p * w[:, None]).sum(dim=0)
        rows = rows + w.sum()
    return num_experts * ((counts / rows).detach() * (probs / rows)).sum()
