"""Measure the allocated bytes of each phase of real training steps on the CPU.

What is measured: every allocation and free made through torch's CPU allocator during two
training steps (the profiler's memory events, `profile_memory=True`, with its recording of ops
turned off: the allocator events still come, and a decode step costs about 1.25x its unprofiled
time instead of 3-4x), on top of the bytes of the
tensors resident when profiling starts (the model's parameters and buffers, after NF4 surgery and
adapters, deduplicated by storage, and the dense rollout weights when the run keeps them). Step 1 is the warm-up: it creates the AdamW moments and the
reusable scratch buffers; the phases of step 2 are reported. Both steps run in a fresh thread, so
the NF4 kernels' thread-local scratch is always created (and counted) in step 1. Peak of a phase =
the largest live total while the phase runs; a phase's span is read from the wall clock
(time.time_ns), the clock the profiler stamps its memory events with. Resident set size is never
used: it counts pages, not tensors.
"""
from __future__ import annotations

import gc
import threading
import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

# phase -> (the module whose global the step calls, the function's name)
PHASES = {"rollout": ("fasttrain.train.answers", "sample_answers"),
          "scores": ("fasttrain.train.trainer", "score_batch"),
          "update": ("fasttrain.train.trainer", "update_policy")}


def resident_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


@contextmanager
def phase_marks(monkeypatch, step_counter, spans: dict):
    """Each phase's (start, end) in step 2, wall-clock ns, into `spans`."""
    import importlib

    def wrap(name, fn):
        def inner(*a, **k):
            start = time.time_ns()
            try:
                return fn(*a, **k)
            finally:
                if step_counter[0] == 2:
                    spans[name] = (start, time.time_ns())
        return inner

    for phase, (module, attr) in PHASES.items():
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, attr, wrap(phase, getattr(mod, attr)))
    yield


def measure_steps(trainer, monkeypatch) -> dict[str, int]:
    """Peak live bytes of each phase of step 2 (step 1 warms up)."""
    import fasttrain.train.answers as answers
    monkeypatch.setattr(answers, "eos_ids", lambda model, tok: [])    # every row runs max_new_tokens
    trainer._setup()
    counter = [0]
    gc.collect()
    # the dense rollout weights (rollout.base_weights) are made when the trainer is built, before
    # profiling starts, and kept for the run: resident like the model
    rw = getattr(trainer, "rollout_weights", None)
    dense = rw.nbytes() if rw is not None else 0
    # Packed rollout weights (oneDNN's layout) are new tensors at each refresh, and the profiler
    # cannot report the free of a block allocated before it started: they are dropped here and
    # packed again inside the profile, so each of their allocations and frees is seen.
    repack = rw is not None and rw.packed
    if repack:
        rw.forget()
    model_bytes = resident_bytes(trainer.model)
    base = model_bytes + (0 if repack else dense)
    threads, result = torch.get_num_threads(), {}

    def run():
        # A fresh thread: the NF4 kernels' thread-local scratch is created (and seen) in its step 1,
        # whatever ran before in this process. The profiler records the thread that starts it, and
        # the CPU autograd engine runs the backward on the calling thread.
        try:
            torch.set_num_threads(threads)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                prof.toggle_collection_dynamic(False, [ProfilerActivity.CPU])   # allocator events only
                if repack:
                    rw.refresh()
                for step in (1, 2):
                    counter[0] = step
                    trainer._train_step(step)
            result["events"] = prof.profiler.kineto_results.events()
        except BaseException as e:  # re-raised in the caller
            result["error"] = e

    spans: dict = {}
    with phase_marks(monkeypatch, counter, spans):
        t = threading.Thread(target=run)
        t.start()
        t.join()
    if "error" in result:
        raise result["error"]
    events = result["events"]
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live, peaks = base, {k: 0 for k in spans}
    starts = {k: None for k in spans}
    for t, nb in mem:
        for k, (s, e) in spans.items():
            if starts[k] is None and t >= s:
                starts[k] = live
        live += nb
        for k, (s, e) in spans.items():
            if s <= t <= e:
                peaks[k] = max(peaks[k], live)
    for k in spans:
        peaks[k] = max(peaks[k], starts[k] or base)
    from fasttrain.train.answers import prompt_token_ids
    ids = prompt_token_ids(trainer.tokenizer, trainer.env, trainer._prompts_for_step(2),
                           trainer.cfg.rollout.answer_prefix)
    return {"resident": model_bytes, "rollout_weights": dense, **peaks, "prompt_tokens": max(len(i) for i in ids),
            "phase_start": {k: v for k, v in starts.items()}}


def planned_and_measured(trainer, monkeypatch) -> dict[str, tuple[int, int]]:
    """{phase: (planned peak, measured peak)} of step 2, and the same above the resident bytes
    (so the activations themselves are checked), the plan made from the trainer's recipe."""
    from fasttrain.plan import gpu_spec, meta_policy, plan_memory, run_shape
    from fasttrain.plan.report import device_for

    measured = measure_steps(trainer, monkeypatch)
    cfg = trainer.cfg
    m = meta_policy(trainer.model.config, dtype=cfg.policy.dtype, adapter=cfg.policy.adapter,
                    rank=cfg.policy.rank, alpha=cfg.policy.alpha, quantize=cfg.policy.quantize)
    plan = plan_memory(m, run_shape(cfg, measured["prompt_tokens"]), device_for(gpu_spec("cpu")))
    resident = sum(plan.phases["update"][k] for k in ("nf4_base", "dense_parts", "adapter_masters", "dora_norms",
                                                      "moe_experts", "moe_router", "moe_adapter_masters"))
    assert resident == measured["resident"]          # the meta build counts the real model's bytes exactly
    # the plan keeps dense rollout weights exactly when the trainer did, and counts their bytes exactly
    assert plan.phases["update"]["rollout_weights"] == measured["rollout_weights"]
    resident += measured["rollout_weights"]
    out = {}
    for phase in ("rollout", "scores", "update"):
        out[phase] = (plan.total(phase), measured[phase])
        # the same bound on the bytes above the resident model, so the activations themselves are checked
        out[phase + " above resident"] = (plan.total(phase) - resident, measured[phase] - resident)
        print(f"{trainer.cfg.policy.model} {phase}: planned {out[phase][0]} measured {out[phase][1]} "
              f"ratio {out[phase][0] / out[phase][1]:.3f}; above the resident bytes: ratio "
              f"{(out[phase][0] - resident) / (out[phase][1] - resident):.3f}")
    return out
