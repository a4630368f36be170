"""decode_attention: one decode step's attention, one query token per row against the row's KV cache.

q [B, kv, G, D] holds the G query heads that share each KV head (grouped-query attention without a
repeat of K/V), k and v [B, kv, S, D] are views of the cache (only the last dimension contiguous),
key_valid [B, S] bool says which columns each row attends. On the CPU it runs fasttrain's kernel
(csrc/cpu/decode_attention.cpp: each key and value read once for the G heads); elsewhere, with
gradients, or with the kernels set to "reference", torch's scaled_dot_product_attention, which is
flash attention on a GPU. No backward: the rollout runs without autograd.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fasttrain._native import load as _load
from fasttrain.ops import reference as _reference
from fasttrain.ops.kernels import use_reference as _use_reference

_load()
_ops = torch.ops.fasttrain

__all__ = ["decode_attention", "decode_attention_backend"]


def decode_attention_backend(q: torch.Tensor | torch.device, grad: bool | None = None) -> str:
    """"kernel" (fasttrain's CPU kernel), "sdpa" (torch's) or "reference" for a query `q`, or for a
    device (no tensor is made: the selftest names the CUDA face on a host without a driver)."""
    if _use_reference():
        return "reference"
    if isinstance(q, torch.Tensor):
        device, grad = q.device, torch.is_grad_enabled() and q.requires_grad
    else:
        device = torch.device(q)
    if device.type == "cpu" and not grad:
        return "kernel"
    return "sdpa"


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(scale·q·kᵀ over each row's valid keys)·v: q [B, kv, G, D], k, v [B, kv, S, D],
    key_valid [B, S] bool -> [B, kv, G, D] in q's dtype (zeros for a row with no valid key on the
    kernel and the reference; SDPA gives NaN there)."""
    kind = decode_attention_backend(q)
    if kind == "reference":
        return _reference.decode_attention(q, k, v, key_valid, scale)
    if kind == "kernel":
        return _ops.decode_attention(q.contiguous(), k, v, key_valid, float(scale))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_valid[:, None, None, :], scale=scale)


@torch.library.register_fake("fasttrain::decode_attention")
def _(q, k, v, key_valid, scale):
    return torch.empty_like(q)
