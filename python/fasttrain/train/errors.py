"""The error that stops a run with a message saying why and how to go on (the trainer raises it;
`fasttrain run` prints it and exits). A stop by a scheduler's signal is fasttrain.train.preemption's
Preempted."""
from __future__ import annotations

import errno
from pathlib import Path

from fasttrain.train.checkpoint import newest_checkpoint_name

__all__ = ["TrainingStopped", "disk_stop"]

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
