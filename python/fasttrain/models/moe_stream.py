"""The mixture-of-experts piece of the streamed NF4 load (fasttrain.models.stream_load): each expert's
slices are quantized to NF4 as they are read, so no 16-bit expert stack is ever held.

    load_streamed(path, dtype, quantize="nf4", targets=..., claim=ExpertCollector(config, renormalize))

The loader offers every checkpoint tensor to `take` first. Checkpoints store the routed experts per
expert (transformers splits its fused stacks at save: `<layer>.mlp.experts.<e>.gate_proj.weight`,
`up_proj`, `down_proj`, each [I, H] or [H, I]) or fused (`<layer>.mlp.experts.gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I]). A per-expert gate slice waits for its up slice (one expert's
[I, H] in 16 bits), then [gate; up] is quantized as that expert's gate_up weight, exactly as
fasttrain.ops.ExpertStack.quantize does it; a down slice is quantized at once; a fused stack is
quantized one expert at a time as read (its 16-bit bytes are read whole, the one place a layer's
stack is in memory: a fused checkpoint's peak). `finish(model)` puts a fasttrain.nn.MoEBlock in
place of each transformers sparse block (its router and shared expert as loaded), before the
loader checks that every tensor arrived.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from fasttrain.ops.moe_experts import ExpertStack
from fasttrain.ops.nf4 import nf4_quantize

__all__ = ["ExpertCollector"]

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class ExpertCollector:
    """Receives the expert tensors of a streamed load and quantizes them as they come."""

    def __init__(self, top_k: int, renormalize: bool, blocksize: int = 64):
        self.top_k, self.renormalize, self.blocksize = int(top_k), bool(renormalize), blocksize
        self.quantized: dict[str, dict[str, dict[int, tuple]]] = {}     # experts path -> stack -> e -> NF4
        self.waiting: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def _put(self, path: str, stack: str, e: int, w: torch.Tensor) -> None:
        self.quantized.setdefault(path, {"gate_up": {}, "down": {}})[stack][e] = nf4_quantize(
            w.contiguous(), blocksize=self.blocksize)

    def take(self, key: str, info: dict, read, dtype: torch.dtype) -> bool:
        """Quantize `key` if it is an expert tensor (True), else leave it to the loader (False)."""
        q = torch.float32 if dtype == torch.float64 else dtype
        m = _PER_EXPERT.match(key)
        if m:
            path, e, which = m.group(1), int(m.group(2)), m.group(3)
            if which == "down":
                self._put(path, "down", e, read(q))
                return True
            got = self.waiting.setdefault((path, e), {})
            got[which] = read(q)
            if len(got) == 2:
                del self.waiting[(path, e)]
                self._put(path, "gate_up", e, torch.cat([got["gate"], got["up"]]))
            return True
        m = _FUSED.match(key)
        if m:
            path, stack = m.group(1), "gate_up" if m.group(2) == "gate_up_proj" else "down"
            for e, w in enumerate(read(q)):
                self._put(path, stack, e, w)
            return True
        return False

    def finish(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Every transformers sparse block whose experts arrived becomes a MoEBlock (in place)."""
        from fasttrain.models.moe import hf_sparse_blocks
        from fasttrain.nn.moe_experts import MoEBlock, MoEExperts
        from fasttrain.nn.surgery import set_module
        if self.waiting:
            (path, e), got = next(iter(self.waiting.items()))
            raise ValueError(f"the checkpoint has part of expert {e} of {path} (got {sorted(got)} of gate, up)")
        for name, block in hf_sparse_blocks(model):
            got = self.quantized.pop(f"{name}.experts", None)    # freed once stacked: one layer held twice
            if got is None:
                continue                          # left to the loader's check of missing tensors
            E = block.experts.gate_up_proj.shape[0]
            for stack in ("gate_up", "down"):
                if sorted(got[stack]) != list(range(E)):
                    raise ValueError(f"{name}.experts: the checkpoint has {len(got[stack])} of the {E} experts' "
                                     f"{stack} weights")
            experts = MoEExperts(*(ExpertStack.from_quantized([got[s][e] for e in range(E)], dtype)
                                   for s in ("gate_up", "down")))
            set_module(model, name, MoEBlock(block.gate.weight, experts, self.top_k, self.renormalize,
                                              getattr(block, "shared_expert", None),
                                              getattr(block, "shared_expert_gate", None)))
        self.quantized.clear()
