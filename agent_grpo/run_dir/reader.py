"""A run directory read for analysis: `agent_grpo.load_run(path)` (docs/python-api.md).

`Run` wraps `run_dir.writer.RunWriter` (which owns the layout, docs/run-directory.md) with what a
notebook asks of a run: the config it ran with, a metric as a `(step, value)` series, the
held-out evaluations, the trajectories of a step and the checkpoints. Every call reads the disk,
so a run that is still being written shows its latest state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from agent_grpo.run_dir.writer import IndexEntry, RunWriter
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = ["AFTER_STEPS", "EVAL_PREFIX", "Run", "is_step_row", "load_run"]

EVAL_PREFIX = "eval_"
AFTER_STEPS = "eval_after_steps"
"""The key of a training run's evaluation that says how many GRPO steps the evaluated policy
had taken: `s + 1` in step `s`'s row (`eval.every`), `steps` in the final row. An eval run's
row has none."""


def _has_eval(row: dict[str, Any]) -> bool:
    return any(k.startswith(EVAL_PREFIX) for k in row)


def _evaluation(row: dict[str, Any]) -> dict[str, Any]:
    """An evaluation's figures in `row`, without their `eval_` prefix, and the row's step."""
    return {"step": row["step"]} | {
        k.removeprefix(EVAL_PREFIX): v for k, v in row.items() if k.startswith(EVAL_PREFIX)
    }


def is_step_row(row: dict[str, Any]) -> bool:
    """A GRPO step's row (it may also hold an `eval.every` evaluation), not an evaluation's own
    row (a training run's final one, or an eval run's)."""
    return "loss" in row


"""Prefix of the held-out evaluation metrics in `metrics.jsonl`."""


def load_run(path: str | Path) -> Run:
    """Open the run directory at `path` (FileNotFoundError if it is not one)."""
    return Run(path)


class Run:
    """One training or evaluation run directory, read for analysis."""

    def __init__(self, path: str | Path) -> None:
        self.store = RunWriter.open(path)

    @property
    def path(self) -> Path:
        """The run directory."""
        return self.store.path

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    def config(self) -> dict[str, Any]:
        """The resolved config the run started with, as the YAML's mapping."""
        data = yaml.safe_load(self.store.config_text)
        return data if isinstance(data, dict) else {}

    def metrics(self) -> list[dict[str, Any]]:
        """Every row of `metrics.jsonl` in file order: GRPO steps and evaluations alike."""
        return self.store.read_metrics()

    def series(self, name: str) -> list[tuple[int, float]]:
        """`(step, value)` of metric `name` in every row that has it (None values left out),
        e.g. `run.series("reward_mean")` for a plot. An evaluation between steps sits in its
        step's row: its policy had `step + 1` updates (`eval_after_steps`)."""
        return [(int(r["step"]), r[name]) for r in self.metrics() if r.get(name) is not None]

    def evaluations(self) -> list[dict[str, Any]]:
        """The held-out evaluations, `eval_` dropped from their keys (`success_rate`,
        `pass_at_k`, ...), each with its row's `step`: an eval run's one; a training run's
        between steps (`eval.every`) and its final, each with `after_steps`, the updates its
        policy had."""
        return [_evaluation(r) for r in self.metrics() if _has_eval(r)]

    def final_eval(self) -> dict[str, Any] | None:
        """The evaluation of an eval run, or of a training run's end (not one between steps);
        None if the run has none (yet)."""
        found = [_evaluation(r) for r in self.metrics() if _has_eval(r) and not is_step_row(r)]
        return found[-1] if found else None

    def steps(self) -> list[int]:
        """Steps (or eval rounds) with stored trajectories, ascending."""
        return self.store.steps()

    def trajectories(self, step: int | None = None) -> list[TrajectoryRecord]:
        """The records of `step`, or of every step in order when None."""
        steps = self.steps() if step is None else [step]
        return [record for s in steps for record in self.store.read_trajectories(s)]

    def index(self) -> list[IndexEntry]:
        """One entry per stored record (reward, success, termination, where it lies): for
        filtering without reading every record."""
        return self.store.index()

    def latest_checkpoint(self) -> Path | None:
        """The newest whole checkpoint directory (its model is `<checkpoint>/model`), or None."""
        return self.store.latest_checkpoint()
