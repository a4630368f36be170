"""SIGTERM and SIGUSR1: the run stops at the next safe point, writes the checkpoint of the last
completed step, exits with status 75, and `--resume` continues it into the uninterrupted run.

Each signalled run is `fasttrain run` in a forked child that sends the signal to itself at a
chosen point: during the rollout of a step (the step is dropped), and during an update (the step
is finished first)."""
import json
import os
import signal

from fasttrain.cli import app
from fasttrain.train import Trainer, load_config
from fasttrain.train.config import config_to_toml
from fasttrain.train.preemption import EXIT_PREEMPTED

STEPS = 5


def _rows(path):
    return [{k: v for k, v in json.loads(l).items() if not k.startswith("seconds")}
            for l in path.read_text().splitlines()]


def _said(capfd) -> str:
    out = capfd.readouterr()
    return " ".join((out.out + out.err).split())         # the console wraps long lines


def _signal_in(where: str, call: int, signum: int, monkeypatch) -> None:
    """Send `signum` at the `call`-th call of `where`, "module:function" (the module whose code calls it)."""
    import importlib
    module_name, fn_name = where.split(":")
    module = importlib.import_module(module_name)
    real, calls = getattr(module, fn_name), [0]

    def wrapped(*a, **kw):
        calls[0] += 1
        if calls[0] == call:
            os.kill(os.getpid(), signum)
        return real(*a, **kw)
    monkeypatch.setattr(module, fn_name, wrapped)


def test_sigterm_and_sigusr1_checkpoint_the_last_step_and_resume_exactly(tiny, tiny_recipe, monkeypatch, capfd):
    from support.fault_world import run_in_child
    # checkpoints only at the end: what a signal saves is the stop's own checkpoint
    recipe = tiny_recipe(tiny / "runs", **{"run.steps": STEPS, "run.checkpoint_every": 100, "probe.every": 0})
    full = Trainer(load_config(recipe), progress=False)
    full.train()
    cfg = load_config({**recipe, "run": {**recipe["run"], "out": str(tiny / "signalled")}})
    (tiny / "recipe.toml").write_text(config_to_toml(cfg))

    def cli(*args):
        return lambda: app([*args, "--no-progress"], prog_name="fasttrain")

    def signalled(where, call, signum, *args):
        def go():
            _signal_in(where, call, signum, monkeypatch)
            cli(*args)()
        return run_in_child(go)

    # SIGTERM in the rollout of step 3: step 3 is dropped, step 2 is checkpointed
    assert signalled("fasttrain.train.answers:sample_answers", 3, signal.SIGTERM, "run",
                     str(tiny / "recipe.toml")) == EXIT_PREEMPTED
    out = _said(capfd)
    assert "received SIGTERM: stopping at the next safe point" in out, out
    assert "stopped by SIGTERM after step 2" in out, out
    (run,) = (tiny / "signalled").iterdir()
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 2
    assert [r["step"] for r in _rows(run / "metrics.jsonl")] == [1, 2]
    # SIGUSR1 during the update of step 4 (the 2nd update after the resume): step 4 is finished first
    assert signalled("fasttrain.train.trainer:update_policy", 2, signal.SIGUSR1, "run", "--resume",
                     str(run)) == EXIT_PREEMPTED
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 4
    assert "stopped by SIGUSR1 after step 4" in _said(capfd)
    assert run_in_child(cli("run", "--resume", str(run))) == 0
    for f in ("metrics.jsonl", "samples.jsonl", "probes.jsonl"):
        assert _rows(run / f) == _rows(full.dir / f), f
