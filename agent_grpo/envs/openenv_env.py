"""OpenEnv-v0: an environment of OpenEnv (the `openenv` package) as a text environment.

`env.kwargs: {environment: my_env.server.my_environment:MyEnvironment}` runs an OpenEnv
`Environment` in this process: the object its FastAPI app serves, called as the server calls it
(no Docker). `{base_url: http://localhost:8000}` talks to a server already running, through
OpenEnv's own `GenericEnvClient` (one WebSocket session per env), so the env's client package is
not needed. With neither, it runs `openenv_guess.GuessNumberEnvironment`. The model's turn
becomes the env's Action in one of two ways, chosen by `action_field`:

- `action_field: message` (text mode, for envs whose Action is a message): the turn's whole text
  is that field of the Action, each turn is one `step`, and the env answers in a user message.
- no `action_field` (tool mode, for Actions with typed fields): the Action's fields but `metadata`
  are the arguments of one tool, `act`, validated by the Action's own constraints; each call is
  one `step`, answered in the tool message. The Action class is read from the Environment's `step`
  annotation, or named by `action: module:Class` (a server's, which we do not import otherwise).

The reset observation is the user message. An observation's text is its `observation_field`, its
only field, or else its fields as JSON. An action the env rejects (the Action's validation, or its
`step` raising, on either end of the wire) is answered `Error: ...` and the episode goes on.

Where we depart from OpenEnv (and from TextEnv's 0.0 at truncation): its per-step rewards are
summed and paid on the last step, since our rollout keeps only that one, at `max_turns`
truncation too (many OpenEnv envs end only by a limit); success is a sum of at least
`success_reward`. In tool mode a turn without a call also ends the episode (our final-answer
rule), besides the env's `done`. The task seed is OpenEnv's reset `seed` (dropped when `reset`
takes none), so the env must draw its episode from it for the members of a GRPO group to share
one task. An observation's `metadata` is not shown (OpenEnv's server does not send it either).
MCP environments (`CallToolAction`) are not mapped.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import typing
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from pydantic_core import to_jsonable_python

from agent_grpo.envs.text_env import Messages, ToolEnv, TurnOutcome, Verdict
from agent_grpo.tools.tool import Tool

__all__ = ["ActionRejected", "OpenEnvEnv", "OpenEnvTask", "observation_text"]

DEFAULT_ENVIRONMENT = "agent_grpo.envs.openenv_guess:GuessNumberEnvironment"
TEXT_PROMPT = "You act in an environment: each reply of yours is your next action."
TOOL_PROMPT = ("You act in an environment with the act tool: each call is one action, answered "
               "by the environment. A reply without a tool call ends the episode.")  # fmt: skip


class OpenEnvTask(BaseModel):
    """One episode's start: OpenEnv's reset seed and first observation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int
    """The seed the OpenEnv env was reset with (the episode's task seed)."""
    observation: str
    """The reset observation as text: the user message."""


class ActionRejected(ValueError):
    """The OpenEnv env refused an action (its Action's validation, or its `step` raised)."""


class Session(Protocol):
    """Where OpenEnv's `reset` and `step` run; both return OpenEnv's `StepResult`."""

    def reset(self, seed: int) -> Any: ...
    def step(self, action: dict[str, Any]) -> Any: ...
    def close(self) -> None: ...


class InProcessSession:
    """An OpenEnv `Environment` object, called as its server would call it."""

    def __init__(
        self, env_cls: type[Any], kwargs: dict[str, Any], action_cls: type[BaseModel]
    ) -> None:
        try:
            self.environment = env_cls(**kwargs)
        except TypeError as error:  # a wrong environment_kwargs: one line, not a traceback
            raise ValueError(f"OpenEnv-v0 environment_kwargs {kwargs}: {error}") from None
        self.action_cls = action_cls

    def reset(self, seed: int) -> Any:
        """OpenEnv's reset, with `seed` only if the env's `reset` takes one (as its server does)."""
        from openenv.core.client_types import StepResult
        from openenv.core.env_server.serialization import serialize_observation

        observation = self.environment.reset(**accepted(self.environment.reset, seed=seed))
        return StepResult(**serialize_observation(observation))

    def step(self, action: dict[str, Any]) -> Any:
        """One step; anything the Action or the env's `step` raises is the env's refusal."""
        from openenv.core.client_types import StepResult
        from openenv.core.env_server.serialization import serialize_observation

        try:
            observation = self.environment.step(self.action_cls.model_validate(action))
        except Exception as error:  # the env's own code: OpenEnv names no refusal type
            raise ActionRejected(one_line(error)) from None
        return StepResult(**serialize_observation(observation))

    def close(self) -> None:
        """Let the env free what it holds."""
        self.environment.close()


class RemoteSession:
    """A running OpenEnv server, through OpenEnv's `GenericEnvClient` (WebSocket, dicts)."""

    def __init__(self, base_url: str, action_cls: type[BaseModel] | None = None) -> None:
        from openenv.core.generic_client import GenericEnvClient

        self.action_cls = action_cls
        self.client = GenericEnvClient(base_url=base_url).sync()
        try:
            self.client.connect()
        except ConnectionError as error:
            self.client.close()
            raise ConnectionError(f"OpenEnv-v0: no OpenEnv server at {base_url}: "
                                  f"{one_line(error)}") from None  # fmt: skip

    def reset(self, seed: int) -> Any:
        """The server's reset of this session (it drops `seed` if the env takes none)."""
        return self.client.reset(seed=seed)

    def step(self, action: dict[str, Any]) -> Any:
        """One step; the server's error reply (RuntimeError) is the env's refusal."""
        try:
            if self.action_cls is not None:  # here, an invalid one is refused with its field named
                self.action_cls.model_validate(action)
            return self.client.step(to_jsonable_python(action))  # a field may be a model
        except (RuntimeError, ValidationError) as error:  # a lost connection propagates
            raise ActionRejected(one_line(error)) from None

    def close(self) -> None:
        """End the session and the client's event loop."""
        self.client.close()


class OpenEnvEnv(ToolEnv[OpenEnvTask]):
    """An OpenEnv environment, in process or on a server; its summed rewards are the reward."""

    default_max_turns = 8

    def __init__(
        self,
        environment: str | None = None,
        base_url: str | None = None,
        action: str | None = None,
        action_field: str | None = None,
        observation_field: str | None = None,
        environment_kwargs: dict[str, Any] | None = None,
        system_prompt: str | None = None,
        success_reward: float = 1.0,
        step_timeout_s: float = 60.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if importlib.util.find_spec("openenv") is None:
            raise ImportError("OpenEnv-v0 needs openenv: pip install 'agent-grpo[openenv]'")
        if environment is not None and base_url is not None:
            raise ValueError("OpenEnv-v0 takes environment= (in process) or base_url= (a "
                             "running server), not both")  # fmt: skip
        env_cls = None if base_url else environment_class(environment or DEFAULT_ENVIRONMENT)
        action_cls = action_class(action, env_cls)
        check_action(action_cls, action_field, needed=env_cls is not None or not action_field)
        self.action_field, self.observation_field = action_field, observation_field
        self.success_reward = success_reward
        self.system_prompt = system_prompt or (TEXT_PROMPT if action_field else TOOL_PROMPT)
        if action_field is None:
            assert action_cls is not None  # check_action insists on it
            self.tools = [act_tool(action_cls, self._act, step_timeout_s)]
        self.session: Session
        if env_cls is None:
            self.session = RemoteSession(str(base_url), action_cls)
        else:
            assert action_cls is not None  # check_action insists on it in process
            self.session = InProcessSession(env_cls, environment_kwargs or {}, action_cls)
        self.episode_return, self.env_done = 0.0, True

    def render_system_prompt(self) -> str:
        """The system prompt, with the tool list in tool mode."""
        return super().render_system_prompt() if self.tools else self.system_prompt

    @property
    def stop_strings(self) -> list[str]:
        """The tool-call format's stop strings in tool mode; none in text mode."""
        return super().stop_strings if self.tools else []

    def generate_task(self, rng: np.random.Generator) -> OpenEnvTask:
        """Reset the OpenEnv env with this episode's seed: its first observation is the task."""
        del rng  # the OpenEnv env draws its episode itself, from the seed
        result = self.session.reset(self.task_seed)
        self.episode_return, self.env_done = 0.0, bool(result.done)
        text = observation_text(result.observation, self.observation_field)
        return OpenEnvTask(seed=self.task_seed, observation=text)

    def user_prompt(self, task: OpenEnvTask) -> str:
        """The reset observation."""
        return task.observation

    def respond(self, action: str) -> TurnOutcome:
        """Text mode: the turn is one step. Tool mode: each `act` call is one (ToolEnv's)."""
        if self.action_field is None:
            outcome = super().respond(action)
        else:
            try:
                reply = self._act(**{self.action_field: action})
            except ActionRejected as error:
                reply = f"Error: the environment rejected the action: {error}"
            outcome = TurnOutcome(observations=[{"role": "user", "content": reply}])
        if self.env_done:  # the env ended the episode: verify() pays its rewards
            outcome.final_answer = action
        return outcome

    def _act(self, **fields: Any) -> str:
        """One OpenEnv step: the observation's text; ActionRejected if the env refuses."""
        if self.env_done:
            raise ActionRejected("the environment's episode is over")
        result = self.session.step(fields)
        self.episode_return += float(result.reward or 0.0)
        self.env_done = bool(result.done)
        return observation_text(result.observation, self.observation_field)

    def verify(self, task: OpenEnvTask, answer: str) -> Verdict:
        """The env's rewards summed; success when they reach `success_reward`."""
        del task, answer  # the env has judged every action already
        total, solved = self.episode_return, self.episode_return >= self.success_reward
        return Verdict(success=solved, reward=total,
                       detail="" if solved else f"the env's rewards sum to {total:g}")  # fmt: skip

    def step(self, action: str) -> tuple[Messages, float, bool, bool, dict[str, Any]]:
        """TextEnv's step, except that a truncated episode keeps the env's summed rewards."""
        observations, reward, terminated, truncated, info = super().step(action)
        reward = self.episode_return if truncated else reward
        return observations, reward, terminated, truncated, info

    def close(self) -> None:
        """End the OpenEnv session."""
        self.session.close()
        super().close()


def observation_text(observation: dict[str, Any], field: str | None = None) -> str:
    """An observation's words: `field`, its only field, or else all its fields as JSON."""
    if field is None and len(observation) == 1:
        (field,) = observation
    if field is None:
        return json.dumps(observation, ensure_ascii=False, default=str)
    if field not in observation:
        raise ValueError(f"OpenEnv-v0: the observation has no field {field!r}; its fields: "
                         f"{', '.join(observation) or 'none'}")  # fmt: skip
    value = observation[field]
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def act_tool(action_cls: type[BaseModel], act: Callable[..., str], timeout_s: float) -> Tool:
    """The `act` tool: the Action's fields but `metadata` (OpenEnv's, not the agent's) as its
    arguments, with the Action's own constraints and descriptions."""
    fields: Any = {n: (f.annotation, f) for n, f in action_cls.model_fields.items()
                   if n != "metadata"}  # fmt: skip
    arguments = create_model(f"{action_cls.__name__}Arguments",
                             __config__=ConfigDict(extra="forbid"), **fields)  # fmt: skip
    description = (inspect.getdoc(action_cls) or "").split("\n\n")[0] or "Act in the environment."
    return Tool(name="act", description=description, args_model=arguments, fn=act,
                is_async=False, timeout_s=timeout_s, max_output_chars=16_000)  # fmt: skip


def environment_class(path: str) -> type[Any]:
    """The OpenEnv `Environment` subclass at `module:Class`."""
    from openenv.core.env_server.interfaces import Environment

    found = load(path, "environment")
    if not (isinstance(found, type) and issubclass(found, Environment)):
        raise ValueError(f"OpenEnv-v0 environment={path!r} is not an OpenEnv Environment class")
    return found


def action_class(path: str | None, env_cls: type[Any] | None) -> type[BaseModel] | None:
    """The Action class: named by `path`, else the one the Environment's `step` is annotated
    with (None when neither says: the base Action has no field to fill)."""
    from openenv.core.env_server.types import Action

    if path is not None:
        found = load(path, "action")
        if not (isinstance(found, type) and issubclass(found, Action)):
            raise ValueError(f"OpenEnv-v0 action={path!r} is not an OpenEnv Action class")
        return found
    try:
        found = typing.get_type_hints(env_cls.step).get("action") if env_cls else None
    except Exception:  # annotations that do not resolve here: the user can name the class
        return None
    usable = isinstance(found, type) and issubclass(found, Action) and found is not Action
    return found if usable else None


def check_action(action_cls: type[BaseModel] | None, field: str | None, needed: bool) -> None:
    """ValueError in one line if the Action class is missing where it is needed, or lacks
    `field`."""
    if action_cls is None and needed:
        why = "its step() is not annotated with one" if field else "tool mode needs its fields"
        raise ValueError(f"OpenEnv-v0 needs the env's Action class, action='module:Class': {why}")
    if action_cls is not None and field is not None and field not in action_cls.model_fields:
        raise ValueError(f"OpenEnv-v0: {action_cls.__name__} has no field {field!r}; its "
                         f"fields: {', '.join(action_cls.model_fields)}")  # fmt: skip


def load(path: str, what: str) -> Any:
    """The object at `module:Name`; ValueError in one line naming `what` if there is none."""
    module, _, name = path.partition(":")
    try:
        if not name:
            raise ValueError("expected module:Class")
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"OpenEnv-v0 {what}={path!r}: {error}") from None


def accepted(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments `fn` takes (OpenEnv's server passes a `reset` only those too)."""
    parameters = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in {p.name for p in parameters}}


def one_line(error: BaseException) -> str:
    """An exception's message on one line; a pydantic one as `field: problem; ...`."""
    if isinstance(error, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'action'}: {e['msg']}"
                         for e in error.errors())  # fmt: skip
    return " ".join(str(error).split())
