"""Runs the tiny recipe (in one process, or as one torchrun rank) and records, per step and per
rank, what the data-parallel equality test compares: this rank's advantages, the entropies and
top-entropy mask of its answer tokens, the gradients AdamW steps with (after the all-reduce and
clipping) and the adapters after the step.

    torchrun --standalone --nproc-per-node 2 dist_driver.py RECIPE.json RECORD_DIR

Also a test environment whose rank 1 kills itself with SIGKILL (make_dying_env)."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def run(recipe: dict, record_dir: Path) -> dict[str, torch.Tensor]:
    """Train the recipe; returns (and saves as record_dir/rank{R}.safetensors) the records."""
    from safetensors.torch import save_file

    from fasttrain.train import Trainer, distributed, load_config
    from fasttrain.train import trainer as trainer_mod

    rec: dict[str, torch.Tensor] = {}
    original = trainer_mod.update_policy
    step = {"n": 0}

    def recorded_update(model, params, optimizer, roll, batch, adv, loss_mask, *args, **kw):
        step["n"] += 1
        s = step["n"]
        cm = roll.completion_mask.bool()
        if s == 1:
            rec["0/params"] = _flat(params)
        rec[f"{s}/seq_len"] = torch.tensor(roll.input_ids.shape[1])
        rec[f"{s}/adv"] = adv.detach().cpu().float()
        rec[f"{s}/entropy"] = batch.entropy[cm].detach().cpu().float()    # row-major answer tokens
        rec[f"{s}/keep"] = loss_mask[cm].detach().cpu().to(torch.uint8)
        grads = []
        opt_step = optimizer.step

        def step_and_record(*a, **k):
            grads.append(_flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params]))
            return opt_step(*a, **k)

        optimizer.step = step_and_record
        try:
            out = original(model, params, optimizer, roll, batch, adv, loss_mask, *args, **kw)
        finally:
            optimizer.step = opt_step
        for k, g in enumerate(grads):
            rec[f"{s}/grad{k}"] = g
        rec[f"{s}/params"] = _flat(params)
        return out

    trainer_mod.update_policy = recorded_update
    try:
        tr = Trainer(load_config(recipe), progress=False)
        tr.train()
    finally:
        trainer_mod.update_policy = original
    record_dir.mkdir(parents=True, exist_ok=True)
    save_file(rec, str(record_dir / f"rank{distributed.rank()}.safetensors"),
              metadata={"run_dir": str(tr.dir), "world_size": str(distributed.world_size())})
    return rec


class RankCrash(BaseException):
    """An error no layer of the trainer handles (the plugin wrapper turns Exceptions into scores)."""


class DyingEnv:
    """The tiny letter environment, except that rank 1 kills itself (SIGKILL, no clean-up), or raises
    with DIE_HOW=raise, when it scores training answers for the DIE_AT_CALL-th time. DIE_HOW=term_agent
    sends SIGTERM to torchrun's agent instead (which sends it on to every rank) and waits 2 s in
    the scoring, so the signal comes during that step; DIE_HOW=hang does the same and then hangs
    with SIGTERM and SIGUSR1 ignored (a rank stuck in C code) until the agent kills it."""

    def __init__(self):
        from support.tiny_world import make_env
        self.inner = make_env()
        self.name, self.channels = self.inner.name, self.inner.channels
        self.data_slices, self.answer_format = self.inner.data_slices, self.inner.answer_format
        self.calls = 0

    def prompts(self, split):
        return self.inner.prompts(split)

    def score(self, *a, **k):
        return self.inner.score(*a, **k)

    def score_many(self, prompts, answers, data_slice="train"):
        if data_slice == "train" and len(prompts) and os.environ.get("RANK") == "1":
            self.calls += 1
            if self.calls == int(os.environ.get("DIE_AT_CALL", "0")):
                how = os.environ.get("DIE_HOW")
                if how == "raise":                             # past the plugin's `except Exception`
                    raise RankCrash("the test environment failed on purpose on rank 1")
                if how in ("term_agent", "hang"):
                    import time
                    if how == "hang":
                        for s in (signal.SIGTERM, signal.SIGUSR1):
                            signal.signal(s, signal.SIG_IGN)
                    os.kill(os.getppid(), signal.SIGTERM)
                    time.sleep(3600 if how == "hang" else 2.0)
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.score_many(prompts, answers, data_slice)


def make_dying_env() -> DyingEnv:
    return DyingEnv()


if __name__ == "__main__":
    from fasttrain.train import distributed
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
    distributed.finish()
