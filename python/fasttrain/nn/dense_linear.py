"""DenseLinear: a frozen 16-bit base weight (the model's own dtype) with an optional LoRA or DoRA
adapter in fp32 masters: `policy.quantize = "none"`.

Forward, in PEFT's arrangement of the same math y = g ⊙ (x·Wᵀ + s·x·Aᵀ·Bᵀ) + bias:
  base = x·Wᵀ + bias                     the layer's own F.linear in the model's dtype
  LoRA:  y = base + s·(x·Aᵀ)·Bᵀ
  DoRA:  y = base + (g − 1)·(base − bias) + g·s·(x·Aᵀ)·Bᵀ,   g = m / ‖W + s·B·A‖_row (detached)
the adapter terms and the sum in fp32 (fp64 for an fp64 model), rounded once to the model's dtype.
The base term is the layer's own F.linear (so adapters off is the model itself), except for a bf16
model on a CPU without native bf16 GEMMs (no avx512_bf16, or ATen below AVX512: the same answer as
fasttrain._C.cpu_has_bf16): there ATen's bf16 GEMM runs about 60x below its fp32 one (0.6 against
36 GFLOP/s at 1024^3 on a 2-core AVX2 EPYC), so the base is x·Wᵀ computed in fp32 from the bf16
values (exact products, fp32 sums) and kept in fp32 until the one rounding; its backward to x is
the fp32 product dy·W rounded once, and nothing but the frozen W is saved for it. A fresh adapter (B = 0, and for DoRA m = the same row norms the first ‖·‖ gives, so g = 1 exactly)
adds exact zeros: the output is unchanged bit for bit. DoRA's row norm is formed explicitly,
W + s·B·A in fp32 a block of rows at a time (bounded scratch), and cached until A or B change.
What it is not: a quantized layer (NF4Linear) or a kernel of its own; every product is ATen's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fasttrain.nn.adapted_linear import AdaptedLinear

__all__ = ["DenseLinear", "dense_linear", "dense_dora_norm", "base_term", "cpu_bf16_native", "fp32_base",
           "linear_bf16_as_fp32", "rollout_head", "Fp32Head", "NORM_BLOCK_ELEMENTS"]

# Rows of W + s·B·A formed at once for DoRA's norm: 2^22 fp32 elements = 16 MiB of scratch.
NORM_BLOCK_ELEMENTS = 1 << 22


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_NATIVE_BF16: bool | None = None


def cpu_bf16_native() -> bool:
    """Whether bf16 GEMMs on this CPU run natively (fasttrain._C.cpu_has_bf16; False without the
    extension, the safe answer: fp32 sums are never less exact)."""
    global _NATIVE_BF16
    if _NATIVE_BF16 is None:
        try:
            from fasttrain.host import cpu_bf16_compute
            _NATIVE_BF16 = cpu_bf16_compute()
        except (ImportError, OSError, RuntimeError):
            _NATIVE_BF16 = False
    return _NATIVE_BF16


def fp32_base(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the base term x·Wᵀ is computed in fp32 (see the module header)."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and not cpu_bf16_native())


class _Fp32Base(torch.autograd.Function):
    """x·Wᵀ + bias in fp32 from bf16 x and W (returned in fp32); W and bias frozen."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        ctx.x_dtype = x.dtype
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())

    @staticmethod
    def backward(ctx, dy):
        (weight,) = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dy.float() @ weight.float()).to(ctx.x_dtype)
        return dx, None, None


# Rows of a bf16 weight upcast at once by `linear_bf16_as_fp32` (4096 x 576 fp32 = 9 MiB for SmolLM2's
# head): the fp32 copy of a 49152-row head would add 113 MiB to the rollout's peak; in slices it adds
# one slice, and the product runs at the fp32 rate (43 ms against 62 ms for bf16 on 16 rows, 2-core AVX2).
UPCAST_ROWS = 4096


@torch.no_grad()
def linear_bf16_as_fp32(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x·Wᵀ for the rollout (no autograd) where `fp32_base(x, weight)`: fp32 sums from the bf16
    values, W upcast UPCAST_ROWS rows at a time; rounded to `out_dtype` (default x.dtype)."""
    xf = x.float()
    n = weight.shape[0]
    if n <= UPCAST_ROWS:
        return F.linear(xf, weight.float()).to(out_dtype or x.dtype)
    out = torch.empty(*x.shape[:-1], n, dtype=out_dtype or x.dtype, device=x.device)
    for i in range(0, n, UPCAST_ROWS):
        out[..., i:i + UPCAST_ROWS] = F.linear(xf, weight[i:i + UPCAST_ROWS].float())
    return out


class Fp32Head(nn.Module):
    """A rollout's view of a bias-free bf16 head (lm_head) that returns fp32 logits computed in fp32
    on a CPU without native bf16 GEMMs (`linear_bf16_as_fp32`), else the head itself, cast to fp32."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = getattr(self.head, "weight", None)
        if isinstance(self.head, nn.Linear) and self.head.bias is None and w is not None and fp32_base(h, w):
            return linear_bf16_as_fp32(h, w, torch.float32)
        return self.head(h)


def rollout_head(head: nn.Module) -> nn.Module:
    """The head a rollout decoder calls: `Fp32Head(head)` where a bf16 head on the CPU would run
    ATen's slow bf16 GEMM, else `head` unchanged."""
    w = getattr(head, "weight", None)
    if (isinstance(head, nn.Linear) and head.bias is None and w is not None and w.device.type == "cpu"
            and w.dtype == torch.bfloat16 and not cpu_bf16_native()):
        return Fp32Head(head)
    return head


def base_term(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The layer's base x·Wᵀ + bias: in fp32 where `fp32_base` says so, else F.linear in x.dtype."""
    if fp32_base(x, weight):
        return _Fp32Base.apply(x, weight, bias)
    return F.linear(x, weight, bias)


@torch.no_grad()
def dense_dora_norm(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """‖W + scale·B·A‖ per output row [out] in fp32 (fp64 for an fp64 weight), W + scale·B·A formed
    NORM_BLOCK_ELEMENTS at a time. weight [out, in], lora_a [r, in], lora_b [out, r]."""
    ct = _compute_dtype(weight.dtype)
    a = lora_a.detach().to(ct)
    out, k = weight.shape
    step = max(1, NORM_BLOCK_ELEMENTS // max(1, k))
    w, b = weight.detach(), lora_b.detach()
    return torch.cat([torch.addmm(w[i:i + step].to(ct), b[i:i + step].to(ct), a, alpha=scale).norm(dim=1)
                      for i in range(0, out, step)])


class _AddRounded(torch.autograd.Function):
    """base + lora summed in lora's (wider) dtype and rounded once to `dtype`, in one pass over the
    output: the same bits as (base.to(lora.dtype) + lora).to(dtype) without the two widened copies
    (ATen's add computes in the operands' common dtype and casts as it stores into `out`). The
    backward hands each operand the incoming gradient in its own dtype, as that expression's
    autograd does (a bf16 gradient widened to fp32 and back is exact)."""

    @staticmethod
    def forward(ctx, base, lora, dtype):
        ctx.dtypes = (base.dtype, lora.dtype)
        return torch.add(base, lora, out=torch.empty(lora.shape, dtype=dtype, device=lora.device))

    @staticmethod
    def backward(ctx, g):
        base_dtype, lora_dtype = ctx.dtypes
        return (g.to(base_dtype) if ctx.needs_input_grad[0] else None,
                g.to(lora_dtype) if ctx.needs_input_grad[1] else None, None)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 lora_a: torch.Tensor | None = None, lora_b: torch.Tensor | None = None, scale: float = 1.0,
                 dora_m: torch.Tensor | None = None, dora_norm: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out] in x.dtype: F.linear(x, weight, bias) plus the LoRA/DoRA terms (see
    the module header). lora_a [r, in], lora_b [out, r] (both or neither); dora_m [out] DoRA's
    magnitude; dora_norm [out] ‖W + s·B·A‖ when the caller has it (else formed here), detached.
    Autograd: x, lora_a, lora_b, dora_m."""
    if (lora_a is None) != (lora_b is None) or (dora_m is not None and lora_a is None):
        raise ValueError("dense_linear: lora_a and lora_b go together, and dora_m needs them")
    base = base_term(x, weight, bias)
    if lora_a is None:
        return base.to(x.dtype)
    ct = _compute_dtype(x.dtype)
    # s·(x·Aᵀ)·Bᵀ with s applied to the r-wide product (the same value where s is a power of two, as
    # alpha / rank usually is; otherwise one fp32 rounding apart), not to the out-wide one
    lora = F.linear(F.linear(x.to(ct), lora_a.to(ct)) * scale, lora_b.to(ct))
    if dora_m is None:
        return _AddRounded.apply(base, lora, x.dtype)
    norm = dense_dora_norm(weight, lora_a, lora_b, scale) if dora_norm is None else dora_norm.detach()
    g = dora_m.to(ct) / norm.to(ct)
    base_c = base.to(ct)
    no_bias = base_c if bias is None else base_c - bias.to(ct)
    return (base_c + (g - 1) * no_bias + g * lora).to(x.dtype)


class DenseLinear(AdaptedLinear):
    """y = g ⊙ (x·Wᵀ + s·x·Aᵀ·Bᵀ) + bias, W the frozen 16-bit weight [out, in]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dim() != 2:
            raise ValueError(f"DenseLinear: weight must be [out_features, in_features], got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.weight_dtype = weight.dtype
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "DenseLinear":
        """The same weight and bias tensors (no copy), frozen."""
        return cls(linear.weight, linear.bias)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def base_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.weight.detach().to(dtype or self.weight_dtype, copy=True)   # callers may write into it

    # ---- DoRA's row norm -----------------------------------------------------------------------
    def _initial_magnitude(self) -> torch.Tensor:
        # the same function as every later norm, with B = 0: g = m / ‖·‖ is exactly 1 at start
        return dense_dora_norm(self.weight, self.lora_A, torch.zeros_like(self.lora_B), self.scale).float()

    def dora_norm(self) -> torch.Tensor:
        return dense_dora_norm(self.weight, self.lora_A, self.lora_B, self.scale)

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.adapter is None or not self.adapters_enabled:
            return dense_linear(x, self.weight, self.bias)
        if self.adapter == "lora":
            return dense_linear(x, self.weight, self.bias, self.lora_A, self.lora_B, self.scale)
        # the norm is detached and changes only with A and B: cached across forwards (versions)
        return dense_linear(x, self.weight, self.bias, self.lora_A, self.lora_B, self.scale, self.lora_magnitude,
                            self._cached_dora_norm())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"dtype={self.weight_dtype}{self._adapter_repr()}")
