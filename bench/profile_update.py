"""Where the update's time goes at the study's shape: op shares and the matmul share of one step's
scoring (the reference forward) and update (forward + backward + optimizer), fasttrain's trainer as
bench_step.py builds it.

    PYTHONPATH=python python bench/profile_update.py [--model smollm2-135m|qwen3.5-bench-100m] [--rows 30]

Method: one warm-up step (rollout + scoring + update) on the bench_step configuration, then the
next step's scoring and update run under torch.profiler (the rollout is not profiled). Prints the
ops by self time (the two phases' profiles summed), the share of the wall time spent in GEMMs (aten::mm, addmm, bmm, baddbmm,
_grouped_mm and fasttrain's own NF4 GEMMs), the model FLOPs of the update as bench_step counts
them (bench_step.update_flops) over the update's wall time, and that rate against this host's
2048^3 matmul in the update's dtype (harness.matmul_gflops). Profiling adds a little overhead per
op; the wall times printed are the profiled ones.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import bench_step as bs  # noqa: E402
from harness import host_precision, machine_name, matmul_gflops  # noqa: E402

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "fasttrain::")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=bs.MODELS, default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=30, help="ops to print")
    ap.add_argument("--checkpointing", choices=["auto", "on", "off"], default="on",
                    help="policy.gradient_checkpointing (bench_step's --checkpointing)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="the policy's dtype before NF4 (what bench_step's --fasttrain-dtype sets); auto: bf16 "
                    "where the host computes bf16 natively, else fp32 (bench_step's choice)")
    ap.add_argument("--shapes", action="store_true", help="also print the GEMMs by input shape")
    ap.add_argument("--shape-ops", default="", help="comma-separated ops (e.g. aten::copy_) also printed by "
                    "input shape; implies recording shapes")
    ap.add_argument("--trace", default="", help="also write a Chrome trace of the profiled phases here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = host_precision()[0] if args.dtype == "auto" else args.dtype
    a = SimpleNamespace(model=args.model, device="cpu", seed=0, warmup=1, steps=1, fasttrain_dtype=dtype,
                        rank=32, alpha=64, quantize="nf4", prompts=4, group=12, new=64, cap=1.2, beta=0.08,
                        lr=1e-5, micro_batch=12, checkpointing=args.checkpointing)
    import fasttrain.train.trainer as T
    from torch.profiler import ProfilerActivity, profile
    env, prompts = bs.step_prompts(a)
    shapes = bs.capture_rollout_shapes()
    walls: dict[str, float] = {}
    state = {"prof": None}
    profs: dict = {}
    originals = {"score_batch": T.score_batch, "update_policy": T.update_policy}

    def wrapped(name):
        def run(*args_, **kw):
            t0 = time.perf_counter()
            if state["prof"] is None:
                return originals[name](*args_, **kw)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes or bool(args.shape_ops)) as prof:
                out = originals[name](*args_, **kw)
            walls[name] = time.perf_counter() - t0
            profs[name] = prof
            return out
        return run
    T.score_batch, T.update_policy = wrapped("score_batch"), wrapped("update_policy")
    with tempfile.TemporaryDirectory() as tmp:
        sel = Path(tmp) / "selection.json"
        sel.write_text(json.dumps({"prompt_ids": [p.id for p in prompts]}))
        tr = T.Trainer(bs.fasttrain_config(a, tmp, str(sel)), Path(tmp) / "run", progress=False)
        tr._setup()
        tr._train_step(1)                                    # warm-up
        state["prof"] = True                                 # the next step's two phases are profiled
        tr._train_step(2)
        state["prof"] = None
        shape = shapes[-1]
        flops = bs.update_flops(tr.model, shape, a)
    if args.trace:
        for name, prof in profs.items():
            prof.export_chrome_trace(f"{args.trace}.{name}.json")
    rows: dict[str, list] = {}                  # op -> [self s, calls], both phases together
    for prof in profs.values():
        for e in prof.key_averages():
            r = rows.setdefault(e.key, [0.0, 0])
            r[0] += e.self_cpu_time_total / 1e6
            r[1] += e.count
    total_self = sum(r[0] for r in rows.values())
    gemm = sum(r[0] for k, r in rows.items() if k.startswith(GEMMS))
    wall = walls["score_batch"] + walls["update_policy"]
    mm_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    rate = statistics.median(matmul_gflops(mm_dtype, n=2048, reps=3) for _ in range(2))
    print(f"profile_update: {args.model}, {machine_name()}, {torch.get_num_threads()} threads, "
          f"rollout B={shape['B']} P={shape['P']} T={shape['T']} answer tokens {shape['answer_tokens']}")
    from fasttrain.train.policy import checkpointing_on
    print(f"gradient checkpointing {'on' if checkpointing_on(tr.model) else 'off'} "
          f"(policy.gradient_checkpointing={tr.cfg.policy.gradient_checkpointing})")
    print(f"wall (profiled): scoring {walls['score_batch']:.2f} s, update {walls['update_policy']:.2f} s")
    print(f"self time in ops {total_self:.2f} s (CPU time of the main thread; ops run on {torch.get_num_threads()} "
          f"threads inside); GEMMs {gemm:.2f} s = {100 * gemm / total_self:.0f}% of op self time")
    print(f"model FLOPs (bench_step.update_flops) {flops / 1e12:.2f} TFLOP in {wall:.1f} s = "
          f"{flops / wall / 1e9:.0f} GFLOP/s; {dtype} 2048^3 matmul {rate:.0f} GFLOP/s: {100 * flops / wall / 1e9 / rate:.0f}%")
    print(f"{'op':60s} {'self s':>8s} {'share':>6s} {'calls':>7s}")
    for k, (sec, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.rows]:
        print(f"{k[:60]:60s} {sec:8.2f} {100 * sec / total_self:5.1f}% {n:7d}")
    if args.shapes:
        by_shape: dict[tuple, list] = {}
        for prof in profs.values():
            for e in prof.key_averages(group_by_input_shape=True):
                if e.key.startswith(GEMMS):
                    r = by_shape.setdefault((e.key, str(e.input_shapes)), [0.0, 0])
                    r[0] += e.self_cpu_time_total / 1e6
                    r[1] += e.count
        print(f"\nGEMMs by input shape ({'self s':>6s}, calls, GFLOP/s where the shapes say)")
        for (k, shp), (sec, n) in sorted(by_shape.items(), key=lambda kv: -kv[1][0])[:args.rows]:
            print(f"{sec:7.2f} s {n:6d}  {_gemm_rate(k, shp, sec, n):>8s}  {k} {shp}")
    for op in filter(None, args.shape_ops.split(",")):
        by_shape = {}
        for prof in profs.values():
            for e in prof.key_averages(group_by_input_shape=True):
                if e.key == op:
                    r = by_shape.setdefault(str(e.input_shapes), [0.0, 0])
                    r[0] += e.self_cpu_time_total / 1e6
                    r[1] += e.count
        print(f"\n{op} by input shape (self s, calls)")
        for shp, (sec, n) in sorted(by_shape.items(), key=lambda kv: -kv[1][0])[:args.rows]:
            print(f"{sec:7.2f} s {n:6d}  {shp}")
    return 0


def _gemm_rate(key: str, shapes: str, sec: float, calls: int) -> str:
    """GFLOP/s of an aten::mm/addmm/bmm row from its recorded input shapes, '' where unknown."""
    import ast
    try:
        s = ast.literal_eval(shapes)
    except (ValueError, SyntaxError):
        return ""
    a, b = (s[1], s[2]) if key in ("aten::addmm", "aten::baddbmm") else (s[0], s[1])
    if key in ("aten::mm", "aten::addmm") and len(a) == 2 and len(b) == 2:
        flops = 2 * a[0] * a[1] * b[1]
    elif key in ("aten::bmm", "aten::baddbmm") and len(a) == 3 and len(b) == 3:
        flops = 2 * a[0] * a[1] * a[2] * b[2]
    else:
        return ""
    return f"{flops * calls / max(sec, 1e-9) / 1e9:.0f}"


if __name__ == "__main__":
    sys.exit(main())
