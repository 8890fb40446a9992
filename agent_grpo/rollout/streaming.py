"""Partial rollouts that keep sampling while the trainer updates (`rollout.partial.keep_sampling`).

A `SamplingLoop` owns one Ray worker's engine and its groups in flight, and runs their turns on
a thread of its own, one turn after another, whether or not a step is waiting for them. Calls
from the worker only post to it: tasks to admit, weights to load, a request for finished groups,
something to run on the engine (the canary). Between two turns the loop loads the newest weights
posted (skipping older ones it never sampled with), admits the tasks, runs what was asked of the
engine and hands out finished groups; no other thread touches the engine or the groups.

What this changes from `PartialCollector` driven by the worker's calls: there, turns run only
inside a step's call and a push waits behind the calls queued before it, so with
`algo.max_staleness` k every turn a group carries into a later call is at least k + 1 versions
old when trained (docs/scaling.md). Here a push reaches the engine at the next turn's start, so
a turn is as old as the updates since it was sampled, and the engine does not wait for the
trainer's update (it waits only when every group it holds has ended).

Where we depart from peers: AReaL and verl's fully asynchronous rollouts can also interrupt a
turn mid-generation; here a turn is one backend call for every episode in flight and is one
policy's sample. The price of not pausing sampling is determinism: which version samples a turn
depends on when the push arrived, so two runs of one config differ (the call-driven mode stays
the default, and is equal to the local run).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from agent_grpo.rollout.collector import Collection, RolloutResult, finish_metrics
from agent_grpo.rollout.engine_weights import EngineWeights
from agent_grpo.rollout.partial import StreamTask

__all__ = ["SamplingLoop"]


@dataclass
class _Take:
    """A request for finished groups, answered in the order requests came."""

    want: int
    """How many finished groups (fewer when no more can finish)."""
    step: int
    """The step whose records they become."""
    run_id: str
    """The run id stamped on them."""
    answer: Future[RolloutResult] = field(default_factory=Future)
    """Its records, or the error that stopped the loop."""


@dataclass
class _Call:
    """Something to run on the engine between two turns (the weight canary's scoring)."""

    run: Callable[[int], Any]
    """Called with the version the engine then holds."""
    answer: Future[Any] = field(default_factory=Future)
    """What it returned, or raised."""


class SamplingLoop:
    """One worker's groups in flight, run turn after turn on a thread of its own; see the
    module's docstring."""

    def __init__(self, collection: Collection, weights: EngineWeights, version: int = 0) -> None:
        self.collection, self.weights = collection, weights
        self.version = version
        """The policy version the engine samples with (the loop thread's to change)."""
        self.turns = 0
        """Turns run so far (a turn is one backend call for every episode in flight)."""
        self._answered = time.perf_counter()
        """When the last take was answered (or the loop started): its metrics' wall time."""
        self._wake = threading.Condition()
        self._admit: list[StreamTask] = []
        self._weights: tuple[dict[str, torch.Tensor], int] | None = None
        self._takes: list[_Take] = []
        self._calls: list[_Call] = []
        self._error: BaseException | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="sampling-loop", daemon=True)
        self._thread.start()

    def admit(self, tasks: Sequence[StreamTask]) -> None:
        """Admit these tasks' groups before the next turn."""
        with self._wake:
            self._admit += tasks
            self._wake.notify()

    def load(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Sample with `weights` (policy `version`) from the next turn on; a newer push posted
        before that turn replaces this one."""
        with self._wake:
            newest = max(self.version, -1 if self._weights is None else self._weights[1])
            if self._error is None and version >= newest:  # never back to older weights
                self._weights = (weights, version)
            self._wake.notify()

    def take(self, want: int, step: int, run_id: str = "") -> Future[RolloutResult]:
        """The oldest `want` groups to finish once that many have, as records of `step` (fewer
        when nothing else is in flight or admitted). Requests are answered in turn; the
        metrics are those of the turns since the last answer."""
        request = _Take(want, step, run_id)
        with self._wake:
            self._post(self._takes, request)
        return request.answer

    def call(self, run: Callable[[int], Any]) -> Future[Any]:
        """`run(version)` between two turns, after the newest weights posted are loaded."""
        request = _Call(run)
        with self._wake:
            self._post(self._calls, request)
        return request.answer

    def close(self) -> None:
        """Stop after the turn in progress, fail the requests not answered, and close the
        environments in flight."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join()
        with self._wake:
            for answer in self._answers():
                answer.set_exception(RuntimeError("the sampling loop is closed"))
            self._takes, self._calls = [], []
        self.collection.close()

    def _answers(self) -> list[Future[Any]]:
        """Every request's answer still owed (with the `_wake` lock held)."""
        return [r.answer for r in self._takes] + [r.answer for r in self._calls]

    def _post(self, queue: list[Any], request: _Take | _Call) -> None:
        """Queue `request`, or fail it at once when the loop has stopped (with the `_wake` lock
        held)."""
        if self._error is not None:
            request.answer.set_exception(self._error)
        elif self._closing:
            request.answer.set_exception(RuntimeError("the sampling loop is closed"))
        else:
            queue.append(request)
            self._wake.notify()

    def _run(self) -> None:
        """Turns until closed; an error fails every request, now and later."""
        try:
            while self._between_turns():
                self.collection.run_turn(self.version)
                self.turns += 1
        except BaseException as error:  # handed to whoever asks next
            with self._wake:
                self._error = error
                for answer in self._answers():
                    answer.set_exception(error)
                self._takes, self._calls = [], []

    def _between_turns(self) -> bool:
        """Load, admit, run calls, answer takes; wait while there is nothing to sample. False
        once closed. A load or an admission that raises stops the loop with the calls and
        takes still queued, so `_run` fails every one of them."""
        while True:
            with self._wake:
                if self._closing:
                    return False
                weights, self._weights = self._weights, None
                admit, self._admit = self._admit, []
            if weights is not None:
                self.weights.load(*weights)
                self.version = weights[1]
            for item in admit:
                self.collection.admit([item.task], item.step, first_index=item.index)
            with self._wake:
                calls, self._calls = self._calls, []
            for request in calls:  # each answered, whatever it raises
                _answer(request.answer, request.run, self.version)
            self._answer_takes()
            running = any(not ep.done for ep in self.collection.episodes)
            with self._wake:
                if running:
                    return True
                if not (self._closing or self._weights or self._admit or self._calls
                        or self._takes_ready()):  # fmt: skip
                    self._wake.wait()

    def _answer_takes(self) -> None:
        """Answer the requests that enough finished groups (or nothing left to run) satisfy."""
        while True:
            with self._wake:
                if not self._takes_ready():
                    return
                request = self._takes.pop(0)
            _answer(request.answer, self._take_now, request)

    def _takes_ready(self) -> bool:
        """Whether the oldest request can be answered now (with the `_wake` lock held)."""
        if not self._takes:
            return False
        finished = len(self.collection.finished())
        idle = not self._admit and all(ep.done for ep in self.collection.episodes)
        return finished >= self._takes[0].want or idle

    def _take_now(self, request: _Take) -> RolloutResult:
        """The oldest finished groups for `request`, with the metrics since the last take."""
        self.collection.run_id = request.run_id
        result = self.collection.take(self.collection.finished()[: request.want], request.step)
        now = time.perf_counter()
        finish_metrics(result, now - self._answered)  # the turns since the last take
        self._answered = now
        result.metrics.in_flight_groups = len(self.collection.groups)
        return result


def _answer(answer: Future[Any], run: Callable[[Any], Any], arg: Any) -> None:
    """Set `answer` to `run(arg)`, or to what it raised."""
    try:
        answer.set_result(run(arg))
    except Exception as error:  # the caller's to handle
        answer.set_exception(error)
