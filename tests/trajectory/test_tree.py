"""The token tree: templates that rewrite history (Qwen3-style reasoning, a generation prompt that
opens reasoning) and context rewrites (compaction) fork the episode into branches; every sampled
token is trained exactly once, every branch equals its conversation rendered from scratch, and no
tool output forges a control token in any branch."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from agent_grpo.inspect.rewriting_templates import QWEN3_STYLE, THINKING_PROMPT, with_template
from agent_grpo.testing.records import sampled_ids, truncated_record
from agent_grpo.testing.strategies import hostile_text, observations, tree_settings
from agent_grpo.trajectory.invariants import (
    TrajectoryInvariantError,
    check_branch_renders,
    check_invariants,
)
from agent_grpo.trajectory.record import Message, Provenance, TrajectoryRecord
from agent_grpo.trajectory.tree import TokenBuilder

IM_START, IM_END = 1, 2
PROMPT = [Message(role="system", content="sys"), Message(role="user", content="What is 2+3?")]


@pytest.fixture(scope="module")
def qwen3(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return with_template(tokenizer, QWEN3_STYLE)


@pytest.fixture(scope="module")
def thinking(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return with_template(tokenizer, THINKING_PROMPT)


def sample(builder: TokenBuilder, tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids = [*tok.encode(text, add_special_tokens=False), builder.turn_end.id]
    builder.add_model_turn(ids, [-0.5] * len(ids))
    return ids


def test_an_append_only_template_never_forks(tokenizer: PreTrainedTokenizerBase) -> None:
    builder = TokenBuilder(tokenizer, PROMPT)
    sample(builder, tokenizer, "<think>a</think>call")
    builder.add_observations([Message(role="tool", content="5")])
    sample(builder, tokenizer, "done")
    record = truncated_record(builder)
    assert builder.branch_count == 1 and record.forks == [] and record.root_messages_count is None
    assert record.lengths.branches == 1 and record.lengths.context == 0


def test_qwen3_style_reasoning_dropped_by_a_new_user_message_forks(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    builder = TokenBuilder(qwen3, PROMPT)
    first = sample(builder, qwen3, "<think>\nadd them\n</think>\n\ncall add")  # rendered as is
    builder.add_observations([Message(role="tool", content="5")])
    assert builder.branch_count == 1  # the reasoning is kept after the last user message
    second = sample(builder, qwen3, "<think>\ngot 5\n</think>\n\nThe answer is 5.")
    builder.add_observations([Message(role="user", content="And 5+5?")])
    # a new user message: both older turns lose their reasoning, so the context is rewritten
    assert builder.branch_count == 2
    fork = builder.forks()[0]
    assert fork.parent == 0 and fork.reason == "template rewrote turn 0"
    text = qwen3.decode(fork.token_ids)
    assert "add them" not in text and "got 5" not in text and "call add" in text
    third = sample(builder, qwen3, "10")
    record = truncated_record(builder)
    check_invariants(record, qwen3)
    check_branch_renders(record, qwen3)
    # every sampled id is trained once: turns 0 and 1 in branch 0, turn 2 in branch 1
    assert sampled_ids(record) == first + second + third
    assert [t.branch for t in record.turns] == [0, 0, 1]
    assert Provenance.CONTEXT in record.forks[0].provenance


def test_qwen3_style_normalised_reasoning_forks_at_the_turn(
    qwen3: PreTrainedTokenizerBase,
) -> None:
    builder = TokenBuilder(qwen3, PROMPT)
    held = builder.token_ids
    ids = sample(builder, qwen3, "<think>add</think>call")  # rendered `<think>\nadd\n...`
    builder.add_observations([Message(role="tool", content="5")])
    fork = builder.forks()[0]
    # the fork shares the prompt and the ids of `<think>`, then the rendering adds a newline
    assert len(held) < fork.fork_at < len(held) + len(ids)
    assert fork.reason == "template rewrote turn 0"
    assert qwen3.decode(fork.token_ids[len(held) :]).startswith("<think>\nadd\n</think>\n\ncall")


def test_a_generation_prompt_that_opens_reasoning_forks_every_turn(
    thinking: PreTrainedTokenizerBase,
) -> None:
    builder = TokenBuilder(thinking, PROMPT)
    for k in range(3):
        sample(builder, thinking, f"step {k}")
        builder.add_observations([Message(role="tool", content=f"obs {k}")])
    held = builder.context_length
    record = truncated_record(builder)
    # the context after the last observation is never sampled in: no row for it
    assert record.lengths.branches == 3 and held > len(record.forks[-1].token_ids)
    assert [f.parent for f in record.forks] == [0, 1]
    assert all(f.reason.startswith("template text changed") for f in record.forks)
    check_invariants(record, thinking)
    check_branch_renders(record, thinking)


def test_an_episode_that_ends_right_after_a_fork_keeps_one_row(
    thinking: PreTrainedTokenizerBase,
) -> None:
    builder = TokenBuilder(thinking, PROMPT)
    ids = sample(builder, thinking, "call")
    builder.add_observations([Message(role="tool", content="a long output")])  # forks
    record = truncated_record(builder)  # ended here (max_context, say): nothing sampled in the fork
    assert record.forks == [] and record.lengths.branches == 1
    assert record.root_messages_count == 3 and record.token_ids[-len(ids) :] == ids
    check_invariants(record, thinking)
    check_branch_renders(record, thinking)


def test_compaction_replaces_old_observations_in_a_new_branch(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    builder = TokenBuilder(tokenizer, PROMPT)
    first = sample(builder, tokenizer, "call one")
    builder.add_observations([Message(role="tool", content="a very long output " * 20)])
    second = sample(builder, tokenizer, "call two")
    builder.add_observations([Message(role="tool", content="short")])
    before = builder.context_length
    summary = Message(role="user", content="[summary] the first call printed a long text")
    builder.replace_messages({3: summary}, reason="compact")
    assert builder.branch_count == 2 and builder.context_length < before
    assert builder.forks()[0].reason == "context: compact"
    third = sample(builder, tokenizer, "done")
    record = truncated_record(builder)
    # the record keeps what happened; the branch renders the compacted conversation
    assert [m.content for m in record.messages][3].startswith("a very long output")
    assert record.forks[0].messages[3] == summary
    assert record.root_messages_count == 5  # branch 0 ends with the turn it trains last
    check_invariants(record, tokenizer)
    check_branch_renders(record, tokenizer)
    assert sampled_ids(record) == first + second + third


def test_replace_messages_refuses_what_would_lose_sampled_ids(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    builder = TokenBuilder(tokenizer, PROMPT)
    sample(builder, tokenizer, "call")
    with pytest.raises(ValueError, match="before a model turn"):
        builder.replace_messages({3: None}, reason="x")
    builder.add_observations([Message(role="tool", content="5")])
    with pytest.raises(ValueError, match="never rewritten"):
        builder.replace_messages({3: Message(role="assistant", content="fake")}, reason="x")
    with pytest.raises(ValueError, match="never rewritten"):
        builder.replace_messages({2: None}, reason="x")
    with pytest.raises(ValueError, match="not within"):
        builder.replace_messages({0: None}, reason="x")
    builder.replace_messages({3: Message(role="tool", content="5")}, reason="same")
    assert builder.branch_count == 1  # nothing changed: no fork


def test_a_tampered_branch_fails_the_render_check(qwen3: PreTrainedTokenizerBase) -> None:
    builder = TokenBuilder(qwen3, PROMPT)
    sample(builder, qwen3, "<think>x</think>call")
    builder.add_observations([Message(role="tool", content="5")])
    sample(builder, qwen3, "done")
    record = truncated_record(builder)
    fork = record.forks[0]
    at = fork.provenance.index(Provenance.OBSERVATION)
    fork.token_ids[at] = 42  # a forged observation id: the invariants do not see it
    check_invariants(record, qwen3)
    with pytest.raises(TrajectoryInvariantError, match=r"branch 1 .*from-scratch rendering"):
        check_branch_renders(record, qwen3)
    record.forks[0].token_ids[0] = 7  # before fork_at: differs from its parent
    with pytest.raises(TrajectoryInvariantError, match="branch 1 at token 0: differs from parent"):
        check_invariants(record, qwen3)


# ---- random conversations under both templates and compaction, hostile tool content ---------

HOSTILE = [
    "<|im_start|>",
    "<|im_end|>",
    "<|im_start|>assistant\n",
    "</think>",
    "<think>",
    "</tool_response>",
    "<tool_call>",
    "\n",
    "\n\n",
    "é",
    "🙂",
    "\ue000slot0\ue001",
]
hostile = hostile_text(HOSTILE, pieces=5, chars=8)


@dataclass
class Turn:
    model_text: str
    observation: Message
    compact: bool


turns = st.lists(
    st.builds(
        Turn,
        model_text=hostile,
        observation=observations(hostile),
        compact=st.booleans(),
    ),
    min_size=1,
    max_size=6,
)


@tree_settings(40)
@given(turns=turns, template=st.sampled_from(["chatml", "qwen3", "thinking"]))
def test_random_episodes_train_each_token_once_and_forge_nothing(
    tokenizer: PreTrainedTokenizerBase, turns: list[Turn], template: str
) -> None:
    tok = {
        "chatml": tokenizer,
        "qwen3": with_template(tokenizer, QWEN3_STYLE),
        "thinking": with_template(tokenizer, THINKING_PROMPT),
    }[template]
    builder, sampled, contexts = TokenBuilder(tok, PROMPT), [], []
    for turn in turns:
        contexts.append(builder.token_ids)
        sampled += sample(builder, tok, turn.model_text)
        builder.add_observations([turn.observation])
        context = builder.context_messages
        if turn.compact and len(context) > 4:  # summarise the oldest observation
            summary = Message(role="user", content="[summary] " + context[3].content[:5])
            builder.replace_messages({3: summary}, reason="compact")
    builder.add_model_turn([IM_END], [-0.1])
    contexts.append(builder.token_ids[:-1])
    sampled.append(IM_END)
    record = truncated_record(builder)
    check_invariants(record, tok, contexts=contexts)
    check_branch_renders(record, tok)
    assert sampled_ids(record) == sampled  # each sampled id trained once, in order
    assert record.lengths.model == len(sampled)
    for row in record.rows():  # observation, prompt and rewritten text never hold a special id
        for t, p in zip(row.token_ids, row.provenance, strict=True):
            if p in (Provenance.OBSERVATION, Provenance.CONTEXT) and t in (IM_START, IM_END):
                assert p is Provenance.CONTEXT and t in sampled, (row.branch, t, p)
    # the record survives a write and a read
    assert TrajectoryRecord.from_json_line(record.to_json_line()) == record
