"""Benchmark: fasttrain.ops.nf4_linear (+LoRA / +DoRA) against bitsandbytes Linear4bit + PEFT on the
same NF4 weights, and against the plain fp32 matrix products of the same shapes. Ratios are measured
side by side in one run (interleaved repetitions, median), so both sides see the same contention.

    python bench/bench_nf4_linear.py [--quick] [--csv bench/results/nf4_linear_cpu.csv]

Targets (CPU): training shapes (M >= 256) fwd+bwd <= 1.1x the plain fp32 products and no
slower than bnb+PEFT; decode shapes (M <= 16) forward <= 0.6x bnb+PEFT; DoRA <= 0.8x PEFT DoRA at
training shapes and <= 0.5x at decode shapes. On a GPU (not run yet): the decode kernel's GB/s
against the card's (floor for 5120x27648 at batch 48: 76 MB -> 23 us on an H100, 16 us on an H200).
"""
from __future__ import annotations

import argparse
import csv
import platform
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import fasttrain.ops as F  # noqa: E402


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def side_by_side(fns: dict, reps: int, warmup: int = 1) -> dict[str, float]:
    for f in fns.values():
        for _ in range(warmup):
            f()
    samples = {k: [] for k in fns}
    for _ in range(reps):  # interleave: each round runs every contender once
        for k, f in fns.items():
            samples[k] += timed(f, 1)
    return {k: statistics.median(v) for k, v in samples.items()}


class OneLinear(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.proj = layer

    def forward(self, x):
        return self.proj(x)


def bnb_peft(w: torch.Tensor, r: int, alpha: float, dora: bool):
    import bitsandbytes as bnb
    import peft
    n, k = w.shape
    lin = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", blocksize=64)._quantize("cpu")
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=["proj"], use_dora=dora, lora_dropout=0.0)
    model = peft.get_peft_model(OneLinear(lin), cfg)
    with torch.no_grad():
        model.base_model.model.proj.lora_B["default"].weight.normal_(0, 0.01)
    return model


def run(shapes, ms, r, alpha, reps, rows, kinds=("lora", "dora")):
    for (n, k) in shapes:
        w = torch.randn(n, k) * 0.02
        q, st = F.nf4_quantize(w)
        wd = F.nf4_dequantize(q, st, torch.float32)
        for kind in kinds:
            dora = kind == "dora"
            ref = bnb_peft(w, r, alpha, dora)
            a = torch.randn(r, k) / k**0.5
            b = torch.randn(n, r) * 0.01
            m = wd.norm(dim=1)
            a.requires_grad_(True), b.requires_grad_(True), m.requires_grad_(dora)
            ref_params = [p for p in ref.parameters() if p.requires_grad]
            for M in ms:
                train = M >= 256
                x = torch.randn(M, k)
                dy = torch.randn(M, n)
                s = alpha / r
                if train:
                    xg = x.clone().requires_grad_(True)

                    def ours():
                        y = F.nf4_linear(xg, q, st, a, b, s, m if dora else None)
                        torch.autograd.grad(y, [xg, a, b] + ([m] if dora else []), dy)

                    def theirs():
                        y = ref(xg)
                        torch.autograd.grad(y, [xg] + ref_params, dy)

                    ad, bd = a.detach(), b.detach()

                    def plain():  # every product of the same shapes, plain fp32 (base and LoRA, fwd + bwd)
                        xa = x @ ad.T
                        (x @ wd.T).addmm_(xa, bd.T)
                        dzb = dy @ bd
                        (dy @ wd).addmm_(dzb, ad)
                        dzb.T @ x
                        dy.T @ xa

                    t = side_by_side({"ours": ours, "bnb_peft": theirs, "fp32_matmul": plain}, reps)
                else:
                    def ours():
                        with torch.no_grad():
                            F.nf4_linear(x, q, st, a, b, s, m if dora else None)

                    def theirs():
                        with torch.no_grad():
                            ref(x)

                    ad, bd = a.detach(), b.detach()

                    def plain():
                        (x @ wd.T).addmm_(x @ ad.T, bd.T)

                    t = side_by_side({"ours": ours, "bnb_peft": theirs, "fp32_matmul": plain}, reps)
                row = dict(kind=kind, shape=f"{n}x{k}", M=M, mode="fwd+bwd" if train else "fwd",
                           ours_ms=1e3 * t["ours"], bnb_peft_ms=1e3 * t["bnb_peft"], fp32_ms=1e3 * t["fp32_matmul"],
                           vs_bnb_peft=t["ours"] / t["bnb_peft"], vs_fp32=t["ours"] / t["fp32_matmul"])
                rows.append(row)
                print(f"{kind:4s} W {n}x{k} M={M:4d} {row['mode']:7s} ours {row['ours_ms']:8.2f} ms | "
                      f"bnb+PEFT {row['bnb_peft_ms']:8.2f} ms ({row['vs_bnb_peft']:.2f}x) | "
                      f"fp32 matmul {row['fp32_ms']:8.2f} ms ({row['vs_fp32']:.2f}x)", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one shape, fewer repetitions")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared, overloaded 2-core box OpenMP spin-waits make "
                         "2-thread timings swing 50x; both sides always use the same count)")
    ap.add_argument("--csv", default="bench/results/nf4_linear_cpu.csv")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; shared machine, ratios measured side by side")
    shapes = [(1536, 576)] if args.quick else [(1536, 576), (4096, 1024)]
    ms = [1, 16, 48, 512] if args.quick else [1, 16, 48, 256, 512]
    rows: list[dict] = []
    run(shapes, ms, r=32, alpha=64, reps=args.reps, rows=rows)
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(rows[0]))
        wr.writeheader()
        wr.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
