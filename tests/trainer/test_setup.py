"""The trainer's setup: what it resolves from the config before the first step."""

from __future__ import annotations

from pathlib import Path

from agent_grpo.config.base import load_config
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.trainer.setup import resolve_max_tokens

TINY = Path(__file__).resolve().parents[2] / "configs/calculator-tiny.yaml"


def test_dr_grpo_max_tokens_is_a_constant_of_the_config() -> None:
    # calculator-tiny: sampling.max_tokens 16; Calculator-v0 defaults to max_turns 4
    config = load_config(TrainConfig, TINY, ["algo.aggregation=seq-mean-token-sum-norm"])
    assert resolve_max_tokens(config) == 16 * 4
    config = load_config(TrainConfig, TINY, ["algo.aggregation=seq-mean-token-sum-norm",
                                             "env.kwargs={max_turns: 2}"])  # fmt: skip
    assert resolve_max_tokens(config) == 32
    fixed = ["algo.aggregation=seq-mean-token-sum-norm", "algo.max_tokens=100"]
    assert resolve_max_tokens(load_config(TrainConfig, TINY, fixed)) == 100


def test_a_run_whose_name_is_taken_takes_a_timestamp_that_its_config_names(tmp_path) -> None:
    import yaml

    from agent_grpo.trainer.setup import open_run

    config = TrainConfig.model_validate({"run": {"root": str(tmp_path), "name": "exp"}})
    first = open_run(config, resume=False)
    again = TrainConfig.model_validate({"run": {"root": str(tmp_path), "name": "exp"}})
    second = open_run(again, resume=False)
    fresh = {"run": {"root": str(tmp_path), "name": "exp"}}
    third = open_run(TrainConfig.model_validate(fresh), resume=False)
    assert first.run_id == "exp" and second.run_id.startswith("exp-")
    assert third.run_id not in ("exp", second.run_id)  # the same second: another suffix
    assert third.run_id.count("-") <= second.run_id.count("-") + 1  # a suffix, not a second stamp
    # the stored config names the directory taken, so `--resume run.name=<it>` finds it, and
    # the run's records (which name their run) use it too
    stored = yaml.safe_load((second.path / "config.yaml").read_text())
    assert stored["run"]["name"] == second.run_id == again.run.name
    assert yaml.safe_load((first.path / "config.yaml").read_text())["run"]["name"] == "exp"
    resumed = TrainConfig.model_validate({**stored, "run": {**stored["run"]}})
    assert open_run(resumed, resume=True).path == second.path


def test_a_run_root_that_is_a_file_is_one_line(tmp_path) -> None:
    import pytest

    from agent_grpo.config.base import ConfigError
    from agent_grpo.trainer.setup import open_run

    (tmp_path / "file").write_text("")
    config = TrainConfig.model_validate({"run": {"root": str(tmp_path / "file")}})
    with pytest.raises(ConfigError, match="is not a directory"):
        open_run(config, resume=False)


def test_a_nested_run_name_keeps_its_folders(tmp_path) -> None:
    import yaml

    from agent_grpo.trainer.setup import open_run

    config = TrainConfig.model_validate({"run": {"root": str(tmp_path), "name": "sweep/a"}})
    run = open_run(config, resume=False)
    assert run.path == tmp_path / "sweep" / "a" and config.run.name == "sweep/a"
    again = TrainConfig.model_validate({"run": {"root": str(tmp_path), "name": "sweep/a"}})
    second = open_run(again, resume=False)
    assert second.path.parent == tmp_path / "sweep" and again.run.name.startswith("sweep/a-")
    assert yaml.safe_load((second.path / "config.yaml").read_text())["run"]["name"] == (
        again.run.name
    )
