"""Continuing a run (`fasttrain run --resume RUN_DIR`): the recipe saved in its folder with the
new overrides (refusing what may not change), and its run files cut back to the checkpoint it
continues from, with a stateful environment brought back to its state by replaying the recorded
answers. The checkpoint itself is read by fasttrain.train.checkpoint."""
from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from fasttrain.train import distributed
from fasttrain.train.answers import is_stateful, score_answers
from fasttrain.train.config import Config, load_config, resume_changes, saved_run_data
from fasttrain.train.run_files import read_jsonl, truncate_jsonl

__all__ = ["resume_config", "checkpoint_step", "cut_run_files", "replay_answers"]

RUN_FILES = ("metrics.jsonl", "samples.jsonl", "probes.jsonl")


def resume_config(run_dir: Path, overrides: list[str] | None) -> tuple[Config, dict[str, tuple[Any, Any]]]:
    """(the run's saved config with `overrides`, {key: (old, new)} of what they changed);
    ConfigError for a change a resume may not make, FileNotFoundError for a folder that is no run."""
    cfg_file = run_dir / "config.toml"
    if not cfg_file.exists():
        raise FileNotFoundError(f"--resume {run_dir}: no config.toml there (not a fasttrain run folder)")
    saved = saved_run_data(tomllib.loads(cfg_file.read_text()))
    cfg = load_config(saved, overrides)
    return cfg, resume_changes(load_config(saved), cfg)                # refuses what may not change


def checkpoint_step(ckpt: Path | None) -> int:
    """The step of checkpoint folder `ckpt` (0 for none)."""
    return int(json.loads((ckpt / "trainer_state.json").read_text())["step"]) if ckpt is not None else 0


def cut_run_files(run_dir: Path, step: int, main: bool) -> tuple[list[dict], list[dict]]:
    """The rows of steps <= `step` kept in metrics.jsonl, samples.jsonl and probes.jsonl (rank 0
    cuts the files once every rank has read them); returns (samples, probes) kept."""
    metrics, samples, probes = ([r for r in read_jsonl(run_dir / f) if r["step"] <= step] for f in RUN_FILES)
    distributed.barrier()                 # every rank has read the files before rank 0 cuts them
    if main:
        for f, rows in zip(RUN_FILES, (metrics, samples, probes)):
            truncate_jsonl(run_dir / f, rows)
    return samples, probes


def replay_answers(cfg: Config, env, train_prompts, samples: list[dict]) -> None:
    """A stateful environment (e.g. the novelty archive) sees the recorded answers again, in
    their order; a stateless one, nothing."""
    if not is_stateful(env):
        return
    by_id = {p.id: p for p in train_prompts}
    for r in samples:
        ps = [by_id[i] for i in r["prompt_ids"] for _ in range(cfg.rollout.group_size)]
        score_answers(env, ps, r["answers"], cfg.env.train_slice, record=True)
