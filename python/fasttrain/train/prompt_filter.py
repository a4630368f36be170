"""The prompt filter (`fasttrain filter RECIPE`): estimate each train prompt's success rate with
the starting policy and keep the prompts it sometimes solves (0 < rate < 1), where GDPO groups
have both successes and failures; when fewer than `filter.min_keep` remain, keep the
`min_keep` prompts closest to break-even (rate 0.5) instead. Writes a JSON selection that a
recipe names with `env.prompts`."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fasttrain.train.answers import answer_token_ids, sample_answers, score_answers, tool_settings, truncation_of
from fasttrain.train.config import Config
from fasttrain.train.environment import load_run_env
from fasttrain.train.policy import build_policy, pick_device
from fasttrain.train.run_files import write_json

__all__ = ["filter_prompts", "selection_path"]


def selection_path(cfg: Config) -> Path:
    if cfg.env.prompts:
        return Path(cfg.env.prompts)
    return Path(cfg.filter.out or Path(cfg.run.out) / f"filter-{cfg.run.name}.json")


def filter_prompts(cfg: Config, out: str | Path | None = None, env=None, progress=None) -> dict[str, Any]:
    env = env if env is not None else load_run_env(cfg)
    device = pick_device(cfg.run.device)
    model, tokenizer, _ = build_policy(cfg, device)
    prompts = env.prompts("train")
    if cfg.filter.max_prompts:
        prompts = prompts[: cfg.filter.max_prompts]
    k = cfg.filter.samples
    rates: dict[str, float] = {}
    t0 = time.perf_counter()
    chunk = max(1, cfg.rollout.prompts_per_step)
    for i in range(0, len(prompts), chunk):
        part = prompts[i: i + chunk]
        roll, texts = sample_answers(model, tokenizer, env, part, group_size=k,
                                     max_new_tokens=cfg.rollout.max_new_tokens,
                                     temperature=cfg.rollout.temperature, seed=cfg.run.seed * 7919 + i,
                                     answer_prefix=cfg.rollout.answer_prefix,
                                     stop_strings=cfg.rollout.stop_strings, tool_settings=tool_settings(cfg),
                                     truncation=truncation_of(cfg.rollout))
        rep = [p for p in part for _ in range(k)]
        scores = score_answers(env, rep, texts, cfg.env.train_slice, record=False,
                               completion_ids=answer_token_ids(roll), conversations=roll.conversations)
        for j, p in enumerate(part):
            rates[p.id] = sum(s.success for s in scores[j * k:(j + 1) * k]) / k
        if progress:
            progress(min(len(prompts), i + chunk), len(prompts))
    keep = [p.id for p in prompts if 0 < rates[p.id] < 1]
    fallback = len(keep) < cfg.filter.min_keep
    if fallback:   # too few mixed prompts: the N closest to break-even (stable order on ties)
        ranked = sorted(prompts, key=lambda p: abs(rates[p.id] - 0.5))
        keep = [p.id for p in ranked[: cfg.filter.min_keep]]
    sel = {"env": env.name, "policy": cfg.policy.model, "samples": k, "seed": cfg.run.seed,
           "prompts_scored": len(prompts), "kept": len(keep), "fallback_closest_to_half": fallback,
           "seconds": time.perf_counter() - t0, "prompt_ids": keep, "rates": rates}
    path = Path(out) if out else selection_path(cfg)
    write_json(path, sel)
    sel["path"] = str(path)
    return sel
