"""`fasttrain init NAME`: a starter task folder that `fasttrain run NAME/recipe.toml` trains.

NAME/data.jsonl (300 arithmetic questions with an `answer` column, the last 100 held out;
fasttrain.tasks.starter.arithmetic writes them), NAME/rewards.py (two reward
functions in TRL's signature) and NAME/recipe.toml (the dataset environment, sized for a CPU).
`fasttrain init NAME --tools` adds NAME/tools.py (a `calculate` tool in TRL's tool contract) and
writes recipe_tools.toml's recipe, whose answers may call it. `fasttrain init NAME --reasoning-gym
gcd,basic_arithmetic` writes NAME/recipe.toml alone: reasoning-gym's generators as the environment
(fasttrain.envs.reasoning_gym), one table of settings each, equal weights.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["STARTER_FILES", "TOOL_FILES", "write_starter", "write_reasoning_gym_recipe"]

STARTER_FILES = ("data.jsonl", "rewards.py", "recipe.toml")
TOOL_FILES = ("data.jsonl", "rewards.py", "tools.py", "recipe.toml")


def _new_folder(folder: str | Path) -> tuple[Path, str]:
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} already exists and is not an empty folder; choose a new name")
    name = folder.resolve().name
    if not name.replace("-", "_").isidentifier():
        raise ValueError(f"{name!r}: use letters, digits, '-' and '_' for the task name")
    return folder, name


def write_starter(folder: str | Path, tools: bool = False) -> list[Path]:
    """Write the starter files into `folder` (created; it must not exist or be empty); `tools`:
    the starter with a tool."""
    folder, name = _new_folder(folder)
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


RG_RECIPE = """# A reasoning-gym task written by `fasttrain init {name} --reasoning-gym {tasks}`:
# train with `fasttrain run {name}/recipe.toml`. Each [env.generators.NAME] table is one of
# reasoning-gym's generators: `weight` (its share of the train rows) and any field of its own config
# class (e.g. max_value for gcd; a wrong name is refused with the close ones). The generator's
# score_answer is the core reward; the answer goes between <answer> and </answer> tags (format channel).
# Sized for 2 CPU cores; on a GPU raise rollout.* and run.steps.
[run]
name = "{name}"
steps = 60
threads = 2

[policy]
model = "smollm2-135m"             # the bundled SmolLM2-135M-Instruct, NF4 + LoRA
rank = 16
alpha = 32.0
gradient_checkpointing = false

[env]
name = "reasoning-gym"
train_rows = 1000                  # split over the generators by weight
probe_rows = 100                   # drawn from other seeds, never trained on, frozen for the run
data_seed = 0
curriculum = false                 # true: reasoning-gym's curricula move each generator's level
curriculum_window = 8              # steps whose mean score decides a move
curriculum_upper = 0.75            # up one level at or above this
curriculum_lower = 0.25            # down one level below this
{generators}
[rollout]
prompts_per_step = 2
group_size = 8
max_new_tokens = 16
temperature = 0.7
answer_prefix = "<answer>"         # the answer starts inside the tag (a small model otherwise explains
stop_strings = ["</answer>"]       # and seldom writes one) and ends with it
dynamic_sampling = false           # true: drop groups without signal and sample more prompts ...
dynamic_max_rounds = 3             # ... in at most this many extra rounds per step

[advantages]
priorities = {{ core = 3.0, format = 1.0 }}
floor = 0.0                        # a wrong answer (score 0) never gets a positive advantage

[loss]
kind = "cispo"
token_mask = "all"
passes = 2
repo_r = true
thermostat_warmup = 2

[optim]
lr = 1e-4
micro_batch = 8

[probe]
every = 10
prompts = 32
samples = 2
temperature = 0.7
"""


def write_reasoning_gym_recipe(folder: str | Path, tasks: str) -> list[Path]:
    """Write `folder`/recipe.toml for the comma-separated reasoning-gym generators `tasks` (each
    checked against reasoning-gym's registry first: an unknown name is refused with the close ones)."""
    from fasttrain.envs.reasoning_gym import check_generators
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise ValueError("--reasoning-gym: name at least one generator, e.g. --reasoning-gym gcd,basic_arithmetic")
    check_generators({n: {} for n in names})
    folder, name = _new_folder(folder)
    gens = "".join(f"\n[env.generators.{n}]\nweight = 1.0\n" for n in names)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "recipe.toml"
    path.write_text(RG_RECIPE.format(name=name, tasks=",".join(names), generators=gens))
    return [path]
