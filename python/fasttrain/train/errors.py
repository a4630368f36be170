"""The error that stops a run with a message saying why and how to go on (the trainer raises it;
`fasttrain run` prints it and exits), and the messages of the run's stops: a full or read-only
disk, non-finite losses or adapters, Ctrl-C. A stop by a scheduler's signal is
fasttrain.train.preemption's Preempted."""
from __future__ import annotations

import errno
from pathlib import Path

from fasttrain.train.checkpoint import newest_checkpoint_name

__all__ = ["TrainingStopped", "disk_stop", "nonfinite_losses_stop", "nonfinite_state_stop", "interrupted_message"]

# the run folder's disk is full, read-only or not ours
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


class TrainingStopped(RuntimeError):
    """The run cannot continue (optim.max_skipped_steps non-finite losses in a row, non-finite
    adapters at a checkpoint, out of memory with one row); the message says why and how to go on."""


def disk_stop(e: OSError, step: int, run_dir: Path) -> TrainingStopped | None:
    """The stop for a write into the run folder that failed for want of space or permission
    (None for any other OSError, which is raised as it is)."""
    if e.errno not in DISK_ERRORS:
        return None
    return TrainingStopped(
        f"step {step}: cannot write {e.filename or run_dir}: {e.strerror} "
        f"(errno {errno.errorcode.get(e.errno, e.errno)}). The last checkpoint, "
        f"{newest_checkpoint_name(run_dir / 'checkpoints')}, is intact and the run files stay "
        f"readable (a line cut short is dropped on reading). Free space or fix the permissions, "
        f"then `fasttrain run --resume {run_dir}`.")


def nonfinite_losses_stop(step: int, in_row: int, optim, run_dir: Path) -> TrainingStopped:
    """The stop after optim.max_skipped_steps non-finite losses in a row (the checkpoint of `step`
    written first)."""
    return TrainingStopped(
        f"stopped at step {step}: {in_row} non-finite losses in a row "
        f"(optim.max_skipped_steps = {optim.max_skipped_steps}). The adapters were not "
        f"updated by those steps; try a lower rate or clipping, or policy.dtype=float32: "
        f"`fasttrain run --resume {run_dir} --set optim.lr={optim.lr / 10:g}`.")


def nonfinite_state_stop(bad: str, step: int, run_dir: Path, lr: float) -> TrainingStopped:
    """The stop for adapters or optimizer state found non-finite (`bad` names the tensor) where
    step `step`'s checkpoint was to be written."""
    last = newest_checkpoint_name(run_dir / "checkpoints")
    return TrainingStopped(
        f"step {step}: {bad} is not finite, so no checkpoint was written (the last one, {last}, "
        f"is whole). Resume from it with a lower rate: `fasttrain run --resume {run_dir} "
        f"--set optim.lr={lr / 10:g}` (or try optim.grad_clip, policy.dtype=float32).")


def interrupted_message(step: int, mid_step: bool, run_dir: Path) -> str:
    """The console line after Ctrl-C at step `step` (the last finished one): checkpointed, or, when
    the next step was under way (`mid_step`), not, the last checkpoint standing."""
    if mid_step:
        return (f"[yellow]interrupted during step {step + 1}[/yellow]: not checkpointed (it would "
                f"hold part of that step); the last checkpoint, "
                f"{newest_checkpoint_name(run_dir / 'checkpoints')}, stands; continue with "
                f"`fasttrain run --resume {run_dir}`")
    return (f"[yellow]interrupted at step {step}[/yellow]: checkpoint saved; "
            f"continue with `fasttrain run --resume {run_dir}`")
