"""Answers per second of the built-in signal verifier on one core.

Compares: scoring throughput against the issue's floor of 200 answers/s (a 48-answer step
in under 0.25 s). The answers are a fixed, seeded mix that looks like a policy's group: a few
families of expressions with mutated windows/fields, plus invalid ones (no tags, garbage),
so the subtree cache sees the overlap real groups have. Also times a cold run (no cache).
Run: PYTHONPATH=python python bench/bench_env.py [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from fasttrain.tasks import load_env

FAMILIES = ["rank(-ts_delta(close, {w}))", "-ts_mean(returns, {w})", "{f} / ts_mean({f}, {w})",
            "ts_corr(close, volume, {w})", "zscore(-ts_mean(returns, {w}) / ts_std(returns, 20))",
            "ts_rank({f}, {w})", "rank({f}) - rank(delay({f}, {w}))", "abs(ts_delta(log({f}), {w}))"]
FIELDS = ["close", "volume", "open", "high"]


def make_answers(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        if u < 0.08:
            out.append("I think momentum works.")
        elif u < 0.12:
            out.append("<signal>rank(close +</signal>")
        else:
            e = FAMILIES[rng.integers(len(FAMILIES))].format(
                w=int(rng.choice([3, 5, 10, 20])), f=FIELDS[rng.integers(len(FIELDS))])
            out.append(f"Here is my idea.\n<signal>{e}</signal>")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--group", type=int, default=48)
    ap.add_argument("--env", default="signal-a")
    ap.add_argument("--csv", default="", help="append rows (bench/harness.py layout) to this CSV")
    args = ap.parse_args()
    t0 = time.perf_counter()
    env = load_env(args.env)
    prompts = env.prompts("train")
    env.score(prompts[0], "<signal>returns</signal>")          # builds panel and slices
    print(f"setup (panel + slices + prompts): {time.perf_counter() - t0:.2f} s")
    times = []
    for step in range(args.steps):
        answers = make_answers(args.group, seed=step)
        ps = [prompts[step]] * args.group
        t = time.perf_counter()
        env.score_many(ps, answers, "train")
        times.append(time.perf_counter() - t)
    med = float(np.median(times))
    cold = []
    for step in range(3):
        env._caches.clear()  # noqa: SLF001 — bench-only: measure without subtree reuse
        t = time.perf_counter()
        for a in make_answers(args.group, seed=100 + step):
            env._caches.clear()  # noqa: SLF001
            env.score(prompts[0], a, "train", record=False)
        cold.append(time.perf_counter() - t)
    cold_med = float(np.median(cold))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"numpy {np.__version__}; env {args.env}, group {args.group}, {args.steps} steps")
    print(f"warm step (subtree cache): median {med * 1e3:.0f} ms per {args.group} answers = "
          f"{args.group / med:.0f} answers/s (floor: 200/s, 250 ms per step) ratio {args.group / med / 200:.2f}x")
    print(f"cold (cache cleared per answer): median {cold_med * 1e3:.0f} ms per {args.group} = "
          f"{args.group / cold_med:.0f} answers/s")
    if args.csv:
        from pathlib import Path

        from harness import row, write_csv
        case = f"{args.env}, group {args.group}"
        write_csv([row("env", case, "fasttrain", "answers_per_s_warm", args.group / med, "1/s"),
                   row("env", case, "fasttrain", "answers_per_s_cold", args.group / cold_med, "1/s"),
                   row("env", case, "fasttrain/floor", "ratio_to_200_per_s", args.group / med / 200, "x")],
                  Path(args.csv))


if __name__ == "__main__":
    main()
