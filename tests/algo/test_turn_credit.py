"""Turn-level credit (GiGPO's step groups): hand-derived golden numbers, the records' turn states
and rewards from the collector, and the per-token advantages the trainer packs.

The golden group: three episodes of two turns, rewards r = (1, 0, 1), a turn reward of 0.5 on
episode 0's first turn, discount 0.5. Returns R_t = r_t + 0.5 R_(t+1), the episode's reward on
its last turn: episode 0 (1.0, 1.0), episode 1 (0, 0), episode 2 (0.5, 1). Every first turn
starts from the prompt (one step group); the second turns of episodes 0 and 1 share state `a`,
episode 2's is `b`, alone.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.algo.groups import advantages_of, turn_advantages_of
from agent_grpo.algo.grpo import group_advantages
from agent_grpo.algo.turn_credit import others_mean, returns_to_go, turn_advantages
from agent_grpo.envs.calculator import CalculatorEnv
from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import read_step_info
from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.collector import CollectOptions, Task, collect_groups
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.testing.backends import ScriptedBackend
from agent_grpo.testing.records import minimal_record
from agent_grpo.trainer.batch import pack_records

REWARDS = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
TURN_REWARDS = torch.tensor([[0.5, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
TWO = torch.tensor([2, 2, 2])
STEP_GROUPS = torch.tensor([[0, 1], [0, 1], [0, 2]])  # prompt; state a; state b
ALL = torch.ones(3, dtype=torch.bool)


def golden(leave_one_out: bool, *, valid: torch.Tensor = ALL) -> torch.Tensor:
    episode = torch.tensor([1 / 3, -2 / 3, 1 / 3]) if not leave_one_out else torch.tensor(
        [0.5, -1.0, 0.5])  # fmt: skip
    return turn_advantages(episode, REWARDS, TURN_REWARDS, TWO, STEP_GROUPS, [0, 0, 0],
                           valid=valid, weight=2.0, discount=0.5, scale="none",
                           leave_one_out=leave_one_out)  # fmt: skip


def test_returns_to_go_by_hand() -> None:
    returns = returns_to_go(TURN_REWARDS, REWARDS, TWO, discount=0.5)
    assert returns.tolist() == [[1.0, 1.0], [0.0, 0.0], [0.5, 1.0]]
    short = returns_to_go(torch.tensor([[1.0, 9.0]]), torch.tensor([2.0]), torch.tensor([1]), 0.5)
    assert short.tolist() == [[3.0, 0.0]]  # past num_turns: 0, and its turn reward ignored


def test_others_mean_is_rloos_baseline() -> None:
    valid = torch.tensor([True, True, True, False])
    got = others_mean(torch.tensor([1.0, 0.0, 1.0, float("nan")]), [0, 0, 0, 0], valid)
    assert got[:3].tolist() == [0.5, 1.0, 0.5]
    assert others_mean(torch.tensor([3.0]), [0], torch.tensor([True])).tolist() == [3.0]


def test_gigpo_mean_baseline_by_hand() -> None:
    # A^E = r - 2/3. First turns: returns (1, 0, 0.5), mean 0.5 -> A^S (0.5, -0.5, 0).
    # Second turns: state a (1, 0), mean 0.5 -> (0.5, -0.5); state b alone -> 0 (GiGPO).
    # A = A^E + 2 A^S.
    want = [[4 / 3, 4 / 3], [-5 / 3, -5 / 3], [1 / 3, 1 / 3]]
    assert torch.allclose(golden(False), torch.tensor(want, dtype=torch.float64), atol=1e-6)


def test_leave_one_out_baseline_by_hand() -> None:
    # A^E (RLOO) = (0.5, -1, 0.5). First turns: 1 - 0.25, 0 - 0.75, 0.5 - 0.5 = (0.75, -0.75, 0).
    # State a: (1 - 0, 0 - 1) = (1, -1); state b alone: its return minus the other episodes'
    # mean reward, 1 - 0.5 = 0.5 (not GiGPO's 0: a baseline from other episodes only).
    want = [[2.0, 2.5], [-2.5, -3.0], [0.5, 1.5]]
    assert torch.allclose(golden(True), torch.tensor(want, dtype=torch.float64), atol=1e-6)


def test_an_episode_that_does_not_count_gets_zero_and_leaves_the_others_alone() -> None:
    rewards = torch.cat([REWARDS, torch.tensor([float("nan")], dtype=torch.float64)])
    turn_rewards = torch.cat([TURN_REWARDS, torch.full((1, 2), float("nan"), dtype=torch.float64)])
    valid = torch.tensor([True, True, True, False])
    step_groups = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 2]])  # the 4th shares b
    got = turn_advantages(torch.tensor([0.5, -1.0, 0.5, 0.0]), rewards, turn_rewards,
                          torch.tensor([2, 2, 2, 2]), step_groups, [0, 0, 0, 0], valid=valid,
                          weight=2.0, discount=0.5, scale="none",
                          leave_one_out=True)  # fmt: skip
    assert got[3].tolist() == [0.0, 0.0]
    assert torch.allclose(got[:3], golden(True), atol=1e-6)  # its junk reached no sum


def test_weight_zero_is_the_episode_advantage_on_every_turn() -> None:
    episode = torch.tensor([0.5, -1.0, 0.5])
    got = turn_advantages(episode, REWARDS, TURN_REWARDS, TWO, STEP_GROUPS, [0, 0, 0],
                          valid=ALL, weight=0.0, discount=1.0, scale="group",
                          leave_one_out=False)  # fmt: skip
    assert torch.equal(got, episode.to(torch.float64)[:, None].expand(3, 2))


def test_leave_one_out_with_std_scaling_is_refused() -> None:
    with pytest.raises(ValidationError, match=r"turn_credit with leave_one_out .* unscaled"):
        AlgoConfig(turn_credit={}, leave_one_out=True, scale="group")  # type: ignore[arg-type]
    AlgoConfig(turn_credit={}, leave_one_out=True)  # type: ignore[arg-type]  # unscaled: fine


# --- records: the collector's states and turn rewards, the trainer's packing ---

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'


class NamedStates(CalculatorEnv):
    """Calculator-v0 naming its states and paying 0.25 for each turn that calls the tool."""

    def reset(self, **kwargs: Any) -> Any:
        messages, info = super().reset(**kwargs)
        return messages, {**info, "state": "start"}

    def step(self, action: str) -> Any:
        obs, reward, terminated, truncated, info = super().step(action)
        called = bool(read_step_info(info).tool_calls)  # this turn's calls
        return obs, reward, terminated, truncated, {**info, "state": f"called={called}",
                                                    "turn_reward": 0.25 * called}  # fmt: skip


def collect(tokenizer: Any, env_factory: Any = make_env) -> list[Any]:
    backend = ScriptedBackend(tokenizer, [CALL, "Answer: 408"])
    config = CollectOptions.from_config(
        RolloutConfig(group_size=2, sampling=SamplingConfig(max_tokens=64))
    )
    tasks = [Task(env_id="agent_grpo/Calculator-v0", seed=s) for s in (3, 7)]
    return collect_groups(tasks, backend, tokenizer, config, env_factory=env_factory).records


def test_identical_histories_share_a_state_and_other_histories_do_not(tokenizer: Any) -> None:
    records = collect(tokenizer)
    states = [[t.state for t in r.turns] for r in records]
    assert states[0] == states[1] and states[2] == states[3]  # a group's identical episodes
    assert states[0][0] != states[0][1] and states[0] != states[2]  # other turns, other tasks
    assert all(t.reward == 0.0 for r in records for t in r.turns)


def test_an_envs_named_states_and_turn_rewards_are_recorded(tokenizer: Any) -> None:
    records = collect(tokenizer, lambda env_id, **kw: NamedStates(**kw))
    for record in records:
        assert [t.state for t in record.turns] == ["start", "called=True"]
        assert [t.reward for t in record.turns] == [0.25, 0.0]  # the last: the episode's own


def test_the_trainer_packs_each_turns_advantage_on_its_own_tokens(tokenizer: Any) -> None:
    records = collect(tokenizer, lambda env_id, **kw: NamedStates(**kw))
    records[0].reward, records[1].reward = 1.0, 0.0  # group 0: rewards (1, 0)
    algo = AlgoConfig(turn_credit={"weight": 1.0})  # type: ignore[arg-type]
    episode = advantages_of(records, algo)
    per_turn = turn_advantages_of(records, algo, episode)
    # group 0: both first turns from "start" with returns 1.25 and 0.25; both second turns from
    # "called=True" with returns 1 and 0: A^S = +-0.707 each (std 0.707); A^E = +-0.707
    assert torch.allclose(torch.tensor(per_turn[:2]), torch.tensor([[1.414, 1.414],
                          [-1.414, -1.414]]), atol=1e-3)  # fmt: skip
    for record, advantages in zip(records, per_turn, strict=True):
        for turn, a in zip(record.turns, advantages, strict=True):
            turn.advantage = a
    records[0].turns[1].advantage = 7.0  # one turn's own, to see where it lands
    batch = pack_records(records, tokenizer.pad_token_id)
    first = records[0].turns
    assert (batch.advantages[0, first[1].token_start : first[1].token_end] == 7.0).all()
    assert torch.allclose(batch.advantages[0, first[0].token_start : first[0].token_end],
                          torch.tensor(per_turn[0][0]))  # fmt: skip


def test_records_without_turn_advantages_pack_the_episodes() -> None:
    record = minimal_record("g", advantage=0.5)
    batch = pack_records([record], pad_id=2)
    assert (batch.advantages == 0.5).all()


def test_a_run_with_turn_credit_stores_the_advantages_it_trained_with(
    tmp_path: Any, tiny_model_dir: Any
) -> None:
    from agent_grpo.inspect.verify_run import RunFacts, record_problems
    from agent_grpo.run_dir.reader import load_run
    from agent_grpo.run_dir.writer import RunWriter
    from agent_grpo.testing.cli_runs import tiny_train
    from agent_grpo.testing.reward_rules import reward_override

    run = tiny_train(tmp_path, tiny_model_dir, "run.name=tc", "steps=1",
                     reward_override("even", "even_tokens"),
                     "algo.turn_credit={weight: 0.5}")  # fmt: skip
    records = load_run(run).trajectories()
    algo = AlgoConfig(turn_credit={"weight": 0.5})  # type: ignore[arg-type]
    want = turn_advantages_of(records, algo, advantages_of(records, algo))
    assert [[t.advantage for t in r.turns] for r in records] == want
    assert any(a != r.advantage for r, per in zip(records, want, strict=True) for a in per)
    # replay --verify recomputes them: the stored ones pass, an edited one is named
    facts = RunFacts.from_config_text((run / "config.yaml").read_text())
    lines = RunWriter.open(run).scan_step(0)
    assert record_problems({0: lines}, facts) == []
    edited = lines[0].record
    assert edited is not None and edited.turns[0].advantage is not None
    edited.turns[0].advantage += 0.5
    [problem] = record_problems({0: lines}, facts)
    assert "turn 0's advantage" in problem and "but turn credit gives" in problem


def gigpo_reference(
    rewards: list[float],
    turn_rewards: list[list[float]],
    states: list[list[str]],
    omega: float,
    gamma: float,
    std_norm: bool,
) -> list[list[float]]:
    """GiGPO as its paper states it (Feng et al. 2025, section 3), in plain Python: the episode
    advantage (R - mean) / F over the group, each turn's discounted return R_t = sum_k gamma^(k-t)
    r_k (the episode's reward on its last turn), the step advantage (R_t - mean) / F over the turns
    whose anchor state is the same, F the group's std (`mean_std_norm`) or 1 (`mean_norm`), and
    A = A^E + omega * A^S. A state seen once compares with itself only: A^S = 0."""

    def normalise(values: list[float]) -> list[float]:
        mean = statistics.fmean(values)
        spread = statistics.stdev(values) if std_norm and len(values) > 1 else 0.0
        return [(v - mean) / (spread + 1e-6) if std_norm else v - mean for v in values]

    episode = normalise(rewards)
    returns: dict[tuple[int, int], float] = {}
    for i, turns in enumerate(turn_rewards):
        later = 0.0
        for t in reversed(range(len(turns))):
            later = turns[t] + (rewards[i] if t == len(turns) - 1 else 0.0) + gamma * later
            returns[(i, t)] = later
    by_state: dict[str, list[tuple[int, int]]] = {}
    for i, row in enumerate(states):
        for t, state in enumerate(row):
            by_state.setdefault(state, []).append((i, t))
    step: dict[tuple[int, int], float] = {}
    for members in by_state.values():
        for member, adv in zip(members, normalise([returns[m] for m in members]), strict=True):
            step[member] = adv
    return [
        [episode[i] + omega * step[(i, t)] for t in range(len(row))] for i, row in enumerate(states)
    ]


@pytest.mark.parametrize("std_norm", [True, False])
def test_equals_gigpos_formula_from_its_paper(std_norm: bool) -> None:
    # Six episodes of 1-4 turns; states drawn from a few so step groups of 1 to several form.
    rng = random.Random(3)
    lengths = [rng.randint(1, 4) for _ in range(6)]
    rewards = [float(rng.random() < 0.5) for _ in lengths]
    turn_rewards = [[rng.choice([0.0, 0.0, 0.3, -0.2]) for _ in range(n)] for n in lengths]
    states = [["prompt"] + [f"s{t}{rng.randint(0, 2)}" for t in range(1, n)] for n in lengths]
    theirs = gigpo_reference(rewards, turn_rewards, states, 0.7, 0.9, std_norm)
    scale = "group" if std_norm else "none"
    reward_tensor = torch.tensor(rewards, dtype=torch.float64)
    valid = torch.ones(6, dtype=torch.bool)
    episode = group_advantages(reward_tensor, [0] * 6, valid=valid, scale=scale)
    width = max(lengths)
    ids = {state: k for k, state in enumerate(sorted({s for row in states for s in row}))}
    ours = turn_advantages(
        episode,
        reward_tensor,
        torch.tensor([row + [0.0] * (width - len(row)) for row in turn_rewards]),
        torch.tensor(lengths),
        torch.tensor([[ids[s] for s in row] + [-1] * (width - len(row)) for row in states]),
        [0] * 6,
        valid=valid,
        weight=0.7,
        discount=0.9,
        scale=scale,
        leave_one_out=False,
    )
    for i, row in enumerate(theirs):
        torch.testing.assert_close(ours[i, : len(row)], torch.tensor(row, dtype=torch.float64))
        assert bool((ours[i, len(row) :] == 0).all())
    sizes = {state: sum(row.count(state) for row in states) for state in ids}
    later = [size for state, size in sizes.items() if state != "prompt"]
    assert 1 in later and max(later) > 1  # singleton states and shared later ones both compared
