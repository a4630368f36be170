"""One plan (memory, time, largest settings) and its three faces: the table `fasttrain plan`
prints, its --json form, and the one line the trainer prints before the first step."""
from __future__ import annotations

from dataclasses import dataclass

from fasttrain.plan.gpus import GPU
from fasttrain.plan.limits import largest_settings
from fasttrain.plan.memory import PARTS, Device, MemoryPlan, fits, gib, plan_memory
from fasttrain.plan.meta_model import ModelShape, meta_policy
from fasttrain.plan.run_shape import RunShape
from fasttrain.plan.speed import StepTime, plan_time

__all__ = ["Plan", "make_plan", "render", "summary_line", "as_json", "device_for"]


def device_for(gpu: GPU) -> Device:
    if gpu.name != "cpu":
        return Device("cuda", free=max(0, gpu.memory_bytes - gpu.context_bytes))
    import torch

    from fasttrain.ops.nf4_linear import _cpu_bf16_compute
    return Device("cpu", cpu_bf16=_cpu_bf16_compute(), threads=torch.get_num_threads(), free=gpu.memory_bytes)


@dataclass
class Plan:
    model: ModelShape
    shape: RunShape
    gpu: GPU
    memory: MemoryPlan
    time: StepTime
    fits: bool
    headroom: int
    limits: dict

    @property
    def peak(self) -> int:
        return self.memory.peak


def make_plan(config, shape: RunShape, gpu: GPU, name: str = "model", env: str = "", mfu: float = 0.4,
              verifier_answers_per_s: float | None = None, with_limits: bool = True,
              decode_share: float = 1.0, measure_shapes: bool = True) -> Plan:
    """Plan `shape` for the model of `config` (dict or transformers config) on `gpu`."""
    m = meta_policy(config, name=name, dtype=shape.dtype, adapter=shape.adapter, rank=shape.rank,
                    alpha=shape.alpha, targets=shape.targets, quantize=shape.quantize)
    dev = device_for(gpu)
    mem = plan_memory(m, shape, dev)
    ok, headroom = fits(mem.peak, gpu.memory_bytes, gpu.context_bytes)
    # what the projections compute in: the model's dtype on CUDA; on a CPU bf16 where it has
    # avx512_bf16 (fasttrain.ops.nf4_linear), else fp32
    compute = shape.dtype if dev.kind == "cuda" else (
        "bfloat16" if shape.dtype == "bfloat16" and dev.cpu_bf16 else "float32")
    t = plan_time(m, shape, gpu, env=env, mfu=mfu, verifier_answers_per_s=verifier_answers_per_s,
                  decode_share=decode_share, compute_dtype=compute,
                  dense_rollout=mem.phases["rollout"].get("rollout_weights", 0) > 0, measure_shapes=measure_shapes)
    lim = largest_settings(m, shape, gpu, dev) if with_limits else {}
    return Plan(m, shape, gpu, mem, t, ok, headroom, lim)


def _per_s(v: float, unit: str) -> str:
    """A rate in T or G units: datasheet GPUs in TFLOP/s and TB/s, a CPU's measured rates in G."""
    return f"{v / 1e12:.2f} T{unit}/s" if v >= 1e12 else f"{v / 1e9:.1f} G{unit}/s"


def _g(b: float) -> str:
    return f"{gib(b):8.2f}"


def summary_line(p: Plan) -> str:
    verdict = "fits" if p.fits else "DOES NOT FIT"
    return (f"plan: {p.model.name} on {p.gpu.title}: peak {gib(p.peak):.2f} GiB in {p.memory.peak_phase} "
            f"of {gib(p.gpu.memory_bytes):.1f} GiB -> {verdict} (headroom {gib(p.headroom):.2f} GiB); "
            f"step ~{p.time.total:.1f} s on paper ({p.time.dominant} dominates)")


def render(p: Plan) -> str:
    m, s, g = p.model, p.shape, p.gpu
    lines = [
        f"model  {m.name}: {m.architecture}, {m.params / 1e9:.2f} B parameters, {m.layers} layers, "
        f"hidden {m.hidden}, heads {m.heads}/{m.kv_heads} kv, vocab {m.vocab}{', tied' if m.tied else ''}",
        f"run    {s.prompts} prompts x {s.group} answers = {s.rows} rows, prompt {s.prompt_tokens} + "
        f"{s.new_tokens} new tokens, micro-batch {s.micro_batch}, {s.passes} pass(es), {s.dtype}, "
        f"{'NF4' if s.quantize == 'nf4' else '16-bit'} base, {s.adapter} r={s.rank} ({m.adapter_params / 1e6:.1f} M params), gradient checkpointing "
        f"{'on' if s.gradient_checkpointing else 'off'}",
        f"device {g.title}: {gib(g.memory_bytes):.1f} GiB, {_per_s(g.bf16_flops, 'FLOP')} bf16, "
        f"{_per_s(g.bandwidth, 'B')} ({g.source}"
        + (", this host's own: --remeasure measures again)" if g.rates is not None else ")"),
        "",
        "memory by part and phase (GiB)",
    ]
    phases = list(p.memory.phases)
    lines.append(f"  {'':48s}" + "".join(f"{ph:>9s}" for ph in phases))
    for key, label in PARTS.items():
        vals = [p.memory.phases[ph].get(key, 0) for ph in phases]
        if not any(vals):
            continue
        lines.append(f"  {label:48s}" + "".join(f"{gib(v):9.2f}" for v in vals))
    lines.append(f"  {'total (peak allocated)':48s}" + "".join(f"{gib(p.memory.total(ph)):9.2f}" for ph in phases))
    n = p.memory.notes
    other = "off" if n["checkpointing"] else "on"
    lines += [
        f"  update activations with checkpointing {other}: {gib(n['update_activations_other']):.2f} GiB",
        f"  log-prob head for N={n['head_tokens']} tokens: fused [N, H] fp32 {gib(n['fused_head_bytes']):.3f} GiB; "
        f"an unfused head's [N, V] fp32 logits {gib(n['unfused_logits_bytes']):.2f} GiB (V/H = {m.vocab / m.hidden:.1f}x)",
        f"  CUDA context + cuBLAS workspace (assumed, outside torch's allocator): {gib(g.context_bytes):.2f} GiB; "
        f"allocator margin 5%",
        "",
        f"peak: {gib(p.peak):.2f} GiB in {p.memory.peak_phase} -> "
        + (f"fits {g.title}, headroom {gib(p.headroom):.2f} GiB" if p.fits else
           f"DOES NOT FIT {g.title}: short by {gib(-p.headroom):.2f} GiB"),
        "",
        "time per step from this host's measured rates (s)" if g.rates is not None else "time per step on paper (s)",
    ]
    for ph, sec in p.time.seconds.items():
        lines.append(f"  {ph:10s}{sec:10.2f}")
    total = p.time.total
    probe = 0.0
    if s.probe_every:
        from fasttrain.plan.speed import plan_time as _pt
        probe_shape = s.with_(prompts=s.probe_prompts, group=s.probe_samples, new_tokens=s.probe_new_tokens)
        probe = _pt(m, probe_shape, g).seconds["rollout"] * (s.steps // s.probe_every + 1) / max(1, s.steps)
    lines += [f"  {'step':10s}{total:10.2f}   ({p.time.dominant} dominates)",
              f"  {s.steps} steps (+ probes): {(total + probe) * s.steps / 3600:.1f} GPU-hours"]
    lines += [f"  assumption: {a}" for a in p.time.assumptions]
    if p.limits:
        lines += ["", "largest settings that fit (the others at the recipe's values)"]
        for k, v in p.limits.items():
            cap = {"micro_batch": f" (all {s.rows} rows)" if v == s.rows else ""}.get(k, "")
            lines.append(f"  {k:16s}{'none: does not fit even at the smallest' if v is None else str(v) + cap}")
        if p.limits.get("micro_batch") is None:
            knobs = {"rollout": "rollout.prompts_per_step, rollout.group_size or rollout.max_new_tokens",
                     "probe": "probe.prompts or probe.max_new_tokens (the probe prefills all its prompts at once)",
                     "scores": "optim.micro_batch", "update": "optim.micro_batch"}
            upd = p.memory.phases["update"]
            resident = sum(upd[k] for k in ("nf4_base", "dense_parts", "adapter_masters", "adam_moments",
                                              "dora_norms", "workspace"))
            worst = max((ph for ph in p.memory.phases if ph != "update"), key=p.memory.total)
            if resident + g.context_bytes >= g.memory_bytes:
                lines.append(
                    f"  this run does not fit even at micro_batch 1: the resident parts alone (frozen base, unquantised "
                    f"parts, adapters and their AdamW moments) are {gib(resident):.2f} GiB of {gib(g.memory_bytes):.1f}; "
                    f"use a larger GPU or a smaller model")
            else:
                lines.append(
                    f"  this run does not fit even at micro_batch 1: the resident parts alone are {gib(resident):.2f} GiB "
                    f"and the {worst} phase needs {gib(p.memory.total(worst)):.2f} GiB of {gib(g.memory_bytes):.1f}; "
                    f"lower {knobs[worst]}, or use a larger GPU or a smaller model")
    return "\n".join(lines)


def as_json(p: Plan) -> dict:
    return {
        "model": {"name": p.model.name, "architecture": p.model.architecture, "params": p.model.params,
                  "layers": p.model.layers, "hidden": p.model.hidden, "vocab": p.model.vocab},
        "run": p.shape.__dict__,
        "gpu": {"name": p.gpu.name, "memory_bytes": p.gpu.memory_bytes, "bf16_flops": p.gpu.bf16_flops,
                "bandwidth": p.gpu.bandwidth, "context_bytes": p.gpu.context_bytes},
        "memory": {ph: {**parts, "total": p.memory.total(ph)} for ph, parts in p.memory.phases.items()},
        "memory_notes": p.memory.notes,
        "peak_bytes": p.peak, "peak_phase": p.memory.peak_phase, "fits": p.fits, "headroom_bytes": p.headroom,
        "seconds": {**p.time.seconds, "step": p.time.total}, "dominant": p.time.dominant,
        "assumptions": p.time.assumptions, "largest": p.limits,
    }


def plan_for_run(cfg, model_config, prompt_tokens: int, device, world: int = 1) -> tuple[str, bool]:
    """(one-line summary, fits) for a run about to start on `device` (the trainer's faces); with
    `world` data-parallel ranks, each rank holds prompts_per_step / world prompts and its share
    of the probe. Times come from this host's measured rates when `fasttrain plan` has cached
    them (the trainer never stops to measure)."""
    import torch

    from fasttrain.plan.gpus import gpu_for_device, measured
    from fasttrain.plan.run_shape import run_shape

    shape = run_shape(cfg, prompt_tokens)
    if world > 1:
        shape = shape.with_(prompts=max(1, shape.prompts // world),
                            probe_prompts=max(1, -(-shape.probe_prompts // world)))
    kind = torch.device(device).type
    p = make_plan(model_config, shape, measured(gpu_for_device(device), kind, cached_only=True),
                  name=str(cfg.policy.model), env=cfg.env.name, with_limits=False, measure_shapes=False)
    return summary_line(p), p.fits
