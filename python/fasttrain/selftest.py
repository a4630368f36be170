"""`fasttrain selftest`: every compiled kernel against the float64 reference, on this device.

    fasttrain selftest [--device cpu|cuda] [--quick] [--json PATH]

Each op runs on a fixed set of cases (odd sizes, several vocabulary chunks and token blocks,
bf16/fp16/fp32, ignore_index, bool and weighted masks, M in {1, 7, 64, 65, 300}), forward and
backward, through its face in fasttrain.ops with the compiled kernels forced on; the same inputs
(already rounded to the case's dtype) go to fasttrain.ops.reference in float64. One row per op and
case: pass/fail, the worst error against its derived tolerance, kernel and reference time. The exit
status is 1 on any failure. The verdict is also kept in a small cache (see `verdict_path`), which
`fasttrain info` and the trainer read; the trainer runs `--quick` on a CUDA device before step 1.

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
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["Row", "run_selftest", "main", "verdict_path", "read_verdict", "record_verdict", "verdict_line",
           "device_info", "KERNELS", "kernel", "implementations"]

U = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
DT_NAME = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _u_acc(dtype: torch.dtype) -> float:
    return U[torch.float64] if dtype == torch.float64 else U[torch.float32]


def _kernel_faces() -> dict[str, Callable]:
    """The op faces whose compiled kernels are checked (a test swaps one for a wrong kernel)."""
    import fasttrain.ops as F
    from fasttrain.nn.dense_linear import dense_linear
    return {"fused_logprob": F.fused_logprob, "policy_loss": F.policy_loss, "nf4_quantize": F.nf4_quantize,
            "nf4_dequantize": F.nf4_dequantize, "nf4_linear": F.nf4_linear, "nf4_dora_norm": F.nf4_dora_norm,
            "nf4_weight_sq_norm": F.nf4_weight_sq_norm, "dense_linear": dense_linear,
            "gated_delta_rule": F.gated_delta_rule, "gated_delta_step": F.gated_delta_step,
            "gated_delta_step_": F.gated_delta_step_, "causal_conv1d": F.causal_conv1d, "causal_conv1d_step": F.causal_conv1d_step,
            "moe_experts": F.moe_experts, "decode_attention": F.decode_attention, "rms_norm": F.rms_norm,
            "rotary_cache_write_": F.rotary_cache_write_, "silu_mul": F.silu_mul,
            "masked_attention": F.masked_attention}


KERNELS: dict[str, Callable] = {}


def kernel(name: str) -> Callable:
    """The face under test for op `name` (KERNELS, filled with the real faces when empty, so a case
    run on its own, outside run_selftest, checks the real kernels)."""
    if not KERNELS:
        KERNELS.update(_kernel_faces())
    return KERNELS[name]


@dataclass
class Row:
    op: str
    case: str
    passed: bool
    output: str = ""          # the output with the worst error/tolerance ratio
    max_err: float = 0.0      # its error ...
    tol: float = 0.0          # ... and the derived tolerance at that element
    kernel_ms: float = 0.0
    ref_ms: float = 0.0
    detail: str = ""          # what failed beyond a value (dtype, shape, exception)
    impl: str = ""            # "face:implementation" the case ran (e.g. gated_delta_rule:fla)


# ---- comparison -------------------------------------------------------------------------------
class _Check:
    """Collects (output, kernel value, float64 reference, elementwise tolerance) and keeps the worst."""

    def __init__(self):
        self.worst = ("", 0.0, 0.0, -1.0)   # output, err, tol, ratio
        self.problems: list[str] = []

    def close(self, name: str, got: torch.Tensor, want: torch.Tensor, tol, dtype: torch.dtype | None = None):
        if dtype is not None and got.dtype != dtype:
            self.problems.append(f"{name}: dtype {got.dtype}, expected {dtype}")
        if tuple(got.shape) != tuple(want.shape):
            self.problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            return
        if got.numel() == 0:
            return
        g = got.detach().to("cpu", torch.float64)
        w = want.detach().to("cpu", torch.float64)
        t = torch.as_tensor(tol, dtype=torch.float64).to("cpu").expand_as(w)
        err = (g - w).abs()
        err = torch.where(torch.isnan(err) | (torch.isfinite(w) & ~torch.isfinite(g)), torch.full_like(err, math.inf), err)
        ratio = err / t.clamp(min=1e-300)
        ratio = torch.where((err == 0), torch.zeros_like(ratio), ratio)
        i = int(ratio.reshape(-1).argmax())
        r = float(ratio.reshape(-1)[i])
        if r > self.worst[3]:
            self.worst = (name, float(err.reshape(-1)[i]), float(t.reshape(-1)[i]), r)

    def exact(self, name: str, got: torch.Tensor, want: torch.Tensor):
        """Bit-for-bit: the error is the number of differing entries, the tolerance 0."""
        if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
            self.problems.append(f"{name}: {got.dtype}{tuple(got.shape)}, expected {want.dtype}{tuple(want.shape)}")
            return
        g, w = got.detach().cpu(), want.detach().cpu()
        diff = int((g != w).sum()) if not g.is_floating_point() else int(((g != w) & ~(g.isnan() & w.isnan())).sum())
        r = math.inf if diff else 0.0
        if r > self.worst[3]:
            self.worst = (name, float(diff), 0.0, r)

    def row(self, op, case, t_kernel, t_ref, impl: str = "") -> Row:
        name, err, tol, ratio = self.worst
        ok = ratio <= 1.0 and not self.problems
        return Row(op, case, ok, name, err, tol, 1e3 * t_kernel, 1e3 * t_ref, "; ".join(self.problems),
                   impl or f"{op}:kernel")


def _timed(fn: Callable, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t


def _rounding(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The most that rounding x to dtype can change it: u·|x|, and half the subnormal spacing
    (u·tiny) below the smallest normal number."""
    return U[dtype] * x.abs().clamp(min=torch.finfo(dtype).tiny)


def _leaf(x: torch.Tensor | None, device, dtype=None) -> torch.Tensor | None:
    """A fresh leaf that requires grad (never the input itself)."""
    if x is None:
        return None
    return x.detach().to(device=device, dtype=dtype or x.dtype).clone().requires_grad_()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- fused_logprob ----------------------------------------------------------------------------
def _logprob_case(dev, N, H, V, dtype, T=0.9, bias=True, chunk=4096, small_grad=False, seed=0,
                  kept=False) -> tuple[str, Callable]:
    name = f"N={N} H={H} V={V} {DT_NAME[dtype]} T={T}{' bias' if bias else ''} chunk={chunk or 'default'}" + \
           (" g~1/N" if small_grad else "") + (" kept set" if kept else "")

    def run(check: _Check):
        from fasttrain.ops import logprob as lp_mod
        from fasttrain.ops import reference as R
        g = _gen(seed)
        h = (torch.randn(N, H, generator=g, dtype=torch.float64) * 3).to(dtype)
        w = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype)
        b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype) if bias else None
        t = torch.randint(0, V, (N,), generator=g)
        t[::7] = -100
        up = torch.randn(N, generator=g, dtype=torch.float64) / (N if small_grad else 1)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        delta = None
        if kept:   # a truncated draw's record: each token's kept set cut at the widest gap among its 20 largest
            zs = (h.double() @ w.double().T + (0 if b is None else b.double())) / T
            s, order = zs.sort(-1, descending=True)
            j = (s[:, :-1] - s[:, 1:])[:, :20].argmax(1)                     # the cut between s[j] and s[j + 1]
            cut = (s.gather(1, j[:, None]) + s.gather(1, j[:, None] + 1))[:, 0] / 2
            pick = (torch.rand(N, generator=g) * (j + 1)).long()
            t = torch.where(t == -100, t, order.gather(1, pick[:, None])[:, 0])
            delta = zs.gather(1, t.clamp(min=0)[:, None])[:, 0] - cut
            delta = delta.to(acc).to(dev)
        leaves_k = [_leaf(x, dev) for x in (h, w, b)]
        leaves_r = [_leaf(x, dev, torch.float64) for x in (h, w, b)]
        td = t.to(dev)

        def kern():
            prev = lp_mod.chunk_bytes()
            lp_mod.set_chunk_bytes(chunk)
            try:
                hk, wk, bk = leaves_k
                logp, ent = KERNELS["fused_logprob"](hk, wk, td, T, bias=bk, keep_delta=delta)
                (logp * up.to(dev, logp.dtype)).sum().backward()
                return logp, ent
            finally:
                lp_mod.set_chunk_bytes(prev)

        def ref():
            hr, wr, br = leaves_r
            logp, ent = R.fused_logprob(hr, wr, td, T, bias=br, keep_delta=delta)
            (logp * up.to(dev)).sum().backward()
            return logp, ent

        (lk, ek), tk = _timed(kern, dev)
        (lr, er), tr = _timed(ref, dev)
        ud, ua = U[dtype], _u_acc(dtype)
        with torch.no_grad():
            hr, wr, br = (x.detach() if x is not None else None for x in leaves_r)
            keep = (td != -100)
            z = hr @ wr.T + (0 if br is None else br)
            zk = z / T
            if delta is not None:   # the kept set's softmax (the reference's own definition)
                zk = torch.where(zk >= zk.gather(1, torch.where(keep, td, 0)[:, None]) - delta.double()[:, None], zk,
                                 torch.full_like(zk, -math.inf))
            P = torch.softmax(zk, -1)
            onehot = torch.zeros_like(P).scatter_(1, torch.where(keep, td, 0)[:, None], 1.0) * keep[:, None]
            P = P * keep[:, None]
            S = (hr.abs() @ wr.abs().T + (0 if br is None else br.abs())).max() / T
            dz = (2 * ud + (H + 2) * ua) * S
            gV = (V + 2) * ua
            eps = 2 * (dz + gV)
            ent_tol = eps * (2 + er.abs().max()) + 4 * ua * (S + math.log(V))
            logp_tol = eps + 4 * ua * (S + math.log(V))
            g_abs = up.to(dev).abs()
            dh_mag = g_abs[:, None] * (P @ wr.abs() + onehot @ wr.abs()) / T
            dh_tol = (eps + gV) * dh_mag + _rounding(leaves_r[0].grad, dtype)
            coef = g_abs[:, None] * (P + onehot) / T          # [N, V]
            dw_tol = (eps + ud + (N + 2) * ua) * (coef.T @ hr.abs()) + _rounding(leaves_r[1].grad, dtype)
        check.close("logp", lk, lr, logp_tol, acc)
        check.close("entropy", ek, er, ent_tol, acc)
        check.close("d_hidden", leaves_k[0].grad, leaves_r[0].grad, dh_tol, dtype)
        check.close("d_weight", leaves_k[1].grad, leaves_r[1].grad, dw_tol, dtype)
        if bias:
            db_tol = (eps + ud + (N + 2) * ua) * coef.sum(0) + _rounding(leaves_r[2].grad, dtype)
            check.close("d_bias", leaves_k[2].grad, leaves_r[2].grad, db_tol, dtype)
        return tk, tr

    return name, run


def _logprob_cases(dev, quick: bool):
    small = 4096 if dev.type == "cpu" else 65536
    if quick:
        return [_logprob_case(dev, 37, 19, 53, torch.float32, chunk=small, seed=1),
                _logprob_case(dev, 130, 65, 1001, torch.bfloat16, T=1.0, chunk=small, seed=2),
                _logprob_case(dev, 64, 32, 777, torch.float16, bias=False, chunk=small, small_grad=True, seed=3),
                _logprob_case(dev, 130, 65, 1001, torch.float32, chunk=small, seed=4, kept=True)]
    out = []
    shapes = [(1, 7, 5), (37, 19, 53), (130, 65, 1001), (300, 96, 5003)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    i = 0
    for (N, H, V) in shapes:
        for dt in dtypes:
            i += 1
            out.append(_logprob_case(dev, N, H, V, dt, T=(0.9, 1.0, 0.7)[i % 3], bias=i % 2 == 0, chunk=small,
                                     small_grad=dt == torch.float16, seed=10 + i))
    out.append(_logprob_case(dev, 300, 96, 5003, torch.bfloat16, chunk=0, seed=40))
    out.append(_logprob_case(dev, 37, 19, 53, torch.float64, chunk=small, seed=41))   # both backends take fp64
    out.append(_logprob_case(dev, 130, 65, 1001, torch.float64, chunk=small, seed=42))
    out.append(_logprob_case(dev, 130, 65, 1001, torch.float32, chunk=small, seed=43, kept=True))   # top_k/top_p replay
    out.append(_logprob_case(dev, 37, 19, 53, torch.float64, chunk=small, seed=44, kept=True))
    return out


# ---- policy_loss ------------------------------------------------------------------------------
def _policy_case(dev, B, T, loss, dtype, per_token_adv=False, float_mask=False, beta=0.0, zeta=0.0,
                 normalizer=False, seed=0, kl="k3_ratio") -> tuple[str, Callable]:
    name = (f"B={B} T={T} {loss} {DT_NAME[dtype]} adv={'token' if per_token_adv else 'seq'} "
            f"mask={'float' if float_mask else 'bool'} beta={beta}" + (f" kl={kl}" if beta else "")
            + f" zeta={zeta}" + (" normalizer" if normalizer else ""))
    eps_low, eps_high, cap = 0.2, 0.28, 1.2

    def run(check: _Check):
        from fasttrain.ops import reference as R
        g = _gen(seed)
        logp = (-torch.rand(B, T, generator=g, dtype=torch.float64) * 6 - 0.01).to(dtype)
        log_ratio = (torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5) * 1.4
        old = (logp.double() - log_ratio).to(dtype)
        ref = (logp.double() + torch.rand(B, T, generator=g, dtype=torch.float64) - 0.5).to(dtype)
        adv = torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g)
        adv = torch.where(adv.abs() < 0.05, torch.zeros_like(adv), adv)
        mask = torch.rand(B, T, generator=g) < 0.8
        mask[0, 0] = True
        # away from every clip edge, in the rounded values the kernel sees
        lr64 = logp.double() - old.double()
        edges = [math.log(1 - eps_low), math.log(1 + eps_high), math.log(1 + eps_low), math.log(cap)]
        for e in edges:
            mask &= (lr64 - e).abs() > 1e-3
        if float_mask:
            mask = mask.float() * torch.rand(B, T, generator=g)
        else:
            old = torch.where(mask, old, torch.full_like(old, float("nan")))  # inactive tokens may hold anything
        norm = float(mask.bool().any(1).sum() if loss == "grpo" else mask.bool().sum()) + 3.0 if normalizer else None
        kw = dict(loss=loss, beta=beta, eps_low=eps_low, eps_high=eps_high, cispo_cap=cap, zeta=zeta,
                  token_normalizer=norm, kl=kl)
        lp_k, lp_r = _leaf(logp, dev), _leaf(logp, dev, torch.float64)

        def kern():
            out, stats = KERNELS["policy_loss"](lp_k, old.to(dev), adv.to(dev), mask.to(dev),
                                                ref_logp=ref.to(dev), **kw)
            out.backward()
            return out, stats

        def refr():
            out, stats = R.policy_loss(lp_r, old.to(dev, torch.float64), adv.to(dev, torch.float64), mask.to(dev),
                                       ref_logp=ref.to(dev, torch.float64), **kw)
            out.backward()
            return out, stats

        (ok_, sk), tk = _timed(kern, dev)
        (orf, sr), tr = _timed(refr, dev)
        ua, ud = U[torch.float32], U[dtype]
        with torch.no_grad():
            on = mask.to(dev) != 0
            n = int(on.sum())
            K = 1 + float(torch.where(on, lp_r.abs() + old.to(dev, torch.float64).abs() + ref.to(dev).double().abs(),
                                      torch.zeros((), dtype=torch.float64, device=dev)).max())
            et = (8 + K) * ua
            terms = R.policy_loss_terms(lp_r.detach(), old.to(dev, torch.float64), adv.to(dev, torch.float64),
                                        mask.to(dev), loss=loss, ref_logp=ref.to(dev, torch.float64), beta=beta,
                                        eps_low=eps_low, eps_high=eps_high, cispo_cap=cap, zeta=zeta, kl=kl)
            # Each token's parts before they add up (they may cancel): the REPO-R factor 1 ± ζ·log p as
            # 1 + ζ|log p|, the policy term |A|·factor·(r + 2)(1 + |log p|) (any branch), the KL term
            # β(e^d + |d| + 1), its gradient |A|·factor·r(1 + cap) + β(1 + e^d); k3_ratio's KL term and
            # gradient (r·k3, −r·d) are both below β·r·(e^d + |d| + 1). Weighted by the mask and divided
            # by the token's normalizer (GRPO: its row's weight times the sequence count).
            w = terms["weight"]
            lp64 = lp_r.detach()
            d = ref.to(dev, torch.float64) - lp64
            adv64 = adv.to(dev, torch.float64)
            adv64 = (adv64[:, None].expand(B, T) if adv64.dim() == 1 else adv64).abs()
            fac = 1 + zeta * lp64.clamp(min=-20).abs()
            r64 = terms["ratio"]
            kl_mag = d.exp() + d.abs() + 1
            kl_grad_mag = 1 + d.exp()
            if kl == "k3_ratio":
                kl_mag = kl_grad_mag = r64 * kl_mag
            loss_mag = (adv64 * fac * (r64 + 2) * (1 + lp64.abs()) + beta * kl_mag) * w
            grad_mag = (adv64 * fac * r64 * (1 + cap) + beta * kl_grad_mag) * w
            if loss == "grpo":
                row_w = w.sum(-1, keepdim=True)
                S = norm if norm is not None else float((row_w > 0).sum())
                per_norm = (row_w * S).clamp(min=1e-300)
            else:
                per_norm = max(norm if norm is not None else float(w.sum()), 1e-300)
            abs_scale = float((loss_mag / per_norm).sum())
            sum_f = et + (n + 2) * ua
            check.close("loss", ok_, orf, sum_f * abs_scale + ua * abs(float(orf)), torch.float32)
            g64 = lp_r.grad
            check.close("d_logp", lp_k.grad, g64, (et + 4 * ua) * grad_mag / per_norm + _rounding(g64, dtype), dtype)
            mags = {"ratio_mean": r64, "kl_mean": kl_mag, "repo_r_factor_mean": fac}
            for k in sk:
                x = mags.get(k)
                m = 1.0 + (float(torch.where(on, x.abs(), torch.zeros_like(x)).max()) if x is not None else 0.0)
                if k == "active_tokens":
                    m = max(m, float(w.sum()))
                check.close(k, sk[k], sr[k], sum_f * m, torch.float32)
        return tk, tr

    return name, run


def _policy_cases(dev, quick: bool):
    if quick:
        return [_policy_case(dev, 6, 37, "cispo", torch.float32, zeta=0.03, seed=1),
                _policy_case(dev, 6, 37, "dapo", torch.bfloat16, per_token_adv=True, float_mask=True, beta=0.04, seed=2),
                _policy_case(dev, 6, 37, "grpo", torch.float16, beta=0.04, zeta=0.02, normalizer=True, seed=3),
                _policy_case(dev, 6, 37, "cispo", torch.float32, beta=0.04, seed=4, kl="k3")]
    out, i = [], 0
    for (B, T) in [(1, 1), (6, 37), (33, 1000)]:
        for loss in ("cispo", "dapo", "grpo"):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                i += 1
                out.append(_policy_case(dev, B, T, loss, dt, per_token_adv=i % 2 == 0, float_mask=i % 3 == 0,
                                        beta=0.04 * (i % 2), zeta=0.03 * (i % 3 == 1), normalizer=i % 4 == 0,
                                        seed=100 + i, kl="k3" if i % 4 == 1 else "k3_ratio"))
    return out


# ---- nf4 quantize / dequantize ------------------------------------------------------------------
def _nf4_special_values() -> torch.Tensor:
    from fasttrain.ops.reference import NF4_LEVELS
    lv = torch.tensor(NF4_LEVELS)
    mids = (lv[:-1] + lv[1:]) / 2
    return torch.cat([lv, mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                      torch.nextafter(mids, torch.full_like(mids, -2.0))])


def _nf4_case(dev, n, dtype, double_quant, blocksize=64, seed=0) -> tuple[str, Callable]:
    name = f"n={n} {DT_NAME[dtype]} blocksize={blocksize}{' double-quant' if double_quant else ''}"

    def run(check: _Check):
        from fasttrain.ops import reference as R
        g = _gen(seed)
        w = torch.randn(n, generator=g) * 0.05
        if n > 300:
            sv = _nf4_special_values()
            w[0] = 1.0                         # block 0's absmax is 1: its values are scaled exactly,
            w[1:1 + sv.numel()] = sv           # so the levels, midpoints and their neighbours test the tie rule
            w[128:192] = 0.0                   # an all-zero block
            w[200] = 40.0                      # an outlier
        w = w.to(dtype).to(dev)

        def kern():
            packed, st = KERNELS["nf4_quantize"](w, blocksize=blocksize, double_quant=double_quant)
            return packed, st, KERNELS["nf4_dequantize"](packed, st, torch.float32), \
                KERNELS["nf4_dequantize"](packed, st, dtype)

        def refr():
            packed, st = R.nf4_quantize(w, blocksize=blocksize, double_quant=double_quant)
            return packed, st, R.nf4_dequantize(packed, st, torch.float32), R.nf4_dequantize(packed, st, dtype)

        (pk, sk, dk32, dk), tk = _timed(kern, dev)
        (pr, sr, dr32, dr), tr = _timed(refr, dev)
        check.exact("packed", pk, pr)
        if double_quant:
            check.exact("offset", sk.offset.reshape(-1), sr.offset.reshape(-1))
            check.exact("qabsmax", sk.qabsmax, sr.qabsmax)
            check.exact("absmax2", sk.absmax2, sr.absmax2)
        else:
            check.exact("absmax", sk.absmax, sr.absmax)
        check.exact("dequantized fp32", dk32, dr32)
        check.exact(f"dequantized {DT_NAME[dtype]}", dk, dr)
        return tk, tr

    return name, run


def _nf4_cases(dev, quick: bool):
    if quick:
        return [_nf4_case(dev, 65, torch.float32, False, seed=1), _nf4_case(dev, 4096 * 3 + 7, torch.bfloat16, True, seed=2)]
    out, i = [], 0
    for n in (1, 63, 64, 65, 4096 * 3 + 7, 64 * 257 + 13, 1 << 20):
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            for dq in (False, True):
                i += 1
                out.append(_nf4_case(dev, n, dt, dq, seed=200 + i))
    out.append(_nf4_case(dev, 4096 + 3, torch.float32, False, blocksize=128, seed=300))
    return out


# ---- nf4_linear and its norms -----------------------------------------------------------------------
def _linear_data(dev, N, K, r, seed):
    from fasttrain.ops import reference as R
    g = _gen(seed)
    w = torch.randn(N, K, generator=g)
    q, st = R.nf4_quantize(w)                       # the format itself is checked by the nf4 rows
    a = torch.randn(r, K, generator=g) / 20
    b = torch.randn(N, r, generator=g) / 20
    return g, q.to(dev), st.to(dev), a.to(dev), b.to(dev)


def _dense_reference(x, w, a, b, s, m):
    """y = g ⊙ (x·Wᵀ + s·(x·Aᵀ)·Bᵀ), g = m / ‖W + s·B·A‖ detached (or 1), in the inputs' float64."""
    y = x @ w.T if a is None else x @ w.T + s * ((x @ a.T) @ b.T)
    if m is not None:
        with torch.no_grad():
            norm = (w + s * b @ a).norm(dim=1)
        y = y * (m / norm)
    return y


def _linear_case(dev, N, K, r, M, dtype, adapter, seed=0, base="nf4") -> tuple[str, Callable]:
    """nf4_linear, or with base "dense" the 16-bit layer's dense_linear on a weight in `dtype`."""
    name = f"N={N} K={K} r={r} M={M} {DT_NAME[dtype]} {adapter}"
    s = 2.0

    def run(check: _Check):
        from fasttrain.ops import reference as R
        g, q, st, a, b = _linear_data(dev, N, K, r, seed)
        W = R.nf4_decode_weight(q, st, torch.float64)
        if base == "dense":
            Wd = (torch.randn(N, K, generator=g) / 4).to(dtype).to(dev)
            W = Wd.double()
        m = (W + s * b.double() @ a.double()).norm(dim=1) * (1 + 0.2 * torch.rand(N, generator=g, dtype=torch.float64).to(dev))
        x = torch.randn(M, K, generator=g).to(dtype).to(dev)
        dy = torch.randn(M, N, generator=g).to(dtype).to(dev)
        lora, dora = adapter != "base", adapter == "dora"
        xk, ak, bk, mk = _leaf(x, dev), _leaf(a, dev), _leaf(b, dev), _leaf(m, dev, torch.float32)
        xr, ar, br, mr = (_leaf(t, dev, torch.float64) for t in (x, a, b, mk))

        def kern():
            if base == "dense":
                y = KERNELS["dense_linear"](xk, Wd, None, ak if lora else None, bk if lora else None, s,
                                            mk if dora else None)
                y.backward(dy)
                return y
            # as NF4Linear: the cached float32 ‖W‖², except for a float64 model (its exact sum)
            wsq = KERNELS["nf4_weight_sq_norm"](q, st) if dora and dtype != torch.float64 else None
            y = KERNELS["nf4_linear"](xk, q, st, ak if lora else None, bk if lora else None, s,
                                      mk if dora else None, wsq)
            y.backward(dy)
            return y

        def refr():
            if base == "dense":
                y = _dense_reference(xr, W, ar if lora else None, br if lora else None, s, mr if dora else None)
                y.backward(dy.double())
                return y
            y = R.nf4_linear(xr, q, st, ar if lora else None, br if lora else None, s, mr if dora else None)
            y.backward(dy.double())
            return y

        yk, tk = _timed(kern, dev)
        yr, tr = _timed(refr, dev)
        ua = _u_acc(dtype)
        uc = U[dtype] if dtype in (torch.bfloat16, torch.float16) else ua
        with torch.no_grad():
            X, Wa, Aa, Ba = xr.abs(), W.abs(), ar.abs(), br.abs()
            if not lora:
                Aa, Ba = torch.zeros_like(Aa), torch.zeros_like(Ba)
            Y = X @ Wa.T + s * (X @ Aa.T) @ Ba.T
            z = xr.detach() @ W.T + (s * (xr.detach() @ ar.detach().T) @ br.detach().T if lora else 0)
            if dora:
                nrm = (W + s * br.detach() @ ar.detach()).norm(dim=1)
                Q = ((Wa + s * Ba @ Aa) ** 2).sum(1)
                gsc = mr.detach() / nrm
                eg = 6 * uc + (K + r + 4) * ua * Q / nrm**2
            else:
                gsc, eg = torch.ones(N, dtype=torch.float64, device=dev), torch.zeros(N, dtype=torch.float64, device=dev)
            base_f = 6 * uc + (K + r + 2) * ua
            check.close("y", yk, yr, gsc * (base_f * Y + eg * z.abs()) + _rounding(yr, dtype), dtype)
            DZ = dy.double().abs() * gsc
            f = lambda L: 6 * uc + eg.max() + (L + 2) * ua  # noqa: E731
            check.close("dx", xk.grad, xr.grad, f(N + r) * (DZ @ Wa + s * (DZ @ Ba) @ Aa) + _rounding(xr.grad, dtype), dtype)
            if lora:
                check.close("dA", ak.grad, ar.grad, f(M + N) * s * ((DZ @ Ba).T @ X) + _rounding(ar.grad, torch.float32), torch.float32)
                check.close("dB", bk.grad, br.grad, f(M + K) * s * (DZ.T @ (X @ Aa.T)) + _rounding(br.grad, torch.float32), torch.float32)
            if dora:
                dm_mag = (dy.double().abs() * Y).sum(0) / nrm
                check.close("dm", mk.grad, mr.grad, (f(M + K + r) + eg) * dm_mag + _rounding(mr.grad, torch.float32), torch.float32)
        return tk, tr

    return name, run


def _dense_cases(dev, quick: bool):
    if quick:
        return [_linear_case(dev, 129, 96, 8, 1, torch.float32, "lora", seed=21, base="dense"),
                _linear_case(dev, 129, 96, 8, 65, torch.bfloat16, "dora", seed=22, base="dense")]
    out, i = [], 0
    for (N, K, r) in [(37, 70, 5), (129, 96, 8), (1000, 584, 16)]:
        for M in (1, 65, 300):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                for adapter in ("base", "lora", "dora"):
                    i += 1
                    out.append(_linear_case(dev, N, K, r, M, dt, adapter, seed=600 + i, base="dense"))
    out.append(_linear_case(dev, 129, 96, 8, 65, torch.float64, "dora", seed=699, base="dense"))
    return out


def _norm_case(dev, N, K, r, dtype, seed=0) -> tuple[str, Callable]:
    name = f"N={N} K={K} r={r} {DT_NAME[dtype]}"
    s = 1.7

    def run(check: _Check):
        from fasttrain.ops import reference as R
        _, q, st, a, b = _linear_data(dev, N, K, r, seed)
        a, b = (a * 20).to(dtype), (b * 20).to(dtype)
        (nk, wk), tk = _timed(lambda: (KERNELS["nf4_dora_norm"](q, st, a, b, s),
                                       KERNELS["nf4_weight_sq_norm"](q, st)), dev)
        (nr, wr), tr = _timed(lambda: (R.nf4_dora_norm(q, st, a.double(), b.double(), s),
                                       R.nf4_decode_weight(q, st, torch.float64).square().sum(1)), dev)
        ua = _u_acc(dtype)
        W = R.nf4_decode_weight(q, st, torch.float64)
        Q = ((W.abs() + s * b.double().abs() @ a.double().abs()) ** 2).sum(1)
        check.close("dora_norm", nk, nr, (2 * ua + (K + r + 6) * ua) * Q / (2 * nr), dtype)
        check.close("weight_sq_norm", wk, wr, (K + 2) * U[torch.float32] * wr + U[torch.float32] * wr, torch.float32)
        return tk, tr

    return name, run


def _linear_cases(dev, quick: bool):
    if quick:
        return [_linear_case(dev, 129, 96, 8, 1, torch.float32, "lora", seed=1),
                _linear_case(dev, 129, 96, 8, 65, torch.bfloat16, "dora", seed=2),
                _linear_case(dev, 37, 70, 5, 7, torch.float16, "base", seed=3)]
    out, i = [], 0
    for (N, K, r) in [(37, 70, 5), (129, 96, 8), (1000, 584, 16)]:
        for M in (1, 7, 64, 65, 300):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                for adapter in ("base", "lora", "dora"):
                    i += 1
                    out.append(_linear_case(dev, N, K, r, M, dt, adapter, seed=400 + i))
    if dev.type == "cpu":
        out.append(_linear_case(dev, 129, 96, 8, 65, torch.float64, "dora", seed=499))
    return out


def _norm_cases(dev, quick: bool):
    if quick:
        return [_norm_case(dev, 129, 96, 8, torch.float32, seed=1)]
    out = [_norm_case(dev, N, K, r, torch.float32, seed=500 + i) for i, (N, K, r) in
           enumerate([(37, 70, 5), (129, 96, 8), (1000, 584, 16)])]
    out.append(_norm_case(dev, 129, 96, 8, torch.float64, seed=510))
    return out


# ---- the optional GPU packages (flash-attn 2, Liger-Kernel): the model's logits with and without --
def _package_case(dev, package: str) -> tuple[str, Callable]:
    def run(check: _Check):
        from fasttrain.models.gpu_packages import check_against_plain
        res, t = _timed(lambda: check_against_plain(package, dev), dev)
        # error against the float64 model, tolerance twice the plain bf16 model's error (+ u·|logit|)
        check.close("logits", torch.tensor([res["max_err"]]), torch.tensor([0.0]), res["tol"])
        return t, 0.0
    return f"tiny Llama bf16 logits with {package} vs float64 (plain bf16 error x2)", run, f"gpu_packages:{package}"


def _package_cases(dev, quick: bool):
    """Only on CUDA, and only for the packages installed there: those are the ones a run uses."""
    if dev.type != "cuda":
        return []
    from fasttrain.models.gpu_packages import installed
    return [_package_case(dev, p) for p in ("flash_attn", "liger_kernel") if installed(p)]


def _gated_delta_cases(dev, quick: bool):
    from fasttrain.selftest_gated_delta import gated_delta_cases
    return gated_delta_cases(dev, quick)


def _conv_cases(dev, quick: bool):
    from fasttrain.selftest_gated_delta import conv_cases
    return conv_cases(dev, quick)


def _moe_cases(dev, quick: bool):
    from fasttrain.selftest_moe import moe_cases
    return moe_cases(dev, quick)


def _decode_attention_case(dev, B, H, G, D, S, dtype, seed) -> tuple:
    """One decode step's attention over a strided cache view with invalid keys, against the float64
    definition: each score off by D·u·Σ|q||k|·scale, moving the weights by 2·max δs; the output by
    (2·max δs + (S + 8)·u)·max|v|, then its rounding (tests/ops/test_decode_attention.py derives it)."""
    from fasttrain.ops.decode_attention import decode_attention_backend
    name = f"B={B} kv={H} G={G} D={D} S={S} {DT_NAME[dtype]}"

    def run(check: _Check):
        from fasttrain.ops import reference as R
        g = torch.Generator().manual_seed(seed)
        q = (torch.randn(B, H, G, D, generator=g) * 2).to(dev, dtype)
        cache = (torch.randn(2, B, H, S + 5, D, generator=g) * 2).to(dev, dtype)
        k, v = cache[0][:, :, :S], cache[1][:, :, :S]
        valid = (torch.rand(B, S, generator=g) > 0.3).to(dev)
        valid[:, -1] = True
        with torch.no_grad():
            o, tk = _timed(lambda: KERNELS["decode_attention"](q, k, v, valid, 0.125), dev)
        ref, tr = _timed(lambda: R.decode_attention(q.double(), k.double(), v.double(), valid, 0.125), dev)
        ua = _u_acc(dtype)
        q64, k64 = q.double(), k.double()
        ds = D * ua * (q64.abs() @ k64.abs().transpose(-1, -2)).amax(-1, keepdim=True) * 0.125
        vmax = v.double().abs().amax(dim=(2, 3))[:, :, None, None]
        check.close("o", o, ref, (2 * ds + (S + 8) * ua) * vmax + _rounding(ref, dtype), dtype)
        return tk, tr

    return name, run, f"decode_attention:{decode_attention_backend(dev, grad=False)}"


def _decode_attention_cases(dev, quick: bool):
    shapes = [(5, 3, 3, 64, 37), (2, 2, 5, 40, 23)] if quick else \
        [(5, 3, 3, 64, 37), (2, 2, 1, 128, 300), (3, 1, 8, 32, 19), (2, 2, 5, 40, 23), (48, 3, 3, 64, 310)]
    dts = (torch.float32, torch.bfloat16) if quick else (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    return [_decode_attention_case(dev, *sh, dt, seed=800 + i) for i, (sh, dt) in
            enumerate((sh, dt) for sh in shapes for dt in dts)]


def _decode_fused_case(dev, kind: str, N: int, H: int, dtype, seed) -> tuple:
    """A decode step's fused elementwise op against its definition: the rotary embedding + cache
    write bit for bit against its correctly rounded steps in the dtype (fasttrain.ops.reference);
    RMSNorm and SwiGLU against float64 within ((1 + u_d)^2 (1 + c·u) - 1)·|ref| (+ half a subnormal
    step per rounding), c = H + 5 for the norm's sum and 4 for SiLU's exp (tests/ops/test_decode_fused.py
    derives both)."""
    from fasttrain.ops.decode_fused import decode_fused_backend
    name = f"{kind} N={N} H={H} {DT_NAME[dtype]}"
    eta = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2

    def run(check: _Check):
        from fasttrain.ops import reference as R
        g = torch.Generator().manual_seed(seed)
        ud, u = U[dtype], U[torch.float32]
        with torch.no_grad():
            if kind == "rms_norm":
                x = (torch.randn(N, H, generator=g) * 3).to(dev, dtype)
                w = (torch.rand(H, generator=g) + 0.5).to(dev, dtype)
                y, tk = _timed(lambda: KERNELS["rms_norm"](x, w, 1e-5), dev)
                x64 = x.double()
                ref, tr = _timed(lambda: w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5), dev)
                check.close("y", y, ref, ((1 + ud) ** 2 * (1 + (H + 5) * u) - 1) * ref.abs()
                            + eta * (w.double().abs() + 1), dtype)
            elif kind == "silu_mul":
                gu = (torch.randn(N, 2 * H, generator=g) * 3).to(dev, dtype)
                a, tk = _timed(lambda: KERNELS["silu_mul"](gu), dev)
                g64, u64 = gu.double()[:, :H], gu.double()[:, H:]
                ref, tr = _timed(lambda: g64 / (1 + torch.exp(-g64)) * u64, dev)
                check.close("a", a, ref, ((1 + ud) ** 2 * (1 + 4 * u) - 1) * ref.abs() + eta * (u64.abs() + 1), dtype)
            else:                                   # rotary_cache_write_: H is the head width, 6 heads over 2 KV heads
                qkv = torch.randn(N, 10 * H, generator=g).to(dev, dtype)
                cos, sin = (torch.rand(2, N, H, generator=g) * 2 - 1).to(dev, dtype)
                cache = torch.randn(2, 2, N, 2, 7, H, generator=g).to(dev, dtype)
                mine, theirs = cache.clone(), cache.clone()
                q, tk = _timed(lambda: KERNELS["rotary_cache_write_"](qkv, cos, sin, mine[1][0], mine[1][1], 3, 6), dev)
                want, tr = _timed(lambda: R.rotary_cache_write_(qkv, cos, sin, theirs[1][0], theirs[1][1], 3, 6), dev)
                check.exact("q", q, want)
                check.exact("cache", mine, theirs)
        return tk, tr

    return name, run, f"decode_fused:{decode_fused_backend(dev, dtype)}"


def _decode_fused_cases(dev, quick: bool):
    dts = (torch.float32, torch.bfloat16) if quick else (torch.float32, torch.bfloat16, torch.float16)
    shapes = {"rms_norm": [(48, 576), (3, 37)], "silu_mul": [(48, 1536), (2, 9)], "rotary_cache_write_": [(48, 64), (3, 6)]}
    return [_decode_fused_case(dev, kind, N, H, dt, seed=900 + i) for i, (kind, N, H, dt) in
            enumerate((k, N, H, dt) for k, shs in shapes.items() for N, H in shs for dt in dts)]


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

    def gamma(n: int) -> float:
        return n * u / (1 - n * u)
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
    z_err = (scale * gamma(D) * (q64.abs() @ k64.abs().mT)).amax(-1, keepdim=True)
    rho = (2 * zf.amax(-1, keepdim=True) + L + 8) * u + 2 * z_err
    dp_err = gamma(D) * (do64.abs() @ v64.abs().mT)
    spd = (p * dp.abs()).sum(-1, keepdim=True)
    bp = rho * p
    bds = scale * p * ((rho + 3 * u) * (dp - dot).abs() + (rho + gamma(L)) * spd + dp_err
                       + (p * dp_err).sum(-1, keepdim=True))
    ep, eds = bp * (1 + ud) + ud * p, bds * (1 + ud) + ud * ds.abs()         # |P̃ − P|, |dS̃ − dS|
    pt, dst = p + ep, ds.abs() + eds                                         # |P̃|, |dS̃| bounded
    out = []
    for ref, b in ((ds @ k64, eds @ k64.abs() + gamma(L) * (dst @ k64.abs())),
                   (ds.mT @ q64, eds.mT @ q64.abs() + gamma(M) * (dst.mT @ q64.abs())),
                   (p.mT @ do64, ep.mT @ do64.abs() + gamma(M) * (pt.mT @ do64.abs()))):
        out.append((ref, b + ud * (ref.abs() + b)))
    return out


def _attention_case(dev, n, h, M, L, D, dtype, seed) -> tuple:
    """The update's masked attention's gradients (fasttrain.ops.masked_attention with its own backward
    wherever it can run) against float64, within attention_grad_bounds."""
    from fasttrain.ops.attention import attention_backward_kind, set_attention_backward
    name = f"n={n} h={h} M={M} L={L} D={D} {DT_NAME[dtype]}"
    probe = torch.empty(n, h, M, D, dtype=dtype, device=dev)
    old = set_attention_backward("fasttrain")
    try:
        impl = f"masked_attention:{attention_backward_kind(probe, probe.new_empty(n, h, L, D))}"
    finally:
        set_attention_backward(old)

    def run(check: _Check):
        g = torch.Generator().manual_seed(seed)
        q, k, v = ((torch.randn(n, h, r, D, generator=g)).to(dev, dtype).requires_grad_() for r in (M, L, L))
        do = torch.randn(n, h, M, D, generator=g).to(dev, dtype)
        mask = torch.rand(n, 1, M, L, generator=g) < 0.6
        mask[..., 0] = True
        mask = mask.to(dev)
        scale = D ** -0.5
        prev = set_attention_backward("fasttrain")
        try:
            grads, tk = _timed(lambda: torch.autograd.grad(kernel("masked_attention")(q, k, v, mask, scale),
                                                           (q, k, v), do), dev)
        finally:
            set_attention_backward(prev)
        refs, tr = _timed(lambda: attention_grad_bounds(q, k, v, do, mask, scale), dev)
        for nm, got, (ref, bound) in zip(("dq", "dk", "dv"), grads, refs):
            check.close(nm, got, ref, bound, dtype)
        return tk, tr

    return name, run, impl


def _attention_cases(dev, quick: bool):
    if dev.type != "cpu":                  # a CPU op: on a GPU masked_attention is torch's SDPA throughout
        return []
    shapes = [(3, 2, 19, 45, 16), (2, 3, 63, 100, 64)] if quick else \
        [(3, 2, 19, 45, 16), (2, 3, 63, 100, 64), (12, 3, 189, 360, 64), (1, 3, 891, 297, 64), (2, 4, 63, 360, 128)]
    dts = (torch.bfloat16, torch.float32)
    return [_attention_case(dev, *sh, dt, seed=950 + i) for i, (sh, dt) in
            enumerate((sh, dt) for sh in shapes for dt in dts)]


CASES = {"fused_logprob": _logprob_cases, "policy_loss": _policy_cases, "nf4_quantize": _nf4_cases,
         "nf4_linear": _linear_cases, "nf4_dora_norm": _norm_cases, "dense_linear": _dense_cases,
         "gated_delta_rule": _gated_delta_cases, "causal_conv1d": _conv_cases, "moe_experts": _moe_cases,
         "decode_attention": _decode_attention_cases, "decode_fused": _decode_fused_cases,
         "masked_attention": _attention_cases, "gpu_packages": _package_cases}


# ---- the run ----------------------------------------------------------------------------------
def device_info(device: torch.device) -> dict[str, Any]:
    """What a bug report needs: device, driver, torch/CUDA versions, compute capability, the build."""
    from fasttrain.ops import build_info
    info: dict[str, Any] = {"device": str(device), "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                            "python": platform.python_version(), "platform": platform.platform(),
                            "cpu": _cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                            "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
                            "build": build_info()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(name=p.name, compute_capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    multiprocessors=p.multi_processor_count, driver=_nvidia_driver())
    else:
        info.update(name=info["cpu"], compute_capability=None, driver=None)
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def run_selftest(device: str | torch.device = "cpu", quick: bool = False, ops: list[str] | None = None,
                 progress: Callable[[Row], None] | None = None) -> dict[str, Any]:
    """Run the cases; returns the report (device info, rows, failing rows, passed)."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("selftest --device cuda: no CUDA device is visible to torch")
    if not KERNELS:
        KERNELS.update(_kernel_faces())
    t0 = time.perf_counter()
    rows: list[Row] = []
    # fp32 GEMMs in full fp32 while checking (TF32, a user's speed choice, would be judged as an error)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        _run_cases(dev, quick, ops, rows, progress)
    finally:
        torch.set_float32_matmul_precision(precision)
    failing = [asdict(r) for r in rows if not r.passed]
    return {"passed": not failing, "quick": quick, "device": device_info(dev),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - (time.perf_counter() - t0))),
            "seconds": round(time.perf_counter() - t0, 3), "cases": len(rows), "failed": len(failing),
            "failing": failing, "rows": [asdict(r) for r in rows]}


def _case_impl(op: str, case: tuple) -> str:
    """A case is (name, run) or (name, run, "face:implementation"); the plain ones run op's kernel."""
    return case[2] if len(case) > 2 else f"{op}:kernel"


def implementations(device: str | torch.device, quick: bool = False) -> set[str]:
    """The "face:implementation" pairs the selftest's rows check on `device` with the packages
    installed now (building the cases runs nothing). The fake-CUDA trace of a training step asserts
    that every implementation the step dispatches to is among them."""
    dev = torch.device(device)
    return {_case_impl(op, c) for op, cases in CASES.items() for c in cases(dev, quick)}


def _run_cases(dev, quick, ops, rows, progress) -> None:
    from fasttrain.ops.kernels import fused_only
    with fused_only():
        for op, cases in CASES.items():
            if ops and op not in ops:
                continue
            for case in cases(dev, quick):
                name, run, impl = case[0], case[1], _case_impl(op, case)
                check = _Check()
                try:
                    tk, tr = run(check)
                    row = check.row(op, name, tk, tr, impl)
                except Exception as e:  # a kernel that raises fails its case; the others still run
                    row = Row(op, name, False, detail=f"{type(e).__name__}: {e}"[:500], impl=impl)
                rows.append(row)
                if progress:
                    progress(row)


# ---- the verdict cache (read by `fasttrain info` and the trainer) --------------------------------
def cache_dir() -> Path:
    """fasttrain's one cache folder (fasttrain.host.cache_root)."""
    from fasttrain.host import cache_root
    return cache_root()


def build_id() -> str:
    """The compiled extension's identity: version, torch, CUDA archs, the CPU variant that runs, and
    the library files' sizes and modification times (a rebuild is a new build)."""
    from fasttrain import _native
    from fasttrain.ops import build_info
    _native.load()
    bi = build_info()
    text = f"{bi['version']}|{bi['torch_version']}|{bi['cuda_archs']}|{bi['cpu_variant']}"
    for mod in (_native._C, _native._C_CUDA):
        if mod is not None:
            so = Path(mod.__file__)
            st = so.stat()
            text += f"|{so.name}|{st.st_size}|{int(st.st_mtime)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def verdict_path() -> Path:
    return cache_dir() / "selftest_verdicts.json"


def _verdict_key(info: dict[str, Any]) -> str:
    return f"{info['device'].split(':')[0]}|{info['name']}|{build_id()}"


def record_verdict(report: dict[str, Any]) -> Path | None:
    """Keep this report's verdict under (device kind, device name, build). Returns the file, or None
    when the cache cannot be written (read-only home): the verdict is then only in the report."""
    path = verdict_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        data = {}
    data[_verdict_key(report["device"])] = {
        "passed": report["passed"], "quick": report["quick"], "when": report["started"], "cases": report["cases"],
        "failing": [f"{r['op']} [{r['case']}]" for r in report["failing"]]}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
        return path
    except OSError:
        return None


def read_verdict(device: str | torch.device) -> dict[str, Any] | None:
    """The last recorded verdict for this device and this build, or None."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()
    try:
        data = json.loads(verdict_path().read_text())
    except (OSError, ValueError):
        return None
    return data.get(f"{dev.type}|{name}|{build_id()}")


def verdict_line(device: str | torch.device) -> str:
    """One line for `fasttrain info`: were the compiled kernels verified on this device, and when."""
    dev = torch.device(device)
    try:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name()
        v = read_verdict(dev)
    except Exception as e:  # no extension, no driver: say so rather than fail `info`
        return f"kernels on {dev.type}: not verified ({type(e).__name__}: {e})"
    if v is None:
        return (f"kernels on {dev.type} ({name}): not verified for this build; run `fasttrain selftest "
                f"--device {dev.type}`")
    how = "selftest --quick" if v["quick"] else "selftest"
    if v["passed"]:
        return f"kernels on {dev.type} ({name}): verified by {how} at {v['when']} ({v['cases']} cases passed)"
    return (f"kernels on {dev.type} ({name}): FAILED {how} at {v['when']}: {', '.join(v['failing'][:4])}"
            f"{' ...' if len(v['failing']) > 4 else ''}; use run.kernels = \"reference\"")


# ---- command line -------------------------------------------------------------------------------
def format_row(r: Row) -> str:
    status = "pass" if r.passed else "FAIL"
    err = f"{r.output} err {r.max_err:.3g} <= tol {r.tol:.3g}" if r.passed else \
        (f"{r.output} err {r.max_err:.3g} > tol {r.tol:.3g}" if r.output else "")
    extra = f"  {r.detail}" if r.detail else ""
    return f"{status}  {r.op:<14} {r.case:<58} {err:<48} kernel {r.kernel_ms:8.2f} ms  ref {r.ref_ms:8.2f} ms{extra}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fasttrain selftest", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when visible, else cpu)")
    p.add_argument("--quick", action="store_true", help="a few cases per op (seconds)")
    p.add_argument("--json", type=Path, default=None, help="write the report (device, versions, every row) here")
    p.add_argument("--op", action="append", default=None, choices=sorted(CASES), help="only this op (repeatable)")
    a = p.parse_args(argv)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        print(f"selftest: --device must be cpu or cuda, got {device!r}", file=sys.stderr)
        return 2
    try:
        report = run_selftest(device, a.quick, a.op, progress=lambda r: print(format_row(r), flush=True))
    except RuntimeError as e:
        print(f"selftest: {e}", file=sys.stderr)
        return 2
    d = report["device"]
    print(f"{report['cases'] - report['failed']}/{report['cases']} cases passed on {d['name']} "
          f"({d['device']}, torch {d['torch']}, CUDA {d['cuda_runtime'] or '-'}"
          f"{', sm ' + d['compute_capability'] if d['compute_capability'] else ''}) in {report['seconds']:.1f} s")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        from fasttrain.train.run_files import json_safe  # standard JSON: an infinite error as "inf"
        a.json.write_text(json.dumps(json_safe(report), indent=1))
        print(f"report: {a.json}")
    record_verdict(report)
    if not report["passed"]:
        ops = sorted({r["op"] for r in report["failing"]})
        print(f"FAILED: {', '.join(ops)}. Train with the plain-PyTorch ops meanwhile: run.kernels = \"reference\" "
              f"in the recipe (--set run.kernels=reference), or FASTTRAIN_KERNELS=reference for other trainers.")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
