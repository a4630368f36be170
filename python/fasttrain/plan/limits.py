"""Largest settings that fit: micro_batch, group_size and max_new_tokens, each searched with the
others at the recipe's values (the peak grows with each, so a binary search finds the edge)."""
from __future__ import annotations

from fasttrain.plan.gpus import GPU
from fasttrain.plan.memory import Device, fits, plan_memory
from fasttrain.plan.meta_model import ModelShape
from fasttrain.plan.run_shape import RunShape

__all__ = ["largest_settings", "fits_shape"]


def fits_shape(m: ModelShape, s: RunShape, gpu: GPU, dev: Device) -> bool:
    return fits(plan_memory(m, s, dev).peak, gpu.memory_bytes, gpu.context_bytes)[0]


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
                     cap_tokens: int = 1 << 16) -> dict:
    """{"micro_batch": ..., "group_size": ..., "max_new_tokens": ...}: the largest value of each that
    fits (micro_batch at most the step's rows), None where even the smallest does not fit."""
    return {
        "micro_batch": _largest(lambda v: fits_shape(m, s.with_(micro_batch=v), gpu, dev), 1, s.rows),
        "group_size": _largest(lambda v: fits_shape(m, s.with_(group=v), gpu, dev), 2, cap_group),
        "max_new_tokens": _largest(lambda v: fits_shape(m, s.with_(new_tokens=v, probe_new_tokens=v), gpu, dev),
                                   1, cap_tokens),
    }
