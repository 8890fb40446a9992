"""Trajectory records built by hand, for tests of what reads records (store, replay, trainer)."""

from __future__ import annotations

from typing import Any

from agent_grpo.envs.registry import make_env
from agent_grpo.trajectory.record import (
    Lengths,
    Message,
    Provenance,
    Termination,
    ToolCallRecord,
    TrajectoryRecord,
    TurnRecord,
)
from agent_grpo.trajectory.tree import TokenBuilder

__all__ = [
    "builder_record",
    "calculator_record",
    "expert_record",
    "group_records",
    "minimal_record",
    "sampled_ids",
    "tool_turn_record",
    "truncated_record",
]


def minimal_record(
    group: str = "g",
    index: int = 0,
    reward: float = 0.0,
    *,
    group_size: int = 1,
    kind: str = "terminated",
    token_ids: list[int] | None = None,
    provenance: list[Provenance] | None = None,
    sampler_logprobs: list[float | None] | None = None,
    answer: str | None = None,
    **fields: Any,
) -> TrajectoryRecord:
    """A one-message record of task `group` (no tokens unless given; sampler logprob -1.0 per
    model token unless given; an `answer` adds the assistant's reply); an `error` ending has
    reason "env raised", any other "t"."""
    provenance = provenance or []
    model = sum(p is Provenance.MODEL for p in provenance)
    values: dict[str, Any] = {
        "group_id": group,
        "task_id": group,
        "index_in_group": index,
        "group_size": group_size,
        "env_id": "e",
        "seed": 0,
        "messages": [Message(role="user", content="q")]
        + ([] if answer is None else [Message(role="assistant", content=answer)]),
        "token_ids": token_ids or [],
        "provenance": provenance,
        "sampler_logprobs": sampler_logprobs
        if sampler_logprobs is not None
        else [-1.0 if p is Provenance.MODEL else None for p in provenance],
        "reward": reward,
        "termination": Termination(kind=kind, reason="env raised" if kind == "error" else "t"),  # type: ignore[arg-type]
        "lengths": Lengths(total=len(provenance), model=model),
    }
    return TrajectoryRecord(**(values | fields))


def tool_turn_record(
    call: ToolCallRecord,
    *,
    user: str,
    model: str,
    tool: str,
    tool_name: str | None,
    provenance: list[Provenance],
    **fields: Any,
) -> TrajectoryRecord:
    """A one-turn tool episode: `user` asks, the assistant's turn (the `model` tokens of
    `provenance`, text `model`) makes `call`, the tool `tool_name` answers `tool`; ids count up
    from 0 unless `fields` say otherwise, and `fields` set anything else (`minimal_record`)."""
    model_at = [i for i, p in enumerate(provenance) if p is Provenance.MODEL]
    turn = TurnRecord(index=0, model_text=model, token_start=model_at[0],
                      token_end=model_at[-1] + 1, finish_reason="stop",
                      tool_calls=[call])  # fmt: skip
    messages = [Message(role="user", content=user), Message(role="assistant", content=model),
                Message(role="tool", content=tool, name=tool_name)]  # fmt: skip
    values: dict[str, Any] = {"token_ids": list(range(len(provenance))), "task_id": "t",
                              "prompt_messages_count": 1}  # fmt: skip
    return minimal_record(
        provenance=provenance, messages=messages, turns=[turn], **(values | fields)
    )


def calculator_record(
    tokenizer: Any = None,
    *,
    step: int = 0,
    group_id: str = "g0",
    index: int = 0,
    reward: float = 1.0,
    success: bool = True,
    termination: str = "terminated",
    tool_error: bool = False,
    observation: str = "4",
    old_shift: dict[int, float] | None = None,
    advantage: float | None = 0.5,
) -> TrajectoryRecord:
    """A two-turn calculator episode; real token ids when a tokenizer is given.

    Model token j (counting model tokens only, from 0) has sampler logprob -0.1*(j+1), old
    logprob sampler + old_shift.get(j, 0) and ref logprob sampler - 0.01.
    """
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
    segments = [
        (Provenance.PROMPT, "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
        (Provenance.MODEL, call + "<|im_end|>"),
        (Provenance.TEMPLATE, "\n<|im_start|>tool\n"),
        (Provenance.OBSERVATION, observation),
        (Provenance.TEMPLATE, "<|im_end|>\n<|im_start|>assistant\n"),
        (Provenance.MODEL, "The answer is 4.<|im_end|>"),
    ]
    ids: list[int] = []
    prov: list[Provenance] = []
    spans = []
    for kind, text in segments:
        piece = tokenizer.encode(text, add_special_tokens=False) if tokenizer else [7] * len(text)
        if kind is Provenance.MODEL:
            spans.append((len(ids), len(ids) + len(piece)))
        ids += piece
        prov += [kind] * len(piece)
    sampler: list[float | None] = [None] * len(ids)
    j = 0
    for i, p in enumerate(prov):
        if p is Provenance.MODEL:
            sampler[i] = -0.1 * (j + 1)
            j += 1
    shift = old_shift or {}
    model_pos = [i for i, p in enumerate(prov) if p is Provenance.MODEL]
    old = [
        None if s is None else s + shift.get(model_pos.index(i), 0.0) for i, s in enumerate(sampler)
    ]
    ref = [None if s is None else s - 0.01 for s in sampler]
    tool_call = ToolCallRecord(
        name="add",
        arguments={"a": 2, "b": 2},
        raw=call,
        result=None if tool_error else observation,
        error="division by zero" if tool_error else None,
        error_kind="raised" if tool_error else None,
    )
    return TrajectoryRecord(
        run_id="run",
        step=step,
        group_id=group_id,
        task_id="agent_grpo/Calculator-v0:3",
        index_in_group=index,
        group_size=4,
        env_id="agent_grpo/Calculator-v0",
        seed=3,
        messages=[
            Message(role="user", content="What is 2+2?"),
            Message(role="assistant", content=call),
            Message(role="tool", content=observation, name="add"),
            Message(role="assistant", content="The answer is 4."),
        ],
        prompt_messages_count=1,
        token_ids=ids,
        provenance=prov,
        sampler_logprobs=sampler,
        old_logprobs=old,
        ref_logprobs=ref,
        reward=reward,
        reward_components={"verifier": reward},
        verifier={"expected": "4", "given": "4", "success": success},
        success=success,
        advantage=advantage,
        turns=[
            TurnRecord(
                index=0,
                model_text=call,
                token_start=spans[0][0],
                token_end=spans[0][1],
                finish_reason="stop",
                tool_calls=[tool_call],
            ),
            TurnRecord(
                index=1,
                model_text="The answer is 4.",
                token_start=spans[1][0],
                token_end=spans[1][1],
                finish_reason="stop",
            ),
        ],
        termination=Termination(kind=termination, reason="final_answer"),  # type: ignore[arg-type]
        lengths=Lengths(model=len(model_pos), total=len(ids), turns=2),
    )


def builder_record(builder: TokenBuilder, **overrides: Any) -> TrajectoryRecord:
    """A record holding exactly what the builder built."""
    fields: dict[str, Any] = {
        "group_id": "g7",
        "task_id": "calc:3",
        "index_in_group": 1,
        "group_size": 2,
        "env_id": "agent_grpo/Calculator-v0",
        "seed": 3,
        "termination": Termination(kind="terminated", reason="final_answer"),
    }
    return builder.to_record(**(fields | overrides))


def truncated_record(builder: TokenBuilder) -> TrajectoryRecord:
    """`builder_record` of an episode a limit ended (max_turns): nothing is verified."""
    return builder_record(builder, termination=Termination(kind="truncated", reason="max_turns"))


def sampled_ids(record: TrajectoryRecord) -> list[int]:
    """Every `model` id of every row of `record`, in row order: each sampled id once."""
    return [
        t
        for row in record.rows()
        for t, p in zip(row.token_ids, row.provenance, strict=True)
        if p is Provenance.MODEL
    ]


def expert_record(env_id: str, seed: int, **env_kwargs: Any) -> TrajectoryRecord:
    """A record of the env's own expert policy (no tokens: verify only needs messages)."""
    env = make_env(env_id, **env_kwargs)
    prompt, _ = env.reset(seed=seed)
    messages = [Message.model_validate(m) for m in prompt]
    reward: Any = 0.0
    terminated = False
    while not terminated:
        action = env.unwrapped.expert_action()  # type: ignore[attr-defined]
        obs, reward, terminated, _, _ = env.step(action)
        messages.append(Message(role="assistant", content=action))
        messages += [Message.model_validate(m) for m in obs] if not terminated else []
    env.close()
    return calculator_record().model_copy(
        update={
            "env_id": env_id,
            "seed": seed,
            "messages": messages,
            "prompt_messages_count": len(prompt),
            "reward": reward,
            "reward_components": {"verifier": reward, "length_penalty": -0.1},
        }
    )


def group_records(
    group: str, prompt: list[int], completions: list[list[int]], advantages: list[float]
) -> list[TrajectoryRecord]:
    """A group of minimal records sharing `prompt`, one per completion, with given advantages."""
    out = []
    for i, (done, advantage) in enumerate(zip(completions, advantages, strict=True)):
        provenance = [Provenance.PROMPT] * len(prompt) + [Provenance.MODEL] * len(done)
        record = minimal_record(
            group,
            i,
            group_size=len(completions),
            token_ids=prompt + done,
            provenance=provenance,
            lengths=Lengths(total=len(provenance)),
            advantage=advantage,
        )
        out.append(record)
    return out
