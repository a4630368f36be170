"""Largest settings that fit: micro_batch, group_size and max_new_tokens, each searched with the
others at the recipe's values and the waves, prefill chunks and micro-batch the plan may pick
(fasttrain.plan.picks: a setting fits when some pick makes every phase fit; the peak at the
smallest picks grows with each setting, so a binary search finds the edge)."""
from __future__ import annotations

from fasttrain.plan.gpus import GPU
from fasttrain.plan.memory import Device
from fasttrain.plan.meta_model import ModelShape
from fasttrain.plan.picks import pick_settings
from fasttrain.plan.run_shape import RunShape

__all__ = ["largest_settings", "fits_shape"]


def fits_shape(m: ModelShape, s: RunShape, gpu: GPU, dev: Device) -> bool:
    """Whether `s` fits with the picks the plan would make for it."""
    return pick_settings(m, s, gpu, dev).fits


def _largest(ok, lo: int, hi: int) -> int | None:
    """Largest v in [lo, hi] with ok(v), assuming ok is monotone (True then False); None if ok(lo) fails."""
    if not ok(lo):
        return None
    if ok(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def largest_settings(m: ModelShape, s: RunShape, gpu: GPU, dev: Device, cap_group: int = 1024,
                     cap_tokens: int = 1 << 18) -> dict:
    """{"micro_batch": ..., "group_size": ..., "max_new_tokens": ...}: the largest value of each that
    fits (micro_batch at most the step's rows, with the recipe's waves and chunks picked), None
    where even the smallest does not fit. A micro-batch counts as fitting only as itself (the
    plan may not lower it); max_new_tokens stops at the model's context less the prompt."""
    from fasttrain.plan.memory import fits, scores_phase, update_phase

    def mb_fits(v: int) -> bool:
        t = s.with_(micro_batch=v, gradient_checkpointing=s.gradient_checkpointing or s.checkpointing_auto)
        return pick_settings(m, t, gpu, dev).fits and all(
            fits(sum(p.values()), gpu.memory_bytes, gpu.context_bytes)[0]
            for p in (scores_phase(m, t, dev), update_phase(m, t, dev)) if p is not None)

    def tokens_fit(v: int) -> bool:
        return fits_shape(m, s.with_(new_tokens=v, probe_new_tokens=v), gpu, dev)
    context = m.context - s.prompt_tokens if m.context > s.prompt_tokens else 0
    out = {
        "micro_batch": _largest(mb_fits, 1, s.rows),
        "group_size": _largest(lambda v: fits_shape(m, s.with_(group=v), gpu, dev), 2, cap_group),
        "max_new_tokens": _largest(tokens_fit, 1, min(cap_tokens, context) if context else cap_tokens),
    }
    if context and out["max_new_tokens"] == context:     # the context stopped it, not the memory
        out["max_new_tokens_memory"] = _largest(tokens_fit, context, cap_tokens)
    return out
