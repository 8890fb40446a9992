"""The run's progress display: phases with step k/N, elapsed and ETA."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from agent_grpo.trainer.progress import RunProgress, format_duration

ROOT = Path(__file__).resolve().parents[2]


def test_durations_read_like_a_clock() -> None:
    assert [format_duration(s) for s in (7, 187, 3725)] == ["7s", "3m07s", "1h02m"]


def test_without_a_terminal_each_phase_is_one_plain_line(caplog, monkeypatch) -> None:
    clock = iter([0.0, 0.0, 10.0, 20.0])
    monkeypatch.setattr("agent_grpo.trainer.progress.time.monotonic", lambda: next(clock))
    caplog.set_level(logging.INFO, logger="agent_grpo")
    logging.getLogger("agent_grpo").propagate = True
    console = Console(file=io.StringIO(), force_terminal=False)
    with RunProgress(4, console=console) as progress:
        progress.start_at(1)  # resumed after step 0: the ETA counts steps run from here
        progress.phase("step 1: rollout")  # clock 10: no step done yet, no ETA
        progress.step()
        progress.phase("step 2: rollout")  # clock 20: 1 step in 20 s, 2 left: 40 s
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["[1/4] step 1: rollout (elapsed 10s)",
                     "[2/4] step 2: rollout (elapsed 20s, ETA 40s)"]  # fmt: skip


def test_on_a_terminal_the_display_is_live_and_goes_away(caplog) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with RunProgress(2, console=console) as progress:
        progress.phase("base eval")
        progress.step()
        progress.close()
    assert "GRPO steps" in out.getvalue() and "base eval" in out.getvalue()
    assert not caplog.records  # no plain lines next to a live display


@pytest.mark.slow
def test_a_piped_training_run_logs_its_phases(tmp_path: Path, tiny_model_dir: Path) -> None:
    command = [sys.executable, "-m", "agent_grpo.cli", "train",
               str(ROOT / "configs/calculator-tiny.yaml"), f"model.name_or_path={tiny_model_dir}",
               f"run.root={tmp_path}", "warm_start.demos=2", "eval.tasks=1"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    for line in ("[0/2] base eval", "[0/2] warm start", "[0/2] step 0: rollout",
                 "[1/2] step 1: update", "[2/2] final eval"):  # fmt: skip
        assert line in done.stdout, line  # the log (rich) writes to stdout
    assert "Loading weights" not in done.stdout + done.stderr  # transformers' bars are quiet
