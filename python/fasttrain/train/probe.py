"""The frozen probe and checkpoint selection.

Every `probe.every` steps (and at step 0 and the last step) the policy answers the environment's
frozen probe prompts; the answers are scored on the train data slice (the selector) and on the
later holdout slice. Data-parallel ranks each answer a contiguous block of the probe prompts
(each prompt's sampler is seeded from the probe seed and its position, so the answers are the
one-process answers) and the scores are gathered. The shipped checkpoint is the probe step with the best train-side mean core
(earliest on ties); the holdout never chooses, it only verifies.
"""
from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

from fasttrain.envs import Prompt
from fasttrain.train import distributed
from fasttrain.train.answers import (answer_token_ids, group_seeds, has_slice, join_rollouts, sample_answers,
                                    score_answers, tool_settings, truncation_of)
from fasttrain.train.config import Config
from fasttrain.train.run_files import write_json

__all__ = ["run_probe", "select_shipped", "ship_best"]


def _summary(scores, prefix: str) -> dict[str, float]:
    n = max(1, len(scores))
    return {f"{prefix}_core": sum(s.core for s in scores) / n,
            f"{prefix}_success": sum(s.success for s in scores) / n,
            f"{prefix}_valid": sum(s.valid for s in scores) / n}


def run_probe(model, tokenizer, env, prompts: Sequence[Prompt], cfg: Config, step: int,
              weights=None, wave: int = 0, prefill_chunk: int = 0) -> dict[str, Any]:
    """Sample the probe prompts (rollout.base_weights applies: `weights` are the trainer's dense
    rollout weights, or None to decode from the model's own layers) and score them. `wave`:
    prompts decoded at once (0: all; each prompt's sampler has its own seed, so waves draw the
    answers of one batch), `prefill_chunk`: prompts prefilled at once (0: a whole wave)."""
    t0 = time.perf_counter()
    G = cfg.probe.samples
    lo, hi = distributed.shard_bounds(len(prompts))
    texts, train, hold = [], [], []
    holdout = has_slice(env, cfg.env.holdout_slice)
    if hi > lo:
        seeds, n, parts = group_seeds([cfg.probe.seed], lo, hi), wave or hi - lo, []
        for a in range(lo, hi, n):
            part, tx = sample_answers(model, tokenizer, env, prompts[a:min(hi, a + n)], group_size=G,
                                      max_new_tokens=cfg.probe.max_new_tokens or cfg.rollout.max_new_tokens,
                                      temperature=cfg.probe.temperature, seed=seeds[a - lo:a - lo + n],
                                      answer_prefix=cfg.rollout.answer_prefix, stop_strings=cfg.rollout.stop_strings,
                                      weights=weights, prefill_chunk=prefill_chunk,
                                      truncation=truncation_of(cfg.probe),
                                      tool_settings={**tool_settings(cfg), "first_slot": (a - lo) * G})
            parts.append(part)
            texts += tx
        pad = getattr(model.config, "pad_token_id", None)
        roll = join_rollouts(parts, pad if isinstance(pad, int) else 0)
        rep = [p for p in prompts[lo:hi] for _ in range(G)]
        kw = dict(record=False, completion_ids=answer_token_ids(roll), conversations=roll.conversations)
        train = score_answers(env, rep, texts, cfg.env.train_slice, **kw)
        hold = score_answers(env, rep, texts, cfg.env.holdout_slice, **kw) if holdout else [None] * len(texts)
    every = distributed.gather_list(list(zip(texts, train, hold)))      # all prompts, in order
    texts, train, hold = [x[0] for x in every], [x[1] for x in every], [x[2] for x in every]
    out: dict[str, Any] = {"step": step, "prompts": len(prompts), "samples": G}
    out.update(_summary(train, "train"))
    for c in (train[0].channels if train else {}):         # each reward channel's mean on the probe
        out[f"train_reward_{c}"] = sum(s.channels[c] for s in train) / len(train)
    if holdout:
        out.update(_summary(hold, "holdout"))
    else:
        out.update({"holdout_core": math.nan, "holdout_success": math.nan, "holdout_valid": math.nan})
    out["seconds"] = time.perf_counter() - t0
    out["examples"] = texts[:3]
    return out


def select_shipped(probes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The probe with the best train-side core (earliest wins ties)."""
    best = None
    for p in probes:
        if best is None or p["train_core"] > best["train_core"]:
            best = p
    return best


def ship_best(run_dir: Path, probes: list[dict[str, Any]], run_id: str) -> dict[str, Any] | None:
    """Copy the best probe's adapter (select_shipped) to run_dir/shipped/ with shipped.json beside
    it, replacing the folder whole (written as shipped.tmp, then renamed); None when no probe ran."""
    best = select_shipped(probes)
    if best is None:
        return None
    src = run_dir / "probes" / f"step_{best['step']:06d}" / "adapter"
    dst = run_dir / "shipped"
    tmp = run_dir / "shipped.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp / "adapter")
    write_json(tmp / "shipped.json", {"run_id": run_id, **best})
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return best
