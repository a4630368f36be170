"""Where a hybrid step's time goes on this machine: the share of the Gated DeltaNet's own math (the
delta rule and the causal conv, forward and backward) in the update's forward+backward and in the
rollout's decode, on the pinned ~100M Qwen3.5-shaped benchmark model (models/configs/qwen3.5-bench-100m.json).

    PYTHONPATH=python python bench/profile_hybrid_step.py [--rows 8 --group 4 --prompt 96 --answer 64]

Method: each phase is timed with the gated delta rule's sequences on fasttrain's kernel
(`set_gated_delta_backend("fused")`: the CPU default without a gradient), again with the chunked
PyTorch form (`set_gated_delta_backend("torch")`: the CPU default for the update; decode steps on
its torch ops), and again with the delta rule and the conv replaced by stand-ins of
the same shapes that cost next to nothing (o = v·β, the state passed through; y = x); the
differences are what those ops cost on each path. The three run interleaved (one of each per round,
the order rotated from round to round) after a warm-up round; medians of --reps rounds. Prints one
line per phase.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import fasttrain.rollout.hybrid_decoder as HD  # noqa: E402
import fasttrain.train.prefix_forward_hybrid as PF  # noqa: E402


def _cheap_rule(q, k, v, g, beta, *, scale=None, initial_state=None, chunk_size=64):
    B, T, Hv, Dv = v.shape
    S = initial_state if initial_state is not None else v.new_zeros(B, Hv, q.shape[-1], Dv, dtype=torch.float32)
    return v * beta[..., None].to(v.dtype), S


def _cheap_step_(state, q, k, v, g, beta, *, active=None, scale=None):
    return v * beta[..., None].to(v.dtype)


def _cheap_conv(x, weight, state=None, activation=True):
    K = weight.shape[1]
    st = state if state is not None else x.new_zeros(x.shape[0], K - 1, x.shape[2])
    return x, torch.cat([st, x], 1)[:, -(K - 1):]


def _cheap_conv_step(x, weight, state, activation=True):
    return x, torch.cat([state, x[:, None]], 1)[:, 1:]


@contextmanager
def stand_ins():
    saved = [(PF, "gated_delta_rule"), (PF, "causal_conv1d"), (HD, "gated_delta_rule"), (HD, "causal_conv1d"),
             (HD, "gated_delta_step_"), (HD, "causal_conv1d_step")]
    old = [getattr(m, n) for m, n in saved]
    new = [_cheap_rule, _cheap_conv, _cheap_rule, _cheap_conv, _cheap_step_, _cheap_conv_step]
    for (m, n), f in zip(saved, new):
        setattr(m, n, f)
    try:
        yield
    finally:
        for (m, n), f in zip(saved, old):
            setattr(m, n, f)


def bench_model(dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM
    from fasttrain.models.families import nf4_targets
    from fasttrain.nn import attach_adapters, quantize_model
    src = Path(__file__).resolve().parents[1] / "python/fasttrain/models/configs/qwen3.5-bench-100m.json"
    d = {k: v for k, v in json.loads(src.read_text()).items() if not k.startswith("_")}
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    quantize_model(model, targets=nf4_targets(model))
    params = attach_adapters(model, kind="lora", r=16, alpha=32)
    for p in params:
        p.requires_grad_(True)
    return model, params


def interleaved(run, forms, reps: int) -> dict:
    """Median seconds of run(form) per form: a warm-up round, then `reps` rounds that each run every
    form once, in an order rotated from round to round (so drift on the machine falls on all forms)."""
    for f in forms:
        run(f)
    ts = {f: [] for f in forms}
    for r in range(reps):
        for f in forms[r % len(forms):] + forms[:r % len(forms)]:
            t = time.perf_counter()
            run(f)
            ts[f].append(time.perf_counter() - t)
    return {f: statistics.median(v) for f, v in ts.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=96)
    ap.add_argument("--answer", type=int, default=64)
    ap.add_argument("--decode", type=int, default=16, help="decode steps timed in the rollout phase")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from fasttrain.rollout import sample
    from fasttrain.train.policy_update import answer_logprobs
    model, params = bench_model(getattr(torch, a.dtype))
    g = torch.Generator().manual_seed(0)
    n = a.rows // a.group
    prompts = [torch.randint(3, 49152, (a.prompt,), generator=g).tolist() for _ in range(n)]
    ids = torch.cat([torch.tensor(prompts).repeat_interleave(a.group, 0),
                     torch.randint(3, 49152, (a.rows, a.answer), generator=g)], 1)
    am = torch.ones_like(ids)
    comp = ids[:, a.prompt:]

    def update():
        model.train()
        lp, _ = answer_logprobs(model, ids, am, a.prompt, comp, torch.ones_like(comp), 1.0,
                                prompt_index=torch.arange(a.rows) // a.group)
        lp.sum().backward()
        model.eval()

    def rollout():
        sample(model, prompts, group_size=a.group, max_new_tokens=a.decode, temperature=1.0, eos_token_ids=[], seed=0)

    print(f"# {torch.get_num_threads()} threads, {a.dtype}, rows {a.rows} (group {a.group}), prompt {a.prompt}, "
          f"answer {a.answer}, decode {a.decode} steps; NF4 + LoRA r16")
    from fasttrain.ops.gated_delta import set_gated_delta_backend
    from fasttrain.ops.gated_delta import gated_delta_backend
    for name, fn, grad in (("update fwd+bwd", update, True), ("rollout prefill+decode", rollout, False)):
        def run(form):
            prev = set_gated_delta_backend("fused" if form == "stand-ins" else form)
            try:
                if form == "stand-ins":
                    with stand_ins():
                        fn()
                else:
                    fn()
            finally:
                set_gated_delta_backend(prev)
        times = interleaved(run, ("fused", "torch", "stand-ins"), a.reps)
        full, chunked, rest = times["fused"], times["torch"], times["stand-ins"]
        share = max(full - rest, 0.0) / full
        share_t = max(chunked - rest, 0.0) / chunked
        default = gated_delta_backend("cpu", grad=grad)
        print(f"{name}: {full:.3f} s with the kernel ({100 * share:.1f}% in the delta rule and conv: "
              f"{max(full - rest, 0.0):.3f} s), {chunked:.3f} s with the chunked torch form ({100 * share_t:.1f}%: "
              f"{max(chunked - rest, 0.0):.3f} s); without the delta rule and conv {rest:.3f} s; the default "
              f"sequence form here: {default}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
