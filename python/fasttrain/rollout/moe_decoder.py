"""The rollout's piece of the mixture-of-experts families: the Llama-family decoder (qwen3_moe) and
the hybrid decoder (qwen3_5_moe), each recording the experts every MoE layer chose for every token
it forwards, for routing replay in the update.

The layer math is the base decoders' (the MLP of a MoE layer is a fasttrain.nn.MoEBlock, called as
a module). What is added: around `prefill` and `decode`, every MoEBlock routes into a RoutingSlot
and its top-k is kept, [n, P, L, k] for the n distinct prompts and [B, L, k] per decoded column.
`routing_record(group, T)` assembles them into the rollout's record [B, P+T, L, k] (column j of
row b: the experts of the token at column j; the last answer column is never forwarded and holds
zeros), uint8 when E <= 256, else int16.

What is not recorded: the compiled decode step and the multi-turn rollout's `step_rows` (their
record is None, and the update routes by itself for those rollouts).
"""
from __future__ import annotations

import torch
from torch import Tensor

from fasttrain.nn.moe_experts import RoutingSlot, moe_blocks, routing_slot

from .decoder import LlamaFamilyDecoder
from .hybrid_decoder import HybridDecoder

__all__ = ["MoEDecoder", "MoEHybridDecoder", "record_dtype"]


def record_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype of an expert index."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class _Recording:
    """Mixed into a decoder: keeps the experts of every forwarded token (see the module header)."""

    def _start_record(self) -> None:
        self.blocks = [b for _, b in moe_blocks(self.model)]
        self.prompt_routing: Tensor | None = None
        self.step_routing: list[Tensor] = []

    def _routed(self, fn, *args, **kw):
        slot = RoutingSlot()
        with routing_slot(self.blocks, slot):
            out = fn(*args, **kw)
        return out, torch.stack([slot.chosen[b] for b in self.blocks], dim=1)    # [N, L, k]

    def prefill(self, input_ids: Tensor, *args, **kw):
        h, r = self._routed(super().prefill, input_ids, *args, **kw)
        self.prompt_routing = r.view(*input_ids.shape, *r.shape[1:])            # [n, P, L, k]
        self.step_routing = []
        return h

    def decode(self, tokens: Tensor, *args, **kw):
        h, r = self._routed(super().decode, tokens, *args, **kw)
        self.step_routing.append(r)                                               # [B, L, k]
        return h

    def routing_record(self, group: int, T: int) -> Tensor | None:
        """[B, P+T, L, k] of this rollout (see the module header), or None when not every forwarded
        token was recorded (compiled decode)."""
        if self.prompt_routing is None or len(self.step_routing) != T - 1 or not self.blocks:
            return None
        dt = record_dtype(self.blocks[0].num_experts)
        prompts = self.prompt_routing.repeat_interleave(group, dim=0)
        B, _, L, k = prompts.shape
        cols = [prompts] + [s[:, None] for s in self.step_routing] + [prompts.new_zeros(B, 1, L, k)]
        return torch.cat(cols, dim=1).to(dt)


class MoEDecoder(_Recording, LlamaFamilyDecoder):
    """qwen3_moe: the Llama-family decoder, recording the routing."""

    def __init__(self, model, weights=None):
        super().__init__(model, weights)
        self._start_record()


class MoEHybridDecoder(_Recording, HybridDecoder):
    """qwen3_5_moe: the Qwen3.5 hybrid decoder, recording the routing."""

    def __init__(self, model, weights=None):
        super().__init__(model, weights)
        self._start_record()
