"""NF4Linear: a frozen NF4 base weight with an optional LoRA or DoRA adapter (fp32 masters).

The base is stored as bitsandbytes-layout NF4 (`fasttrain.ops.nf4_quantize`), 4 bits per weight plus
one absmax per 64 (fp32, or 8-bit with double quantisation: 4.13 bits per weight in all). Forward is
one `fasttrain.ops.nf4_linear` call. The adapter (initialisation, merge, the switch for the reference
policy) is `fasttrain.nn.adapted_linear.AdaptedLinear`'s; DoRA's m starts at the row norms of the
dequantised base, so the output equals the base at start.
"""
from __future__ import annotations

import torch
from torch import nn

from fasttrain.nn.adapted_linear import AdaptedLinear
from fasttrain.ops.nf4 import NF4State, nf4_dequantize, nf4_quantize
from fasttrain.ops.nf4_linear import nf4_dora_norm, nf4_linear, nf4_weight_sq_norm


class NF4Linear(AdaptedLinear):
    """y = g ⊙ (x·Wᵀ + s·x·Aᵀ·Bᵀ) + bias, W frozen NF4 [out, in]; adapter "lora" | "dora" | None."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, blocksize: int = 64,
                 double_quant: bool = False, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.blocksize, self.double_quant, self.weight_dtype = blocksize, double_quant, dtype
        n = in_features * out_features
        nb = (n + blocksize - 1) // blocksize
        self.register_buffer("qweight", torch.zeros((n + 1) // 2, dtype=torch.uint8, device=device))
        if double_quant:
            self.register_buffer("qabsmax", torch.zeros(nb, dtype=torch.uint8, device=device))
            self.register_buffer("absmax2", torch.zeros((nb + 255) // 256, device=device))
            self.register_buffer("absmax_code", torch.zeros(256, device=device))
            self.register_buffer("absmax_offset", torch.zeros((), device=device))
        else:
            self.register_buffer("absmax", torch.zeros(nb, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self.register_buffer("weight_sq_norm", None, persistent=False)

    # ---- construction --------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, blocksize: int = 64, double_quant: bool = False) -> "NF4Linear":
        w = linear.weight.detach()
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, blocksize=blocksize,
                    double_quant=double_quant, dtype=w.dtype, device=w.device)
        wq = w.float() if w.dtype == torch.float64 else w  # NF4 is defined on fp32/fp16/bf16 values
        packed, state = nf4_quantize(wq.contiguous(), blocksize=blocksize, double_quant=double_quant)
        layer.qweight.copy_(packed)
        if double_quant:
            layer.qabsmax.copy_(state.qabsmax)
            layer.absmax2.copy_(state.absmax2)
            layer.absmax_code = state.code  # the one shared 256-entry dynamic map (not a copy per layer)
            layer.absmax_offset.copy_(state.offset)
        else:
            layer.absmax.copy_(state.absmax)
        if linear.bias is not None:
            layer.bias.data.copy_(linear.bias.detach())
        return layer

    @property
    def state(self) -> NF4State:
        shape = torch.Size((self.out_features, self.in_features))
        if self.double_quant:
            return NF4State(shape, self.weight_dtype, self.blocksize, qabsmax=self.qabsmax, absmax2=self.absmax2,
                            code=self.absmax_code, offset=self.absmax_offset)
        return NF4State(shape, self.weight_dtype, self.blocksize, absmax=self.absmax)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The base weight W [out, in] as stored (NF4-rounded), in `dtype` (default: the original dtype)."""
        dtype = dtype or self.weight_dtype
        if dtype == torch.float64:  # decoded values are exact in fp32
            return nf4_dequantize(self.qweight, self.state, torch.float32).double()
        return nf4_dequantize(self.qweight, self.state, dtype)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.dequantized_weight(dtype)

    # ---- adapters ------------------------------------------------------------------------------
    def _initial_magnitude(self) -> torch.Tensor:
        # ‖W‖² once per layer (a buffer, not a parameter); m starts at ‖W + s·B·A‖ = ‖W‖ (B = 0),
        # the square root of the same ‖W‖² the op's norm starts from.
        if self.weight_dtype == torch.float64:  # an fp64 model (tests) keeps the exact fp64 sum
            self.weight_sq_norm = self.dequantized_weight(torch.float64).square().sum(1)
        else:
            self.weight_sq_norm = nf4_weight_sq_norm(self.qweight, self.state)
        return self.weight_sq_norm.double().sqrt().float()

    def attach_adapter(self, kind: str = "lora", r: int = 32, alpha: float = 64, rslora: bool = False,
                       generator: torch.Generator | None = None) -> list[nn.Parameter]:
        self.weight_sq_norm = None
        return super().attach_adapter(kind, r, alpha, rslora, generator)

    def dora_norm(self) -> torch.Tensor:
        """‖W + s·B·A‖ per output row (detached), from the factorised form."""
        a, b = self.lora_A.detach(), self.lora_B.detach()
        if self.weight_dtype == torch.float64:  # an fp64 model computes its norm in fp64, as the op does
            a, b = a.double(), b.double()
        return nf4_dora_norm(self.qweight, self.state, a, b, self.scale, self.weight_sq_norm)

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapter is None or not self.adapters_enabled:
            y = nf4_linear(x, self.qweight, self.state)
        elif self.adapter == "dora" and not torch.is_grad_enabled():
            # Rollout/decode: the adapter is fixed between optimizer steps, so DoRA's row norm (one
            # pass over W with A) is cached until A or B change (their version counters), and the
            # m/‖·‖ scale is applied to the LoRA output.
            g = (self.lora_magnitude / self._cached_dora_norm()).to(x.dtype)
            y = nf4_linear(x, self.qweight, self.state, self.lora_A, self.lora_B, self.scale) * g
        else:
            y = nf4_linear(x, self.qweight, self.state, self.lora_A, self.lora_B, self.scale, self.lora_magnitude,
                           self.weight_sq_norm)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        ad = self._adapter_repr()
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"blocksize={self.blocksize}, double_quant={self.double_quant}{ad}")
