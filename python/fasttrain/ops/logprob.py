"""Fused per-token log-probability and entropy from hidden states: the logits are never stored.

    logp, entropy = fasttrain.ops.fused_logprob(hidden, weight, targets, temperature=1.0)

For token n with logits z_n = (hidden_n . weight^T + bias) / temperature:
    logp[n]    = log softmax(z_n)[targets[n]]
    entropy[n] = -sum_v p_nv log p_nv   (detached: no gradient flows through it)
Tokens whose target equals `ignore_index` give 0 and no gradient.

keep_delta (optional, [N] like targets): the kept set of a truncated draw (top_k / top_p / min_p),
recorded by the sampler as delta_n = z_n[target] - z_cut >= 0 in temperature-scaled logits (+inf:
the whole vocabulary). The op then scores q_n = softmax(z_n) restricted to
K_n = {v : z_nv >= z_n[target] - delta_n} (ties at the cut kept, the target always in) and
renormalised: logp = log q(target), entropy = H(q), and the gradients those of log q, in the same
one pass over the vocabulary (the cut comes from one dot product h_n . W[target] before the chunks).

The vocabulary is streamed in chunks with an online log-sum-exp (core/math.h), so memory beyond
inputs and outputs is a bounded scratch (`chunk_bytes`, default 8 MiB on CPU), not N x V. When
hidden requires grad, the forward also forms the per-token gradient vector
(W[t_n] - sum_v p_nv W[v]) / T ([N, H] floats); the backward is then one row scaling. The gradient
for weight (and bias) is computed only when they require grad, by recomputing p per chunk.
"""
from __future__ import annotations

import contextlib
import os

import torch

from fasttrain._native import load as _load
from fasttrain.ops import reference as _reference
from fasttrain.ops.kernels import use_reference as _use_reference

_load()
_ops = torch.ops.fasttrain

__all__ = ["fused_logprob", "set_chunk_bytes", "chunk_bytes", "brgemm_bf16_available", "bf16_dot_available",
           "logprob_pack_cache"]

_CHUNK_BYTES = 0  # 0: the backend's default (CPU: 8 MiB in all threads; CUDA: 256 MiB)


def brgemm_bf16_available() -> bool:
    """Whether the CPU kernel's bf16 head GEMMs (the logits and the p·W accumulator) run on ATen's
    brgemm here: oneDNN's ukernel packs bf16 on AMX and AVX-512 bf16 CPUs; elsewhere they widen to
    float32."""
    return bool(_load().cpu_brgemm_bf16())


def bf16_dot_available() -> bool:
    """Whether the CPU kernel's bf16 head products run on the avx512_bf16 dot-product instruction
    here (where the CPU has avx512_bf16 and ATen sits at AVX512 but oneDNN's ukernel does not pack
    bf16, as on AMD EPYC without AMX): bf16 h and W, exact products and fp32 sums as on the widened
    float32 path; FASTTRAIN_LOGPROB_BF16DOT=0 turns it off."""
    return bool(_load().cpu_bf16_dot())


@contextlib.contextmanager
def logprob_pack_cache():
    """Inside this scope the CPU kernel keeps W's packed bf16 copies (brgemm_bf16_available or
    bf16_dot_available) across
    calls instead of packing W on every call; leaving it frees them. An entry is W's storage,
    offset, shape and version counter, so an in-place write through W (the optimizer's included)
    makes it stale; a write that bypasses the version counter (`w.data[...] = ...`) would not: open
    the scope where W is not written that way, as fasttrain's trainer does around each phase.
    Scopes nest. Costs up to two packed copies of W (V x H bf16 each) while open;
    FASTTRAIN_LOGPROB_PACK_CACHE=0 makes the scope keep nothing (W packed on every call)."""
    if os.environ.get("FASTTRAIN_LOGPROB_PACK_CACHE", "1") == "0":
        yield
        return
    lib = _load()
    lib.logprob_pack_scope(True)
    try:
        yield
    finally:
        lib.logprob_pack_scope(False)


def set_chunk_bytes(nbytes: int) -> None:
    """Bound the scratch memory of fused_logprob (bytes; 0 restores the backend default)."""
    global _CHUNK_BYTES
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"set_chunk_bytes: nbytes must be a non-negative int, got {nbytes!r}")
    _CHUNK_BYTES = nbytes


def chunk_bytes() -> int:
    return _CHUNK_BYTES


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def fused_logprob(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    ignore_index: int = -100,
    bias: torch.Tensor | None = None,
    keep_delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log p(target) and entropy under softmax(hidden . weight^T / temperature).

    hidden [N, H] and weight [V, H] (and bias [V]) in bf16, fp16 or fp32 (fp64 for checks);
    targets [N] int64. Returns (logp [N], entropy [N]) in fp32 (fp64 for fp64 inputs); entropy is
    detached. Leading dimensions of hidden/targets ([B, T, H] / [B, T]) are flattened and restored.
    keep_delta: targets' shape, float: score each token on its kept set (see the module docstring).
    """
    if _use_reference():
        return _reference.fused_logprob(hidden, weight, targets, temperature, ignore_index, bias, keep_delta)
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fused_logprob: {name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() < 2:
        raise ValueError(f"fused_logprob: hidden must be [N, H] (or [..., H]), got shape {tuple(hidden.shape)}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"fused_logprob: targets must have shape {tuple(hidden.shape[:-1])} (hidden's leading "
                         f"dims), got {tuple(targets.shape)}")
    if keep_delta is not None:
        if not isinstance(keep_delta, torch.Tensor) or keep_delta.shape != targets.shape:
            raise ValueError(f"fused_logprob: keep_delta must be a tensor of targets' shape {tuple(targets.shape)}")
        keep_delta = keep_delta.reshape(-1).to(_acc_dtype(hidden.dtype))
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(targets.numel(), hidden.shape[-1])  # not -1: hidden may be [N, 0]
    t1 = targets.reshape(-1)
    compute_grad = torch.is_grad_enabled() and hidden.requires_grad
    logp, entropy = _FusedLogprob(h2, weight, t1, bias, float(temperature), int(ignore_index), compute_grad,
                                  _CHUNK_BYTES, keep_delta)
    return logp.view(lead), entropy.view(lead)


def _FusedLogprob(hidden, weight, targets, bias, temperature, ignore_index, compute_grad, chunk_bytes,
                  keep_delta=None):
    logp, entropy, _stats, _gv = _ops.fused_logprob_forward(hidden, weight, targets, bias, temperature,
                                                          ignore_index, compute_grad, chunk_bytes, keep_delta)
    return logp, entropy


@torch.library.register_fake("fasttrain::fused_logprob_forward")
def _(hidden, weight, targets, bias, temperature, ignore_index, compute_grad, chunk_bytes, keep_delta=None):
    n, h = hidden.shape
    acc = _acc_dtype(hidden.dtype)
    vec = hidden.new_empty((n, h) if compute_grad else (0, h), dtype=acc)
    return (hidden.new_empty((n,), dtype=acc), hidden.new_empty((n,), dtype=acc),
            hidden.new_empty((2 if keep_delta is None else 3, n), dtype=acc), vec)


@torch.library.register_fake("fasttrain::fused_logprob_backward_weight")
def _(grad_logp, hidden, weight, targets, bias, stats, temperature, ignore_index, chunk_bytes):
    return (torch.empty_like(weight, memory_format=torch.contiguous_format),
            weight.new_empty((weight.shape[0],), dtype=_acc_dtype(hidden.dtype)))


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, temperature, ignore_index, compute_grad, chunk_bytes = inputs[:8]
    logp, entropy, stats, grad_vec = output
    ctx.mark_non_differentiable(entropy, stats, grad_vec)
    ctx.hidden_dtype = hidden.dtype
    ctx.compute_grad = compute_grad
    ctx.args = (temperature, ignore_index, chunk_bytes)
    # Only what the backward needs: grad_vec for hidden; hidden, weight, bias, stats for weight/bias.
    need_w = ctx.needs_input_grad[1] or (bias is not None and ctx.needs_input_grad[3])
    ctx.need_w = need_w
    ctx.save_for_backward(grad_vec, hidden if need_w else None, weight if need_w else None, targets,
                          bias if need_w else None, stats if need_w else None)


def _backward(ctx, grad_logp, grad_entropy, grad_stats, grad_vec_out):
    grad_vec, hidden, weight, targets, bias, stats = ctx.saved_tensors
    temperature, ignore_index, chunk_bytes = ctx.args
    d_hidden = d_weight = d_bias = None
    if ctx.needs_input_grad[0]:
        if not ctx.compute_grad:
            raise RuntimeError("fused_logprob: hidden requires grad but its gradient vector was not formed "
                               "in the forward (was the forward run under torch.no_grad()?)")
        d_hidden = (grad_vec * grad_logp.to(grad_vec.dtype).unsqueeze(1)).to(ctx.hidden_dtype)
    if ctx.need_w:
        gw, gb = _ops.fused_logprob_backward_weight(grad_logp.to(stats.dtype).contiguous(), hidden, weight, targets,
                                                    bias, stats, temperature, ignore_index, chunk_bytes)
        if ctx.needs_input_grad[1]:
            d_weight = gw
        if bias is not None and ctx.needs_input_grad[3]:
            d_bias = gb.to(bias.dtype)
    # one gradient per input the op was called with (the dispatcher leaves out keep_delta when it is None)
    return (d_hidden, d_weight, None, d_bias) + (None,) * (len(ctx.needs_input_grad) - 4)


torch.library.register_autograd("fasttrain::fused_logprob_forward", _backward, setup_context=_setup_context)
