"""Where a small training step's wall time goes outside the kernels, at the learning benchmark's shape
(bench/bench_learning.py's fasttrain worker: 2 prompts x 8 answers, <= 16 new tokens, 2 passes,
SmolLM2-135M, LoRA r16, the starter task).

    PYTHONPATH=python python bench/profile_step_overhead.py [--steps 6] [--algo cispo] [--seed 11]
        [--profile cprofile|torch|none] [--top 40] [--metrics out.jsonl]
    PYTHONPATH=python python bench/profile_step_overhead.py --compare before.jsonl after.jsonl

Method: the worker's own config (bench_learning.fasttrain_config with its defaults) in one process;
every training step's five phases come from its metrics row (seconds_rollout, _verify, _advantages,
_logprob, _update; their sum is seconds_step, the time bench_learning sums). Step 1 is a warm-up
and left out of the shares. With --profile cprofile, steps 2.. run under cProfile (the probe and
checkpoint between steps do not) and the functions are grouped into parts: the torch ops called
from Python (self time of the builtin ops and the C++ extension's calls: the kernels), and the
Python around them, by module. With --profile torch, torch.profiler's op table of the same steps.
--metrics copies the run's metrics.jsonl; --compare A B then checks two such files step by step,
every field but the timings (`seconds_*`) equal (NaN equal to NaN): a change that claims to keep
every number must pass it against a run before the change, with the same --threads.

cProfile adds a cost per Python call, so its shares overstate the Python parts a little; the phase
seconds printed first are the run's own (from a run with --profile none they are unprofiled). cProfile charges a
tensor operator written as Python syntax (a * b, a + b) to the calling function's self time, so
the Python parts are upper bounds; torch.profiler's "outside any op" line is the tighter one. Each
step's minor page faults and user / system CPU seconds are printed too (the allocator's cost shows
in the system share). On a machine shared with other work, trust the shares, not the seconds.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

PHASES = ("rollout", "verify", "advantages", "logprob", "update")


def bench_args(ns) -> argparse.Namespace:
    """bench_learning's defaults for the fasttrain worker, with this script's steps."""
    import bench_learning as bl
    from harness import host_precision
    bl.TASK.clear()
    bl.TASK.update(bl.TASKS["starter"])
    a = argparse.Namespace(steps=ns.steps, quantize="none", rank=16, alpha=32, lr=1e-4, beta=ns.beta, prompts=2,
                           group=8, micro_batch=8, passes=2, new=16, temperature=0.7, save_every=ns.steps,
                           threads=ns.threads, trl_conventions=False, precision=ns.precision,
                           top_p=1.0, top_k=0, replay="on")
    if a.precision == "auto":
        a.precision = host_precision()[0]
    return a


# torch.profiler's ops by what they do (first match wins); self CPU time summed per group
OP_GROUPS = (
    ("fused log-prob (fasttrain)", ("fused_logprob",)),
    ("attention", ("attention", "scaled_dot_product", "_MaskedAttention", "softmax")),
    ("GEMMs", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn::_linear_pointwise", "aten::linear",
               "aten::matmul")),
    ("rollout weight packing", ("_reorder_linear_weight",)),
    ("dtype casts and copies", ("aten::copy_", "aten::_to_copy", "aten::to", "aten::clone", "aten::contiguous")),
    ("allocation", ("aten::empty", "aten::empty_strided", "aten::zeros", "aten::full", "aten::new_")),
    ("views and shape ops", ("aten::view", "aten::reshape", "aten::as_strided", "aten::transpose", "aten::t",
                             "aten::slice", "aten::narrow", "aten::select", "aten::expand", "aten::unsqueeze",
                             "aten::squeeze", "aten::split", "aten::chunk", "aten::permute", "aten::_unsafe_view",
                             "aten::detach", "detach", "aten::alias", "aten::unbind", "aten::flatten")),
    ("optimizer and clipping", ("Optimizer", "_foreach", "aten::addcdiv", "aten::lerp", "aten::sqrt", "aten::norm",
                                "aten::linalg_vector_norm")),
    ("fasttrain fused decode ops", ("fasttrain::",)),
    ("autograd engine nodes", ("autograd::", "Backward")),
)


def op_group(name: str) -> str:
    for label, keys in OP_GROUPS:
        if any(k in name for k in keys):
            return label
    return "other ops (elementwise, norms, sampling)"


def part_of(fn: tuple[str, int, str]) -> str:
    """The part of a step a profiled function belongs to (its self time is charged there)."""
    file, _, name = fn
    if file == "~":                                   # builtins: C functions called from Python
        if "torch._C" in name or "torch._ops" in name or name.startswith("<built-in method torch.") or \
                name.startswith("<built-in method") and ("of torch" in name or "of PyCapsule" in name or "_C." in name
                                                         or "fasttrain" in name):
            return "torch ops and kernels (C++)"
        if "method 'acquire'" in name or "select" in name or "poll" in name or "recv" in name or "read" in name:
            return "waiting (locks, pipes, other processes)"
        return "other builtins"
    p = file.replace("\\", "/")
    if p.endswith("/torch/_ops.py"):                   # an op's Python face: its self time is the C++ call
        return "torch ops and kernels (C++)"
    for key, label in (("/fasttrain/rollout/", "fasttrain.rollout (Python)"),
                       ("/fasttrain/ops/", "fasttrain.ops (Python)"),
                       ("/fasttrain/nn/", "fasttrain.nn (Python)"),
                       ("/fasttrain/models/", "fasttrain.models (Python)"),
                       ("/fasttrain/envs/", "fasttrain.envs (Python)"),
                       ("/fasttrain/rl/", "fasttrain.rl (Python)"),
                       ("/fasttrain/train/", "fasttrain.train (Python)"),
                       ("/fasttrain/", "fasttrain other (Python)"),
                       ("/torch/optim/", "torch.optim (Python)"),
                       ("/torch/autograd/", "torch.autograd (Python)"),
                       ("/torch/nn/", "torch.nn (Python)"),
                       ("/torch/", "torch other (Python)"),
                       ("/tokenizers/", "tokenizers"), ("/transformers/", "transformers (Python)"),
                       ("/multiprocessing/", "multiprocessing"), ("/concurrent/", "concurrent"),
                       ("/json/", "json"), ("/numpy/", "numpy (Python)")):
        if key in p:
            return label
    if "/starter/" in p or "rewards" in p:
        return "reward functions"
    return "other Python"


def compare_metrics(a_path: str, b_path: str) -> int:
    """Print where two metrics.jsonl files differ (timing fields excluded); 0 when they agree."""
    def rows(p):
        return [json.loads(x) for x in Path(p).read_text().splitlines() if x.strip()]

    def same(x, y):
        return x == y or (isinstance(x, float) and isinstance(y, float) and x != x and y != y)
    a, b = rows(a_path), rows(b_path)
    bad = 0
    for ra, rb in zip(a, b):
        keys = {k for k in ra.keys() | rb.keys() if not k.startswith("seconds")}
        for k in sorted(keys):
            if k not in ra or k not in rb or not same(ra[k], rb[k]):
                bad += 1
                print(f"step {ra.get('step')}: {k}: {ra.get(k)!r} != {rb.get(k)!r}")
    n = min(len(a), len(b))
    print(f"{n} steps compared (timing fields excluded): {'identical' if not bad else f'{bad} differences'}")
    return 1 if bad or n == 0 else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--algo", choices=["cispo", "dapo"], default="cispo")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--beta", type=float, default=0.08)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    ap.add_argument("--profile", choices=["cprofile", "torch", "none"], default="cprofile")
    ap.add_argument("--top", type=int, default=40, help="functions printed by self time and by cumulative time")
    ap.add_argument("--metrics", help="copy the run's metrics.jsonl here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="only compare two metrics.jsonl files "
                    "(timing fields excluded) and exit 1 where they differ")
    ap.add_argument("--mark", action="store_true", help="print a line '== step N ==' on stdout as each step "
                    "starts (to split a log such as ONEDNN_VERBOSE=profile_create's by step)")
    ap.add_argument("--stats", help="write the cProfile stats here (pstats format)")
    ns = ap.parse_args()
    if ns.compare:
        return compare_metrics(*ns.compare)
    import bench_learning as bl

    from fasttrain.train.trainer import Trainer
    a = bench_args(ns)
    out = Path(tempfile.mkdtemp(prefix="profile-step-"))
    tr = Trainer(bl.fasttrain_config(a, ns.seed, ns.algo, str(out)), progress=False)
    prof = cProfile.Profile() if ns.profile == "cprofile" else None
    tprof = None
    walls: list[float] = []
    faults: list[int] = []
    cpu: list[tuple[float, float]] = []          # (user, system) CPU seconds of each step
    inner = tr._train_step

    def step(s: int):
        nonlocal tprof
        on = s > 1
        if ns.mark:
            print(f"== step {s} ==", flush=True)
        t = time.perf_counter()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        if on and prof is not None:
            prof.enable()
        if on and ns.profile == "torch" and tprof is None:
            from torch.profiler import ProfilerActivity, profile
            tprof = profile(activities=[ProfilerActivity.CPU])
            tprof.__enter__()
        try:
            return inner(s)
        finally:
            if on and prof is not None:
                prof.disable()
            walls.append(time.perf_counter() - t)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            faults.append(r1.ru_minflt - r0.ru_minflt)
            cpu.append((r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime))

    tr._train_step = step
    t0 = time.perf_counter()
    tr.train()
    total = time.perf_counter() - t0
    if tprof is not None:
        tprof.__exit__(None, None, None)
    rows = [json.loads(x) for x in (tr.dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if ns.metrics:
        shutil.copy(tr.dir / "metrics.jsonl", ns.metrics)
    tr.env.close()
    timed = rows[1:]
    step_s = sum(r["seconds_step"] for r in timed)
    print(f"{len(rows)} steps ({ns.algo}, seed {ns.seed}, {a.precision}); process {total:.1f} s; "
          f"steps 2..{len(rows)}: seconds_step sum {step_s:.2f} s, median {statistics.median(r['seconds_step'] for r in timed):.2f} s, "
          f"profiled wall {sum(walls[1:]):.2f} s")
    print(f"per step: minor page faults {faults}; CPU seconds user "
          f"{[round(u, 2) for u, _ in cpu]}, system {[round(s, 2) for _, s in cpu]} (system: the kernel's "
          f"share, page faults and memory mapping included); steps 2..: system "
          f"{100 * sum(s for _, s in cpu[1:]) / max(1e-9, sum(u + s for u, s in cpu[1:])):.1f}% of the CPU time")
    print("| phase | s (sum, steps 2..) | share of seconds_step |\n|---|---:|---:|")
    for ph in PHASES:
        v = sum(r[f"seconds_{ph}"] for r in timed)
        print(f"| {ph} | {v:.2f} | {100 * v / step_s:.1f}% |")
    if prof is not None:
        st = pstats.Stats(prof)
        if ns.stats:
            st.dump_stats(ns.stats)
        parts: dict[str, float] = {}
        for fn, (cc, nc, tt, ct, callers) in st.stats.items():
            parts[part_of(fn)] = parts.get(part_of(fn), 0.0) + tt
        tot = sum(parts.values())
        print(f"\ncProfile self time by part (steps 2..; {tot:.2f} s profiled)\n| part | s | share |\n|---|---:|---:|")
        for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v:.2f} | {100 * v / tot:.1f}% |")
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(ns.top)
            print(f"\n--- by {key} ---")
            print("\n".join(buf.getvalue().splitlines()[4:]))
    if tprof is not None:
        groups: dict[str, float] = {}
        for ev in tprof.key_averages():
            groups[op_group(ev.key)] = groups.get(op_group(ev.key), 0.0) + ev.self_cpu_time_total / 1e6
        wall = sum(walls[1:])
        inside = sum(groups.values())
        print(f"\ntorch.profiler self CPU time by group (steps 2..; {wall:.2f} s wall)\n| group | s | share of wall |\n"
              "|---|---:|---:|")
        for k, v in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v:.2f} | {100 * v / wall:.1f}% |")
        print(f"| outside any op (Python between ops, the profiler's own cost) | {max(0.0, wall - inside):.2f} | "
              f"{100 * max(0.0, wall - inside) / wall:.1f}% |")
        # fasttrain's own ops call ATen inside (their GEMMs count as GEMMs above): their inclusive time too
        incl = {ev.key: ev.cpu_time_total / 1e6 for ev in tprof.key_averages()
                if ev.key.startswith("fasttrain::") or "fused_logprob" in ev.key or "MaskedAttention" in ev.key}
        print("\nfasttrain's ops, inclusive CPU time (their ATen calls included)\n| op | s | share of wall |\n|---|---:|---:|")
        for k, v in sorted(incl.items(), key=lambda kv: -kv[1]):
            print(f"| {k[:70]} | {v:.2f} | {100 * v / wall:.1f}% |")
        print(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=ns.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
