"""The float64 oracle of the mixture-of-experts families: transformers' own model (its attention,
Gated DeltaNet, experts and shared expert) with every router computed in float64 and, when asked,
forced to given experts.

    with hf_routing(model, forced=record):     # record: per MoE layer [N, k] in the forward's token order
        logits = model(input_ids, attention_mask=..., position_ids=...).logits
    chosen = routing.chosen                    # per MoE layer the top-k each router picked

transformers' routers take the softmax in float32 even in a float64 model, so a float64 forward is
only float32-accurate in its routing weights; here the router is the same formula (softmax over all
E logits, top-k or the forced experts, renormalised where the family renormalises) in the model's
dtype. Tests compare fasttrain's MoE forwards against it. What it is not: used in training.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

__all__ = ["hf_routing", "OracleRouting"]


class OracleRouting:
    """What the patched routers did: `chosen[i]` [N, k] the top-k of MoE layer i (its own choice)."""

    def __init__(self, forced=None):
        self.forced = forced
        self.chosen: list[torch.Tensor] = []


def _routers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


@contextmanager
def hf_routing(model, forced=None, renormalize: bool | None = None):
    """Inside the block each transformers TopKRouter of `model` (in layer order) routes in the model's
    dtype, by its own top-k or by forced[i]; yields the OracleRouting. The model's experts run
    transformers' eager implementation from then on."""
    routers = _routers(model)
    rec = OracleRouting(forced)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")       # the per-expert loop (grouped_mm has no float64)
    originals = [r.forward for r in routers]
    for i, router in enumerate(routers):
        renorm = getattr(router, "norm_topk_prob", True) if renormalize is None else renormalize

        def forward(hidden, router=router, i=i, renorm=renorm):
            h = hidden.reshape(-1, router.hidden_dim)
            logits = F.linear(h, router.weight)
            probs = logits.softmax(dim=-1)
            own = probs.topk(router.top_k, dim=-1)[1]
            if len(rec.chosen) <= i:
                rec.chosen.append(own)
            idx = own if rec.forced is None else rec.forced[i].to(h.device).long()
            w = probs.gather(1, idx)
            if renorm:
                w = w / w.sum(-1, keepdim=True)
            return logits, w.to(logits.dtype), idx
        router.forward = forward
    try:
        yield rec
    finally:
        for router, f in zip(routers, originals):
            router.forward = f
