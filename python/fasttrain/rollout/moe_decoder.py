"""The rollout's piece of the mixture-of-experts families: the Llama-family decoder (qwen3_moe) and
the hybrid decoder (qwen3_5_moe), each recording the experts every MoE layer chose for every token
it forwards, for routing replay in the update.

The layer math is the base decoders' (the MLP of a MoE layer is a fasttrain.nn.MoEBlock, called as
a module). What is added: around `prefill`, `decode` and `step_rows` (the multi-turn rollout's k
tokens per row), every MoEBlock routes into a RoutingSlot and its top-k is kept with the cache
columns its tokens went to: [n, P, L, k] for each prefill chunk of distinct prompts, [B, k, L, top-k]
per step. The compiled decode step (fasttrain.rollout.compiled_decode) routes into a `StepSlot`
inside its graph and returns the step's top-k beside the logits, which it hands to `record_step`.
`routing_record(group, T)` assembles them into the rollout's record [B, P+T, L, k] (column j of
row b: the experts of the token at column j, prompt, sampled or tool-result; a column no real token
was forwarded at, such as the last answer column or a held row's, holds zeros and is never read),
uint8 when E <= 256, else int16. `start_record()` begins a rollout's record (the compiled step's
decoder is kept across rollouts).
"""
from __future__ import annotations

import torch
from torch import Tensor

from fasttrain.nn.moe_experts import RoutingSlot, moe_blocks, routing_slot

from .decoder import LlamaFamilyDecoder
from .hybrid_decoder import HybridDecoder

__all__ = ["MoEDecoder", "MoEHybridDecoder", "StepSlot", "record_dtype"]


def record_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype of an expert index."""
    return torch.uint8 if num_experts <= 256 else torch.int16


class StepSlot(RoutingSlot):
    """The routing slot of the compiled decode step: the blocks' own top-k in call (layer) order,
    a list the traced step appends to and returns (no dict keyed by modules inside the graph)."""

    def __init__(self):
        super().__init__()
        self.order: list[Tensor] = []

    def forced_for(self, block) -> Tensor | None:
        return None

    def seen(self, block, own: Tensor) -> None:
        self.order.append(own.detach())


class _Recording:
    """Mixed into a decoder: keeps the experts of every forwarded token (see the module header)."""

    def _start_record(self) -> None:
        self.blocks = [b for _, b in moe_blocks(self.model)]
        if not self.blocks:
            from fasttrain.models.moe import hf_sparse_blocks
            found = hf_sparse_blocks(self.model)
            what = (f"its {len(found)} sparse blocks are transformers' own ({type(found[0][1]).__name__})"
                    if found else "it has no mixture-of-experts block fasttrain knows")
            raise ValueError(
                f"fasttrain.rollout: a {type(self.model).__name__} mixture-of-experts model needs fasttrain's "
                f"expert blocks to decode and record its routing, but {what}; call "
                "fasttrain.models.moe.moe_surgery(model, nf4=False) first (the trainer's build_policy does)")
        self.start_record()

    def start_record(self) -> None:
        """Begin a rollout's record (what an earlier rollout recorded is dropped)."""
        self.prompt_routing: list[Tensor] = []             # per prefill chunk [n, P, L, k]
        self.step_routing: list[tuple[Tensor, Tensor, Tensor]] = []   # (columns [B, s], valid [B, s], [B, s, L, k])

    def _routed(self, fn, *args, **kw):
        slot = RoutingSlot()
        with routing_slot(self.blocks, slot):
            out = fn(*args, **kw)
        return out, torch.stack([slot.chosen[b] for b in self.blocks], dim=1)    # [N, L, k]

    def prefill(self, input_ids: Tensor, *args, **kw):
        h, r = self._routed(super().prefill, input_ids, *args, **kw)
        self.prompt_routing.append(r.view(*input_ids.shape, *r.shape[1:]))      # [n, P, L, k]
        return h

    def record_step(self, routing: Tensor, column: int | Tensor, valid: Tensor | None = None) -> None:
        """One token per row decoded at cache `column` with its top-k [B, L, k] (valid [B]: which rows
        forwarded a real token; None: all)."""
        B = routing.shape[0]
        col = torch.as_tensor(column, device=routing.device).reshape(-1)[:1].expand(B)[:, None]
        ok = torch.ones(B, 1, dtype=torch.bool, device=routing.device) if valid is None else valid[:, None]
        self.step_routing.append((col, ok, routing[:, None]))

    def decode(self, tokens: Tensor, key_valid: Tensor, cos: Tensor, sin: Tensor, cache, column, active=None):
        h, r = self._routed(super().decode, tokens, key_valid, cos, sin, cache, column, active=active)
        self.record_step(r, column, active)                                        # r: [B, L, k]
        return h

    def step_rows(self, tokens: Tensor, valid: Tensor, columns: Tensor, *args, **kw):
        h, r = self._routed(super().step_rows, tokens, valid, columns, *args, **kw)
        self.step_routing.append((columns, valid.bool(), r.view(*tokens.shape, *r.shape[1:])))
        return h

    def routing_record(self, group: int, T: int) -> Tensor | None:
        """[B, P+T, L, k] of this rollout (see the module header), or None without a prefill."""
        if not self.prompt_routing or not self.blocks:
            return None
        prompts = torch.cat(self.prompt_routing).repeat_interleave(group, dim=0)    # [B, P, L, k]
        B, P, L, k = prompts.shape
        rec = prompts.new_zeros(B, P + T, L, k)
        rec[:, :P] = prompts
        for cols, ok, r in self.step_routing:
            keep = ok & (cols >= P) & (cols < P + T)
            rows = torch.arange(B, device=cols.device)[:, None].expand_as(cols)
            rec[rows[keep], cols[keep]] = r[keep].to(rec.dtype)
        return rec.to(record_dtype(self.blocks[0].num_experts))


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
