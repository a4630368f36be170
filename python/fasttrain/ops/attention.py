"""masked_attention: the update's masked attention (queries over their prompt's keys and their own
answers), with a CPU backward of batched GEMMs around one fused softmax step.

    o = masked_attention(q, k, v, mask, scale)   # q [n, h, M, D], k/v [n, h, L, D], mask bool -> [n, h, M, D]

The forward is torch's scaled_dot_product_attention (ATen's flash attention on the CPU). Under the
default setting, "auto", on a CPU that computes bf16 natively, for bf16 heads of at most
AUTO_MAX_HEAD_DIM with a gradient wanted, the backward is fasttrain's, not ATen's. Per chunk of
rows, S = q·kᵀ and dP = dO·vᵀ as float32 GEMMs (their inputs exact in float32), then
csrc/cpu/attention_backward.cpp's softmax step (P and dS = scale·P ⊙ (dP − Σ P·dP) in one pass, in
q's dtype), then dV = Pᵀ·dO, dQ = dS·k and dK = dSᵀ·q as GEMMs in q's dtype (P and dS rounded to
it, as ATen's flash backward rounds them). `set_attention_backward("fasttrain")` takes it wherever it can run (float32 too), "flash"
nowhere (torch's backward throughout); FASTTRAIN_ATTENTION_BACKWARD sets the same at import.
Why: at the update's answer shape (SmolLM2's study micro-batch: 12 rows, 3 KV heads of 64, 189
query rows of a KV head over 360 keys) on a 2-core AMX Xeon, ATen's flash backward took 25-27 ms
a call (many small GEMMs on 32-query blocks, about 60 GFLOP/s), this one 14-15 ms; forward +
backward 0.69-0.71x of torch's (bench/bench_attention_backward.py). Where "auto" keeps torch's,
as measured there: float32 (ATen's float32 backward was the faster, 20 against 31 ms at that
shape), heads of 128 (the hybrid's: 0.8-1.2x, a wash), emulated bf16 (not measured).
Memory: the backward holds two float32 [rows, h, M, L] score tensors and two in q's dtype for a
chunk of rows at a time, the chunk sized so one float32 tensor stays within `SCORE_BYTES` (4 MiB:
16 MiB chunks ran slower, 24-25 against 14-15 ms, on that Xeon); where a single row's scores
exceed it (long answers), or on another device or dtype (float64, the GPU), the call is torch's
SDPA with its own backward. `fasttrain plan` counts both sides (fasttrain.plan.memory): this
backward saves q, k, v and the shared bool mask where torch's also saves its output, log-sum-exp
and the float mask SDPA makes, and at a layer's attention backward it adds its workspace
(backward_workspace), which sets the update's peak on small models with long prompts (tests/plan's
tiny bf16 model: 2.08 MB measured with torch's backward, 3.57 MB with this one, planned 3.62).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from fasttrain._native import load as _load
from fasttrain.ops.kernels import use_reference as _use_reference

_load()
_ops = torch.ops.fasttrain

__all__ = ["masked_attention", "attention_backward_kind", "set_attention_backward"]

AUTO_MAX_HEAD_DIM = 64          # "auto": heads up to this size (measured faster there; a wash at 128)
SCORE_BYTES = 4 << 20           # the largest float32 score tensor one backward chunk makes
_KIND = {"value": "auto"}       # FASTTRAIN_ATTENTION_BACKWARD sets it at import (set_attention_backward)


def set_attention_backward(kind: str) -> str:
    """"auto" (the default: fasttrain's backward where it was measured faster, bf16 heads of
    at most AUTO_MAX_HEAD_DIM on a CPU that computes bf16 natively), "fasttrain" (fasttrain's
    wherever it can run: the CPU, float32 or bf16; for tests and comparisons) or "flash" (torch's
    SDPA backward everywhere). Returns the previous setting."""
    if kind not in ("auto", "fasttrain", "flash"):
        raise ValueError(f"set_attention_backward: kind must be 'auto', 'fasttrain' or 'flash', got {kind!r}")
    old, _KIND["value"] = _KIND["value"], kind
    return old


if os.environ.get("FASTTRAIN_ATTENTION_BACKWARD"):
    set_attention_backward(os.environ["FASTTRAIN_ATTENTION_BACKWARD"])


def attention_backward_kind(q: torch.Tensor, k: torch.Tensor) -> str:
    """"fasttrain" or "sdpa": whose backward masked_attention's call with these q, k would use."""
    if (_use_reference() or q.device.type != "cpu" or k.dtype != q.dtype or q.shape[1] != k.shape[1]):
        return "sdpa"
    _, h, M, D = q.shape
    dtype_bytes = {torch.float32: 4, torch.bfloat16: 2}.get(q.dtype, 0)
    native = _KIND["value"] == "auto" and dtype_bytes == 2 and _native_bf16()
    return "fasttrain" if takes_fasttrain_backward(dtype_bytes, D, h * M * k.shape[2], native) else "sdpa"


def takes_fasttrain_backward(dtype_bytes: int, head_dim: int, scores_per_row: int, native_bf16: bool) -> bool:
    """The rule, on the CPU (fasttrain.plan reads it too): a call whose q is float32 (4) or bf16 (2)
    with `scores_per_row` = heads x queries x keys of one row of q takes fasttrain's backward under
    the current setting: none under "flash"; any whose one row fits SCORE_BYTES under "fasttrain";
    under "auto" only bf16 heads of at most AUTO_MAX_HEAD_DIM on a CPU with native bf16."""
    kind = _KIND["value"]
    if kind == "flash" or dtype_bytes not in (2, 4) or not row_fits(scores_per_row):
        return False
    return kind == "fasttrain" or (dtype_bytes == 2 and head_dim <= AUTO_MAX_HEAD_DIM and native_bf16)


def row_fits(scores_per_row: int) -> bool:
    """Whether one row's float32 scores fit a chunk (else the call is torch's SDPA)."""
    return scores_per_row * 4 <= SCORE_BYTES


def backward_workspace(n: int, h: int, M: int, L: int, D: int, dtype_bytes: int) -> int:
    """Bytes _backward allocates beyond its dq, dk, dv (their shapes, in q's dtype) for q [n, h, M, D]
    over L keys, at its largest moment (fasttrain.plan counts it): one chunk's float32 S and dP with P
    and dS in q's dtype, or S with dP being formed from float32 copies of the chunk's dO and v."""
    c = min(n, _chunk_rows(h, M, L))
    scores = c * h * M * L
    return max((8 + 2 * dtype_bytes) * scores, 8 * scores + 4 * c * h * (M + L) * D)


def _chunk_rows(h: int, M: int, L: int) -> int:
    return max(1, SCORE_BYTES // max(1, h * M * L * 4))


def _native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (the NF4 kernels' own test): where the backward was
    measured faster. Elsewhere bf16 GEMMs are emulated and torch's backward stays."""
    from fasttrain.host import cpu_bf16_compute
    return cpu_bf16_compute()


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """softmax(scale·q·kᵀ over the allowed keys)·v, torch's scaled_dot_product_attention with
    fasttrain's backward where attention_backward_kind says so and the call has its form: q
    [n, h, M, D], k and v [n, h, L, D] (as many heads: fold grouped-query heads into M first), mask
    bool broadcastable to [n, h, M, L] (True = may attend) or None. Any other call is SDPA's as given.
    Every query row must have an allowed key (SDPA gives NaN for one without)."""
    wants_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if (wants_grad and q.dim() == 4 and k.dim() == 4 and k.shape == v.shape and q.shape[:2] == k.shape[:2]
            and q.shape[3] == k.shape[3] and (mask is None or mask.dtype == torch.bool)
            and attention_backward_kind(q, k) == "fasttrain"):
        return _MaskedAttention.apply(q, k, v, mask, float(scale))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class _MaskedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        ctx.save_for_backward(q, k, v, mask)
        ctx.scale = scale
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, mask = ctx.saved_tensors
        return (*_backward(do, q, k, v, mask, ctx.scale), None, None)


def _backward(do, q, k, v, mask, scale: float):
    n, h, M, D = q.shape
    L = k.shape[2]
    dt = q.dtype
    if mask is not None:
        while mask.dim() < 4:
            mask = mask[None]
        if mask.shape[3] != L:
            mask = mask.expand(*mask.shape[:3], L)
        if mask.stride(3) != 1 and L > 1:
            mask = mask.contiguous()
    dq, dk, dv = (torch.empty(t.shape, dtype=dt, device=t.device) for t in (q, k, v))
    step = _chunk_rows(h, M, L)
    do = do.to(dt)
    for a in range(0, n, step):
        b = min(n, a + step)
        qc, kc, vc, doc = q[a:b], k[a:b], v[a:b], do[a:b]
        s = torch.matmul(qc.float(), kc.float().mT)                       # [c, h, M, L] float32
        dp = torch.matmul(doc.float(), vc.float().mT)
        mc = None if mask is None else (mask if mask.shape[0] == 1 else mask[a:b])
        p, ds = _ops.attention_softmax_grad(s, dp, mc, scale, dt)
        del s, dp
        torch.matmul(p.mT, doc, out=dv[a:b])
        del p
        torch.matmul(ds, kc, out=dq[a:b])
        torch.matmul(ds.mT, qc, out=dk[a:b])
        del ds                                  # not held into the next chunk
    return dq, dk, dv


@torch.library.register_fake("fasttrain::attention_softmax_grad")
def _(s, dp, mask, scale, out_dtype):
    return s.new_empty(s.shape, dtype=out_dtype), s.new_empty(s.shape, dtype=out_dtype)
