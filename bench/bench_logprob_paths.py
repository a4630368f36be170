"""The fused log-prob head's CPU paths side by side at the learning benchmark's sizes: bf16 h and W,
SmolLM2's head (H = 576, V = 49152), inside the pack scope as the trainer calls it.

    PYTHONPATH=python python bench/bench_logprob_paths.py [--threads 2] [--repeats 7] [--out bench/results]

Paths (FASTTRAIN_LOGPROB_BF16DOT / FASTTRAIN_LOGPROB_BRGEMM, read by the kernel on every call):
  dot       both products on the avx512_bf16 dot-product instruction (csrc/cpu/bf16_dot.h), where
            fasttrain.ops.bf16_dot_available()
  widened   float32 GEMMs of widened W chunks (the path every CPU without bf16 products takes)
For each token count: the forward without gradient (the reference log-probs) and with the hidden
gradient vector (the update), the median of --repeats calls after one warm-up call that packs W,
the paths interleaved call by call so both see the same load. Also printed: the pack itself (one
call outside the scope minus one inside). The machine's load before the start is printed; numbers
from a busy machine are not speeds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

PATHS = {"dot": {"FASTTRAIN_LOGPROB_BF16DOT": "1"}, "widened": {"FASTTRAIN_LOGPROB_BF16DOT": "0",
                                                              "FASTTRAIN_LOGPROB_BRGEMM": "0"}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tokens", default="80,160,320,640")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args()
    import fasttrain.ops as fo
    from bench_learning import machine_busy
    from harness import machine_name
    torch.set_num_threads(a.threads)
    if not fo.bf16_dot_available():
        print("this CPU has no bf16 dot-product path (fasttrain.ops.bf16_dot_available() is False): nothing to compare")
        return 0
    busy = machine_busy()
    H, V, T = 576, 49152, 0.7
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(V, H, generator=g) * 0.02).bfloat16()
    rows = []
    for n in [int(x) for x in a.tokens.split(",")]:
        h0 = torch.randn(n, H, generator=g).bfloat16()
        t = torch.randint(0, V, (n,), generator=g)
        for grad in (False, True):
            times = {p: [] for p in PATHS}

            def call(path):
                os.environ.update(PATHS[path])
                h = h0.clone().requires_grad_(grad)
                with torch.set_grad_enabled(grad):
                    t0 = time.perf_counter()
                    fo.fused_logprob(h, W, t, T)
                    return time.perf_counter() - t0

            unscoped = {p: call(p) for p in PATHS}
            with fo.logprob_pack_cache():
                for p in PATHS:
                    call(p)                                          # warm-up: packs W
                for _ in range(a.repeats):
                    for p in PATHS:
                        times[p].append(call(p))
            med = {p: statistics.median(v) * 1e3 for p, v in times.items()}
            rows.append((n, grad, med["dot"], med["widened"], med["dot"] / med["widened"],
                         unscoped["dot"] * 1e3 - med["dot"]))
    for k in ("FASTTRAIN_LOGPROB_BF16DOT", "FASTTRAIN_LOGPROB_BRGEMM"):
        os.environ.pop(k, None)
    day = time.strftime("%Y-%m-%d")
    lines = [f"# The fused log-prob head's CPU paths ({machine_name()}, {day})", "",
             f"`python bench/bench_logprob_paths.py --threads {a.threads} --repeats {a.repeats}`; torch "
             f"{torch.__version__}, {a.threads} thread(s); bf16 h [N, 576] and W [49152, 576] (SmolLM2's head), "
             f"temperature {T}, inside `logprob_pack_cache()`; median of {a.repeats} calls, paths interleaved.",
             "", f"**Busy machine: {busy}; not a speed.**" if busy else "The machine was quiet at the start.", "",
             "| tokens | hidden gradient | dot-product path, ms | widened float32, ms | ratio | pack (one call unscoped minus scoped), ms |",
             "|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {n} | {'yes' if gr else 'no'} | {d:.1f} | {w:.1f} | {r:.2f}x | {pk:.0f} |" for n, gr, d, w, r, pk in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{machine_name()}-{day}-logprob-paths.md"
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
