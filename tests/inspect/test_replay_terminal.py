"""The terminal replay without colour, at a width that fits, without the prompt, and with the group
baseline the advantages used."""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from agent_grpo.algo.grpo import group_advantages
from agent_grpo.inspect.baseline import AdvantageNorm, group_baseline
from agent_grpo.inspect.replay import (
    PIPED_WIDTH,
    PLAIN_MARKS,
    add_replay_parser,
    render_group,
    render_trajectory,
)
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.testing.records import calculator_record
from agent_grpo.trajectory.record import Provenance, TrajectoryRecord

RUNS = ["prompt", "model", "template", "observation", "template", "model"]
"""Provenance runs of `make_record`'s tokens, in order."""


def _text(renderable: Any) -> str:
    console = Console(width=220, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_replay_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


def _marks(out: str) -> list[str]:
    return re.findall("\u27e6(\\w+)\u27e7", out)


def test_plain_token_view_marks_provenance_runs_and_clipped_tokens(tokenizer: Any) -> None:
    record = calculator_record(tokenizer, old_shift={0: 0.5})
    out = _text(render_trajectory(record, tokenizer, tokens=True, plain=True))
    legend = [p.value for p in PLAIN_MARKS]
    assert _marks(out) == legend + RUNS  # the legend lists each mark, then one per run
    assert "\u27e6model\u27e7\u27ea<\u27ebtool_call>" in out  # the clipped first model token
    assert "\u27e6observation\u27e74\u27e6template\u27e7" in out
    coloured = _text(render_trajectory(record, tokenizer, tokens=True))
    assert _marks(coloured) == [] and "\u27ea" not in coloured  # colour carries it instead


@pytest.fixture
def run(tmp_path: Path, embedded_model_dir: Path, tokenizer: Any) -> RunWriter:
    """Step 0: one group of two (rewards 1, 0) under RLOO (`algo.leave_one_out`)."""
    config = f"model: {{name_or_path: {embedded_model_dir}}}\nalgo: {{leave_one_out: true}}\n"
    run = RunWriter.create(tmp_path, run_id="r", config_text=config)
    group = [
        calculator_record(tokenizer, group_id="s0-t0", index=i, reward=1.0 - i, old_shift={0: 0.5})
        for i in range(2)
    ]
    run.write_trajectories(0, group)
    return run


@pytest.fixture
def piped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Output captured (not a terminal), and nothing forcing a width or colour."""
    for name in ("COLUMNS", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE"):
        monkeypatch.delenv(name, raising=False)


def test_cli_piped_output_is_plain_and_piped_width(
    run: RunWriter, capsys: pytest.CaptureFixture[str], piped: None
) -> None:
    assert _cli(["replay", str(run.path), "--sample", "0", "--tokens"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # no colour codes in a file
    assert _marks(out)[-len(RUNS) :] == RUNS and "\u27ea<\u27eb" in out
    assert max(len(line) for line in out.splitlines()) == PIPED_WIDTH  # panels span the width


def test_cli_no_prompt_leaves_the_prompt_out(
    run: RunWriter, capsys: pytest.CaptureFixture[str], piped: None
) -> None:
    assert _cli(["replay", str(run.path), "--sample", "0", "--tokens"]) == 0
    assert "What is 2+2?" in capsys.readouterr().out
    assert _cli(["replay", str(run.path), "--sample", "0", "--tokens", "--no-prompt"]) == 0
    out = capsys.readouterr().out
    assert "What is 2+2?" not in out and "<|im_start|>user" not in out
    assert "prompt: 1 message(s) hidden (--no-prompt)" in out
    prompt = sum(p is Provenance.PROMPT for p in run.find(0)[0].provenance)
    assert f"({prompt} prompt tokens hidden)\u27e6model\u27e7" in out
    assert "The answer is 4." in out  # the rest of the episode stays


def test_cli_group_caption_is_the_whole_group_under_the_run_config(
    run: RunWriter, capsys: pytest.CaptureFixture[str], piped: None
) -> None:
    assert _cli(["replay", str(run.path), "--sample", "1"]) == 0
    out = capsys.readouterr().out
    # One member shown, the baseline of both; RLOO is unscaled: no std is shown.
    assert "advantage = n/(n-1) * (r - mean) (RLOO) over 2 of 2 counted: mean 0.5000" in out
    assert "std" not in out


def _group(rewards: list[float]) -> list[TrajectoryRecord]:
    return [calculator_record(index=i, reward=r) for i, r in enumerate(rewards)]


def test_group_baseline_is_the_one_group_advantages_divided_by() -> None:
    rewards = [1.0, 0.0, 1.0, 0.0, 0.25]
    records = _group(rewards)
    records[4].excluded = "env error"  # left out of the statistics, as the trainer does
    baseline = group_baseline(records)
    assert (baseline.members, baseline.counted, baseline.dead) == (5, 4, False)
    assert baseline.mean == 0.5
    assert baseline.std == pytest.approx(math.sqrt(4 * 0.25 / 3))  # unbiased, not 0.5
    valid = torch.tensor([True] * 4 + [False])
    advantages = group_advantages(torch.tensor(rewards), ["g0"] * 5, valid=valid)
    assert baseline.std is not None
    by_hand = [(r - baseline.mean) / (baseline.std + 1e-6) for r in rewards[:4]]
    assert advantages[:4].tolist() == pytest.approx(by_hand, rel=1e-6)
    caption = _text(render_group(records, baseline))
    assert "over 4 of 5 counted: mean 0.5000 std 0.5774 (unbiased)" in caption
    assert "env error" in caption  # the excluded column


def test_group_baseline_captions_follow_the_norm() -> None:
    records = _group([1.0, 0.0, 0.0])
    none = group_baseline(records, AdvantageNorm(scale="none")).caption()
    assert none == "advantage = r - mean (Dr. GRPO) over 3 of 3 counted: mean 0.3333"
    rloo = group_baseline(records, AdvantageNorm(scale="group", leave_one_out=True)).caption()
    assert rloo == (
        "advantage = (n/(n-1) * (r - mean)) / std (RLOO) over 3 of 3 counted: mean 0.3333 "
        "std 0.5774 (unbiased)"
    )
    dead = group_baseline(_group([1.0, 1.0])).caption()
    assert dead.endswith("mean 1.0000 std 0.0000 (unbiased); dead group: every advantage 0")


@pytest.mark.parametrize(
    ("algo", "norm"),
    [
        (None, AdvantageNorm("group", False)),
        ({"scale": "none"}, AdvantageNorm("none", False)),
        ({"leave_one_out": True}, AdvantageNorm("none", True)),  # RLOO as published
        ({"leave_one_out": True, "scale": "group"}, AdvantageNorm("group", True)),
    ],
)
def test_advantage_norm_from_config(algo: dict[str, Any] | None, norm: AdvantageNorm) -> None:
    assert AdvantageNorm.from_config({"algo": algo} if algo is not None else {}) == norm
