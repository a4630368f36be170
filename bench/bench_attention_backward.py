"""Benchmark: the update's masked attention, forward + backward, fasttrain.ops.masked_attention's
CPU backward (batched GEMMs around csrc/cpu/attention_backward.cpp's softmax step) against torch's
scaled_dot_product_attention with its own (ATen's flash-attention) backward, on the same inputs,
side by side in one process, interleaved repetitions, medians.

Shapes (bf16, SmolLM2-135M's heads: 3 KV heads of 64 with 3 query heads each, folded into the
query rows as fasttrain.train.prefix_forward folds them):
  answers  the study's micro-batch: 12 rows, 63 answer queries each over a 297-token prompt and
           their own answers (360 keys), causal over the answers;
  prompt   one 297-token prompt over itself, causal.

    python bench/bench_attention_backward.py [--threads 2] [--reps 15] [--csv PATH]
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
import fasttrain.ops as ops  # noqa: E402
from harness import machine_name  # noqa: E402


def shapes(kv: int, G: int, D: int, P: int, A: int, rows: int):
    causal = torch.ones(A, A, dtype=torch.bool).tril_()
    answers = torch.cat([torch.ones(A, P, dtype=torch.bool), causal], 1).repeat(G, 1)   # [G·A, P+A]
    prompt = torch.ones(P, P, dtype=torch.bool).tril_().repeat(G, 1)                    # [G·P, P]
    return {"answers": (rows, G * A, P + A, answers[None, None].expand(rows, 1, G * A, P + A)),
            "prompt": (1, G * P, P, prompt[None, None])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--csv", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kv, G, D = 3, 3, 64
    gen = torch.Generator().manual_seed(0)
    rows_out = []
    print(f"bench_attention_backward: {machine_name()}, {torch.get_num_threads()} threads, bf16, "
          f"{kv} KV heads x {G} query heads of {D}; medians of {a.reps} interleaved reps")
    for name, (n, M, L, mask) in shapes(kv, G, D, 297, 63, 12).items():
        q = torch.randn(n, kv, M, D, generator=gen).bfloat16().requires_grad_()
        k = torch.randn(n, kv, L, D, generator=gen).bfloat16().requires_grad_()
        v = torch.randn(n, kv, L, D, generator=gen).bfloat16().requires_grad_()
        do = torch.randn(n, kv, M, D, generator=gen).bfloat16()

        def run(kind):
            old = ops.set_attention_backward(kind)
            try:
                t0 = time.perf_counter()
                ops.masked_attention(q, k, v, mask, D ** -0.5).backward(do)
                return time.perf_counter() - t0
            finally:
                ops.set_attention_backward(old)
                q.grad = k.grad = v.grad = None

        for kind in ("auto", "flash"):
            run(kind)
        times = {"auto": [], "flash": []}
        for _ in range(a.reps):
            for kind in ("auto", "flash"):
                times[kind].append(run(kind))
        ours, flash = (statistics.median(times[k]) * 1e3 for k in ("auto", "flash"))
        flops = 4 * n * kv * M * L * D * 3.5        # forward 2 GEMMs (mask not discounted), backward 5
        print(f"  {name:8s} q [{n}, {kv}, {M}, {D}] over {L} keys: fasttrain {ours:7.2f} ms, torch SDPA "
              f"{flash:7.2f} ms, ratio {ours / flash:.2f}x ({flops / ours / 1e6:.0f} vs {flops / flash / 1e6:.0f} "
              f"GFLOP/s forward + backward)")
        rows_out.append((name, n, M, L, ours, flash))
    if a.csv:
        with open(a.csv, "a") as f:
            for name, n, M, L, ours, flash in rows_out:
                f.write(f"{machine_name()},{name},{n},{M},{L},{ours:.3f},{flash:.3f}\n")


if __name__ == "__main__":
    main()
