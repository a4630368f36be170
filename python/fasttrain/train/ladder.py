"""`fasttrain ladder RECIPE... --seeds N`: run each recipe (a rung) with N seeds, then write the
table that ranks them (ladder-<stamp>.md + .json next to the runs).

Seeds: rung k's i-th run uses run.seed + i (run.seed as the recipe and --set give it), so every
rung sees the same seeds and a rung's change against the previous one is a paired difference,
seed by seed. Each run probes at least 5 times (probe.every is lowered to steps // 5 where the
recipe probes less often), so the shipped pick has checkpoints to choose from. The statistics are
fasttrain.train.intervals; the table is fasttrain.train.report.ladder_table.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fasttrain.train.config import Config, ConfigError, load_config
from fasttrain.train.report import ladder_table
from fasttrain.train.run_files import write_json, write_text

__all__ = ["run_ladder", "ladder_configs", "MIN_PROBES"]

MIN_PROBES = 5


def probes_per_run(cfg: Config) -> int:
    """Probes after the start probe: every probe.every steps and one at the end."""
    every, steps = cfg.probe.every, cfg.run.steps
    return 1 if every == 0 else -(-steps // every)


def ladder_configs(recipes: list[str], overrides: list[str], seeds: int = 1,
                   out: str | None = None) -> list[list[Config]]:
    """The resolved configs, [rung][seed]: the recipe, the overrides, run.out, then run.seed and
    (where needed) probe.every. Every recipe and override is checked before anything runs."""
    if seeds < 1:
        raise ConfigError(f"--seeds {seeds}: use 1 or more")
    if not recipes:
        raise ConfigError("ladder: name at least one recipe")
    extra = list(overrides) + ([f"run.out={json.dumps(out)}"] if out else [])
    rungs = []
    for r in recipes:
        cfg = load_config(r, extra)
        more = []
        if probes_per_run(cfg) < MIN_PROBES:
            more.append(f"probe.every={max(1, cfg.run.steps // MIN_PROBES)}")
        rungs.append([load_config(r, extra + more + [f"run.seed={cfg.run.seed + i}"]) for i in range(seeds)])
    return rungs


def run_ladder(recipes: list[str], overrides: list[str], out: str | None = None, progress: bool = True,
               console=None, seeds: int = 1) -> tuple[Path, list[list[dict[str, Any]]]]:
    """Run every rung with `seeds` seeds; returns (table path, exports [rung][seed])."""
    from fasttrain.train.prompt_filter import filter_prompts, selection_path
    from fasttrain.train.trainer import Trainer

    rungs = ladder_configs(recipes, overrides, seeds, out)
    exports: list[list[dict[str, Any]]] = []
    for name, cfgs in zip(recipes, rungs):
        runs = []
        for cfg in cfgs:
            if cfg.env.prompts and not selection_path(cfg).exists():
                if console:
                    console.print(f"{name}: no prompt selection at {selection_path(cfg)}; running the filter first")
                filter_prompts(cfg)
            if console:
                console.print(f"rung {len(exports) + 1} ({name}), seed {cfg.run.seed}")
            runs.append(Trainer(cfg, progress=progress, console=console).train())
        exports.append(runs)
    root = Path(rungs[0][0].run.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = root / f"ladder-{stamp}.md"
    runs_list = "\n".join(f"- rung {i} ({r}): " + ", ".join(f"`{e['run_id']}`" for e in runs)
                          for i, (r, runs) in enumerate(zip(recipes, exports), 1))
    write_text(path, f"# Ladder {stamp}\n\n" + ladder_table(exports) + "\n" + runs_list + "\n")
    write_json(path.with_suffix(".json"), [
        {"recipe": r, "runs": [{"run_id": e["run_id"], "seed": e["config"]["run"]["seed"], "shipped": e["shipped"],
                                "start_probe": e["start_probe"], "holdout_change": e["holdout_change"]}
                               for e in runs]}
        for r, runs in zip(recipes, exports)])
    return path, exports
