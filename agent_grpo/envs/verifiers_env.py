"""Verifiers-v0: a verifiers v1 environment (a `vf.Taskset`), trained as it is written.

`env.kwargs: {taskset: my_envs.math:MathTaskset, args: {split: train}}` builds the taskset the
way verifiers does (its own config type validates `args`) and trains on its tasks: the user
message is the task's `prompt` (text or messages), the system prompt its `system_prompt`, the
tools are the `@vf.tool` methods of the `Toolset`s that `Taskset.toolsets` and `Task.toolsets`
return (named `<server>_<tool>`, or bare for `TOOL_PREFIX = None`, as verifiers' harnesses name
them), and the reward is the task's own `score`: its `@vf.reward` functions (and those its
config plugs in), weighted and summed; a total of `success_reward` solves it.

Version: verifiers 0.4.0, installed with `--no-deps`: its wheel pins `mcp==2.0.0` and `openai<3`
for its own rollouts (MCP tool servers, its model client), while its v1 tasksets, toolsets,
rewards and traces import and run beside our mcp 2.3 and openai 3; the `verifiers` extra lists
what they import. The v1 API moves between releases, so this adapter follows 0.4.0's
(`Taskset.toolsets(config)`, `Task(data, config)`, `task.hooks`, `Trace.state`) and refuses
another release in one line.

Where we depart from verifiers:
- We own the multi-turn loop, the tool-call format and tokenization: verifiers' harness, rollout,
  OpenAI client and MCP servers are not used. Tools are the toolsets' bound methods, called
  in-process with our timeouts and output caps. A taskset's toolsets are made and `setup()` once
  per process (verifiers shares them across a worker's rollouts); a task's own are made per
  episode and also get `setup_task`. A toolset with its own `vf.State` reads and writes the
  episode's state around each call, as over verifiers' state channel, and the rewards see it as
  `trace.state`. As in verifiers' harnesses, a turn without a tool call ends the episode;
  `@vf.stop` and `@vf.intercept` hooks are not run (`max_turns` is ours).
- Scoring is offline: the conversation becomes a `vf.Trace` (the model's turns `sampled`, tool
  calls left in their text, in our format) and `task.score(trace)` is awaited. What cannot run
  without a model client or a sandbox (judges, a task that needs a container or overrides
  `setup`/`finalize`, a reward that takes a `runtime`, which verifiers would silently skip
  offline) and a reward that is not `async def` are refused, in one line, when the env is made.
- Seeds index tasks as Dataset-v0's do: a training seed draws a task, held-out seeds walk the
  held-out tasks in order. They come from `heldout_args` (the taskset built again), else they are
  the last `heldout_fraction` of the tasks; training never sees a held-out prompt.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent_grpo.envs.text_env import HELDOUT_SEEDS, ToolEnv, Verdict
from agent_grpo.envs.verifiers_tasks import (
    check_scoring,
    import_verifiers,
    load_tasks,
    one_line,
    problems,
    split_tasks,
)
from agent_grpo.tools.tool import Tool, tool

__all__ = ["VerifiersEnv", "VerifiersEnvConfig", "VerifiersTask"]

_TOOL_ENV_KWARGS = set(inspect.signature(ToolEnv.__init__).parameters) - {"self"}
_MODEL = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class VerifiersEnvConfig(BaseModel):
    """Verifiers-v0's kwargs: the taskset, how it is built, split and judged."""

    model_config = _MODEL

    taskset: str = "agent_grpo.envs.verifiers_word_problems:WordProblemsTaskset"
    """`module:attribute` naming a `vf.Taskset` subclass or a function returning a taskset, or an
    installed taskset id (verifiers' loader; a Hub `org/name` id is not installed from here)."""
    args: dict[str, Any] = {}
    """The training tasks' taskset config fields (checked by its config type), or the function's
    keyword arguments."""
    heldout_args: dict[str, Any] | None = None
    """The same for the held-out tasks (`{split: test}`); None: hold out the last
    `heldout_fraction` of the training tasks."""
    heldout_fraction: float = Field(default=0.2, gt=0, lt=1)
    """Share of the tasks held out when there are no `heldout_args`."""
    success_reward: float = 1.0
    """Total reward at which an episode counts as solved."""
    expert_reply: str | None = None
    """The scripted expert's answer, formatted with the task data's fields (`Answer: {answer}`);
    None: no expert, so no warm start."""


class VerifiersTask(BaseModel):
    """One task of the taskset: where it is, and its data."""

    model_config = _MODEL

    split: Literal["train", "heldout"]
    """Which of the env's task lists holds it."""
    index: int
    """Its place in that list."""
    data: dict[str, Any]
    """Its `TaskData` as JSON: prompt, system prompt and the taskset's own fields."""


def _run(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Await verifiers' async hooks from our sync env API."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # the rollout's worker threads: no loop running
        return asyncio.run(coroutine)
    # Called from async code (a notebook): asyncio.run would refuse, so run on a thread's own loop.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


@dataclass
class EpisodeState:
    """The episode's `trace.state`, which verifiers shares between the tools and the rewards."""

    value: Any = None
    """The task's `vf.State` (its class's `State` specialization), made at reset."""


@functools.cache
def _shared_servers(taskset: Any) -> tuple[Any, ...]:
    """The taskset's own toolsets, made and set up once per (cached) taskset."""
    servers = type(taskset).toolsets(taskset.config)
    for server in servers:
        _run(server.setup())
    return tuple(servers)


def _task_servers(task: Any) -> list[Any]:
    """A task's own toolsets for one episode, set up, and for this task."""
    servers = type(task).toolsets(task.config)
    for server in servers:
        _run(server.setup())
        _run(server.setup_task(task.data))
    return servers


def _with_state(server: Any, fn: Callable[..., Any], episode: EpisodeState) -> Callable[..., Any]:
    """`fn` called as verifiers' tool servers call it: the server's `self.state` is the episode's
    state while it runs (validated into the server's `State` type), and what the call leaves
    there replaces the episode's state."""
    from verifiers.v1.mcp.server import _call_state

    adapter = server._state_adapter  # the server's `State` type, as verifiers validates it

    @functools.wraps(fn)
    async def call(*args: Any, **kwargs: Any) -> Any:
        state = adapter.validate_json(episode.value.model_dump_json())
        token = _call_state.set(state)
        try:
            result = fn(*args, **kwargs)
            result = await result if inspect.isawaitable(result) else result
        finally:
            _call_state.reset(token)
        episode.value = type(episode.value).model_validate_json(adapter.dump_json(state))
        return result

    return call


def _tools(servers: tuple[Any, ...] | list[Any], episode: EpisodeState) -> list[Tool]:
    """Each toolset's `@vf.tool` methods as our tools, named as verifiers' harnesses name them."""
    vf = import_verifiers()
    from verifiers.v1.utils.decorators import discover_decorated

    def name(server: Any, fn: Any) -> str:
        bare = getattr(fn, "tool_name", None) or fn.__name__
        return f"{server.server_name}_{bare}" if server.server_name else bare

    def wrapped(server: Any, fn: Any) -> Any:
        stateful = server._state_cls is not vf.State  # verifiers syncs only a State subclass
        return _with_state(server, fn, episode) if stateful else fn

    return [tool(name=name(s, fn))(wrapped(s, fn))
            for s in servers for fn in discover_decorated(s, "tool")]  # fmt: skip


def _trace(task: Any, conversation: list[dict[str, str]], prompt_length: int, state: Any) -> Any:
    """The conversation as the `vf.Trace` verifiers' rewards read; the assistant messages after
    the first `prompt_length` are the sampled turns (before them: the prompt's own examples)."""
    vf = import_verifiers()

    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}

    def message(i: int, m: dict[str, str]) -> Any:
        if m["role"] == "tool":  # our tool messages carry no call id: one per position
            return vf.ToolMessage(
                tool_call_id=f"call_{i}", content=m["content"], name=m.get("name")
            )
        return kinds[m["role"]](content=m["content"])

    nodes = [
        vf.MessageNode(parent=i - 1 if i else None, message=message(i, m),
                       sampled=m["role"] == "assistant" and i >= prompt_length)
        for i, m in enumerate(conversation)
    ]  # fmt: skip
    recorded = vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
    agent = vf.AgentInfo(config=vf.AgentConfig())  # ours: no harness, model or runtime of theirs
    return vf.Trace(task=recorded, agent=agent, nodes=nodes, state=state)


def _scores(trace: Any) -> str:
    """`name=value` for each reward (weighted, as it adds to the total) and metric."""
    values = {**{k: r.value for k, r in trace.rewards.items() if r is not None},
              **{k: v for k, v in trace.metrics.items() if v is not None}}  # fmt: skip
    return ", ".join(f"{k}={v:g}" for k, v in values.items())


def _raised_in(error: BaseException, names: list[str]) -> str:
    """` in <reward> (file:line)` for the innermost frame of a reward or metric, if any."""
    frames = traceback.extract_tb((error.__cause__ or error).__traceback__)
    hits = [f for f in frames if f.name in names]
    return f" in {hits[-1].name} ({hits[-1].filename}:{hits[-1].lineno})" if hits else ""


class VerifiersEnv(ToolEnv[VerifiersTask]):
    """Solve a verifiers taskset's tasks; the task's own rubric is the reward."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{k: kwargs.pop(k) for k in list(kwargs) if k in _TOOL_ENV_KWARGS})
        import_verifiers()  # before the cache: a missing package is refused on every call
        try:
            self.config = VerifiersEnvConfig.model_validate(kwargs)
        except ValidationError as error:
            raise ValueError(f"Verifiers-v0 kwargs: {problems(error)}") from None
        taskset, tasks = load_tasks(self.config.taskset, self.config.args)
        heldout = self.config.heldout_args
        held = None if heldout is None else load_tasks(self.config.taskset, heldout)[1]
        self.tasks = split_tasks(tasks, held, self.config.heldout_fraction)
        # the held-out tasks may be built with another task config (`heldout_args.task`)
        self.scoring_names = [*check_scoring(tasks[0]), *check_scoring(self.tasks["heldout"][0])]
        self.episode_state = EpisodeState()
        self.shared_tools = _tools(_shared_servers(taskset), self.episode_state)
        self.tools = list(self.shared_tools)  # a task's own toolsets join at reset
        self.prompt_length = 0  # messages of the episode's prompt, set at reset
        if self.config.expert_reply is not None:
            self._format_expert(tasks[0].data.model_dump(mode="json"))

    def generate_task(self, rng: np.random.Generator) -> VerifiersTask:
        """A random training task, or the held-out task at this seed's place in `HELDOUT_SEEDS`."""
        tasks = self.tasks[self.split]
        index = (self.task_seed - HELDOUT_SEEDS.start if self.split == "heldout"
                 else int(rng.integers(len(tasks)))) % len(tasks)  # fmt: skip
        data = tasks[index].data.model_dump(mode="json")
        return VerifiersTask(split=self.split, index=index, data=data)

    def verifiers_task(self, task: VerifiersTask) -> Any:
        """The verifiers `Task` behind `task`."""
        return self.tasks[task.split][task.index]

    def opening_messages(self, task: VerifiersTask) -> list[dict[str, str]]:
        """The task's system prompt (and the tool list), then its prompt; the episode's state is
        made, and a task's own toolsets are made and set up for it, here."""
        from verifiers.v1.state import state_cls
        from verifiers.v1.types import content_text

        vf_task = self.verifiers_task(task)
        self.episode_state.value = state_cls(type(vf_task))()
        self.tools = [*self.shared_tools, *_tools(_task_servers(vf_task), self.episode_state)]
        prompt = vf_task.data.prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [
            {"role": m.role, "content": content_text(m.content)} for m in prompt]  # fmt: skip
        leading = messages.pop(0) if messages[:1] and messages[0]["role"] == "system" else {}
        self.system_prompt = vf_task.data.system_prompt or leading.get("content", "")
        self.prompt_length = 1 + len(messages)
        return [{"role": "system", "content": self.render_system_prompt()}, *messages]

    def render_system_prompt(self) -> str:
        """The system prompt, and the tool list when there are tools."""
        return super().render_system_prompt() if self.tools else self.system_prompt

    def verify(self, task: VerifiersTask, answer: str) -> Verdict:
        """The task's own `score` on the whole conversation: its weighted rewards, summed."""
        del answer  # the conversation ends with it, and the rewards read the whole trace
        vf_task = self.verifiers_task(task)
        trace = _trace(vf_task, self.conversation, self.prompt_length, self.episode_state.value)
        try:
            _run(vf_task.score(trace))
        except Exception as error:
            where = _raised_in(error, self.scoring_names)
            raise ValueError(f"verifiers scoring of {type(vf_task).__name__} failed{where}: "
                             f"{one_line(error.__cause__ or error)}") from None  # fmt: skip
        scores = _scores(trace)
        answer_field = task.data.get("answer")
        expected = None if answer_field is None else str(answer_field)
        success = trace.reward >= self.config.success_reward
        return Verdict(success=success, reward=trace.reward, expected=expected, detail=scores)

    def expert_action(self) -> str:
        """`expert_reply` filled in with the task's data."""
        assert self.task is not None
        if self.config.expert_reply is None:
            raise NotImplementedError("Verifiers-v0 has no expert without expert_reply")
        return self._format_expert(self.task.data)

    def _format_expert(self, data: dict[str, Any]) -> str:
        try:
            return str(self.config.expert_reply).format(**data)
        except (KeyError, IndexError) as error:
            raise ValueError(f"expert_reply {self.config.expert_reply!r} names {error}, which the "
                             f"task data lacks; it has {', '.join(data)}") from None  # fmt: skip
