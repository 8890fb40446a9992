"""Context policies: which observations each rewrites (pure), and episodes of Logs-v0, whose tool
outputs do not all fit, collected under each: `stop` truncates, the others fork and finish."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from agent_grpo.rollout.backends.base import Generation, SamplingConfig
from agent_grpo.rollout.collector import CollectOptions, Task, collect_groups
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.rollout.context import (
    SUMMARY_HEADER,
    CompactObservations,
    DropObservations,
    TruncateObservations,
    first_lines,
    rewrite_for,
    summary_request,
)
from agent_grpo.testing.backends import ScriptedBackend
from agent_grpo.trajectory.invariants import check_branch_renders
from agent_grpo.trajectory.record import Message

SYSTEM, USER = Message(role="system", content="s"), Message(role="user", content="q")
CONVERSATION = [
    SYSTEM,
    USER,
    Message(role="assistant", content="call 1"),
    Message(role="tool", content="one\nlong"),
    Message(role="assistant", content="call 2"),
    Message(role="tool", content="two\nlong"),
    Message(role="assistant", content="call 3"),
    Message(role="tool", content="three"),
]


def test_drop_replaces_the_oldest_observations_and_keeps_the_newest() -> None:
    policy = DropObservations(keep_last=1)
    rewrite = rewrite_for(policy, CONVERSATION, 2, count=5)
    assert sorted(rewrite) == [3, 5]  # never the prompt, a turn, or the newest observation
    assert {m.content for m in rewrite.values() if m is not None} == {policy.placeholder}
    assert list(rewrite_for(policy, CONVERSATION, 2, count=1)) == [3]


def test_truncate_cuts_only_what_is_longer() -> None:
    rewrite = rewrite_for(TruncateObservations(keep_last=0, max_chars=3), CONVERSATION, 2, 9)
    assert {i: m.content for i, m in rewrite.items() if m} == {
        3: "one [truncated]",
        5: "two [truncated]",
        7: "thr [truncated]",
    }


def test_compact_puts_one_summary_in_place_of_the_first_and_drops_the_rest() -> None:
    rewrite = rewrite_for(CompactObservations(), CONVERSATION, 2, count=2)
    assert rewrite[5] is None and rewrite[3] is not None and rewrite[3].role == "tool"
    assert rewrite[3].content == first_lines([CONVERSATION[3], CONVERSATION[5]])
    assert rewrite[3].content.endswith("- one\n- two")


def test_a_summarizer_that_does_not_load_is_a_config_error() -> None:
    with pytest.raises(ValidationError, match="summarizer 'no_such_module:f' cannot be loaded"):
        RolloutConfig.model_validate(
            {"context": {"type": "compact", "summarizer": "no_such_module:f"}}
        )


READS = [
    f'<tool_call>\n{{"name": "read_log", "arguments": {{"log": "svc-7-{k}"}}}}\n</tool_call>'
    for k in range(3)
]


@pytest.mark.parametrize("policy", ["stop", "drop", "truncate", "compact"])
def test_logs_episodes_under_each_policy(tokenizer: PreTrainedTokenizerBase, policy: str) -> None:
    backend = ScriptedBackend(tokenizer, [*READS, "Answer: 3"])
    rollout = RolloutConfig.model_validate(
        {
            "group_size": 1,
            "max_context_tokens": 1100,
            "context": {"type": policy},
            "sampling": SamplingConfig(max_tokens=40),
            "check_renders": True,
        }
    )
    result = collect_groups(
        [Task(env_id="agent_grpo/Logs-v0", seed=1)],
        backend,
        tokenizer,
        CollectOptions.from_config(rollout),
    )
    record = result.records[0]
    check_branch_renders(record, tokenizer)
    if policy == "stop":
        assert record.termination.reason == "max_context" and not record.forks
        return
    assert record.termination.reason == "final_answer" and len(record.turns) == 4
    assert record.forks and {f.reason for f in record.forks} == {f"context: {policy}"}
    assert all(len(row.token_ids) <= 1100 for row in record.rows())
    # the record keeps every observation as it came back; the branches hold the rewrites
    assert sum(m.content.startswith("errors: ") for m in record.messages) == 3


class SummarizingBackend:
    """The scripted episode, and a fixed summary for a prompt that asks for one (the policy
    writing its own summary, `summarizer: policy`); remembers the summary requests."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, script: list[str], summary: str):
        self.episode = ScriptedBackend(tokenizer, script)
        self.tokenizer, self.summary = tokenizer, summary
        self.requests: list[tuple[str, SamplingConfig]] = []

    def generate(self, prompts, sampling, seeds):  # type: ignore[no-untyped-def]
        text = self.tokenizer.decode(prompts[0])
        if CompactObservations().summary_prompt not in text:
            return self.episode.generate(prompts, sampling, seeds)
        self.requests.append((text, sampling))
        ids = self.tokenizer.encode(self.summary, add_special_tokens=False)
        return [Generation(ids, [-0.1] * len(ids), "stop", self.summary)]


def test_the_policy_writes_the_summary_of_the_outputs_it_replaces(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    backend = SummarizingBackend(tokenizer, [*READS, "Answer: 3"], "svc-7-0 had 1 error")
    rollout = RolloutConfig.model_validate(
        {
            "group_size": 1,
            "max_context_tokens": 1100,
            "context": {"type": "compact", "summarizer": "policy", "summary_max_tokens": 24},
            "sampling": SamplingConfig(max_tokens=40),
            "check_renders": True,
        }
    )
    result = collect_groups([Task(env_id="agent_grpo/Logs-v0", seed=1)], backend, tokenizer,
                            CollectOptions.from_config(rollout))  # fmt: skip
    record = result.records[0]
    check_branch_renders(record, tokenizer)
    assert record.termination.reason == "final_answer" and len(record.turns) == 4
    text, sampling = backend.requests[0]
    assert "[tool output 1]" in text and "errors: " in text  # the outputs being replaced
    assert sampling.temperature == 0 and sampling.max_tokens == 24
    summaries = [m.content for f in record.forks for m in f.messages if m.role == "tool"
                 and m.content.startswith(SUMMARY_HEADER)]  # fmt: skip
    assert summaries and summaries[0] == f"{SUMMARY_HEADER}\nsvc-7-0 had 1 error"
    # the summary's tokens are context in the new branch, never trained: model tokens are the
    # episode's own turns' tokens, and its four turns are all there is
    assert record.lengths.model == sum(t.token_end - t.token_start for t in record.turns)
    assert sum(m.content.startswith("errors: ") for m in record.messages) == 3  # kept as they came


def test_summary_request_numbers_the_outputs_under_the_prompt() -> None:
    policy = CompactObservations(summarizer="policy", summary_prompt="Be brief.")
    system, user = summary_request(policy, [CONVERSATION[3], CONVERSATION[5]])
    assert system.content == "Be brief." and system.role == "system"
    assert user.content == "[tool output 1]\none\nlong\n\n[tool output 2]\ntwo\nlong"
