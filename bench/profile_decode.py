"""Where the rollout's decode step spends its time at the study's shape: the op profile of a
rollout of `--new` tokens minus a one-token rollout (so prefill and set-up cancel), fasttrain's
trainer as bench_step.py builds it (its rollout weights, packed where the host packs).

    PYTHONPATH=python python bench/profile_decode.py [--model smollm2-135m|qwen3.5-bench-100m] [--rows 30]
        [--unfused] [--compile] [--dtype auto|bf16|fp32]

Prints the decode step's wall time (median of the unprofiled runs), then the ops by self time per
step (profiled run of T tokens minus profiled run of 1 token, divided by T - 1). Profiling adds a
little per op; the per-step wall time printed first is the unprofiled one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import bench_step as bs  # noqa: E402
from harness import host_precision, machine_name  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=bs.MODELS, default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=30, help="ops to print")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--compile", action="store_true", help="rollout.compile (the compiled decode step)")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                    help="the policy's dtype before NF4 (bench_step's --fasttrain-dtype); auto: bf16 where the host "
                    "computes bf16 natively, else fp32 (bench_step's choice)")
    ap.add_argument("--shapes", action="store_true",
                    help="also print the ops of the T-token run by input shape (per step, prefill included)")
    ap.add_argument("--unfused", action="store_true",
                    help="the decode step through the modules' own elementwise ops (not fasttrain.ops.decode_fused)")
    args = ap.parse_args()
    if args.unfused:
        from fasttrain.rollout.decoder import LlamaFamilyDecoder
        LlamaFamilyDecoder._fused_units = lambda self, tokens: None
    dtype = host_precision()[0] if args.dtype == "auto" else args.dtype
    a = SimpleNamespace(model=args.model, device="cpu", seed=0, warmup=1, steps=1, fasttrain_dtype=dtype,
                        rank=32, alpha=64, quantize="nf4", prompts=4, group=12, new=args.new, cap=1.2, beta=0.08,
                        lr=1e-5, micro_batch=12, checkpointing="on")
    import fasttrain.train.trainer as T
    from torch.profiler import ProfilerActivity, profile

    env, prompts = bs.step_prompts(a)
    with tempfile.TemporaryDirectory() as tmp:
        sel = Path(tmp) / "selection.json"
        sel.write_text(json.dumps({"prompt_ids": [p.id for p in prompts]}))
        cfg = bs.fasttrain_config(a, tmp, str(sel))
        tr = T.Trainer(cfg, Path(tmp) / "run", progress=False)
        tr._setup()
        if args.compile:
            tr.cfg.rollout.compile = True
        R = tr.cfg.rollout
        w = tr.rollout_weights
        ids, run = bs.rollout_timer(tr, prompts[:a.prompts], a.group)
        with torch.inference_mode():
            run(2)
            full = statistics.median(run(args.new) for _ in range(3))
            one = statistics.median(run(1) for _ in range(3))
            step = (full - one) / (args.new - 1)
            profs = {}
            for n in (1, args.new):
                with profile(activities=[ProfilerActivity.CPU], record_shapes=args.shapes) as prof:
                    run(n)
                profs[n] = {e.key: (e.self_cpu_time_total / 1e6, e.count) for e in prof.key_averages()}
                if args.shapes and n == args.new:
                    by_shape = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    print(f"profile_decode: {args.model}, {machine_name()}, {torch.get_num_threads()} threads, "
          f"{len(ids)} prompts x {a.group}, {args.new} new tokens, {dtype}, weights "
          f"{type(w).__name__ if w is not None else 'nf4'}{' packed' if getattr(w, 'packed', False) else ''}"
          f"{', compiled' if R.compile else ''}{', unfused' if args.unfused else ''}")
    print(f"decode step (unprofiled): {1e3 * step:.1f} ms")
    rows = {}
    for k in set(profs[args.new]) | set(profs[1]):
        s1, c1 = profs[1].get(k, (0.0, 0))
        s2, c2 = profs[args.new].get(k, (0.0, 0))
        rows[k] = ((s2 - s1) / (args.new - 1), (c2 - c1) / (args.new - 1))
    total = sum(r[0] for r in rows.values())
    print(f"op self time per step (profiled) {1e3 * total:.1f} ms")
    print(f"{'op':60s} {'ms/step':>8s} {'share':>6s} {'calls/step':>10s}")
    for k, (sec, n) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:args.rows]:
        print(f"{k[:60]:60s} {1e3 * sec:8.2f} {100 * sec / total:5.1f}% {n:10.1f}")
    if args.shapes:
        print(f"\nby input shape, T-token run / T (ms/step, calls/step)")
        for e in by_shape[:args.rows]:
            print(f"  {e.self_cpu_time_total / 1e3 / args.new:8.2f} {e.count / args.new:7.1f}  {e.key} {e.input_shapes}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
