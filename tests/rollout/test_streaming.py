"""The sampling loop of `rollout.partial.keep_sampling`: turns run between requests, pushes are
loaded at the next turn, and errors and closing reach whoever waits."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from agent_grpo.rollout.backends.base import Generation, SamplingConfig
from agent_grpo.rollout.collector import Collection, CollectOptions, Task
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.rollout.partial import StreamTask
from agent_grpo.rollout.streaming import SamplingLoop
from agent_grpo.testing.backends import SeededFinal
from agent_grpo.testing.envs import long_tail_seeds
from agent_grpo.testing.waiting import wait_until

ENV = "agent_grpo.testing.envs:LongTailEnv"


class RecordedWeights:
    """Where the loop's pushes go: it keeps the versions loaded and the turn each came before."""

    def __init__(self) -> None:
        self.loaded: list[int] = []
        self.loop: SamplingLoop | None = None
        self.before_turn: list[int] = []

    def load(self, weights: dict[str, torch.Tensor], version: int) -> None:
        self.loaded.append(version)
        self.before_turn.append(self.loop.turns if self.loop is not None else -1)

    def close(self) -> None:
        """Nothing held."""


class Gated(SeededFinal):
    """`SeededFinal` that runs a turn only when the test lets it (`step.release()`); `entered`
    counts the turns begun, the last one perhaps still waiting."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, [])
        self.step = threading.Semaphore(0)
        self.entered = 0

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        self.entered += 1
        assert self.step.acquire(timeout=30), "the test never let this turn run"
        return super().generate(prompts, sampling, seeds)


@contextlib.contextmanager
def sampling_loop(
    backend: Any, tokenizer: Any, weights: RecordedWeights | None = None
) -> Iterator[tuple[SamplingLoop, RecordedWeights]]:
    """A loop over `backend`, closed at the end (a gated turn still waiting let through)."""
    options = CollectOptions.from_config(
        RolloutConfig(group_size=1, sampling=SamplingConfig(max_tokens=16))
    )
    weights = weights or RecordedWeights()
    loop = SamplingLoop(Collection(backend, tokenizer, options, run_id="r"), weights)
    weights.loop = loop
    try:
        yield loop, weights
    finally:
        if isinstance(backend, Gated):
            backend.step.release(100)
        loop.close()


def tasks(step: int, turns: list[int]) -> list[StreamTask]:
    seeds = long_tail_seeds(turns)
    return [StreamTask(step, i, Task(env_id=ENV, seed=s)) for i, s in enumerate(seeds)]


def test_the_loop_keeps_sampling_between_requests(tokenizer) -> None:
    backend = Gated(tokenizer)
    with sampling_loop(backend, tokenizer) as (loop, _):
        loop.admit(tasks(0, [6, 1, 6]))
        answer = loop.take(1, step=0, run_id="r")
        backend.step.release(1)
        first = answer.result(timeout=30)
        assert [r.group_id for r in first.records] == ["s0-t1"]
        backend.step.release(5)  # nobody asks, and the two long episodes run to their end
        assert wait_until(lambda: loop.turns == 6, 30)
        second = loop.take(2, step=1, run_id="r").result(timeout=30)
        assert [r.group_id for r in second.records] == ["s0-t0", "s0-t2"]
        assert {r.step for r in second.records} == {1} and loop.turns == 6
        assert second.metrics.in_flight_groups == 0


def test_a_push_is_loaded_before_the_next_turn_and_tags_the_turns_after_it(tokenizer) -> None:
    backend = Gated(tokenizer)
    with sampling_loop(backend, tokenizer) as (loop, weights):
        loop.admit(tasks(0, [6]))
        answer = loop.take(1, step=2, run_id="r")
        backend.step.release(2)
        assert wait_until(lambda: backend.entered == 3, 30)
        loop.load({}, 1)  # posted while the third turn waits to run: it is sampled at version 0
        loop.load({}, 2)
        backend.step.release(4)
        record = answer.result(timeout=30).records[0]
        versions = [t.policy_version for t in record.turns]
        # version 1 never sampled: it was replaced before the loop reached a turn's start
        assert versions[:3] == [0, 0, 0] and set(versions[3:]) == {2}
        assert weights.loaded == [2] and weights.before_turn == [3]


def test_an_engine_call_runs_on_the_weights_posted_before_it(tokenizer) -> None:
    with sampling_loop(SeededFinal(tokenizer, []), tokenizer) as (loop, weights):
        loop.load({}, 3)
        assert loop.call(lambda version: version).result(timeout=30) == 3
        loop.load({}, 2)  # older than what it holds: never loaded
        assert loop.call(lambda version: version).result(timeout=30) == 3
        assert weights.loaded == [3]


class FailingWeights(RecordedWeights):
    def load(self, weights: dict[str, torch.Tensor], version: int) -> None:
        raise RuntimeError("out of memory")


def test_a_push_that_fails_to_load_fails_the_calls_posted_with_it(tokenizer) -> None:
    backend = Gated(tokenizer)
    with sampling_loop(backend, tokenizer, FailingWeights()) as (loop, _):
        loop.admit(tasks(0, [6]))
        backend.step.release(1)
        assert wait_until(lambda: backend.entered == 2, 30)
        loop.load({}, 1)  # both wait for the turn in progress; the load then fails
        scored = loop.call(lambda version: version)
        backend.step.release(1)
        with pytest.raises(RuntimeError, match="out of memory"):
            scored.result(timeout=30)
        with pytest.raises(RuntimeError, match="out of memory"):
            loop.take(1, step=0, run_id="r").result(timeout=30)


def test_a_request_for_more_groups_than_can_finish_gets_those_that_did(tokenizer) -> None:
    with sampling_loop(SeededFinal(tokenizer, []), tokenizer) as (loop, _):
        loop.admit(tasks(0, [2]))
        result = loop.take(3, step=0, run_id="r").result(timeout=30)
        assert [r.group_id for r in result.records] == ["s0-t0"]
        assert loop.take(1, step=1, run_id="r").result(timeout=30).records == []


def test_an_error_in_the_loop_fails_the_waiting_request_and_every_later_one(tokenizer) -> None:
    with sampling_loop(SeededFinal(tokenizer, []), tokenizer) as (loop, _):
        loop.admit([StreamTask(0, 0, Task(env_id="agent_grpo.testing.envs:NoSuchEnv", seed=0))])
        with pytest.raises(Exception, match="NoSuchEnv"):
            loop.take(1, step=0, run_id="r").result(timeout=30)
        with pytest.raises(Exception, match="NoSuchEnv"):
            loop.call(lambda version: version).result(timeout=30)


def test_closing_fails_a_waiting_request_and_closes_the_envs_in_flight(tokenizer) -> None:
    backend = Gated(tokenizer)
    with sampling_loop(backend, tokenizer) as (loop, _):  # closed again at the end: no effect
        loop.admit(tasks(0, [6]))
        answer = loop.take(1, step=0, run_id="r")
        backend.step.release(1)
        assert wait_until(lambda: backend.entered == 2, 30)  # the second turn waits to run
        env, closed = loop.collection.episodes[0].env, []
        env.close = lambda: closed.append(True)  # type: ignore[method-assign]
        closer = threading.Thread(target=loop.close)
        closer.start()  # it waits for the turn in progress, which waits for the test
        assert wait_until(lambda: loop._closing, 30)
        backend.step.release(1)
        closer.join(timeout=30)
        assert not closer.is_alive() and loop.turns == 2  # no turn after the one in progress
        with pytest.raises(RuntimeError, match="closed"):
            answer.result(timeout=30)
        assert loop.collection.groups == {} and closed == [True]
        with pytest.raises(RuntimeError, match="closed"):
            loop.take(1, step=1, run_id="r").result(timeout=30)
