"""The update's shared-prefix forward for the mixture-of-experts families, with routing replay.

The layers run as their base family runs them (`with_routing_replay(base)`, base the base family's
forward: qwen3_moe the Llama family's in train/prefix_forward_llama.py, qwen3_5_moe the hybrid's in
train/prefix_forward_hybrid.py; train/prefix_forward.py's PREFIX_FORWARDS pairs them), the MoE
layers' MLP being fasttrain.nn.MoEBlock. What is added: each decoder layer runs with its MoE
block's routing slot set, inside the layer's own function, so a gradient-checkpoint recompute
routes exactly as the forward did. With a rollout record (fasttrain.rollout.moe_routing.ReplayRouting)
the slot forces the rollout's experts on the prompt tokens (each distinct prompt once) and on the
answers' input tokens, in the order those tokens go through the MLP, and collects the block's own
top-k for the disagreement statistics; the weights of the forced experts come from this forward's
router (fasttrain.nn.moe_experts). Without a record (the reference forward, adapters off, for the
KL; a rollout with no record) the blocks route by themselves.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from fasttrain.nn.moe_experts import moe_blocks, routing_slot
from fasttrain.train.prefix_common import prompt_groups

__all__ = ["with_routing_replay"]


class _LayerSlot:
    """The RoutingSlot face of one MoE layer's part of a ReplayRouting."""

    def __init__(self, routing, i: int):
        self.routing, self.i = routing, i

    def forced_for(self, block) -> Tensor | None:
        return self.routing.forced(self.i)

    def seen(self, block, own: Tensor) -> None:
        self.routing.seen(self.i, own)

    def logits(self, block, logits: Tensor) -> None:
        self.routing.logits(self.i, logits)


def _routed(block, slot, run, x_p, x_a):
    with routing_slot([block], slot):
        return run(x_p, x_a)


def with_routing_replay(base_forward):
    """The shared-prefix forward of a mixture of experts whose layers run as `base_forward` (its base
    family's, with the same arguments) runs them: as fasttrain.train.prefix_forward.shared_prefix_hidden,
    the rollout's `routing` (a ReplayRouting of these rows, or None) replayed per MoE layer."""
    return functools.partial(_replayed, base_forward)


def _replayed(base_forward, model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
              prompt_len: int, T: int, prompt_index: Tensor | None = None, wrap=None,
              routing=None) -> Tensor | None:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = base.model.layers
    block_of = {id(layer.mlp): n for n, layer in enumerate(layers)}
    blocks = [b for _, b in moe_blocks(base)]
    at_layer = {block_of[id(b)]: (j, b) for j, b in enumerate(blocks) if id(b) in block_of}
    if routing is not None:
        P, A = prompt_len, T - 1
        inverse, first = prompt_groups(input_ids, attention_mask, P, prompt_index)
        rows = torch.bincount(inverse, minlength=first.shape[0])            # answers per distinct prompt
        prompt_mask, answer_mask = attention_mask[first, :P].long(), attention_mask[:, P:P + A].long()
        valid = torch.cat([prompt_mask.reshape(-1), answer_mask.reshape(-1)]).bool()
        weight = torch.cat([(prompt_mask * rows[:, None]).reshape(-1), answer_mask.reshape(-1)])
        routing.token_order(first, P, A, valid, weight)

    def layer_wrap(i, run):
        run = wrap(i, run) if wrap is not None else run
        if i not in at_layer:
            return run
        j, block = at_layer[i]
        return functools.partial(_routed, block, None if routing is None else _LayerSlot(routing, j), run)

    return base_forward(model, input_ids, attention_mask, position_ids, prompt_len, T, prompt_index,
                        wrap=layer_wrap)
