"""AdaptedLinear: what every frozen-base linear layer with a LoRA or DoRA adapter shares.

A subclass holds the frozen base weight W [out, in] its own way (NF4Linear: packed 4-bit codes;
DenseLinear: the model's 16-bit tensor) and says how to read it (`base_weight`), how to form DoRA's
row norm ‖W + s·B·A‖ (`dora_norm`) and the magnitude's starting value (`_initial_magnitude`). Here
live the adapter itself (fp32 masters A [r, in], B [out, r], DoRA's m [out]), initialised as PEFT
does (A Kaiming-uniform with a=√5, B zero, m = ‖W‖ per row, so the output equals the base at
start), the switch that turns it off for the reference policy, and the merged weight. What it is
not: a forward; each subclass computes y = g ⊙ (x·Wᵀ + s·x·Aᵀ·Bᵀ) + bias in its own kernel.
"""
from __future__ import annotations

import math
from typing import Iterator

import torch
from torch import nn

__all__ = ["AdaptedLinear", "adapted_layers"]


class AdaptedLinear(nn.Module):
    """Frozen base W [out_features, in_features] (+ bias) with an optional adapter "lora" | "dora"."""

    in_features: int
    out_features: int
    weight_dtype: torch.dtype

    def __init__(self):
        super().__init__()
        self.adapter: str | None = None
        self.r, self.alpha, self.rslora, self.scale = 0, 0.0, False, 0.0
        for name in ("lora_A", "lora_B", "lora_magnitude"):
            self.register_parameter(name, None)
        self.adapters_enabled = True

    # ---- what a subclass provides --------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A new tensor holding the frozen base weight W [out, in] as the layer computes with it, in
        `dtype` (default: the model's dtype); the caller may write into it."""
        raise NotImplementedError

    def dora_norm(self) -> torch.Tensor:
        """‖W + s·B·A‖ per output row [out] (detached)."""
        raise NotImplementedError

    def _initial_magnitude(self) -> torch.Tensor:
        """DoRA's m at attach time (B = 0): ‖W‖ per row, formed so that the first `dora_norm` equals
        it bit for bit (then g = m / ‖·‖ is exactly 1 and a fresh adapter changes nothing)."""
        raise NotImplementedError

    # ---- adapters ------------------------------------------------------------------------------
    def attach_adapter(self, kind: str = "lora", r: int = 32, alpha: float = 64, rslora: bool = False,
                       generator: torch.Generator | None = None) -> list[nn.Parameter]:
        """Add a fresh LoRA or DoRA adapter (fp32), initialised as PEFT does; returns its parameters."""
        if kind not in ("lora", "dora"):
            raise ValueError(f"attach_adapter: kind must be 'lora' or 'dora', got {kind!r}")
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"attach_adapter: r must be a positive int, got {r!r}")
        dev = self.device
        a = torch.empty(r, self.in_features, dtype=torch.float32, device=dev)
        # PEFT's default init: nn.init.kaiming_uniform_(A, a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / math.sqrt(self.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, dtype=torch.float32, device=dev))
        self.adapter, self.r, self.alpha, self.rslora = kind, r, float(alpha), bool(rslora)
        self.scale = float(alpha) / (math.sqrt(r) if rslora else r)
        params = [self.lora_A, self.lora_B]
        self.__dict__.pop("_dora_norm_cache", None)      # a norm of the previous adapter, if any
        self.lora_magnitude = None
        if kind == "dora":
            self.lora_magnitude = nn.Parameter(self._initial_magnitude())
            params.append(self.lora_magnitude)
        return params

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for p in (self.lora_A, self.lora_B, self.lora_magnitude) if p is not None]

    def _cached_dora_norm(self) -> torch.Tensor:
        """`dora_norm()`, recomputed only when A, B (their version counters) or s changed."""
        key = (self.lora_A._version, self.lora_B._version, self.lora_A.data_ptr(), self.lora_B.data_ptr(), self.scale)
        cache = getattr(self, "_dora_norm_cache", None)
        if cache is None or cache[0] != key:
            cache = (key, self.dora_norm())
            self._dora_norm_cache = cache
        return cache[1]

    def merged_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """W + s·B·A (LoRA) or m/‖W + s·B·A‖ ⊙ (W + s·B·A) (DoRA), computed in fp32, returned in dtype."""
        w = self.base_weight(torch.float32)
        if self.adapter is not None:
            w = w + self.scale * (self.lora_B.detach() @ self.lora_A.detach())
            if self.adapter == "dora":
                w = w * (self.lora_magnitude.detach() / w.norm(dim=1)).unsqueeze(1)
        return w.to(dtype)

    def _adapter_repr(self) -> str:
        if self.adapter is None:
            return ""
        return f", adapter={self.adapter}(r={self.r}, alpha={self.alpha:g}" + (", rslora" if self.rslora else "") + ")"


def adapted_layers(model: nn.Module) -> Iterator[tuple[str, AdaptedLinear]]:
    """(qualified name, layer) for every adaptable linear layer (NF4 or 16-bit base), in module order."""
    for name, mod in model.named_modules():
        if isinstance(mod, AdaptedLinear):
            yield name, mod
