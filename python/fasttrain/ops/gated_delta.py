"""The gated delta rule and the causal depthwise conv of Gated DeltaNet layers (hybrid models).

    o, S = gated_delta_rule(q, k, v, g, beta, initial_state=S0)   # a sequence, chunked
    o1, S = gated_delta_step(q1, k1, v1, g1, beta1, S)             # one token (decode)
    y, c = causal_conv1d(x, weight, state)                         # y: SiLU(conv), c: last K-1 inputs

Shapes: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv] (Hv a multiple of Hk: q/k head h serves value heads
h·Hv/Hk ...); g (log decay, <= 0) and beta [B, T, Hv]; state [B, Hv, Dk, Dv]. The definition is
fasttrain.ops.reference.gated_delta_rule (one token at a time); this face computes the same thing.

Which implementation runs (gated_delta_backend; the reference whenever the kernels are set to
"reference"):
  one token per row (gated_delta_step, the decoder's gated_delta_step_): fasttrain's own kernel,
    "fused" (csrc/cpu/gated_delta.cpp, csrc/cuda/gated_delta.cu: the recurrence one token at a time
    per (row, value head), the state kept in cache), on every device;
  a sequence (gated_delta_rule: a prefill, the update's forward and backward) on CUDA: a chunked
    form, never the token kernel (built for decode, it would take seconds per 4K-token sequence on
    a GPU): flash-linear-attention's chunked kernel ("fla", `fasttrain[gpu]`) when it is installed
    and the values are 16-bit (fla takes bf16/fp16 q, k, v only: the callers' float32 q/k are
    rounded to v's dtype for it, the state stays float32), else the chunked PyTorch form below
    ("torch", fasttrain.ops.gated_delta_chunked: its backward written out);
  a sequence on the CPU with a gradient wanted (the update): the chunked PyTorch form, "torch";
  a sequence on the CPU without one (the rollout's prefill, the scores' forwards): the token
    kernel, "fused" (which can also keep states every `chunk_size` tokens and recompute them span
    by span in a backward, when forced for the update).
`set_gated_delta_backend("fused" | "torch" | "fla")`, or FASTTRAIN_GATED_DELTA, forces one. Why
this split, measured side by side (bench/results/cpu-2c-AMD-EPYC-2026-12-02-gated-delta.md, a
quiet 2-core AVX2 EPYC, the benchmark hybrid's heads, before the chunked form's backward was
written out; bench/results/cpu-2c-Intel-Xeon-2026-12-02-gated-delta.md on this form): forward +
backward, the kernel took 1.33-1.68x the chunked form's time at 2 threads and 1.01-1.03x at one;
forward only, 0.72-0.78x; a decode step, 0.11x. The memory plan counts the chunked form's bytes
for the update (fasttrain.plan.hybrid_memory, from the chunked form's accounting in
fasttrain.ops.gated_delta_chunked, where the form and its derivation are).
"""
from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

from fasttrain._native import load as _load
from fasttrain.ops import reference as _reference
from fasttrain.ops.gated_delta_chunked import accumulation_dtype, chunked_rule
from fasttrain.ops.gated_delta_chunked import decay_floor  # noqa: F401  (read from here by the selftest's bound)
from fasttrain.ops.kernels import use_reference as _use_reference

_load()
_ops = torch.ops.fasttrain

__all__ = ["gated_delta_rule", "gated_delta_step", "gated_delta_step_", "causal_conv1d", "causal_conv1d_step",
           "gated_delta_backend", "set_gated_delta_backend", "causal_conv1d_backend"]

_BACKENDS = ("auto", "fused", "torch", "fla")
_chosen_backend = os.environ.get("FASTTRAIN_GATED_DELTA", "auto")
if _chosen_backend not in _BACKENDS:
    raise ValueError(f"FASTTRAIN_GATED_DELTA={_chosen_backend!r}; allowed: {', '.join(_BACKENDS)}")
FLA_MAX_HEAD_DIM = 256          # flash-linear-attention's chunked kernels assert K <= 256
_HALF = (torch.bfloat16, torch.float16)


def set_gated_delta_backend(kind: str) -> str:
    """"auto" (default: see the module header), "fused", "torch" (the chunked PyTorch form) or
    "fla" (flash-linear-attention's chunked kernel for sequences), for comparisons. Returns the
    previous choice. The reference still wins when the kernels are set to "reference"."""
    global _chosen_backend
    if kind not in _BACKENDS:
        raise ValueError(f"set_gated_delta_backend: {kind!r}; allowed: {', '.join(_BACKENDS)}")
    prev, _chosen_backend = _chosen_backend, kind
    return prev


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def gated_delta_backend(device: torch.device | str, dtype: torch.dtype = torch.float32, *, step: bool = False,
                        head_dim: int = 0, grad: bool = False) -> str:
    """What runs on `device` now for values (v) in `dtype` with key head dim `head_dim`: over a
    sequence (gated_delta_rule) with or without a gradient wanted (`grad`), or one token per row
    (`step`: gated_delta_step and gated_delta_step_). "reference", "fla", "fused" or "torch".

    The rule, each form where it measured fastest (bench/bench_gated_delta.py; the module header):
      one token per row (decode): "fused", fasttrain's kernel, on every device;
      a sequence on CUDA: "fla" when flash-linear-attention is installed, the values are 16-bit and
        head_dim <= FLA_MAX_HEAD_DIM, else "torch" (the chunked form), with or without a gradient;
      a sequence on the CPU with a gradient wanted (the update's forward and backward): "torch";
      a sequence on the CPU without one (the rollout's prefill, the scores): "fused".
    set_gated_delta_backend (or FASTTRAIN_GATED_DELTA) forces one form for every call: "fused"
    keeps the update on the token kernel, "torch" runs the chunked form (and the step's torch ops)
    everywhere. The memory plan counts the form this returns for the CPU update
    (fasttrain.plan.hybrid_memory.update_rule_form)."""
    if _use_reference():
        return "reference"
    if _chosen_backend != "auto":
        return _chosen_backend
    if step:
        return "fused"
    if torch.device(device).type != "cuda":
        return "torch" if grad else "fused"
    if dtype in _HALF and head_dim <= FLA_MAX_HEAD_DIM and _installed("fla"):
        return "fla"
    return "torch"


def _check(q, k, v, g, beta, initial_state) -> None:
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"gated_delta_rule: q, k must be [B, T, Hk, Dk] and v [B, T, Hv, Dv]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError(f"gated_delta_rule: value heads ({Hv}) must be a multiple of query/key heads ({Hk})")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, Hv):
            raise ValueError(f"gated_delta_rule: {name} must be [B, T, Hv] = {(B, T, Hv)}, got {tuple(t.shape)}")
    if initial_state is not None and tuple(initial_state.shape) != (B, Hv, Dk, Dv):
        raise ValueError(f"gated_delta_rule: initial_state must be [B, Hv, Dk, Dv] = {(B, Hv, Dk, Dv)}, "
                         f"got {tuple(initial_state.shape)}")


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     scale: float | None = None, initial_state: torch.Tensor | None = None,
                     chunk_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, T, Hv, Dv] in v's dtype, final state [B, Hv, Dk, Dv] float32, float64 for float64 inputs).
    Autograd: q, k, v, g, beta, initial_state. scale defaults to Dk^-1/2. chunk_size: the torch
    path's chunk (32 measured fastest forward+backward at head dim 128 on a CPU, against 16 and 64;
    flash-linear-attention picks its own). Which implementation runs: gated_delta_backend."""
    _check(q, k, v, g, beta, initial_state)
    if chunk_size < 1:
        raise ValueError(f"gated_delta_rule: chunk_size must be >= 1, got {chunk_size}")
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    backend = gated_delta_backend(q.device, v.dtype, head_dim=q.shape[-1], grad=grad)
    if backend == "reference":
        return _reference.gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    if backend == "fla" and v.dtype != torch.float64:
        return _fla(q, k, v, g, beta, scale, initial_state)
    if backend == "torch":
        return chunked_rule(q, k, v, g, beta, scale, initial_state, chunk_size)
    return _fused(q, k, v, g, beta, scale, initial_state, chunk_size)


def _fused(q, k, v, g, beta, scale, initial_state, C: int):
    """fasttrain's kernel: inputs in float32 (float64 for float64), o back in v's dtype, the state in
    the accumulation dtype. States are kept every C tokens for the backward only when a gradient is
    wanted."""
    acc = accumulation_dtype(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    qa, ka, va, ga, ba = (t.to(acc).contiguous() for t in (q, k, v, g, beta))
    s0 = None if initial_state is None else initial_state.to(acc).contiguous()
    save = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, s0))
    o, S, _ = _ops.gated_delta_forward(qa, ka, va, ga, ba, s0, scale, int(C), save)
    return o.to(v.dtype), S


@torch.library.register_fake("fasttrain::gated_delta_forward")
def _(q, k, v, g, beta, s0, scale, checkpoint_every, save):
    B, T, _, Dk = q.shape
    Hv, Dv = v.shape[2:]
    n = -(-T // checkpoint_every)
    return (torch.empty_like(v), v.new_empty((B, Hv, Dk, Dv)), v.new_empty((B if save else 0, Hv, n, Dk, Dv)))


@torch.library.register_fake("fasttrain::gated_delta_backward")
def _(grad_o, grad_state, q, k, v, g, beta, checkpoints, scale, checkpoint_every):
    B, T, _, Dk = q.shape
    Hv, Dv = v.shape[2:]
    return (q.new_empty((B, T, Hv, Dk)), q.new_empty((B, T, Hv, Dk)), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), v.new_empty((B, Hv, Dk, Dv)))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, s0, scale, checkpoint_every, save = inputs
    _, _, ckpt = output
    ctx.mark_non_differentiable(ckpt)
    ctx.args = (scale, checkpoint_every, save, s0 is not None)
    ctx.save_for_backward(q, k, v, g, beta, ckpt)


def _backward(ctx, grad_o, grad_state, grad_ckpt):
    q, k, v, g, beta, ckpt = ctx.saved_tensors
    scale, C, save, has_s0 = ctx.args
    if not save:
        raise RuntimeError("gated_delta_rule: a gradient was asked of a forward run without saved states "
                           "(was it run under torch.no_grad()?)")
    if grad_o is None:
        grad_o = torch.zeros_like(v)
    gs = None if grad_state is None else grad_state.to(v.dtype).contiguous()
    dq, dk, dv, dg, db, ds0 = _ops.gated_delta_backward(grad_o.to(v.dtype).contiguous(), gs, q, k, v, g, beta, ckpt,
                                                        scale, C)
    B, T, Hk, Dk = q.shape
    rep = v.shape[2] // Hk
    if rep > 1:                                               # value heads that share a q/k head
        dq, dk = dq.view(B, T, Hk, rep, Dk).sum(3), dk.view(B, T, Hk, rep, Dk).sum(3)
    return dq, dk, dv, dg, db, (ds0 if has_s0 else None), None, None, None


torch.library.register_autograd("fasttrain::gated_delta_forward", _backward, setup_context=_setup_context)


def _fla(q, k, v, g, beta, scale, initial_state):
    """flash-linear-attention's chunk_gated_delta_rule with the inputs its source accepts (0.3 asserts
    q, k, v of one 16-bit dtype and q/k heads equal to v's): q, k (float32 from the callers' L2
    norm) and beta rounded to v's dtype (the model's, bf16/fp16; float32 v goes to the torch form),
    q/k heads repeated per value head, g and the state float32. Returns o in v's dtype and the
    state float32."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    half = v.dtype if v.dtype in _HALF else torch.bfloat16
    Hk, Hv = q.shape[2], v.shape[2]
    if Hv != Hk:
        q, k = q.repeat_interleave(Hv // Hk, dim=2), k.repeat_interleave(Hv // Hk, dim=2)
    s0 = None if initial_state is None else initial_state.float()
    o, S = chunk_gated_delta_rule(q.to(half), k.to(half), v.to(half), g.float(), beta.to(half), scale=scale,
                                  initial_state=s0, output_final_state=True)
    return o.to(v.dtype), S.float()




def _one_token(q, k, v, g, beta, acc: torch.dtype, scale: float | None):
    """The kernel's inputs for one token per row: each [B, 1, ...] contiguous in acc, and the scale."""
    ins = [t.to(acc)[:, None].contiguous() for t in (q, k, v, g, beta)]
    return (*ins, q.shape[-1] ** -0.5 if scale is None else float(scale))


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: q, k [B, Hk, Dk], v [B, Hv, Dv], g/beta [B, Hv], state [B, Hv, Dk, Dv]
    (float32 in a rollout whatever the model dtype). Returns (o [B, Hv, Dv] in v's dtype, the new
    state in the state's dtype), computed in the state's dtype."""
    if _use_reference():
        return _reference.gated_delta_step(q, k, v, g, beta, state, scale=scale)
    if gated_delta_backend(q.device, step=True) == "fused":   # one kernel call instead of ~10 small ops
        *one, sc = _one_token(q, k, v, g, beta, state.dtype, scale)
        o, S, _ = _ops.gated_delta_forward(*one, state.contiguous(), sc, 1, False)
        return o[:, 0].to(v.dtype), S
    Hk, Hv = q.shape[1], v.shape[1]
    acc = state.dtype
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if Hv != Hk:
        q, k = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)
    qa, ka, va = q.to(acc) * scale, k.to(acc), v.to(acc)
    S = state * g.to(acc).exp()[..., None, None]
    recalled = (ka[:, :, None, :] @ S)[:, :, 0]                    # Sᵀk  [B, H, Dv]
    delta = beta.to(acc)[..., None] * (va - recalled)
    S = S + ka[..., :, None] * delta[..., None, :]
    o = (qa[:, :, None, :] @ S)[:, :, 0]                           # Sᵀq
    return o.to(v.dtype), S


def gated_delta_step_(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, *, active: torch.Tensor | None = None,
                      scale: float | None = None) -> torch.Tensor:
    """gated_delta_step writing the new state into `state` itself (the decoder's cache): rows whose
    `active` [B] bool is False keep their state (their output is 0). Returns o [B, Hv, Dv] in v's
    dtype. On fasttrain's kernel this reads the state twice and writes it once, with no
    temporaries; elsewhere it is gated_delta_step followed by a copy."""
    if gated_delta_backend(q.device, step=True) == "fused" and not torch.is_grad_enabled():
        *one, sc = _one_token(q, k, v, g, beta, state.dtype, scale)
        o = _ops.gated_delta_decode_(state, *one, None if active is None else active.contiguous(), sc)
        return o[:, 0].to(v.dtype)
    o, new = gated_delta_step(q, k, v, g, beta, state, scale=scale)
    if active is not None:
        new = torch.where(active.view(-1, 1, 1, 1), new, state)
        o = o * active.view(-1, 1, 1).to(o.dtype)
    state.copy_(new)
    return o


@torch.library.register_fake("fasttrain::gated_delta_decode_")
def _(state, q, k, v, g, beta, active, scale):
    return torch.empty_like(v)


def causal_conv1d_backend(device: torch.device | str, dtype: torch.dtype, channels: int, width: int) -> str:
    """What causal_conv1d runs on `device` for x in `dtype`: "reference", "causal_conv1d" (Tri Dao's
    CUDA kernel, `fasttrain[gpu]`, on CUDA when installed and the shape is one it takes: widths 2-4
    and, in the channels-last layout the projections give, channels a multiple of 8) or "torch"."""
    if _use_reference():
        return "reference"
    if (torch.device(device).type == "cuda" and dtype in (torch.float32, *_HALF) and 2 <= width <= 4
            and channels % 8 == 0 and _installed("causal_conv1d")):
        return "causal_conv1d"
    return "torch"


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                  activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time with SiLU: x [B, T, C], weight [C, K], state [B, K-1, C] (the
    inputs before x, zeros when None). Returns (y [B, T, C] in x's dtype, new state [B, K-1, C]).
    Computed in float32 (float64 for float64 x); which implementation: causal_conv1d_backend."""
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"causal_conv1d: x must be [B, T, C] and weight [C, K]; got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    backend = causal_conv1d_backend(x.device, x.dtype, x.shape[2], weight.shape[1])
    if backend == "reference":
        return _reference.causal_conv1d(x, weight, state, activation)
    B, T, Cn = x.shape
    K = weight.shape[1]
    if state is None:
        state = x.new_zeros(B, K - 1, Cn)
    xt = torch.cat([state.to(x.dtype), x], 1)                 # [B, K-1+T, C]
    if backend == "causal_conv1d":
        return _conv_package(x, weight, state.to(x.dtype), activation), xt[:, T:]
    return _conv_torch(xt, weight, T, activation).to(x.dtype), xt[:, T:]


def _conv_package(x, weight, state, activation: bool) -> torch.Tensor:
    """causal-conv1d's causal_conv1d_fn in the channels-last layout (x as [B, C, T] with stride 1 over
    channels), the carried inputs as its initial_states [B, C, K-1] (channels-last too, x's dtype):
    no data-dependent test of whether the state is zero."""
    from causal_conv1d import causal_conv1d_fn
    xc = x.contiguous().transpose(1, 2)
    s0 = state.contiguous().transpose(1, 2)
    y = causal_conv1d_fn(xc, weight.to(x.dtype), None, initial_states=s0, activation="silu" if activation else None)
    return y.transpose(1, 2)


def _conv_torch(xt, weight, T: int, activation: bool) -> torch.Tensor:
    """K shifted multiply-adds over [B, T, C] (channels last, as the projections give them): on the
    CPU this is several times faster than F.conv1d's depthwise path on the transposed layout."""
    acc = torch.float64 if xt.dtype == torch.float64 else torch.float32
    xa, w = xt.to(acc), weight.to(acc)
    y = xa[:, :T] * w[:, 0]
    for j in range(1, weight.shape[1]):
        y = y + xa[:, j:j + T] * w[:, j]
    return F.silu(y) if activation else y


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor,
                       activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x [B, C], state [B, K-1, C] -> (y [B, C], new state [B, K-1, C])."""
    if _use_reference():
        return _reference.causal_conv1d_step(x, weight, state, activation)
    window = torch.cat([state.to(x.dtype), x[:, None]], 1)    # [B, K, C]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = (window.to(acc) * weight.to(acc).T).sum(1)
    if activation:
        y = F.silu(y)
    return y.to(x.dtype), window[:, 1:]
