"""What each trainer teaches per second: fasttrain and TRL's GRPOTrainer trained on the same task
files with the same settings, every adapter scored by one evaluator that neither trainer owns.

What it compares (each run in its own subprocess, one after another, never two at once):
  task       one dataset file and one reward-function file read by both trainers (default: the
             `fasttrain init` starter, python/fasttrain/tasks/starter/: data.jsonl with its last 100 rows
             held out, rewards.py's `correct` and `concise` weighted 3 : 1, system prompt
             "Answer with the number only.")
  fasttrain  `Trainer` on the dataset environment: GDPO over the two rewards (batch-normalised),
             no floor guard (advantages.guard = "none"), no REPO-R, all answer tokens, beta KL.
  TRL        GRPOTrainer (TRL 1.16) with multi_objective_aggregation = "normalize_then_sum" and
             reward_weights 3, 1 (GDPO's per-reward group normalisation, then batch scaling),
             top_entropy_quantile 1.0 (all tokens), the same beta.
  the same   SmolLM2-135M-Instruct as a 16-bit base (bf16; fasttrain policy.quantize = "none",
             TRL bf16 weights + bf16=True) where the CPU has native bf16 GEMMs, else in fp32 on both
             sides (--precision auto: ATen's bf16 GEMM runs ~60x below fp32 on an AVX2-only CPU, and
             TRL has no fp32-sums path for a bf16 model), LoRA rank/alpha on the 7 projections, lr (constant,
             AdamW defaults, grad clip 1), group size, prompts per step (TRL's generation batch =
             prompts x group, gradient accumulation = batch / micro-batch), passes per batch (TRL
             num_iterations; TRL counts an optimizer step per pass, so it runs steps x passes),
             answer length, temperature 0.7 (top-p 1, top-k off), the prompts of each step (TRL is
             given fasttrain's order with shuffling off), seeds.
  pairs      CISPO (cap 1.2; TRL loss_type="cispo", epsilon_high=1.2) and DAPO (clip 0.2 / 0.28).
  evaluator  bench/learning_eval.py: each saved adapter PEFT-loaded on the base (same precision), answers
             sampled on the held-out rows with the same seeds, scored with the reward file's `correct`.

Numbers: held-out score before (base) and after (each run's final adapter), mean over seeds and
rows with a 95% interval over both (fasttrain.train.intervals.crossed_mean_interval); train reward
(`correct` in the rollouts) over the first and last fifth of the steps; median seconds per step
(one rollout batch and its passes); training wall time (sum of step times: model loading, probes
and adapter saving are excluded on both sides) to reach TRL's final mean train reward (its last
fifth, mean over seeds; the curve is a trailing mean over a fifth of the steps). The plot is the
held-out score of the adapters saved along each run against training seconds.
Timings are reportable only from a quiet machine: the load average before the start is recorded
and a busy machine's timings are labelled not reportable.

Run: python bench/bench_learning.py --quick              (end to end in minutes: a check, not a result)
     python bench/bench_learning.py                      (the full run; prints its plan and estimate first)
     python bench/bench_learning.py --steps 24 --seeds 1-5 --work runs/learn24x5
                                                          (the seeded rerun: seeds 1 to 5 chosen before it ran,
                                                          every seed reported; add --trl-conventions for
                                                          fasttrain with TRL's loss conventions)
     python bench/bench_learning.py --steps 24 --seeds 11-18 --save-every 24 --work runs/learn24x8
     python bench/bench_learning.py --task countdown --pairs dapo --beta 0 --steps 24 --seeds 11-18 --save-every 24 \
                                    --work runs/learn-countdown24x8
                                                          (the pre-registered rerun with the KL default "k3_ratio":
                                                          seeds 11 to 18 chosen before any run with them, all
                                                          reported, none rerun; resumable: a finished run in the
                                                          --work folder is kept; --save-every 24 saves only the
                                                          final adapters, all the targets score, and cuts the
                                                          evaluation to a quarter)
     python bench/bench_learning.py --first-step --steps 24 --seeds 1   (both samplers before any update:
                                                          the mean reward of each on the same prompts, paired)
     python bench/bench_learning.py --replot bench/results/<stem>.json   (the figure of a finished run)
"""
from __future__ import annotations

import argparse
import functools
import json
import math
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

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
STARTER = ROOT / "python" / "fasttrain" / "tasks" / "starter"
TASKS_DIR = ROOT / "python" / "fasttrain" / "tasks"
# --task: the task files both trainers read. "starter": the `fasttrain init` arithmetic (its last 100 rows held
# out). "countdown": the packaged countdown_small variant (fasttrain.tasks.countdown, sized for a 135M model), its
# own probe file held out, no answer prefix on either side (TRL has none), answer x3 + format x1.
TASKS = {
    "starter": {"dataset": STARTER / "data.jsonl", "rewards_file": STARTER / "rewards.py",
                "rewards": ("correct", "concise"), "weights": (3.0, 1.0), "core": "correct",
                "system_prompt": "Answer with the number only.", "probe_rows": 100, "probe_dataset": None,
                "what": "the `fasttrain init` starter (data.jsonl, last 100 rows held out; rewards.py correct x3 + "
                        "concise x1)"},
    "countdown": {"dataset": TASKS_DIR / "countdown_small_train.jsonl", "rewards_file": TASKS_DIR / "countdown.py",
                  "rewards": ("answer", "format"), "weights": (3.0, 1.0), "core": "answer",
                  "system_prompt": "You are a precise assistant. Reply with the answer only.", "probe_rows": 100,
                  "probe_dataset": TASKS_DIR / "countdown_small_probe.jsonl",
                  "what": "countdown_small (1000 training rows, its 100-row probe file held out; countdown.py answer x3 "
                          "+ format x1)"},
}
TASK = dict(TASKS["starter"])
PAIRS = {"cispo": {"fasttrain": {"kind": "cispo", "cispo_cap": 1.2}, "trl": {"loss_type": "cispo", "epsilon_high": 1.2}},
         "dapo": {"fasttrain": {"kind": "dapo", "eps_low": 0.2, "eps_high": 0.28},
                  "trl": {"loss_type": "dapo", "epsilon": 0.2, "epsilon_high": 0.28}}}


def fasttrain_config(a, seed: int, algo: str, out: str):
    from fasttrain.train.config import load_config
    return load_config({
        "run": {"name": f"learn-{algo}", "seed": seed, "steps": a.steps, "out": out, "device": "cpu",
                "threads": a.threads},
        "policy": {"model": "smollm2-135m", "dtype": torch_dtype(a), "quantize": a.quantize, "adapter": "lora",
                   "rank": a.rank, "alpha": float(a.alpha), "gradient_checkpointing": False},
        "env": {"name": "dataset", "dataset": str(TASK["dataset"]),
                **({"probe_dataset": str(TASK["probe_dataset"])} if TASK["probe_dataset"]
                   else {"probe_rows": TASK["probe_rows"]}),
                "rewards": [f"{TASK['rewards_file']}:{r}" for r in TASK["rewards"]], "core": TASK["core"],
                "system_prompt": TASK["system_prompt"]},
        "rollout": {"prompts_per_step": a.prompts, "group_size": a.group, "max_new_tokens": a.new,
                    "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k,
                    "replay_kept_set": a.replay == "on"},
        "advantages": {"priorities": dict(zip(TASK["rewards"], TASK["weights"])), "guard": "none",
                       "batch_normalize": True},
        "loss": {**PAIRS[algo]["fasttrain"], "beta": a.beta, "token_mask": "all", "passes": a.passes, "repo_r": False,
                 **({"normalize": "trl"} if a.trl_conventions else {})},
        "optim": {"lr": a.lr, "micro_batch": a.micro_batch, "grad_clip": 1.0},
        # the probe only saves the adapters the evaluator scores; 2 rows keep its cost small
        "probe": {"every": a.save_every, "prompts": 2, "samples": 1, "temperature": a.temperature},
    })


def torch_dtype(a) -> str:
    """The base's torch dtype name for --precision."""
    return "bfloat16" if a.precision == "bf16" else "float32"


# ---- workers (each in its own process) ----------------------------------------------------
def worker_fasttrain(a, seed: int, algo: str, out: Path) -> dict:
    from fasttrain.train.run_files import read_jsonl
    from fasttrain.train.trainer import Trainer
    t0 = time.perf_counter()
    tr = Trainer(fasttrain_config(a, seed, algo, str(out)), progress=False)
    tr.train()
    metrics = read_jsonl(tr.dir / "metrics.jsonl")
    steps = [{"step": m["step"], "seconds": m["seconds_step"], "reward_core": m[f"reward_{TASK['core']}"],
              "gap": m.get("rollout_logprob_gap")} for m in metrics]
    cum = _cumulative([s["seconds"] for s in steps])
    adapters = [{"step": s, "seconds": cum[s - 1], "path": str(tr.dir / "probes" / f"step_{s:06d}" / "adapter")}
                for s in _save_steps(a)]
    return {"steps": steps, "adapters": adapters, "process_seconds": time.perf_counter() - t0,
            "setting": f"fasttrain {a.precision} base, policy.quantize={a.quantize}, LoRA r{a.rank}"}


def worker_trl(a, seed: int, algo: str, out: Path) -> dict:
    if knob_args(a):
        raise SystemExit("the TRL worker samples with temperature alone here (top_p 1, top_k off): "
                         "run the sampling knobs with --trainers fasttrain")
    import torch
    import transformers
    from datasets import Dataset
    from learning_eval import bundled_model_dir, load_base, load_file_module, messages_of
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from fasttrain.train.trainer import Trainer
    t0 = time.perf_counter()
    torch.set_num_threads(a.threads)
    # the prompts of each step in fasttrain's order (its Trainer reads the dataset; no model is loaded)
    ft = Trainer(fasttrain_config(a, seed, algo, str(out / "order")), progress=False)
    order = [int(p.id.split("/")[1]) for s in range(1, a.steps + 1) for p in ft._prompts_for_step(s)]
    ft.env.close()
    rows = [json.loads(x) for x in TASK["dataset"].read_text().splitlines() if x.strip()]
    data = Dataset.from_list([{**rows[i], "prompt": messages_of(rows[i], TASK["system_prompt"])} for i in order])

    rewards_mod = load_file_module(TASK["rewards_file"], "task_rewards")
    core_values: list[float] = []

    def recorded(fn):
        @functools.wraps(fn)
        def wrapped(**kw):
            vals = fn(**kw)
            if fn.__name__ == TASK["core"]:
                core_values.append(float(sum(vals) / len(vals)))
            return vals
        return wrapped

    model, tok = load_base(bundled_model_dir(), torch_dtype(a))
    cfg = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=a.precision == "bf16", **PAIRS[algo]["trl"], beta=a.beta,
        num_generations=a.group, max_completion_length=a.new, temperature=a.temperature, top_p=1.0, top_k=0,
        per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=a.prompts * a.group // a.micro_batch,
        num_iterations=a.passes, max_steps=a.steps * a.passes, learning_rate=a.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, shuffle_dataset=False, seed=seed,
        reward_weights=list(TASK["weights"]), multi_objective_aggregation="normalize_then_sum",
        top_entropy_quantile=1.0, logging_steps=10_000, save_strategy="no", report_to="none", disable_tqdm=True,
        gradient_checkpointing=False, dataloader_num_workers=0)
    lora = LoraConfig(r=a.rank, lora_alpha=a.alpha, target_modules=list(TARGETS), lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[recorded(getattr(rewards_mod, r)) for r in TASK["rewards"]],
                          args=cfg, train_dataset=data, processing_class=tok, peft_config=lora)
    opt_seconds: list[float] = []
    adapters: list[dict] = []
    save_at = set(_save_steps(a))

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            opt_seconds.append(time.perf_counter() - self.t0)      # before the adapter is saved
            if state.global_step % a.passes == 0 and state.global_step // a.passes in save_at:
                s = state.global_step // a.passes
                path = out / "adapters" / f"step_{s:06d}"
                model.save_pretrained(str(path))
                adapters.append({"step": s, "seconds": sum(opt_seconds), "path": str(path)})

    trainer.add_callback(Clock())
    trainer.train()
    per_step = [sum(opt_seconds[i * a.passes:(i + 1) * a.passes]) for i in range(a.steps)]
    steps = [{"step": i + 1, "seconds": per_step[i], "reward_core": core_values[i] if i < len(core_values) else math.nan}
             for i in range(a.steps)]
    return {"steps": steps, "adapters": adapters, "process_seconds": time.perf_counter() - t0,
            "setting": ("TRL bf16 weights + bf16=True" if a.precision == "bf16" else "TRL fp32") + ", PEFT LoRA"}


# ---- the first step: both samplers on the base policy, before any update ----------------------
def first_step_fasttrain(a, seed: int) -> list[float]:
    """fasttrain's answers to the prompts of steps 1..a.steps, all from the base policy (no update):
    the core reward's mean per prompt, in fasttrain's prompt order."""
    from fasttrain.train.answers import answer_token_ids, score_answers
    from fasttrain.train.trainer import Trainer
    torch_threads(a.threads)
    tr = Trainer(fasttrain_config(a, seed, "cispo", tempfile.mkdtemp(prefix="first-step-")), progress=False)
    tr._setup()
    means = []
    for step in range(1, a.steps + 1):
        prompts = tr._prompts_for_step(step)
        roll, texts = tr.sample_step(step, prompts, 0, len(prompts), None)
        scores = score_answers(tr.env, [p for p in prompts for _ in range(a.group)], texts, "train", record=False,
                               completion_ids=answer_token_ids(roll))      # the `concise` reward reads them
        core = [s.channels[TASK["core"]] for s in scores]
        means += [statistics.fmean(core[i * a.group:(i + 1) * a.group]) for i in range(len(prompts))]
    tr.env.close()
    return means


def first_step_trl(a, seed: int) -> list[float]:
    """TRL's answers to the same prompts in the same order, from its own generation and reward step
    on the base policy (`_generate_and_score_completions` only; no optimizer step): the core
    reward's mean per prompt."""
    from datasets import Dataset
    from learning_eval import bundled_model_dir, load_base, load_file_module, messages_of
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from fasttrain.train.trainer import Trainer
    torch_threads(a.threads)
    ft = Trainer(fasttrain_config(a, seed, "cispo", tempfile.mkdtemp(prefix="first-step-order-")), progress=False)
    order = [int(p.id.split("/")[1]) for s in range(1, a.steps + 1) for p in ft._prompts_for_step(s)]
    ft.env.close()
    rows = [json.loads(x) for x in TASK["dataset"].read_text().splitlines() if x.strip()]
    data = [{**rows[i], "prompt": messages_of(rows[i], TASK["system_prompt"])} for i in order]
    rewards_mod = load_file_module(TASK["rewards_file"], "task_rewards")
    core: list[float] = []

    def recorded(**kw):
        vals = getattr(rewards_mod, TASK["core"])(**kw)
        core.extend(float(v) for v in vals)
        return vals
    recorded.__name__ = TASK["core"]
    model, tok = load_base(bundled_model_dir(), torch_dtype(a))
    cfg = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="first-step-trl-"), use_cpu=True, bf16=a.precision == "bf16", beta=0.0,
                     num_generations=a.group, max_completion_length=a.new, temperature=a.temperature, top_p=1.0,
                     top_k=0, per_device_train_batch_size=a.prompts * a.group, shuffle_dataset=False, seed=seed,
                     report_to="none", disable_tqdm=True, save_strategy="no")
    trainer = GRPOTrainer(model=model, reward_funcs=[recorded], args=cfg, train_dataset=Dataset.from_list(data),
                          processing_class=tok, peft_config=LoraConfig(r=a.rank, lora_alpha=a.alpha,
                                                                       target_modules=list(TARGETS), task_type="CAUSAL_LM"))
    trainer.model.train()
    for i in range(0, len(data), a.prompts):
        trainer._generate_and_score_completions([row for row in data[i:i + a.prompts] for _ in range(a.group)])
    return [statistics.fmean(core[i * a.group:(i + 1) * a.group]) for i in range(len(data))]


def first_step_report(a) -> list[str]:
    """Both trainers' mean first-step reward on the same prompts (95% intervals over prompts) and the
    paired difference; they agree when the difference's interval holds 0."""
    from fasttrain.train.intervals import mean_interval
    seed = a.seeds[0]
    ft, trl = first_step_fasttrain(a, seed), first_step_trl(a, seed)
    diff = mean_interval([x - y for x, y in zip(ft, trl)])
    agree = diff.low <= 0 <= diff.high
    return [f"first-step mean reward ({TASK['core']}), {len(ft)} prompts x {a.group} answers, base policy, seed {seed}:",
            f"- fasttrain {mean_interval(ft).show('.3f')}, TRL {mean_interval(trl).show('.3f')}",
            f"- paired by prompt, fasttrain minus TRL: {diff.show('+.3f')} -> {'agree' if agree else 'DIFFER'}"]


def torch_threads(n: int) -> None:
    import torch
    torch.set_num_threads(n)


def _save_steps(a) -> list[int]:
    return sorted({*range(a.save_every, a.steps + 1, a.save_every), a.steps})


def _cumulative(xs: list[float]) -> list[float]:
    out, t = [], 0.0
    for x in xs:
        t += x
        out.append(t)
    return out


def run_worker(argv: list[str], timeout: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-out", path, *argv]
    proc = subprocess.run(cmd, timeout=timeout, stdout=sys.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {' '.join(argv[-6:])} failed with exit code {proc.returncode}")
    return json.loads(Path(path).read_text())


# ---- the summary -------------------------------------------------------------------------
def fifth(n: int) -> int:
    return max(1, n // 5)


def trailing_mean(xs: list[float], w: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1):i + 1]) for i in range(len(xs))]


def time_to_reach(runs: list[dict], target: float) -> float | None:
    """Training seconds (mean over seeds) at the first step where the seed-mean train reward,
    as a trailing mean over a fifth of the steps, reaches `target`; None if it never does."""
    n = min(len(r["steps"]) for r in runs)
    curve = trailing_mean([statistics.fmean(r["steps"][i]["reward_core"] for r in runs) for i in range(n)], fifth(n))
    cum = [statistics.fmean(_cumulative([s["seconds"] for s in r["steps"]])[i] for r in runs) for i in range(n)]
    for c, t in zip(curve, cum):
        if c >= target - 1e-12:
            return t
    return None


def summarize(results: dict, base_scores: list[float], scores: dict[str, list[float]], a, busy: str | None) -> tuple[str, list[dict]]:
    from harness import row

    from fasttrain.train.intervals import crossed_mean_interval, mean_interval
    n = a.steps
    lines, csv = [], []
    before = mean_interval(base_scores)
    trl_final = {algo: statistics.fmean(statistics.fmean(s["reward_core"] for s in r["steps"][-fifth(n):])
                                        for r in results[f"trl/{algo}"]) for algo in a.pairs if f"trl/{algo}" in results}
    head = ("| trainer | algorithm | seeds | held-out before | held-out after (95%) | gain (95%) | train reward "
            "first -> last | s / step (median) | training s, total | s to TRL's final train reward |")
    lines += [head, "|---|---|---:|---:|---:|---:|---|---:|---:|---:|"]
    for key, runs in results.items():
        trainer, algo = key.split("/")
        final = [scores[r["adapters"][-1]["path"]] for r in runs]
        after = crossed_mean_interval(final)
        gain = crossed_mean_interval([[x - b for x, b in zip(f, base_scores)] for f in final])
        first = statistics.fmean(statistics.fmean(s["reward_core"] for s in r["steps"][:fifth(n)]) for r in runs)
        last = statistics.fmean(statistics.fmean(s["reward_core"] for s in r["steps"][-fifth(n):]) for r in runs)
        step_s = statistics.median(s["seconds"] for r in runs for s in r["steps"])
        total = statistics.fmean(sum(s["seconds"] for s in r["steps"]) for r in runs)
        reach = time_to_reach(runs, trl_final[algo]) if algo in trl_final else None
        t = (lambda v: "-" if v is None else f"{v:.0f}") if not busy else (lambda v: "n/r")
        lines.append(f"| {trainer} | {algo} | {len(runs)} | {before.show('.3f')} | {after.show('.3f')} | "
                     f"{gain.show('+.3f')}{' *' if gain.excludes_zero else ''} | {first:.3f} -> {last:.3f} | "
                     f"{t(step_s) if busy else f'{step_s:.1f}'} | {t(total)} | {t(reach)} |")
        csv += [row("learning", f"{trainer}/{algo}", trainer, m, v, u, seeds=len(runs), steps=n) for m, v, u in (
            ("heldout_before", before.mean, "share"), ("heldout_after", after.mean, "share"),
            ("heldout_after_low", after.low, "share"), ("heldout_after_high", after.high, "share"),
            ("gain", gain.mean, "share"), ("gain_low", gain.low, "share"), ("gain_high", gain.high, "share"),
            ("train_reward_first", first, "share"), ("train_reward_last", last, "share"),
            ("seconds_per_step", step_s, "s"), ("training_seconds", total, "s"),
            ("seconds_to_trl_final_reward", reach if reach is not None else math.nan, "s"))]
    return "\n".join(lines) + "\n", csv


# The targets, fixed before the seeded rerun (seeds 1 to 5, every seed reported): per pair, the paired
# held-out difference fasttrain minus TRL has a mean >= -0.02 and a 95% interval inside +-0.12, in
# <= 0.33x TRL's training time.
EQUIVALENCE_MEAN, EQUIVALENCE_MARGIN, TIME_RATIO = -0.02, 0.12, 0.33


def seed_t_interval(algo: str, diffs: list[float]) -> list[str]:
    """The targets on the t-interval over seeds: each seed's held-out difference (the mean over the
    evaluated rows, fasttrain minus TRL) is one value, and the interval is Student's t with n - 1
    degrees of freedom. It also says the smallest true difference this many seeds detect with 80%
    power in a two-sided 5% test, (t_0.975 + t_0.80) x sd / sqrt(n), with the seeds' own sd."""
    from fasttrain.train.intervals import mean_interval, t_quantile
    iv = mean_interval(diffs)
    n = len(diffs)
    if n < 2:
        return [f"- {algo}: t-interval over seeds: one seed, none"]
    sd = statistics.stdev(diffs)
    detect = (t_quantile(0.975, n - 1) + t_quantile(0.80, n - 1)) * sd / math.sqrt(n)
    met = iv.mean >= EQUIVALENCE_MEAN and -EQUIVALENCE_MARGIN <= iv.low and iv.high <= EQUIVALENCE_MARGIN
    return [f"- {algo}: the same difference, 95% t-interval over the {n} seeds (per-seed means; sd {sd:.3f}): "
            f"{iv.mean:+.3f} [{iv.low:+.3f}, {iv.high:+.3f}] -> {'met' if met else 'NOT met'}; a true difference of "
            f"{detect:.3f} or more would be detected with 80% power (two-sided, 5%)",
            f"- {algo}: per seed: " + ", ".join(f"{d:+.3f}" for d in diffs)]


def claim(results: dict, base_scores, scores, a, busy: str | None) -> list[str]:
    """The pre-registered targets, checked on each pair that both trainers ran with the same seeds,
    and whether fasttrain is ahead of TRL at equal training time."""
    from fasttrain.train.intervals import crossed_mean_interval
    out = []
    for algo in a.pairs:
        ft, trl = results.get(f"fasttrain/{algo}"), results.get(f"trl/{algo}")
        if not ft or not trl or len(ft) != len(trl):
            out.append(f"- {algo}: not checked (needs both trainers with the same seeds)")
            continue
        diff = crossed_mean_interval([[x - y for x, y in zip(scores[f["adapters"][-1]["path"]],
                                                             scores[t["adapters"][-1]["path"]])]
                                      for f, t in zip(ft, trl)])
        met = diff.mean >= EQUIVALENCE_MEAN and -EQUIVALENCE_MARGIN <= diff.low and diff.high <= EQUIVALENCE_MARGIN
        out.append(f"- {algo}: held-out after, fasttrain minus TRL (paired by seed, 95% over seeds and rows): "
                   f"{diff.show('+.3f')} (target: mean >= {EQUIVALENCE_MEAN}, interval within "
                   f"+-{EQUIVALENCE_MARGIN}) -> {'met' if met else 'NOT met'}")
        out.extend(seed_t_interval(algo, [statistics.fmean(scores[f["adapters"][-1]["path"]]) -
                                          statistics.fmean(scores[t["adapters"][-1]["path"]]) for f, t in zip(ft, trl)]))
        if busy:
            out.append(f"- {algo}: time claims not reportable: {busy}")
            continue
        ratio = statistics.fmean(sum(s["seconds"] for s in r["steps"]) for r in ft) / \
            statistics.fmean(sum(s["seconds"] for s in r["steps"]) for r in trl)
        ft_end = statistics.fmean(r["adapters"][-1]["seconds"] for r in ft)
        ft_final = statistics.fmean(statistics.fmean(scores[r["adapters"][-1]["path"]]) for r in ft)
        trl_at = _score_at(trl, scores, ft_end)
        out.append(f"- {algo}: training time fasttrain / TRL: {ratio:.2f}x (target: <= {TIME_RATIO}x) -> "
                   f"{'met' if ratio <= TIME_RATIO else 'NOT met'}")
        out.append(f"- {algo}: at fasttrain's end ({ft_end:.0f} s) TRL's held-out score was {_f(trl_at)} (its "
                   f"adapters interpolated), fasttrain's {ft_final:.3f} -> "
                   f"{'higher' if trl_at is not None and ft_final > trl_at else 'NOT higher'} at equal training time")
    return out


def _f(v):
    return "-" if v is None else f"{v:.3f}"


def _score_at(runs: list[dict], scores, t: float) -> float | None:
    """Seed-mean held-out score of a trainer at training second t, linear between its saved
    adapters (the base's score at 0 s is not used: before the first adapter, None)."""
    pts = sorted((statistics.fmean(r["adapters"][i]["seconds"] for r in runs),
                  statistics.fmean(statistics.fmean(scores[r["adapters"][i]["path"]]) for r in runs))
                 for i in range(min(len(r["adapters"]) for r in runs)))
    if not pts or t < pts[0][0]:
        return None
    for (t0, y0), (t1, y1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return y0 + (y1 - y0) * (t - t0) / (t1 - t0) if t1 > t0 else y1
    return pts[-1][1]


def plot(results: dict, base_mean: float, scores, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for key, runs in results.items():
        k = min(len(r["adapters"]) for r in runs)
        xs = [0.0] + [statistics.fmean(r["adapters"][i]["seconds"] for r in runs) for i in range(k)]
        ys = [base_mean] + [statistics.fmean(statistics.fmean(scores[r["adapters"][i]["path"]]) for r in runs)
                            for i in range(k)]
        ax.plot(xs, ys, marker="o", linestyle="-" if key.startswith("fasttrain") else "--", label=key)
    ax.set_xlabel("training seconds (sum of step times)")
    ax.set_ylabel("held-out score (share correct)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def curves(results: dict, base_mean: float, scores) -> dict[str, dict[str, list[float]]]:
    """Per trainer/algorithm: the seed-mean held-out score at each saved adapter (the base's at step
    0 and 0 s first), against its step and against its training seconds (seed mean)."""
    out = {}
    for key, runs in results.items():
        k = min(len(r["adapters"]) for r in runs)
        out[key] = {
            "steps": [0] + [runs[0]["adapters"][i]["step"] for i in range(k)],
            "seconds": [0.0] + [statistics.fmean(r["adapters"][i]["seconds"] for r in runs) for i in range(k)],
            "heldout": [base_mean] + [statistics.fmean(statistics.fmean(scores[r["adapters"][i]["path"]]) for r in runs)
                                      for i in range(k)]}
    return out


def plot_steps_and_seconds(results: dict, base_mean: float, scores, path: Path, title: str) -> None:
    """One figure, two panels sharing the y axis: held-out score against steps (what each trainer
    learns per step) and against training seconds (per second); one colour per algorithm, fasttrain
    solid, TRL dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    colours = {}
    for key, c in curves(results, base_mean, scores).items():
        trainer, algo = key.split("/")
        colour = colours.setdefault(algo, f"C{len(colours)}")
        style = dict(color=colour, marker="o", linestyle="-" if trainer == "fasttrain" else "--", label=key)
        by_step.plot(c["steps"], c["heldout"], **style)
        by_time.plot(c["seconds"], c["heldout"], **style)
    by_step.set_xlabel("optimizer steps (rollout batches)")
    by_time.set_xlabel("training seconds (sum of step times)")
    by_step.set_ylabel("held-out score (share correct)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    by_time.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(json_path: Path) -> Path:
    """The steps-and-seconds figure of a finished run, from its result JSON alone (no model is run):
    written beside it as <stem>-curves.png."""
    d = json.loads(json_path.read_text())
    stem = json_path.stem
    a = d["args"]
    title = (f"{stem}: held-out score per step and per second, mean of seeds {a['seeds']}, {a['steps']} steps"
             + ("\ntimings NOT reportable (busy machine)" if d.get("busy") else ""))
    out = json_path.with_name(f"{stem}-curves.png")
    plot_steps_and_seconds(d["results"], statistics.fmean(d["base_scores"]), d["scores"], out, title)
    return out


def _cpu_busy_fraction(seconds: float = 3.0) -> float:
    """Share of the machine's CPU time spent running anything (user + system, not idle or I/O wait)
    over `seconds`, from /proc/stat. The load average is not used: a process sleeping in an
    uninterruptible I/O wait counts 1 there while it takes no CPU at all."""
    def sample():
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = f[3] + f[4]                                    # idle + iowait
        return sum(f[:8]) - idle, sum(f[:8])
    b0, t0 = sample()
    time.sleep(seconds)
    b1, t1 = sample()
    return (b1 - b0) / max(1, t1 - t0)


def machine_busy(threshold: float = 0.10) -> str | None:
    """None on a quiet machine; else why the timings are not reportable (more than 10% of the
    CPU busy with other work over 3 s before the start)."""
    try:
        frac = _cpu_busy_fraction()
    except OSError:                                            # no /proc: fall back to the load average
        load = os.getloadavg()[0]
        return f"load average {load:.2f} before the start (other work on the machine)" if load > 0.5 else None
    return (f"{100 * frac:.0f}% of the CPU busy before the start (other work on the machine)"
            if frac > threshold else None)


def estimate(a, sec_per_step: dict[str, float] | None = None) -> str:
    """Minutes the full run takes on a quiet 2-core CPU: steps x seeds x pairs x (fasttrain + TRL
    step) + loading + evaluation. The rates are guesses from a busy machine (one thread, load ~9:
    fasttrain 13-34 s and TRL 40-150 s per step, 0.47 s per evaluated answer) divided by about 3."""
    ft, trl = (sec_per_step or {}).get("fasttrain", 6.0), (sec_per_step or {}).get("trl", 20.0)
    runs = len(a.seeds) * len(a.pairs)
    train = runs * a.steps * (ft + trl) + runs * 2 * 60            # + model loading, probes, saving
    n_adapters = 1 + 2 * runs * len(_save_steps(a))
    evals = n_adapters * a.eval_rows * a.eval_samples * 0.15      # seconds per evaluated answer
    return f"about {(train + evals) / 60:.0f} min ({train / 60:.0f} training, {evals / 60:.0f} evaluation)"


def seed_list(text: str) -> list[int]:
    """ "1-5" -> [1, 2, 3, 4, 5]; "1,3,7" -> [1, 3, 7]."""
    out = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        out += list(range(int(lo), int(hi) + 1)) if sep else [int(lo)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a check end to end: 3 steps, 1 seed, 20 rows, "
                    "the final adapters only")
    ap.add_argument("--task", choices=sorted(TASKS), default="starter",
                    help="the task files both trainers read (starter: the fasttrain init arithmetic; countdown: "
                         "countdown_small)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=seed_list, default=[1, 2, 3, 4, 5],
                    help="seeds, e.g. 1-5 or 1,2,3 (the default, 1 to 5, was chosen before any run with it)")
    ap.add_argument("--pairs", type=lambda s: s.split(","), default=["cispo", "dapo"])
    ap.add_argument("--trainers", type=lambda s: s.split(","), default=["fasttrain", "trl"])
    ap.add_argument("--quantize", default="none", help='fasttrain policy.quantize ("none": the 16-bit base)')
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beta", type=float, default=0.08)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=1.0, help="fasttrain's rollout.top_p (the TRL side refuses it)")
    ap.add_argument("--top-k", type=int, default=0, help="fasttrain's rollout.top_k (0: off)")
    ap.add_argument("--replay", choices=["on", "off"], default="on",
                    help="fasttrain's rollout.replay_kept_set (off: the update scores the full vocabulary, as TRL does)")
    ap.add_argument("--save-every", type=int, default=0, help="adapter every N steps (default steps / 4)")
    ap.add_argument("--eval-rows", type=int, default=100)
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--eval-seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--not-quiet", default="", metavar="WHY",
                    help="mark the timings not reportable whatever the busy check finds (runs reused from a call "
                         "made while other work ran, e.g. two lanes of seeds side by side)")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--timeout", type=int, default=4 * 3600)
    ap.add_argument("--work", help="folder for the runs and evaluations, kept: a run or evaluation found there with "
                    "the same settings is reused (an interrupted benchmark goes on; a later call can add a pair)")
    ap.add_argument("--trl-conventions", action="store_true", help="fasttrain with TRL's loss conventions "
                    "(loss.normalize = \"trl\"; the KL estimator is TRL's by default, loss.kl = \"k3_ratio\"; docs/trl.md)")
    ap.add_argument("--first-step", action="store_true", help="only compare both trainers' answers at the first "
                    "step (the base policy, no update) on the prompts of --steps steps: mean reward of each, paired")
    ap.add_argument("--replot", type=Path, help="only redraw the steps-and-seconds figure of a result JSON")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="both trainers' and the evaluator's base precision (auto: bf16 where the CPU has native "
                         "bf16 GEMMs, else fp32; bench/harness.py host_precision)")
    ap.add_argument("--worker", choices=["fasttrain", "trl"])
    ap.add_argument("--worker-seed", type=int)
    ap.add_argument("--worker-algo")
    ap.add_argument("--worker-dir")
    ap.add_argument("--worker-out")
    a = ap.parse_args()
    TASK.clear()
    TASK.update(TASKS[a.task])
    if a.precision == "auto":
        from harness import host_precision
        a.precision, a.precision_why = host_precision()
    else:
        a.precision_why = "chosen on the command line"
    if a.replot:
        print(f"wrote {replot(a.replot)}")
        return 0
    if a.first_step:
        print("\n".join(first_step_report(a)))
        return 0
    if a.quick:
        a.steps, a.seeds, a.eval_rows, a.eval_samples = min(a.steps, 3), a.seeds[:1], 20, 1
        a.save_every = a.save_every or a.steps
    a.save_every = a.save_every or max(1, a.steps // 4)
    if a.eval_rows > TASK["probe_rows"]:
        ap.error(f"--eval-rows {a.eval_rows}: the task holds out {TASK['probe_rows']} rows")
    if a.worker:
        fn = worker_fasttrain if a.worker == "fasttrain" else worker_trl
        res = fn(a, a.worker_seed, a.worker_algo, Path(a.worker_dir))
        Path(a.worker_out).write_text(json.dumps(res))
        return 0
    return run_all(a)


def knob_args(a) -> list[str]:
    """The sampling knobs' flags for a worker, only where they differ from temperature alone (so the
    argv of a run made before the knobs existed, by which a finished run is reused, stays the same)."""
    out = []
    if a.top_p != 1.0:
        out.append(f"--top-p={a.top_p}")
    if a.top_k != 0:
        out.append(f"--top-k={a.top_k}")
    if a.replay != "on":
        out.append(f"--replay={a.replay}")
    return out


def run_all(a) -> int:
    import torch
    from harness import machine_name, versions
    from learning_eval import EvalSettings, bundled_model_dir, evaluate, held_out_rows, load_reward

    busy = a.not_quiet or machine_busy()
    day = time.strftime("%Y-%m-%d")
    stem = (f"{machine_name()}-{day}-learning{'' if a.task == 'starter' else '-' + a.task}"
            f"{'-quick' if a.quick else ''}")
    cmd = " ".join(["python bench/bench_learning.py"] + sys.argv[1:])
    print(f"{cmd}\n{stem}: {len(a.seeds)} seeds x {a.pairs} x {a.trainers}, {a.steps} steps; estimate {estimate(a)}"
          + (f"\nBUSY: {busy}; timings will be marked not reportable" if busy else ""), flush=True)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="bench_learning-"))
    work.mkdir(parents=True, exist_ok=True)
    common = [f"--{k.replace('_', '-')}={getattr(a, k)}" for k in
              ("steps", "precision", "quantize", "rank", "alpha", "lr", "beta", "prompts", "group", "micro_batch", "passes", "new",
               "temperature", "save_every", "threads")] + (["--trl-conventions"] if a.trl_conventions else []) \
        + ([f"--task={a.task}"] if a.task != "starter" else []) + knob_args(a)
    results: dict[str, list[dict]] = {}
    t0 = time.time()
    for algo in a.pairs:
        for trainer in a.trainers:
            for seed in a.seeds:
                d = work / f"{'' if a.task == 'starter' else a.task + '-'}{trainer}-{algo}-{seed}"
                argv = common + ["--worker", trainer, "--worker-seed", str(seed), "--worker-algo", algo,
                                 "--worker-dir", str(d)]
                done = d / "result.json"
                if done.exists() and json.loads(done.read_text()).get("argv") == argv:
                    print(f"[{time.time() - t0:.0f} s] {trainer} {algo} seed {seed}: reused from {done}", flush=True)
                    res = json.loads(done.read_text())
                else:
                    print(f"[{time.time() - t0:.0f} s] {trainer} {algo} seed {seed}", flush=True)
                    res = run_worker(argv, a.timeout)
                    d.mkdir(parents=True, exist_ok=True)
                    done.write_text(json.dumps({**res, "argv": argv}))
                results.setdefault(f"{trainer}/{algo}", []).append(res)
    rows = held_out_rows(TASK["dataset"], TASK["probe_rows"], TASK["probe_dataset"])[:a.eval_rows]
    settings = EvalSettings(TASK["system_prompt"], "", a.temperature, a.new, a.eval_samples, a.eval_seed,
                            dtype=torch_dtype(a))
    paths = [ad["path"] for runs in results.values() for r in runs for ad in r["adapters"]]
    torch.set_num_threads(a.threads)
    print(f"[{time.time() - t0:.0f} s] evaluating the base and {len(paths)} adapters on {len(rows)} held-out rows",
          flush=True)
    # Evaluations are kept in the work folder under their settings, so a later call scores only new adapters.
    cache_path = work / "evaluations.json"
    key = json.dumps([len(rows), a.eval_samples, a.eval_seed, a.temperature, a.new, a.precision])
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    seen = cache.setdefault(key, {})
    todo = [p for p in [None] + paths if str(p) not in seen]
    if todo:
        ev = evaluate(bundled_model_dir(), todo, rows, load_reward(f"{TASK['rewards_file']}:{TASK['core']}"),
                      settings)
        seen.update({str(e["adapter"]): e["scores"] for e in ev})
        # Another call on the same work folder (a lane of other seeds) may have written meanwhile: merge.
        latest = json.loads(cache_path.read_text()) if cache_path.exists() else {}
        for k, v in latest.items():
            cache.setdefault(k, {}).update({p: s for p, s in v.items() if p not in cache.get(k, {})})
        tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(cache_path)
    base_scores = seen["None"]
    scores = {str(p): seen[str(p)] for p in paths}
    table, csv = summarize(results, base_scores, scores, a, busy)
    lines = claim(results, base_scores, scores, a, busy)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    title = (f"{stem}\n{a.task}, SmolLM2-135M, {a.precision}, fasttrain base {a.quantize} / TRL {a.precision}, "
             f"{len(a.seeds)} seed(s), {a.steps} steps" + ("\ntimings NOT reportable (busy machine)" if busy else ""))
    plot(results, statistics.fmean(base_scores), scores, out / f"{stem}.png", title)
    plot_steps_and_seconds(results, statistics.fmean(base_scores), scores, out / f"{stem}-curves.png", title)
    v = versions()
    md = [f"# Learning benchmark: fasttrain vs TRL GRPOTrainer ({stem})", "",
          f"Command: `{cmd}` (total {(time.time() - t0) / 60:.0f} min)", "",
          f"Machine: {machine_name()}, {os.cpu_count()} cores; versions: " + ", ".join(f"{k} {x}" for k, x in v.items()),
          "", f"Task: {TASK['what']}, {a.steps} steps of {a.prompts} prompts x {a.group} answers, <= {a.new} tokens, "
          f"temperature {a.temperature}, {a.passes} passes, lr {a.lr}, beta {a.beta}, LoRA r{a.rank} alpha {a.alpha}; "
          f"precision {a.precision} on both sides and in the evaluator ({a.precision_why}); "
          f"fasttrain policy.quantize={a.quantize}, TRL {a.precision}. Evaluator: bench/learning_eval.py on {len(rows)} held-out "
          f"rows x {a.eval_samples} answers, seed {a.eval_seed}.", ""]
    if busy or a.quick:
        md += [f"**Timings not reportable**: {busy or 'a --quick check'}." if busy else
               "**A --quick check (few steps, one seed): not a result.**", ""]
    md += [table, "Intervals: 95%, over seeds and held-out rows (two-way random effects); * a gain whose interval "
           "excludes 0. Time columns: training seconds (sum of step times; loading, probes, saving excluded).", "",
           "Targets (pre-registered):", *lines, "", f"![held-out score vs training seconds]({stem}.png)", "",
           f"![held-out score per step and per second]({stem}-curves.png)", ""]
    md += ["Per run: " + "; ".join(f"{k} seed {a.seeds[i]}: {r['setting']}, process {r['process_seconds']:.0f} s"
                                   for k, runs in results.items() for i, r in enumerate(runs))]
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    from harness import write_csv
    (out / f"{stem}.csv").unlink(missing_ok=True)
    write_csv(csv, out / f"{stem}.csv")
    (out / f"{stem}.json").write_text(json.dumps({"results": results, "base_scores": base_scores, "scores": scores,
                                                  "busy": busy, "args": {k: v for k, v in vars(a).items()}}, default=str))
    print("\n".join(md))
    print(f"wrote {out / stem}.md/.csv/.json/.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
