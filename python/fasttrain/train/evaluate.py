"""`fasttrain eval RUN_DIR`: score a run's shipped checkpoint on the frozen probe again (train
slice and holdout slice), from the files of the run folder alone."""
from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from fasttrain.train.config import load_config
from fasttrain.train.environment import load_run_env
from fasttrain.train.policy import build_policy, pick_device
from fasttrain.train.probe import run_probe
from fasttrain.train.run_files import write_json

__all__ = ["evaluate_run"]


def evaluate_run(run_dir: str | Path, overrides: list[str] | None = None, env=None) -> dict[str, Any]:
    from fasttrain.nn import load_adapter

    run_dir = Path(run_dir)
    shipped = run_dir / "shipped" / "adapter"
    if not (run_dir / "config.toml").exists() or not shipped.exists():
        raise FileNotFoundError(f"{run_dir}: needs config.toml and shipped/adapter (a finished fasttrain run)")
    cfg = load_config(tomllib.loads((run_dir / "config.toml").read_text()), overrides)
    env = env if env is not None else load_run_env(cfg)
    model, tokenizer, _ = build_policy(cfg, pick_device(cfg.run.device))
    load_adapter(model, shipped)
    import json
    step = json.loads((run_dir / "shipped" / "shipped.json").read_text())["step"]
    res = run_probe(model, tokenizer, env, env.prompts("probe")[: cfg.probe.prompts], cfg, step)
    write_json(run_dir / "eval.json", res)
    return res
