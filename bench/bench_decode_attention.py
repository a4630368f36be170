"""Benchmark: one decode step's attention, fasttrain.ops.decode_attention (the CPU kernel) against
torch's scaled_dot_product_attention on the same inputs (grouped-query heads expanded the way the
decoder would hand them to SDPA: q [B, kv, G, D] against [B, kv, S, D]), side by side in one
process, interleaved repetitions, medians.

Shape (default): SmolLM2-135M's rollout at the study's batch, 48 rows, 3 KV heads of 64 with 3
query heads each, 300 keys valid per row, bf16, over `--layers` distinct caches (each read once per
pass, as a decode step reads its 30 layers' caches: cold in cache) and one cache again and again
(warm). The cache's bytes a layer (2 x B x kv x S x D x 2 B) are printed: at bench_step's read
probe (26-30 GB/s on the 2-core Xeon) they are the kernel's floor.

    python bench/bench_decode_attention.py [--threads 2] [--reps 15] [--csv PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fasttrain.ops import decode_attention  # noqa: E402
from harness import machine_name  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--rows", type=int, default=48)
    ap.add_argument("--kv", type=int, default=3)
    ap.add_argument("--group", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    B, H, G, D, S = a.rows, a.kv, a.group, a.head_dim, a.keys
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, B, H, S + 100, D, generator=gen).bfloat16() for _ in range(a.layers)]
    qs = [torch.randn(B, H, G, D, generator=gen).bfloat16() for _ in range(a.layers)]
    valid = torch.ones(B, S, dtype=torch.bool)
    scale = D ** -0.5

    def ours(c, q):
        return decode_attention(q, c[0][:, :, :S], c[1][:, :, :S], valid, scale)

    mask = valid[:, None, None, :]                       # [B, 1, 1, S]

    def sdpa(c, q):
        return torch.nn.functional.scaled_dot_product_attention(q, c[0][:, :, :S], c[1][:, :, :S],
                                                                attn_mask=mask, scale=scale)

    with torch.inference_mode():
        err = (ours(caches[0], qs[0]).float() - sdpa(caches[0], qs[0]).float()).abs().max().item()
        times = {(n, k): [] for n in ("fasttrain", "sdpa") for k in ("cold", "warm")}
        for _ in range(2):
            for f in (ours, sdpa):
                for c, q in zip(caches, qs):
                    f(c, q)
        for _ in range(a.reps):
            for name, f in (("fasttrain", ours), ("sdpa", sdpa)):
                t = time.perf_counter()
                for c, q in zip(caches, qs):
                    f(c, q)
                times[(name, "cold")].append((time.perf_counter() - t) / a.layers)
                t = time.perf_counter()
                for _ in range(a.layers):
                    f(caches[0], qs[0])
                times[(name, "warm")].append((time.perf_counter() - t) / a.layers)
    kv_bytes = 2 * B * H * S * D * 2
    print(f"decode attention, {machine_name()}, {a.threads} threads: {B} rows, {H} KV heads x {G} query heads "
          f"of {D}, {S} keys, bf16; {a.layers} distinct caches (cold) or one (warm); medians of {a.reps}")
    print(f"  the cache's bytes: {kv_bytes / 1e6:.1f} MB a layer; max |fasttrain - sdpa| = {err:.3g}")
    rows = []
    for k in ("cold", "warm"):
        ft, sd = (statistics.median(times[(n, k)]) * 1e3 for n in ("fasttrain", "sdpa"))
        print(f"  {k}: fasttrain {ft:.3f} ms a layer, sdpa {sd:.3f} ms, ratio {ft / sd:.2f}x")
        rows += [(k, "fasttrain", ft), (k, "sdpa", sd)]
    if a.csv:
        import os
        new = not os.path.exists(a.csv)
        with open(a.csv, "a") as fh:
            if new:
                fh.write("date,machine,bench,case,impl,metric,value,unit,threads\n")
            for k, impl, v in rows:
                fh.write(f"{time.strftime('%Y-%m-%d')},{machine_name()},decode_attention,"
                         f"{B}x{H}x{G}x{D}x{S}-{k},{impl},ms_per_layer,{v},ms,{a.threads}\n")


if __name__ == "__main__":
    main()
