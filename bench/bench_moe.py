"""Benchmark: fasttrain.ops.moe_experts against transformers' expert implementations ("eager": a
loop over the experts hit, with host syncs; "grouped_mm": tokens sorted by expert, one grouped
GEMM per projection) with PEFT `target_parameters` LoRA on both expert stacks, at one Qwen3-30B-A3B
MoE layer (hidden 2048, moe_intermediate 768, 128 experts, top-8) scaled down by --scale to fit the
CPU (hidden, intermediate and experts divided by it; top-k kept). Forward (no gradients: the
rollout) and forward + backward (gradients to x and the LoRA factors: the update), at a decode
token count and an update token count; time (median of interleaved repetitions, so every
contender sees the same contention) and peak memory above the inputs (the peak of the live bytes the
CPU allocator hands out during one call, from the profiler's memory events), side by side.

    python bench/bench_moe.py [--scale 4] [--quick] [--csv bench/results/moe_cpu.csv]

Contenders: transformers eager + PEFT, transformers grouped_mm + PEFT (experts in --dtype, as a
QLoRA load leaves them), fasttrain NF4 experts, fasttrain 16-bit experts (same --dtype). Target
(the update's token count, forward + backward): fasttrain <= 0.5x transformers' best time and
<= 0.5x its peak memory. Run it on a quiet machine: on a loaded one OpenMP's active wait makes every
ATen call inside a parallel region (fasttrain's tiles, transformers' loops alike) wait for time
slices (OMP_WAIT_POLICY=passive avoids that, at some cost when the machine is quiet).
"""
from __future__ import annotations

import argparse
import csv
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
import fasttrain.ops as F  # noqa: E402
from fasttrain.ops.moe_experts import ExpertStack  # noqa: E402

QWEN3_30B_A3B = dict(hidden=2048, intermediate=768, experts=128, top_k=8)


# ---- measuring -------------------------------------------------------------------------------------
def peak_mib(fn) -> float:
    """Peak live bytes (MiB) that one call of fn allocates above what is live before it: the running
    sum of the CPU allocator's events (torch.profiler, profile_memory) over the call, which sees every
    tensor torch allocates, fasttrain's kernel's scratch included, and tensors freed and reallocated
    alike. (The process's resident-set peak cannot: freed blocks stay mapped in malloc's arenas and
    are reused, so a second call adds nothing to it.) The CPU autograd engine runs the backward on
    the calling thread, which the profiler records."""
    from torch.profiler import ProfilerActivity, profile
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        prof.toggle_collection_dynamic(False, [ProfilerActivity.CPU])   # allocator events only
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nb in events:
        live += nb
        peak = max(peak, live)
    return peak / 2**20


def side_by_side(fns: dict, reps: int) -> dict[str, float]:
    for f in fns.values():  # warm-up
        f()
    samples = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            samples[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in samples.items()}


# ---- the contenders ------------------------------------------------------------------------------
class _Holder(nn.Module):
    """A module with transformers' experts under `experts`, so PEFT's target_parameters reach them."""

    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, idx, w):
        return self.experts(x, idx, w)


def transformers_peft(impl: str, gate_up, down, H, I, E, k, r, dtype):
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k)
    cfg._experts_implementation = impl
    experts = Qwen3MoeExperts(cfg).to(dtype)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
    model = inject_adapter_in_model(LoraConfig(r=r, lora_alpha=2 * r, target_modules=[],
                                               target_parameters=["experts.gate_up_proj", "experts.down_proj"]),
                                    _Holder(experts))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=0.02)         # a trained adapter: B != 0, so the backward does its work
        p.requires_grad_("lora_" in n)
    return model


def fasttrain_experts(gate_up, down, E, r, nf4: bool, dtype):
    if nf4:
        gu, dn = ExpertStack.quantize(gate_up), ExpertStack.quantize(down)
    else:
        gu = ExpertStack(E, gate_up.shape[1], gate_up.shape[2], dtype, weight=gate_up)
        dn = ExpertStack(E, down.shape[1], down.shape[2], dtype, weight=down)
    H, I = down.shape[1], down.shape[2]
    g = torch.Generator().manual_seed(1)
    lora = [(torch.randn(E, r, i, generator=g) / i ** 0.5, torch.randn(E, o, r, generator=g) * 0.02)
            for o, i in ((2 * I, H), (H, I))]
    params = [t.requires_grad_() for ab in lora for t in ab]

    def run(x, idx, w):
        return F.moe_experts(x, idx, w, gu, dn, lora[0], lora[1], 2.0)
    return run, params


def routing(N, E, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=g)
    w, idx = logits.softmax(-1).topk(k, dim=-1)
    return idx, (w / w.sum(-1, keepdim=True)).to(dtype)


def bench(args) -> list[dict]:
    s = args.scale
    H, I, E = QWEN3_30B_A3B["hidden"] // s, QWEN3_30B_A3B["intermediate"] // s, QWEN3_30B_A3B["experts"] // s
    k, r, dtype = min(QWEN3_30B_A3B["top_k"], E), args.rank, getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    contenders = {}
    for impl in ("eager", "grouped_mm"):
        m = transformers_peft(impl, gate_up, down, H, I, E, k, r, dtype)
        contenders[f"transformers {impl} + PEFT"] = (m, [p for p in m.parameters() if p.requires_grad])
    for nf4 in (True, False):
        contenders[f"fasttrain {'NF4' if nf4 else args.dtype}"] = fasttrain_experts(gate_up, down, E, r, nf4, dtype)
    rows = []
    for phase, N in (("decode", args.decode_tokens), ("update", args.update_tokens)):
        idx, w = routing(N, E, k, dtype)
        x0 = torch.randn(N, H, generator=g).to(dtype)
        for mode in ("forward", "forward+backward"):
            fns = {}
            for name, (fn, params) in contenders.items():
                def call(fn=fn, params=params, mode=mode):
                    if mode == "forward":
                        with torch.no_grad():
                            return fn(x0, idx, w)
                    x = x0.clone().requires_grad_()
                    fn(x, idx, w).float().square().mean().backward()
                    for p in params:
                        p.grad = None
                fns[name] = call
            times = side_by_side(fns, args.reps)
            for name, f in fns.items():
                rows.append(dict(phase=phase, tokens=N, mode=mode, contender=name, ms=1e3 * times[name],
                                 peak_mib=peak_mib(f)))
    return rows, dict(H=H, I=I, E=E, k=k, r=r, dtype=args.dtype)


def report(rows, shape) -> str:
    lines = [f"moe_experts, Qwen3-30B-A3B layer / {shape}; host {platform.processor() or platform.machine()}, "
             f"{torch.get_num_threads()} threads, torch {torch.__version__}", "",
             "| phase | tokens | mode | contender | ms | peak MiB | time / best transformers | memory / best transformers |",
             "|---|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["phase"], r["mode"]) for r in rows):
        group = [r for r in rows if (r["phase"], r["mode"]) == key]
        tf = [r for r in group if r["contender"].startswith("transformers")]
        best_t, best_m = min(r["ms"] for r in tf), min(r["peak_mib"] for r in tf)
        for r in group:
            lines.append(f"| {r['phase']} | {r['tokens']} | {r['mode']} | {r['contender']} | {r['ms']:.2f} | "
                         f"{r['peak_mib']:.1f} | {r['ms'] / best_t:.2f} | {r['peak_mib'] / max(best_m, 1e-9):.2f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, default=4, help="divide hidden, intermediate and experts by this")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--update-tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a tiny shape, one repetition: proves the script runs")
    ap.add_argument("--csv", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.scale, args.rank, args.decode_tokens, args.update_tokens, args.reps = 16, 4, 4, 64, 1
    rows, shape = bench(args)
    print(report(rows, shape))
    if args.csv:
        with args.csv.open("w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]))
            wr.writeheader()
            wr.writerows(rows)


if __name__ == "__main__":
    main()
