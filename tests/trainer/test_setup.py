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
