"""End-to-end: every CLI entry point as a subprocess, on the tiny model and a tiny budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent_grpo.testing.cli_runs import RULE_REWARD, agent_grpo, deterministic, metrics

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Two GRPO steps on Calculator-v0 with the tiny model, checkpointing every step."""
    root = tmp_path_factory.mktemp("runs")
    agent_grpo(
        "train",
        str(ROOT / "configs/calculator-tiny.yaml"),
        f"model.name_or_path={tiny_model_dir}",
        f"run.root={root}",
        "run.name=full",
        RULE_REWARD,
        cwd=root,
    )
    return root


def test_train_writes_metrics_trajectories_and_checkpoints(trained: Path) -> None:
    run = trained / "full"
    rows = metrics(run)
    steps = [r for r in rows if "reward_mean" in r]
    assert [r["step"] for r in steps] == [0.0, 1.0]
    for row in steps:
        assert row["trained_tokens"] > 0 and row["grad_norm"] > 0
    assert any("eval_success_rate" in r for r in rows)
    assert (run / "config.yaml").exists()
    assert sorted(p.name for p in (run / "trajectories").iterdir())[:2] == [
        "step_000000.jsonl",
        "step_000001.jsonl",
    ]
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(checkpoints) == 2
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))


def test_resume_continues_with_identical_next_step(trained: Path, tiny_model_dir: Path) -> None:
    config = str(ROOT / "configs/calculator-tiny.yaml")
    common = [
        f"model.name_or_path={tiny_model_dir}",
        f"run.root={trained}",
        "run.name=resumed",
        RULE_REWARD,
    ]
    agent_grpo("train", config, *common, "steps=1", "eval=null", cwd=trained)
    agent_grpo("train", config, *common, "steps=2", "eval=null", "--resume", cwd=trained)
    full = [r for r in metrics(trained / "full") if "reward_mean" in r]
    resumed = [r for r in metrics(trained / "resumed") if "reward_mean" in r]
    assert [r["step"] for r in resumed] == [0.0, 1.0]
    assert deterministic(resumed[1]) == pytest.approx(deterministic(full[1]), rel=1e-5, abs=1e-7)


def test_eval_and_envs(tmp_path: Path, tiny_model_dir: Path) -> None:
    done = agent_grpo("envs", cwd=tmp_path)
    for name in ("Calculator-v0", "PythonSandbox-v0", "Search-v0", "WebApi-v0"):
        assert f"agent_grpo/{name}" in done.stdout
    done = agent_grpo(
        "eval",
        str(ROOT / "configs/eval-calculator.yaml"),
        f"model.name_or_path={tiny_model_dir}",
        f"run.root={tmp_path}",
        "eval.tasks=2",
        "eval.max_tokens=8",
        cwd=tmp_path,
    )
    assert "success_rate" in done.stdout
    [row] = metrics(tmp_path / "eval-calculator")
    assert row["eval_tasks"] == 2.0
    # again into the same name: a directory of its own, taken before it evaluates (it used to
    # evaluate, then fail to create the taken directory and lose the results)
    agent_grpo("eval", str(ROOT / "configs/eval-calculator.yaml"),
               f"model.name_or_path={tiny_model_dir}", f"run.root={tmp_path}", "eval.tasks=1",
               "eval.max_tokens=8", cwd=tmp_path)  # fmt: skip
    [again] = [p for p in tmp_path.glob("eval-calculator-*") if p.is_dir()]
    assert [r["eval_tasks"] for r in metrics(again)] == [1.0]
    assert [r["eval_tasks"] for r in metrics(tmp_path / "eval-calculator")] == [2.0]


def test_a_bad_config_key_is_a_clear_error(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent_grpo.cli",
            "train",
            str(ROOT / "configs/calculator.yaml"),
            "algo.clip_hihg=0.3",
        ],
        cwd=tmp_path,
        env=env,
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "algo.clip_hihg" in done.stderr and "calculator.yaml" in done.stderr


def test_replay_inspect_html_and_verify_on_the_trained_run(trained: Path) -> None:
    run = trained / "full"
    shown = agent_grpo("replay", str(run), "--step", "1", "--group", "0", "--sample", "1",
                       "--tokens", cwd=trained)  # fmt: skip
    assert "reward" in shown.stdout.lower() and "model" in shown.stdout
    html = trained / "replay.html"
    agent_grpo("replay", str(run), "--html", str(html), cwd=trained)
    page = html.read_text()
    assert page.startswith("<!DOCTYPE html>") or "<html" in page[:200]
    assert "http://" not in page and "https://" not in page  # self-contained
    verified = agent_grpo("replay", str(run), "--verify", cwd=trained).stdout.splitlines()
    assert next(line for line in verified if line.startswith("verify run: ")).startswith(
        "verify run: ok"
    )  # the run as a whole: manifest chain, config, metrics, checkpoints
    lines = [line for line in verified if line.startswith("verify s")]
    stored = sum(len(f.read_bytes().splitlines()) for f in (run / "trajectories").iterdir())
    assert len(lines) == stored == 8 and all(line.endswith(": ok") for line in lines)  # all steps
    counts = "diverged 0, corrupt 0, duplicated 0, unverifiable 0; incomplete groups 0"
    assert verified[-1] == f"verified 8 records: ok 8, {counts}"
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    drift = agent_grpo("replay", str(run), "--step", "1", "--group", "0", "--sample", "0",
                       "--recompute-logprobs", str(checkpoint), cwd=trained)  # fmt: skip
    assert "drift" in drift.stdout.lower()
    inspected = agent_grpo("inspect", str(run), cwd=trained)
    assert "reward" in inspected.stdout.lower()
    assert list(run.glob("*.png")), "inspect writes a PNG next to the run"


def test_a_second_run_with_the_same_name_gets_its_own_directory(
    trained: Path, tiny_model_dir: Path
) -> None:
    config = str(ROOT / "configs/calculator-tiny.yaml")
    model = f"model.name_or_path={tiny_model_dir}"
    quick = ["steps=0", "eval=null", "warm_start=null"]
    done = agent_grpo("train", config, model, f"run.root={trained}", "run.name=full", *quick,
                      cwd=trained)  # fmt: skip
    printed = Path(done.stdout.strip().splitlines()[-1])
    assert printed.parent == trained and printed.name.startswith("full-")
    assert (printed / "config.yaml").exists()
    assert len(metrics(trained / "full")) > 2  # the first run's records are untouched
