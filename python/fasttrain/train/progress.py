"""The progress bar of `fasttrain run` (rank 0 alone, on stderr): steps done, time, and the last
step's rewards, shares, KL, entropy, ζ and seconds; each probe's result as a line above it."""
from __future__ import annotations

from typing import Any

__all__ = ["ProgressBar", "progress_line"]


def progress_line(row: dict[str, Any]) -> str:
    """The bar's text for a step's metrics row."""
    return (f"reward {row['reward']:+.3f} core {row['core']:+.3f} valid {row['valid']:.0%} "
            f"nz {row['nonzero_adv_share']:.0%} KL {row['kl']:.4f} H {row['entropy']:.2f} "
            f"ζ {row['zeta']:.1e} {row['seconds_step']:.1f}s/step")


class ProgressBar:
    """`with ProgressBar(console, name, steps, done, shown) as bar: bar.show(step, row, probe)`;
    nothing is drawn when `shown` is false."""

    def __init__(self, console, name: str, steps: int, done: int, shown: bool = True):
        self._bar = None
        self._info = ""
        if shown:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                                 console=console, transient=False)
            self._task = self._bar.add_task(name, total=steps, completed=done, info="starting")

    def __enter__(self) -> "ProgressBar":
        if self._bar is not None:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

    def show(self, step: int, row: dict[str, Any] | None, probe: dict[str, Any] | None) -> None:
        """Steps done: `step`; the text of `row` (the last one's when None); a probe's line."""
        if self._bar is None:
            return
        if row is not None:
            self._info = progress_line(row)
        if probe is not None:
            self._bar.console.print(f"probe @ step {probe['step']}: train core {probe['train_core']:+.4f}  "
                                    f"holdout core {probe['holdout_core']:+.4f}  valid {probe['train_valid']:.0%}")
        self._bar.update(self._task, completed=step, info=self._info)
