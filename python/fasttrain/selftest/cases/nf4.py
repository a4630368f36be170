"""Selftest cases of nf4_quantize and nf4_dequantize: exact, bit for bit."""
from __future__ import annotations

from typing import Callable

import torch

from fasttrain.selftest.bounds import DT_NAME
from fasttrain.selftest.harness import Check, gen, kernel, timed

__all__ = ["nf4_case", "nf4_cases"]


def _nf4_special_values() -> torch.Tensor:
    from fasttrain.ops.reference import NF4_LEVELS
    lv = torch.tensor(NF4_LEVELS)
    mids = (lv[:-1] + lv[1:]) / 2
    return torch.cat([lv, mids, torch.nextafter(mids, torch.full_like(mids, 2.0)),
                      torch.nextafter(mids, torch.full_like(mids, -2.0))])


def nf4_case(dev, n, dtype, double_quant, blocksize=64, seed=0) -> tuple[str, Callable]:
    name = f"n={n} {DT_NAME[dtype]} blocksize={blocksize}{' double-quant' if double_quant else ''}"

    def run(check: Check):
        from fasttrain.ops import reference as R
        g = gen(seed)
        w = torch.randn(n, generator=g) * 0.05
        if n > 300:
            sv = _nf4_special_values()
            w[0] = 1.0                         # block 0's absmax is 1: its values are scaled exactly,
            w[1:1 + sv.numel()] = sv           # so the levels, midpoints and their neighbours test the tie rule
            w[128:192] = 0.0                   # an all-zero block
            w[200] = 40.0                      # an outlier
        w = w.to(dtype).to(dev)

        def kern():
            packed, st = kernel("nf4_quantize")(w, blocksize=blocksize, double_quant=double_quant)
            return packed, st, kernel("nf4_dequantize")(packed, st, torch.float32), \
                kernel("nf4_dequantize")(packed, st, dtype)

        def refr():
            packed, st = R.nf4_quantize(w, blocksize=blocksize, double_quant=double_quant)
            return packed, st, R.nf4_dequantize(packed, st, torch.float32), R.nf4_dequantize(packed, st, dtype)

        (pk, sk, dk32, dk), tk = timed(kern, dev)
        (pr, sr, dr32, dr), tr = timed(refr, dev)
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


def nf4_cases(dev, quick: bool):
    if quick:
        return [nf4_case(dev, 65, torch.float32, False, seed=1), nf4_case(dev, 4096 * 3 + 7, torch.bfloat16, True, seed=2)]
    out, i = [], 0
    for n in (1, 63, 64, 65, 4096 * 3 + 7, 64 * 257 + 13, 1 << 20):
        for dt in (torch.float32, torch.float16, torch.bfloat16):
            for dq in (False, True):
                i += 1
                out.append(nf4_case(dev, n, dt, dq, seed=200 + i))
    out.append(nf4_case(dev, 4096 + 3, torch.float32, False, blocksize=128, seed=300))
    return out

