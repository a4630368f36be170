"""What the plan picks so that a run fits: rollout waves, prefill chunks and the update's micro-batch.

Each phase's peak depends on its own settings only: the rollout's on its wave (prompts whose G
answers decode at once) and its prefill chunk (prompts prefilled at once), the probe's on its own
two, the scores' and the update's on the micro-batch and gradient checkpointing. So each is picked
alone: the largest value at which its phase fits the device (fasttrain.plan.memory.fits: the 5%
allocator margin and the CUDA context on top of the peak). The largest, because it is the fastest:
a decode step reads the weights once for all its rows, so W waves read them W times as often; a
prefill chunk and a micro-batch read them again too, and a micro-batch that splits a group runs
the group's prompt once more (fasttrain.plan.speed prices each pick).

What the recipe sets is kept: rollout.wave_prompts, rollout.prefill_prompts, probe.wave_prompts and
probe.prefill_prompts when positive (0: the plan picks); optim.micro_batch is the most the plan
uses, lowered only when it does not fit; gradient checkpointing is turned on only when the update
does not fit without it at one answer per micro-batch; rollout.base_weights = "auto" gives up the
dense rollout copy only when some phase fits at no setting with it.

A wave holds whole groups (a prompt's G answers share its prefill), so the smallest wave is one
prompt: a recipe whose one group cannot decode at full length (the plan's worst case: every answer
runs to max_new_tokens) fits at no wave size, and `blocked` names the setting to change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fasttrain.plan.gpus import GPU
from fasttrain.plan.load import load_phase
from fasttrain.plan.memory import (Device, fits, gib, probe_phase, resident_base, rollout_phase, scores_phase,
                                   update_phase)
from fasttrain.plan.meta_model import ModelShape
from fasttrain.plan.run_shape import RunShape

__all__ = ["Picks", "pick_settings", "SETTINGS"]

# RunShape field -> the recipe setting that fixes it
SETTINGS = {"wave": "rollout.wave_prompts", "prefill_chunk": "rollout.prefill_prompts",
            "probe_wave": "probe.wave_prompts", "probe_prefill_chunk": "probe.prefill_prompts",
            "micro_batch": "optim.micro_batch", "gradient_checkpointing": "policy.gradient_checkpointing",
            "rollout_weights": "rollout.base_weights"}


@dataclass(frozen=True)
class Picks:
    shape: RunShape                               # the recipe's shape with every pick applied
    chosen: dict = field(default_factory=dict)    # RunShape field -> value, for every setting above
    fixed: tuple = ()                             # the fields the recipe set itself
    blocked: tuple = ()                           # one sentence per phase that fits at no setting

    @property
    def fits(self) -> bool:
        return not self.blocked


def _sizes(n: int) -> list[int]:
    """Useful group counts of n items, largest first: ceil(n / k) for k = 1..n (a size between
    two of these makes as many waves as the smaller one and needs more memory)."""
    return sorted({-(-n // k) for k in range(1, n + 1)}, reverse=True)


def _largest(values: list[int], ok) -> int | None:
    """The first of `values` (largest first) with ok(v), ok being False then True along them."""
    if not values or not ok(values[-1]):
        return None
    lo, hi = -1, len(values) - 1            # ok(values[hi]) holds; find the first index where it does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(values[mid]) else (mid, hi)
    return values[hi]


def _of(nbytes: int, gpu: GPU) -> str:
    """'X GiB of Y' as the fit check counts them: the peak, its 5% margin and the CUDA context."""
    return f"{gib(gpu.memory_bytes - fits(nbytes, gpu.memory_bytes, gpu.context_bytes)[1]):.2f} GiB with the " \
           f"allocator margin and the CUDA context, of {gib(gpu.memory_bytes):.1f}"


def _fit(parts: dict | None, gpu: GPU) -> bool:
    return parts is None or fits(sum(parts.values()), gpu.memory_bytes, gpu.context_bytes)[0]


def _pick_rollout(m, s: RunShape, gpu: GPU, dev: Device, probe: bool) -> tuple[RunShape, str | None]:
    """The wave and prefill chunk of the rollout (or the probe): the largest wave that fits with
    chunks of one prompt, then the largest chunk at that wave."""
    wave_f, chunk_f = ("probe_wave", "probe_prefill_chunk") if probe else ("wave", "prefill_chunk")
    n = s.probe_prompts if probe else s.prompts
    phase = probe_phase if probe else rollout_phase

    def ok(shape: RunShape) -> bool:
        return _fit(phase(m, shape, dev), gpu)
    wave = getattr(s, wave_f) or _largest(_sizes(n), lambda v: ok(s.with_(**{wave_f: v, chunk_f: 1})))
    if wave is None or not ok(s.with_(**{wave_f: wave, chunk_f: 1})):
        what = "probe" if probe else "rollout"
        rows = (s.probe_samples if probe else s.group) * (getattr(s, wave_f) or 1)
        need = sum(phase(m, s.with_(**{wave_f: getattr(s, wave_f) or 1, chunk_f: 1}), dev).values())
        knobs = ("probe.max_new_tokens or probe.samples" if probe else "rollout.max_new_tokens or rollout.group_size")
        if getattr(s, wave_f):
            knobs = f"{SETTINGS[wave_f]} (set to {getattr(s, wave_f)}; 0 lets the plan pick), " + knobs
        return s, (f"the {what} does not fit even {rows} answers at a time at full length "
                   f"({_of(need, gpu)}): lower {knobs}")
    s = s.with_(**{wave_f: min(wave, n)})
    chunk = getattr(s, chunk_f) or _largest(_sizes(min(wave, n)), lambda v: ok(s.with_(**{chunk_f: v})))
    if chunk is None or not ok(s.with_(**{chunk_f: chunk})):
        return s.with_(**{chunk_f: 1}), (f"the {'probe' if probe else 'rollout'}'s prefill does not fit at "
                                         f"{SETTINGS[chunk_f]} = {chunk}: set it to 0 (the plan picks)")
    return s.with_(**{chunk_f: chunk}), None


def _pick_micro_batch(m, s: RunShape, gpu: GPU, dev: Device) -> tuple[RunShape, str | None]:
    """The largest micro-batch up to the recipe's at which the scores and the update fit, with
    gradient checkpointing turned on when even one answer does not fit without it (with
    policy.gradient_checkpointing = "auto": on unless the recipe's own micro-batch fits without it)."""
    def ok(shape: RunShape) -> bool:
        return _fit(scores_phase(m, shape, dev), gpu) and _fit(update_phase(m, shape, dev), gpu)
    if ok(s):                                   # the recipe's own (even above the step's rows)
        return s, None
    if s.checkpointing_auto and not s.gradient_checkpointing:
        # "auto" turns it off only at the recipe's own micro-batch: never fewer answers per pass
        # to save the recompute
        s = s.with_(gradient_checkpointing=True)
        if ok(s):
            return s, None
    for shape in ([s] if s.gradient_checkpointing else [s, s.with_(gradient_checkpointing=True)]):
        top = max(1, min(s.micro_batch, s.rows))
        mb = _largest(list(range(top, 0, -1)), lambda v: ok(shape.with_(micro_batch=v)))
        if mb is not None:
            return shape.with_(micro_batch=mb), None
    one = s.with_(micro_batch=1, gradient_checkpointing=True)
    need = max(sum(update_phase(m, one, dev).values()), sum((scores_phase(m, one, dev) or {}).values()))
    return s, (f"the update does not fit even one answer per micro-batch with gradient checkpointing "
               f"({_of(need, gpu)}): lower rollout.max_new_tokens")


def pick_settings(m: ModelShape, s: RunShape, gpu: GPU, dev: Device) -> Picks:
    """The recipe's shape `s` with the largest wave, prefill chunk and micro-batch that fit `gpu`;
    with rollout.base_weights = "auto", the rollout decodes from the NF4 layers when the dense
    copy "auto" would keep leaves some phase no setting that fits (the copy is resident in every
    phase: at long answers its bytes are better spent on the cache)."""
    picks = _picks(m, s, gpu, dev)
    if picks.fits or s.rollout_weights != "auto" or not resident_base(m, s, dev)["rollout_weights"]:
        return picks
    nf4 = _picks(m, s.with_(rollout_weights="nf4"), gpu, dev)
    return nf4 if nf4.fits else picks


def _picks(m: ModelShape, s: RunShape, gpu: GPU, dev: Device) -> Picks:
    fixed = tuple(f for f in ("wave", "prefill_chunk", "probe_wave", "probe_prefill_chunk") if getattr(s, f))
    blocked = []
    base = resident_base(m, s, dev)
    resident = sum(base[k] for k in ("nf4_base", "dense_parts", "adapter_masters", "adam_moments", "dora_norms",
                                     "rollout_weights", "workspace", "moe_experts", "moe_router",
                                     "moe_adapter_masters", "moe_adam_moments"))
    if not fits(resident, gpu.memory_bytes, gpu.context_bytes)[0]:
        return Picks(s, {f: getattr(s, f) for f in SETTINGS}, fixed, (
            f"the resident parts alone (frozen base, unquantised parts, adapters and their AdamW moments"
            f"{', the dense rollout weights' if base['rollout_weights'] else ''}) need {_of(resident, gpu)}: "
            f"use a larger GPU or a smaller model",))
    if not _fit(load_phase(m), gpu):
        blocked.append(f"the model alone does not fit while it loads ({_of(sum(load_phase(m).values()), gpu)}): "
                       f"use policy.quantize = \"nf4\", a larger GPU or a smaller model")
    out = s
    for step in (lambda x: _pick_rollout(m, x, gpu, dev, probe=False),
                 lambda x: _pick_rollout(m, x, gpu, dev, probe=True),
                 lambda x: _pick_micro_batch(m, x, gpu, dev)):
        out, why = step(out)
        if why:
            blocked.append(why)
    chosen = {f: getattr(out, f) for f in SETTINGS}
    return Picks(out, chosen, fixed, tuple(blocked))
