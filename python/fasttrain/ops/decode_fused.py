"""decode_fused: the elementwise work of a Llama-family decode step in four ops.

rms_norm (HF's LlamaRMSNorm), add_rms_norm_ (the residual add, in place, then the norm),
rotary_cache_write_ (the rotary embedding of q and k, the write of k and v into the KV cache at one
column) and silu_mul (the SwiGLU between gate_up and down). Each rounds where the model's eager
modules round (fasttrain.ops.reference holds those formulas). On the CPU they run fasttrain's
kernels (csrc/cpu/decode_fused.cpp: one pass each, where eager PyTorch takes ~40 ops a layer);
elsewhere, with gradients, for float64, or with the kernels set to "reference", the reference
formulas. No backward: the rollout runs without autograd.
"""
from __future__ import annotations

import torch

from fasttrain._native import load as _load
from fasttrain.ops import reference as _reference
from fasttrain.ops.kernels import use_reference as _use_reference

_load()
_ops = torch.ops.fasttrain

__all__ = ["rms_norm", "add_rms_norm_", "rotary_cache_write_", "silu_mul", "decode_fused_backend"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def decode_fused_backend(x: torch.Tensor | torch.device | str, dtype: torch.dtype | None = None) -> str:
    """"kernel" (fasttrain's CPU kernels) or "reference" for an input `x`, or for a device and dtype
    (no tensor is made: the selftest names the CUDA face on a host without a driver)."""
    if isinstance(x, torch.Tensor):
        device, dtype, grad = x.device, x.dtype, torch.is_grad_enabled() and x.requires_grad
    else:
        device, grad = torch.device(x), False
    if _use_reference() or device.type != "cpu" or dtype not in _KERNEL_DTYPES or grad:
        return "reference"
    return "kernel"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [N, H], weight [H] (x's dtype) -> weight · rnd(x / sqrt(mean(x²) + eps)) [N, H]."""
    if decode_fused_backend(x) == "reference":
        return _reference.rms_norm(x, weight, eps)
    return _ops.rms_norm(x.contiguous(), weight.contiguous(), float(eps))


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x <- x + delta in place (x [N, H] contiguous), then rms_norm(x, weight, eps)."""
    if decode_fused_backend(x) == "reference":
        return _reference.add_rms_norm_(x, delta, weight, eps)
    return _ops.add_rms_norm_(x, delta.contiguous(), weight.contiguous(), float(eps))


def rotary_cache_write_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, column: int, n_heads: int, q_norm: torch.Tensor | None = None,
                        k_norm: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    """qkv [B, (n_heads + 2 kv)·D] (q, k, v heads), cos, sin [B, D]; k_cache, v_cache [B, kv, S, D]
    (views of a cache, last dimension contiguous): writes the rotated k and v at `column`, returns
    the rotated q [B, kv, n_heads / kv, D] (query head h shares KV head h // (n_heads / kv)).
    q_norm, k_norm [D] (both or neither): each q and k head goes through rms_norm with that weight
    first (Qwen3's per-head norms)."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("rotary_cache_write_: q_norm and k_norm come together")
    if decode_fused_backend(qkv) == "reference":
        return _reference.rotary_cache_write_(qkv, cos, sin, k_cache, v_cache, column, n_heads, q_norm, k_norm,
                                              norm_eps)
    return _ops.rotary_cache_write_(qkv.contiguous(), cos.contiguous(), sin.contiguous(), k_cache, v_cache,
                                    int(column), int(n_heads), q_norm, k_norm, float(norm_eps))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [N, 2I] (gate, then up) -> rnd(rnd(silu(gate)) · up) [N, I]."""
    if decode_fused_backend(gate_up) == "reference":
        return _reference.silu_mul(gate_up)
    return _ops.silu_mul(gate_up.contiguous())


@torch.library.register_fake("fasttrain::rms_norm")
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake("fasttrain::add_rms_norm_")
def _(x, delta, weight, eps):
    return torch.empty_like(x)


@torch.library.register_fake("fasttrain::rotary_cache_write_")
def _(qkv, cos, sin, k_cache, v_cache, column, n_heads, q_norm=None, k_norm=None, norm_eps=0.0):
    B, kv, _, D = k_cache.shape
    return qkv.new_empty(B, kv, n_heads // kv, D)


@torch.library.register_fake("fasttrain::silu_mul")
def _(gate_up):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
