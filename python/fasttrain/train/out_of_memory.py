"""The out-of-memory back-off: each phase of a step (the rollout, the scoring, the update) runs
with a batch size; torch.OutOfMemoryError halves that size, kept for the rest of the run (and in
checkpoints), and runs the phase again, down to one row. The step's other phases are not redone.

An update of k > 1 passes may run out of memory after some passes stepped: `undo_update` copies
the adapters and AdamW's moments to host memory first, and the retry starts from that copy.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from fasttrain.train import distributed
from fasttrain.train.errors import TrainingStopped

__all__ = ["OutOfMemoryBackoff", "undo_update"]

WHAT = {"rollout": "prompts per rollout chunk", "scores": "answers per scoring micro-batch",
        "update": "answers per update micro-batch"}


class OutOfMemoryBackoff:
    """`sizes`: each phase's batch (rollout: prompts per chunk, None = all; scores and update:
    answers per micro-batch), a dict shared with its owner and changed in place. `whole_rollout`:
    the prompts of one rank's step (the rollout's size when None). `warn(step, message)` says
    each halving; `last_checkpoint()` names the checkpoint a stop points to."""

    def __init__(self, sizes: dict[str, int | None], whole_rollout: int, warn: Callable[[int, str], None],
                 last_checkpoint: Callable[[], str]):
        self.sizes = sizes
        self.whole_rollout = whole_rollout
        self.warn = warn
        self.last_checkpoint = last_checkpoint
        self.retries = 0                     # halvings in the step under way

    def run(self, step: int, phase: str, run: Callable[[int | None], Any], model: torch.nn.Module,
            undo: Callable[[], None] | None = None) -> Any:
        """run(size) with the phase's size, halved and run again on out-of-memory; TrainingStopped
        with one row, and in the update under torchrun (the ranks' collectives cannot redo one
        rank's update)."""
        training = model.training
        while True:
            size = self.sizes[phase]
            try:
                return run(size)
            except torch.OutOfMemoryError as e:
                now = size or self.whole_rollout
                if now <= 1 or (phase == "update" and distributed.world_size() > 1):
                    why = ("with one row" if now <= 1 else
                           "in the update under torchrun (the ranks' collectives cannot redo one rank's update)")
                    raise TrainingStopped(
                        f"step {step}: out of memory {why} ({phase}: {str(e).strip()[:200]}). Lower "
                        f"rollout.max_new_tokens or rollout.group_size, or see `fasttrain plan`; the last "
                        f"checkpoint is {self.last_checkpoint()}.") from None
                self.sizes[phase] = now // 2
                self.retries += 1
                self.warn(step, f"out of memory in the {phase} of step {step} with {now} {WHAT[phase]}: "
                               f"retrying with {now // 2} (kept for the rest of the run)")
                del e
                if undo is not None:
                    undo()
                model.train(training)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()


def undo_update(model: torch.nn.Module, params: list[torch.Tensor],
                optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """A function that puts the adapters and AdamW back as they are now (before an update that may
    run out of memory part-way, after some passes stepped). The copy is kept in host memory: it
    must not add to the device memory the update needs. Only an update of k > 1 passes needs it:
    with one pass nothing has stepped before its end, and pass 1 starts by clearing the gradients."""
    saved = [p.detach().to("cpu", copy=True) for p in params]
    state = {p: {k: (v.to("cpu", copy=True), v.device) if torch.is_tensor(v) else v for k, v in st.items()}
             for p, st in optimizer.state.items()}
    training = model.training

    def undo() -> None:
        with torch.no_grad():
            for p, v in zip(params, saved):
                p.copy_(v)
                p.grad = None
        optimizer.state.clear()
        for p, st in state.items():
            optimizer.state[p] = {k: v[0].to(v[1], copy=True) if isinstance(v, tuple) else v
                                  for k, v in st.items()}
        model.train(training)
    return undo
