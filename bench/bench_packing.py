"""Benchmark: the update's forward + backward with the answers packed (fasttrain.train.answer_packing).

One micro-batch of B rows (U prompts of P tokens, B/U answers each) whose answers spread 1:8 in
length (--min-len .. --max-len, evenly spaced, mixed over the prompts) against a micro-batch with
the same number of answer tokens at one length (their mean), both through
fasttrain.train.policy_update.answer_logprobs (the shared-prefix forward, the fused log-prob) and the
backward of a weighted sum of the log-probs, on the policy as the trainer builds it: NF4 base (the
family's 16-bit projections kept), LoRA r=32 alpha=64 on every projection, bf16, gradient
checkpointing on. Also the spread batch in the padded layout (`packed=False`), for contrast. The
cases run interleaved (one repetition of each per round), after a warm-up round; medians.

Target: the spread batch within 15% of the uniform one (packed), where the padded layout pays
for B·(max length) answer tokens.

    python bench/bench_packing.py [--model smollm2-135m|qwen3.5-bench-100m] [--reps 5]
        [--out bench/results/<stem>]   (writes <stem>.csv and appends a section to <stem>.md)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))

from harness import machine_name, row, versions, write_csv  # noqa: E402

FACTORIES = {"qwen3.5-bench-100m": "fasttrain.models.bench_model:qwen3_5_bench"}


def load(name: str):
    if name in FACTORIES:
        import importlib
        mod, _, fn = FACTORIES[name].partition(":")
        return getattr(importlib.import_module(mod), fn)("bfloat16")
    from fasttrain.models import load_policy
    return load_policy(None, dtype=torch.bfloat16)


def policy(name: str):
    """The policy as train/policy.build_policy makes it (NF4, the family's 16-bit projections, LoRA)."""
    from fasttrain.models.families import adapter_targets, nf4_targets
    from fasttrain.nn import adaptable_model, attach_adapters, quantize_model
    model, _ = load(name)
    for p in model.parameters():
        p.requires_grad_(False)
    quantize_model(model, targets=nf4_targets(model))
    kept = tuple(t for t in adapter_targets(model) if t not in nf4_targets(model))
    if kept:
        adaptable_model(model, targets=kept)
    params = attach_adapters(model, kind="lora", r=32, alpha=64.0, seed=0)
    model.activation_checkpointing_enable({"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model, params


def micro_batch(lengths: list[int], U: int, P: int, vocab: int, seed: int = 0):
    """ids, mask, positions [B, P+T], completion ids and mask [B, T], prompt_index [B]: U prompts of
    P tokens (prompt u left-padded by u tokens), row b an answer of lengths[b] tokens."""
    B, T = len(lengths), max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(B, P + T, dtype=torch.long)
    am = torch.zeros_like(ids)
    prompts = [torch.randint(3, vocab, (P - u,), generator=g) for u in range(U)]
    groups = torch.arange(B) % U
    for b, n in enumerate(lengths):
        p = prompts[int(groups[b])]
        ids[b, P - len(p):P], am[b, P - len(p):P] = p, 1
        ids[b, P:P + n], am[b, P:P + n] = torch.randint(3, vocab, (n,), generator=g), 1
    pos = (am.cumsum(1) - 1).clamp(min=0)
    return ids, am, pos, ids[:, P:].clone(), am[:, P:].clone(), groups


def step(model, params, mb, P: int, packed: bool):
    from fasttrain.train.policy_update import answer_logprobs
    ids, am, pos, comp, cm, groups = mb
    for p in params:
        p.grad = None
    logp, _ = answer_logprobs(model, ids, am, P, comp, cm, 1.0, position_ids=pos, prompt_index=groups,
                              packed=packed)
    w = torch.linspace(-1.0, 1.0, logp.numel()).view(logp.shape)
    (logp * w).sum().backward()


def tokens_through_layers(model, mb, P: int, packed: bool) -> int:
    """Token rows of one layer's MLP in the forward (no grad)."""
    from fasttrain.train.policy_update import answer_logprobs
    seen = []
    H = model.config.hidden_size
    hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0].numel() // H))
    try:
        with torch.no_grad():
            ids, am, pos, comp, cm, groups = mb
            answer_logprobs(model, ids, am, P, comp, cm, 1.0, position_ids=pos, prompt_index=groups, packed=packed)
    finally:
        hook.remove()
    return sum(seen)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", *FACTORIES])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--note", default="", help="how busy the machine was (written with the numbers)")
    ap.add_argument("--out", default=None, help="results stem (default bench/results/<machine>-<date>-packing)")
    a = ap.parse_args()

    import datetime as dt
    stem = Path(a.out) if a.out else HERE / "results" / f"{machine_name()}-{dt.date.today().isoformat()}-packing"
    load_start = os.getloadavg()[0]
    model, params = policy(a.model)
    vocab = model.config.vocab_size
    B, U, P = a.rows, a.prompts, a.prompt_len
    spread = [round(a.min_len + (a.max_len - a.min_len) * i / (B - 1)) for i in range(B)]
    # mix the lengths over the prompts: row b (prompt b % U) gets the b-th of an interleaved order
    order = sorted(range(B), key=lambda i: (i % 2, i if i % 2 == 0 else -i))
    spread = [spread[i] for i in order]
    mean = sum(spread) / B
    uniform = [round(mean)] * B
    batches = {"spread": micro_batch(spread, U, P, vocab), "uniform": micro_batch(uniform, U, P, vocab)}
    cases = {"spread packed": ("spread", True), "uniform": ("uniform", True), "spread padded": ("spread", False)}
    tokens = {c: tokens_through_layers(model, batches[b], P, pk) for c, (b, pk) in cases.items()}
    fns = {c: (lambda b=b, pk=pk: step(model, params, batches[b], P, pk)) for c, (b, pk) in cases.items()}
    for f in fns.values():                                  # warm-up round
        f()
    samples = {c: [] for c in fns}
    cpu = {c: [] for c in fns}        # the process's CPU time: what a busy machine's time slicing leaves out
    t_start = dt.datetime.now(dt.timezone.utc)
    for _ in range(a.reps):
        for c, f in fns.items():
            t, tc = time.perf_counter(), time.process_time()
            f()
            samples[c].append(time.perf_counter() - t)
            cpu[c].append(time.process_time() - tc)
    t_end = dt.datetime.now(dt.timezone.utc)
    load_end = os.getloadavg()[0]
    med = {c: statistics.median(v) for c, v in samples.items()}
    med_cpu = {c: statistics.median(v) for c, v in cpu.items()}
    rows = []
    for c, v in med.items():
        for metric, value, xs in (("fwd_bwd_s", v, samples[c]), ("fwd_bwd_cpu_s", med_cpu[c], cpu[c])):
            rows.append(row("packing", f"{a.model} B={B} P={P} answers {a.min_len}..{a.max_len}", c, metric, value,
                            "s", tokens=tokens[c], threads=torch.get_num_threads(), load_start=load_start,
                            load_end=load_end, samples=" ".join(f"{x:.3f}" for x in xs)))
    write_csv(rows, stem.with_suffix(".csv"))
    ratio_packed = med["spread packed"] / med["uniform"]
    ratio_padded = med["spread padded"] / med["uniform"]
    v = versions()
    lines = [
        f"## {a.model}: answers {min(spread)}..{max(spread)} tokens (1:{max(spread) / min(spread):.0f}) vs "
        f"{uniform[0]} each",
        "",
        f"Machine: {machine_name()}, {torch.get_num_threads()} threads; torch {v['torch']}, "
        f"transformers {v.get('transformers', '?')}. Run {t_start:%H:%M}-{t_end:%H:%M} UTC, load average "
        f"{load_start:.1f} at start, {load_end:.1f} at the end. {a.note}".rstrip(),
        "",
        f"`python bench/bench_packing.py --model {a.model} --rows {B} --prompts {U} --prompt-len {P} "
        f"--min-len {a.min_len} --max-len {a.max_len} --reps {a.reps}`: one micro-batch of {B} rows "
        f"({U} prompts of up to {P} tokens), forward + backward of answer_logprobs (NF4 + LoRA r=32, bf16, "
        f"gradient checkpointing), {a.reps} interleaved repetitions after a warm-up, medians.",
        "",
        "| case | answer tokens | token rows per layer | wall (median) | vs uniform | CPU time (median) | vs uniform "
        "| wall samples (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    answer_tokens = {"spread packed": sum(spread), "uniform": sum(uniform), "spread padded": sum(spread)}
    for c in cases:
        lines.append(f"| {c} | {answer_tokens[c]} | {tokens[c]} | {med[c]:.3f} s | {med[c] / med['uniform']:.2f}x | "
                     f"{med_cpu[c]:.3f} s | {med_cpu[c] / med_cpu['uniform']:.2f}x | "
                     + " ".join(f"{x:.2f}" for x in samples[c]) + " |")
    cpu_packed = med_cpu["spread packed"] / med_cpu["uniform"]
    # each round runs the cases back to back: the ratio within a round sees the least change in contention
    per_round = {c: statistics.median(x / u for x, u in zip(samples[c], samples["uniform"])) for c in cases}
    verdict = "met" if ratio_packed <= 1.15 else "missed"
    lines += ["", f"Spread (packed) / uniform: **{ratio_packed:.2f}x** wall, {cpu_packed:.2f}x CPU time (target "
                  f"<= 1.15x: {verdict} on wall time); the padded layout on the spread batch: {ratio_padded:.2f}x wall, "
                  f"{med_cpu['spread padded'] / med_cpu['uniform']:.2f}x CPU time. Median of the per-round wall "
                  f"ratios: spread packed {per_round['spread packed']:.2f}x, spread padded "
                  f"{per_round['spread padded']:.2f}x.", ""]
    md = stem.with_suffix(".md")
    new = not md.exists()
    with open(md, "a") as f:
        if new:
            f.write("# The update's forward + backward with the answers packed\n\n"
                    "bench/bench_packing.py; CSV alongside (same stem).\n\n")
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
