"""Every `fasttrain ...` command in a code block of README.md and docs/*.md runs: `run` commands
with --dry-run (the recipe, the overrides, the dataset and the reward functions are all checked;
no weights are loaded), every other command for real, on the tiny model and environment where it
trains (ladder, filter; a ladder with at most 2 seeds) and on a one-step tiny run where it needs a run folder (`runs/<run-id>`).
The commands of one block run in order in one folder (`fasttrain init my_task` then `fasttrain run
my_task/recipe.toml`). A misspelled key, an unknown recipe or a wrong option fails the test."""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fasttrain.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_ID = "runs/<run-id>"

# Appended after a command's own --set (so its keys are still checked): train on the tiny world.
TINY = ["policy.model=support.tiny_world:tiny_policy", "policy.dtype=float32", "policy.rank=2", "policy.gradient_checkpointing=false",
        "env.name=support.tiny_world:make_env", "run.device=cpu", "run.threads=1", "run.steps=1", "rollout.prompts_per_step=1",
        "rollout.group_size=2", "rollout.max_new_tokens=4", "optim.micro_batch=2", "probe.prompts=1", "probe.every=0",
        "filter.samples=2", "filter.max_prompts=2", "filter.min_keep=1"]
TRAINS = ("ladder", "filter")


@dataclass(frozen=True)
class DocCommand:
    where: str               # file:line
    argv: tuple[str, ...]    # after `fasttrain`


def doc_commands(text: str, name: str) -> list[list[DocCommand]]:
    """The fasttrain commands of each fenced code block, block by block: lines that start with
    `fasttrain` or `$ fasttrain`, or run `-m fasttrain` (torchrun, python); backslash
    continuations joined; `#` comments dropped."""
    blocks: list[list[DocCommand]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].lstrip().startswith("```"):
            i += 1
            continue
        block, i = [], i + 1
        while i < len(lines) and not lines[i].lstrip().startswith("```"):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            text = line.strip().removeprefix("$ ")
            if not (text.startswith("fasttrain ") or text == "fasttrain" or "-m fasttrain" in text):
                i += 1                    # not a command line (code, TOML, output): never parsed
                continue
            words = shlex.split(text, comments=True)     # a broken quote in a command fails the test
            if words and words[0] == "fasttrain":
                block.append(DocCommand(f"{name}:{start + 1}", tuple(words[1:])))
            elif "-m" in words and words.index("-m") + 1 < len(words) and words[words.index("-m") + 1] == "fasttrain":
                block.append(DocCommand(f"{name}:{start + 1}", tuple(words[words.index("-m") + 2:])))
            i += 1
        if block:
            blocks.append(block)
        i += 1
    return blocks


def _all_blocks() -> list[tuple[str, list[DocCommand]]]:
    out = []
    for path in DOCS:
        for block in doc_commands(path.read_text(), path.name):
            out.append((block[0].where, block))
    return out


def _tiny_run(folder: Path, runner: CliRunner) -> Path:
    from support.recipes import make_tiny_recipe, recipe_toml
    if (folder / "tiny_runs").is_dir():                  # one per block
        (run_dir,) = (folder / "tiny_runs").iterdir()
        return run_dir
    recipe = folder / "tiny.toml"
    recipe.write_text(recipe_toml(make_tiny_recipe(folder / "tiny_runs", **{"run.steps": 1, "probe.every": 0})))
    res = runner.invoke(app, ["run", str(recipe), "--no-progress"])
    assert res.exit_code == 0, res.output
    (run_dir,) = (folder / "tiny_runs").iterdir()
    return run_dir


def check_command(cmd: DocCommand, folder: Path, runner: CliRunner) -> tuple[int, str]:
    """Run one documented command here (the rules of the module header); (exit code, output)."""
    argv = list(cmd.argv)
    if any(RUN_ID in a for a in argv):
        run_dir = _tiny_run(folder, runner)
        argv = [a.replace(RUN_ID, str(run_dir)) for a in argv]
    # a placeholder (<name>) or a syntax sketch ([--opt], a|b) outside a --set value is no command
    odd = [a for a in argv if "=" not in a and re.search(r"<[^>]*>|^\[|\|", a)]
    if odd:
        return 2, f"{cmd.where}: {odd} is a placeholder or a syntax sketch, not a command; write a real command"
    if argv and argv[0] == "run" or not argv:
        argv = (argv or ["run"]) + ["--dry-run"]
    elif argv[0] in TRAINS:
        argv += [x for s in TINY for x in ("--set", s)] + (["--no-progress"] if argv[0] == "ladder" else [])
        if "--seeds" in argv:             # 2 seeds exercise the paired differences; more only cost time
            i = argv.index("--seeds") + 1
            argv[i] = str(min(int(argv[i]), 2)) if argv[i].isdigit() else argv[i]
    res = runner.invoke(app, argv)
    return res.exit_code, f"{cmd.where}: fasttrain {' '.join(argv)}\n{res.output}{res.exception or ''}"


BLOCKS = _all_blocks()


def test_the_docs_have_commands_to_check():
    assert any(c.argv[:1] == ("run",) for _, b in BLOCKS for c in b)


@pytest.mark.parametrize("block", [b for _, b in BLOCKS], ids=[w for w, _ in BLOCKS])
def test_documented_command_runs(block, tiny, monkeypatch):
    monkeypatch.chdir(tiny)
    runner = CliRunner()
    for cmd in block:
        code, out = check_command(cmd, tiny, runner)
        assert code == 0, out


def test_a_misspelled_key_in_a_documented_command_fails(tiny, monkeypatch):
    monkeypatch.chdir(tiny)
    text = "Train:\n\n```bash\nfasttrain run demo --set rollout.group_sise=4   # a typo\n```\n"
    ((cmd,),) = doc_commands(text, "README.md")
    assert cmd.argv == ("run", "demo", "--set", "rollout.group_sise=4")
    code, out = check_command(cmd, tiny, CliRunner())
    assert code == 2 and "unknown key 'rollout.group_sise'" in out
    ((cmd,),) = doc_commands("```\n$ fasttrain ladder dapo cispo --seeds 2 --set loss.kindd=dapo\n```\n", "x.md")
    code, out = check_command(cmd, tiny, CliRunner())
    assert code == 2 and "unknown key 'loss.kindd'" in out


def test_commands_are_parsed_from_fenced_blocks_only():
    text = ("Run `fasttrain run nowhere` inline (not checked).\n\n```bash\n"
            "torchrun --nproc-per-node 4 --rdzv-endpoint HOST:PORT \\\n    -m fasttrain run cispo_repo_r\n"
            "make demo\n```\n\n```\nfasttrain init my_task   # writes\nfasttrain run my_task/recipe.toml\n```\n")
    blocks = doc_commands(text, "a.md")
    assert [[c.argv for c in b] for b in blocks] == [[("run", "cispo_repo_r")],
                                                    [("init", "my_task"), ("run", "my_task/recipe.toml")]]
    assert blocks[0][0].where == "a.md:4" and blocks[1][1].where == "a.md:11"
