"""The update: its fast paths (shared prompt pass, skipped zero-advantage rows, micro-batching)
give the same update as the plain computation; a non-finite loss never reaches the weights; and
what its metrics count."""

from __future__ import annotations

import copy

import pytest
import torch

from agent_grpo.config.jobs import AlgoConfig, SpeedConfig
from agent_grpo.testing.records import group_records, minimal_record
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


def update(model: torch.nn.Module, algo: AlgoConfig, records: list[TrajectoryRecord]):
    model = copy.deepcopy(model)
    policy = wrap_policy(model, "none", DistContext())
    optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
    metrics, seen = minibatch_update(policy, optimizer, pack_records(records, 2), None, None,
                                     algo, temperature=0.9, max_tokens=16)  # fmt: skip
    return model, metrics.model_dump(), seen


def test_fast_paths_give_the_plain_update(tiny_model) -> None:
    model, _ = tiny_model
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    records = group_records("a", ids(17), [ids(5), ids(3), ids(6)], [1.0, -0.5, -0.5])
    records += group_records("b", ids(11), [ids(4), ids(4)], [0.0, 0.0])  # a dead group
    records += group_records("c", ids(20), [ids(2), ids(7)], [0.7, -0.7])
    plain = AlgoConfig(
        speed=SpeedConfig(shared_prefix=False, skip_zero_advantage=False, micro_batch_tokens=10**6)
    )
    fast = AlgoConfig(
        speed=SpeedConfig(shared_prefix=True, skip_zero_advantage=True, micro_batch_tokens=40)
    )
    slow_model, slow_metrics, slow_seen = update(model, plain, records)
    fast_model, fast_metrics, fast_seen = update(model, fast, records)
    assert abs(slow_metrics["loss"] - fast_metrics["loss"]) < 1e-6
    assert abs(slow_metrics["grad_norm"] - fast_metrics["grad_norm"]) < 1e-4
    for a, b in zip(slow_model.parameters(), fast_model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    # the dead group was skipped by the fast path: no trainer logprobs there
    assert torch.isnan(fast_seen[3:5]).all() and not torch.isnan(slow_seen[3, 11:15]).any()
    scored = ~torch.isnan(fast_seen)
    assert torch.allclose(fast_seen[scored], slow_seen[scored], atol=1e-5)


def test_a_non_finite_loss_skips_the_optimizer_step(tiny_model) -> None:
    model, _ = tiny_model
    tokens = {"token_ids": [5, 6, 7], "provenance": [Provenance.PROMPT] + [Provenance.MODEL] * 2}
    records = [minimal_record("a", i, float(i), group_size=3, **tokens) for i in range(3)]
    batch = pack_records(records, 2, [1.0, -1.0, 0.5])
    old = torch.full(batch.input_ids.shape, -1.0)
    old[0, 1] = float("nan")  # pi_old of one model token is NaN: the loss is NaN
    policy = wrap_policy(model, "none", DistContext())
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    metrics, _ = minibatch_update(policy, optimizer, batch, old, None, AlgoConfig(), 1.0, 16)
    assert metrics.skipped_steps == 1 and metrics.optimizer_steps == 0
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not optimizer.state  # AdamW's moments were never touched either


@pytest.mark.parametrize("skip_zero_advantage", [True, False])
def test_a_minibatch_without_signal_leaves_weights_and_adamw_as_they_were(
    tiny_model, skip_zero_advantage: bool
) -> None:
    """After a real step AdamW has momentum; a zero gradient would still move every weight. A
    minibatch whose every advantage is 0 (beta 0) takes no step, whether its rows ran or not."""
    model, _ = tiny_model
    policy = wrap_policy(copy.deepcopy(model), "none", DistContext())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    algo = AlgoConfig(speed=SpeedConfig(skip_zero_advantage=skip_zero_advantage))
    live = group_records("a", [5, 6, 7], [[8, 9], [10, 11, 12]], [1.0, -1.0])
    first, _ = minibatch_update(policy, optimizer, pack_records(live, 2), None, None, algo, 1.0, 16)
    assert first.optimizer_steps == 1 and first.idle_steps == 0
    weights = copy.deepcopy(policy.state_dict())
    moments = copy.deepcopy(optimizer.state_dict())
    dead = group_records("b", [5, 6, 7], [[8, 9], [10, 11, 12]], [0.0, 0.0])
    idle, _ = minibatch_update(policy, optimizer, pack_records(dead, 2), None, None, algo, 1.0, 16)
    assert (idle.optimizer_steps, idle.idle_steps, idle.skipped_steps) == (0, 1, 0)
    for name, value in policy.state_dict().items():
        assert torch.equal(value, weights[name]), name
    for key, state in optimizer.state_dict()["state"].items():
        assert int(state["step"]) == int(moments["state"][key]["step"]) == 1


# ---- What the update's metrics count: `trained_tokens` is the loss mask's tokens however the
# update ran (skipped zero-advantage rows included), and a logprob mismatch measured over no token
# is "not measured" (None), not a perfect 0.0.


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
