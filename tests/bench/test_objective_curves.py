"""`bench/objective_curves.py` reads a run's held-out curve by the policy each evaluation saw
(`eval_after_steps`: s + 1 in step s's row, the run's steps in its final row)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from objective_curves import curve, finished, warm_start_success  # noqa: E402


def test_a_curve_counts_the_updates_each_evaluation_saw(tmp_path: Path) -> None:
    run = tmp_path / "grpo-seed0"
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    rows = [
        {"step": 0, "loss": 0.1},
        {"step": 1, "loss": 0.2, "eval_success_rate": 0.5, "eval_after_steps": 2},
        {"step": 2, "loss": 0.3},
        {"step": 3, "eval_success_rate": 0.75, "eval_after_steps": 3},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert curve(run) == {2: 0.5, 3: 0.75}
    assert finished(run, 3) and not finished(run, 4)
    state = {"step": 2, "eval_warm_start": {"summary": {"success_rate": 0.354}}}
    (run / "checkpoints" / "step_000002" / "state.json").write_text(json.dumps(state))
    assert warm_start_success(run) == 0.354
