"""Rollout waves and prefill chunks: decode ms/step and rollout seconds at the study's shape, one
batch against waves, and the plan's time for the same shapes beside each measurement.

What it compares, in one run on one machine: fasttrain.rollout.sample over n prompts x G answers
decoded as one batch (what the study runs: the plan picks one wave when it fits) against the same
prompts in waves of w prompts (fasttrain.train.answers.join_rollouts of w-prompt rollouts) and with
the prefill in chunks of c prompts. The decode step of a one-wave rollout is the same code as
before waves existed (the chunked prefill runs before the first step), so its ms/step is the
"no worse than today" check; waves are expected to cost about W times the weight reads of a decode
step where decode is bandwidth-bound (the plan's decode floor), and less where it is
compute-bound. Every row prints the plan's seconds for the same shape (fasttrain.plan.speed with
this host's measured rates when cached) and the measured / planned ratio: the time accuracy the
issue asks for at 1K, 2K and 4K new tokens (--new 1024,2048,4096) lives here, never in tests.

Models: the bundled SmolLM2-135M (--model smollm2) or the benchmark hybrid (--model hybrid,
fasttrain.models.bench_model: the 27B's layer layout at hidden 512). Answers never stop early
(no EOS), so every shape decodes exactly n·G·T tokens, the plan's worst case.

Run: python bench/bench_waves.py [--model smollm2|hybrid] [--prompts 4] [--group 12]
     [--new 128,1024] [--waves 1,2,4] [--chunks 0,1] [--reps 2] [--csv out.csv]
Unrun in the session that wrote it (a shared, busy machine): no number is claimed from it.
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

from harness import machine_name, row, write_csv  # noqa: E402

from fasttrain.rollout import sample  # noqa: E402
from fasttrain.train.answers import join_rollouts  # noqa: E402


def _model(name: str):
    if name == "hybrid":
        from fasttrain.models.bench_model import qwen3_5_bench
        return qwen3_5_bench()
    from fasttrain.models import load_policy
    return load_policy(dtype=torch.bfloat16)


def _rollout(model, prompts, G, T, wave, chunk, seeds):
    parts = [sample(model, prompts[a:a + wave], group_size=G, max_new_tokens=T, temperature=1.0,
                    eos_token_ids=[], seed=seeds[a:a + wave], prefill_chunk=chunk)
             for a in range(0, len(prompts), wave)]
    return join_rollouts(parts, 0)


def _planned(model, n, G, P, T, wave, chunk) -> float:
    from fasttrain.plan.gpus import gpu_spec, measured
    from fasttrain.plan.meta_model import meta_policy
    from fasttrain.plan.run_shape import RunShape
    from fasttrain.plan.speed import plan_time
    m = meta_policy(model.config, dtype="bfloat16")
    s = RunShape(prompts=n, group=G, prompt_tokens=P, new_tokens=T, micro_batch=8, wave=wave, prefill_chunk=chunk)
    return plan_time(m, s, measured(gpu_spec("cpu"), "cpu"), compute_dtype="float32",
                     dense_rollout=False).seconds["rollout"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "hybrid"], default="smollm2")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=12)
    ap.add_argument("--new", default="128", help="comma-separated max_new_tokens")
    ap.add_argument("--waves", default="4,2,1", help="comma-separated prompts per wave")
    ap.add_argument("--chunks", default="0,1", help="comma-separated prompts per prefill chunk (0: all)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--csv", default="")
    args = ap.parse_args()
    model, _ = _model(args.model)
    n, G = args.prompts, args.group
    prompts = [[(17 * i + 3 * j) % 1000 + 10 for j in range(300 + 7 * i)] for i in range(n)]
    P = max(map(len, prompts))
    seeds = list(range(100, 100 + n))
    print(f"{args.model} on {machine_name()}, {torch.get_num_threads()} threads: {n} prompts x {G} answers, "
          f"prompts of {P} tokens at most, no EOS")
    rows = []
    with torch.inference_mode():
        _rollout(model, prompts[:1], 2, 2, 1, 0, seeds)                  # warm-up
        for T in map(int, args.new.split(",")):
            base = None
            for wave in map(int, args.waves.split(",")):
                for chunk in map(int, args.chunks.split(",")):
                    times = {}
                    for t in (1, T):
                        runs = []
                        for _ in range(args.reps):
                            t0 = time.perf_counter()
                            _rollout(model, prompts, G, t, wave, chunk, seeds)
                            runs.append(time.perf_counter() - t0)
                        times[t] = statistics.median(runs)
                    step_ms = (times[T] - times[1]) / max(1, T - 1) * 1e3
                    planned = _planned(model, n, G, P, T, wave, chunk)
                    base = base or step_ms
                    print(f"T={T:5d} wave={wave} chunk={chunk or 'all'}: rollout {times[T]:.2f} s, decode "
                          f"{step_ms:.1f} ms/step ({step_ms / base:.2f}x one batch); planned {planned:.2f} s "
                          f"(measured/planned {times[T] / planned:.2f})")
                    case = f"{args.model}-T{T}-w{wave}-c{chunk}"
                    rows += [row("bench_waves", case, "fasttrain", "rollout", times[T], "s", planned_s=planned),
                             row("bench_waves", case, "fasttrain", "decode", step_ms, "ms/step")]
    if args.csv:
        write_csv(rows, Path(args.csv))


if __name__ == "__main__":
    main()
