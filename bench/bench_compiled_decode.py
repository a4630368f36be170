"""The decode step eager against compiled (rollout.compile), side by side in one process, and where
an eager decode step's time goes (torch.profiler): the evidence behind rollout.compile = "auto".

    PYTHONPATH=python python bench/bench_compiled_decode.py --model smollm2 --dtype bf16
        [--prompts 4 --group 12 --new 32 --reps 3] [--profile] [--no-compile] [--csv FILE]

Models: smollm2 (the bundled SmolLM2-135M-Instruct), hybrid (the pinned ~100M Qwen3.5-shaped
benchmark model, models/configs/qwen3.5-bench-100m.json), moe (the pinned Qwen3-MoE benchmark
model); all plain (no NF4, no adapter: the decode step a run with dense rollout weights takes).
Prompts: the first --prompts of the signal-a environment, --group answers each, temperature 1, one
seed per prompt (as the trainer: the noise of the groups is drawn side by side on the threads),
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
    if name == "moe":                        # fasttrain's expert blocks (the rollout records their routing)
        from fasttrain.models.moe import moe_surgery
        moe_surgery(model, nf4=False)
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
    seeds = list(range(len(prompts)))        # one generator per prompt, as the trainer seeds them
    print(f"{a.model} {a.dtype}, {len(prompts)} prompts x {G} = batch {len(prompts) * G}, prompt len "
          f"~{max(map(len, prompts))}, {T} new tokens, {torch.get_num_threads()} threads, {machine_name()} "
          f"({host_precision()[1]}), load {os.getloadavg()[0]:.1f}" + (" BUSY" if a.busy else ""), flush=True)

    def run(n, compiled):
        return sample(model, prompts, group_size=G, max_new_tokens=n, temperature=1.0, eos_token_ids=[], seed=seeds,
                      pad_token_id=tok.pad_token_id, compile=compiled)

    rows = []
    case = f"{a.model}-{len(prompts)}x{G}x{T}-{a.dtype}"
    extra = {"busy": "yes" if a.busy else "no"}
    with torch.inference_mode():
        if a.profile:
            profile(run, T, model)
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


def profile(run, T: int, model) -> None:
    """One eager rollout of T tokens under torch.profiler, its parts labelled: the sampler's prefill,
    each decode step's layers (the decoder class's own `decode`) and the head (hooks on
    model.lm_head); what is left of the loop is sampling, stopping and bookkeeping."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    import fasttrain.rollout.sampling as S
    from fasttrain.rollout.families import decoder_for

    cls = type(decoder_for(model))
    own = "decode" in cls.__dict__
    f_decode, f_prefill = cls.decode, S.prefill_in_chunks

    def decode(*args, **kw):
        with record_function("ft::decode"):
            return f_decode(*args, **kw)

    def prefill(*args, **kw):
        with record_function("ft::prefill"):
            return f_prefill(*args, **kw)
    head_scope = []

    def pre(mod, args):
        head_scope.append(record_function("ft::head"))
        head_scope[-1].__enter__()

    def post(mod, args, out):
        head_scope.pop().__exit__(None, None, None)

    run(2, False)                                             # warm-up
    cls.decode, S.prefill_in_chunks = decode, prefill
    hooks = [model.lm_head.register_forward_pre_hook(pre), model.lm_head.register_forward_hook(post)]
    try:
        with tprofile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("ft::sample"):
                t0 = time.perf_counter()
                run(T, False)
                wall = time.perf_counter() - t0
    finally:
        for h in hooks:
            h.remove()
        S.prefill_in_chunks = f_prefill
        if own:
            cls.decode = f_decode
        else:
            del cls.decode
    ev = prof.events()
    by: dict[str, list] = {}
    for e in ev:
        by.setdefault(e.name, []).append(e)
    sample_ev = by["ft::sample"][0]
    prefill_ev, decodes, heads = by.get("ft::prefill", []), by.get("ft::decode", []), by.get("ft::head", [])

    def interval(e):
        return e.time_range.start, e.time_range.end

    def union(iv) -> float:
        tot, cur = 0.0, None
        for s, t in sorted(iv):
            if cur is None or s > cur[1]:
                if cur:
                    tot += cur[1] - cur[0]
                cur = [s, t]
            else:
                cur[1] = max(cur[1], t)
        return tot + (cur[1] - cur[0] if cur else 0.0)

    def aten_under(parent):
        """The outermost ATen ops under `parent` (looking through labels and other scopes)."""
        out, stack = [], list(parent.cpu_children)
        while stack:
            e = stack.pop()
            (out.append(e) if e.name.startswith("aten::") else stack.extend(e.cpu_children))
        return out

    def wall_of(evs) -> float:
        return sum(e.time_range.elapsed_us() for e in evs)

    def ops_of(evs) -> float:
        return sum(union([interval(c) for c in aten_under(e)]) for e in evs)
    labelled = [interval(e) for e in prefill_ev + decodes + heads]

    def outside(e) -> bool:
        a, b = interval(e)
        return not any(x <= a and b <= y for x, y in labelled)
    loop_ops = [c for c in aten_under(sample_ev) if outside(c)]
    s0, s1 = interval(sample_ev)
    n = max(len(decodes), 1)
    pre_w = wall_of(prefill_ev)
    dec_w, dec_o = wall_of(decodes), ops_of(decodes)
    head_w, head_o = wall_of(heads), ops_of(heads)
    loop_w = (s1 - s0) - pre_w - dec_w - head_w
    loop_o = union([interval(c) for c in loop_ops])
    ms = 1e3
    print(f"  profile: eager rollout {wall * 1e3:.1f} ms ({(s1 - s0) / ms:.1f} ms profiled), prefill {pre_w / ms:.1f} ms, "
          f"{len(decodes)} decode steps, {len(heads)} head calls; per decode step:")
    for name, w, o, k in (("layers (decode)", dec_w, dec_o, sum(len(aten_under(e)) for e in decodes)),
                          ("head (lm_head)", head_w, head_o, sum(len(aten_under(e)) for e in heads)),
                          ("rest of the loop", loop_w, loop_o, len(loop_ops))):
        print(f"    {name:18s} {w / n / ms:8.3f} ms wall  ATen ops {o / n / ms:8.3f} ms  between ops "
              f"{(w - o) / n / ms:7.3f} ms ({(w - o) / max(w, 1e-9):5.1%})  {k / n:6.1f} top-level ops")
    agg: dict[str, list] = {}
    for c in loop_ops:
        k = agg.setdefault(c.name, [0, 0.0])
        k[0] += 1
        k[1] += c.time_range.elapsed_us()
    pool = [e for e in by.get("aten::exponential_", []) if e.thread != sample_ev.thread]
    if pool:     # per-prompt generators draw on the noise pool's threads; the loop waits (between ops)
        print(f"    noise drawn on the pool's threads: {union([interval(e) for e in pool]) / n / ms:.3f} ms per step "
              f"(wall, {len(pool) / n:.1f} draws), inside 'between ops' of the rest of the loop")
    print("    the rest of the loop's ops (per decode step; includes the last step's sampling and the tail):")
    for name, (cnt, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:16]:
        print(f"      {name:34s} {cnt / n:5.1f} calls  {us / n / ms:7.3f} ms")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
