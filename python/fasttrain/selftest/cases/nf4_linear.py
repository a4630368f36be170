"""Selftest cases of nf4_linear, the 16-bit dense_linear, nf4_dora_norm and nf4_weight_sq_norm;
the bounds are derived in fasttrain.selftest.bounds."""
from __future__ import annotations

from typing import Callable

import torch

from fasttrain.selftest.bounds import DT_NAME, U, rounding, u_acc
from fasttrain.selftest.harness import Check, gen, kernel, leaf, timed

__all__ = ["linear_case", "linear_cases", "dense_cases", "norm_case", "norm_cases"]


def _linear_data(dev, N, K, r, seed):
    from fasttrain.ops import reference as R
    g = gen(seed)
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


def linear_case(dev, N, K, r, M, dtype, adapter, seed=0, base="nf4") -> tuple[str, Callable]:
    """nf4_linear, or with base "dense" the 16-bit layer's dense_linear on a weight in `dtype`."""
    name = f"N={N} K={K} r={r} M={M} {DT_NAME[dtype]} {adapter}"
    s = 2.0

    def run(check: Check):
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
        xk, ak, bk, mk = leaf(x, dev), leaf(a, dev), leaf(b, dev), leaf(m, dev, torch.float32)
        xr, ar, br, mr = (leaf(t, dev, torch.float64) for t in (x, a, b, mk))

        def kern():
            if base == "dense":
                y = kernel("dense_linear")(xk, Wd, None, ak if lora else None, bk if lora else None, s,
                                            mk if dora else None)
                y.backward(dy)
                return y
            # as NF4Linear: the cached float32 ‖W‖², except for a float64 model (its exact sum)
            wsq = kernel("nf4_weight_sq_norm")(q, st) if dora and dtype != torch.float64 else None
            y = kernel("nf4_linear")(xk, q, st, ak if lora else None, bk if lora else None, s,
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

        yk, tk = timed(kern, dev)
        yr, tr = timed(refr, dev)
        ua = u_acc(dtype)
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
            check.close("y", yk, yr, gsc * (base_f * Y + eg * z.abs()) + rounding(yr, dtype), dtype)
            DZ = dy.double().abs() * gsc
            f = lambda L: 6 * uc + eg.max() + (L + 2) * ua  # noqa: E731
            check.close("dx", xk.grad, xr.grad, f(N + r) * (DZ @ Wa + s * (DZ @ Ba) @ Aa) + rounding(xr.grad, dtype), dtype)
            if lora:
                check.close("dA", ak.grad, ar.grad, f(M + N) * s * ((DZ @ Ba).T @ X) + rounding(ar.grad, torch.float32), torch.float32)
                check.close("dB", bk.grad, br.grad, f(M + K) * s * (DZ.T @ (X @ Aa.T)) + rounding(br.grad, torch.float32), torch.float32)
            if dora:
                dm_mag = (dy.double().abs() * Y).sum(0) / nrm
                check.close("dm", mk.grad, mr.grad, (f(M + K + r) + eg) * dm_mag + rounding(mr.grad, torch.float32), torch.float32)
        return tk, tr

    return name, run


def dense_cases(dev, quick: bool):
    if quick:
        return [linear_case(dev, 129, 96, 8, 1, torch.float32, "lora", seed=21, base="dense"),
                linear_case(dev, 129, 96, 8, 65, torch.bfloat16, "dora", seed=22, base="dense")]
    out, i = [], 0
    for (N, K, r) in [(37, 70, 5), (129, 96, 8), (1000, 584, 16)]:
        for M in (1, 65, 300):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                for adapter in ("base", "lora", "dora"):
                    i += 1
                    out.append(linear_case(dev, N, K, r, M, dt, adapter, seed=600 + i, base="dense"))
    out.append(linear_case(dev, 129, 96, 8, 65, torch.float64, "dora", seed=699, base="dense"))
    return out


def norm_case(dev, N, K, r, dtype, seed=0) -> tuple[str, Callable]:
    name = f"N={N} K={K} r={r} {DT_NAME[dtype]}"
    s = 1.7

    def run(check: Check):
        from fasttrain.ops import reference as R
        _, q, st, a, b = _linear_data(dev, N, K, r, seed)
        a, b = (a * 20).to(dtype), (b * 20).to(dtype)
        (nk, wk), tk = timed(lambda: (kernel("nf4_dora_norm")(q, st, a, b, s),
                                       kernel("nf4_weight_sq_norm")(q, st)), dev)
        (nr, wr), tr = timed(lambda: (R.nf4_dora_norm(q, st, a.double(), b.double(), s),
                                       R.nf4_decode_weight(q, st, torch.float64).square().sum(1)), dev)
        ua = u_acc(dtype)
        W = R.nf4_decode_weight(q, st, torch.float64)
        Q = ((W.abs() + s * b.double().abs() @ a.double().abs()) ** 2).sum(1)
        check.close("dora_norm", nk, nr, (2 * ua + (K + r + 6) * ua) * Q / (2 * nr), dtype)
        check.close("weight_sq_norm", wk, wr, (K + 2) * U[torch.float32] * wr + U[torch.float32] * wr, torch.float32)
        return tk, tr

    return name, run


def linear_cases(dev, quick: bool):
    if quick:
        return [linear_case(dev, 129, 96, 8, 1, torch.float32, "lora", seed=1),
                linear_case(dev, 129, 96, 8, 65, torch.bfloat16, "dora", seed=2),
                linear_case(dev, 37, 70, 5, 7, torch.float16, "base", seed=3)]
    out, i = [], 0
    for (N, K, r) in [(37, 70, 5), (129, 96, 8), (1000, 584, 16)]:
        for M in (1, 7, 64, 65, 300):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                for adapter in ("base", "lora", "dora"):
                    i += 1
                    out.append(linear_case(dev, N, K, r, M, dt, adapter, seed=400 + i))
    if dev.type == "cpu":
        out.append(linear_case(dev, 129, 96, 8, 65, torch.float64, "dora", seed=499))
    return out


def norm_cases(dev, quick: bool):
    if quick:
        return [norm_case(dev, 129, 96, 8, torch.float32, seed=1)]
    out = [norm_case(dev, N, K, r, torch.float32, seed=500 + i) for i, (N, K, r) in
           enumerate([(37, 70, 5), (129, 96, 8), (1000, 584, 16)])]
    out.append(norm_case(dev, 129, 96, 8, torch.float64, seed=510))
    return out

