"""The `fasttrain` command line (Typer)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(add_completion=False, no_args_is_help=False, help="fasttrain: fast RL post-training for LMs.")
console = Console()

DISPATCH_KEYS = ("CPU", "CUDA", "Autograd", "Meta")


def registered_ops() -> list[tuple[str, list[str]]]:
    """Every fasttrain:: op and the dispatch keys that have a kernel for it."""
    import torch

    import fasttrain.ops  # noqa: F401  (registers schemas, fakes and autograd)

    names = sorted({n for n in torch._C._dispatch_get_all_op_names() if n.startswith("fasttrain::")})
    out = []
    for name in names:
        keys = [k for k in DISPATCH_KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(name, k)]
        out.append((name, keys))
    return out


@app.command()
def info() -> None:
    """Version, torch, compiled backends and CUDA archs, and every registered fasttrain op."""
    import torch

    import fasttrain
    from fasttrain.ops import build_info

    bi = build_info()
    console.print(f"fasttrain {fasttrain.__version__}  (extension {bi['version']}, built against torch {bi['torch_version']})")
    console.print(f"torch {torch.__version__}  CUDA runtime {torch.version.cuda or 'none'}  "
                  f"GPU available: {torch.cuda.is_available()}")
    console.print(f"compiled backends: {', '.join(bi['backends'])}  CUDA archs: {bi['cuda_archs'] or '-'}")
    from fasttrain.ops.kernels import kernels
    from fasttrain.selftest import verdict_line, verdict_path
    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        console.print(verdict_line(dev))
    console.print(f"selftest verdicts: {verdict_path()}  ops run now: {kernels()}")
    table = Table(title="registered ops (torch.ops.fasttrain)")
    table.add_column("op")
    for k in DISPATCH_KEYS:
        table.add_column(k, justify="center")
    for name, keys in registered_ops():
        table.add_row(name, *["yes" if k in keys else "-" for k in DISPATCH_KEYS])
    console.print(table)


@app.command()
def selftest(device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when visible)"),
             quick: bool = typer.Option(False, "--quick", help="a few cases per op (seconds)"),
             json_out: Optional[Path] = typer.Option(None, "--json", help="write the report (device, versions, rows)"),
             op: list[str] = typer.Option([], "--op", help="only this op (repeatable)")) -> None:
    """Check every compiled kernel against the float64 reference on this device; exit 1 on any failure."""
    from fasttrain.selftest import main as selftest_main

    argv = (["--device", device] if device else []) + (["--quick"] if quick else []) + \
        (["--json", str(json_out)] if json_out else []) + [x for o in op for x in ("--op", o)]
    raise typer.Exit(selftest_main(argv))


SET_HELP = "Override a recipe key: --set section.key=value (repeatable), e.g. --set loss.kind=dapo"


def _fail(msg: str) -> None:
    from rich.markup import escape
    console.print(f"[red]error:[/red] {escape(msg)}")
    raise typer.Exit(2)


@app.command()
def run(recipe: str = typer.Argument("demo", help="bundled recipe name or path to a .toml"),
        set_: list[str] = typer.Option([], "--set", help=SET_HELP),
        resume: Optional[Path] = typer.Option(None, "--resume", help="continue the run in this folder"),
        out: Optional[str] = typer.Option(None, "--out", help="parent folder of the run (default runs/)"),
        no_progress: bool = typer.Option(False, "--no-progress", help="no live progress bar")) -> None:
    """Train a policy with RECIPE (default: the CPU demo) and write runs/<run-id>/."""
    from fasttrain.train import ConfigError, Trainer, TrainingStopped, load_config

    try:
        if resume is not None:
            trainer = Trainer.resume(resume, set_, progress=not no_progress, console=console)
        else:
            overrides = list(set_) + ([f"run.out={json.dumps(out)}"] if out else [])
            trainer = Trainer(load_config(recipe, overrides), progress=not no_progress, console=console)
        console.print(f"run [bold]{trainer.run_id}[/bold] -> {trainer.dir}")
        export = trainer.train()
    except (ConfigError, FileNotFoundError) as e:
        _fail(str(e))
    except TrainingStopped as e:
        _fail(str(e))
    sh = export["shipped"]
    if sh:
        hold = sh["holdout_core"]
        console.print(f"shipped step {sh['step']}: train core {sh['train_core']:+.4f}"
                      + (f", holdout core {hold:+.4f}" if isinstance(hold, float) and hold == hold else ""))
    console.print(f"report: {trainer.dir / 'report.md'}")


@app.command()
def init(name: str = typer.Argument(..., help="folder to create for the task, e.g. my_task")) -> None:
    """Write a starter task (a 20-row dataset, two reward functions, a recipe) to train at once."""
    from fasttrain.starter import write_starter

    try:
        files = write_starter(name)
    except (FileExistsError, ValueError) as e:
        _fail(str(e))
    for f in files:
        console.print(f"wrote {f}")
    console.print(f"train it: [bold]fasttrain run {Path(name) / 'recipe.toml'}[/bold]")


@app.command()
def ladder(recipes: list[str] = typer.Argument(..., help="recipes to run in order, e.g. dapo cispo cispo_repo_r"),
           set_: list[str] = typer.Option([], "--set", help=SET_HELP),
           out: Optional[str] = typer.Option(None, "--out", help="parent folder of the runs"),
           no_progress: bool = typer.Option(False, "--no-progress")) -> None:
    """Run several recipes and write the seed-style table (rung, configuration, shipped step, holdout, change, versus)."""
    from fasttrain.train import ConfigError
    from fasttrain.train.ladder import run_ladder

    try:
        path, _ = run_ladder(recipes, set_, out, progress=not no_progress, console=console)
    except (ConfigError, FileNotFoundError) as e:
        _fail(str(e))
    console.print(path.read_text())
    console.print(f"table: {path}")


@app.command(name="filter")
def filter_(recipe: str = typer.Argument(..., help="recipe whose policy and environment to use"),
            set_: list[str] = typer.Option([], "--set", help=SET_HELP),
            out: Optional[Path] = typer.Option(None, "--out", help="selection file (default: the recipe's env.prompts)")) -> None:
    """Keep the train prompts the starting policy solves sometimes (0 < success rate < 1)."""
    from fasttrain.train import ConfigError, load_config
    from fasttrain.train.prompt_filter import filter_prompts

    try:
        sel = filter_prompts(load_config(recipe, set_), out,
                             progress=lambda i, n: console.print(f"  scored {i}/{n} prompts", end="\r"))
    except (ConfigError, FileNotFoundError) as e:
        _fail(str(e))
    how = "closest to break-even (too few mixed prompts)" if sel["fallback_closest_to_half"] else "0 < rate < 1"
    console.print(f"kept {sel['kept']} of {sel['prompts_scored']} prompts ({how}) -> {sel['path']}")


@app.command(name="eval")
def eval_(run_dir: Path = typer.Argument(..., help="a finished run folder"),
          set_: list[str] = typer.Option([], "--set", help=SET_HELP)) -> None:
    """Score the run's shipped checkpoint on the frozen probe (train slice and holdout)."""
    from fasttrain.train import ConfigError
    from fasttrain.train.evaluate import evaluate_run

    try:
        res = evaluate_run(run_dir, set_)
    except (ConfigError, FileNotFoundError) as e:
        _fail(str(e))
    table = Table(title=f"probe of the shipped checkpoint (step {res['step']})")
    for c in ("slice", "core", "success", "valid"):
        table.add_column(c)
    for sl in ("train", "holdout"):
        table.add_row(sl, f"{res[sl + '_core']:+.4f}", f"{res[sl + '_success']:.0%}", f"{res[sl + '_valid']:.0%}")
    console.print(table)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
