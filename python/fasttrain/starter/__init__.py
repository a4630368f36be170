"""`fasttrain init NAME`: a starter task folder that `fasttrain run NAME/recipe.toml` trains.

NAME/data.jsonl (300 arithmetic questions with an `answer` column, the last 100 held out;
fasttrain.starter.arithmetic writes them), NAME/rewards.py (two reward
functions in TRL's signature) and NAME/recipe.toml (the dataset environment, sized for a CPU).
`fasttrain init NAME --tools` adds NAME/tools.py (a `calculate` tool in TRL's tool contract) and
writes recipe_tools.toml's recipe, whose answers may call it.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["STARTER_FILES", "TOOL_FILES", "write_starter"]

STARTER_FILES = ("data.jsonl", "rewards.py", "recipe.toml")
TOOL_FILES = ("data.jsonl", "rewards.py", "tools.py", "recipe.toml")


def write_starter(folder: str | Path, tools: bool = False) -> list[Path]:
    """Write the starter files into `folder` (created; it must not exist or be empty); `tools`:
    the starter with a tool."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} already exists and is not an empty folder; choose a new name")
    name = folder.resolve().name
    if not name.replace("-", "_").isidentifier():
        raise ValueError(f"{name!r}: use letters, digits, '-' and '_' for the task name")
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    src = resources.files(__package__)
    for f in (TOOL_FILES if tools else STARTER_FILES):
        text = (src / ("recipe_tools.toml" if tools and f == "recipe.toml" else f)).read_text()
        if f == "recipe.toml":
            text = text.replace("{name}", name)
        (folder / f).write_text(text)
        out.append(folder / f)
    return out
