"""Data-parallel scaling on this machine: training steps per second with 1 and with N processes
(torchrun, gloo on CPU / NCCL on GPU), one thread each, on the same global batch, and the time the
ranks spend in collectives per step.

Each side is a fresh `fasttrain run` of the same recipe (1 process: `python -m fasttrain run`;
N processes: `torchrun --standalone --nproc-per-node N -m fasttrain run`). The numbers come from the
run's own metrics.jsonl (rank 0's view): seconds_step per step (rollout, verify, advantages,
log-probs, update; not probes or checkpoints) and seconds_collectives (the part of it spent inside
torch.distributed calls, including the wait for the slowest rank). Medians over the steps after
the first (warm-up).

The default policy is the tiny 2-layer test model (tests/support/tiny_world.py): it shows the
overheads of splitting a step (collectives, duplicated per-step work), not a model's scaling;
--model smollm2-135m runs the bundled model instead (minutes per step on a busy CPU).

Run: python bench/bench_dist.py [--nproc 2] [--steps 4] [--model tiny|smollm2-135m] [--out NAME]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "python"))


def recipe(out: Path, steps: int, model: str, ppstep: int, group: int, tokens: int) -> str:
    tiny = model == "tiny"
    return f"""
[run]
name = "bench-dist"
seed = 7
steps = {steps}
out = "{out}"
threads = 1
device = "cpu"

[policy]
model = "{'support.tiny_world:tiny_policy' if tiny else model}"
dtype = "float32"
rank = 8
alpha = 16.0

[env]
name = "{'support.tiny_world:make_env' if tiny else 'signal-a'}"

[rollout]
prompts_per_step = {ppstep}
group_size = {group}
max_new_tokens = {tokens}

[advantages]
{'priorities = { core = 3.0 }' if tiny else ''}
floor = -1e9

[loss]
kind = "cispo"
token_mask = "top_entropy"
passes = 1

[optim]
lr = 1e-3
micro_batch = 4

[probe]
every = 0
prompts = 1
samples = 2
"""


def run_side(nproc: int, recipe_file: Path, out: Path, env: dict) -> dict:
    if nproc == 1:
        cmd = [sys.executable, "-m", "fasttrain", "run", str(recipe_file), "--no-progress"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "fasttrain", "run", str(recipe_file), "--no-progress"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    meas = rows[1:] or rows
    step = statistics.median(r["seconds_step"] for r in meas)
    coll = statistics.median(r.get("seconds_collectives", 0.0) for r in meas)
    phases = {k: statistics.median(r[k] for r in meas) for k in rows[0] if k.startswith("seconds_")
              and k not in ("seconds_step", "seconds_collectives")}
    return {"nproc": nproc, "steps_measured": len(meas), "seconds_step": step, "steps_per_s": 1.0 / step,
            "seconds_collectives": coll, "wall_s_whole_run": wall, "tokens": statistics.median(r["tokens"] for r in meas),
            **phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", default="dist_cpu", help="bench/results/OUT.csv and .md")
    a = ap.parse_args()
    import torch
    from harness import RESULTS, machine_name, versions

    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT / "tests")])}
    load = os.getloadavg()
    results = []
    for n in (1, a.nproc):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            f = tmp / "recipe.toml"
            f.write_text(recipe(tmp / "runs", a.steps, a.model, a.prompts_per_step, a.group_size, a.max_new_tokens))
            r = run_side(n, f, tmp / "runs", env)
        results.append(r)
        print(f"{n} process(es): {r['steps_per_s']:.3f} steps/s ({r['seconds_step']:.2f} s/step), "
              f"collectives {r['seconds_collectives'] * 1e3:.1f} ms/step", flush=True)
    load_after = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    keys = list(dict.fromkeys(k for r in results for k in r))
    with open(RESULTS / f"{a.out}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(results)
    one, many = results
    lines = [
        "# bench_dist: data-parallel steps per second, 1 vs %d processes" % a.nproc, "",
        f"Machine: {machine_name()}, {os.cpu_count()} cores; torch {torch.__version__} "
        f"({'NCCL' if torch.cuda.is_available() else 'gloo'}), one thread per process. "
        f"Policy: {a.model}; global batch {a.prompts_per_step} prompts x {a.group_size} answers, "
        f"<= {a.max_new_tokens} new tokens; {a.steps} steps, medians of steps 2..{a.steps}. "
        f"Load average {load[0]:.1f} before, {load_after[0]:.1f} after: the machine was shared and busy "
        "(other engineers' jobs), so absolute times are noisy; compare the two rows of this run only.", "",
        "| processes | steps/s | s/step | collectives ms/step | rollout s | update s | wall s (whole run) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['nproc']} | {r['steps_per_s']:.3f} | {r['seconds_step']:.2f} | "
                     f"{r['seconds_collectives'] * 1e3:.1f} | {r.get('seconds_rollout', float('nan')):.2f} | "
                     f"{r.get('seconds_update', float('nan')):.2f} | {r['wall_s_whole_run']:.1f} |")
    lines += ["", f"Speed-up: {many['steps_per_s'] / one['steps_per_s']:.2f}x with {a.nproc} processes "
              f"(ideal {a.nproc}x); collectives {many['seconds_collectives'] / many['seconds_step']:.0%} of a step "
              "(rank 0's time inside torch.distributed calls, including waiting for the slower rank).", "",
              f"versions: {json.dumps(versions())}", "",
              f"Reproduce: `python bench/bench_dist.py --nproc {a.nproc} --steps {a.steps} --model {a.model}`"]
    (RESULTS / f"{a.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
