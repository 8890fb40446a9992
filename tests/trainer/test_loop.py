"""The training loop: group advantages of the step's records (excluded members left out, rewards
in fp64, RLOO as published), the pi_old it records and where the loss's tensors live."""

from __future__ import annotations

import json

import pytest
import torch

from agent_grpo.algo.groups import advantages_of
from agent_grpo.config.jobs import AlgoConfig
from agent_grpo.models.loading import load_model
from agent_grpo.models.logprobs import token_logprobs
from agent_grpo.testing.cli_runs import tiny_train
from agent_grpo.testing.records import minimal_record
from agent_grpo.testing.reward_rules import reward_override

EVEN = reward_override("even", "even_tokens")


def test_an_infrastructure_failure_is_left_out_of_its_group_baseline() -> None:
    # Group a: rewards [1, 0] count, the error member (reward 0) does not: A = +-0.707 (std of
    # [1, 0] is sqrt(.5)), where counting it would give [1.15, -0.58, -0.58]. Group b keeps one
    # valid member: advantage 0 for all.
    members = [("a", 0, 1.0, "terminated"), ("a", 1, 0.0, "terminated"), ("a", 2, 0.0, "error"),
               ("b", 0, 1.0, "terminated"), ("b", 1, 0.0, "error")]  # fmt: skip
    records = [minimal_record(g, i, r, group_size=3, kind=k) for g, i, r, k in members]
    got = advantages_of(records, AlgoConfig()).tolist()
    assert got == pytest.approx([0.7071, -0.7071, 0.0, 0.0, 0.0], abs=1e-3)


def test_large_close_rewards_are_not_rounded_before_the_advantage() -> None:
    # In float32, 1000.0001 / .0002 / .0003 are 1000.00006 / 1000.00018 / 1000.0003, which the
    # std division turns into [-0.86, -0.22, 1.08] instead of [-1, 0, 1] (times
    # std / (std + eps) = 1e-4 / (1e-4 + 1e-6): the default eps of 1e-6 is 1% of this std).
    rewards = [1000.0001, 1000.0002, 1000.0003]
    records = [minimal_record("a", i, r, group_size=3) for i, r in enumerate(rewards)]
    got = advantages_of(records, AlgoConfig()).tolist()
    shrink = 1e-4 / (1e-4 + 1e-6)
    assert got == pytest.approx([-shrink, 0.0, shrink], abs=1e-4)


def test_leave_one_out_alone_is_unscaled_rloo() -> None:
    # r = [3, 0, 0]: r_i - mean(others) = [3 - 0, 0 - 1.5, 0 - 1.5]; no std division
    records = [minimal_record("a", i, r, group_size=3) for i, r in enumerate([3.0, 0.0, 0.0])]
    got = advantages_of(records, AlgoConfig(leave_one_out=True)).tolist()
    assert got == pytest.approx([3.0, -1.5, -1.5])
    scaled = advantages_of(records, AlgoConfig(leave_one_out=True, scale="group")).tolist()
    assert scaled == pytest.approx([3.0 / 3**0.5, -1.5 / 3**0.5, -1.5 / 3**0.5], rel=1e-5)


@pytest.mark.slow
def test_recorded_pi_old_is_the_policy_before_the_update(tmp_path, tiny_model_dir) -> None:
    # old_logprobs=sampler with 2 minibatches: the second minibatch runs after an optimizer
    # step, so its first-pass logprobs are not pi_old (lr 1e-2 makes the difference visible)
    run = tiny_train(tmp_path, tiny_model_dir, EVEN, "run.name=pi-old", "steps=1",
                     "algo.old_logprobs=sampler", "algo.minibatches=2", "algo.lr=1.0e-2",
                     "algo.speed.skip_zero_advantage=false")  # fmt: skip
    lines = (run / "trajectories" / "step_000000.jsonl").read_text().splitlines()
    model = load_model(tiny_model_dir)
    for r in map(json.loads, lines):
        ids = torch.tensor([r["token_ids"]])
        with torch.no_grad():
            want = token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0]
        got = [(i, v) for i, v in enumerate(r["old_logprobs"]) if v is not None]
        assert got, "every record has trainer logprobs"
        assert max(abs(v - float(want[i])) for i, v in got) < 1e-4


def test_every_tensor_reaching_the_loss_is_on_the_configured_device(
    tmp_path, tiny_model_dir, monkeypatch
) -> None:
    from agent_grpo.algo import objective

    seen: set[torch.device] = set()
    real = objective.policy_loss

    def spy(*args, **kwargs):
        tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
        seen.update(t.device for t in tensors)
        return real(*args, **kwargs)

    monkeypatch.setattr(objective, "policy_loss", spy)
    tiny_train(tmp_path, tiny_model_dir, EVEN, "run.name=device", "steps=1", "model.device=cpu",
               "algo.beta=0.04", "algo.tis_cap=2.0")  # fmt: skip
    assert seen == {torch.device("cpu")}


@pytest.mark.slow
def test_partial_rollouts_train_a_carried_episodes_turns_only_within_the_bound(
    tmp_path, tiny_model_dir
) -> None:
    from agent_grpo.inspect.verify_run import RunFacts, record_problems
    from agent_grpo.run_dir.writer import RunWriter

    # long_every 2: half the tasks take 6 turns, so groups are carried across updates; with
    # max_staleness 0 only the turns sampled by the weights being trained may train
    run = tiny_train(tmp_path, tiny_model_dir, EVEN, "run.name=partial", "steps=4",
                     "env.id=agent_grpo.testing.envs:LongTailEnv", "env.kwargs={long_every: 2}",
                     "rollout.partial={over_sample: 2}", "rollout.sampling.stop=[e]",
                     "algo.speed.skip_zero_advantage=false")  # fmt: skip
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["in_flight_groups"] for r in rows] == [2, 2, 2, 2]
    store = RunWriter.open(run)
    steps = {step: store.read_trajectories(step) for step in store.steps()}
    straddled = 0
    for step, records in steps.items():
        for record in records:
            assert record.step == step and record.policy_version <= step
            straddled += len({t.policy_version for t in record.turns}) > 1
            for turn in record.turns:
                assert record.old_logprobs is not None
                trained = record.old_logprobs[turn.token_start : turn.token_end]
                # excluded episodes train nothing; the others train exactly their fresh turns
                fresh = turn.policy_version == step and record.excluded is None
                assert all((v is not None) == fresh for v in trained), (step, turn)
    assert straddled > 0
    assert sum(r["stale_masked_tokens"] for r in rows) > 0
    # replay --verify's record checks agree, and catch a stale turn that claims to have trained
    facts = RunFacts.from_config_text((run / "config.yaml").read_text())
    lines = {step: store.scan_step(step) for step in steps}
    assert record_problems(lines, facts) == []
    line = next(
        line for step, found in lines.items() for line in found
        if line.record is not None and any(t.policy_version != step for t in line.record.turns)
    )  # fmt: skip
    assert line.record is not None
    stale = next(t for t in line.record.turns if t.policy_version != line.record.step)
    line.record.old_logprobs[stale.token_start] = -1.0  # type: ignore[index]
    assert any("but was trained" in p for p in record_problems(lines, facts))


@pytest.mark.parametrize(
    ("every", "steps", "due"),
    [(0, 4, []), (1, 4, [0, 1, 2]), (2, 5, [1, 3]), (2, 4, [1]), (5, 4, [])],
)
def test_held_out_evaluations_fall_every_n_steps_and_leave_the_last_to_the_final_one(
    every: int, steps: int, due: list[int]
) -> None:
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.trainer.loop import heldout_due

    config = TrainConfig.model_validate({"steps": steps, "eval": {"every": every}})
    assert [s for s in range(steps) if heldout_due(config, s)] == due
    assert not heldout_due(TrainConfig.model_validate({"steps": steps, "eval": None}), 0)


def test_a_held_out_evaluation_joins_its_steps_row_of_metrics(tmp_path, tiny_model_dir) -> None:
    evaluate = "eval={tasks: 2, samples: 2, max_tokens: 8, temperature: 1.0, every: 1}"
    run = tiny_train(tmp_path, tiny_model_dir, EVEN, "run.name=heldout", "steps=3", evaluate)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in rows if "eval_success_rate" in r]
    assert evaluated == [0, 1, 3]  # after steps 0 and 1, then the final evaluation's own row
    for row in rows:
        if "eval_success_rate" in row:
            assert row["eval_tasks"] == 2 and row["eval_samples_per_task"] == 2
            assert 0.0 <= row["eval_success_rate"] <= row["eval_pass_at_k"] <= 1.0
    # each evaluation says how many updates its policy had: its step's and the ones before
    assert [r["eval_after_steps"] for r in rows if "eval_success_rate" in r] == [1, 2, 3]
    assert [r["heldout_time_s"] > 0 for r in rows if "loss" in r] == [True, True, False]
    from agent_grpo.inspect.pass_at_curves import run_pass_at_curves
    from agent_grpo.run_dir.reader import load_run
    from agent_grpo.run_dir.writer import RunWriter

    found = [(c.label, c.step) for c in run_pass_at_curves(RunWriter.open(run))]
    assert found == [("base", 0), ("in training", 1), ("in training", 2), ("final", 3)]
    final = load_run(run).final_eval()
    assert final is not None and final["after_steps"] == 3 and final["step"] == 3


def test_a_run_that_fails_closes_its_rollouts_and_the_envs_they_keep(
    tmp_path, tiny_model_dir, monkeypatch
) -> None:
    """Envs kept between steps (an MCP server each, for some) stop when the run fails, not at
    interpreter exit; the run's own error is the one raised."""
    from agent_grpo.rollout.env_pool import EnvPool
    from agent_grpo.rollout.sources import LocalRollouts

    collect, closed = LocalRollouts.collect, []
    close = EnvPool.close

    def failing_collect(self: LocalRollouts, step: int, version: int):
        if step == 1:
            raise RuntimeError("the engine went away")
        return collect(self, step, version)

    def counting_close(self: EnvPool) -> None:
        closed.append(self.idle)  # step 0's envs, kept for step 1
        close(self)

    monkeypatch.setattr(LocalRollouts, "collect", failing_collect)
    monkeypatch.setattr(EnvPool, "close", counting_close)
    with pytest.raises(RuntimeError, match="the engine went away"):
        tiny_train(tmp_path, tiny_model_dir, "steps=3")
    assert closed == [4]  # the run's one pool: step 0's 2 tasks x 2


def test_held_out_evaluations_reuse_the_runs_envs(tmp_path, tiny_model_dir, monkeypatch) -> None:
    """The base, in-training and final evaluations and the steps take their envs from one pool,
    which builds only as many as the most one collection holds at once (Calculator-v0 envs are
    `reusable`), and closes them when the run ends."""
    from agent_grpo.rollout.env_pool import EnvPool

    pools: list[tuple[int, int]] = []
    close = EnvPool.close

    def counting_close(self: EnvPool) -> None:
        pools.append((self.built, self.idle))
        close(self)

    monkeypatch.setattr(EnvPool, "close", counting_close)
    evaluate = "eval={tasks: 3, samples: 2, max_tokens: 8, temperature: 1.0, every: 1}"
    tiny_train(tmp_path, tiny_model_dir, EVEN, "steps=2", evaluate)
    # three evaluations (base, after step 0, final) of 3 tasks x 2 and two steps of 2 x 2, from
    # one pool of 6 envs: before, each evaluation built and closed 6 of its own
    assert pools == [(6, 6)]
