"""The Python API: docs/python-api.md's example runs as written (with the tiny model), the API
takes every config form, and `import agent_grpo` stays light."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import agent_grpo
from agent_grpo.api import as_config
from agent_grpo.config.base import ConfigError
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.run_dir.reader import Run, load_run
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.testing.cli_runs import fresh_python
from agent_grpo.testing.records import calculator_record

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "python-api.md"
MODEL_LINE = re.compile(r'^MODEL = "smollm2-135m-instruct"(.*)$', re.MULTILINE)


def python_cells(markdown: str) -> list[str]:
    """The ```python blocks of a markdown page, in order."""
    return re.findall(r"^```python\n(.*?)^```$", markdown, re.MULTILINE | re.DOTALL)


@pytest.mark.slow
def test_the_docs_example_runs(
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = "\n".join(python_cells(DOC.read_text()))
    code, replaced = MODEL_LINE.subn(f"MODEL = {str(tiny_model_dir)!r}", code)
    assert replaced == 1, "the example must set MODEL on one line, for this test to swap it"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    run, evaluation = namespace["run"], namespace["evaluation"]
    assert isinstance(run, Run) and isinstance(evaluation, Run)
    assert [step for step, _ in run.series("reward_mean")] == [0, 1]
    assert run.final_eval() is not None and run.final_eval()["tasks"] == 2  # type: ignore[index]
    assert evaluation.final_eval()["tasks"] == 2  # type: ignore[index]
    assert run.config()["model"]["name_or_path"] == str(tiny_model_dir)
    out = capsys.readouterr().out
    assert "step 1: mean reward" in out and "Did you mean: `Calculator`?" in out
    assert not (tmp_path / "runs" / "typo").exists()  # the mistake made no run directory


@pytest.mark.slow
def test_import_agent_grpo_is_light_and_api_names_resolve() -> None:
    script = (
        "import inspect, sys, agent_grpo\n"
        "assert 'torch' not in sys.modules, 'import agent_grpo pulled in torch'\n"
        "assert callable(agent_grpo.load_run) and 'torch' not in sys.modules\n"
        "import agent_grpo.config.jobs, agent_grpo.preflight\n"
        "assert 'torch' not in sys.modules, 'validating a config pulled in torch'\n"
        "import agent_grpo.config.jobs, agent_grpo.evaluation.heldout, agent_grpo.trainer.loop\n"
        "assert agent_grpo.train.__module__ == agent_grpo.evaluate.__module__ == 'agent_grpo.api'\n"
        "assert 'overrides' in inspect.signature(agent_grpo.train).parameters\n"
        "from agent_grpo import evaluate, train\n"
        "assert train is agent_grpo.train and evaluate is agent_grpo.evaluate\n"
    )
    fresh_python(script)


def test_train_is_the_api_function(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[TrainConfig] = []

    def fake_loop(
        config: TrainConfig,
        *,
        resume: bool = False,
        accept_config_change: bool = False,
        callbacks: object = (),
    ) -> Path:
        seen.append(config)
        return RunWriter.create(tmp_path, "fake").path

    monkeypatch.setattr("agent_grpo.trainer.loop.train", fake_loop)
    run = agent_grpo.train({"steps": 3}, overrides=["seed=7"])
    assert isinstance(run, Run) and run.path == tmp_path / "fake"
    assert (seen[0].steps, seen[0].seed) == (3, 7)


def test_as_config_takes_objects_mappings_and_paths(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\n")
    from_path = as_config(TrainConfig, path, ["seed=5"])
    from_mapping = as_config(TrainConfig, {"steps": 3, "seed": 5})
    from_object = as_config(TrainConfig, TrainConfig(steps=3), ["seed=5"])
    assert from_path == from_mapping == from_object
    same = TrainConfig()
    assert as_config(TrainConfig, same) is same
    with pytest.raises(ConfigError, match=r"^invalid config <TrainConfig>: algo\.clip_hihg"):
        as_config(TrainConfig, {"algo": {"clip_hihg": 0.3}})


def test_run_reads_series_evaluations_and_trajectories(tmp_path: Path) -> None:
    store = RunWriter.create(tmp_path, "r", config_text="steps: 2\n")
    store.write_metrics(0, {"reward_mean": 0.25, "kl_ref": None})
    store.write_trajectories(
        0, [calculator_record(step=0, reward=0.0), calculator_record(step=0, index=1)]
    )
    store.write_metrics(1, {"reward_mean": 0.75})
    store.write_trajectories(1, [calculator_record(step=1, reward=0.5)])
    store.write_metrics(2, {"eval_success_rate": 0.5, "eval_tasks": 2.0})
    run = load_run(tmp_path / "r")
    assert run.config() == {"steps": 2}
    assert run.series("reward_mean") == [(0, 0.25), (1, 0.75)]
    assert run.series("kl_ref") == []  # None values are left out
    assert run.final_eval() == {"step": 2, "success_rate": 0.5, "tasks": 2.0}
    assert [r.reward for r in run.trajectories()] == [0.0, 1.0, 0.5]
    assert [r.reward for r in run.trajectories(step=1)] == [0.5]
    assert run.steps() == [0, 1] and len(run.index()) == 3


def test_load_run_refuses_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a run directory"):
        load_run(tmp_path)
