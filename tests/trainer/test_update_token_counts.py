"""What the update's metrics count: `trained_tokens` is the loss mask's tokens however the
update ran (skipped zero-advantage rows included), and a logprob mismatch measured over no token
is "not measured" (None), not a perfect 0.0."""

from __future__ import annotations

import copy

import torch

from agent_grpo.config.jobs import AlgoConfig, SpeedConfig
from agent_grpo.trainer.batch import pack_records
from agent_grpo.trainer.metrics import logprob_mismatch
from agent_grpo.trainer.parallel import DistContext, wrap_policy
from agent_grpo.trainer.update import minibatch_update
from agent_grpo.trajectory.record import (
    Lengths,
    Message,
    Provenance,
    Termination,
    TrajectoryRecord,
)


def group(name: str, prompt: list[int], completions: list[list[int]], advantages: list[float]):
    out = []
    for i, (done, advantage) in enumerate(zip(completions, advantages, strict=True)):
        provenance = [Provenance.PROMPT] * len(prompt) + [Provenance.MODEL] * len(done)
        out.append(TrajectoryRecord(
            group_id=name, task_id=name, index_in_group=i, group_size=len(completions),
            env_id="e", seed=0, messages=[Message(role="user", content="q")],
            token_ids=prompt + done, provenance=provenance,
            sampler_logprobs=[-1.0 if p is Provenance.MODEL else None for p in provenance],
            reward=0.0, termination=Termination(kind="terminated", reason="t"),
            lengths=Lengths(total=len(provenance), model=len(done)), advantage=advantage,
        ))  # fmt: skip
    return out


def trained_tokens(model: torch.nn.Module, algo: AlgoConfig, records) -> float:
    policy = wrap_policy(copy.deepcopy(model), "none", DistContext())
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    metrics, _ = minibatch_update(policy, optimizer, pack_records(records, 2), None, None,
                                  algo, temperature=0.9, max_tokens=16)  # fmt: skip
    return metrics.trained_tokens


def test_trained_tokens_do_not_depend_on_skipping_zero_advantage_rows(tiny_model) -> None:
    model, _ = tiny_model
    records = group("a", [5, 6, 7], [[8, 9, 10], [11, 12]], [1.0, -1.0])  # 5 model tokens
    records += group("b", [5, 6], [[13, 14, 15, 16], [17]], [0.0, 0.0])  # dead: 5 more
    skipped = trained_tokens(
        model, AlgoConfig(speed=SpeedConfig(skip_zero_advantage=True)), records
    )
    run = trained_tokens(model, AlgoConfig(speed=SpeedConfig(skip_zero_advantage=False)), records)
    assert skipped == run == 10.0


def test_a_mismatch_over_no_token_is_not_measured() -> None:
    nothing = torch.zeros(2, 3, dtype=torch.bool)
    values = torch.full((2, 3), -1.0)
    got = logprob_mismatch(values, values - 0.5, nothing)
    assert got.logprob_mismatch_mean is None and got.logprob_mismatch_max is None
    # where both scored tokens, it is measured: |-1 - -1.5| = 0.5
    got = logprob_mismatch(values, values - 0.5, ~nothing)
    assert (got.logprob_mismatch_mean, got.logprob_mismatch_max) == (0.5, 0.5)
