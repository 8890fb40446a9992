"""One progress display for a whole run: step k/N with elapsed time and ETA, and the phase the
run is in (base eval, warm start, rollout, update, eval) on a line of its own.

On a terminal it is a rich live display (the step lines scroll above it); when output is not a
terminal (CI, `| tee`, a log file) it prints one plain line per phase instead, so a log still
says what the run was doing when it stopped. Rank 0 only under torchrun.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from agent_grpo.logs import get_logger

__all__ = ["RunProgress", "format_duration"]

log = get_logger("train")


def format_duration(seconds: float) -> str:
    """`1h02m`, `3m07s` or `12s`."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class RunProgress:
    """The run's progress: `with RunProgress(steps, first) as p: p.phase("rollout"); p.step()`.

    `RunProgress.off()` is one that shows nothing (other ranks, tests)."""

    def __init__(self, steps: int, first: int = 0, console: Console | None = None) -> None:
        self.steps, self.done, self.first = steps, first, first
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self.quiet = False
        self.started = time.monotonic()
        self._progress: Progress | None = None
        self._run: TaskID | None = None
        self._phase: TaskID | None = None

    @classmethod
    def off(cls) -> RunProgress:
        """A progress that shows nothing."""
        progress = cls(0)
        progress.live, progress.quiet = False, True
        return progress

    def __enter__(self) -> RunProgress:
        if self.live:
            self._progress = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                MofNCompleteColumn(), TextColumn("elapsed"), TimeElapsedColumn(),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=True,
            )  # fmt: skip
            self._progress.start()
            self._run = self._progress.add_task("GRPO steps", total=self.steps, completed=self.done)
            self._phase = self._progress.add_task("starting", total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Take the live display down (idempotent: the loop closes it before its table)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def eta_s(self, now: float) -> float | None:
        """Seconds left at the mean pace of the steps run so far (None before the first)."""
        ran = self.done - self.first
        if ran <= 0:
            return None
        return (now - self.started) / ran * (self.steps - self.done)

    def phase(self, name: str) -> None:
        """Show `name` as the current phase (until the next call)."""
        if self._progress is not None and self._phase is not None:
            self._progress.update(self._phase, description=name)
            return
        if self.quiet:
            return
        now = time.monotonic()
        eta = self.eta_s(now)
        log.info("[%d/%d] %s (elapsed %s%s)", self.done, self.steps, name,
                 format_duration(now - self.started),
                 "" if eta is None else f", ETA {format_duration(eta)}")  # fmt: skip

    def start_at(self, done: int) -> None:
        """Steps start at `done` (a resumed run): the ETA counts only steps run from here."""
        self.done = self.first = done
        self.started = time.monotonic()
        if self._progress is not None and self._run is not None:
            self._progress.update(self._run, completed=done)

    def step(self) -> None:
        """One GRPO step is done."""
        self.done += 1
        if self._progress is not None and self._run is not None:
            self._progress.update(self._run, completed=self.done)
