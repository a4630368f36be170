"""Selftest cases of the decode step's fused elementwise ops: rms_norm, silu_mul and
rotary_cache_write_."""
from __future__ import annotations

import torch

from fasttrain.selftest.bounds import DT_NAME, U
from fasttrain.selftest.harness import Check, kernel, timed

__all__ = ["decode_fused_case", "decode_fused_cases"]


def decode_fused_case(dev, kind: str, N: int, H: int, dtype, seed) -> tuple:
    """A decode step's fused elementwise op against its definition: the rotary embedding + cache
    write bit for bit against its correctly rounded steps in the dtype (fasttrain.ops.reference);
    RMSNorm and SwiGLU against float64 within ((1 + u_d)^2 (1 + c·u) - 1)·|ref| (+ half a subnormal
    step per rounding), c = H + 5 for the norm's sum and 4 for SiLU's exp (tests/ops/test_decode_fused.py
    derives both)."""
    from fasttrain.ops.decode_fused import decode_fused_backend
    name = f"{kind} N={N} H={H} {DT_NAME[dtype]}"
    eta = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps / 2

    def run(check: Check):
        from fasttrain.ops import reference as R
        g = torch.Generator().manual_seed(seed)
        ud, u = U[dtype], U[torch.float32]
        with torch.no_grad():
            if kind == "rms_norm":
                x = (torch.randn(N, H, generator=g) * 3).to(dev, dtype)
                w = (torch.rand(H, generator=g) + 0.5).to(dev, dtype)
                y, tk = timed(lambda: kernel("rms_norm")(x, w, 1e-5), dev)
                x64 = x.double()
                ref, tr = timed(lambda: w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5), dev)
                check.close("y", y, ref, ((1 + ud) ** 2 * (1 + (H + 5) * u) - 1) * ref.abs()
                            + eta * (w.double().abs() + 1), dtype)
            elif kind == "silu_mul":
                gu = (torch.randn(N, 2 * H, generator=g) * 3).to(dev, dtype)
                a, tk = timed(lambda: kernel("silu_mul")(gu), dev)
                g64, u64 = gu.double()[:, :H], gu.double()[:, H:]
                ref, tr = timed(lambda: g64 / (1 + torch.exp(-g64)) * u64, dev)
                check.close("a", a, ref, ((1 + ud) ** 2 * (1 + 4 * u) - 1) * ref.abs() + eta * (u64.abs() + 1), dtype)
            else:                                   # rotary_cache_write_: H is the head width, 6 heads over 2 KV heads
                qkv = torch.randn(N, 10 * H, generator=g).to(dev, dtype)
                cos, sin = (torch.rand(2, N, H, generator=g) * 2 - 1).to(dev, dtype)
                cache = torch.randn(2, 2, N, 2, 7, H, generator=g).to(dev, dtype)
                mine, theirs = cache.clone(), cache.clone()
                q, tk = timed(lambda: kernel("rotary_cache_write_")(qkv, cos, sin, mine[1][0], mine[1][1], 3, 6), dev)
                want, tr = timed(lambda: R.rotary_cache_write_(qkv, cos, sin, theirs[1][0], theirs[1][1], 3, 6), dev)
                check.exact("q", q, want)
                check.exact("cache", mine, theirs)
        return tk, tr

    return name, run, f"decode_fused:{decode_fused_backend(dev, dtype)}"


def decode_fused_cases(dev, quick: bool):
    dts = (torch.float32, torch.bfloat16) if quick else (torch.float32, torch.bfloat16, torch.float16)
    shapes = {"rms_norm": [(48, 576), (3, 37)], "silu_mul": [(48, 1536), (2, 9)], "rotary_cache_write_": [(48, 64), (3, 6)]}
    return [decode_fused_case(dev, kind, N, H, dt, seed=900 + i) for i, (kind, N, H, dt) in
            enumerate((k, N, H, dt) for k, shs in shapes.items() for N, H in shs for dt in dts)]

