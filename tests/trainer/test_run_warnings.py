"""A run that cannot learn must not look like one that can."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel

from agent_grpo.config.base import load_config
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.envs.text_env import ToolEnv, Verdict
from agent_grpo.rollout.collector import CollectOptions, EnvStepError, Task, collect_groups
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.testing.backends import ScriptedBackend
from agent_grpo.testing.reward_rules import reward_override
from agent_grpo.trainer.loop import train

ROOT = Path(__file__).resolve().parents[2]
DEAD = reward_override("dead", "constant")


class Riddle(BaseModel):
    """Nothing to solve."""

    answer: str


class BrokenVerifierEnv(ToolEnv[Riddle]):
    """Any answer makes the verifier raise."""

    system_prompt = "Reply Answer: done"

    def generate_task(self, rng: np.random.Generator) -> Riddle:
        return Riddle(answer="done")

    def user_prompt(self, task: Riddle) -> str:
        return "Go."

    def verify(self, task: Riddle, answer: str) -> Verdict:
        raise KeyError("expected_answer")


BROKEN = f"{__name__}:BrokenVerifierEnv"


def test_a_raising_verifier_is_an_error_not_a_wrong_answer(tokenizer) -> None:
    backend = ScriptedBackend(tokenizer, ["Answer: done"])
    config = CollectOptions.from_config(RolloutConfig(group_size=2))
    result = collect_groups([Task(env_id=BROKEN, seed=4)], backend, tokenizer, config)
    assert [r.termination.kind for r in result.records] == ["error", "error"]
    assert "KeyError" in result.records[0].termination.reason
    assert result.metrics.env_failures == 2


def test_stop_on_env_error_names_the_env_the_seed_and_the_answer(tokenizer) -> None:
    backend = ScriptedBackend(tokenizer, ["Answer: done"])
    config = CollectOptions.from_config(RolloutConfig(group_size=2, stop_on_env_error=True))
    with pytest.raises(EnvStepError, match=r"BrokenVerifierEnv seed 4 .*KeyError.*Answer: done"):
        collect_groups([Task(env_id=BROKEN, seed=4)], backend, tokenizer, config)


@pytest.mark.slow
def test_a_run_with_every_group_dead_says_so(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    overrides = [f"model.name_or_path={tiny_model_dir}", f"run.root={tmp_path}", "eval=null",
                 "warm_start=null", "run.tensorboard=false", "steps=3", DEAD]  # fmt: skip
    caplog.set_level(logging.INFO, logger="agent_grpo")
    logger = logging.getLogger("agent_grpo")
    propagate, logger.propagate = logger.propagate, False  # as under the CLI's setup_logging
    logger.addHandler(caplog.handler)
    try:
        train(load_config(TrainConfig, ROOT / "configs/calculator-tiny.yaml", overrides))
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate
    lines = [r.getMessage() for r in caplog.records]
    steps = [line for line in lines if line.startswith("step ")]
    dead = "no signal: every group is dead (all rewards equal), loss 0, no optimizer step"
    assert len(steps) == 3 and all(dead in s for s in steps)
    assert all("truncated 100%" in s for s in steps)  # 16 tokens never finish an answer
    assert sum("NO LEARNING SIGNAL for 3 steps" in line for line in lines) == 1
