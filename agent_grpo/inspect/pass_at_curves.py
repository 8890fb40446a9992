"""The pass@k curves of a run, for the replay page: pass@k against k, one curve per held-out
evaluation the run directory recorded.

Where each evaluation is recorded:

- a training run's base and warm-start evaluations: in every checkpoint's `state.json`
  (`TrainerState.eval_before`, `eval_warm_start`, each an `EvalResult` whose `pass_at` maps k to
  pass@k), where they are kept so that the final table survives a resume;
- a training run's final evaluation, and an eval run's one: a `metrics.jsonl` row with
  `eval_pass_at_<k>` for each k (`EvalResult.row()`).

An evaluation recorded before pass@k was (no `pass_at`, no `eval_pass_at_<k>`) has no curve.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from agent_grpo.run_dir.reader import AFTER_STEPS, is_step_row
from agent_grpo.run_dir.writer import RunWriter

__all__ = ["PassAtCurve", "row_points", "run_pass_at_curves", "state_points"]

Points = tuple[tuple[int, float], ...]

STATE_EVALUATIONS = {"eval_before": "base", "eval_warm_start": "warm start"}
"""`state.json` keys of the evaluations a training run makes before its first step, by label."""

_ROW_KEY = re.compile(r"eval_pass_at_(\d+)")  # not `eval_pass_at_k`: that is pass@samples again


@dataclass(frozen=True)
class PassAtCurve:
    """One evaluation's unbiased pass@k for k = 1 .. its samples per task."""

    label: str
    """Which evaluation: `base`, `warm start`, `in training` (between steps, `eval.every`),
    `final` (a training run's) or `eval` (an eval run's)."""
    step: int
    """GRPO steps taken before it."""
    points: Points
    """(k, pass@k), k ascending, as recorded."""


MAX_K = 2**53
"""The largest k a pass@k point may have: the largest integer a JavaScript number holds."""


def row_points(row: Mapping[str, Any]) -> Points:
    """(k, pass@k) of a `metrics.jsonl` row's `eval_pass_at_<k>` keys, k ascending."""
    found = [
        (int(m.group(1)), float(value))
        for key, value in row.items()
        if (m := _ROW_KEY.fullmatch(key)) and isinstance(value, int | float)
    ]
    # a k no page can draw (400 digits reach JavaScript as Infinity) is no point of a curve
    return tuple(sorted((k, v) for k, v in found if k <= MAX_K))


def state_points(result: Mapping[str, Any] | None) -> Points:
    """(k, pass@k) of an `EvalResult` as `state.json` holds it (`{"pass_at": {"1": ...}}`)."""
    pass_at = (result or {}).get("pass_at") or {}
    return tuple(sorted((int(k), float(v)) for k, v in pass_at.items()))


def run_pass_at_curves(run: RunWriter) -> list[PassAtCurve]:
    """Every evaluation of `run` that recorded pass@k, in the order they ran."""
    curves = []
    checkpoint = run.latest_checkpoint()  # each checkpoint carries the same two evaluations
    if checkpoint is not None:
        state = json.loads((checkpoint / "state.json").read_text())
        for key, label in STATE_EVALUATIONS.items():
            curves.append(PassAtCurve(label, 0, state_points(state.get(key))))
    # A training run's rows: its final evaluation's own, and steps that may hold one after
    # their update (`eval.every`); an eval run's config has no steps.
    config = yaml.safe_load(run.config_text)
    label = "final" if isinstance(config, dict) and "steps" in config else "eval"
    for row in run.read_metrics():
        try:
            after = int(row.get(AFTER_STEPS, row.get("step", "")))
        except (TypeError, ValueError):  # a row edited by hand ("step": "1x"): not a curve
            continue
        name = "in training" if is_step_row(row) else label
        curves.append(PassAtCurve(name, after, row_points(row)))
    return [curve for curve in curves if curve.points]
