"""Selftest cases of policy_loss (CISPO, DAPO, GRPO, KL estimators, REPO-R); the bound is derived
in fasttrain.selftest.bounds."""
from __future__ import annotations

import math
from typing import Callable

import torch

from fasttrain.selftest.bounds import DT_NAME, U, rounding
from fasttrain.selftest.harness import Check, gen, kernel, leaf, timed

__all__ = ["policy_case", "policy_cases"]


def policy_case(dev, B, T, loss, dtype, per_token_adv=False, float_mask=False, beta=0.0, zeta=0.0,
                 normalizer=False, seed=0, kl="k3_ratio") -> tuple[str, Callable]:
    name = (f"B={B} T={T} {loss} {DT_NAME[dtype]} adv={'token' if per_token_adv else 'seq'} "
            f"mask={'float' if float_mask else 'bool'} beta={beta}" + (f" kl={kl}" if beta else "")
            + f" zeta={zeta}" + (" normalizer" if normalizer else ""))
    eps_low, eps_high, cap = 0.2, 0.28, 1.2

    def run(check: Check):
        from fasttrain.ops import reference as R
        g = gen(seed)
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
        lp_k, lp_r = leaf(logp, dev), leaf(logp, dev, torch.float64)

        def kern():
            out, stats = kernel("policy_loss")(lp_k, old.to(dev), adv.to(dev), mask.to(dev),
                                                ref_logp=ref.to(dev), **kw)
            out.backward()
            return out, stats

        def refr():
            out, stats = R.policy_loss(lp_r, old.to(dev, torch.float64), adv.to(dev, torch.float64), mask.to(dev),
                                       ref_logp=ref.to(dev, torch.float64), **kw)
            out.backward()
            return out, stats

        (ok_, sk), tk = timed(kern, dev)
        (orf, sr), tr = timed(refr, dev)
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
            check.close("d_logp", lp_k.grad, g64, (et + 4 * ua) * grad_mag / per_norm + rounding(g64, dtype), dtype)
            mags = {"ratio_mean": r64, "kl_mean": kl_mag, "repo_r_factor_mean": fac}
            for k in sk:
                x = mags.get(k)
                m = 1.0 + (float(torch.where(on, x.abs(), torch.zeros_like(x)).max()) if x is not None else 0.0)
                if k == "active_tokens":
                    m = max(m, float(w.sum()))
                check.close(k, sk[k], sr[k], sum_f * m, torch.float32)
        return tk, tr

    return name, run


def policy_cases(dev, quick: bool):
    if quick:
        return [policy_case(dev, 6, 37, "cispo", torch.float32, zeta=0.03, seed=1),
                policy_case(dev, 6, 37, "dapo", torch.bfloat16, per_token_adv=True, float_mask=True, beta=0.04, seed=2),
                policy_case(dev, 6, 37, "grpo", torch.float16, beta=0.04, zeta=0.02, normalizer=True, seed=3),
                policy_case(dev, 6, 37, "cispo", torch.float32, beta=0.04, seed=4, kl="k3")]
    out, i = [], 0
    for (B, T) in [(1, 1), (6, 37), (33, 1000)]:
        for loss in ("cispo", "dapo", "grpo"):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                i += 1
                out.append(policy_case(dev, B, T, loss, dt, per_token_adv=i % 2 == 0, float_mask=i % 3 == 0,
                                        beta=0.04 * (i % 2), zeta=0.03 * (i % 3 == 1), normalizer=i % 4 == 0,
                                        seed=100 + i, kl="k3" if i % 4 == 1 else "k3_ratio"))
    return out

