"""Collect groups of multi-turn trajectories, batched across every group, turn by turn.

Each turn, every unfinished trajectory of every group is continued in ONE backend call; then the
environment steps for that turn run concurrently in threads, each with a deadline, so one slow
tool delays the batch by at most `env_step_timeout_s`. A trajectory ends on its own: final answer
(terminated), max turns (truncated, decided by the env), max tokens in one turn (truncated,
`max_tokens_per_turn`), the context limit (truncated, `max_context`), or a failing/hanging
environment (`error`, the rest of the group carries on). Envs whose reset waits on a server
of their own (`TextEnv.concurrent_reset`: Notes-v0's MCP server) also start at once, after the
first of their kind, rather than one server after another. Envs come from an `EnvPool`
(`rollout/env_pool.py`): kept across steps, it resets the `reusable` ones for later episodes
instead of building them again.

Departures from common practice, on purpose:
- A turn cut by `max_tokens` is not sent to the verifier as a final answer: the episode ends as
  truncated with reward 0. A half-written tool call is not an answer.
- Sampled tokens past the context limit are dropped, not re-tokenized: a prefix of a sampled
  sequence is still exactly what the model conditioned on.
- A first prompt that leaves no room to sample (as long as `max_context_tokens` or longer) is
  a `PromptTooLongError` before anything is generated, not a truncated record: no turn of it
  could be trained on, and cutting the prompt would change the task.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import gymnasium
from pydantic import BaseModel, ConfigDict
from rich.progress import Progress

from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import read_state, read_step_info, read_turn_reward
from agent_grpo.rollout.backends.base import Generation, GenerationBackend, SamplingConfig
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.rollout.context import (
    POLICY_SUMMARIZER,
    SUMMARY_HEADER,
    CompactObservations,
    ContextPolicy,
    StopAtLimit,
    fitting_rewrite,
    load_summarizer,
    summary_request,
)
from agent_grpo.rollout.env_pool import EnvFactory, EnvKey, EnvPool, close_quietly, env_key
from agent_grpo.trajectory.invariants import check_branch_renders, check_invariants
from agent_grpo.trajectory.record import Message, Termination, TrajectoryRecord, TurnRecord
from agent_grpo.trajectory.tokens import ChatTemplateError
from agent_grpo.trajectory.tree import TokenBuilder

__all__ = [
    "CollectOptions",
    "Collection",
    "EnvStepError",
    "PromptTooLongError",
    "RolloutMetrics",
    "RolloutResult",
    "Task",
    "collect_groups",
    "conversation_digest",
    "finish_metrics",
    "group_id_of",
    "replay_env",
]


class Task(BaseModel):
    """One prompt: an environment id and the seed that fixes its task."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True)

    env_id: str
    """Registered gymnasium id or `package.module:Class`."""
    seed: int
    """Environment seed; the same seed always gives the same task."""
    env_kwargs: dict[str, Any] = {}
    """Extra keyword arguments for the environment constructor."""

    @property
    def task_id(self) -> str:
        """Stable prompt id shared by every sample of this task."""
        return f"{self.env_id}:{self.seed}"


@dataclass(frozen=True)
class CollectOptions:
    """What `collect_groups` needs to know besides the tasks: the collector's own arguments,
    built from the user's `RolloutConfig` (`from_config`) or set directly (evaluation)."""

    group_size: int
    """G: samples per task."""
    sampling: SamplingConfig
    """Sampling settings, stop strings included."""
    max_context_tokens: int
    """Longest episode in tokens."""
    env_step_timeout_s: float = 60.0
    """Deadline for one environment step."""
    stop_on_env_error: bool = False
    """Raise at the first env step that fails twice instead of recording an error episode."""
    show_progress: bool = False
    """A progress bar of the collection's own (off inside a training run, whose display shows
    the rollout phase)."""
    check_renders: bool = False
    """Check every branch against its from-scratch rendering (`RolloutConfig.check_renders`)."""
    context: ContextPolicy = field(default_factory=StopAtLimit)
    """What an episode does when its next turn would not fit (`RolloutConfig.context`)."""

    @classmethod
    def from_config(
        cls, config: RolloutConfig, *, stop: Sequence[str] = (), show_progress: bool = False
    ) -> CollectOptions:
        """The options `config` sets; `stop` are the env's stop strings, used unless the config
        names some."""
        sampling = config.sampling.model_copy(update={"stop": config.sampling.stop or list(stop)})
        return cls(
            group_size=config.group_size, sampling=sampling,
            max_context_tokens=config.max_context_tokens,
            env_step_timeout_s=config.env_step_timeout_s,
            stop_on_env_error=config.stop_on_env_error, show_progress=show_progress,
            check_renders=config.check_renders, context=config.context,
        )  # fmt: skip


class RolloutMetrics(BaseModel):
    """What one collection cost and produced."""

    trajectories: int = 0
    """Records produced."""
    generated_tokens: int = 0
    """Model tokens sampled across all turns."""
    model_time_s: float = 0.0
    """Seconds inside the backend's generate calls."""
    env_time_s: float = 0.0
    """Seconds in environment steps (wall time of each turn's concurrent steps)."""
    wall_time_s: float = 0.0
    """Seconds for the whole collection."""
    tokens_per_s: float = 0.0
    """generated_tokens / wall_time_s."""
    turns_mean: float = 0.0
    """Mean assistant turns per trajectory."""
    tool_calls: int = 0
    """Tool calls made."""
    tool_errors: int = 0
    """Tool calls that failed (parse, validation, exception, timeout, oversized)."""
    truncated: int = 0
    """Trajectories ended by a limit."""
    errors: int = 0
    """Trajectories ended by an environment or engine failure."""
    env_retries: int = 0
    """Env steps that raised or hung and were retried once on a fresh env instance."""
    env_failures: int = 0
    """Env steps that failed again on the retry (their episodes end as errors)."""
    worker_failures: int = 0
    """Rollout workers (Ray actors) that died during the collection; their groups were sent
    to another worker."""
    stale_dropped: int = 0
    """Records dropped for being sampled more than `algo.max_staleness` versions ago."""
    in_flight_groups: int = 0
    """Groups left in flight when the collection returned, to continue on the next weights
    (`rollout.partial`)."""
    reused_prefix_tokens: int = 0
    """Context tokens the backend served from its prefix cache instead of prefilling."""


class RolloutResult(BaseModel):
    """Records, in task order then group order, and the collection's metrics."""

    records: list[TrajectoryRecord]
    """All trajectories; `records[i * G + j]` is sample j of task i."""
    metrics: RolloutMetrics
    """Throughput and outcome counts."""


@dataclass
class _Episode:
    """Mutable state of one trajectory while it is being collected."""

    task: Task
    index: int
    env: gymnasium.Env[Any, Any] | None  # None once ended and restored from a checkpoint
    builder: TokenBuilder
    prompt_count: int
    step: int = 0  # the step it was admitted for: its group id and its sampling seeds
    turns: list[TurnRecord] = field(default_factory=list)
    contexts: list[list[int]] = field(default_factory=list)
    termination: Termination | None = None
    reward: float = 0.0
    verifier: dict[str, Any] = field(default_factory=dict)
    success: bool = False
    malformed: int = 0
    state: str | None = None  # the env's name for the state the next turn starts from

    @property
    def done(self) -> bool:
        return self.termination is not None


def sampling_seed(base: int, step: int, task: Task, index: int, turn: int) -> int:
    """A per-(step, task, sample, turn) seed, independent of batch composition."""
    key = f"{base}|{step}|{task.task_id}|{index}|{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


_Started = tuple[gymnasium.Env[Any, Any], Any, dict[str, Any]]
"""A new env, reset: the env, its first observation and its info."""


def _start_episode(
    task: Task, index: int, tokenizer: Any, started: _Started, step: int
) -> _Episode:
    env, observation, info = started
    prompt = [Message.model_validate(m) for m in observation]
    episode = _Episode(task, index, env, TokenBuilder(tokenizer, prompt), len(prompt), step)
    episode.state = read_state(info)
    return episode


_RESET_THREADS = 16
"""Envs reset at once (`_reset_all`): enough for a step's servers to start together on a small
machine, few enough not to start hundreds of processes at once."""


def _reset_all(tasks: Sequence[Task], env_factory: EnvFactory) -> list[_Started]:
    """A new env for every task, reset with the task's seed, in task order. The first env of
    each env id and kwargs starts alone, in the calling thread (what an env loads once per
    process, a dataset behind `functools.cache`, is loaded by it); the others follow one by one,
    or all at once in threads where that first env says `concurrent_reset` (an env whose reset
    waits on a server of its own: Notes-v0 starts an MCP server process, most of a second each).
    A failing reset closes every env started and raises its error."""

    def start(task: Task) -> _Started:
        env = env_factory(task.env_id, **task.env_kwargs)
        try:
            observation, info = env.reset(seed=task.seed)
        except BaseException:
            close_quietly(env)
            raise
        return env, observation, info

    keys = [env_key(task.env_id, task.env_kwargs) for task in tasks]
    firsts: dict[EnvKey, int] = {}
    for i, k in enumerate(keys):
        firsts.setdefault(k, i)
    started: dict[int, _Started] = {}
    rest: dict[int, cf.Future[_Started]] = {}
    try:
        for i in firsts.values():
            started[i] = start(tasks[i])
        together = {k for k, i in firsts.items() if _concurrent_reset(started[i][0])}
        for i, task in enumerate(tasks):
            if i not in started and keys[i] not in together:
                started[i] = start(task)
        with cf.ThreadPoolExecutor(_RESET_THREADS, thread_name_prefix="env-reset") as pool:
            for i, task in enumerate(tasks):
                if i not in started:
                    rest[i] = pool.submit(start, task)
        errors = [f.exception() for f in rest.values() if f.exception() is not None]
        if errors:
            raise errors[0]  # type: ignore[misc]
        return [started[i] if i in started else rest[i].result() for i in range(len(tasks))]
    except BaseException:
        done = [f for f in rest.values() if f.done() and f.exception() is None]
        for env, _, _ in [*started.values(), *(f.result() for f in done)]:
            close_quietly(env)
        raise


def _concurrent_reset(env: gymnasium.Env[Any, Any]) -> bool:
    """Whether `env`'s kind may be reset in threads at once (`TextEnv.concurrent_reset`)."""
    return getattr(env.unwrapped, "concurrent_reset", False) is True


class PromptTooLongError(ValueError):
    """A task's first prompt leaves no room for a sampled token within `max_context_tokens`."""

    def __init__(self, task: Task, prompt_tokens: int, max_context_tokens: int) -> None:
        self.task = task
        self.prompt_tokens = prompt_tokens
        self.max_context_tokens = max_context_tokens
        super().__init__(
            f"the prompt of env {task.env_id!r} seed {task.seed} is {prompt_tokens} tokens, but "
            f"max_context_tokens is {max_context_tokens}: no room to sample a turn. Raise "
            "max_context_tokens or shorten the prompt."
        )


def _check_prompts_fit(episodes: Sequence[_Episode], max_context_tokens: int) -> None:
    """Raise `PromptTooLongError` for the first episode whose prompt fills the context."""
    for ep in episodes:
        if ep.builder.context_length >= max_context_tokens:
            raise PromptTooLongError(ep.task, ep.builder.context_length, max_context_tokens)


def _fit_to_context(gen: Generation, room: int) -> tuple[Generation, bool]:
    """Drop sampled tokens past the context limit (a prefix of a sample is still exact)."""
    room = max(0, room)  # a negative slice bound would keep tokens past the limit
    if len(gen.token_ids) <= room:
        return gen, False
    cut = Generation(gen.token_ids[:room], gen.logprobs[:room], "length", extra=gen.extra)
    return cut, True


def _policy_summary(
    backend: GenerationBackend,
    tokenizer: Any,
    policy: CompactObservations,
    seed: int,
    messages: Sequence[Message],
) -> str:
    """The policy's own summary of `messages` (`summarizer: policy`): one greedy generation on
    `summary_request`, its text under the summary header. Not trained, not recorded as ids.
    The request is built like every prompt (`TokenBuilder`), so tool text in it stays text."""
    ids = list(TokenBuilder(tokenizer, summary_request(policy, messages)).token_ids)
    sampling = SamplingConfig(temperature=0.0, max_tokens=policy.summary_max_tokens)
    (generation,) = backend.generate([ids], sampling, [seed])
    text = generation.text or tokenizer.decode(generation.token_ids, skip_special_tokens=True)
    return f"{SUMMARY_HEADER}\n{text.strip()}"


def _make_room(
    ep: _Episode, config: CollectOptions, backend: GenerationBackend, tokenizer: Any
) -> None:
    """Rewrite the oldest observations, as few as the context policy needs, so that a whole
    turn (`sampling.max_tokens`) fits `max_context_tokens`; `stop` leaves the context alone."""
    policy, builder = config.context, ep.builder
    limit = config.max_context_tokens - config.sampling.max_tokens
    if isinstance(policy, StopAtLimit) or builder.context_length <= limit:
        return
    summarize: Callable[[Sequence[Message]], str] | None = None
    if isinstance(policy, CompactObservations) and policy.summarizer == POLICY_SUMMARIZER:
        turn = len(ep.turns) - 1  # the turn just taken
        seed = sampling_seed(config.sampling.seed, ep.step, ep.task, ep.index, turn) ^ 1
        summarize = functools.partial(_policy_summary, backend, tokenizer, policy, seed)
    elif isinstance(policy, CompactObservations):
        summarize = load_summarizer(policy.summarizer)
    rewrite = fitting_rewrite(policy, builder.context_messages, ep.prompt_count,
                              lambda r: builder.preview_length(r) <= limit, summarize)  # fmt: skip
    if rewrite:
        builder.replace_messages(rewrite, reason=policy.type)


def _generate_turn(
    active: list[_Episode], backend: GenerationBackend, config: CollectOptions
) -> list[tuple[Generation, bool]]:
    prompts = [list(ep.builder.token_ids) for ep in active]
    seeds = [
        sampling_seed(config.sampling.seed, ep.step, ep.task, ep.index, len(ep.turns))
        for ep in active
    ]
    generations = backend.generate(prompts, config.sampling, seeds)
    for ep, prompt in zip(active, prompts, strict=True):
        ep.contexts.append(prompt)
    return [
        _fit_to_context(gen, config.max_context_tokens - len(prompt))
        for gen, prompt in zip(generations, prompts, strict=True)
    ]


def _record_model_turn(ep: _Episode, gen: Generation, version: int | None) -> TurnRecord:
    state = ep.state if ep.state is not None else conversation_digest(ep.builder.messages)
    span = ep.builder.add_model_turn(gen.token_ids, gen.logprobs)
    record = span.record(gen.finish_reason, index=len(ep.turns))
    record.state = state
    record.policy_version = version
    ep.turns.append(record)
    return record


def conversation_digest(messages: Sequence[Message]) -> str:
    """A turn's state when the env names none: a digest of the conversation it is written
    after (roles and contents), so only identical histories share it."""
    digest = hashlib.sha256()
    for m in messages:
        for part in (m.role, m.name or "", m.content):
            digest.update(f"{len(part)}:{part}".encode())
    return digest.hexdigest()[:16]


_Stepped = tuple[Any, float, bool, bool, dict[str, Any], float]
"""An env step's observation, reward, terminated, truncated and info, and when it started."""


def _step_env(ep: _Episode, env: gymnasium.Env[Any, Any] | None = None) -> _Stepped:
    """`ep`'s last action stepped on `env` (default: the episode's own)."""
    env = ep.env if env is None else env
    assert env is not None, "an episode in flight has its env"
    started = time.perf_counter()
    obs, reward, terminated, truncated, info = env.step(ep.builder.action(-1))
    return obs, float(reward), bool(terminated), bool(truncated), info, started


def _apply_step(ep: _Episode, result: _Stepped) -> None:
    obs, reward, terminated, truncated, info, started = result
    turn = ep.turns[-1]
    turn.env_latency_s = time.perf_counter() - started
    step_info = read_step_info(info)
    turn.tool_calls = list(step_info.tool_calls)
    turn.reward, ep.state = read_turn_reward(info), read_state(info)
    ep.malformed += step_info.malformed_tool_calls
    if terminated or truncated:
        ep.reward = reward
        ep.verifier = dict(step_info.verifier or {})
        ep.success = bool(step_info.success)
        kind: Literal["terminated", "truncated"] = "terminated" if terminated else "truncated"
        ep.termination = Termination(kind=kind, reason=step_info.end_reason or kind)
        return
    ep.builder.add_observations([Message.model_validate(m) for m in obs])


def _in_daemon_thread(fn: Callable[[], Any]) -> cf.Future[Any]:
    """Run `fn` in a daemon thread: one that hangs is abandoned and never blocks process exit
    (a ThreadPoolExecutor's workers are joined at exit)."""
    future: cf.Future[Any] = cf.Future()

    def target() -> None:
        try:
            future.set_result(fn())
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=target, name="env-step", daemon=True).start()
    return future


def _step_or_error(future: cf.Future[Any], deadline: float, timeout_s: float) -> Any:
    """The step's result, or the `Termination` it failed with (timeout or exception)."""
    try:
        return future.result(timeout=max(0.0, deadline - time.perf_counter()))
    except cf.TimeoutError:
        # A hung step cannot be killed from here; its thread is abandoned and the env is
        # never used again. Tools that must be killable run in the sandbox.
        return Termination(kind="error", reason=f"env step timeout ({timeout_s}s)")
    except Exception as error:  # the env's bug must not take the batch down
        return Termination(kind="error", reason=f"{type(error).__name__}: {error}")


def replay_env(
    ep: _Episode, env_factory: EnvFactory, skip_last: bool = False
) -> gymnasium.Env[Any, Any]:
    """A new env instance where `ep`'s is: reset with the task's seed and stepped through the
    episode's actions (all, or all but the last); envs are deterministic given seed and
    actions, so it holds the same state."""
    env = env_factory(ep.task.env_id, **ep.task.env_kwargs)
    try:
        env.reset(seed=ep.task.seed)
        actions = ep.builder.actions
        for action in actions[:-1] if skip_last else actions:
            env.step(action)
    except BaseException:
        close_quietly(env)
        raise
    return env


def _on_fresh_env(ep: _Episode, envs: EnvPool) -> tuple[gymnasium.Env[Any, Any], _Stepped]:
    """This turn's step again on an env that has not failed (`replay_env` up to this turn's
    action): that env and the step's result. The caller makes it the episode's only once it
    returns, never from this thread: a step that hangs leaves its env here, unused."""
    env = replay_env(ep, envs, skip_last=True)
    try:
        return env, _step_env(ep, env)
    except BaseException:
        envs.discard(env)
        raise


class EnvStepError(RuntimeError):
    """An env step or its verifier failed twice, with `rollout.stop_on_env_error` set."""


def _step_all(
    stepping: list[_Episode],
    timeout_s: float,
    envs: EnvPool,
    metrics: RolloutMetrics,
    stop_on_error: bool = False,
) -> None:
    """Step every episode concurrently, each with `timeout_s` from the start of the turn. A step
    that raises or hangs is retried once, on a fresh env (`_on_fresh_env`), so one flaky env
    call does not cost the group a member; failing again ends the episode as an error (and
    without an env). An env whose step failed is discarded, never given to a later episode:
    a hung step may still be running in its thread."""
    results = _run_concurrently([functools.partial(_step_env, ep) for ep in stepping], timeout_s)
    failed = [ep for ep, r in zip(stepping, results, strict=True) if isinstance(r, Termination)]
    metrics.env_retries += len(failed)
    for ep in failed:
        envs.discard(ep.env)
        ep.env = None
    retried = _run_concurrently(
        [functools.partial(_on_fresh_env, ep, envs) for ep in failed], timeout_s
    )
    again: dict[int, Any] = {}
    for ep, outcome in zip(failed, retried, strict=True):
        if isinstance(outcome, Termination):
            again[id(ep)] = outcome
        else:
            ep.env, again[id(ep)] = outcome
    for ep, result in zip(stepping, results, strict=True):
        result = again.get(id(ep), result)
        if isinstance(result, Termination):
            if stop_on_error:
                action = ep.builder.messages[-1].content
                raise EnvStepError(
                    f"{ep.task.env_id} seed {ep.task.seed} turn {len(ep.turns) - 1}: "
                    f"{result.reason} (also on a fresh env); the model's action was "
                    f"{action[:300]!r}"
                )
            ep.termination = Termination(kind="error", reason=f"{result.reason} (retried once)")
            metrics.env_failures += 1
            continue
        try:
            _apply_step(ep, result)
        except ChatTemplateError:
            # the chat template, not this env, is broken: every episode would end the same way
            # as a reward-0 "error", so the run stops with the template's own message
            raise
        except Exception as error:
            ep.termination = Termination(kind="error", reason=f"{type(error).__name__}: {error}")


def _run_concurrently(calls: list[Callable[[], Any]], timeout_s: float) -> list[Any]:
    """Each call in a daemon thread, all with one deadline; results or `Termination`s."""
    futures = [_in_daemon_thread(call) for call in calls]
    deadline = time.perf_counter() + timeout_s
    return [_step_or_error(future, deadline, timeout_s) for future in futures]


def _to_record(
    ep: _Episode, group_id: str, group_size: int, step: int, run_id: str, config: CollectOptions
) -> TrajectoryRecord:
    assert ep.termination is not None
    return ep.builder.to_record(
        run_id=run_id,
        step=step,
        group_id=group_id,
        task_id=ep.task.task_id,
        index_in_group=ep.index,
        group_size=group_size,
        env_id=ep.task.env_id,
        seed=ep.task.seed,
        sampling_temperature=config.sampling.temperature or 1.0,
        reward=ep.reward,
        reward_components={"verifier": ep.reward},
        verifier=ep.verifier,
        success=ep.success,
        turns=ep.turns,  # with their tool calls, states, turn rewards and versions
        termination=ep.termination,
        malformed_tool_calls=ep.malformed,
        group_member_ids=[f"{group_id}/{i}" for i in range(group_size)],
        policy_version=min((t.policy_version for t in ep.turns if t.policy_version is not None),
                           default=0),
    )  # fmt: skip


def _end_turn(ep: _Episode, gen: Generation, cut: bool) -> bool:
    """End the episode if this turn hit a token limit; True when it did."""
    if cut:
        ep.termination = Termination(kind="truncated", reason="max_context")
    elif gen.finish_reason == "length":
        ep.termination = Termination(kind="truncated", reason="max_tokens_per_turn")
    return ep.done


def _run_turn(
    active: list[_Episode],
    backend: GenerationBackend,
    tokenizer: Any,
    config: CollectOptions,
    metrics: RolloutMetrics,
    envs: EnvPool,
    version: int | None,
) -> None:
    """One turn of every episode in `active`: one backend call, then every env step at once;
    `version` tags the sampled turns (None: the record's version stands for every turn)."""
    started = time.perf_counter()
    try:
        outputs = _generate_turn(active, backend, config)
    except Exception as error:  # an engine failure ends this turn's trajectories, not the run
        for ep in active:
            ep.termination = Termination(kind="error", reason=f"generation failed: {error}")
        return
    metrics.model_time_s += time.perf_counter() - started
    stepping = []
    for ep, (gen, cut) in zip(active, outputs, strict=True):
        _record_model_turn(ep, gen, version)
        metrics.generated_tokens += len(gen.token_ids)
        metrics.reused_prefix_tokens += int(gen.extra.get("reused_tokens", 0))
        if not _end_turn(ep, gen, cut):
            stepping.append(ep)
    started = time.perf_counter()
    _step_all(stepping, config.env_step_timeout_s, envs, metrics,
              config.stop_on_env_error)  # fmt: skip
    metrics.env_time_s += time.perf_counter() - started
    for ep in stepping:
        if not ep.done:
            _make_room(ep, config, backend, tokenizer)  # may rewrite old outputs
        if not ep.done and len(ep.builder.token_ids) >= config.max_context_tokens:
            ep.termination = Termination(kind="truncated", reason="max_context")


def group_id_of(step: int, task_index: int) -> str:
    """The group id of task `task_index` admitted for `step` (`s{step}-t{task_index}`)."""
    return f"s{step}-t{task_index}"


class Collection:
    """Groups of episodes in flight: admitted, continued one turn at a time (every unfinished
    episode in one backend call), and taken out as records once a whole group has ended.

    `collect_groups` admits its tasks and runs them to the end. A partial rollout
    (`rollout/partial.py`) keeps one collection across training steps instead: it takes the
    groups that finished and leaves the others in flight, to continue on the next weights.
    """

    def __init__(
        self,
        backend: GenerationBackend,
        tokenizer: Any,
        config: CollectOptions,
        *,
        run_id: str = "",
        env_factory: EnvFactory = make_env,
        envs: EnvPool | None = None,
    ) -> None:
        """`envs`: where episodes get their envs and return them once their group is taken (a
        pool kept across steps reuses `reusable` envs); without one, a pool of the collection's
        own, built with `env_factory`, whose envs close with the collection."""
        self.backend, self.tokenizer, self.config = backend, tokenizer, config
        self.run_id = run_id
        self.envs = envs if envs is not None else EnvPool(env_factory)
        self._own_envs = envs is None
        self.metrics = RolloutMetrics()
        """What the turns run since the last `take` cost (`take` hands them over)."""
        self.groups: dict[str, list[_Episode]] = {}
        """Group id -> its episodes, in admission order."""

    def admit(self, tasks: Sequence[Task], step: int, first_index: int = 0) -> None:
        """Start `group_size` episodes of every task: task i is group
        `group_id_of(step, first_index + i)`. A prompt too long to sample from raises
        `PromptTooLongError` and admits nothing."""
        size = self.config.group_size
        members = [(task, i) for task in tasks for i in range(size)]
        started = _reset_all([task for task, _ in members], self.envs)
        try:
            episodes = [
                _start_episode(task, i, self.tokenizer, new, step)
                for (task, i), new in zip(members, started, strict=True)
            ]
            _check_prompts_fit(episodes, self.config.max_context_tokens)
        except BaseException:  # a prompt too long, or one the chat template refuses
            for env, _, _ in started:
                close_quietly(env)
            raise
        for t in range(len(tasks)):
            self.groups[group_id_of(step, first_index + t)] = episodes[t * size : (t + 1) * size]

    @property
    def episodes(self) -> list[_Episode]:
        """Every episode in flight, in admission order."""
        return [ep for group in self.groups.values() for ep in group]

    def run_turn(self, version: int | None = None) -> bool:
        """One turn of every unfinished episode, its turns tagged `version`; False when no
        episode was left to run."""
        active = [ep for ep in self.episodes if not ep.done]
        if active:
            _run_turn(active, self.backend, self.tokenizer, self.config, self.metrics,
                      self.envs, version)  # fmt: skip
        return bool(active)

    def finished(self) -> list[str]:
        """Ids of the groups every member of which has ended, in admission order."""
        return [g for g, members in self.groups.items() if all(ep.done for ep in members)]

    def take(self, group_ids: Sequence[str], step: int) -> RolloutResult:
        """The records of these finished groups, stamped `step`, with the metrics of the turns
        run since the last take; they leave the collection and their envs go back to the pool
        (closed, unless their kind is reusable)."""
        records, episodes = [], []
        for group_id in group_ids:
            for ep in self.groups.pop(group_id):
                records.append(_to_record(ep, group_id, self.config.group_size, step,
                                          self.run_id, self.config))  # fmt: skip
                episodes.append(ep)
                self.envs.release(ep.env)
        for record, ep in zip(records, episodes, strict=True):  # cheap next to sampling
            check_invariants(record, self.tokenizer, contexts=ep.contexts)
            if self.config.check_renders:
                check_branch_renders(record, self.tokenizer)
        metrics, self.metrics = self.metrics, RolloutMetrics()
        return RolloutResult(records=records, metrics=metrics)

    def close(self) -> None:
        """Close every env still in flight (their episodes are dropped), and the idle envs of a
        pool of the collection's own."""
        for ep in self.episodes:
            close_quietly(ep.env)
        self.groups.clear()
        if self._own_envs:
            self.envs.close()


def collect_groups(
    tasks: Sequence[Task],
    backend: GenerationBackend,
    tokenizer: Any,
    config: CollectOptions,
    *,
    step: int = 0,
    run_id: str = "",
    env_factory: EnvFactory = make_env,
    envs: EnvPool | None = None,
) -> RolloutResult:
    """Sample `config.group_size` trajectories for every task, all groups batched per turn;
    envs from `envs` (a pool kept across calls reuses `reusable` envs) or built with
    `env_factory` and closed at the end."""
    started = time.perf_counter()
    collection = Collection(backend, tokenizer, config, run_id=run_id, env_factory=env_factory,
                            envs=envs)  # fmt: skip
    collection.admit(tasks, step)
    total = len(tasks) * config.group_size
    try:
        with Progress(transient=True, disable=not config.show_progress) as progress:
            bar = progress.add_task("rollout", total=total)
            while collection.run_turn():
                progress.update(bar, completed=sum(ep.done for ep in collection.episodes))
        result = collection.take(collection.finished(), step)
    finally:  # an error mid-rollout (`EnvStepError`, a broken chat template) or an interrupt
        collection.close()  # stops the envs still in flight (MCP servers) now, not at exit
    finish_metrics(result, time.perf_counter() - started)
    return result


def finish_metrics(result: RolloutResult, wall_time_s: float) -> None:
    """Fill the metrics a collection's records decide, for a collection of `wall_time_s`."""
    metrics, records = result.metrics, result.records
    metrics.wall_time_s = wall_time_s
    metrics.trajectories = len(records)
    metrics.turns_mean = sum(len(r.turns) for r in records) / max(1, len(records))
    calls = [c for r in records for t in r.turns for c in t.tool_calls]
    metrics.tool_calls = len(calls)
    metrics.tool_errors = sum(c.error is not None for c in calls)
    metrics.truncated = sum(r.termination.kind == "truncated" for r in records)
    metrics.errors = sum(r.termination.kind == "error" for r in records)
    metrics.tokens_per_s = metrics.generated_tokens / max(metrics.wall_time_s, 1e-9)
