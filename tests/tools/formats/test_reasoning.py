"""Calls are read after a turn's closed reasoning (`after_reasoning`): a reasoning model (Qwen3,
DeepSeek-R1) that mentions or drafts a call in reasoning it then closes has made no call."""

from __future__ import annotations

import json

import pytest

from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import read_step_info
from agent_grpo.tools.formats import after_reasoning

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "after"),
    [
        ("Answer: 5", "Answer: 5"),  # no reasoning: all of it
        ("<think>\nplan\n</think>\n\nAnswer: 5", "\n\nAnswer: 5"),
        ("plan\n</think>\n\nAnswer: 5", "\n\nAnswer: 5"),  # the prompt opened the reasoning
        # a turn whose reasoning never closes keeps its calls: `</tool_call>` ends a turn that
        # calls from inside `<think>` before any `</think>`
        ("<think>\nI will call <tool_call>{...}</tool_call>",
         "<think>\nI will call <tool_call>{...}</tool_call>"),
        # the first close ends the reasoning; a later one is text of the answer (or a call's)
        ("a</think>b</think>c", "b</think>c"),
        # `<think>` that does not open the turn is text, not reasoning: a call's argument
        ('call <tool_call>{"code": "print(\'<think>\')"}</tool_call>',
         'call <tool_call>{"code": "print(\'<think>\')"}</tool_call>'),
    ],
)  # fmt: skip
def test_after_reasoning(text: str, after: str) -> None:
    assert after_reasoning(text) == after


def test_a_call_mentioned_while_reasoning_is_not_a_malformed_call() -> None:
    env = make_env("agent_grpo/Calculator-v0", malformed_policy="terminate")
    env.reset(seed=3)
    turn = "<think>\nI should call the calculator with a <tool_call> block.\n</think>\n\nAnswer: 5"
    _, reward, terminated, _, info = env.step(turn)
    step = read_step_info(info)
    # before, the unclosed `<tool_call>` in the reasoning was a malformed call: reward -1
    assert terminated and reward == 0.0 and step.end_reason == "final_answer"
    assert step.malformed_tool_calls == 0 and step.verifier is not None
    assert step.verifier["given"] == "5"


def test_a_call_from_inside_unclosed_reasoning_runs() -> None:
    # the stop string ends the turn at the call's close, before any `</think>`
    env = make_env("agent_grpo/Calculator-v0")
    env.reset(seed=3)
    observations, _, terminated, _, info = env.step(f"<think>\nadd them\n{CALL}")
    assert not terminated and len(read_step_info(info).tool_calls) == 1
    assert "5" in observations[0]["content"]


def test_a_call_drafted_while_reasoning_is_not_run_and_the_one_after_it_is() -> None:
    env = make_env("agent_grpo/Calculator-v0")
    env.reset(seed=3)
    drafted = CALL.replace("2 + 3", "1 / 0")
    observations, _, terminated, _, info = env.step(f"<think>\n{drafted}\n</think>\n\n{CALL}")
    calls = read_step_info(info).tool_calls
    assert not terminated and [json.loads(c.raw.split("\n")[1]) for c in calls] == [
        {"name": "calculator", "arguments": {"expression": "2 + 3"}}
    ]
    assert len(observations) == 1 and "5" in observations[0]["content"]
