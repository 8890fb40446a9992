"""`inspect`: the flags of a step, per-reward-component means, eval success and integer steps in
`curves.png`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from agent_grpo.inspect.curves import (
    PLOTS,
    Curve,
    add_inspect_parser,
    curves_figure,
    panel_curves,
    reward_component_keys,
)
from agent_grpo.inspect.flags import row_flags
from agent_grpo.run_dir.writer import RunWriter

NAN = float("nan")


def test_row_flags_name_each_problem_most_serious_first() -> None:
    healthy = {"dead_group_fraction": 0.5, "error_fraction": 0.0, "malformed_call_rate": 0.0,
               "truncated_fraction": 0.0, "nonfinite_rewards": 0, "skipped_steps": 0}  # fmt: skip
    assert row_flags(healthy) == []
    broken = {"dead_group_fraction": 1.0, "error_fraction": 0.5, "malformed_call_rate": 0.25,
              "truncated_fraction": 0.75, "nonfinite_rewards": 2, "skipped_steps": 1}  # fmt: skip
    assert row_flags(broken) == [
        "all groups dead",
        "env/verifier errors 50%",
        "non-finite rewards 2",
        "malformed calls 25%",
        "truncated 75%",
        "skipped steps 1",
    ]


@pytest.mark.parametrize(
    ("row", "flags"),
    [
        ({"loss": 0.0, "grad_norm": 0.0}, ["all groups dead"]),  # a run without signal metrics
        ({"loss": 0.0, "grad_norm": 0.25}, []),
        ({"dead_group_fraction": 0.5, "loss": 0.0, "grad_norm": 0.0}, []),  # the fraction wins
        ({"eval_success_rate": 0.0, "eval_tasks": 4}, []),  # the final eval row
        ({"error_fraction": NAN, "truncated_fraction": None}, []),
    ],
)
def test_row_flags_missing_and_old_keys(row: dict[str, Any], flags: list[str]) -> None:
    assert row_flags(row) == flags


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_inspect_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def _table(out: str) -> list[list[str]]:
    """Header and body rows of the rich table in `out`, as stripped cells."""
    lines = [line.replace("┃", "│") for line in out.splitlines() if line.startswith(("┃", "│"))]
    return [[c.strip() for c in line.rstrip().split("│")[1:-1]] for line in lines]


def _step(step: int, **values: float) -> dict[str, float]:
    return {"step": step, "reward_mean": 0.25 * step, **values}


ROWS = [
    _step(0, **{"rewards/verifier/mean": 0.0, "rewards/even/mean": 0.5}, success_rate=0.0,
          dead_group_fraction=1.0, loss=0.0, grad_norm=0.0),
    _step(1, **{"rewards/verifier/mean": 0.5, "rewards/even/mean": 0.25}, success_rate=0.5,
          dead_group_fraction=0.5, error_fraction=0.5),
    _step(2, **{"rewards/verifier/mean": 1.0, "rewards/judge/mean": 0.75}, success_rate=1.0,
          dead_group_fraction=0.0, truncated_fraction=0.25),
    {"step": 3, "eval_success_rate": 0.75, "eval_tasks": 4.0},  # the final held-out eval
]  # fmt: skip


def test_inspect_table_has_component_means_and_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("COLUMNS", "80")
    run = RunWriter.create(tmp_path, run_id="r")
    for row in ROWS:
        run.write_metrics(int(row["step"]), row)
    assert _cli(["inspect", str(run.path)]) == 0
    v, e, j = "rewards/verifier/mean", "rewards/even/mean", "rewards/judge/mean"
    assert _table(capsys.readouterr().out) == [
        ["step", "reward", v, e, j, "success", "dead groups", "truncated", "eval success", "flags"],
        ["0", "0", "0", "0.5", "-", "0", "1", "-", "-", "all groups dead"],
        ["1", "0.25", "0.5", "0.25", "-", "0.5", "0.5", "-", "-", "env/verifier errors 50%"],
        ["2", "0.5", "1", "-", "0.75", "1", "0", "0.25", "-", "truncated 25%"],
        ["3", "-", "-", "-", "-", "-", "-", "-", "0.75", ""],
    ]


def test_a_healthy_run_has_no_flags_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    run = RunWriter.create(tmp_path, run_id="r")
    run.write_metrics(0, {"reward_mean": 0.5, "dead_group_fraction": 0.0, "error_fraction": 0.0})
    assert _cli(["inspect", str(run.path), "--out", str(tmp_path / "c.png")]) == 0
    assert _table(capsys.readouterr().out)[0] == ["step", "reward", "dead groups"]


def test_panels_draw_eval_success_and_each_reward_component() -> None:
    assert reward_component_keys(ROWS) == [
        "rewards/verifier/mean",
        "rewards/even/mean",
        "rewards/judge/mean",
    ]
    assert panel_curves(ROWS, "success") == [
        Curve("train", [0.0, 1.0, 2.0], [0.0, 0.5, 1.0]),
        Curve("eval (held-out)", [3.0], [0.75]),
    ]
    assert panel_curves(ROWS, "reward components") == [
        Curve("verifier", [0.0, 1.0, 2.0], [0.0, 0.5, 1.0]),
        Curve("even", [0.0, 1.0], [0.5, 0.25]),
        Curve("judge", [2.0], [0.75]),
    ]
    assert panel_curves(ROWS, "KL ref") == []


def test_curves_figure_has_integer_step_ticks_and_the_eval_line() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = curves_figure(ROWS, title="r")
    try:
        axes = {ax.get_title(): ax for ax in fig.axes}
        assert list(axes) == PLOTS
        for title in ("reward", "success", "reward components", "truncated"):
            ticks = axes[title].get_xticks()
            assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), (title, ticks)
        success = axes["success"]
        assert [t.get_text() for t in success.get_legend().get_texts()] == [
            "train",
            "eval (held-out)",
        ]
        assert success.get_lines()[1].get_xydata().tolist() == [[3.0, 0.75]]
        components = axes["reward components"].get_legend().get_texts()
        assert [t.get_text() for t in components] == ["verifier", "even", "judge"]
    finally:
        plt.close(fig)
    fig = curves_figure([_step(0, success_rate=0.5)])  # a single step: still whole ticks
    try:
        ticks = fig.axes[0].get_xticks()
        assert 0.0 in ticks and all(float(t).is_integer() for t in ticks), ticks
    finally:
        plt.close(fig)
