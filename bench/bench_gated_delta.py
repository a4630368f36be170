"""Benchmark: fasttrain.ops.gated_delta_rule's two CPU forms, fasttrain's token kernel ("fasttrain":
decode, prefill and scores) and the chunked PyTorch form with its written-out backward ("torch
chunked": the update), against each other and against transformers' torch fallback (what TRL runs
for a Qwen3.5 model on a machine without flash-linear-attention), on the same inputs, side by side
in one process (interleaved repetitions, medians), at the shapes of the benchmark hybrid (models/configs/qwen3.5-bench-100m.json:
2 q/k heads, 6 value heads, head dims 128).

Cases: the update's forward + backward of a prompt from a zero state and of a micro-batch of answers
continuing from their prompt's state (gradients for q, k, v, g, beta and the initial state); the
same without gradients (the rollout's prefill of 4 prompts from a zero state, the scores' forward
of 12 answers from their prompt's state); and one decode step of a batch of 48 rows (fasttrain's
in place on the cache's state).
Floor of the decode step: the float32 state, 48 x 6 x 128 x 128 x 4 B = 18.9 MB per layer, read
twice and written once by the kernel (the minimum is once each).

    python bench/bench_gated_delta.py [--threads N] [--reps 5] [--csv bench/results/gated_delta.csv]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import fasttrain.ops as F  # noqa: E402
from fasttrain.ops.gated_delta import set_gated_delta_backend  # noqa: E402

HK, HV, DK, DV = 2, 6, 128, 128


def inputs(B: int, T: int, state: bool, grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, HK, DK, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, HK, DK, generator=g), dim=-1)
    v = torch.randn(B, T, HV, DV, generator=g).bfloat16()
    gl = -torch.rand(B, T, HV, generator=g) * 2
    beta = torch.rand(B, T, HV, generator=g).bfloat16()
    s0 = torch.randn(B, HV, DK, DV, generator=g) * 0.1 if state else None
    xs = [q, k, v, gl, beta] + ([s0] if state else [])
    return [x.requires_grad_(grad) for x in xs]


def fasttrain_rule(backend: str):
    def run(q, k, v, gl, beta, s0=None):
        prev = set_gated_delta_backend(backend)
        try:
            return F.gated_delta_rule(q, k, v, gl, beta, initial_state=s0)
        finally:
            set_gated_delta_backend(prev)
    return run


def hf_rule(q, k, v, gl, beta, s0=None):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule
    rep = HV // HK
    return torch_chunk_gated_delta_rule(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, gl, beta,
                                        initial_state=s0, output_final_state=True)


def fwd_bwd(fn, xs):
    def go():
        for x in xs:
            x.grad = None
        o, S = fn(*xs)
        (o.float().square().sum() + S.float().square().sum()).backward()
    return go


def side_by_side(fns: dict, reps: int) -> dict[str, float]:
    for f in fns.values():
        f()
    samples = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            samples[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in samples.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small shapes, 2 repetitions (a check, not a result)")
    ap.add_argument("--csv")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from harness import machine_name, row, write_csv
    reps = 2 if a.quick else a.reps
    rows = []
    print(f"# {machine_name()}, {torch.get_num_threads()} threads; heads {HK} q/k, {HV} v, dims {DK}x{DV}; "
          f"medians of {reps} interleaved repetitions")
    cases = [("prompt fwd+bwd", 1, 32 if a.quick else 160, False), ("answers fwd+bwd", 4 if a.quick else 12,
                                                                         16 if a.quick else 64, True)]
    for name, B, T, state in cases:
        xs = inputs(B, T, state, grad=True)
        t = side_by_side({"fasttrain": fwd_bwd(fasttrain_rule("fused"), xs),
                          "torch chunked": fwd_bwd(fasttrain_rule("torch"), xs),
                          "transformers": fwd_bwd(hf_rule, xs)}, reps)
        print(f"{name} B={B} T={T}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in t.items())
              + f"; fasttrain / transformers {t['fasttrain'] / t['transformers']:.2f}x, "
              f"/ torch chunked {t['fasttrain'] / t['torch chunked']:.2f}x", flush=True)
        rows += [row("gated_delta", f"{name} B={B} T={T}", k, "seconds", v, "s") for k, v in t.items()]
    # no gradient: the rollout's prefill (prompts from a zero state) and the scores' forward (answers
    # continuing from their prompt's state)
    nograd = [("prefill no-grad", 2 if a.quick else 4, 32 if a.quick else 300, False),
              ("answers no-grad", 4 if a.quick else 12, 16 if a.quick else 64, True)]
    for name, B, T, state in nograd:
        xs = inputs(B, T, state, grad=False)

        def fwd(fn):
            def go():
                with torch.no_grad():
                    fn(*xs)
            return go
        t = side_by_side({"fasttrain": fwd(fasttrain_rule("fused")), "torch chunked": fwd(fasttrain_rule("torch")),
                          "transformers": fwd(hf_rule)}, reps)
        print(f"{name} B={B} T={T}: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in t.items())
              + f"; fasttrain / transformers {t['fasttrain'] / t['transformers']:.2f}x, "
              f"/ torch chunked {t['fasttrain'] / t['torch chunked']:.2f}x", flush=True)
        rows += [row("gated_delta", f"{name} B={B} T={T}", k, "seconds", v, "s") for k, v in t.items()]
    B = 8 if a.quick else 48
    with torch.no_grad():
        q, k, v, gl, beta, s0 = inputs(B, 1, True, False)          # [B, 1, ...]: one token per row
        one = [x[:, 0] for x in (q, k, v, gl, beta)]
        state = s0.clone()

        def ours():
            F.gated_delta_step_(state, *one)

        def chunked():
            prev = set_gated_delta_backend("torch")
            try:
                o, S = F.gated_delta_step(*one, state)
            finally:
                set_gated_delta_backend(prev)
            state.copy_(S)

        def hf():
            from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule
            rep = HV // HK
            o, S = torch_recurrent_gated_delta_rule(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, gl,
                                                    beta, initial_state=state, output_final_state=True)
            state.copy_(S)

        t = side_by_side({"fasttrain": ours, "torch chunked": chunked, "transformers": hf}, reps * 4)
    mb = B * HV * DK * DV * 4 / 2**20
    print(f"decode step B={B} (state {mb:.1f} MiB): " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in t.items())
          + f"; fasttrain / transformers {t['fasttrain'] / t['transformers']:.2f}x; fasttrain moves "
          f"{3 * mb / 1024 / t['fasttrain']:.1f} GiB/s of state", flush=True)
    rows += [row("gated_delta", f"decode step B={B}", k, "seconds", v, "s") for k, v in t.items()]
    if a.csv:
        write_csv(rows, Path(a.csv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
