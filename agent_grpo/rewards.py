"""Reward sources beyond the environment's verifier, combined with weights.

The verifier's reward is always component `verifier`. Each extra source scores every trajectory
of a step; the record keeps every component (`reward_components`) and `reward` becomes
`verifier + sum(weight_k * component_k)`. Sources are named types chosen by `type`:
`rule` (a Python callable), `reward_model` (a transformers sequence-classification model) and
`judge` (an LLM behind an OpenAI-compatible chat endpoint).

The judge is a remote service, so it fails like one: its requests run `max_concurrency` at a
time, each with a timeout, and a timeout, a connection error, a 429 or a 5xx is retried with
exponential backoff. An episode the judge still cannot score is a `RewardFailure`: the episode
is excluded as an infrastructure failure (`apply_rewards` marks it; the step goes on), never a
crashed step and never a reward of 0 that the policy would be trained against. TRL's and verl's
reward functions have no such path: an exception there ends the step.
"""

from __future__ import annotations

import importlib
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Literal

import httpx
from pydantic import Field

from agent_grpo.config.base import ConfigModel
from agent_grpo.trajectory.record import TrajectoryRecord

__all__ = [
    "JudgeRewardConfig",
    "RewardFailure",
    "RewardFn",
    "RewardModelRewardConfig",
    "RewardSourceConfig",
    "RuleRewardConfig",
    "apply_rewards",
    "brevity",
    "build_reward_fn",
]


@dataclass(frozen=True)
class RewardFailure:
    """A reward source that could not score one episode (e.g. its judge kept failing)."""

    reason: str
    """What went wrong, for the record's `excluded` text."""


RewardFn = Callable[[Sequence[TrajectoryRecord]], Sequence[float | RewardFailure]]


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
    timeout_s: float = Field(default=60.0, gt=0)
    """Per-request timeout (connect, read and write each)."""
    max_concurrency: int = Field(default=8, ge=1)
    """Judge requests in flight at once."""
    max_retries: int = Field(default=3, ge=0)
    """Retries of a request that timed out, failed to connect or got a 429 or 5xx; after them
    the episode is excluded as an infrastructure failure."""
    backoff_s: float = Field(default=1.0, ge=0)
    """Wait before the first retry; each further retry waits twice as long."""


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
    import torch  # here, not at the top: a config names reward sources without loading torch
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


def _retryable(error: Exception) -> bool:
    """Whether a failed judge request may succeed when sent again."""
    if isinstance(error, httpx.HTTPStatusError):
        code = error.response.status_code
        return code == 429 or code >= 500
    return isinstance(error, httpx.TransportError)  # timeouts and connection errors


def _judge_once(client: httpx.Client, config: JudgeRewardConfig, record: TrajectoryRecord) -> float:
    """One judge request for one episode; raises on any failure."""
    body = {
        "model": config.model,
        "temperature": 0.0,
        "messages": [
            {"role": "user", "content": config.prompt.format(conversation=transcript(record))}
        ],
    }
    url = config.base_url.rstrip("/") + "/v1/chat/completions"
    reply = client.post(url, json=body).raise_for_status().json()
    return parse_judge_score(reply["choices"][0]["message"]["content"])


def _judge_with_retries(
    client: httpx.Client, config: JudgeRewardConfig, record: TrajectoryRecord
) -> float | RewardFailure:
    """The judge's score of one episode, retried with backoff; a `RewardFailure` at the end."""
    for attempt in range(config.max_retries + 1):
        try:
            return _judge_once(client, config, record)
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
            # ValueError..TypeError: a reply that is not the chat-completions JSON we asked for
            if not _retryable(error) or attempt == config.max_retries:
                tries = f"{attempt + 1} attempt(s)"
                return RewardFailure(f"judge {config.name}: {type(error).__name__}: "
                                     f"{error} ({tries})")  # fmt: skip
            time.sleep(config.backoff_s * 2**attempt)
    raise AssertionError("unreachable: the last attempt returns")


def _judge_fn(config: JudgeRewardConfig, transport: httpx.BaseTransport | None) -> RewardFn:
    def score(records: Sequence[TrajectoryRecord]) -> list[float | RewardFailure]:
        limits = httpx.Limits(max_connections=config.max_concurrency)
        with (
            httpx.Client(timeout=config.timeout_s, transport=transport, limits=limits) as client,
            ThreadPoolExecutor(max_workers=config.max_concurrency) as pool,
        ):
            return list(pool.map(lambda r: _judge_with_retries(client, config, r), records))

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
    """Score every record with every source; record each component and the weighted total.

    A record a source could not score (`RewardFailure`) lacks that component, and is excluded as
    an infrastructure failure: its total is not a reward the policy earned."""
    for record in records:
        record.reward_components.setdefault("verifier", record.reward)
    for config, fn in sources:
        for record, value in zip(records, fn(records), strict=True):
            if isinstance(value, RewardFailure):
                if record.excluded is None:
                    record.excluded = f"infrastructure failure: {value.reason}"
            else:
                record.reward_components[config.name] = value
    weights = {config.name: config.weight for config, _ in sources}
    for record in records:
        record.reward = record.reward_components["verifier"] + sum(
            weights[name] * value
            for name, value in record.reward_components.items()
            if name in weights
        )
