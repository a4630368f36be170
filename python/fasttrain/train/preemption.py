"""Stopping on a scheduler's signal: SIGTERM (sent before a preemption or at the end of a job's
time; torchrun's agent forwards it to every rank) and SIGUSR1 (which some schedulers send first,
e.g. Slurm's `--signal=USR1@120`).

    with StopSignals(cfg.run.stop_timeout) as stop:
        ... with stop.abortable(): rollout ...     # a signal here ends the step at once
        ... if stop.agreed(): checkpoint, raise Preempted(...)   # at each step's end

What happens on a signal: the trainer finishes the step in hand (or drops it, when the signal
comes during its rollout in one process: nothing of that step is recorded yet), writes the
checkpoint of the last completed step and exits with status EXIT_PREEMPTED (75, "temporary
failure": requeue and `--resume`). The resumed run is the uninterrupted one.

Why a watcher thread: Python runs a signal's handler in the main thread between bytecodes, so a
rank blocked in a collective for a dead or hung peer would never see it before run.dist_timeout.
The C-level handler also writes the signal's number to a pipe (signal.set_wakeup_fd); a thread
blocked on that pipe wakes at once and gives the main thread `timeout_s` to reach a safe point;
past it the process leaves (os._exit, EXIT_PREEMPTED) and the last complete checkpoint stands.

Under torchrun the ranks stop together: each step's end asks every rank whether one was
signalled (one small all-reduce), so they write the same checkpoint; the rollout is not aborted
there (ranks would leave the step at different points).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Callable

__all__ = ["StopSignals", "Preempted", "EXIT_PREEMPTED", "SIGNALS"]

EXIT_PREEMPTED = 75                      # sysexits' EX_TEMPFAIL: try again (resume)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Stopped by a signal at a safe point; the checkpoint of `step` is written."""

    def __init__(self, signum: int, step: int = -1):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.step = signum, step

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class StopSignals:
    """Records SIGTERM/SIGUSR1 while active (see the module docstring); a no-op off the main thread."""

    def __init__(self, timeout_s: float, say: Callable[[str], None] = print):
        self.timeout_s, self.say = float(timeout_s), say
        self.requested: int | None = None
        self._abortable = False
        self._old: dict[int, object] = {}
        self._pipe: tuple[int, int] | None = None
        self._old_fd = -1
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    # ---- life ---------------------------------------------------------------------------
    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for s in SIGNALS:
            self._old[s] = signal.signal(s, self._on_signal)
        threading.Thread(target=self._watch, args=(r, w), name="fasttrain-stop-signals", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if self._pipe is None:
            return
        for s, h in self._old.items():
            signal.signal(s, h)
        signal.set_wakeup_fd(self._old_fd)
        if self._timer is not None:
            self._timer.cancel()
        os.write(self._pipe[1], b"\0")            # ends the watcher, which closes the pipe
        self._pipe = None

    # ---- the two threads ------------------------------------------------------------------
    def _on_signal(self, signum: int, frame) -> None:       # main thread, between bytecodes
        self._note(signum)
        if self._abortable:
            self._abortable = False
            raise Preempted(signum)

    def _watch(self, r: int, w: int) -> None:                  # its own thread: wakes at once
        try:
            while True:
                data = os.read(r, 64)
                if not data or 0 in data:
                    return
                for signum in (b for b in data if b in SIGNALS):
                    self._note(signum)
        finally:
            os.close(r)
            os.close(w)

    def _note(self, signum: int) -> None:
        """The first signal: recorded, the stop's deadline started, the console told (by whichever
        thread sees it first)."""
        with self._lock:
            if self._timer is not None:
                return
            self.requested = signum
            self._timer = threading.Timer(self.timeout_s, self._give_up, args=(signum,))
            self._timer.daemon = True
            self._timer.start()
        self.say(f"received {signal.Signals(signum).name}: stopping at the next safe point (a checkpoint of "
                 f"the last completed step, within run.stop_timeout = {self.timeout_s:g} s)")

    def _give_up(self, signum: int) -> None:
        self.say(f"no safe point within run.stop_timeout = {self.timeout_s:g} s of "
                 f"{signal.Signals(signum).name} (a peer rank is gone or hangs): leaving without a new "
                 f"checkpoint; the last complete checkpoint stands (exit status {EXIT_PREEMPTED})")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)

    # ---- what the trainer asks ------------------------------------------------------------
    @contextlib.contextmanager
    def abortable(self, allowed: bool = True):
        """A signal inside raises Preempted at once (one already received raises on entry)."""
        if not allowed:
            yield
            return
        if self.requested is not None:
            raise Preempted(self.requested)
        self._abortable = True
        try:
            yield
        finally:
            self._abortable = False

    def agreed(self, any_rank: Callable[[bool], bool]) -> bool:
        """Whether to stop now: some rank was signalled (`any_rank` reduces over the ranks)."""
        return any_rank(self.requested is not None)
