"""The plan's step time against real training steps on this CPU: planned / measured per phase.

    python bench/bench_planned_time.py                 # the tiny model (seconds)
    python bench/bench_planned_time.py --all           # plus the demo and the study shape on SmolLM2-135M
    python bench/bench_planned_time.py --long 1024,2048,4096
        # long answers: SmolLM2-135M's widths (2 of 30 layers) and the benchmark hybrid's (4 of 16:
        # 3 Gated DeltaNet + 1 gated attention), random weights, 1 prompt x 2 answers run to the end,
        # prompt padded to 200 tokens, micro-batch 2, two passes, float32, NF4 + LoRA r32: the shapes
        # whose memory tools/plan_check.py and tests/plan check; here their seconds
    python bench/bench_planned_time.py --moe            # only the mixtures of experts, below
    python bench/bench_planned_time.py --moe --moe-hidden 64 --moe-experts 8 --moe-new 4   # a smoke run
        # the bundled qwen3-30b-a3b and qwen3.5-35b-a3b at small width (tests/support/moe_scaled.py: their
        # families, layouts, top-8 and relative widths at hidden 256, 32 experts, 2 layers / one
        # attention interval of 4), random weights, 2 prompts x 4 answers of 32 new tokens, micro-batch
        # 4, one pass, float32, NF4 + LoRA r 8 on the projections and the experts: the routed experts
        # timed from fasttrain.ops.moe_experts' rates measured at the model's shapes (the plan's note
        # says at what), planned against measured per phase

How it is measured, and why: the plan times each phase from rates measured on the host
(fasttrain.train.calibrate, into fasttrain.plan.host_rates: matmul, bandwidth, attention, sampling, per-layer framework costs on a
micro model), never from the runs checked here. Both the host's rates and the steps are measured in
this process, one right after the other, with one thread and the process's CPU time: with one
thread, CPU time is the time the work takes on an idle core, and it is what the plan predicts for a
one-thread run. Step 1 warms up (allocator, first-call costs); the next step(s) are compared, with
every answer run to max_new_tokens (EOS and stop strings off), as the plan assumes.

This used to be a unit test with a 30% bound; it moved here because a busy machine moves CPU time
too (cache misses, frequency, memory bandwidth shared with other processes), so the bound failed
on a loaded host while the plan was right. What `make test` keeps of the plan does not depend on
the machine's load: the counted bytes (tests/plan/test_measured_peaks.py, the allocator's own
events), the FLOP counts (tests/plan/test_hybrid_plan.py) and the arithmetic from given rates
(tests/plan/test_planned_time.py). The goal stays: planned within 30% of measured on a quiet host.

Each run appends its table to bench/results/<machine>-<date>-planned-time.md, with the machine's
load average at the start (a number taken on a loaded host says so).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from unittest import mock

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "python"), str(ROOT / "tests")]     # tests/: the support package's worlds

from harness import RESULTS, machine_name  # noqa: E402

GOAL = 0.30
PHASES = {"rollout": "sample_answers", "scores": "score_batch", "update": "update_policy"}


def planned_vs_measured(trainer, label: str, steps: int = 1, warm: bool = True) -> dict:
    """Planned and measured CPU seconds, per phase and in all, of steps 2 .. steps + 1 (1 .. steps
    without `warm`: at long answers the first step's one-time costs are a small share of minutes of
    decoding, and a warm-up step would double the run), each step planned at its own prompt length."""
    import fasttrain.train.answers as answers
    import fasttrain.train.trainer as tr_mod
    from fasttrain.train.calibrate import measure
    from fasttrain.plan import gpu_spec, run_shape
    from fasttrain.plan.report import make_plan
    from fasttrain.train.answers import prompt_token_ids

    cpu: dict[str, float] = {}

    def clocked(name, fn):
        def inner(*a, **k):
            t = time.process_time()
            try:
                return fn(*a, **k)
            finally:
                cpu[name] = cpu.get(name, 0.0) + time.process_time() - t
        return inner

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(answers, "eos_ids", lambda model, tok: []))   # run to max_new_tokens
        for phase, attr in PHASES.items():
            stack.enter_context(mock.patch.object(tr_mod, attr, clocked(phase, getattr(tr_mod, attr))))
        trainer._setup()
        first = 2 if warm else 1
        if warm:
            trainer._train_step(1)
        rates = measure("cpu", clock=time.process_time)          # right before the steps it predicts
        cpu.clear()
        measured = 0.0
        for step in range(first, steps + first):
            t = time.process_time()
            trainer._train_step(step)
            measured += time.process_time() - t
    cfg = trainer.cfg
    planned, by_phase = 0.0, dict.fromkeys(PHASES, 0.0)
    for step in range(first, steps + first):
        ids = prompt_token_ids(trainer.tokenizer, trainer.env, trainer._prompts_for_step(step), cfg.rollout.answer_prefix)
        shape = run_shape(cfg, max(len(i) for i in ids))
        plan = make_plan(trainer.model.config, shape, replace(gpu_spec("cpu"), rates=rates), name=label,
                         env=cfg.env.name, with_limits=False)
        planned += plan.time.total
        for phase in PHASES:
            by_phase[phase] += plan.time.seconds[phase]
    return {"label": label, "steps": steps, "planned": planned, "measured": measured, "by_phase": by_phase,
            "cpu": dict(cpu), "assumption": " ".join([plan.time.assumptions[0]] + [
                a for a in plan.time.assumptions if a.startswith("MoE:")]),
            "shape": (f"{shape.prompts} prompts x {shape.group} answers, prompt {shape.prompt_tokens} + "
                      f"{shape.new_tokens} new tokens, micro-batch {shape.micro_batch}, {shape.passes} pass(es), "
                      f"{shape.dtype}")}


def tiny_case(out: Path):
    from support.recipes import tiny_recipe
    from fasttrain.train import Trainer, load_config

    r = tiny_recipe(out, 2, 6, 24, 6)
    r["policy"]["model"] = "support.padded_world:tiny_policy_as_loaded"
    return Trainer(load_config(r), progress=False), "tiny", 4


def demo_case(out: Path):
    from fasttrain.train import Trainer, load_config

    cfg = load_config("demo", ["rollout.stop_strings=[]", "probe.every=0", f"run.out={out}", "run.threads=1"])
    return Trainer(cfg, progress=False), "demo", 1


def study_case(out: Path):
    """bench/bench_step.py's default shape on SmolLM2-135M: 4 prompts x 12 answers, 64 new tokens,
    micro-batch 12, LoRA r=32 on the 7 projections, beta 0.08, one pass, bf16."""
    from fasttrain.train import Trainer, load_config

    cfg = load_config({
        "run": {"name": "study", "seed": 0, "steps": 2, "out": str(out), "device": "cpu", "threads": 1},
        "policy": {"dtype": "bfloat16", "rank": 32, "alpha": 64.0},
        "env": {"name": "signal-a"},
        "rollout": {"prompts_per_step": 4, "group_size": 12, "max_new_tokens": 64, "temperature": 1.0},
        "loss": {"kind": "cispo", "cispo_cap": 1.2, "beta": 0.08, "token_mask": "all", "passes": 1},
        "optim": {"lr": 1e-5, "micro_batch": 12, "grad_clip": 1.0},
        "probe": {"every": 0}})
    return Trainer(cfg, progress=False), "study shape", 1


def long_case(model: str, layers: int, new: int):
    """(a factory of) the long-answer case: tools/plan_check.py's model and world at `new` tokens."""
    def make(out: Path):
        sys.path.insert(0, str(ROOT / "tools"))
        from support import padded_world
        import plan_check
        from fasttrain.train import Trainer, load_config

        plan_check.ARGS.update(model=model, device="cpu", layers=layers, context=200 + new + 64)
        padded_world.PADDING = " x" * 30        # prompts of about 200 tokens, as tools/plan_check.py pads them
        sys.modules.setdefault("plan_check", plan_check)
        cfg = load_config({
            "run": {"name": "long", "seed": 7, "steps": 1, "out": str(out), "device": "cpu", "threads": 1},
            "policy": {"model": "plan_check:policy", "dtype": "float32", "rank": 32, "alpha": 64.0},
            "env": {"name": "support.padded_world:make_env"},
            "rollout": {"prompts_per_step": 1, "group_size": 2, "max_new_tokens": new},
            "advantages": {"priorities": {"core": 3.0}, "floor": -1e9},
            "loss": {"kind": "cispo", "repo_r": True, "passes": 2, "token_mask": "all"},
            "optim": {"micro_batch": 2}, "probe": {"every": 0}})
        return Trainer(cfg, progress=False), f"{model} ({layers} layers), {new} new tokens", 1
    make.__name__ = f"long_{model}_{new}"
    make.warm = False
    return make


LONG = (("smollm2-135m", 2), ("qwen3.5-bench-100m", 4))
MOE = (("qwen3-30b-a3b", "qwen3_30b_a3b_policy"), ("qwen3.5-35b-a3b", "qwen3_5_35b_a3b_policy"))
MOE_RUN = {"new": 32}


def moe_case(name: str, policy: str):
    """(a factory of) a MoE case: the bundled `name` at small width (tests/support/moe_scaled.py, its SIZE
    set from the command line), the padded letters world, 2 prompts x 4 answers, micro-batch 4."""
    def make(out: Path):
        from support import moe_scaled
        from support.recipes import tiny_recipe
        from fasttrain.train import Trainer, load_config

        r = tiny_recipe(out, 2, 4, MOE_RUN["new"], 4)
        r["policy"].update(model=f"support.moe_scaled:{policy}", rank=8, alpha=16.0)
        r["loss"]["passes"] = 1
        r["probe"]["every"] = 0
        z = moe_scaled.SIZE
        label = f"{name} at hidden {z['hidden']}, {z['experts']} experts max ({z['layers'] or 'default'} layers)"
        return Trainer(load_config(r), progress=False), label, 1
    make.__name__ = f"moe_{policy}"
    return make


def table(res: dict) -> list[str]:
    ratio = res["planned"] / res["measured"]
    lines = [f"### {res['label']}: {res['shape']}, one thread, CPU seconds of {res['steps']} step(s)", "",
             "| phase | planned s | measured s |", "|---|---:|---:|"]
    lines += [f"| {p} | {res['by_phase'][p]:.3f} | {res['cpu'].get(p, 0.0):.3f} |" for p in PHASES]
    lines += [f"| step | {res['planned']:.3f} | {res['measured']:.3f} |", "",
              f"planned / measured {ratio:.2f} ({'within' if abs(ratio - 1) <= GOAL else 'outside'} the "
              f"{GOAL:.0%} goal). {res['assumption']}", ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--all", action="store_true", help="also the demo and the study shape on SmolLM2-135M")
    ap.add_argument("--long", default="", help="comma-separated new-token counts: only the long-answer cases")
    ap.add_argument("--moe", action="store_true", help="only the mixtures of experts (qwen3-30b-a3b, qwen3.5-35b-a3b "
                                                       "at small width)")
    ap.add_argument("--moe-hidden", type=int, default=256)
    ap.add_argument("--moe-experts", type=int, default=32, help="at most this many experts (at least top-k)")
    ap.add_argument("--moe-layers", type=int, default=0, help="0: 2 (qwen3-30b-a3b), 4 (qwen3.5-35b-a3b)")
    ap.add_argument("--moe-new", type=int, default=32, help="new tokens per answer")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    out = [f"## {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {machine_name()}, "
           f"load average {load:.1f} at the start (cores: {os.cpu_count()})", ""]
    cases = [tiny_case] + ([demo_case, study_case] if args.all else [])
    if args.long:
        cases = [long_case(m, n, int(t)) for t in args.long.split(",") for m, n in LONG]
    if args.moe:
        from support import moe_scaled
        moe_scaled.SIZE.update(hidden=args.moe_hidden, experts=args.moe_experts, layers=args.moe_layers)
        MOE_RUN["new"] = args.moe_new
        cases = [moe_case(name, policy) for name, policy in MOE]
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            trainer, label, steps = case(Path(tmp) / case.__name__)
            lines = table(planned_vs_measured(trainer, label, steps, warm=getattr(case, "warm", True)))
            print("\n".join(lines), flush=True)
            out += lines
    path = RESULTS / f"{machine_name()}-{dt.date.today().isoformat()}-planned-time.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("\n".join(out) + "\n")
    print(f"appended to {path}")


if __name__ == "__main__":
    main()
