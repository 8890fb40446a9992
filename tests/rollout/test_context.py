"""Context policies: which observations each rewrites (pure), and episodes of Logs-v0, whose tool
outputs do not all fit, collected under each: `stop` truncates, the others fork and finish."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from transformers import PreTrainedTokenizerBase

from agent_grpo.inspect.rewriting_templates import QWEN3_STYLE, THINKING_PROMPT, with_template
from agent_grpo.rollout.backends.base import Generation, SamplingConfig
from agent_grpo.rollout.collector import CollectOptions, Task, collect_groups
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.rollout.context import (
    COMPACTED,
    SUMMARY_HEADER,
    CompactObservations,
    DropObservations,
    TruncateObservations,
    first_lines,
    fitting_rewrite,
    rewrite_for,
    summary_request,
)
from agent_grpo.testing.backends import ScriptedBackend
from agent_grpo.trajectory.invariants import check_branch_renders
from agent_grpo.trajectory.record import Message, TrajectoryRecord

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


def test_compact_puts_one_summary_in_place_of_the_first_and_a_pointer_to_it_in_the_rest() -> None:
    rewrite = rewrite_for(CompactObservations(), CONVERSATION, 2, count=2)
    assert rewrite[3] is not None and rewrite[3].role == "tool"
    assert rewrite[3].content == first_lines([CONVERSATION[3], CONVERSATION[5]])
    assert rewrite[3].content.endswith("- one\n- two")
    # a tool message stays after each call: templates that rewrite assistant turns need one
    assert rewrite[5] == Message(role="tool", content=COMPACTED)


def test_compacting_again_keeps_the_earlier_summary() -> None:
    once = rewrite_for(CompactObservations(keep_last=0), CONVERSATION, 2, count=2)
    conversation = [once.get(i, m) or m for i, m in enumerate(CONVERSATION)]
    twice = rewrite_for(CompactObservations(keep_last=0), conversation, 2, count=3)
    assert twice[3] is not None and twice[3].content == f"{SUMMARY_HEADER}\n- one\n- two\n- three"
    assert twice[5] == twice[7] == Message(role="tool", content=COMPACTED)


def test_the_search_goes_past_old_outputs_that_are_short_already() -> None:
    # `truncate` leaves the oldest output ("42") as it is: the rewrite of it alone changes
    # nothing, and the search must go on to the long ones after it, not give up
    outputs = ["42", "x" * 500, "y" * 500, "newest"]
    conversation = [SYSTEM, USER]
    for text in outputs:
        conversation += [
            Message(role="assistant", content="call"),
            Message(role="tool", content=text),
        ]

    def fits(rewrite: dict[int, Message | None]) -> bool:
        kept = [rewrite.get(i, m) for i, m in enumerate(conversation)]
        return sum(len(m.content) for m in kept if m is not None) < 300

    policy = TruncateObservations(keep_last=1, max_chars=20)
    rewrite = fitting_rewrite(policy, conversation, 2, fits)
    assert sorted(rewrite) == [5, 7] and fits(rewrite)
    nothing_fits = fitting_rewrite(policy, conversation, 2, lambda _: False)
    assert sorted(nothing_fits) == [5, 7]  # all it can do, for the caller to try
    assert fitting_rewrite(policy, conversation[:4], 2, fits) == {}  # nothing long to cut


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


def logs_episode(
    backend: Any,
    tokenizer: PreTrainedTokenizerBase,
    context: dict[str, Any],
    max_context: int,
    max_tokens: int,
) -> TrajectoryRecord:
    """One scripted Logs-v0 episode under a context policy, checked to render and to end on its
    answer after its four turns."""
    rollout = RolloutConfig.model_validate(
        {"group_size": 1, "max_context_tokens": max_context, "context": context,
         "sampling": SamplingConfig(max_tokens=max_tokens), "check_renders": True}
    )  # fmt: skip
    result = collect_groups([Task(env_id="agent_grpo/Logs-v0", seed=1)], backend, tokenizer,
                            CollectOptions.from_config(rollout))  # fmt: skip
    record = result.records[0]
    check_branch_renders(record, tokenizer)
    assert record.termination.reason == "final_answer" and len(record.turns) == 4
    return record


@pytest.mark.parametrize("template", [THINKING_PROMPT, QWEN3_STYLE], ids=["thinking", "qwen3"])
def test_compaction_under_templates_that_rewrite_assistant_turns(
    tokenizer: PreTrainedTokenizerBase, template: str
) -> None:
    # Qwen3-style templates drop older turns' reasoning; compacting two outputs or more once
    # left two assistant turns side by side, which such a template's rewrite cannot be located
    # between, and the collection failed with a ChatTemplateError
    tok = with_template(tokenizer, template)
    opened = "" if template == THINKING_PROMPT else "<think>\n"  # that one opens it itself
    turns = [f"{opened}read it\n</think>\n\n{call}" for call in READS]
    backend = ScriptedBackend(tok, [*turns, f"{opened}count\n</think>\n\nAnswer: 3"])
    record = logs_episode(backend, tok, {"type": "compact", "keep_last": 0}, 800, 64)
    compacted = [m for f in record.forks for m in f.messages if m.content == COMPACTED]
    assert compacted, "some compaction covered two outputs or more"


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
    policy = {"type": "compact", "summarizer": "policy", "summary_max_tokens": 24}
    record = logs_episode(backend, tokenizer, policy, 1100, 40)
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
