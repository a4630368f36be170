"""Selftest cases of fused_logprob (forward and backward, vocabulary chunks, kept sets); the bound
is derived in fasttrain.selftest.bounds."""
from __future__ import annotations

import math
from typing import Callable

import torch

from fasttrain.selftest.bounds import DT_NAME, U, rounding, u_acc
from fasttrain.selftest.harness import Check, gen, kernel, leaf, timed

__all__ = ["logprob_case", "logprob_cases"]


def logprob_case(dev, N, H, V, dtype, T=0.9, bias=True, chunk=4096, small_grad=False, seed=0,
                  kept=False) -> tuple[str, Callable]:
    name = f"N={N} H={H} V={V} {DT_NAME[dtype]} T={T}{' bias' if bias else ''} chunk={chunk or 'default'}" + \
           (" g~1/N" if small_grad else "") + (" kept set" if kept else "")

    def run(check: Check):
        from fasttrain.ops import logprob as lp_mod
        from fasttrain.ops import reference as R
        g = gen(seed)
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
        leaves_k = [leaf(x, dev) for x in (h, w, b)]
        leaves_r = [leaf(x, dev, torch.float64) for x in (h, w, b)]
        td = t.to(dev)

        def kern():
            prev = lp_mod.chunk_bytes()
            lp_mod.set_chunk_bytes(chunk)
            try:
                hk, wk, bk = leaves_k
                logp, ent = kernel("fused_logprob")(hk, wk, td, T, bias=bk, keep_delta=delta)
                (logp * up.to(dev, logp.dtype)).sum().backward()
                return logp, ent
            finally:
                lp_mod.set_chunk_bytes(prev)

        def ref():
            hr, wr, br = leaves_r
            logp, ent = R.fused_logprob(hr, wr, td, T, bias=br, keep_delta=delta)
            (logp * up.to(dev)).sum().backward()
            return logp, ent

        (lk, ek), tk = timed(kern, dev)
        (lr, er), tr = timed(ref, dev)
        ud, ua = U[dtype], u_acc(dtype)
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
            dh_tol = (eps + gV) * dh_mag + rounding(leaves_r[0].grad, dtype)
            coef = g_abs[:, None] * (P + onehot) / T          # [N, V]
            dw_tol = (eps + ud + (N + 2) * ua) * (coef.T @ hr.abs()) + rounding(leaves_r[1].grad, dtype)
        check.close("logp", lk, lr, logp_tol, acc)
        check.close("entropy", ek, er, ent_tol, acc)
        check.close("d_hidden", leaves_k[0].grad, leaves_r[0].grad, dh_tol, dtype)
        check.close("d_weight", leaves_k[1].grad, leaves_r[1].grad, dw_tol, dtype)
        if bias:
            db_tol = (eps + ud + (N + 2) * ua) * coef.sum(0) + rounding(leaves_r[2].grad, dtype)
            check.close("d_bias", leaves_k[2].grad, leaves_r[2].grad, db_tol, dtype)
        return tk, tr

    return name, run


def logprob_cases(dev, quick: bool):
    small = 4096 if dev.type == "cpu" else 65536
    if quick:
        return [logprob_case(dev, 37, 19, 53, torch.float32, chunk=small, seed=1),
                logprob_case(dev, 130, 65, 1001, torch.bfloat16, T=1.0, chunk=small, seed=2),
                logprob_case(dev, 64, 32, 777, torch.float16, bias=False, chunk=small, small_grad=True, seed=3),
                logprob_case(dev, 130, 65, 1001, torch.float32, chunk=small, seed=4, kept=True)]
    out = []
    shapes = [(1, 7, 5), (37, 19, 53), (130, 65, 1001), (300, 96, 5003)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    i = 0
    for (N, H, V) in shapes:
        for dt in dtypes:
            i += 1
            out.append(logprob_case(dev, N, H, V, dt, T=(0.9, 1.0, 0.7)[i % 3], bias=i % 2 == 0, chunk=small,
                                     small_grad=dt == torch.float16, seed=10 + i))
    out.append(logprob_case(dev, 300, 96, 5003, torch.bfloat16, chunk=0, seed=40))
    out.append(logprob_case(dev, 37, 19, 53, torch.float64, chunk=small, seed=41))   # both backends take fp64
    out.append(logprob_case(dev, 130, 65, 1001, torch.float64, chunk=small, seed=42))
    out.append(logprob_case(dev, 130, 65, 1001, torch.float32, chunk=small, seed=43, kept=True))   # top_k/top_p replay
    out.append(logprob_case(dev, 37, 19, 53, torch.float64, chunk=small, seed=44, kept=True))
    return out

