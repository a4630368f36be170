"""Rollout throughput: fasttrain.rollout.sample against transformers `generate`, same model, same
batch (n prompts x G completions), same number of new tokens, same dtype, side by side in one run.

What it measures: wall time of one full rollout (prefill + decode) and new tokens per second.
Both sides sample at temperature 1 with no top-k/top-p and never stop early (generate gets
min_new_tokens = max_new_tokens, sample gets no EOS ids), so both produce exactly n*G*T tokens.
What it is not: a decode-only kernel bench. Two effects add up in the ratio and are reported
apart: (1) sample prefills each distinct prompt once and shares its KV cache across the group
(generate prefills all n*G rows); (2) the per-step decode cost (ms/step, against the floor of one
plain forward of n*G single tokens).

Policy variants (--variants): the same loop on the training policy, NF4 base + LoRA (r 32, B
random so the adapter matters), decoding from the NF4 layers ("nf4") or from dense merged copies
("dequantized", rollout.base_weights), against the plain model ("plain"); --compile adds each
variant with the decode step through torch.compile (compile time printed apart from the steady
state; "dequantized" then holds plain weights, which compile traces, and the variant "packed" is the
eager default's packed copy, run eager only); --profile prints where each policy variant's decode step's time goes (nf4_linear self time is the
dequantisation, its aten::mm children the GEMM; attention, sampling ops, the rest is Python and
small ops). Decode ms/step = (T-token run - 1-token run) / (T - 1), medians of --reps.

Run: python bench/bench_rollout.py [--dtype fp32|bf16] [--prompts 4] [--group 12] [--new 32]
     [--variants plain,nf4,dequantized] [--compile] [--profile] [--skip-generate]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import host_precision, machine_name, row, write_csv  # noqa: E402

from fasttrain.tasks import load_env  # noqa: E402
from fasttrain.models import chat_prompt_ids, load_policy  # noqa: E402
from fasttrain.rollout import sample  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=12)
    ap.add_argument("--new", type=int, default=32, help="max_new_tokens (both sides)")
    ap.add_argument("--csv", default="", help="append long-format rows (bench/harness.py) to this CSV")
    ap.add_argument("--variants", default="", help="comma-separated: plain,nf4,dequantized (policy variants)")
    ap.add_argument("--compile", action="store_true", help="also each variant with the compiled decode step")
    ap.add_argument("--profile", action="store_true", help="op profile of the NF4 + LoRA decode step")
    ap.add_argument("--reps", type=int, default=2, help="measured runs per variant (median)")
    ap.add_argument("--skip-generate", action="store_true", help="only the policy variants")
    args = ap.parse_args()
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    if args.variants:
        variants(args, dtype)
        if args.skip_generate:
            return

    model, tok = load_policy(dtype=dtype)
    env = load_env("signal-a")
    prompts = [chat_prompt_ids(tok, p.spec, env.answer_format)
               for p in env.prompts("train")[:args.prompts]]
    n, G, T = len(prompts), args.group, args.new
    B = n * G
    pad = tok.pad_token_id
    P = max(map(len, prompts))
    print(f"SmolLM2-135M-Instruct {args.dtype}, {n} prompts x {G} = batch {B}, prompt len ~{P}, "
          f"{T} new tokens, {torch.get_num_threads()} threads, {machine_name()} ({host_precision()[1]})")

    with torch.inference_mode():
        # warm-up both paths on a short run (allocator, SDPA kernel selection)
        sample(model, prompts[:1], group_size=2, max_new_tokens=2, eos_token_ids=[], seed=0)

        t0 = time.perf_counter()
        r = sample(model, prompts, group_size=G, max_new_tokens=T, temperature=1.0,
                   eos_token_ids=[], seed=0, pad_token_id=pad)
        ours = time.perf_counter() - t0
        assert r.completion_ids.shape == (B, T)

        # our prefill alone (n distinct prompts) -> decode ms/step by difference
        t0 = time.perf_counter()
        sample(model, prompts, group_size=G, max_new_tokens=1, temperature=1.0,
               eos_token_ids=[], seed=0, pad_token_id=pad)
        ours_prefill = time.perf_counter() - t0
        ours_step = (ours - ours_prefill) / max(T - 1, 1)

        # floor of one decode step: a plain forward of B single tokens, no cache
        one = torch.full((B, 1), 42, dtype=torch.long)
        t0 = time.perf_counter()
        model(one)
        floor = time.perf_counter() - t0

        enc = torch.full((n, P), pad, dtype=torch.long)
        am = torch.zeros((n, P), dtype=torch.long)
        for i, p in enumerate(prompts):
            enc[i, P - len(p):] = torch.tensor(p)
            am[i, P - len(p):] = 1
        torch.manual_seed(0)
        t0 = time.perf_counter()
        out = model.generate(enc, attention_mask=am, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, num_return_sequences=G, max_new_tokens=T,
                             min_new_tokens=T, pad_token_id=pad, eos_token_id=tok.eos_token_id)
        hf = time.perf_counter() - t0
        assert out.shape == (B, P + T), out.shape

    toks = B * T
    ratio = hf / ours
    print(f"{'':28s}{'wall s':>9s}{'new tok/s':>11s}")
    print(f"{'transformers generate':28s}{hf:9.2f}{toks / hf:11.1f}   ({hf / T * 1e3:.0f} ms per new token incl. prefill)")
    print(f"{'fasttrain.rollout.sample':28s}{ours:9.2f}{toks / ours:11.1f}   (prefill {ours_prefill:.2f} s, decode {ours_step * 1e3:.0f} ms/step)")
    print(f"ratio sample / generate: {ratio:.2f}x   decode floor (plain forward of {B} tokens): {floor * 1e3:.0f} ms")

    if args.csv:
        case = f"{n}x{G}x{T}-{args.dtype}"
        extra = {"prompt_len": P, "threads": torch.get_num_threads(), "load_avg": f"{os.getloadavg()[0]:.1f}"}
        write_csv([row("rollout", case, "generate", "tok_per_s", toks / hf, "tok/s", **extra),
                   row("rollout", case, "fasttrain", "tok_per_s", toks / ours, "tok/s", **extra),
                   row("rollout", case, "fasttrain", "decode_ms_per_step", ours_step * 1e3, "ms", **extra),
                   row("rollout", case, "plain_forward", "ms", floor * 1e3, "ms", **extra),
                   row("rollout", case, "fasttrain/generate", "speedup", ratio, "x", **extra)], Path(args.csv))

def variants(args, dtype) -> None:
    """Decode ms/step of the rollout loop on the plain model and on the NF4 + LoRA policy."""
    import copy
    import statistics

    from fasttrain.nn import RolloutWeights, attach_adapters, quantize_model

    plain, tok = load_policy(dtype=dtype)
    env = load_env("signal-a")
    prompts = [chat_prompt_ids(tok, p.spec, env.answer_format) for p in env.prompts("train")[:args.prompts]]
    G, T = args.group, args.new
    policy = copy.deepcopy(plain)
    quantize_model(policy)
    torch.manual_seed(0)
    params = attach_adapters(policy, kind="lora", r=32, alpha=64)
    with torch.no_grad():
        for p in params[1::2]:
            p.normal_(0, 1e-3)                      # B != 0: the adapter changes the output
    t0 = time.perf_counter()
    dense = RolloutWeights(policy, pack=False if args.compile else None)   # compile traces plain weights
    merge_s = time.perf_counter() - t0
    cases = {"plain": (plain, None), "nf4": (policy, None), "dequantized": (policy, dense)}
    if args.compile:     # the eager default beside the compiled step's plain weights: packed where the host packs
        cases["packed"] = (policy, RolloutWeights(policy))
    names = [v for v in args.variants.split(",") if v]
    for v in names:
        if v not in cases:
            raise SystemExit(f"--variants: unknown {v!r}; allowed: {', '.join(cases)}")
    print(f"\npolicy variants ({args.dtype}, {len(prompts)}x{G} rows, {T} new tokens, median of {args.reps}); "
          f"dense merged copy: {dense.nbytes(head=False) / 2**20:.0f} MiB, built in {merge_s:.2f} s (once per optimizer step)")
    rows, base = [], None
    for compiled in ([False, True] if args.compile else [False]):
        for v in names:
            model, w = cases[v]
            if compiled and getattr(w, "packed", False):
                continue                                 # compile traces plain weights only

            def run(n, model=model, w=w):
                return sample(model, prompts, group_size=G, max_new_tokens=n, temperature=1.0, eos_token_ids=[],
                              seed=0, pad_token_id=tok.pad_token_id, weights=w, compile=compiled)
            compile_s = 0.0
            with torch.inference_mode():
                t0 = time.perf_counter()
                run(T)                                   # warm-up (compiles when compiled)
                if compiled:
                    from fasttrain.rollout.compiled_decode import compiled_decode
                    compile_s = compiled_decode(model, w).compile_seconds
                full, one = [], []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    run(T)
                    full.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    run(1)
                    one.append(time.perf_counter() - t0)
            f, o = statistics.median(full), statistics.median(one)
            step = (f - o) / max(T - 1, 1)
            name = v + (" compiled" if compiled else "")
            base = step if base is None else base
            print(f"  {name:24s} rollout {f:8.2f} s  prefill {o:6.2f} s  decode {step * 1e3:8.1f} ms/step"
                  f"  ({step / base:.2f}x plain eager)" + (f"  compile {compile_s:.1f} s" if compiled else ""),
                  flush=True)
            rows.append(row("rollout_variants", f"{len(prompts)}x{G}x{T}-{args.dtype}", name, "decode_ms_per_step",
                            step * 1e3, "ms", load_avg=f"{os.getloadavg()[0]:.1f}"))
            if compiled:
                rows.append(row("rollout_variants", f"{len(prompts)}x{G}x{T}-{args.dtype}", name, "compile_s",
                                compile_s, "s"))
    if args.profile:
        for v in names:
            if v != "plain":
                profile_decode(*cases[v], prompts, G, tok.pad_token_id, v)
    if args.csv:
        write_csv(rows, Path(args.csv))


def profile_decode(policy, weights, prompts, G, pad, name) -> None:
    """Where one NF4 + LoRA decode step's time goes (torch.profiler over 8 decode steps), decoding
    from the NF4 layers (weights None) or from the dense merged copies."""
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode():
        sample(policy, prompts, group_size=G, max_new_tokens=2, eos_token_ids=[], seed=0, pad_token_id=pad,
               weights=weights)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sample(policy, prompts, group_size=G, max_new_tokens=9, eos_token_ids=[], seed=0, pad_token_id=pad,
                   weights=weights)
    ev = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ev)
    print(f"\n{name} rollout profile (prefill + 8 decode steps), self CPU time by op, top 12 of "
          f"{total / 1e6:.2f} s:")
    for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:12]:
        print(f"  {e.key:40s} {e.self_cpu_time_total / 1e6:8.3f} s  {100 * e.self_cpu_time_total / total:5.1f}%"
              f"  calls {e.count}")


if __name__ == "__main__":
    main()
