"""Does every prompt teach? Dynamic sampling and the curriculum on two reasoning-gym generators,
against the plain recipe, every adapter scored by one evaluator that no trainer owns.

What it compares (each run in its own subprocess, one after another, never two at once):
  task       two reasoning-gym generators (--generators; default basic_arithmetic, two 1-digit
             terms added, and letter_counting, 1 or 2 words; see GENERATORS), equal weights,
             env.train_rows 1000, env.data_seed 0; every answer starts with the prefilled "<answer>"
             (rollout.answer_prefix) and stops at "</answer>", 16 new tokens. The pair should start
             at a success between 0.1 and 0.6: confirm with `--pick` first. Measured with
             `--pick --pick-rows 40 --pick-samples 2 --threads 1` (40 held-out rows x 2 answers, a
             standard error of about 0.035; a shared 2-core AMD EPYC, 2026-12-07): basic_arithmetic
             with 1-digit terms 0.125, letter_counting over 1-2 words 0.114. Wider settings start
             below the window: 1-2-digit terms 0.051 and 3-5 words 0.065 (the same 40 x 2); with 12
             rows x 2 (2026-12-06), gcd (up to 10) 0.037, spell_backward (3-4 letters) 0.028 and
             leg_counting (1-2 kinds, up to 5 each) 0.001. Without the prefilled tag every candidate
             scored 0 on 8 rows: the model explains and seldom writes the tags.
  arms       plain        the recipe as `fasttrain init --reasoning-gym` writes it (sized for a CPU)
             dynamic      + rollout.dynamic_sampling (rollout.dynamic_max_rounds 3)
             curriculum   + env.curriculum (window 8 steps, bounds 0.75 / 0.25; level 0 of
                          reasoning-gym's curriculum replaces the range settings above, so this
                          arm starts on its own rows, e.g. 1-digit addition)
             both         + both
  seeds      21, 22, 23 (chosen before any run), 60 steps, an adapter every 10 steps
  evaluator  bench/learning_eval.py (imports nothing of fasttrain's trainer or environments): each
             saved adapter PEFT-loaded on the base, answers sampled on held-out rows with the same
             seeds, scored by a reward function of this file that calls reasoning-gym's own
             extract_answer (the last <answer>...</answer>; a tag never closed gives the rest of
             its line) and the generator's
             score_answer on the row as reasoning-gym regenerates it. The held-out rows are drawn
             from seeds of their own (EVAL_SEED + k), at the recipe's settings, and every question
             that any arm could train on or probe (the environment's rows at every curriculum level
             reached) is left out.

Numbers per arm (mean over seeds): held-out score of the base and of the adapters at each saved
step, against steps and against training seconds (sum of seconds_step); the non-zero-advantage
share before dropping (nonzero_adv_share_before, or nonzero_adv_share without dynamic sampling) and
after; extra answers per step and the share of rollout seconds spent on dropped groups; seconds
per step. Written to bench/results/<host>-<day>-signal.{md,json}.

Resumable: every run and every evaluation is kept in --work under its settings; a later call with
the same --work reuses what is done (a run that was cut short resumes from its last checkpoint).
Timings are reportable only from a quiet machine (the load is recorded before the start).

Run: python bench/bench_signal.py --pick                    (starting success of candidate generators)
     python bench/bench_signal.py --quick                   (2 steps, 1 seed, 8 rows: a check, not a result)
     python bench/bench_signal.py --work runs/signal        (the full run; again with the same --work to go on)
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

# generator -> its settings (small enough for a 135M model to solve some of the time)
GENERATORS = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
                         "allow_parentheses": False, "allow_negation": False},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "max_instances": 5},
    "gcd": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 10},
    "letter_counting": {"min_words": 1, "max_words": 2},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
}
DEFAULT_PAIR = ("basic_arithmetic", "letter_counting")
ARMS = {"plain": {}, "dynamic": {"rollout.dynamic_sampling": True},
        "curriculum": {"env.curriculum": True},
        "both": {"rollout.dynamic_sampling": True, "env.curriculum": True}}
EVAL_SEED = 777_000
ANSWER_FORMAT = None      # the environment's own (fasttrain.envs.reasoning_gym.ANSWER_FORMAT), read at run time


def recipe(a, arm: str, seed: int, out: str) -> dict:
    gens = {g: {"weight": 1.0, **GENERATORS[g]} for g in a.generators}
    r = {
        "run": {"name": f"signal-{arm}", "seed": seed, "steps": a.steps, "out": out, "device": "cpu",
                "threads": a.threads, "checkpoint_every": a.save_every},
        "policy": {"model": "smollm2-135m", "rank": 16, "alpha": 32.0, "gradient_checkpointing": False},
        "env": {"name": "reasoning-gym", "generators": gens, "train_rows": 1000, "probe_rows": 16, "data_seed": 0},
        # the answer starts inside the tag and stops at its end: without it the 135M model explains
        # and seldom writes a tag in a CPU-sized answer
        "rollout": {"prompts_per_step": a.prompts, "group_size": a.group, "max_new_tokens": a.new,
                    "temperature": a.temperature, "dynamic_max_rounds": 3, "answer_prefix": "<answer>",
                    "stop_strings": ["</answer>"]},
        "advantages": {"priorities": {"core": 3.0, "format": 1.0}, "floor": 0.0},
        "loss": {"kind": "cispo", "token_mask": "all", "passes": 2, "repo_r": True, "thermostat_warmup": 2},
        "optim": {"lr": 1e-4, "micro_batch": 8},
        # the probe saves the adapters the evaluator scores; 2 rows keep its cost small
        "probe": {"every": a.save_every, "prompts": 2, "samples": 1, "temperature": a.temperature},
    }
    for k, v in ARMS[arm].items():
        sec, key = k.split(".")
        r[sec][key] = v
    return r


# ---- a worker: one run (resumed if its folder holds a checkpoint) -----------------------------
def worker(a, arm: str, seed: int, out: Path) -> dict:
    from fasttrain.train import Trainer, load_config
    from fasttrain.train.run_files import read_jsonl
    runs = sorted(p for p in out.glob("*") if (p / "config.toml").exists()) if out.exists() else []
    if runs and (runs[-1] / "checkpoints").exists() and any((runs[-1] / "checkpoints").iterdir()):
        tr = Trainer.resume(runs[-1], progress=False)
    else:
        tr = Trainer(load_config(recipe(a, arm, seed, str(out))), progress=False)
    tr.train()
    m = read_jsonl(tr.dir / "metrics.jsonl")
    levels = {}
    for row in m:
        for k, v in row.items():
            if k.startswith("curriculum_level_"):
                g = k[len("curriculum_level_"):]
                levels[g] = sorted(set(levels.get(g, [])) | {int(v), int(row[f"curriculum_next_level_{g}"])})
    steps = [{"step": r["step"], "seconds": r["seconds_step"], "core": r["reward_core"],
              "share_before": r.get("nonzero_adv_share_before", r["nonzero_adv_share"]),
              "share_after": r["nonzero_adv_share"], "extra_answers": r.get("dynamic_extra_answers", 0),
              "dropped_share": r.get("seconds_share_dropped", 0.0)} for r in m]
    cum, t = [], 0.0
    for s in steps:
        t += s["seconds"]
        cum.append(t)
    saves = sorted({*range(a.save_every, a.steps + 1, a.save_every), a.steps})
    adapters = [{"step": s, "seconds": cum[s - 1], "path": str(tr.dir / "probes" / f"step_{s:06d}" / "adapter")}
                for s in saves]
    return {"steps": steps, "adapters": adapters, "levels": levels, "run_dir": str(tr.dir)}


def run_worker(argv: list[str], timeout: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker-out", path, *argv],
                          timeout=timeout, stdout=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {' '.join(argv[-6:])} failed with exit code {proc.returncode}")
    return json.loads(Path(path).read_text())


# ---- the held-out rows and their reward (the evaluator's side) ---------------------------------
def held_out(a, exclude: set[str], n: int) -> list[dict]:
    """n rows per generator from seeds EVAL_SEED + k, at the recipe's settings, none in `exclude`."""
    import reasoning_gym
    rows = []
    for k, g in enumerate(a.generators):
        ds = reasoning_gym.create_dataset(g, **GENERATORS[g], seed=EVAL_SEED + k, size=20 * n)
        got = 0
        for i in range(len(ds)):
            e = ds[i]
            if e["question"] in exclude:
                continue
            exclude.add(e["question"])
            rows.append({"prompt": e["question"], "generator": g, "rg_seed": EVAL_SEED + k, "rg_index": i,
                         "rg_size": 20 * n})
            got += 1
            if got == n:
                break
    return rows


def rg_reward(prompts, completions, generator, rg_seed, rg_index, rg_size, **kw):
    """reasoning-gym's extract_answer and the generator's score_answer on the regenerated row."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer
    out, cache = [], {}
    for c, g, s, i, n in zip(completions, generator, rg_seed, rg_index, rg_size):
        key = (g, s)
        if key not in cache:
            cache[key] = reasoning_gym.create_dataset(g, **GENERATORS[g], seed=s, size=n)
        ds = cache[key]
        text = c[0]["content"] if isinstance(c, list) else c
        ans = extract_answer(text)
        if ans is None and "<answer>" in text:          # never closed: the rest of the tag's line
            ans = text[text.rfind("<answer>") + 8:].strip().split("\n", 1)[0].strip() or None
        out.append(float(ds.score_answer(ans, ds[i])))
    return out


def trained_questions(a, levels: dict[str, list[int]]) -> set[str]:
    """Every question an arm could have trained on or probed: the environment's rows at each level reached."""
    from fasttrain.envs.reasoning_gym import ReasoningGymEnvironment
    gens = {g: {"weight": 1.0, **GENERATORS[g]} for g in a.generators}
    env = ReasoningGymEnvironment(gens, train_rows=1000, probe_rows=16)
    qs = {p.spec for p in env.prompts("train") + env.prompts("probe")}
    top = max((max(v) for v in levels.values()), default=0)
    if top > 0:
        cur = ReasoningGymEnvironment(gens, train_rows=1000, probe_rows=16, curriculum=True)
        for lv in range(top + 1):
            cur.curriculum.levels = {g: min(lv, cur.curriculum.top[g]) for g in a.generators}
            qs |= {p.spec for p in cur.prompts("train")}
    return qs


# ---- --pick: starting success of candidates -------------------------------------------------------
def pick(a) -> int:
    from learning_eval import EvalSettings, bundled_model_dir, evaluate
    from fasttrain.envs.reasoning_gym import ANSWER_FORMAT as FMT
    import torch
    torch.set_num_threads(a.threads)
    cands = a.candidates or list(GENERATORS)
    for g in cands:
        b = argparse.Namespace(generators=[g])
        rows = held_out(b, set(), a.pick_rows)
        s = EvalSettings(system_prompt=FMT, answer_prefix="<answer>", temperature=a.temperature, max_new_tokens=a.new,
                         samples=a.pick_samples, seed=1234, batch=a.pick_rows, dtype="bfloat16")
        t = time.perf_counter()
        (res,) = evaluate(bundled_model_dir(), [None], rows, rg_reward, s, log=lambda *x: None)
        print(f"{g:18s} {GENERATORS[g]}: starting success {res['mean']:.3f} over {len(rows)} rows x "
              f"{a.pick_samples} answers ({time.perf_counter() - t:.0f} s)", flush=True)
    return 0


# ---- the whole benchmark ------------------------------------------------------------------------------------
def mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def run_all(a) -> int:
    import torch
    from harness import machine_name
    from learning_eval import EvalSettings, bundled_model_dir, evaluate
    from fasttrain.envs.reasoning_gym import ANSWER_FORMAT as FMT
    from bench_learning import machine_busy
    busy = machine_busy()
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="bench_signal-"))
    work.mkdir(parents=True, exist_ok=True)
    common = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
              ("steps", "prompts", "group", "new", "temperature", "save_every", "threads")]
    common += ["--generators=" + ",".join(a.generators)]
    t0 = time.time()
    results: dict[str, list[dict]] = {}
    for arm in a.arms:
        for seed in a.seeds:
            d = work / f"{arm}-{seed}"
            argv = common + ["--worker", arm, "--worker-seed", str(seed), "--worker-dir", str(d)]
            done = d / "result.json"
            want = recipe(a, arm, seed, str(d))           # the settings too (GENERATORS may have changed)
            if done.exists() and json.loads(done.read_text()).get("recipe") == want:
                res = json.loads(done.read_text())
                print(f"[{time.time() - t0:.0f} s] {arm} seed {seed}: reused", flush=True)
            elif a.eval_part:
                raise SystemExit(f"--eval-part: the run {arm} seed {seed} is not done; evaluate after every run")
            else:
                print(f"[{time.time() - t0:.0f} s] {arm} seed {seed}", flush=True)
                res = run_worker(argv, a.timeout)
                done.write_text(json.dumps({**res, "argv": argv, "recipe": want}))
            results.setdefault(arm, []).append(res)
    levels: dict[str, list[int]] = {}
    for runs in results.values():
        for r in runs:
            for g, v in r["levels"].items():
                levels[g] = sorted(set(levels.get(g, [])) | set(v))
    rows = held_out(a, trained_questions(a, levels), a.eval_rows)
    settings = EvalSettings(system_prompt=FMT, answer_prefix="<answer>", temperature=a.temperature,
                            max_new_tokens=a.new, samples=a.eval_samples, seed=1234, dtype="bfloat16")
    cache_path = work / "evaluations.json"
    key = json.dumps({"rows": rows, "settings": settings.__dict__}, sort_keys=True)
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    cache = cache if cache.get("key") == key else {"key": key, "scores": {}}
    for part in sorted(work.glob("evaluations.part*.json")):      # what --eval-part processes scored
        got = json.loads(part.read_text())
        if got.get("key") == key:
            cache["scores"].update(got["scores"])
    todo = [None] + [ad["path"] for runs in results.values() for r in runs for ad in r["adapters"]]
    todo = [p for p in todo if str(p) not in cache["scores"]]
    torch.set_num_threads(a.threads)
    if a.eval_part:                      # one share of the evaluations, in a process of its own
        i, n = (int(x) for x in a.eval_part.split("/"))
        mine = {"key": key, "scores": {}}
        part_path = work / f"evaluations.part{i}.json"
        for p in todo[i::n]:
            (res,) = evaluate(bundled_model_dir(), [p], rows, rg_reward, settings, log=lambda *x: None)
            mine["scores"][str(p)] = res["mean"]
            part_path.write_text(json.dumps(mine))
        print(f"[{time.time() - t0:.0f} s] part {i}/{n}: {len(todo[i::n])} evaluation(s) in {part_path}", flush=True)
        return 0
    if todo:
        print(f"[{time.time() - t0:.0f} s] evaluating {len(todo)} adapter(s) on {len(rows)} held-out rows", flush=True)
        for p in todo:                                    # one at a time, saved after each (resumable)
            (res,) = evaluate(bundled_model_dir(), [p], rows, rg_reward, settings, log=lambda *x: None)
            cache["scores"][str(p)] = res["mean"]
            cache_path.write_text(json.dumps(cache))
    base = cache["scores"]["None"]
    lines = [f"# Dynamic sampling and the curriculum on reasoning-gym ({', '.join(a.generators)})", "",
             f"`python bench/bench_signal.py {' '.join(sys.argv[1:])}` on {machine_name()}, "
             f"{time.strftime('%Y-%m-%d')}; {len(a.seeds)} seeds ({', '.join(map(str, a.seeds))}), {a.steps} steps, "
             f"{a.prompts} prompts x {a.group} answers per step; held-out: {len(rows)} rows x {a.eval_samples} answers.",
             "" if not busy else f"BUSY when started ({busy}): the seconds below are not reportable.", "",
             f"Base (no adapter): held-out score {base:.3f}.", "",
             "| arm | held-out, final | held-out by step | s/step | training s | nz share before | nz share after "
             "| extra answers/step | rollout s share dropped |", "|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for arm, runs in results.items():
        by_step: dict[int, list[float]] = {}
        for r in runs:
            for ad in r["adapters"]:
                by_step.setdefault(ad["step"], []).append(cache["scores"][ad["path"]])
        final = mean(by_step[max(by_step)])
        sps = mean([mean([s["seconds"] for s in r["steps"]]) for r in runs])
        total = mean([sum(s["seconds"] for s in r["steps"]) for r in runs])
        row = {"final": final, "by_step": {k: mean(v) for k, v in sorted(by_step.items())}, "s_per_step": sps,
               "train_seconds": total,
               "share_before": mean([s["share_before"] for r in runs for s in r["steps"]]),
               "share_after": mean([s["share_after"] for r in runs for s in r["steps"]]),
               "extra_answers": mean([s["extra_answers"] for r in runs for s in r["steps"]]),
               "dropped_share": mean([s["dropped_share"] for r in runs for s in r["steps"]]),
               "per_seed_final": [cache["scores"][r["adapters"][-1]["path"]] for r in runs],
               "adapter_seconds": [[ad["seconds"] for ad in r["adapters"]] for r in runs]}
        summary[arm] = row
        curve = " ".join(f"{k}:{v:.3f}" for k, v in row["by_step"].items())
        lines.append(f"| {arm} | {final:.3f} | {curve} | {sps:.1f} | {total:.0f} | {row['share_before']:.2f} | "
                     f"{row['share_after']:.2f} | {row['extra_answers']:.1f} | {row['dropped_share']:.2f} |")
    stem = f"{machine_name()}-{time.strftime('%Y-%m-%d')}-signal{'-quick' if a.quick else ''}"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"base": base, "arms": summary, "argv": sys.argv[1:],
                                                  "busy": busy}, indent=1))
    print("\n".join(lines))
    print(f"wrote {out / (stem + '.md')}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--generators", type=lambda s: s.split(","), default=list(DEFAULT_PAIR))
    ap.add_argument("--arms", type=lambda s: s.split(","), default=list(ARMS))
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[21, 22, 23])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--eval-rows", type=int, default=50, help="held-out rows per generator")
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=6 * 3600)
    ap.add_argument("--work", help="folder for the runs and evaluations, kept: a later call goes on from it")
    ap.add_argument("--eval-part", help="I/N: after the runs (all done), only the I-th of N shares of the evaluations, "
                                        "kept in the work folder for the report call (N processes in parallel)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--quick", action="store_true", help="2 steps, 1 seed, 4 held-out rows per generator")
    ap.add_argument("--pick", action="store_true", help="only the bundled model's starting success per candidate")
    ap.add_argument("--candidates", type=lambda s: s.split(","), default=None)
    ap.add_argument("--pick-rows", type=int, default=12)
    ap.add_argument("--pick-samples", type=int, default=2)
    ap.add_argument("--worker")
    ap.add_argument("--worker-seed", type=int)
    ap.add_argument("--worker-dir")
    ap.add_argument("--worker-out")
    a = ap.parse_args()
    unknown = [g for g in a.generators + (a.candidates or []) if g not in GENERATORS]
    if unknown:
        ap.error(f"no settings for {unknown} in GENERATORS: {', '.join(GENERATORS)}")
    if a.pick:
        return pick(a)
    if a.quick:
        a.steps, a.seeds, a.eval_rows, a.eval_samples, a.save_every = 2, a.seeds[:1], 4, 1, 2
    if a.worker:
        res = worker(a, a.worker, a.worker_seed, Path(a.worker_dir))
        Path(a.worker_out).write_text(json.dumps(res))
        return 0
    return run_all(a)


if __name__ == "__main__":
    sys.exit(main())
