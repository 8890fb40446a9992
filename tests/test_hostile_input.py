"""Hostile model and tool output never takes a rollout down.

Covers text that cannot be encoded (lone surrogates in model output, tool arguments and tool
results) reaching records and the store.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from agent_grpo.env import ToolEnv, Verdict
from agent_grpo.invariants import check_invariants
from agent_grpo.rollout.backend import Generation, SamplingConfig
from agent_grpo.rollout.collector import (
    CollectorConfig,
    Task,
    collect_groups,
)
from agent_grpo.store import RunDir
from agent_grpo.tokens import TokenBuilder, encode_plain
from agent_grpo.tool import tool
from agent_grpo.trajectory import (
    Lengths,
    Message,
    Provenance,
    Termination,
    ToolCallRecord,
    TrajectoryRecord,
    TurnRecord,
    valid_text,
)


def call(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


any_char = st.characters(codec=None, exclude_categories=())


def ids_with(ids: list[int], provenance: list[Provenance], kinds: set[Provenance]) -> list[int]:
    """The ids whose provenance is one of `kinds`, in order."""
    return [i for i, p in zip(ids, provenance, strict=True) if p in kinds]


class ScriptedBackend:
    """Answers the k-th generate call of every prompt with `script[k]`, then EOS."""

    def __init__(self, tokenizer: Any, script: list[str]) -> None:
        self.tokenizer, self.script, self.calls = tokenizer, script, 0

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        text = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return [Generation(list(ids), [-0.5] * len(ids), "stop") for _ in prompts]

    def update_weights(self, model: Any) -> None:
        """Nothing to update."""

    def close(self) -> None:
        """Nothing to release."""


# ---- text that cannot be encoded (issue 12, item 16) ---------------------------------------------


def test_valid_text_replaces_only_lone_surrogates() -> None:
    assert valid_text("a\ud800b\udfff") == "a\ufffdb\ufffd"
    assert valid_text("\ud83d\ude00") == "\U0001f600"  # a pair written as two code points
    assert valid_text("\ude00\ud83d") == "\ufffd\ufffd"  # the same halves, out of order
    text = "plain é 日本 \x00"
    assert valid_text(text) is text


def record_with_text(text: str, key: str) -> TrajectoryRecord:
    """A one-turn record with `text` in every text field and `key` as a dict key."""
    call_record = ToolCallRecord(
        name=text, arguments={key: [text, {key: text}]}, raw=text, result=text, error=text
    )
    return TrajectoryRecord(
        group_id="g",
        task_id="t:0",
        index_in_group=0,
        group_size=1,
        env_id="t",
        seed=0,
        messages=[
            Message(role="user", content=text),
            Message(role="assistant", content=text),
            Message(role="tool", content=text, name=text),
        ],
        prompt_messages_count=1,
        token_ids=[1, 2],
        provenance=[Provenance.PROMPT, Provenance.MODEL],
        sampler_logprobs=[None, -0.5],
        verifier={key: text, "nested": [{key: text}]},
        reward_components={key: 1.0},
        turns=[
            TurnRecord(
                index=0,
                model_text=text,
                token_start=1,
                token_end=2,
                finish_reason="stop",
                tool_calls=[call_record],
            )
        ],
        termination=Termination(kind="error", reason=text),
        lengths=Lengths(prompt=1, model=1, total=2, turns=1),
    )


def texts(value: Any) -> list[str]:
    """Every string in a JSON-like value, keys included."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [t for k, v in value.items() for t in (*texts(k), *texts(v))]
    if isinstance(value, list):
        return [t for v in value for t in texts(v)]
    return []


surrogate = st.characters(categories=["Cs"])
any_text = st.lists(st.one_of(any_char, surrogate), max_size=20).map("".join)


@settings(max_examples=200, deadline=None)
@given(any_text, any_text)
def test_every_text_in_a_record_serializes(text: str, key: str) -> None:
    record = record_with_text(text, key)
    line = record.to_json_line()
    line.encode("utf-8")  # strict: no surrogate survived
    back = TrajectoryRecord.from_json_line(line)
    assert back == record
    assert set(texts(back.model_dump(mode="json"))) >= {valid_text(text), valid_text(key)}
    assert back.token_ids == [1, 2]  # ids are never touched


def test_text_assigned_after_construction_is_repaired_when_written(tmp_path: Path) -> None:
    good = record_with_text("fine", "k")
    bad = record_with_text("fine", "k").model_copy(update={"index_in_group": 1})
    bad.messages[0].content = "a\ud800"  # no validation on assignment
    bad.verifier["late"] = "\udcff"
    run = RunDir.create(tmp_path, "run")
    run.write_trajectories(3, [good, bad])
    assert [e.index_in_group for e in run.index()] == [0, 1]
    [first, second] = run.read_trajectories(3)
    assert first == good
    assert second.messages[0].content == "a\ufffd" and second.verifier["late"] == "\ufffd"


def test_an_unserializable_record_is_skipped_and_the_step_stays_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    records = [
        record_with_text("fine", "k").model_copy(update={"index_in_group": i}) for i in (0, 1, 2)
    ]
    records[1].verifier["deep"] = json.loads(nested(400))  # deeper than pydantic serializes
    run = RunDir.create(tmp_path, "run")
    with caplog.at_level(logging.ERROR):
        run.write_trajectories(0, records)
    assert "g/1 cannot be serialized" in caplog.text
    assert [e.index_in_group for e in run.index()] == [0, 2]
    assert [r.index_in_group for r in run.read_trajectories(0)] == [0, 2]
    assert run.rebuild_index() == 2  # the trajectory file and the index agree


class HostileTask(BaseModel):
    n: int


@tool
def echo(text: str) -> str:
    """Return `text`."""
    return text


@tool
def raw_output() -> str:
    """Process output decoded the way `os.fsdecode` does: undecodable bytes become surrogates."""
    return b"ok \xff\xfe".decode("utf-8", "surrogateescape")


class EchoEnv(ToolEnv[HostileTask]):
    """Tools that hand back whatever they are given, surrogates included."""

    system_prompt = "Call tools."
    tools = (echo, raw_output)

    def generate_task(self, rng: np.random.Generator) -> HostileTask:
        return HostileTask(n=int(rng.integers(10)))

    def user_prompt(self, task: HostileTask) -> str:
        return f"Task {task.n}"

    def verify(self, task: HostileTask, answer: str) -> Verdict:
        return Verdict(success="done" in answer)


def test_surrogates_in_tool_arguments_and_results_reach_a_stored_record(
    tokenizer, tmp_path: Path
) -> None:
    # The model writes plain ASCII: `\ud800` is a JSON escape that decodes to a lone surrogate.
    script = [
        '<tool_call>{"name": "echo", "arguments": {"text": "a\\ud800b"}}</tool_call>'
        '<tool_call>{"name": "raw_output", "arguments": {}}</tool_call>',
        "done",
    ]
    config = CollectorConfig(group_size=2, progress=False)
    result = collect_groups(
        [Task(env_id="test/Echo-v0", seed=1)],
        ScriptedBackend(tokenizer, script),
        tokenizer,
        config,
        env_factory=lambda env_id, **kwargs: EchoEnv(),
    )
    for record in result.records:
        assert record.termination.kind == "terminated", record.termination
        [echoed, raw] = record.turns[0].tool_calls
        assert echoed.arguments == {"text": "a\ufffdb"} and echoed.result == "a\ufffdb"
        assert raw.result == "ok \ufffd\ufffd"
        observed = ids_with(record.token_ids, record.provenance, {Provenance.OBSERVATION})
        expected = [encode_plain(tokenizer, text) for text in ("a\ufffdb", "ok \ufffd\ufffd")]
        assert observed == expected[0] + expected[1]
    run = RunDir.create(tmp_path, "run")
    run.write_trajectories(0, result.records)
    assert run.read_trajectories(0) == result.records


class SurrogateDecoder:
    """The real tokenizer, except that decoding passes an undecodable byte through as a
    surrogate (as a `surrogateescape` decoder would)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def decode(self, ids: Any, **kwargs: Any) -> str:
        return self._tokenizer.decode(ids, **kwargs) + "\udcff"


def test_decoded_model_text_is_repaired_and_the_invariants_hold(tokenizer) -> None:
    decoder = SurrogateDecoder(tokenizer)
    builder = TokenBuilder(decoder, [Message(role="user", content="hi")])  # type: ignore[arg-type]
    ids = [*tokenizer.encode("hello", add_special_tokens=False), tokenizer.eos_token_id]
    span = builder.add_model_turn(ids, [-0.1] * len(ids))
    assert span.model_text == "hello\ufffd" == builder.messages[-1].content
    record = TrajectoryRecord(
        group_id="g",
        task_id="t:0",
        index_in_group=0,
        group_size=1,
        env_id="t",
        seed=0,
        messages=builder.messages,
        prompt_messages_count=1,
        token_ids=builder.token_ids,
        provenance=builder.provenance,
        sampler_logprobs=builder.sampler_logprobs,
        turns=[
            TurnRecord(
                index=0,
                model_text=span.model_text,
                token_start=span.start,
                token_end=span.end,
                finish_reason="stop",
            )
        ],
        termination=Termination(kind="terminated", reason="final_answer"),
        lengths=builder.lengths(),
    )
    check_invariants(record, decoder)  # type: ignore[arg-type]
    assert record.token_ids[span.start : span.end] == ids
    TrajectoryRecord.from_json_line(record.to_json_line())
