"""Keys a config no longer takes fail with what to do instead, not pydantic's bare refusal."""

from __future__ import annotations

import pytest

from agent_grpo.config.base import ConfigError, validate_config
from agent_grpo.config.jobs import TrainConfig


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [("progress", False, "did nothing in training"), ("check_invariants", True, "always checked")],
)
def test_a_retired_rollout_key_names_itself_and_the_fix(key: str, value: bool, says: str) -> None:
    with pytest.raises(ConfigError) as raised:
        validate_config(TrainConfig, {"rollout": {key: value}}, "c.yaml")
    message = str(raised.value)
    assert message.startswith(f"invalid config c.yaml: rollout.{key} was removed: ")
    assert says in message and "\n" not in message


def test_a_key_of_the_same_name_elsewhere_is_not_retired() -> None:
    # Only the dotted path is retired: `progress` under another section is an ordinary unknown key.
    with pytest.raises(ConfigError, match=r"algo\.progress: Extra inputs") as raised:
        validate_config(TrainConfig, {"algo": {"progress": False}}, "c.yaml")
    assert "was removed" not in str(raised.value)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("micro_batch_tokens", 4096),
        ("shared_prefix", True),
        ("skip_zero_advantage", True),
        ("recompute_mlp", False),
        ("optimizer_in_backward", False),
    ],
)
def test_a_speed_switch_under_algo_points_to_algo_speed(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as raised:
        validate_config(TrainConfig, {"algo": {key: value}}, "c.yaml")
    message = str(raised.value)
    assert message.startswith(f"invalid config c.yaml: algo.{key} was removed: ")
    assert "algo.speed" in message and "\n" not in message
    # The new home takes it.
    validate_config(TrainConfig, {"algo": {"speed": {key: value}}}, "c.yaml")
