"""The sampling knobs' evidence: does training on the distribution each token was drawn from matter?

Three arms of fasttrain on the starter task (bench_learning.py's settings: CISPO, beta 0.08, 24 steps of
2 prompts x 8 answers, <= 16 tokens, 2 passes, temperature 0.7), the same seeds in each:
  temperature      temperature alone (top_p 1, top_k off), today's default
  knobs-replay     top_p 0.9 and top_k 20, each token's kept set replayed in the update (the default
                   rollout.replay_kept_set = true)
  knobs-full-vocab top_p 0.9 and top_k 20, the update scoring the full vocabulary (replay off: what TRL
                   does with these knobs)
Seeds 31, 32 and 33, chosen before any run with them; all are reported.

Measured: held-out score of each arm's final adapter by bench/learning_eval.py (one evaluator, which samples
with temperature 0.7 alone in every arm, so the arms are scored identically), the paired difference of
each knobs arm from the temperature arm (95% over seeds and rows, and the t-interval over seeds), the train
reward, and the rollout/update log-prob gap (`rollout_logprob_gap`, the mean |update log-prob - rollout
log-prob| of the sampled tokens at the first pass) per step. Without the replay the gap is the kept mass's
log (the update's distribution is not the one sampled from); with it, rounding.

Run: python bench/bench_knobs.py --work runs/knobs   (resumable: a finished run in --work is kept)
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

import bench_learning as bl  # noqa: E402

SEEDS = (31, 32, 33)
ARMS = {"temperature": [], "knobs-replay": ["--top-p=0.9", "--top-k=20"],
        "knobs-full-vocab": ["--top-p=0.9", "--top-k=20", "--replay=off"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="runs/knobs")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch threads of each run (1 on a shared host: two threads on two busy vCPUs wait on "
                         "each other); every arm uses the same, as the numerics depend on it")
    a = ap.parse_args()
    from fasttrain.train.intervals import crossed_mean_interval, mean_interval
    from harness import host_precision, machine_name
    from learning_eval import EvalSettings, bundled_model_dir, evaluate, held_out_rows, load_reward

    import torch
    precision, why = host_precision()
    busy = bl.machine_busy()
    day = time.strftime("%Y-%m-%d")
    stem = f"{machine_name()}-{day}-sampling-knobs"
    # bench_learning's defaults for everything else, parsed the way its own command line is
    sys.argv = ["bench_learning.py", f"--steps={a.steps}", f"--precision={precision}", f"--threads={a.threads}"]
    base = bl_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    common = [f"--{k.replace('_', '-')}={getattr(base, k)}" for k in
              ("steps", "precision", "quantize", "rank", "alpha", "lr", "beta", "prompts", "group", "micro_batch",
               "passes", "new", "temperature", "save_every", "threads")]
    results: dict[str, list[dict]] = {}
    t0 = time.time()
    for arm, flags in ARMS.items():
        for seed in SEEDS:
            d = work / f"{arm}-{seed}"
            argv = common + flags + ["--worker", "fasttrain", "--worker-seed", str(seed), "--worker-algo", "cispo",
                                     "--worker-dir", str(d)]
            done = d / "result.json"
            if done.exists() and json.loads(done.read_text()).get("argv") == argv:
                res = json.loads(done.read_text())
                print(f"[{time.time() - t0:.0f} s] {arm} seed {seed}: reused", flush=True)
            else:
                print(f"[{time.time() - t0:.0f} s] {arm} seed {seed}", flush=True)
                res = bl.run_worker(argv, a.timeout)
                d.mkdir(parents=True, exist_ok=True)
                done.write_text(json.dumps({**res, "argv": argv}))
            results.setdefault(arm, []).append(res)
    rows = held_out_rows(bl.TASK["dataset"], bl.TASK["probe_rows"], bl.TASK["probe_dataset"])[:base.eval_rows]
    settings = EvalSettings(bl.TASK["system_prompt"], "", base.temperature, base.new, base.eval_samples, base.eval_seed,
                            dtype=bl.torch_dtype(base))
    torch.set_num_threads(base.threads)
    cache_path = work / "evaluations.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    seen = cache.setdefault(json.dumps([len(rows), base.eval_samples, base.eval_seed, base.temperature, base.new,
                                        precision]), {})
    finals = {arm: [r["adapters"][-1]["path"] for r in runs] for arm, runs in results.items()}
    todo = [p for p in [None] + [p for ps in finals.values() for p in ps] if str(p) not in seen]
    if todo:
        print(f"[{time.time() - t0:.0f} s] evaluating {len(todo)} on {len(rows)} held-out rows", flush=True)
        ev = evaluate(bundled_model_dir(), todo, rows, load_reward(f"{bl.TASK['rewards_file']}:{bl.TASK['core']}"),
                      settings)
        seen.update({str(e["adapter"]): e["scores"] for e in ev})
        cache_path.write_text(json.dumps(cache))
    before = mean_interval(seen["None"])
    md = [f"# Sampling knobs: training on the distribution sampled ({stem})", "",
          f"Command: `python bench/bench_knobs.py --work {a.work} --threads {a.threads}` (total {(time.time() - t0) / 60:.0f} min). "
          f"Machine: {machine_name()}; precision {precision} ({why}).", "",
          f"Task: bench_learning.py's starter task, fasttrain CISPO, beta {base.beta}, {a.steps} steps of {base.prompts} "
          f"prompts x {base.group} answers, <= {base.new} tokens, {base.passes} passes, temperature {base.temperature}; "
          f"seeds {', '.join(map(str, SEEDS))} (chosen before the runs, all reported). Evaluator: bench/learning_eval.py "
          f"on {len(rows)} held-out rows x {base.eval_samples} answers, temperature {base.temperature} alone in every arm.",
          ""]
    if busy:
        md += [f"**Timings not reportable**: {busy}.", ""]
    md += ["| arm | held-out before | held-out after (95%) | minus temperature (95%, seeds x rows) | "
           "minus temperature, t over seeds | train reward first -> last | gap, mean of steps | gap, max step | "
           "s / step (median) |", "|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    ref = [seen[p] for p in finals["temperature"]]
    n = bl.fifth(a.steps)
    for arm, runs in results.items():
        fin = [seen[p] for p in finals[arm]]
        after = crossed_mean_interval(fin)
        if arm == "temperature":
            diff_s = diff_t = "-"
        else:
            d = crossed_mean_interval([[x - y for x, y in zip(f, r)] for f, r in zip(fin, ref)])
            t = mean_interval([statistics.fmean(f) - statistics.fmean(r) for f, r in zip(fin, ref)])
            diff_s, diff_t = d.show("+.3f"), t.show("+.3f")
        first = statistics.fmean(statistics.fmean(s["reward_core"] for s in r["steps"][:n]) for r in runs)
        last = statistics.fmean(statistics.fmean(s["reward_core"] for s in r["steps"][-n:]) for r in runs)
        gaps = [s["gap"] for r in runs for s in r["steps"] if s.get("gap") is not None and math.isfinite(s["gap"])]
        step_s = statistics.median(s["seconds"] for r in runs for s in r["steps"])
        md.append(f"| {arm} | {before.show('.3f')} | {after.show('.3f')} | {diff_s} | {diff_t} | {first:.3f} -> "
                  f"{last:.3f} | {statistics.fmean(gaps):.2e} | {max(gaps):.2e} | "
                  f"{'n/r' if busy else f'{step_s:.1f}'} |")
    md += ["", "Gap: `rollout_logprob_gap`, the mean over a step's sampled tokens of |update log-prob - rollout "
           "log-prob| at the first pass (the same weights), averaged over steps and seeds; max: the largest step's.",
           "Intervals: 95%; seeds x rows: two-way random effects over seeds and held-out rows (paired by seed and "
           "row); t over seeds: Student's t on the per-seed mean differences, 2 degrees of freedom."]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"results": results, "scores": {p: seen[p] for ps in finals.values()
                                                                                for p in ps}, "base": seen["None"],
                                                  "busy": busy}, default=str))
    print("\n".join(md))
    return 0


def bl_args():
    """bench_learning's parsed defaults (its parser is built inside its main, so parse through it)."""
    captured = {}

    def fake_run_all(ns):
        captured["a"] = ns
        return 0
    real = bl.run_all
    bl.run_all = fake_run_all
    try:
        bl.main()
    finally:
        bl.run_all = real
    return captured["a"]


if __name__ == "__main__":
    raise SystemExit(main())
