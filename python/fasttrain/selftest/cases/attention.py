"""Selftest cases of decode_attention (one decode step over a strided cache) and of the update's
masked_attention gradients (within fasttrain.selftest.bounds.attention_grad_bounds)."""
from __future__ import annotations

import torch

from fasttrain.selftest.bounds import DT_NAME, attention_grad_bounds, rounding, u_acc
from fasttrain.selftest.harness import Check, kernel, timed

__all__ = ["decode_attention_case", "decode_attention_cases", "attention_case", "attention_cases"]


def decode_attention_case(dev, B, H, G, D, S, dtype, seed) -> tuple:
    """One decode step's attention over a strided cache view with invalid keys, against the float64
    definition: each score off by D·u·Σ|q||k|·scale, moving the weights by 2·max δs; the output by
    (2·max δs + (S + 8)·u)·max|v|, then its rounding (tests/ops/test_decode_attention.py derives it)."""
    from fasttrain.ops.decode_attention import decode_attention_backend
    name = f"B={B} kv={H} G={G} D={D} S={S} {DT_NAME[dtype]}"

    def run(check: Check):
        from fasttrain.ops import reference as R
        g = torch.Generator().manual_seed(seed)
        q = (torch.randn(B, H, G, D, generator=g) * 2).to(dev, dtype)
        cache = (torch.randn(2, B, H, S + 5, D, generator=g) * 2).to(dev, dtype)
        k, v = cache[0][:, :, :S], cache[1][:, :, :S]
        valid = (torch.rand(B, S, generator=g) > 0.3).to(dev)
        valid[:, -1] = True
        with torch.no_grad():
            o, tk = timed(lambda: kernel("decode_attention")(q, k, v, valid, 0.125), dev)
        ref, tr = timed(lambda: R.decode_attention(q.double(), k.double(), v.double(), valid, 0.125), dev)
        ua = u_acc(dtype)
        q64, k64 = q.double(), k.double()
        ds = D * ua * (q64.abs() @ k64.abs().transpose(-1, -2)).amax(-1, keepdim=True) * 0.125
        vmax = v.double().abs().amax(dim=(2, 3))[:, :, None, None]
        check.close("o", o, ref, (2 * ds + (S + 8) * ua) * vmax + rounding(ref, dtype), dtype)
        return tk, tr

    return name, run, f"decode_attention:{decode_attention_backend(dev, grad=False)}"


def decode_attention_cases(dev, quick: bool):
    shapes = [(5, 3, 3, 64, 37), (2, 2, 5, 40, 23)] if quick else \
        [(5, 3, 3, 64, 37), (2, 2, 1, 128, 300), (3, 1, 8, 32, 19), (2, 2, 5, 40, 23), (48, 3, 3, 64, 310)]
    dts = (torch.float32, torch.bfloat16) if quick else (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    return [decode_attention_case(dev, *sh, dt, seed=800 + i) for i, (sh, dt) in
            enumerate((sh, dt) for sh in shapes for dt in dts)]


def attention_case(dev, n, h, M, L, D, dtype, seed) -> tuple:
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

    def run(check: Check):
        g = torch.Generator().manual_seed(seed)
        q, k, v = ((torch.randn(n, h, r, D, generator=g)).to(dev, dtype).requires_grad_() for r in (M, L, L))
        do = torch.randn(n, h, M, D, generator=g).to(dev, dtype)
        mask = torch.rand(n, 1, M, L, generator=g) < 0.6
        mask[..., 0] = True
        mask = mask.to(dev)
        scale = D ** -0.5
        prev = set_attention_backward("fasttrain")
        try:
            grads, tk = timed(lambda: torch.autograd.grad(kernel("masked_attention")(q, k, v, mask, scale),
                                                           (q, k, v), do), dev)
        finally:
            set_attention_backward(prev)
        refs, tr = timed(lambda: attention_grad_bounds(q, k, v, do, mask, scale), dev)
        for nm, got, (ref, bound) in zip(("dq", "dk", "dv"), grads, refs):
            check.close(nm, got, ref, bound, dtype)
        return tk, tr

    return name, run, impl


def attention_cases(dev, quick: bool):
    if dev.type != "cpu":                  # a CPU op: on a GPU masked_attention is torch's SDPA throughout
        return []
    shapes = [(3, 2, 19, 45, 16), (2, 3, 63, 100, 64)] if quick else \
        [(3, 2, 19, 45, 16), (2, 3, 63, 100, 64), (12, 3, 189, 360, 64), (1, 3, 891, 297, 64), (2, 4, 63, 360, 128)]
    dts = (torch.bfloat16, torch.float32)
    return [attention_case(dev, *sh, dt, seed=950 + i) for i, (sh, dt) in
            enumerate((sh, dt) for sh in shapes for dt in dts)]

