"""The decode step eager against compiled (rollout.compile), side by side in one process, and where
an eager decode step's time goes (torch.profiler): the evidence behind rollout.compile = "auto".

    PYTHONPATH=python python bench/bench_compiled_decode.py --model smollm2 --dtype bf16
        [--prompts 4 --group 12 --new 32 --reps 3] [--profile] [--no-compile] [--csv FILE]

Models: smollm2 (the bundled SmolLM2-135M-Instruct), hybrid (the pinned ~100M Qwen3.5-shaped
benchmark model, models/configs/qwen3.5-bench-100m.json), moe (the pinned Qwen3-MoE benchmark
model); all plain (no NF4, no adapter: the decode step a run with dense rollout weights takes).
Prompts: the first --prompts of the signal-a environment, --group answers each, temperature 1,
no EOS (every row decodes --new tokens).

What it measures: decode ms/step = (T-token rollout - 1-token rollout) / (T - 1), for eager and
compiled, the two interleaved in each of --reps rounds so a busy machine slows both alike; the
ratio compiled / eager is the median of the per-round ratios. The compile (first call per batch
shape, plus its first run) is printed apart. Both sides' tokens are compared (same seed).

--profile: torch.profiler over one eager rollout of --new tokens, the sampler's own pieces
labelled (prefill, each decode step's layers + lm_head, the rest of the loop: sampling, stopping,
bookkeeping). Per decode step it prints the step's wall time, the time its top-level ATen ops
take (the union of their intervals) and the rest, Python and dispatch between ops, and the same
for the sampling part of the loop; then the top-level ops of the loop outside the layers.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import host_precision, machine_name, row, write_csv  # noqa: E402


def load(name: str, dtype: torch.dtype):
    if name == "smollm2":
        from fasttrain.models import load_policy
        return load_policy(dtype=dtype)
    from fasttrain.models.bench_model import qwen3_5_bench, qwen3_moe_bench
    build = {"hybrid": qwen3_5_bench, "moe": qwen3_moe_bench}[name]
    model, tok = build(dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    return model.eval(), tok


def prompts_of(tok, n: int):
    from fasttrain.envs import load_env
    from fasttrain.models import chat_prompt_ids
    env = load_env("signal-a")
    return [chat_prompt_ids(tok, p.spec, env.answer_format) for p in env.prompts("train")[:n]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "hybrid", "moe"], default="smollm2")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=12)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="profile one eager rollout's decode steps")
    ap.add_argument("--no-compile", action="store_true", help="only the profile (no compiled side)")
    ap.add_argument("--busy", action="store_true", help="mark the rows busy (the machine is shared)")
    ap.add_argument("--csv", default="")
    a = ap.parse_args()
    from fasttrain.rollout import sample

    dtype = torch.float32 if a.dtype == "fp32" else torch.bfloat16
    model, tok = load(a.model, dtype)
    prompts = prompts_of(tok, a.prompts)
    G, T = a.group, a.new
    print(f"{a.model} {a.dtype}, {len(prompts)} prompts x {G} = batch {len(prompts) * G}, prompt len "
          f"~{max(map(len, prompts))}, {T} new tokens, {torch.get_num_threads()} threads, {machine_name()} "
          f"({host_precision()[1]}), load {os.getloadavg()[0]:.1f}" + (" BUSY" if a.busy else ""), flush=True)

    def run(n, compiled):
        return sample(model, prompts, group_size=G, max_new_tokens=n, temperature=1.0, eos_token_ids=[], seed=0,
                      pad_token_id=tok.pad_token_id, compile=compiled)

    rows = []
    case = f"{a.model}-{len(prompts)}x{G}x{T}-{a.dtype}"
    extra = {"busy": "yes" if a.busy else "no"}
    with torch.inference_mode():
        if a.profile:
            profile(run, T)
        if a.no_compile:
            return
        sides = [False, True]
        ref = {}
        t0 = time.perf_counter()
        for c in sides:
            t0 = time.perf_counter()
            ref[c] = run(T, c)
            if c:
                from fasttrain.rollout.compiled_decode import compiled_decode
                cs = compiled_decode(model, None).compile_seconds
                print(f"  warm-up compiled: {time.perf_counter() - t0:.1f} s (compile + first run {cs:.1f} s)",
                      flush=True)
                rows.append(row("compiled_decode", case, "compiled", "compile_s", cs, "s", **extra))
        same = torch.equal(ref[False].completion_ids, ref[True].completion_ids)
        gap = float((ref[False].logprobs - ref[True].logprobs).abs().max())
        print(f"  same tokens eager/compiled: {same}; max |logp eager - compiled| {gap:.2e}", flush=True)
        steps = {c: [] for c in sides}
        for _ in range(a.reps):
            for c in sides:
                t0 = time.perf_counter()
                run(T, c)
                full = time.perf_counter() - t0
                t0 = time.perf_counter()
                run(1, c)
                one = time.perf_counter() - t0
                steps[c].append((full - one) / max(T - 1, 1))
    ratios = [c / e for e, c in zip(steps[False], steps[True])]
    med = {c: statistics.median(v) for c, v in steps.items()}
    r = statistics.median(ratios)
    print(f"  decode ms/step  eager {med[False] * 1e3:8.2f}  compiled {med[True] * 1e3:8.2f}  "
          f"compiled/eager {r:.3f} (per round: {', '.join(f'{x:.3f}' for x in ratios)})", flush=True)
    for c in sides:
        rows.append(row("compiled_decode", case, "compiled" if c else "eager", "decode_ms_per_step",
                        med[c] * 1e3, "ms", **extra))
    rows.append(row("compiled_decode", case, "compiled/eager", "ratio", r, "x", **extra))
    if a.csv:
        write_csv(rows, Path(a.csv))


def profile(run, T: int) -> None:
    """One eager rollout of T tokens under torch.profiler, its parts labelled by wrapping the
    sampler's prefill and the decoder's decode/lm_head (the wrappers add one record_function each)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    import fasttrain.rollout.sampling as S
    from fasttrain.rollout.families import DECODERS

    patched = []

    def wrap(owner, name, label):
        f = getattr(owner, name)

        def g(*args, **kw):
            with record_function(label):
                return f(*args, **kw)
        setattr(owner, name, g)
        patched.append((owner, name, f))

    run(2, False)                                             # warm-up
    wrap(S, "prefill_in_chunks", "ft::prefill")
    for cls in set(DECODERS.values()):
        if "decode" in cls.__dict__:
            wrap(cls, "decode", "ft::decode")
    try:
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("ft::sample"):
                t0 = time.perf_counter()
                run(T, False)
                wall = time.perf_counter() - t0
    finally:
        for owner, name, f in reversed(patched):
            setattr(owner, name, f)
    ev = prof.events()
    by = {}
    for e in ev:
        by.setdefault(e.name, []).append(e)
    sample_ev = by["ft::sample"][0]
    prefill = by.get("ft::prefill", [])
    decodes = by.get("ft::decode", [])

    def interval(e):
        return e.time_range.start, e.time_range.end

    def union(iv):
        iv = sorted(iv)
        tot, cur = 0.0, None
        for s, t in iv:
            if cur is None or s > cur[1]:
                if cur:
                    tot += cur[1] - cur[0]
                cur = [s, t]
            else:
                cur[1] = max(cur[1], t)
        return tot + (cur[1] - cur[0] if cur else 0.0)

    def aten_children(parent):
        out, stack = [], list(parent.cpu_children)
        while stack:
            e = stack.pop()
            if e.name.startswith("aten::"):
                out.append(e)
            else:
                stack.extend(e.cpu_children)        # our labels / python scopes: look inside
        return out

    dec_wall = sum(e.time_range.elapsed_us() for e in decodes)
    dec_ops = sum(union([interval(c) for c in aten_children(e)]) for e in decodes)
    pre_wall = sum(e.time_range.elapsed_us() for e in prefill)
    s0, s1 = interval(sample_ev)
    # the loop outside the layers: the sample's top-level ops that are not inside a prefill/decode label
    inside = [interval(e) for e in prefill + decodes]

    def outside(e):
        a, b = interval(e)
        return not any(x <= a and b <= y for x, y in inside)
    loop_ops = [c for c in aten_children(sample_ev) if outside(c)]
    n = max(len(decodes), 1)
    total = s1 - s0
    loop_wall = total - pre_wall - dec_wall
    loop_op_t = union([interval(c) for c in loop_ops])
    print(f"  profile: eager rollout {wall * 1e3:.1f} ms ({total / 1e3:.1f} ms profiled), prefill "
          f"{pre_wall / 1e3:.1f} ms, {len(decodes)} decode steps")
    print(f"    decode layers + head per step: {dec_wall / n / 1e3:8.3f} ms wall, ATen ops {dec_ops / n / 1e3:8.3f} ms,"
          f" Python/dispatch between ops {(dec_wall - dec_ops) / n / 1e3:8.3f} ms "
          f"({(dec_wall - dec_ops) / max(dec_wall, 1):.1%}); {sum(len(aten_children(e)) for e in decodes) / n:.0f} "
          f"top-level ops")
    print(f"    rest of the loop per step (sampling, stopping, bookkeeping): {loop_wall / n / 1e3:8.3f} ms wall, "
          f"ATen ops {loop_op_t / n / 1e3:8.3f} ms, between ops {(loop_wall - loop_op_t) / n / 1e3:8.3f} ms; "
          f"{len(loop_ops) / n:.0f} top-level ops")
    agg = {}
    for c in loop_ops:
        k = agg.setdefault(c.name, [0, 0.0])
        k[0] += 1
        k[1] += c.time_range.elapsed_us()
    for name, (cnt, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"      {name:34s} {cnt / n:5.1f} per step  {us / n / 1e3:7.3f} ms per step")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
