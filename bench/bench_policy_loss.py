"""Benchmark: fasttrain.ops.policy_loss against the same recipe composed in eager PyTorch.

Forward + backward of the full recipe per token (REPO-R factor, ratio, CISPO or DAPO, k3 KL with
beta, mask, token-level mean, the stats a trainer logs), on the same inputs, timed side by side in
one process (both sides see the same machine load). Prints the median times and fused/eager ratio.
Floor: the fused op moves ~24 B/token forward (logp, old, ref, mask, adv in fp32 + coef out) and 8
backward; at the ~10 GB/s two shared cores stream, 1M tokens is ~3 ms.

  python bench/bench_policy_loss.py [--device cpu|cuda] [--threads N] [--repeats 20] [--csv bench/results/policy_loss.csv]
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import time

import torch

import fasttrain.ops as ops


def eager_policy_loss(logp, old_logp, adv, mask, *, loss, ref_logp, beta, eps_low=0.2, eps_high=0.28, cap=1.2,
                      zeta=0.0):
    """The recipe as a trainer writes it in eager PyTorch (one kernel per step)."""
    mask = mask.float()
    adv = adv[:, None].expand_as(logp) if adv.dim() == 1 else adv
    lp_d = logp.detach().clamp(min=-20.0)
    factor = torch.where(adv > 0, 1 - zeta * lp_d, 1 + zeta * lp_d).clamp(min=0.0)
    a = adv * factor
    ratio = torch.exp(logp - old_logp)
    if loss == "cispo":
        per_tok = -torch.clamp(ratio, max=cap).detach() * a * logp
    else:
        per_tok = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1
    per_tok = per_tok + beta * kl
    n = mask.sum()
    out = (per_tok * mask).sum() / n
    with torch.no_grad():
        r = ratio.detach()
        stats = {
            "ratio_mean": (r * mask).sum() / n,
            "clip_low_frac": (((r < 1 - eps_low) & (a < 0)).float() * mask).sum() / n,
            "clip_high_frac": (((r > 1 + eps_high) & (a > 0)).float() * mask).sum() / n,
            "cap_frac": ((r > cap).float() * mask).sum() / n,
            "kl_mean": (kl.detach() * mask).sum() / n,
            "repo_r_factor_mean": (factor * mask).sum() / n,
        }
    return out, stats


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_inputs(B, T, device):
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(B, T, generator=g) * 5).to(device)
    old = (logp.cpu() + (torch.rand(B, T, generator=g) - 0.5) * 0.6).to(device)
    ref = (logp.cpu() + (torch.rand(B, T, generator=g) - 0.5) * 0.6).to(device)
    adv = torch.randn(B, generator=g).to(device)
    mask = (torch.rand(B, T, generator=g) < 0.9).to(device)
    return logp, old, adv, mask, ref


def time_fwd_bwd(fn, logp, repeats, device):
    times = []
    for _ in range(repeats):
        lp = logp.detach().requires_grad_()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, stats = fn(lp)
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--csv", default="bench/results/policy_loss.csv")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for both sides (0: torch's default). On a loaded machine eager's many small "
                        "multi-threaded ops stall at OpenMP barriers; 1 thread is the fairer comparison there")
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dev = args.device
    name = (torch.cuda.get_device_name() if dev == "cuda"
            else f"{cpu_name()}, {torch.get_num_threads()} threads (shared machine)")
    print(f"policy_loss fwd+bwd, fused vs eager, device: {name}, torch {torch.__version__}")
    print(f"{'loss':6} {'tokens':>10} {'B x T':>12} {'eager ms':>9} {'fused ms':>9} {'ratio':>6}")
    rows = []
    for B, T in ((48, 320), (1000, 1000)):
        logp, old, adv, mask, ref = make_inputs(B, T, dev)
        for loss in ("cispo", "dapo"):
            kw = dict(loss=loss, ref_logp=ref, beta=0.04, zeta=0.01)
            fused = lambda lp: ops.policy_loss(lp, old, adv, mask, **kw)  # noqa: E731
            eager = lambda lp: eager_policy_loss(lp, old, adv, mask, **kw)  # noqa: E731
            # Same answer first (a benchmark of a wrong op is worthless).
            lf, le = fused(logp)[0], eager(logp)[0]
            assert torch.allclose(lf, le, rtol=1e-4, atol=1e-6), (lf, le)
            for f in (fused, eager):  # warm-up
                time_fwd_bwd(f, logp, 3, dev)
            te, tf = [], []
            for _ in range(3):  # interleave the two sides
                te.append(time_fwd_bwd(eager, logp, args.repeats, dev))
                tf.append(time_fwd_bwd(fused, logp, args.repeats, dev))
            te, tf = min(te), min(tf)
            print(f"{loss:6} {B * T:>10,} {f'{B} x {T}':>12} {te * 1e3:9.3f} {tf * 1e3:9.3f} {tf / te:6.3f}")
            rows.append(dict(op="policy_loss", loss=loss, tokens=B * T, B=B, T=T, device=name,
                             torch=torch.__version__, eager_ms=te * 1e3, fused_ms=tf * 1e3, ratio=tf / te))
    if args.csv:
        os.makedirs(os.path.dirname(args.csv), exist_ok=True)
        new = not os.path.exists(args.csv)
        with open(args.csv, "a", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            if new:
                w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
