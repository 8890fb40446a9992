"""`bench/objective_curves.py` reads a run's held-out curve by the policy each evaluation saw:
an evaluation in step s's row scored the policy after s + 1 updates, the final one's row is the
step after the last."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from objective_curves import curve, finished, warm_start_success  # noqa: E402


def test_a_curve_counts_the_updates_each_evaluation_saw(tmp_path: Path) -> None:
    run = tmp_path / "grpo-seed0"
    run.mkdir()
    rows = [
        {"step": 0, "loss": 0.1},
        {"step": 1, "loss": 0.2, "eval_success_rate": 0.5},
        {"step": 2, "loss": 0.3},
        {"step": 3, "eval_success_rate": 0.75},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert curve(run) == {2: 0.5, 3: 0.75}
    assert finished(run, 3) and not finished(run, 4)
    log = "INFO eval base: success 0.000, pass@2 0\nINFO eval warm start: success 0.354, pass@2 1\n"
    run.with_suffix(".log").write_text(log)
    assert warm_start_success(run) == 0.354
