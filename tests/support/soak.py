"""The soak's reusable part: a tiny-model run (support.tiny_world's 2-layer byte-level Llama)
uninterrupted, and the same run SIGKILLed at random points and resumed after each kill, and the
comparison of the two (adapters and AdamW moments bit for bit, metrics.jsonl timings aside,
samples.jsonl, probes.jsonl). tests/train/test_soak_short.py runs the short version (40 steps,
3 kills, forked segments); bench/soak.py the long one (300 steps, 6 kills, `fasttrain run` in its
own process per segment) and records what it found.

Each killed segment runs until the run's metrics.jsonl reaches a random step, then a random
fraction of a second more (so the kill lands anywhere in a step: rollout, scoring, update, a
checkpoint write), then gets SIGKILL. What is lost is at most the steps since the last
checkpoint; the resumed run must repeat them bit for bit.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent

__all__ = ["recipe", "rss_mb", "uninterrupted", "killed_run", "rows", "compare"]


def recipe(out: Path, steps: int, every: int, seed: int = 7) -> dict:
    return {
        "run": {"name": "soak", "seed": seed, "steps": steps, "out": str(out), "device": "cpu", "threads": 1,
                "checkpoint_every": every},
        "policy": {"model": "support.tiny_world:tiny_policy", "dtype": "float32", "rank": 4, "alpha": 8.0},
        "env": {"name": "support.tiny_world:make_env"},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8},
        "advantages": {"priorities": {"core": 3.0}, "floor": -1e9},
        "loss": {"kind": "cispo", "repo_r": True, "passes": 2, "token_mask": "all", "thermostat_warmup": 2},
        "optim": {"lr": 1e-2, "micro_batch": 3},
        "probe": {"every": max(every * 4, 10), "prompts": 3},
    }


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def uninterrupted(cfg_dict: dict, rss_at: tuple[int, ...] = ()) -> tuple[Path, dict[int, float]]:
    """The reference run in this process; resident memory (MB) after the steps in rss_at."""
    from fasttrain.train import Trainer, load_config
    tr = Trainer(load_config(cfg_dict), progress=False)
    real, rss = tr._train_step, {}

    def step(s):
        out = real(s)
        if s in rss_at:
            import gc
            gc.collect()
            rss[s] = rss_mb()
        return out
    tr._train_step = step
    tr.train()
    return tr.dir, rss


def _lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _launch_cli(recipe_file: Path, run_dir: Path | None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(TESTS)]), "OMP_NUM_THREADS": "1"}
    args = ["run", "--resume", str(run_dir)] if run_dir else ["run", str(recipe_file)]
    with open(recipe_file.parent / "segments.log", "ab") as log:
        p = subprocess.Popen([sys.executable, "-m", "fasttrain", *args, "--no-progress"], env=env,
                             stdout=log, stderr=log)
    return p.pid, p.wait, p.poll                          # exit code, minus the signal that ended it


def _launch_fork(recipe_file: Path, run_dir: Path | None):
    pid = os.fork()
    if pid == 0:                                         # the child: one segment of the run
        code = 0
        try:
            from fasttrain.cli import app
            args = ["run", "--resume", str(run_dir)] if run_dir else ["run", str(recipe_file)]
            log = os.open(recipe_file.parent / "segments.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(log, 1)
            os.dup2(log, 2)
            app([*args, "--no-progress"], prog_name="fasttrain")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        os._exit(code)
    status: list[int] = []

    def wait(flags: int = 0) -> int | None:
        if not status:
            got, st = os.waitpid(pid, flags)
            if got == 0:
                return None
            status.append(-os.WTERMSIG(st) if os.WIFSIGNALED(st) else os.WEXITSTATUS(st))
        return status[0]
    return pid, wait, lambda: wait(os.WNOHANG)


def killed_run(cfg_dict: dict, workdir: Path, kills: int, rng: random.Random, launcher: str = "cli",
               log=print) -> tuple[Path, list[dict]]:
    """The same run, SIGKILLed `kills` times at random steps (and random moments within them) and
    resumed each time; returns its folder and what each kill cost."""
    from fasttrain.train.config import config_to_toml, load_config
    steps = cfg_dict["run"]["steps"]
    recipe_file = workdir / "soak.toml"
    recipe_file.write_text(config_to_toml(load_config(cfg_dict)))
    out = Path(cfg_dict["run"]["out"])
    launch = _launch_fork if launcher == "fork" else _launch_cli
    targets = sorted(rng.sample(range(2, steps), kills))
    events, run_dir, done = [], None, 0
    for target in targets + [None]:
        pid, wait, poll = launch(recipe_file, run_dir)
        if target is None:
            code = wait()
            if code != 0:
                raise RuntimeError(f"the last resumed segment failed (exit status {code})")
            break
        target = max(target, done + 1)               # past where the last kill left the files
        while True:                                  # until the run reaches the target step
            if run_dir is None and out.exists():
                found = [p for p in out.iterdir() if p.is_dir()]
                run_dir = found[0] if found else None
            if run_dir is not None and _lines(run_dir / "metrics.jsonl") >= target:
                break
            if poll() is not None:
                raise RuntimeError(f"a segment ended on its own before step {target} (exit status {poll()}); "
                                   f"see {recipe_file.parent / 'segments.log'}")
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.4))            # anywhere within the next step
        done = _lines(run_dir / "metrics.jsonl")
        os.kill(pid, signal.SIGKILL)
        wait()
        latest = json.loads((run_dir / "checkpoints" / "latest.json").read_text())["step"] \
            if (run_dir / "checkpoints" / "latest.json").exists() else 0
        events.append({"killed_after_step": done, "resumed_from": latest, "steps_lost": done - latest})
        log(f"SIGKILL after step {done}: resume from checkpoint {latest} ({done - latest} steps to redo)")
    return run_dir, events


def rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("seconds")}
            for line in path.read_text().splitlines()]


def compare(a: Path, b: Path, steps: int) -> dict[str, bool]:
    from safetensors.torch import load_file
    fa, fb = (load_file(str(d / "checkpoints" / f"step_{steps:06d}" / "trainer_state.safetensors")) for d in (a, b))
    return {"adapters_and_moments_bit_equal": fa.keys() == fb.keys() and all(fa[k].equal(fb[k]) for k in fa),
            "metrics_equal": rows(a / "metrics.jsonl") == rows(b / "metrics.jsonl"),
            "samples_equal": rows(a / "samples.jsonl") == rows(b / "samples.jsonl"),
            "probes_equal": rows(a / "probes.jsonl") == rows(b / "probes.jsonl")}
