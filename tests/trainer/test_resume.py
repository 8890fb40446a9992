"""Resuming continues the run with the config it started with, or records the change it was told
to accept; a run that has nothing to resume says so in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent_grpo.config.base import ConfigError, dump_config
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.trainer.resume import ConfigChange, check_resume, config_changes

ROOT = Path(__file__).resolve().parents[2]


def test_config_changes_lists_each_changed_dotted_key() -> None:
    old = {"seed": 0, "algo": {"lr": 1e-5, "beta": 0.0}, "run": {"name": "a"}}
    new = {"seed": 1, "algo": {"lr": 1e-5, "beta": 0.04}, "run": {"name": "a"}, "steps": 3}
    assert config_changes(old, new) == [
        ConfigChange("algo.beta", 0.0, 0.04),
        ConfigChange("seed", 0, 1),
        ConfigChange("steps", None, 3),
    ]


def _stored_run(tmp_path: Path, config: TrainConfig) -> None:
    run = tmp_path / config.run.name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(dump_config(config))  # as the run writes it


def _config(tmp_path: Path, **changes: object) -> TrainConfig:
    return TrainConfig.model_validate({"run": {"root": str(tmp_path), "name": "r"}, **changes})


def test_the_same_config_and_more_steps_resume_without_asking(tmp_path: Path) -> None:
    _stored_run(tmp_path, _config(tmp_path))
    longer = _config(tmp_path, steps=50, run={"root": str(tmp_path), "name": "r",
                                              "checkpoint_every": 5})  # fmt: skip
    assert check_resume(longer, accept_config_change=False) == []


def test_a_run_from_before_eval_every_resumes_with_or_without_it(tmp_path: Path) -> None:
    _stored_run(tmp_path, _config(tmp_path))
    stored = tmp_path / "r" / "config.yaml"
    stored.write_text(stored.read_text().replace("  every: 0\n", ""))  # as older runs wrote it
    assert "  every:" not in stored.read_text()
    assert check_resume(_config(tmp_path), accept_config_change=False) == []
    assert check_resume(_config(tmp_path, eval={"every": 2}), accept_config_change=False) == []


def test_a_changed_lr_seed_or_group_size_is_refused_naming_each_key(tmp_path: Path) -> None:
    _stored_run(tmp_path, _config(tmp_path))
    changed = _config(tmp_path, seed=7, algo={"lr": 3e-5}, rollout={"group_size": 4})
    with pytest.raises(ConfigError) as refused:
        check_resume(changed, accept_config_change=False)
    message = str(refused.value)
    assert "\n" not in message and "--accept-config-change" in message
    for key in ("algo.lr (1e-05 -> 3e-05)", "seed (0 -> 7)", "rollout.group_size (8 -> 4)"):
        assert key in message
    accepted = check_resume(changed, accept_config_change=True)
    assert [c.key for c in accepted] == ["algo.lr", "rollout.group_size", "seed"]


def test_resuming_a_run_that_was_never_made_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot resume .*/r: it does not exist"):
        check_resume(_config(tmp_path), accept_config_change=False)


def _train(root: Path, model_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "agent_grpo.cli", "train",
               str(ROOT / "configs/calculator-tiny.yaml"), f"model.name_or_path={model_dir}",
               f"run.root={root}", "run.name=r", "steps=1", "eval=null", "warm_start=null",
               "run.tensorboard=false", *extra]  # fmt: skip
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_cli_refuses_a_changed_resume_and_records_an_accepted_one(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    assert _train(tmp_path, tiny_model_dir).returncode == 0
    # The override after --resume is taken (argparse alone would call it unrecognised).
    refused = _train(tmp_path, tiny_model_dir, "--resume", "steps=2", "algo.lr=3e-5")
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.strip().splitlines()[-1].startswith("error: cannot resume")
    assert "algo.lr (1e-05 -> 3e-05)" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "r" / "config-changes.jsonl").exists()
    config = (tmp_path / "r" / "config.yaml").read_text()
    accepted = _train(
        tmp_path, tiny_model_dir, "--resume", "--accept-config-change", "steps=2", "algo.lr=3e-5"
    )
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    [entry] = [json.loads(x) for x in (tmp_path / "r" / "config-changes.jsonl").read_text()
               .splitlines()]  # fmt: skip
    assert entry["step"] == 1
    assert entry["changes"] == [{"key": "algo.lr", "old": 1e-05, "new": 3e-05}]
    assert (tmp_path / "r" / "config.yaml").read_text() == config  # what the run started with


def _checkpoint(tmp_path: Path, step: int, state: str) -> Path:
    folder = tmp_path / "r" / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / "state.json").write_text(state)
    return folder


def test_fewer_steps_than_the_newest_checkpoint_has_done_are_refused(tmp_path: Path) -> None:
    # the loop would not run, and the final evaluation would be recorded as that of a policy
    # 2 steps in, which has trained 3
    _stored_run(tmp_path, _config(tmp_path, steps=3))
    _checkpoint(tmp_path, 3, json.dumps({"step": 3}))
    with pytest.raises(ConfigError, match=r"with steps=2: its newest checkpoint is after step 3"):
        check_resume(_config(tmp_path, steps=2), accept_config_change=False)
    assert check_resume(_config(tmp_path, steps=3), accept_config_change=False) == []


def test_a_newest_checkpoint_whose_state_does_not_read_is_one_line(tmp_path: Path) -> None:
    _stored_run(tmp_path, _config(tmp_path))
    folder = _checkpoint(tmp_path, 2, '{"step": 2, "eval_bef')  # cut short
    unreadable = rf"{folder}/state.json does not read \(JSONDecodeError: "
    with pytest.raises(ConfigError, match=unreadable):
        check_resume(_config(tmp_path), accept_config_change=False)
