"""The `fasttrain` command line (Typer)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from fasttrain.selftest.command import selftest as selftest_command

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
    console.print(f"compiled backends: {', '.join(bi['backends'])}  CUDA archs: {bi['cuda_archs'] or '-'}"
                  + (f" + PTX {bi['cuda_ptx']}" if bi.get("cuda_ptx") else ""))
    console.print(f"CPU kernels: {bi['cpu_variant']} variant (compiled: {bi['cpu_variants'].replace(',', ', ')}; "
                  f"ATen dispatches at {torch.backends.cpu.get_cpu_capability()})")
    from fasttrain.ops.kernels import kernels
    from fasttrain.selftest.cache import verdict_line, verdict_path
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


# `fasttrain selftest`: the command of fasttrain.selftest.command (also `python -m fasttrain.selftest`)
app.command(name="selftest")(selftest_command)


SET_HELP = "Override a recipe key: --set section.key=value (repeatable), e.g. --set loss.kind=dapo"


def _fail(msg: str) -> None:
    from rich.markup import escape
    console.print(f"[red]error:[/red] {escape(msg)}")
    raise typer.Exit(2)


@app.command()
def run(recipe: str = typer.Argument("demo", help="bundled recipe name or path to a .toml"),
        set_: list[str] = typer.Option([], "--set", help=SET_HELP),
        resume: Optional[Path] = typer.Option(None, "--resume", help="continue the run in this folder"),
        from_: Optional[str] = typer.Option(None, "--from", help="with --resume: the kept checkpoint to "
                                            "continue from, e.g. step_000040 (default: the newest whole one)"),
        out: Optional[str] = typer.Option(None, "--out", help="parent folder of the run (default runs/)"),
        no_progress: bool = typer.Option(False, "--no-progress", help="no live progress bar"),
        nproc: int = typer.Option(1, "--nproc", min=1, help="data-parallel processes on this machine "
                                  "(one per GPU; starts torchrun)"),
        dry_run: bool = typer.Option(False, "--dry-run", help="resolve the recipe and overrides, load the dataset "
                                     "and reward functions, print the plan, and stop (no weights are loaded)")) -> None:
    """Train a policy with RECIPE (default: the CPU demo) and write runs/<run-id>/."""
    from fasttrain.extras import require

    require("transformers")             # every policy loads through it: say so before a run folder exists
    from fasttrain.train import ConfigError, Trainer, TrainingStopped, distributed, load_config
    from fasttrain.train.checkpoint import CheckpointError
    from fasttrain.train.preemption import EXIT_PREEMPTED, Preempted

    if dry_run:
        _dry_run(recipe, set_, resume, out, nproc)
        return
    from_step = _from_step(from_, resume)
    if nproc > 1:
        _launch(nproc, recipe, set_, resume, out, no_progress, from_)
    trainer = None
    try:
        if resume is not None:
            trainer = Trainer.resume(resume, set_, from_step, progress=not no_progress, console=console)
        else:
            overrides = list(set_) + ([f"run.out={json.dumps(out)}"] if out else [])
            trainer = Trainer(load_config(recipe, overrides), progress=not no_progress, console=console)
        if trainer.main:
            console.print(f"run [bold]{trainer.run_id}[/bold] -> {trainer.dir}")
        export = trainer.train()
    except (ConfigError, FileNotFoundError, CheckpointError) as e:
        _fail(str(e))
    except TrainingStopped as e:
        _fail(str(e))
    except Preempted:
        # stopped by SIGTERM / SIGUSR1 at a safe point, its checkpoint written (the trainer said so):
        # status 75 (EX_TEMPFAIL) tells a scheduler to requeue; --resume continues the same run
        sys.stdout.flush()
        sys.stderr.flush()
        if distributed.world_size() > 1:
            os._exit(EXIT_PREEMPTED)
        raise typer.Exit(EXIT_PREEMPTED)
    except distributed.RankLost as e:
        # The process group is broken (a peer is gone): its backend threads can abort the interpreter's
        # normal exit (gloo: "terminate called without an active exception", SIGABRT), which would
        # also make torchrun report this rank rather than the lost one. Say why, then leave at once.
        try:
            _fail(str(e).replace("RUN_DIR", str(trainer.dir) if trainer else "RUN_DIR"))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
    distributed.finish()
    if not trainer.main:
        return
    sh = export["shipped"]
    if sh:
        hold = sh["holdout_core"]
        console.print(f"shipped step {sh['step']}: train core {sh['train_core']:+.4f}"
                      + (f", holdout core {hold:+.4f}" if isinstance(hold, float) and hold == hold else ""))
    console.print(f"report: {trainer.dir / 'report.md'}")


def _run_config(recipe: str, set_: list[str], resume: Optional[Path], out: Optional[str] = None):
    """The config `run` would train with: the run folder's own config.toml under --resume, else the recipe."""
    import tomllib

    from fasttrain.train import load_config
    from fasttrain.train.config import saved_run_data

    if resume is not None:
        if not (resume / "config.toml").exists():
            raise FileNotFoundError(f"--resume {resume}: no config.toml there (not a fasttrain run folder)")
        return load_config(saved_run_data(tomllib.loads((resume / "config.toml").read_text())), set_)
    return load_config(recipe, list(set_) + ([f"run.out={json.dumps(out)}"] if out else []))


def _dry_run(recipe: str, set_: list[str], resume: Optional[Path], out: Optional[str], nproc: int) -> None:
    """`run --dry-run`: the checks of a run up to its first weight, then the plan (fasttrain.train.preflight)."""
    from fasttrain.train import ConfigError, distributed
    from fasttrain.train.preflight import dry_run

    try:
        cfg = _run_config(recipe, set_, resume, out)
        distributed.check_prompts_per_step(cfg.rollout.prompts_per_step, nproc)
        lines = dry_run(cfg)
    except (ConfigError, FileNotFoundError) as e:
        _fail(str(e))
    for line in lines:
        console.print(line, markup=False, highlight=False)


def _from_step(text: Optional[str], resume: Optional[Path]) -> Optional[int]:
    """--from step_000040 (or step_40, or 40) -> 40."""
    if text is None:
        return None
    if resume is None:
        _fail("--from picks a checkpoint of the run given to --resume; add --resume RUN_DIR")
    digits = text.strip().removeprefix("step_")
    if not digits.isdigit():
        _fail(f"--from {text!r}: name a checkpoint folder such as step_000040 (or its step, 40)")
    return int(digits)


def _launch(nproc: int, recipe: str, set_: list[str], resume: Optional[Path], out: Optional[str],
            no_progress: bool, from_: Optional[str] = None) -> None:
    """`run --nproc N`: check the recipe here, then start the same command under torchrun."""
    import os

    from fasttrain.train import ConfigError, distributed

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _fail("--nproc starts torchrun itself; under torchrun, leave it out")
    try:
        cfg = _run_config(recipe, set_, resume)
        distributed.check_prompts_per_step(cfg.rollout.prompts_per_step, nproc)
    except (ConfigError, FileNotFoundError) as e:
        _fail(str(e))
    argv = ["run", recipe] + [x for s in set_ for x in ("--set", s)]
    argv += (["--resume", str(resume)] if resume is not None else []) + (["--out", out] if out else [])
    argv += ["--from", from_] if from_ else []
    argv += ["--no-progress"] if no_progress else []
    raise typer.Exit(distributed.launch_local(nproc, argv))


@app.command()
def init(name: str = typer.Argument(..., help="folder to create for the task, e.g. my_task"),
         tools: bool = typer.Option(False, "--tools", help="a starter whose answers may call a tool (tools.py)"),
         reasoning_gym: Optional[str] = typer.Option(None, "--reasoning-gym", metavar="TASK[,TASK...]",
                                                     help="a recipe on reasoning-gym's generators, e.g. gcd,basic_arithmetic "
                                                          "(needs the reasoning-gym extra)")) -> None:
    """Write a starter task (300 arithmetic questions, reward functions, a recipe; --tools: and a tool;
    --reasoning-gym: a recipe on reasoning-gym's generators) to train at once."""
    from fasttrain.tasks.starter import write_reasoning_gym_recipe, write_starter

    try:
        if reasoning_gym is not None:
            if tools:
                raise ValueError("--tools and --reasoning-gym write different starters: choose one")
            files = write_reasoning_gym_recipe(name, reasoning_gym)
        else:
            files = write_starter(name, tools=tools)
    except (FileExistsError, ValueError, ImportError) as e:
        _fail(str(e))
    for f in files:
        console.print(f"wrote {f}")
    console.print(f"train it: [bold]fasttrain run {Path(name) / 'recipe.toml'}[/bold]")


@app.command()
def ladder(recipes: list[str] = typer.Argument(..., help="recipes to run in order, e.g. dapo cispo cispo_repo_r"),
           set_: list[str] = typer.Option([], "--set", help=SET_HELP),
           out: Optional[str] = typer.Option(None, "--out", help="parent folder of the runs"),
           seeds: int = typer.Option(1, "--seeds", min=1, help="runs per rung, seeds run.seed, run.seed + 1, ... "
                                     "(the same on every rung, so changes are paired)"),
           no_progress: bool = typer.Option(False, "--no-progress")) -> None:
    """Run several recipes with N seeds each and write the table that ranks them: each rung's shipped holdout
    score (mean, 95% interval) and its change against the previous rung (paired by seed)."""
    from fasttrain.train import ConfigError
    from fasttrain.train.ladder import run_ladder

    try:
        path, _ = run_ladder(recipes, set_, out, progress=not no_progress, console=console, seeds=seeds)
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


@app.command()
def export(run_dir: Path = typer.Argument(..., help="a finished run folder"),
           to: Path = typer.Option(..., "--to", help="the new folder to write"),
           fmt: str = typer.Option("merged", "--format", help="merged: a 16-bit model folder with the adapter folded "
                                   "in (transformers, vLLM); peft: the adapter as PEFT reads it; vllm: the LoRA "
                                   "adapter as vLLM's --lora-modules reads it (not DoRA)"),
           dtype: Optional[str] = typer.Option(None, "--dtype", help="merged: bfloat16 | float16 (default: the run's "
                                               "policy.dtype when 16-bit, else bfloat16)")) -> None:
    """Write the run's shipped checkpoint into a new folder, as a merged model or an adapter."""
    from fasttrain.train import ConfigError
    from fasttrain.train.export import export_run

    try:
        out = export_run(run_dir, to, fmt, dtype)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    console.print(f"exported {run_dir} ({fmt}) -> {out}")


@app.command()
def plan(recipe: str = typer.Argument("demo", help="bundled recipe name or path to a .toml"),
         set_: list[str] = typer.Option([], "--set", help=SET_HELP),
         model: Optional[str] = typer.Option(None, "--model", help="bundled config name (e.g. qwen2.5-32b), "
                                             "a config.json, or a model folder (default: the recipe's policy.model)"),
         gpu: str = typer.Option("h100-sxm-80gb", "--gpu", help="h100-sxm-80gb | h200-141gb | a100-80gb | l40s-48gb | "
                                 "cpu (this host's CPU) | cuda (this host's CUDA card)"),
         rates: str = typer.Option("measured", "--rates", help="measured: time cpu/cuda from rates measured on this "
                                   "host (once, then cached); datasheet: the table's rates and --mfu"),
         remeasure: bool = typer.Option(False, "--remeasure", help="measure this host's rates again (with --rates measured)"),
         prompt_tokens: int = typer.Option(
             360, "--prompt-tokens", help="tokens of the longest prompt, chat template included (signal-a: 344-362 "
             "with SmolLM2's tokenizer)"),
         mfu: float = typer.Option(0.4, "--mfu", help="assumed share of the bf16 peak reached by matmul phases"),
         decode_share: float = typer.Option(1.0, "--decode-share", help="measured share of the bandwidth floor "
                                            "reached by decode (1.0: the floor)"),
         verifier_rate: Optional[float] = typer.Option(None, "--verifier-answers-per-s",
                                                       help="the verifier's measured answers per second"),
         as_json_: bool = typer.Option(False, "--json", help="print the plan as JSON")) -> None:
    """Will RECIPE fit a GPU, and how long will a step take? On paper: the model is built from its config.json
    on the meta device (no weights are read)."""
    from fasttrain.plan import gpu_spec, model_config, run_shape
    from fasttrain.plan.gpus import gpu_for_device, measured
    from fasttrain.plan.report import as_json, make_plan, render
    from fasttrain.train import ConfigError, load_config

    try:
        if rates not in ("measured", "datasheet"):
            raise ValueError(f"--rates {rates!r}: allowed values are measured, datasheet")
        if gpu.strip().lower() == "cuda":
            import torch
            if not torch.cuda.is_available():
                raise ValueError("--gpu cuda: no CUDA card is visible on this host; name one of the table's GPUs")
            device = gpu_for_device("cuda")
        else:
            device = gpu_spec(gpu)
        if rates == "measured" and gpu.strip().lower() in ("cpu", "cuda"):
            from fasttrain.train.calibrate import calibrate    # on demand: measured once, then cached
            kind = gpu.strip().lower()
            device = measured(device, kind, rates=calibrate(kind, refresh=remeasure))
        cfg = load_config(recipe, set_)
        spec = model or (cfg.policy.model if cfg.policy.model not in ("", "default") else "smollm2-135m")
        if ":" in spec and not Path(spec).exists():
            raise ConfigError(f"policy.model {spec!r} is a factory; pass --model with its config.json")
        if spec.lower().endswith(".gguf"):
            raise ConfigError(f"policy.model {spec!r} is a GGUF file; pass --model with a config.json")
        p = make_plan(model_config(spec), run_shape(cfg, prompt_tokens), device,
                      name=Path(spec).stem if Path(spec).suffix == ".json" else Path(spec).name or spec,
                      env=cfg.env.name, mfu=mfu, decode_share=decode_share,
                      verifier_answers_per_s=verifier_rate)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if as_json_:
        print(json.dumps(as_json(p), indent=2, default=str))
    else:
        print(render(p))
    if not p.fits:
        raise typer.Exit(1)


def main() -> None:
    """The `fasttrain` command: a package that the plain wheel does not install, or a native
    extension built for another torch, is one line that says what to install, not a traceback."""
    from fasttrain._native import NativeExtensionError
    from fasttrain.extras import install_hint

    try:
        app()
    except ModuleNotFoundError as e:
        hint = install_hint(e)
        if hint is None:
            raise
        _say_and_exit(hint)
    except NativeExtensionError as e:
        _say_and_exit(str(e))


def _say_and_exit(line: str) -> None:
    from rich.markup import escape
    Console(stderr=True).print(f"[red]error:[/red] {escape(line)}", soft_wrap=True)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
