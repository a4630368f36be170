"""Run by tests/ops/test_cpu_variants.py in a fresh process under one ATEN_CPU_CAPABILITY: names the
CPU variant that runs and checks its kernels against float64 references, printing one JSON line
{"variant", "aten", "failures"}.

The bounds are the deterministic ones of fp32 arithmetic (u = 2^-24, a sum of n products off by at
most gamma_n = n·u / (1 - n·u) times the sum of their magnitudes), so they hold for any variant and
any BLAS the variant calls, and a kernel that decodes or sums wrongly is off by far more:
- nf4_dequantize: a table lookup times the block's absmax, one fp32 rounding: equal to the
  reference bit for bit;
- nf4_linear (LoRA, at M = 7, the tiled decode, and M = 80, decode + GEMM): |y - y64| <=
  gamma_{K+r+4} (|x|·|W|ᵀ + s·|x|·|A|ᵀ·|B|ᵀ);
- fused_logprob: z = h·Wᵀ/T off by e_v <= gamma_{H+1}·(|h|·|W_v|)/T + u·|z_v|; log p = z_t - lse(z)
  off by at most 2·max_v e_v plus the rounding of the exponentials, their sum and the log,
  (V + 8)·u·(1 + |lse|).
"""
from __future__ import annotations

import json

import torch

import fasttrain.ops as F
from fasttrain._native import build_info
from fasttrain.ops import reference as R

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def check_nf4(failures: list[str]) -> None:
    for numel in (1, 63, 64, 1001):
        w = torch.randn(numel)
        q, st = F.nf4_quantize(w)
        if not torch.equal(F.nf4_dequantize(q, st, torch.float32), R.nf4_dequantize(q, st, torch.float32)):
            failures.append(f"nf4_dequantize differs from the table at numel={numel}")


def check_nf4_linear(failures: list[str]) -> None:
    N, K, r, s = 96, 200, 8, 0.5
    w = torch.randn(N, K)
    q, st = F.nf4_quantize(w)
    w64 = R.nf4_decode_weight(q, st, torch.float64)
    a, b = torch.randn(r, K) / 10, torch.randn(N, r) / 10
    for M in (7, 80):
        x = torch.randn(M, K)
        x64 = x.double()
        ref = x64 @ w64.T + s * (x64 @ a.double().T) @ b.double().T
        mag = x64.abs() @ w64.abs().T + s * (x64.abs() @ a.double().abs().T) @ b.double().abs().T
        err = (F.nf4_linear(x, q, st, a, b, s).double() - ref).abs()
        bound = gamma(K + r + 4) * mag
        if not bool((err <= bound).all()):
            failures.append(f"nf4_linear M={M}: error {float((err - bound).max()):.3g} over the bound")


def check_fused_logprob(failures: list[str]) -> None:
    N, H, V, T = 37, 64, 1000, 0.7
    h, W = torch.randn(N, H), torch.randn(V, H) / 4
    t = torch.randint(0, V, (N,))
    h64, W64 = h.double(), W.double()
    z = h64 @ W64.T / T
    lse = torch.logsumexp(z, dim=1)
    ref = z.gather(1, t[:, None]).squeeze(1) - lse
    e = (gamma(H + 1) * (h64.abs() @ W64.abs().T) / T + U * z.abs()).max(dim=1).values
    bound = 2 * e + (V + 8) * U * (1 + lse.abs())
    logp, _ = F.fused_logprob(h, W, t, temperature=T)
    err = (logp.double() - ref).abs()
    if not bool((err <= bound).all()):
        failures.append(f"fused_logprob: error {float((err - bound).max()):.3g} over the bound")


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    failures: list[str] = []
    for check in (check_nf4, check_nf4_linear, check_fused_logprob):
        check(failures)
    print(json.dumps({"variant": build_info()["cpu_variant"], "aten": torch.backends.cpu.get_cpu_capability(),
                      "failures": failures}))


if __name__ == "__main__":
    main()
