"""Reward sources: rules, a reward model, an LLM judge (which fails like a remote service), and
how they combine."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from transformers import LlamaForSequenceClassification

from agent_grpo.algo.groups import counts_in_group
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.rewards import (
    JudgeRewardConfig,
    RewardFailure,
    RewardModelRewardConfig,
    RuleRewardConfig,
    apply_rewards,
    build_reward_fn,
    parse_judge_score,
)
from agent_grpo.rollout.collector import RolloutMetrics, RolloutResult
from agent_grpo.rollout.step import mark_excluded, score
from agent_grpo.testing.records import minimal_record
from agent_grpo.testing.tiny_model import tiny_model_config
from agent_grpo.trajectory.record import Message, TrajectoryRecord


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


# ---- The LLM judge fails like a remote service: requests run concurrently (bounded), time out,
# and are retried with backoff; an episode it still cannot score is excluded, the step goes on.


def record(reward: float, index: int = 0, group: str = "g") -> TrajectoryRecord:
    messages = [Message(role="user", content="2+2?"), Message(role="assistant", content="4")]
    return minimal_record(group, index, reward, group_size=4, task_id="t", messages=messages)


def judge(**overrides: object) -> JudgeRewardConfig:
    fields = {"name": "judge", "base_url": "http://judge", "model": "m", "backoff_s": 0.0}
    return JudgeRewardConfig.model_validate(fields | overrides)


def reply(text: str) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"message": {"content": text}}]})


def test_a_503_is_retried_and_the_episode_scored() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(503) if len(calls) < 3 else reply("7")

    fn = build_reward_fn(judge(max_retries=3), transport=httpx.MockTransport(handler))
    assert list(fn([record(1.0)])) == [0.7]
    assert len(calls) == 3


def test_a_timeout_is_retried() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ReadTimeout("judge too slow", request=request)
        return reply("10")

    fn = build_reward_fn(judge(), transport=httpx.MockTransport(handler))
    assert list(fn([record(1.0)])) == [1.0]


def test_a_judge_still_failing_after_its_retries_excludes_the_episode_not_the_step() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(503)

    config = judge(max_retries=2)
    fn = build_reward_fn(config, transport=httpx.MockTransport(handler))
    records = [record(1.0)]
    apply_rewards(records, [(config, fn)])
    mark_excluded(records)
    assert len(calls) == 3  # the first try and 2 retries
    assert records[0].excluded is not None
    assert records[0].excluded.startswith("infrastructure failure: judge judge: HTTPStatusError")
    assert "judge" not in records[0].reward_components  # no made-up 0 for the judge
    assert not counts_in_group(records[0])


def test_a_client_error_is_not_retried() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(400)

    fn = build_reward_fn(judge(max_retries=3), transport=httpx.MockTransport(handler))
    (out,) = fn([record(1.0)])
    assert isinstance(out, RewardFailure) and len(calls) == 1


def test_requests_run_concurrently_within_the_bound() -> None:
    lock, in_flight, peak = threading.Lock(), [0], [0]

    def handler(request: httpx.Request) -> httpx.Response:
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        time.sleep(0.05)
        with lock:
            in_flight[0] -= 1
        return reply("5")

    fn = build_reward_fn(judge(max_concurrency=3), transport=httpx.MockTransport(handler))
    assert list(fn([record(0.0, i) for i in range(8)])) == [0.5] * 8
    assert peak[0] == 3


def test_the_step_survives_an_unreachable_judge() -> None:
    # port 9 on localhost refuses the connection: a ConnectError on every try, no network used
    source = judge(base_url="http://127.0.0.1:9", max_retries=1, timeout_s=2.0)
    config = TrainConfig.model_validate({"rewards": [source.model_dump()]})
    result = score(
        config, RolloutResult(records=[record(1.0, i) for i in range(4)], metrics=RolloutMetrics())
    )
    assert all(r.excluded and "ConnectError" in r.excluded for r in result.records)
    assert all(r.reward == 1.0 for r in result.records)  # the verifier's, never a judged 0
