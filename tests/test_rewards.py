"""Reward sources: rules, a reward model, an LLM judge, and how they combine."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import LlamaForSequenceClassification

from agent_grpo.rewards import (
    JudgeRewardConfig,
    RewardModelRewardConfig,
    RuleRewardConfig,
    apply_rewards,
    build_reward_fn,
    parse_judge_score,
)
from agent_grpo.testing.records import minimal_record
from agent_grpo.testing.tiny_model import tiny_model_config
from agent_grpo.trajectory.record import TrajectoryRecord


def brevity(r: TrajectoryRecord) -> float:
    """A rule used by the test through its import path."""
    return -0.01 * len(r.messages[-1].content)


def test_rule_and_weights_combine_and_every_component_is_kept() -> None:
    config = RuleRewardConfig(name="brevity", function=f"{__name__}:brevity", weight=2.0)
    records = [minimal_record(reward=1.0, answer="4"), minimal_record(answer="five hundred")]
    apply_rewards(records, [(config, build_reward_fn(config))])
    assert records[0].reward_components == {"verifier": 1.0, "brevity": -0.01}
    assert records[0].reward == pytest.approx(1.0 + 2.0 * -0.01)
    assert records[1].reward == pytest.approx(0.0 + 2.0 * -0.12)


def test_judge_scores_through_an_openai_compatible_endpoint() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        score = "9" if "assistant: 4" in body["messages"][0]["content"] else "2 out of 10"
        return httpx.Response(200, json={"choices": [{"message": {"content": score}}]})

    config = JudgeRewardConfig(name="judge", base_url="http://judge", model="m", weight=1.0)
    fn = build_reward_fn(config, transport=httpx.MockTransport(handler))
    assert fn([minimal_record(answer=a) for a in ["4", "5"]]) == pytest.approx([0.9, 0.2])
    assert seen[0]["model"] == "m" and seen[0]["temperature"] == 0.0


def test_parse_judge_score_clamps_and_defaults() -> None:
    assert parse_judge_score("Score: 7.5") == 0.75
    assert parse_judge_score("42") == 1.0
    assert parse_judge_score("no idea") == 0.0


def test_reward_model_scores_with_a_sequence_classifier(tmp_path, tokenizer) -> None:
    torch.manual_seed(0)
    config = tiny_model_config()
    config.vocab_size, config.num_labels = len(tokenizer), 1
    config.pad_token_id = tokenizer.pad_token_id
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    fn = build_reward_fn(RewardModelRewardConfig(name="rm", model=str(tmp_path)))
    scores = fn([minimal_record(answer=a) for a in ["4", "a much longer answer", "4"]])
    assert scores[0] == scores[2] and scores[0] != scores[1]
