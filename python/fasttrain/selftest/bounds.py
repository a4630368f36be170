"""The derived error bounds of `fasttrain selftest`, shared with the tests: the unit roundoffs, the
rounding of a result to its dtype, and the bounds that are a function of their own (the masked
attention's gradients). Each case module (fasttrain.selftest.cases) derives its op's bound from
these; its header states the derivation.

Tolerances (each is an elementwise bound, derived here, never measured on a host):
  u_d  unit roundoff of the case's dtype (2^-8 bf16, 2^-11 fp16, 2^-24 fp32, 2^-53 fp64): a kernel
       may store inputs, intermediates and outputs in it;
  u_a  unit roundoff of the accumulation dtype (fp32; fp64 for fp64 inputs): a sum of L terms
       computed in it is off by at most L·u_a times the sum of the terms' magnitudes (Higham's γ_L,
       first order).
  Magnitudes are the float64 reference's own absolute-value sums (|h|·|W|ᵀ, Σ p|w| ...), so a
  bound scales with what the sum could lose, not with its (possibly cancelled) value.
  fused_logprob: logits z = (h·wᵀ + b)/T are off by Δz = (2u_d + (H+2)u_a)·max(|h|·|w|ᵀ + |b|)/T;
    log p = z_t − lse moves by ε = 2(Δz + (V+2)u_a) (both terms, plus the V-term sum in lse);
    entropy −Σ p log p by ε(2 + H) (δp_v = p_v·δlog p_v); d h = g(w_t − Σ p w)/T by
    |g|(ε + (V+2)u_a)(|w_t| + Σ p|w|)/T plus its rounding to the input dtype; dW and db sum N tokens'
    g(1[t=v] − p)h/T with p possibly stored in the input dtype: (ε + u_d + (N+2)u_a) times
    Σ_n |g|(p + 1[t=v])|h|/T, plus the output's rounding.
  policy_loss: a token's ratio r = exp(logp − old) carries the rounding of its argument, so each
    token term is off by ε_t = (8 + K)u_a with K = 1 + max(|logp| + |old| + |ref|); the loss sums n
    tokens: (ε_t + (n+2)u_a) times the sum over tokens of their parts' magnitudes (the parts may cancel:
    REPO-R's factor 1 ± ζ log p counts as 1 + ζ|log p|, the policy term as |A|·factor·(r + 2)(1 + |log p|),
    the KL term as β(e^d + |d| + 1)) over the normalizer; the gradient is per token: (ε_t + 4u_a) times
    |A|·factor·r(1 + cap) + β(1 + e^d), weighted and normalized,
    plus its rounding to the input dtype (half the subnormal spacing below the smallest normal);
    each statistic is a weighted mean: (ε_t + (n+2)u_a)·(1 + max|x_t|)
    (KL: x = e^d + |d| + 1). Tokens within 1e-3 of a clip edge are masked out (a token on an edge may
    take either branch legitimately; its gradient would jump by A·r).
  nf4 quantize/dequantize: exact (the format is defined bit for bit); the error is the number of
    differing bytes, scales or decoded values.
  nf4_linear: u_c = u_d for bf16/fp16 inputs (W, A, B, x·Aᵀ and the DoRA scale may be rounded to it),
    u_a for fp32. With Y = |x|·|W|ᵀ + s(|x|·|A|ᵀ)·|B|ᵀ, the pre-scale output is off by
    (6u_c + (K + r + 2)u_a)·Y (at most six roundings to the compute dtype on any path: operand casts,
    GEMM outputs, the LoRA add, the DoRA scale); DoRA's g = m/‖W + sBA‖ by the relative
    ε_g = 6u_c + (K + r + 4)u_a·Q/‖·‖² with Q = Σ_k(|W| + s|B|·|A|)² (what the factorised norm's sums
    hold); the backward's products likewise, with the length of each sum (N + r for dx, M + N for dA,
    M + K for dB, M + K + r for dm) and dz = dy ⊙ g inheriting ε_g.
  dense_linear (policy.quantize = "none": the model's 16-bit W, fasttrain.nn.dense_linear, ATen's
    products): the same bounds as nf4_linear with W the dense weight (its base GEMM output, the fp32
    casts and the one final rounding are among the six roundings).
  nf4_dora_norm: ‖·‖² off by (2u_c + (K + r + 6)u_a)·Q, so ‖·‖ by that over 2‖·‖;
  nf4_weight_sq_norm: (K + 2)u_a·Σ W² plus the float32 rounding of the result.
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
"""
from __future__ import annotations

import torch

__all__ = ["U", "DT_NAME", "u_acc", "rounding", "gamma", "sum_bound", "attention_grad_bounds"]

U = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DT_NAME = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def u_acc(dtype: torch.dtype) -> float:
    return U[torch.float64] if dtype == torch.float64 else U[torch.float32]


def rounding(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The most that rounding x to dtype can change it: u·|x|, and half the subnormal spacing
    (u·tiny) below the smallest normal number."""
    return U[dtype] * x.abs().clamp(min=torch.finfo(dtype).tiny)


def gamma(n: int, u: float) -> float:
    """Higham's γ_n = n·u/(1 − n·u) (Accuracy and Stability of Numerical Algorithms, §3.1): a sum of
    n terms accumulated in precision u is off by at most γ_n times the sum of their magnitudes."""
    return n * u / (1 - n * u)


def sum_bound(n_terms: int, u: float, magnitude):
    """The worst rounding error of a sum of n_terms products accumulated in precision u: γ_n times
    the sum of the terms' absolute values (magnitude)."""
    return gamma(n_terms, u) * magnitude


def attention_grad_bounds(q, k, v, do, mask, scale: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(float64 gradient, its bound)] for q, k, v of softmax(scale·q·kᵀ over `mask`)·v with output
    gradient do, as fasttrain.ops.masked_attention's CPU backward computes it (u: float32's unit
    roundoff, u_d: q's dtype's, γ_n = n·u/(1 − n·u)): S = q·kᵀ and dP = dO·vᵀ are float32 sums of D
    exact products (γ_D·Σ|q||k|, times scale into every z, and γ_D·Σ|dO||v|); the softmax step's P
    errs by ρ·P, ρ = (2·max|z| + L + 8)·u + 2·max(scale·γ_D·Σ|q||k|) (the shift, exp at 1 ulp, the sum of
    L terms, the reciprocal), Σ P·dP by (ρ + γ_L)·Σ P|dP|, dS = scale·P·(dP − Σ P·dP) by
    scale·P·((ρ + 3u)·|dP − Σ P·dP| + (ρ + γ_L)·Σ P|dP|) plus dP's own error through both terms; P and
    dS are then rounded to u_d; dV = P̃ᵀ·dO, dQ = dS̃·k and dK = dS̃ᵀ·q sum M, L and M terms in float32
    (γ of Σ|terms|) and round to u_d (tests/ops/test_attention_backward.py checks the step's own bound)."""
    u = U[torch.float32]
    ud = U[q.dtype] if q.dtype in (torch.bfloat16, torch.float16) else u

    def gamma_u(n: int) -> float:
        return gamma(n, u)
    q64, k64, v64, do64 = (t.detach().to("cpu", torch.float64) for t in (q, k, v, do))
    M, D = q.shape[2], q.shape[3]
    L = k.shape[2]
    z = (q64 @ k64.mT) * scale
    if mask is not None:
        z = z.masked_fill(~mask.to("cpu").expand_as(z), float("-inf"))
    p = torch.nan_to_num(torch.softmax(z, -1), nan=0.0)
    dp = do64 @ v64.mT
    dot = (p * dp).sum(-1, keepdim=True)
    ds = scale * p * (dp - dot)
    zf = torch.where(torch.isfinite(z), z, torch.zeros_like(z)).abs()
    z_err = (scale * gamma_u(D) * (q64.abs() @ k64.abs().mT)).amax(-1, keepdim=True)
    rho = (2 * zf.amax(-1, keepdim=True) + L + 8) * u + 2 * z_err
    dp_err = gamma_u(D) * (do64.abs() @ v64.abs().mT)
    spd = (p * dp.abs()).sum(-1, keepdim=True)
    bp = rho * p
    bds = scale * p * ((rho + 3 * u) * (dp - dot).abs() + (rho + gamma_u(L)) * spd + dp_err
                       + (p * dp_err).sum(-1, keepdim=True))
    ep, eds = bp * (1 + ud) + ud * p, bds * (1 + ud) + ud * ds.abs()         # |P̃ − P|, |dS̃ − dS|
    pt, dst = p + ep, ds.abs() + eds                                         # |P̃|, |dS̃| bounded
    out = []
    for ref, b in ((ds @ k64, eds @ k64.abs() + gamma_u(L) * (dst @ k64.abs())),
                   (ds.mT @ q64, eds.mT @ q64.abs() + gamma_u(M) * (dst.mT @ q64.abs())),
                   (p.mT @ do64, ep.mT @ do64.abs() + gamma_u(M) * (pt.mT @ do64.abs()))):
        out.append((ref, b + ud * (ref.abs() + b)))
    return out

