"""The decode step (decoder layers + lm_head) through torch.compile, kept per model.

Why: a decode step at rollout batch sizes is hundreds of small ops (7 projections, norms, rotary,
attention per layer); in eager PyTorch their per-op overhead is a large share of the step on a
CPU and most of it on a GPU. Inductor fuses the elementwise work around the GEMMs; on CUDA,
mode "reduce-overhead" replays the whole step as one CUDA graph.

How the shapes stay fixed (the hybrid decoder's step does the same with its conv and recurrent
states, written in place of fixed buffers): `LlamaFamilyDecoder.decode_static` writes the new keys/values at a
column given as a tensor and attends over every cache column under the key mask, so one compiled
graph serves every step of a rollout; each layer's keys and values are their own tensors, so the
compiled step writes one column in place. The cache length is rounded up to a multiple of `BUCKET`
and the cache buffer is kept here across rollouts, so prompts of different lengths share a few
compiled graphs (and, on CUDA, the captured graphs keep their static cache address).
Sampling stays outside the compiled step (it owns the seeded generator).

A mixture of experts' decoder records each token's experts for routing replay
(fasttrain.rollout.moe_decoder): its blocks route into one StepSlot for the life of this object
(set around each call, so the graph's guard on it holds), the traced step returns the top-k of
every MoE layer beside the logits, and `step` hands them to the decoder's record.
"""
from __future__ import annotations

import inspect
import time
import weakref

import torch
from torch import Tensor

from .decoder import LlamaFamilyDecoder
from .families import decoder_for

__all__ = ["CompiledDecode", "compiled_decode", "BUCKET"]

BUCKET = 64

_BY_MODEL: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class CompiledDecode:
    """step(tokens, key_valid, cos, sin, column) -> logits [B, V] (the model's dtype) on a cache it owns."""

    def __init__(self, dec: LlamaFamilyDecoder, backend: str = "inductor"):
        self.dec, self.backend = dec, backend
        # a decoder whose step holds rows itself (a hybrid's states) takes the per-row `active` mask
        self._takes_active = "active" in inspect.signature(dec.decode_static).parameters
        cuda = dec.device.type == "cuda" and backend == "inductor"
        self._fn = torch.compile(self._step, backend=backend, mode="reduce-overhead" if cuda else None,
                                 dynamic=False)
        self._caches: dict[tuple[int, int], Tensor] = {}
        from .moe_decoder import StepSlot
        self._slot = StepSlot() if hasattr(dec, "record_step") else None    # a mixture of experts' record
        self.compile_seconds = 0.0     # first call per shape (compile + first run), summed
        self._shapes_run: set[tuple] = set()

    def _step(self, tokens: Tensor, key_valid: Tensor, cos: Tensor, sin: Tensor, cache: list,
              column: Tensor, active: Tensor | None) -> Tensor:
        extra = {"active": active} if self._takes_active else {}
        h = self.dec.decode_static(tokens, key_valid, cos, sin, cache, column, **extra)
        logits = self.dec.lm_head(h)
        if self._slot is None:
            return logits, None
        return logits, torch.stack(self._slot.order, dim=1)       # [B, L, k] the step's experts

    def cache(self, batch: int, seq: int) -> list[tuple[Tensor, Tensor]]:
        """Per-layer (keys, values) [B, kv, S_max, D] for `batch` rows and at least `seq` columns."""
        seq = -(-seq // BUCKET) * BUCKET
        key = (batch, seq)
        if key not in self._caches:
            d = self.dec
            if hasattr(d, "static_cache"):   # a decoder that lays out its own fixed buffers (hybrids)
                self._caches = {key: d.static_cache(batch, seq)}
                return self._caches[key]
            c = [tuple(torch.zeros(batch, d.n_kv, seq, d.head_dim, dtype=d.dtype, device=d.device) for _ in range(2))
                 for _ in d.layers]
            if d.device.type == "cuda":
                for kv in c:
                    for t in kv:
                        torch._dynamo.mark_static_address(t)
            self._caches = {key: c}        # one live shape at a time: a new batch shape frees the old
        return self._caches[key]

    def fill(self, small, cache, group: int, prompt_len: int) -> int:
        """Give each prompt's prefilled cache (`small`, the decoder's own layout) to its `group` rows
        of the fixed cache, clearing the Llama layout's columns past the prompt; returns the width."""
        if hasattr(self.dec, "static_cache"):
            self.dec.copy_prompts(small, cache, group, prompt_len)
            return self.dec.cache_width(cache)
        for i, kv in enumerate(cache):
            for j, t in enumerate(kv):
                t[:, :, :prompt_len].unflatten(0, (-1, group)).copy_(small[i, j].unsqueeze(1))
                t[:, :, prompt_len:].zero_()
        return cache[0][0].shape[2]

    def step(self, tokens: Tensor, key_valid: Tensor, cos: Tensor, sin: Tensor, cache: list,
             column: Tensor, active: Tensor | None = None) -> Tensor:
        shape = (tuple(key_valid.shape), tokens.shape[0])
        first = shape not in self._shapes_run
        t0 = time.perf_counter()
        if self._slot is None:
            out, routing = self._fn(tokens, key_valid, cos, sin, cache, column, active if self._takes_active else None)
        else:
            from fasttrain.nn.moe_experts import routing_slot
            self._slot.order = []
            with routing_slot(self.dec.blocks, self._slot):
                out, routing = self._fn(tokens, key_valid, cos, sin, cache, column,
                                        active if self._takes_active else None)
            self.dec.record_step(routing.clone() if routing.is_cuda else routing, column, active)
        if first:
            if out.is_cuda:
                torch.cuda.synchronize()
            self.compile_seconds += time.perf_counter() - t0
            self._shapes_run.add(shape)
        return out.clone() if out.is_cuda else out   # CUDA graphs reuse their output buffer


def compiled_decode(model, weights=None, backend: str = "inductor") -> CompiledDecode:
    """The CompiledDecode of `model` with these rollout weights and torch.compile backend (tests use
    "aot_eager": the same traced graph without code generation), built on first use."""
    per = _BY_MODEL.setdefault(model, {})
    key = (id(weights), backend)
    if key not in per or per[key].dec.weights is not weights:
        per.clear()
        per[key] = CompiledDecode(decoder_for(model, weights), backend)
    return per[key]
