"""NF4Linear: a frozen NF4 base weight with an optional LoRA or DoRA adapter (fp32 masters).

The base is stored as bitsandbytes-layout NF4 (`fasttrain.ops.nf4_quantize`), 4 bits per weight plus
one absmax per 64 (fp32, or 8-bit with double quantisation: 4.13 bits per weight in all). Forward is
one `fasttrain.ops.nf4_linear` call. Adapter initialisation follows PEFT (LoRA: A Kaiming-uniform with
a=√5, B zero; DoRA: m = row norms of the dequantised base), so the output equals the base at start.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from fasttrain.ops.nf4 import NF4State, nf4_dequantize, nf4_quantize
from fasttrain.ops.nf4_linear import nf4_dora_norm, nf4_linear, nf4_weight_sq_norm


class NF4Linear(nn.Module):
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
        self.adapter: str | None = None
        self.r, self.alpha, self.rslora, self.scale = 0, 0.0, False, 0.0
        for name in ("lora_A", "lora_B", "lora_magnitude"):
            self.register_parameter(name, None)
        self.register_buffer("weight_sq_norm", None, persistent=False)
        self.adapters_enabled = True

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

    # ---- adapters ------------------------------------------------------------------------------
    def attach_adapter(self, kind: str = "lora", r: int = 32, alpha: float = 64, rslora: bool = False,
                       generator: torch.Generator | None = None) -> list[nn.Parameter]:
        """Add a fresh LoRA or DoRA adapter (fp32), initialised as PEFT does; returns its parameters."""
        if kind not in ("lora", "dora"):
            raise ValueError(f"attach_adapter: kind must be 'lora' or 'dora', got {kind!r}")
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"attach_adapter: r must be a positive int, got {r!r}")
        dev = self.qweight.device
        a = torch.empty(r, self.in_features, dtype=torch.float32, device=dev)
        # PEFT's default init: nn.init.kaiming_uniform_(A, a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)).
        bound = 1.0 / math.sqrt(self.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, r, dtype=torch.float32, device=dev))
        self.adapter, self.r, self.alpha, self.rslora = kind, r, float(alpha), bool(rslora)
        self.scale = float(alpha) / (math.sqrt(r) if rslora else r)
        params = [self.lora_A, self.lora_B]
        self.lora_magnitude = None
        self.weight_sq_norm = None
        if kind == "dora":
            # ‖W‖² once per layer (a buffer, not a parameter); m starts at ‖W + s·B·A‖ = ‖W‖ (B = 0).
            if self.weight_dtype == torch.float64:  # an fp64 model (tests) keeps the exact fp64 sum
                self.weight_sq_norm = self.dequantized_weight(torch.float64).square().sum(1)
            else:
                self.weight_sq_norm = nf4_weight_sq_norm(self.qweight, self.state)
            self.lora_magnitude = nn.Parameter(self.weight_sq_norm.double().sqrt().float())
            params.append(self.lora_magnitude)
        return params

    def adapter_parameters(self) -> list[nn.Parameter]:
        return [p for p in (self.lora_A, self.lora_B, self.lora_magnitude) if p is not None]

    def dora_norm(self) -> torch.Tensor:
        """‖W + s·B·A‖ per output row (detached), from the factorised form."""
        a, b = self.lora_A.detach(), self.lora_B.detach()
        if self.weight_dtype == torch.float64:  # an fp64 model computes its norm in fp64, as the op does
            a, b = a.double(), b.double()
        return nf4_dora_norm(self.qweight, self.state, a, b, self.scale, self.weight_sq_norm)

    def _cached_dora_norm(self) -> torch.Tensor:
        key = (self.lora_A._version, self.lora_B._version, self.lora_A.data_ptr(), self.lora_B.data_ptr(), self.scale)
        cache = getattr(self, "_dora_norm_cache", None)
        if cache is None or cache[0] != key:
            cache = (key, self.dora_norm())
            self._dora_norm_cache = cache
        return cache[1]

    def merged_weight(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """W + s·B·A (LoRA) or m/‖W + s·B·A‖ ⊙ (W + s·B·A) (DoRA), computed in fp32, returned in dtype."""
        w = self.dequantized_weight(torch.float32)
        if self.adapter is not None:
            w = w + self.scale * (self.lora_B.detach() @ self.lora_A.detach())
            if self.adapter == "dora":
                w = w * (self.lora_magnitude.detach() / w.norm(dim=1)).unsqueeze(1)
        return w.to(dtype)

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
        ad = "" if self.adapter is None else f", adapter={self.adapter}(r={self.r}, alpha={self.alpha:g}" + \
            (", rslora" if self.rslora else "") + ")"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"blocksize={self.blocksize}, double_quant={self.double_quant}{ad}")
