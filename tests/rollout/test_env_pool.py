"""The envs a rollout keeps between episodes (`agent_grpo/rollout/env_pool.py`)."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import pytest
from pydantic import BaseModel

from agent_grpo.envs.answers import text_verdict
from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import TextEnv, Verdict
from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.collector import CollectOptions, Task, collect_groups
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.rollout.env_pool import EnvPool
from agent_grpo.testing.backends import ScriptedBackend
from agent_grpo.trajectory.record import TrajectoryRecord

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'


class Counting:
    """`make_env`, counting the envs built and closed."""

    closed: ClassVar[list[gym.Env]] = []

    def __init__(self) -> None:
        self.built: list[gym.Env] = []

    def __call__(self, env_id: str, **kwargs: Any) -> gym.Env:
        env = make_env(env_id, **kwargs)
        close = env.close

        def closing() -> None:
            Counting.closed.append(env)
            close()

        env.close = closing  # type: ignore[method-assign]
        self.built.append(env)
        return env


def test_a_reusable_env_goes_back_to_the_next_task_of_its_id_and_kwargs() -> None:
    factory = Counting()
    pool = EnvPool(factory)
    first = pool("agent_grpo/Calculator-v0")
    pool.release(first)
    assert pool.idle == 1
    assert pool("agent_grpo/Calculator-v0") is first
    other = pool("agent_grpo/Calculator-v0", digits=3)  # other kwargs: another kind of env
    assert other is not first and len(factory.built) == 2 == pool.built
    pool.release(first)
    pool.release(other)
    Counting.closed.clear()
    pool.close()
    assert {id(e) for e in Counting.closed} == {id(first), id(other)} and pool.idle == 0


def test_an_env_that_did_not_opt_in_is_closed_when_released() -> None:
    factory = Counting()
    pool = EnvPool(factory)
    env = pool("agent_grpo/Dataset-v0", mcp_server={"command": ["true"]})  # a user's server
    Counting.closed.clear()
    pool.release(env)
    assert Counting.closed == [env] and pool.idle == 0
    assert pool("agent_grpo/Dataset-v0", mcp_server={"command": ["true"]}) is not env


def _episode(record: TrajectoryRecord) -> tuple[Any, ...]:
    """What a record says happened (not how long it took)."""
    calls = [(c.name, c.result, c.error) for t in record.turns for c in t.tool_calls]
    return (record.group_id, record.seed, record.token_ids, record.messages, record.reward,
            record.success, record.termination, calls)  # fmt: skip


def test_a_pool_kept_across_steps_builds_envs_once_and_changes_no_record(tokenizer) -> None:
    config = CollectOptions.from_config(
        RolloutConfig(group_size=2, sampling=SamplingConfig(max_tokens=64))
    )
    steps = [[Task(env_id="agent_grpo/Calculator-v0", seed=s) for s in seeds]
             for seeds in ((3, 7, 11), (5, 9, 13), (3, 21, 8))]  # fmt: skip
    factory = Counting()
    pool = EnvPool(factory)
    pooled, fresh = [], []
    for step, tasks in enumerate(steps):
        backend = ScriptedBackend(tokenizer, [CALL, "Answer: 408"])
        pooled += collect_groups(tasks, backend, tokenizer, config, step=step, envs=pool).records
        backend = ScriptedBackend(tokenizer, [CALL, "Answer: 408"])
        fresh += collect_groups(tasks, backend, tokenizer, config, step=step).records
        assert len(factory.built) == 6 and pool.idle == 6  # the first step's six, every step
    assert [_episode(r) for r in pooled] == [_episode(r) for r in fresh]
    pool.close()


class _Stuck(BaseModel):
    """Nothing to ask."""


class StuckEnv(TextEnv[_Stuck]):
    """A reusable env whose step hangs (`hang`) or raises (`fail`), every time."""

    reusable = True

    def __init__(self, hang: bool = False, fail: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hang, self.fail = hang, fail

    def generate_task(self, rng: np.random.Generator) -> _Stuck:
        return _Stuck()

    def user_prompt(self, task: _Stuck) -> str:
        return "Go."

    def verify(self, task: _Stuck, answer: str) -> Verdict:
        return text_verdict(answer, "done")

    def step(self, action: str) -> Any:
        if self.hang:
            time.sleep(2.0)
        if self.fail:
            raise RuntimeError("the env broke")
        return super().step(action)


@pytest.mark.parametrize("kwargs", [{"hang": True}, {"fail": True}])
def test_an_env_whose_step_failed_is_never_handed_out_again(tokenizer, kwargs) -> None:
    """A hung step may still run in its thread: its env, and the retry's, must not reach a
    later episode (which it would then step into), nor the pool's idle envs."""
    factory = Counting()
    pool = EnvPool(factory)
    env_id = f"{__name__}:StuckEnv"
    config = CollectOptions.from_config(RolloutConfig(group_size=2, env_step_timeout_s=0.3))
    backend = ScriptedBackend(tokenizer, ["Answer: done"])
    records = collect_groups([Task(env_id=env_id, seed=0, env_kwargs=kwargs)], backend, tokenizer,
                             config, envs=pool).records  # fmt: skip
    assert [r.termination.kind for r in records] == ["error", "error"]
    assert len(factory.built) == 4 and pool.idle == 0  # each member's env, then its retry's
    failed = {id(env) for env in factory.built}
    assert not {id(pool(env_id, **kwargs)) for _ in range(2)} & failed
    pool.close()
