"""Reward sources beyond the environment's verifier, combined with weights.

The verifier's reward is always component `verifier`. Each extra source scores every trajectory
of a step; the record keeps every component (`reward_components`) and `reward` becomes
`verifier + sum(weight_k * component_k)`. Sources are named types chosen by `type`:
`rule` (a Python callable), `reward_model` (a transformers sequence-classification model) and
`judge` (an LLM behind an OpenAI-compatible chat endpoint).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import httpx
import torch
from pydantic import Field

from agent_grpo.config.base import ConfigModel
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = [
    "JudgeRewardConfig",
    "RewardFn",
    "RewardModelRewardConfig",
    "RewardSourceConfig",
    "RuleRewardConfig",
    "apply_rewards",
    "brevity",
    "build_reward_fn",
]

RewardFn = Callable[[Sequence[TrajectoryRecord]], list[float]]


class RuleRewardConfig(ConfigModel):
    """A Python function `fn(record: TrajectoryRecord) -> float`."""

    type: Literal["rule"] = "rule"
    """Source kind."""
    name: str
    """Component name recorded on each trajectory."""
    function: str
    """Import path `package.module:function` of the rule."""
    weight: float = 1.0
    """Multiplier in the total reward."""


class RewardModelRewardConfig(ConfigModel):
    """A transformers sequence-classification model scoring the whole conversation."""

    type: Literal["reward_model"] = "reward_model"
    """Source kind."""
    name: str
    """Component name recorded on each trajectory."""
    model: str
    """Local path or hub id of an `AutoModelForSequenceClassification` checkpoint."""
    weight: float = 1.0
    """Multiplier in the total reward."""
    max_length: int = 2048
    """Conversations are truncated from the left to this many tokens."""


class JudgeRewardConfig(ConfigModel):
    """An LLM judge behind an OpenAI-compatible `/v1/chat/completions` endpoint."""

    type: Literal["judge"] = "judge"
    """Source kind."""
    name: str
    """Component name recorded on each trajectory."""
    base_url: str
    """Server root, e.g. http://127.0.0.1:8000."""
    model: str
    """Model name the server serves."""
    weight: float = 1.0
    """Multiplier in the total reward."""
    prompt: str = (
        "Rate how well the assistant solved the user's task, from 0 (not at all) to 10 "
        "(perfectly). Reply with the number only.\n\n{conversation}"
    )
    """Judge prompt; `{conversation}` is replaced by the transcript."""
    timeout_s: float = 60.0
    """Per-request timeout."""


RewardSourceConfig = Annotated[
    RuleRewardConfig | RewardModelRewardConfig | JudgeRewardConfig, Field(discriminator="type")
]


def transcript(record: TrajectoryRecord) -> str:
    """The conversation as plain text, one `role: content` block per message."""
    return "\n\n".join(f"{m.role}: {m.content}" for m in record.messages)


def brevity(record: TrajectoryRecord) -> float:
    """An example rule: minus the number of sampled tokens, in hundreds (shorter is better)."""
    return -record.lengths.model / 100.0


def _rule_fn(config: RuleRewardConfig) -> RewardFn:
    module, _, attr = config.function.partition(":")
    rule = getattr(importlib.import_module(module), attr)
    return lambda records: [float(rule(r)) for r in records]


def _reward_model_fn(config: RewardModelRewardConfig) -> RewardFn:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model)
    tokenizer.truncation_side = "left"
    model = AutoModelForSequenceClassification.from_pretrained(config.model).eval()

    @torch.no_grad()
    def score(records: Sequence[TrajectoryRecord]) -> list[float]:
        out = []
        for record in records:
            enc = tokenizer(
                transcript(record),
                truncation=True,
                max_length=config.max_length,
                return_tensors="pt",
            )
            out.append(float(model(**enc).logits[0, 0]))  # [1, num_labels] -> first label
        return out

    return score


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_judge_score(text: str) -> float:
    """First number in the judge's reply, mapped from 0..10 to 0..1 (0 when there is none)."""
    match = _NUMBER.search(text)
    return min(max(float(match.group()) / 10.0, 0.0), 1.0) if match else 0.0


def _judge_fn(config: JudgeRewardConfig, transport: httpx.BaseTransport | None) -> RewardFn:
    def score(records: Sequence[TrajectoryRecord]) -> list[float]:
        url = config.base_url.rstrip("/") + "/v1/chat/completions"
        with httpx.Client(timeout=config.timeout_s, transport=transport) as client:
            out = []
            for record in records:
                prompt = config.prompt.format(conversation=transcript(record))
                body = {
                    "model": config.model,
                    "temperature": 0.0,
                    "messages": [{"role": "user", "content": prompt}],
                }
                reply = client.post(url, json=body).raise_for_status().json()
                out.append(parse_judge_score(reply["choices"][0]["message"]["content"]))
            return out

    return score


def build_reward_fn(
    config: RuleRewardConfig | RewardModelRewardConfig | JudgeRewardConfig,
    *,
    transport: httpx.BaseTransport | None = None,
) -> RewardFn:
    """Turn one reward-source config into a batch scoring function."""
    if isinstance(config, RuleRewardConfig):
        return _rule_fn(config)
    if isinstance(config, RewardModelRewardConfig):
        return _reward_model_fn(config)
    return _judge_fn(config, transport)


def apply_rewards(
    records: Sequence[TrajectoryRecord],
    sources: Sequence[
        tuple[RuleRewardConfig | RewardModelRewardConfig | JudgeRewardConfig, RewardFn]
    ],
) -> None:
    """Score every record with every source; record each component and the weighted total."""
    for record in records:
        record.reward_components.setdefault("verifier", record.reward)
    for config, fn in sources:
        for record, value in zip(records, fn(records), strict=True):
            record.reward_components[config.name] = value
    weights = {config.name: config.weight for config, _ in sources}
    for record in records:
        record.reward = record.reward_components["verifier"] + sum(
            weights[name] * value
            for name, value in record.reward_components.items()
            if name in weights
        )
