"""`fasttrain ladder RECIPE...`: run several recipes one after another and write the seed-style
comparison table (ladder.md + ladder.json) next to the runs."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fasttrain.train.config import load_config
from fasttrain.train.report import ladder_table
from fasttrain.train.run_files import write_json, write_text

__all__ = ["run_ladder"]


def run_ladder(recipes: list[str], overrides: list[str], out: str | None = None, progress: bool = True,
               console=None) -> tuple[Path, list[dict[str, Any]]]:
    from fasttrain.train.prompt_filter import filter_prompts, selection_path
    from fasttrain.train.trainer import Trainer

    exports = []
    extra = list(overrides) + ([f"run.out={_quote(out)}"] if out else [])
    root = None
    for r in recipes:
        cfg = load_config(r, extra)
        root = Path(cfg.run.out)
        if cfg.env.prompts and not selection_path(cfg).exists():
            if console:
                console.print(f"{r}: no prompt selection at {selection_path(cfg)}; running the filter first")
            filter_prompts(cfg)
        exports.append(Trainer(cfg, progress=progress, console=console).train())
    table = ladder_table(exports)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = (root or Path("runs")) / f"ladder-{stamp}.md"
    write_text(path, f"# Ladder {stamp}\n\n" + table + "\n" + "\n".join(
        f"- rung {i}: run `{e['run_id']}`" for i, e in enumerate(exports, 1)) + "\n")
    write_json(path.with_suffix(".json"), [{"run_id": e["run_id"], "shipped": e["shipped"],
                                            "holdout_change": e["holdout_change"]} for e in exports])
    return path, exports


def _quote(s: str) -> str:
    import json
    return json.dumps(s)
