"""One plan (memory, time, largest settings) and its three faces: the table `fasttrain plan`
prints, its --json form, and the one line the trainer prints before the first step."""
from __future__ import annotations

from dataclasses import dataclass

from fasttrain.plan import moe_memory
from fasttrain.plan.gpus import GPU
from fasttrain.plan.limits import largest_settings
from fasttrain.plan.memory import PARTS, Device, MemoryPlan, fits, gib, plan_memory
from fasttrain.plan.meta_model import ModelShape, meta_policy
from fasttrain.plan.picks import Picks, pick_settings
from fasttrain.plan.run_shape import RunShape
from fasttrain.plan.speed import StepTime, plan_time, waves

__all__ = ["Plan", "make_plan", "render", "summary_line", "as_json", "device_for", "plan_run", "plan_for_run"]


def device_for(gpu: GPU) -> Device:
    if gpu.name != "cpu":
        return Device("cuda", free=max(0, gpu.memory_bytes - gpu.context_bytes))
    import torch

    from fasttrain.host import cpu_bf16_compute
    return Device("cpu", cpu_bf16=cpu_bf16_compute(), threads=torch.get_num_threads(), free=gpu.memory_bytes)


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
    picks: Picks | None = None
    pick_seconds: dict | None = None      # RunShape field -> seconds its pick adds (a step's, or a probe's)
    recipe_micro_batch: int = 0
    recipe_rollout_weights: str = "auto"
    prompt_estimated: bool = False        # the prompt tokens were estimated (no tokenizer at hand)

    @property
    def peak(self) -> int:
        return self.memory.peak


def make_plan(config, shape: RunShape, gpu: GPU, name: str = "model", env: str = "", mfu: float = 0.4,
              verifier_answers_per_s: float | None = None, with_limits: bool = True,
              decode_share: float = 1.0, measure_shapes: bool = True, model: ModelShape | None = None) -> Plan:
    """Plan `shape` for the model of `config` (dict or transformers config) on `gpu`; `model`: the
    ModelShape meta_policy built for that config and shape already (it is not built again)."""
    m = model or meta_policy(config, name=name, dtype=shape.dtype, adapter=shape.adapter, rank=shape.rank,
                             alpha=shape.alpha, targets=shape.targets, quantize=shape.quantize)
    dev = device_for(gpu)
    picks = pick_settings(m, shape, gpu, dev)
    mem = plan_memory(m, picks.shape, dev)
    ok, headroom = fits(mem.peak, gpu.memory_bytes, gpu.context_bytes)
    # what the projections compute in: the model's dtype on CUDA; on a CPU bf16 where it has
    # avx512_bf16 (fasttrain.ops.nf4_linear), else fp32
    compute = shape.dtype if dev.kind == "cuda" else (
        "bfloat16" if shape.dtype == "bfloat16" and dev.cpu_bf16 else "float32")
    dense = mem.phases["rollout"].get("rollout_weights", 0) > 0

    def timed(s: RunShape) -> StepTime:
        return plan_time(m, s, gpu, env=env, mfu=mfu, verifier_answers_per_s=verifier_answers_per_s,
                         decode_share=decode_share, compute_dtype=compute, dense_rollout=dense,
                         measure_shapes=measure_shapes)
    t = timed(picks.shape)
    lim = largest_settings(m, shape, gpu, dev) if with_limits else {}
    return Plan(m, picks.shape, gpu, mem, t, ok and picks.fits, headroom, lim, picks,
                _pick_seconds(shape, picks, t, timed), shape.micro_batch, shape.rollout_weights)


def _probe_shape(s: RunShape) -> RunShape:
    """The probe as a rollout: its prompts, samples, answer length, waves and prefill chunk."""
    return s.with_(prompts=s.probe_prompts, group=s.probe_samples, new_tokens=s.probe_new_tokens,
                   wave=s.probe_wave, prefill_chunk=s.probe_prefill_chunk)


def _pick_seconds(recipe: RunShape, picks: Picks, picked: StepTime, timed) -> dict:
    """Seconds each pick adds over running its phase whole (one wave, one prefill, the recipe's
    micro-batch and checkpointing), applied one after the other: a step's for the rollout's and the
    update's settings, a probe's for the probe's. Settings that change nothing are not priced."""
    s = picks.shape.with_(wave=0, prefill_chunk=0, probe_wave=0, probe_prefill_chunk=0,
                          micro_batch=recipe.micro_batch, gradient_checkpointing=recipe.gradient_checkpointing)
    effective = {"wave": "wave_prompts", "prefill_chunk": "prefill_prompts", "micro_batch": "micro_batch",
                 "gradient_checkpointing": "gradient_checkpointing"}
    out: dict = {}
    before = None
    for f, prop in effective.items():
        nxt = s.with_(**{f: getattr(picks.shape, f)})
        if getattr(nxt, prop) != getattr(s, prop):
            before = before or timed(s)
            after = picked if nxt == picks.shape else timed(nxt)
            out[f] = after.total - before.total
            before = after
        s = nxt
    probe = _probe_shape(s.with_(probe_wave=0, probe_prefill_chunk=0))
    for f, g, prop in (("probe_wave", "wave", "wave_prompts"), ("probe_prefill_chunk", "prefill_chunk",
                                                                "prefill_prompts")):
        nxt = probe.with_(**{g: getattr(picks.shape, f)})
        if getattr(nxt, prop) != getattr(probe, prop):
            out[f] = timed(nxt).seconds["rollout"] - timed(probe).seconds["rollout"]
        probe = nxt
    return out


def _per_s(v: float, unit: str) -> str:
    """A rate in T or G units: datasheet GPUs in TFLOP/s and TB/s, a CPU's measured rates in G."""
    return f"{v / 1e12:.2f} T{unit}/s" if v >= 1e12 else f"{v / 1e9:.1f} G{unit}/s"


def _g(b: float) -> str:
    return f"{gib(b):8.2f}"


def summary_line(p: Plan) -> str:
    verdict = "fits" if p.fits else "DOES NOT FIT"
    s = p.shape
    return (f"plan: {p.model.name} on {p.gpu.title}: peak {gib(p.peak):.2f} GiB in {p.memory.peak_phase} "
            f"of {gib(p.gpu.memory_bytes):.1f} GiB -> {verdict} (headroom {gib(p.headroom):.2f} GiB); "
            f"rollout {s.wave_prompts} prompt(s) a wave, prefill {s.prefill_prompts}; probe "
            f"{s.probe_wave_prompts} a wave, prefill {s.probe_prefill_prompts}; micro-batch {s.micro_batch}; "
            f"step ~{p.time.total:.1f} s on paper ({p.time.dominant} dominates)"
            + "".join(f"; DOES NOT FIT: {why}" for why in (p.picks.blocked if p.picks else ())))


def render(p: Plan) -> str:
    m, s, g = p.model, p.shape, p.gpu
    lines = [
        f"model  {m.name}: {m.architecture}, {m.params / 1e9:.2f} B parameters, {m.layers} layers, "
        f"hidden {m.hidden}, heads {m.heads}/{m.kv_heads} kv, vocab {m.vocab}{', tied' if m.tied else ''}"
        f"{moe_memory.describe(m)}",
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
        probe = plan_time(m, _probe_shape(s), g).seconds["rollout"] * (s.steps // s.probe_every + 1) / max(1, s.steps)
    lines += [f"  {'step':10s}{total:10.2f}   ({p.time.dominant} dominates)",
              f"  {s.steps} steps (+ probes): {(total + probe) * s.steps / 3600:.1f} GPU-hours"]
    lines += [f"  assumption: {a}" for a in p.time.assumptions]
    if p.picks is not None:
        lines += ["", "picked so that every phase fits (largest that fits; a positive recipe value is kept)"]
        lines += [f"  {line}" for line in pick_lines(p)]
        lines += [f"  DOES NOT FIT: {why}" for why in p.picks.blocked]
    if p.limits:
        lines += ["", "largest settings that fit (the others at the recipe's values; waves, prefill chunks and "
                      "the micro-batch picked)"]
        for k, v in p.limits.items():
            cap = {"micro_batch": f" (all {s.rows} rows)" if v == s.rows else "",
                   "max_new_tokens": " (the model's context less the prompt)" if "max_new_tokens_memory" in p.limits
                   else ""}.get(k, "")
            label = "memory alone" if k == "max_new_tokens_memory" else k
            lines.append(f"  {label:16s}{'none: does not fit even at the smallest' if v is None else str(v) + cap}")
    return "\n".join(lines)


def pick_lines(p: Plan) -> list[str]:
    """One line per picked setting: its value, whether the recipe set it, what it costs in time."""
    s, pk, sec = p.shape, p.picks, p.pick_seconds or {}

    def cost(f: str, per: str = "step") -> str:
        what = "one wave" if "wave" in f else "one prefill" if "chunk" in f else "the recipe's"
        return f"; +{sec[f]:.2f} s per {per} over {what}" if f in sec else ""

    def own(f: str) -> str:
        return " (the recipe's)" if f in pk.fixed else ""
    n_waves = -(-s.prompts // s.wave_prompts)
    p_waves = -(-s.probe_prompts // s.probe_wave_prompts)
    return [
        f"rollout waves   {s.wave_prompts} prompt(s) x {s.group} = {s.wave_prompts * s.group} answers decoded at once, "
        f"{n_waves} wave(s){own('wave')}{cost('wave')}",
        f"rollout prefill {s.prefill_prompts} prompt(s) at a time{own('prefill_chunk')}{cost('prefill_chunk')}",
        f"probe waves     {s.probe_wave_prompts} prompt(s) x {s.probe_samples} answers at once, {p_waves} wave(s)"
        f"{own('probe_wave')}{cost('probe_wave', 'probe')}",
        f"probe prefill   {s.probe_prefill_prompts} prompt(s) at a time{own('probe_prefill_chunk')}"
        f"{cost('probe_prefill_chunk', 'probe')}",
        f"micro-batch     {s.micro_batch} answer(s) (recipe: at most {p.recipe_micro_batch}){cost('micro_batch')}",
        f"checkpointing   {'on' if s.gradient_checkpointing else 'off'}{cost('gradient_checkpointing')}",
    ] + ([f"rollout weights the NF4 layers (rollout.base_weights \"auto\" would keep a dense copy of "
          f"{gib(p.model.linear_params * p.model.w):.2f} GiB, which leaves no setting that fits)"]
         if s.rollout_weights != p.recipe_rollout_weights else [])


def _moe_json(moe) -> dict:
    """The routed experts' shape as the JSON plan names it ({} for a dense model)."""
    if moe is None:
        return {}
    return {"experts": moe.experts, "active": moe.active, "expert_width": moe.width, "moe_layers": moe.layers,
            "shared_width": moe.shared}


def as_json(p: Plan) -> dict:
    return {
        "model": {"name": p.model.name, "architecture": p.model.architecture, "params": p.model.params,
                  "layers": p.model.layers, "hidden": p.model.hidden, "vocab": p.model.vocab,
                  "moe": _moe_json(p.model.moe)},
        "run": p.shape.__dict__,
        "gpu": {"name": p.gpu.name, "memory_bytes": p.gpu.memory_bytes, "bf16_flops": p.gpu.bf16_flops,
                "bandwidth": p.gpu.bandwidth, "context_bytes": p.gpu.context_bytes},
        "memory": {ph: {**parts, "total": p.memory.total(ph)} for ph, parts in p.memory.phases.items()},
        "memory_notes": p.memory.notes,
        "peak_bytes": p.peak, "peak_phase": p.memory.peak_phase, "fits": p.fits, "headroom_bytes": p.headroom,
        "seconds": {**p.time.seconds, "step": p.time.total}, "dominant": p.time.dominant,
        "assumptions": p.time.assumptions, "largest": p.limits,
        "picks": None if p.picks is None else {
            "settings": p.picks.chosen, "fixed_by_recipe": list(p.picks.fixed), "blocked": list(p.picks.blocked),
            "seconds_added": p.pick_seconds or {}},
    }


def plan_run(cfg, model_config, prompt_tokens: int, device, world: int = 1) -> Plan:
    """The plan of a run about to start on `device` (the trainer's face); with `world`
    data-parallel ranks, each rank holds prompts_per_step / world prompts and its share of the
    probe. Times come from this host's measured rates when `fasttrain plan` has cached them (the
    trainer never stops to measure)."""
    import torch

    from fasttrain.plan.gpus import gpu_for_device, measured
    from fasttrain.plan.run_shape import run_shape

    shape = run_shape(cfg, prompt_tokens)
    if world > 1:
        shape = shape.with_(prompts=max(1, shape.prompts // world),
                            probe_prompts=max(1, -(-shape.probe_prompts // world)))
    kind = torch.device(device).type
    return make_plan(model_config, shape, measured(gpu_for_device(device), kind),
                     name=str(cfg.policy.model), env=cfg.env.name, with_limits=False, measure_shapes=False)


def plan_for_run(cfg, model_config, prompt_tokens: int, device, world: int = 1) -> tuple[str, bool]:
    """(one-line summary, fits) of plan_run."""
    p = plan_run(cfg, model_config, prompt_tokens, device, world)
    return summary_line(p), p.fits
