"""NF4 linear with LoRA / DoRA adapters: y = g ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ).

W is a frozen NF4 weight [N, K] (bitsandbytes layout, see `fasttrain.ops.nf4`); A [r, K] and B [N, r]
are the LoRA factors (fp32 masters); for DoRA g = m / ‖W + s·B·A‖_row with the norm detached (as in
the DoRA paper and PEFT), else g = 1. The dequantised W is never saved for the backward: the
backward decodes it again. The DoRA norm comes from ‖W‖² + 2s·rowdot(B, A·Wᵀ) + s²·rowdot(B·A·Aᵀ, B),
so W + s·B·A is never formed.
"""
from __future__ import annotations

import torch

from fasttrain._native import load as _load
from fasttrain.host import cpu_bf16_compute
from fasttrain.ops import reference as _reference
from fasttrain.ops.kernels import use_reference as _use_reference
from fasttrain.ops.nf4 import NF4State

_load()
_ops = torch.ops.fasttrain

__all__ = ["nf4_linear", "nf4_dora_norm", "nf4_weight_sq_norm"]


def nf4_linear(x: torch.Tensor, qweight: torch.Tensor, state: NF4State, lora_a: torch.Tensor | None = None,
               lora_b: torch.Tensor | None = None, scale: float = 1.0, dora_m: torch.Tensor | None = None,
               weight_sq_norm: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in_features] -> [..., out_features] in x.dtype.

    qweight/state: `fasttrain.ops.nf4_quantize` of a [out, in] weight. lora_a [r, in], lora_b [out, r]
    (both or neither), scale = alpha/r (or alpha/sqrt(r) for rsLoRA), dora_m [out] DoRA magnitude.
    weight_sq_norm [out] fp32: ‖W‖² per row, to skip recomputing it (DoRA only).
    Autograd: x, lora_a, lora_b, dora_m.
    """
    if not isinstance(state, NF4State):
        raise ValueError("nf4_linear: state must be the NF4State of a 2-D weight [out_features, in_features]")
    _reference.check_nf4_linear_args(x, state, lora_a, lora_b, dora_m)
    out_features, in_features = state.shape
    if _use_reference():
        return _reference.nf4_linear(x, qweight, state, lora_a, lora_b, scale, dora_m, weight_sq_norm)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    y, _, _, _ = _ops.nf4_linear(x2, qweight, state.absmax_fp32(), state.blocksize, out_features,
                                 lora_a, lora_b, float(scale), dora_m, weight_sq_norm)
    return y.view(*lead, out_features)


def nf4_dora_norm(qweight: torch.Tensor, state: NF4State, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  scale: float, weight_sq_norm: torch.Tensor | None = None) -> torch.Tensor:
    """‖W + scale·B·A‖ per output row [out] from the factorised form (fp64 when lora_a is fp64)."""
    if _use_reference():
        return _reference.nf4_dora_norm(qweight, state, lora_a, lora_b, scale, weight_sq_norm)
    return _ops.nf4_dora_norm(qweight, state.absmax_fp32(), state.blocksize, state.shape[0], lora_a, lora_b,
                              float(scale), weight_sq_norm)


def nf4_weight_sq_norm(qweight: torch.Tensor, state: NF4State) -> torch.Tensor:
    """‖W‖² per output row [out], fp32 (summed in fp64)."""
    if _use_reference():
        return _reference.nf4_weight_sq_norm(qweight, state)
    return _ops.nf4_weight_sq_norm(qweight, state.absmax_fp32(), state.blocksize, state.shape[0], state.shape[1])


# ---- torch.compile faces ---------------------------------------------------------------------------
def _stat_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.register_fake("fasttrain::nf4_linear")
def _(x, packed, absmax, blocksize, out_features, lora_a, lora_b, scale, dora_m, weight_sq_norm):
    m = x.shape[0]
    y = x.new_empty((m, out_features))
    ct = torch.float64 if x.dtype == torch.float64 else (x.dtype if x.is_cuda else torch.float32)
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        ct = torch.bfloat16 if cpu_bf16_compute() else torch.float32
    xa_dt = torch.float32 if x.is_cuda else ct  # CUDA keeps x·Aᵀ in fp32
    xa = x.new_empty((m, lora_a.shape[0]), dtype=xa_dt) if lora_a is not None else x.new_empty((0,), dtype=xa_dt)
    dora = dora_m is not None
    rnorm = x.new_empty((out_features,) if dora else (0,), dtype=_stat_dtype(x))
    if x.is_cuda:
        rnorm = x.new_empty(rnorm.shape, dtype=torch.float32)
    z = x.new_empty((m, out_features) if dora else (0,), dtype=ct)
    return y, xa, rnorm, z


_cpu_bf16_compute = cpu_bf16_compute   # the old private name, kept for one release: fasttrain.host's


@torch.library.register_fake("fasttrain::nf4_linear_backward")
def _(dy, x, packed, absmax, blocksize, out_features, lora_a, lora_b, scale, dora_m, xa, rnorm, z, output_mask):
    e = lambda: x.new_empty((0,))  # noqa: E731  (a fresh tensor per output: outputs never alias)
    dx = x.new_empty(x.shape) if output_mask[0] else e()
    da = lora_a.new_empty(lora_a.shape) if (lora_a is not None and output_mask[1]) else e()
    db = lora_b.new_empty(lora_b.shape) if (lora_b is not None and output_mask[2]) else e()
    dm = dora_m.new_empty(dora_m.shape if output_mask[3] else (0,)) if dora_m is not None else x.new_empty(
        (0,), dtype=torch.float32)
    return dx, da, db, dm


@torch.library.register_fake("fasttrain::nf4_dora_norm")
def _(packed, absmax, blocksize, out_features, lora_a, lora_b, scale, weight_sq_norm):
    return lora_a.new_empty((out_features,), dtype=_stat_dtype(lora_a))


@torch.library.register_fake("fasttrain::nf4_weight_sq_norm")
def _(packed, absmax, blocksize, out_features, in_features):
    return absmax.new_empty((out_features,))


# ---- autograd: the backward is itself an op ---------------------------------------------------------
def _setup_context(ctx, inputs, output):
    x, packed, absmax, blocksize, out_features, lora_a, lora_b, scale, dora_m, _wsq = inputs
    _, xa, rnorm, z = output
    ctx.save_for_backward(x, packed, absmax, lora_a, lora_b, dora_m, xa, rnorm, z)
    ctx.blocksize, ctx.out_features, ctx.scale = blocksize, out_features, scale


def _backward(ctx, dy, _dxa, _drnorm, _dz):
    x, packed, absmax, lora_a, lora_b, dora_m, xa, rnorm, z = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [bool(need[0]), bool(need[5]), bool(need[6]), bool(need[8])]
    if dy is None:
        return (None,) * 10
    dx, da, db, dm = _ops.nf4_linear_backward(dy.contiguous(), x, packed, absmax, ctx.blocksize, ctx.out_features,
                                              lora_a, lora_b, ctx.scale, dora_m, xa, rnorm, z, mask)
    return (dx if mask[0] else None, None, None, None, None, da if mask[1] else None, db if mask[2] else None,
            None, dm if mask[3] else None, None)


torch.library.register_autograd("fasttrain::nf4_linear", _backward, setup_context=_setup_context)
