"""The rollout collector: groups batched per turn, every ending recorded, invariants on records."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, ClassVar

import numpy as np
import pytest
from pydantic import BaseModel

from agent_grpo.envs.answers import text_verdict
from agent_grpo.envs.text_env import ToolEnv, Verdict
from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.collector import CollectOptions, EnvStepError, Task, collect_groups
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.testing.backends import ScriptedBackend
from agent_grpo.testing.waiting import wait_until
from agent_grpo.tools.tool import tool
from agent_grpo.trajectory.invariants import check_invariants
from agent_grpo.trajectory.record import Provenance
from agent_grpo.trajectory.tokens import ChatTemplateError

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'


def test_calculator_groups_are_batched_per_turn_and_pass_invariants(tokenizer) -> None:
    backend = ScriptedBackend(tokenizer, [CALL, "Answer: 408"])
    tasks = [Task(env_id="agent_grpo/Calculator-v0", seed=s) for s in (3, 7, 11)]
    config = CollectOptions.from_config(
        RolloutConfig(group_size=2, sampling=SamplingConfig(max_tokens=64))
    )
    result = collect_groups(tasks, backend, tokenizer, config)
    # two turns, each ONE call covering all 3 x 2 trajectories
    assert backend.calls == [6, 6]
    records = result.records
    assert [r.task_id for r in records] == [t.task_id for t in tasks for _ in range(2)]
    assert len({r.group_id for r in records}) == 3
    for record in records:
        check_invariants(record, tokenizer)
        assert record.termination.kind == "terminated"
        assert [t.tool_calls[0].result for t in record.turns[:1]] == ["408"]
        assert record.lengths.turns == 2 == len(record.turns)
        assert record.group_member_ids == [f"{record.group_id}/0", f"{record.group_id}/1"]
        kinds = set(record.provenance)
        assert kinds == {
            Provenance.PROMPT,
            Provenance.MODEL,
            Provenance.TEMPLATE,
            Provenance.OBSERVATION,
        }
    assert result.metrics.tool_calls == 6 and result.metrics.tool_errors == 0
    assert result.metrics.generated_tokens == sum(r.lengths.model for r in records)


def test_max_tokens_per_turn_truncates_without_verifying(tokenizer) -> None:
    backend = ScriptedBackend(tokenizer, ["Answer: " + "9" * 200])
    config = CollectOptions.from_config(
        RolloutConfig(group_size=1, sampling=SamplingConfig(max_tokens=8))
    )
    [record] = collect_groups(
        [Task(env_id="agent_grpo/Calculator-v0", seed=1)], backend, tokenizer, config
    ).records
    assert record.termination.kind == "truncated"
    assert record.termination.reason == "max_tokens_per_turn"
    assert record.reward == 0.0 and record.lengths.model == 8


def test_context_limit_drops_sampled_tokens_past_it(tokenizer) -> None:
    backend = ScriptedBackend(tokenizer, [CALL, "Answer: 408"])
    probe = collect_groups(
        [Task(env_id="agent_grpo/Calculator-v0", seed=1)],
        backend,
        tokenizer,
        CollectOptions.from_config(RolloutConfig(group_size=1)),
    ).records[0]
    prompt_len = probe.lengths.prompt
    config = CollectOptions.from_config(
        RolloutConfig(group_size=1, max_context_tokens=prompt_len + 5)
    )
    [record] = collect_groups(
        [Task(env_id="agent_grpo/Calculator-v0", seed=1)], backend, tokenizer, config
    ).records
    assert record.termination.reason == "max_context"
    assert len(record.token_ids) == prompt_len + 5
    check_invariants(record, tokenizer)


# ---- environments that misbehave -----------------------------------------------------------------


@tool(timeout_s=0.3)
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "done"


class SlowTask(BaseModel):
    """The number of seconds the tool should sleep."""

    seconds: float


class SlowEnv(ToolEnv[SlowTask]):
    """Calls a tool that may sleep past its timeout; `step_sleep` stalls the whole step."""

    system_prompt = "Call slow, then reply Answer: done"
    tools = (slow,)
    default_max_turns = 3

    def __init__(self, step_sleep: float = 0.0, fail: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.step_sleep = step_sleep
        self.fail = fail

    def generate_task(self, rng: np.random.Generator) -> SlowTask:
        return SlowTask(seconds=float(rng.choice([0.0, 5.0])))

    def user_prompt(self, task: SlowTask) -> str:
        return "Go."

    def verify(self, task: SlowTask, answer: str) -> Verdict:
        return text_verdict(answer, "done")

    def step(self, action: str) -> Any:
        if self.fail:
            raise RuntimeError("environment exploded")
        time.sleep(self.step_sleep)
        return super().step(action)


SLOW = f"{__name__}:SlowEnv"
SLOW_CALL = '<tool_call>{"name": "slow", "arguments": {"seconds": 5}}</tool_call>'


def test_a_tool_past_its_timeout_is_recorded_and_the_batch_finishes(tokenizer) -> None:
    backend = ScriptedBackend(tokenizer, [SLOW_CALL, "Answer: done"])
    config = CollectOptions.from_config(RolloutConfig(group_size=4))
    started = time.perf_counter()
    records = collect_groups([Task(env_id=SLOW, seed=0)], backend, tokenizer, config).records
    assert time.perf_counter() - started < 3.0  # 4 concurrent 5 s sleeps, each cut at 0.3 s
    for record in records:
        call = record.turns[0].tool_calls[0]
        assert call.error_kind == "timeout"
        assert record.termination.kind == "terminated" and record.success


def test_a_hanging_or_failing_env_errors_only_its_own_trajectory(tokenizer) -> None:
    backend = ScriptedBackend(tokenizer, ["Answer: done"])
    tasks = [
        Task(env_id=SLOW, seed=0, env_kwargs={"step_sleep": 3.0}),
        Task(env_id=SLOW, seed=0, env_kwargs={"fail": True}),
        Task(env_id=SLOW, seed=0),
    ]
    config = CollectOptions.from_config(RolloutConfig(group_size=2, env_step_timeout_s=0.5))
    started = time.perf_counter()
    records = collect_groups(tasks, backend, tokenizer, config).records
    assert time.perf_counter() - started < 2.5
    kinds = [(r.termination.kind, r.termination.reason) for r in records]
    assert kinds[:2] == [("error", "env step timeout (0.5s) (retried once)")] * 2
    assert kinds[2:4] == [("error", "RuntimeError: environment exploded (retried once)")] * 2
    assert kinds[4:] == [("terminated", "final_answer")] * 2
    assert [r.success for r in records[4:]] == [True, True]


class FlakyEnv(SlowEnv):
    """With `flaky=True`, the first instance to take a second step raises there, once."""

    failures = 0

    def __init__(self, flaky: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.flaky = flaky
        self.steps = 0

    def step(self, action: str) -> Any:
        self.steps += 1
        if self.flaky and self.steps == 2 and FlakyEnv.failures == 0:
            FlakyEnv.failures += 1
            raise ConnectionError("tool server went away")
        return super().step(action)


def test_a_failed_env_step_is_retried_once_on_a_fresh_env(tokenizer) -> None:
    FlakyEnv.failures = 0
    backend = ScriptedBackend(tokenizer, [SLOW_CALL.replace("5", "0"), "Answer: done"])
    tasks = [Task(env_id=f"{__name__}:FlakyEnv", seed=0, env_kwargs={"flaky": True})]
    config = CollectOptions.from_config(RolloutConfig(group_size=2))
    result = collect_groups(tasks, backend, tokenizer, config)
    # the member whose env raised in its second step finished like its group-mate, on a fresh
    # env replayed through its first action
    assert [r.termination.kind for r in result.records] == ["terminated", "terminated"]
    assert [r.success for r in result.records] == [True, True]
    assert result.records[0].messages == result.records[1].messages
    assert (result.metrics.env_retries, result.metrics.env_failures) == (1, 0)


class ResetLogEnv(SlowEnv):
    """Logs its resets; past the first, each waits at `barrier` for the others (when set); one
    with `fail_reset` raises. Counts the instances made and closed. Declares `concurrent_reset`
    (as an env whose reset starts a server does)."""

    concurrent_reset = True
    reset_sleep: ClassVar[float] = 0.0
    log: ClassVar[list[str]] = []
    barrier: ClassVar[threading.Barrier | None] = None
    made: ClassVar[int] = 0
    closed: ClassVar[int] = 0
    lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, fail_reset: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_reset = fail_reset
        with ResetLogEnv.lock:
            ResetLogEnv.made += 1

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        ResetLogEnv.log.append("start")
        if self.fail_reset:
            raise RuntimeError("server did not start")
        if self.barrier is not None and len(ResetLogEnv.log) > 2:  # not the first
            self.barrier.wait()  # broken (an error) unless the others are resetting too
        observation = super().reset(seed=seed, options=options)
        time.sleep(self.reset_sleep)
        ResetLogEnv.log.append("end")
        return observation

    def close(self) -> None:
        with ResetLogEnv.lock:
            ResetLogEnv.closed += 1
        super().close()


class SequentialResetEnv(ResetLogEnv):
    """`ResetLogEnv` without `concurrent_reset`: the default, for envs that did not ask. Its
    resets take a while, so two at once would overlap in the log."""

    concurrent_reset = False
    reset_sleep = 0.05


RESET_LOG = f"{__name__}:ResetLogEnv"


def test_envs_reset_together_after_the_first_of_their_id_alone(tokenizer) -> None:
    ResetLogEnv.log, ResetLogEnv.made, ResetLogEnv.closed = [], 0, 0
    ResetLogEnv.barrier = threading.Barrier(3, timeout=10)
    backend = ScriptedBackend(tokenizer, ["Answer: done"])
    config = CollectOptions.from_config(RolloutConfig(group_size=4))
    try:
        records = collect_groups([Task(env_id=RESET_LOG, seed=0)], backend, tokenizer, config)
    finally:
        ResetLogEnv.barrier = None
    # the first reset ran alone (what it loads once is loaded once), the other three at once
    assert ResetLogEnv.log[:2] == ["start", "end"] and ResetLogEnv.log.count("end") == 4
    assert [r.success for r in records.records] == [True] * 4
    assert ResetLogEnv.closed == ResetLogEnv.made == 4


def test_a_failing_reset_closes_every_env_started_and_raises(tokenizer) -> None:
    ResetLogEnv.log, ResetLogEnv.made, ResetLogEnv.closed = [], 0, 0
    backend = ScriptedBackend(tokenizer, ["Answer: done"])
    tasks = [Task(env_id=RESET_LOG, seed=0),
             Task(env_id=RESET_LOG, seed=1, env_kwargs={"fail_reset": True}),
             Task(env_id=RESET_LOG, seed=2)]  # fmt: skip
    config = CollectOptions.from_config(RolloutConfig(group_size=2))
    with pytest.raises(RuntimeError, match="server did not start"):
        collect_groups(tasks, backend, tokenizer, config)
    assert ResetLogEnv.closed == ResetLogEnv.made >= 2  # none left running
    assert backend.calls == []  # nothing sampled


def test_envs_that_did_not_ask_reset_one_after_another(tokenizer) -> None:
    ResetLogEnv.log, ResetLogEnv.made, ResetLogEnv.closed = [], 0, 0
    backend = ScriptedBackend(tokenizer, ["Answer: done"])
    config = CollectOptions.from_config(RolloutConfig(group_size=4))
    task = Task(env_id=f"{__name__}:SequentialResetEnv", seed=0)
    records = collect_groups([task], backend, tokenizer, config).records
    assert ResetLogEnv.log == ["start", "end"] * 4  # never two at once
    assert [r.success for r in records] == [True] * 4


def test_an_error_mid_rollout_closes_every_env(tokenizer) -> None:
    ResetLogEnv.log, ResetLogEnv.made, ResetLogEnv.closed = [], 0, 0
    backend = ScriptedBackend(tokenizer, ["Answer: done"])
    tasks = [
        Task(env_id=RESET_LOG, seed=0),
        Task(env_id=RESET_LOG, seed=1, env_kwargs={"fail": True}),
    ]
    config = CollectOptions.from_config(RolloutConfig(group_size=2, stop_on_env_error=True))
    with pytest.raises(EnvStepError, match="environment exploded"):
        collect_groups(tasks, backend, tokenizer, config)
    # every env was closed: the two in flight at once, and the four whose step raised (each
    # failing member's first env and its retry's) in threads of their own, as a hung step's
    # env must be (its close may wait on the step)
    wait_until(lambda: ResetLogEnv.closed >= 6, 5.0)
    assert (ResetLogEnv.made, ResetLogEnv.closed) == (6, 6)


def test_hf_backend_same_seeds_same_trajectories(tokenizer, tiny_model) -> None:
    from agent_grpo.rollout.backends.hf import HFBackend

    model, _ = tiny_model
    tasks = [Task(env_id="agent_grpo/Calculator-v0", seed=s) for s in (1, 2)]
    config = CollectOptions.from_config(
        RolloutConfig(group_size=3, sampling=SamplingConfig(temperature=1.0, max_tokens=12, seed=5))
    )
    runs = [
        collect_groups(tasks, HFBackend(model, tokenizer), tokenizer, config).records
        for _ in range(2)
    ]
    for a, b in zip(*runs, strict=True):
        assert a.token_ids == b.token_ids
        assert a.sampler_logprobs == pytest.approx(b.sampler_logprobs, abs=1e-6)
    # different samples within a group: the per-sample seeds differ
    assert len({tuple(r.token_ids) for r in runs[0][:3]}) > 1


def test_calls_past_the_per_turn_cap_are_answered_not_run(tokenizer) -> None:
    from agent_grpo.envs.registry import make_env

    env = make_env("agent_grpo/Calculator-v0", max_tool_calls_per_turn=2)
    env.reset(seed=0)
    calls = "".join(
        f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{i} + 1"}}}}</tool_call>'
        for i in range(5)
    )
    observations, *_ = env.step(calls)
    assert [m["content"] for m in observations[:2]] == ["1", "2"]
    assert all("at most 2 tool calls per turn" in m["content"] for m in observations[2:])
    assert len(observations) == 5
    env.close()


@pytest.mark.parametrize("name", ["Calculator-v0", "PythonSandbox-v0", "Search-v0", "WebApi-v0"])
def test_hf_backend_trajectories_pass_the_invariants_on_every_env(tokenizer, tiny_model, name):
    from agent_grpo.rollout.backends.hf import HFBackend

    model, _ = tiny_model
    sampling = SamplingConfig(temperature=1.0, max_tokens=16, stop=["</tool_call>"])
    config = CollectOptions.from_config(RolloutConfig(group_size=2, sampling=sampling))
    tasks = [Task(env_id=f"agent_grpo/{name}", seed=3)]
    records = collect_groups(tasks, HFBackend(model, tokenizer), tokenizer, config).records
    assert len(records) == 2 and all(r.lengths.model > 0 for r in records)
    for record in records:
        check_invariants(record, tokenizer)


def test_a_chat_template_that_fails_to_render_stops_the_rollout(tokenizer) -> None:
    # an error of the template is the setup's, not the episode's: no group of reward-0 episodes
    broken = copy.deepcopy(tokenizer)
    broken.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}"
        "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    backend = ScriptedBackend(broken, [CALL, "The answer is 408."])
    config = CollectOptions.from_config(
        RolloutConfig(group_size=2, sampling={"max_tokens": 64})  # type: ignore[arg-type]
    )
    tasks = [Task(env_id="agent_grpo/Calculator-v0", seed=1)]
    with pytest.raises(ChatTemplateError, match="no tool role"):
        collect_groups(tasks, backend, broken, config)
