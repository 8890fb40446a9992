"""Text environments: gymnasium envs whose observations are chat messages and actions are text.

`TextEnv` is the contract the rollout relies on. `reset(seed=)` returns the prompt (a system and a
user message); `step(action)` takes the assistant's text for one turn and returns the new messages
(tool results; nothing after a final answer), the reward, `terminated`, `truncated` and an info
dict whose `STEP_INFO_KEY` entry is a typed `StepInfo` (read it with `read_step_info`).

`ToolEnv` adds tools: a new environment is a task generator, a list of `@tool` functions and a
verifier. Where we depart from common practice:

- Reward is the verifier's reward at the end and 0.0 on every other step, including at truncation
  (no shaping, no partial credit for tool use); extra reward sources live in `agent_grpo.rewards`.
- A turn with no tool call is the final answer; there is no `answer` tool. A turn with a
  malformed call (bad JSON, unknown tool, bad arguments) is not a final answer: under the
  `feedback` policy (default) the model gets an `Error: ...` tool message and another turn; under
  `terminate` it gets the same messages (the turn's valid calls still run) but the episode ends
  with `malformed_penalty`. A tool that raises or times out is not malformed: its `Error: ...`
  message comes back under both policies and the episode goes on. A tool message carries `name`
  only when it is one of the env's tools: a name the model made up never reaches the template.
- A task is drawn from `np.random.default_rng(task_seed)`, not from the env's running generator,
  so a task id `{env_id}:{seed}` alone reproduces the task; `reset()` without a seed draws the
  task seed from the env's generator (within `TRAIN_SEEDS`).
- Seeds are split by range: `TRAIN_SEEDS` for training (`train_seeds(n, rng)`) and
  `HELDOUT_SEEDS` for evaluation (`heldout_seeds(n)`). `self.split` is set before `generate_task`,
  so an env with a small task space can draw held-out tasks from a disjoint pool (Search-v0
  holds out people).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Generic, Literal, TypeVar

import gymnasium as gym
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from agent_grpo.tools.formats import (
    HermesToolCallFormat,
    ParsedToolCall,
    ToolCallFormat,
    ToolCallParseError,
    after_reasoning,
    get_tool_format,
    parse_tool_calls,
)
from agent_grpo.tools.tool import Tool, format_tool_result, run_tool_call
from agent_grpo.trajectory.record import Message, Termination, ToolCallRecord

__all__ = [
    "HELDOUT_SEEDS",
    "STATE_KEY",
    "STEP_INFO_KEY",
    "TRAIN_SEEDS",
    "TURN_REWARD_KEY",
    "ExpertEpisode",
    "MessagesSpace",
    "StepInfo",
    "TextEnv",
    "TextSpace",
    "ToolEnv",
    "TurnOutcome",
    "Verdict",
    "as_tool_format",
    "heldout_seeds",
    "read_state",
    "read_step_info",
    "read_turn_reward",
    "render_call",
    "run_expert",
    "split_of",
    "train_seeds",
]

Messages = list[dict[str, str]]
Split = Literal["train", "heldout"]
MalformedPolicy = Literal["feedback", "terminate"]
TaskT = TypeVar("TaskT")

TRAIN_SEEDS = range(0, 1_000_000_000)
"""Seeds for training tasks."""
HELDOUT_SEEDS = range(1_000_000_000, 1_001_000_000)
"""Seeds for evaluation tasks; never used for training."""
STEP_INFO_KEY = "agent_grpo"
"""The key of `step()`'s info dict that holds the `StepInfo`."""
STATE_KEY = "state"
"""Optional key of `reset()`'s and `step()`'s info: the state the next turn starts from, as
text (turn-level credit groups turns by it; `agent_grpo.algo.turn_credit`)."""
TURN_REWARD_KEY = "turn_reward"
"""Optional key of `step()`'s info: the reward of that turn alone (a finite number)."""
ROLES = ("system", "user", "assistant", "tool")
"""Message roles an observation may hold."""


def split_of(seed: int) -> Split:
    """Which split a task seed belongs to."""
    return "heldout" if seed in HELDOUT_SEEDS else "train"


def train_seeds(n: int, rng: random.Random | None = None) -> list[int]:
    """`n` distinct training seeds drawn with `rng` (a fixed generator when None)."""
    return (rng or random.Random(0)).sample(TRAIN_SEEDS, n)


def heldout_seeds(n: int, start: int = 0) -> list[int]:
    """The `n` held-out seeds from index `start` on: the evaluation tasks, the same every run."""
    if start + n > len(HELDOUT_SEEDS):
        raise ValueError(f"only {len(HELDOUT_SEEDS)} held-out seeds exist")
    return list(HELDOUT_SEEDS[start : start + n])


class TextSpace(gym.Space[str]):
    """Any string of at most `max_length` characters (an assistant turn)."""

    _SAMPLE_CHARS = np.array(list("abcdefghijklmnopqrstuvwxyz0123456789 "))

    def __init__(self, max_length: int = 1_000_000, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_length = max_length

    @property
    def is_np_flattenable(self) -> bool:
        """Text has no flat numeric form."""
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        """Random lowercase text of up to 32 characters (never a tool call)."""
        n = int(self.np_random.integers(0, 33))
        return "".join(self.np_random.choice(self._SAMPLE_CHARS, size=n))

    def contains(self, x: Any) -> bool:
        """Whether `x` is a string no longer than `max_length`."""
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TextSpace) and other.max_length == self.max_length


class MessagesSpace(gym.Space[Messages]):
    """Lists of chat messages: dicts with `role` and `content`, and optionally `name`."""

    def __init__(self, text: TextSpace | None = None, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.text = text or TextSpace()

    @property
    def is_np_flattenable(self) -> bool:
        """Messages have no flat numeric form."""
        return False

    def sample(self, mask: Any = None, probability: Any = None) -> Messages:
        """Up to three random messages with random roles."""
        self.text.seed(int(self.np_random.integers(2**31)))
        n = int(self.np_random.integers(0, 4))
        return [
            {"role": str(self.np_random.choice(ROLES)), "content": self.text.sample()}
            for _ in range(n)
        ]

    def contains(self, x: Any) -> bool:
        """Whether `x` is a list of well-formed message dicts."""
        return isinstance(x, list) and all(self._is_message(m) for m in x)

    def _is_message(self, m: Any) -> bool:
        return (
            isinstance(m, dict)
            and {"role", "content"} <= m.keys() <= {"role", "content", "name"}
            and m["role"] in ROLES
            and m["content"] in self.text
            and isinstance(m.get("name", ""), str)
        )

    def __repr__(self) -> str:
        return f"MessagesSpace({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MessagesSpace) and other.text == self.text


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class Verdict(_Model):
    """What a verifier concluded about a final answer."""

    success: bool
    """Whether the task is solved."""
    reward: float = 0.0
    """Reward for the episode; defaults to 1.0 on success and 0.0 otherwise."""
    expected: str | None = None
    """The reference answer, for logs."""
    given: str | None = None
    """The answer extracted from the model's text (None when none could be extracted)."""
    detail: str = ""
    """Why, in words, for failures."""

    @model_validator(mode="before")
    @classmethod
    def _default_reward(cls, data: Any) -> Any:
        if isinstance(data, dict) and "reward" not in data:
            return {**data, "reward": float(bool(data.get("success")))}
        return data


class StepInfo(_Model):
    """What one `step()` did, for the rollout: stored in `info[STEP_INFO_KEY]`."""

    turn: int
    """0-based index of the assistant turn this step consumed."""
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    """Tool calls of this turn, in order, with results or errors (malformed ones included)."""
    malformed_tool_calls: int = 0
    """Calls of this turn that failed to parse or validate."""
    malformed_tool_calls_total: int = 0
    """Malformed calls in the whole trajectory so far."""
    final_answer: str | None = None
    """The turn's text when it was the final answer."""
    verifier: dict[str, Any] | None = None
    """The `Verdict` as a dict when the answer was verified, else None."""
    success: bool | None = None
    """Whether the task was solved; None while the episode goes on."""
    end_reason: str | None = None
    """Why the episode ended (`final_answer`, `malformed_tool_call`, `max_turns`); None if not."""


def read_state(info: Mapping[str, Any]) -> str | None:
    """The state an env names in `info[STATE_KEY]`, or None; anything but text is a TypeError
    naming the key."""
    value = info.get(STATE_KEY)
    if value is not None and not isinstance(value, str):
        raise TypeError(f"info[{STATE_KEY!r}] must be text (the state's name), got {value!r}")
    return value


def read_turn_reward(info: Mapping[str, Any]) -> float:
    """The turn's own reward, `info[TURN_REWARD_KEY]` (0 when absent); anything but a finite
    number is a TypeError naming the key."""
    value = info.get(TURN_REWARD_KEY, 0.0)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TypeError(f"info[{TURN_REWARD_KEY!r}] must be a finite number, got {value!r}")
    return float(value)


def read_step_info(info: Mapping[str, Any]) -> StepInfo:
    """Read the `StepInfo` back from a `step()` info dict (also after it went through JSON)."""
    value = info[STEP_INFO_KEY]
    return value if isinstance(value, StepInfo) else StepInfo.model_validate(value)


class TurnOutcome(_Model):
    """How an environment reacts to one assistant turn (what `TextEnv.respond` returns)."""

    observations: list[dict[str, str]] = Field(default_factory=list)
    """Messages sent back (tool results or errors)."""
    final_answer: str | None = None
    """Set when the turn is the final answer: the episode ends and this text is verified."""
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    """The turn's tool calls."""
    malformed_tool_calls: int = 0
    """How many of them failed to parse or validate."""
    penalty: float | None = None
    """Set to end the episode now, unverified, with this reward."""


class TextEnv(gym.Env[Messages, str], Generic[TaskT]):
    """A chat environment: subclasses write `generate_task`, `user_prompt` and `verify`."""

    metadata = {"render_modes": []}
    system_prompt: str = ""
    """The system message (ToolEnv appends the tool list)."""
    default_max_turns: ClassVar[int] = 1
    """Assistant turns before truncation when the constructor is not given `max_turns`."""
    file_kwargs: ClassVar[tuple[str, ...]] = ()
    """Constructor arguments that name files (a name, a list of names, or a dict of either): in
    a config file, a relative name is also looked up beside the file (`load_config`)."""
    concurrent_reset: bool = False
    """Whether a rollout may construct and reset instances of this env at once, in threads (after
    one alone): for envs whose reset waits on something of its own, such as a server starting
    (Notes-v0's MCP server). Off by default: a reset that touches state shared across instances
    (a generator library's globals) would no longer be a function of its seed."""
    reusable: bool = False
    """Whether a rollout may reset an instance for a later episode instead of building a new one
    (`agent_grpo/rollout/env_pool.py`): for envs whose reset starts the episode over completely,
    server and files included, so that a used instance and a new one play the same episode
    for a seed. Off by default: an env whose reset leaves state behind would hand the next
    episode a wrong start with no error. The built-ins that set it are checked by
    `tests/envs/test_reuse.py`."""

    def __init__(self, max_turns: int | None = None, render_mode: str | None = None) -> None:
        if render_mode is not None:
            raise ValueError("text environments have no render modes")
        self.max_turns = self.default_max_turns if max_turns is None else max_turns
        if not isinstance(self.max_turns, int) or isinstance(self.max_turns, bool):
            raise ValueError(f"max_turns must be a whole number, got {self.max_turns!r}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {self.max_turns}")
        self.observation_space = MessagesSpace()
        self.action_space = TextSpace()
        self.task: TaskT | None = None
        self.task_seed = -1
        self.split: Split = "train"
        self.turn = 0
        self.conversation: Messages = []
        self.tool_calls: list[ToolCallRecord] = []
        self.malformed_tool_calls = 0
        self._done = True

    def generate_task(self, rng: np.random.Generator) -> TaskT:
        """Draw a task; `self.split` says whether it is a training or held-out one."""
        raise NotImplementedError

    def user_prompt(self, task: TaskT) -> str:
        """The user message that states `task`."""
        raise NotImplementedError

    def verify(self, task: TaskT, answer: str) -> Verdict:
        """Judge the final answer `answer` (the whole text of the last turn)."""
        raise NotImplementedError

    def expert_action(self) -> str:
        """The scripted expert's next turn, from `self.task` and what happened so far."""
        raise NotImplementedError(f"{type(self).__name__} has no expert policy")

    def respond(self, action: str) -> TurnOutcome:
        """React to one assistant turn; the plain text env treats every turn as the answer."""
        return TurnOutcome(final_answer=action)

    def render_system_prompt(self) -> str:
        """The system message text."""
        return self.system_prompt

    @property
    def stop_strings(self) -> list[str]:
        """Strings that end an assistant turn, for samplers."""
        return []

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Messages, dict[str, Any]]:
        """Start an episode on the task of `seed`; returns the system and user messages."""
        super().reset(seed=seed)
        if seed is None:
            seed = int(self.np_random.integers(TRAIN_SEEDS.start, TRAIN_SEEDS.stop))
        self.task_seed, self.split = seed, split_of(seed)
        self.task = self.generate_task(np.random.default_rng(seed))
        self.turn, self.tool_calls, self.malformed_tool_calls, self._done = 0, [], 0, False
        self.conversation = self.opening_messages(self.task)
        return copy.deepcopy(self.conversation), {"seed": seed, "split": self.split}

    def opening_messages(self, task: TaskT) -> Messages:
        """The episode's first messages: the system prompt, then `user_prompt(task)`."""
        return [
            {"role": "system", "content": self.render_system_prompt()},
            {"role": "user", "content": self.user_prompt(task)},
        ]

    def step(self, action: str) -> tuple[Messages, float, bool, bool, dict[str, Any]]:
        """Take one assistant turn; see the module docstring for reward and termination."""
        if self._done:
            raise RuntimeError("the episode is over (or never started): call reset() first")
        self.conversation.append({"role": "assistant", "content": action})
        outcome = self.respond(action)
        self.tool_calls.extend(outcome.tool_calls)
        self.malformed_tool_calls += outcome.malformed_tool_calls
        self.conversation.extend(copy.deepcopy(outcome.observations))
        reward, terminated, truncated, info = self._conclude(outcome)
        self.turn += 1
        self._done = terminated or truncated
        return (
            copy.deepcopy(outcome.observations),
            reward,
            terminated,
            truncated,
            {STEP_INFO_KEY: info},
        )

    def _conclude(self, outcome: TurnOutcome) -> tuple[float, bool, bool, StepInfo]:
        info = StepInfo(
            turn=self.turn,
            tool_calls=outcome.tool_calls,
            malformed_tool_calls=outcome.malformed_tool_calls,
            malformed_tool_calls_total=self.malformed_tool_calls,
        )
        if outcome.final_answer is not None:
            assert self.task is not None
            verdict = self.verify(self.task, outcome.final_answer)
            info.final_answer, info.verifier = outcome.final_answer, verdict.model_dump()
            info.success = verdict.success
            info.end_reason = "final_answer"
            return verdict.reward, True, False, info
        if outcome.penalty is not None:
            info.success = False
            info.end_reason = "malformed_tool_call"
            return outcome.penalty, True, False, info
        if self.turn + 1 >= self.max_turns:
            info.success = False
            info.end_reason = "max_turns"
            return 0.0, False, True, info
        return 0.0, False, False, info


class ToolEnv(TextEnv[TaskT]):
    """A tool-using environment: `tools`, a task generator and a verifier make a new one."""

    tools: Sequence[Tool] = ()
    """The tools the model may call (a class attribute, or set in `__init__`)."""
    default_max_turns: ClassVar[int] = 4

    def __init__(
        self,
        max_turns: int | None = None,
        malformed_policy: MalformedPolicy = "feedback",
        malformed_penalty: float = -1.0,
        tool_call_format: ToolCallFormat | str | None = None,
        render_mode: str | None = None,
        max_tool_calls_per_turn: int = 8,
    ) -> None:
        super().__init__(max_turns=max_turns, render_mode=render_mode)
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        if malformed_policy not in ("feedback", "terminate"):
            raise ValueError(f"malformed_policy must be feedback or terminate: {malformed_policy}")
        self.malformed_policy: MalformedPolicy = malformed_policy
        self.malformed_penalty = malformed_penalty
        self.tool_call_format: ToolCallFormat = as_tool_format(tool_call_format)

    @property
    def tool_map(self) -> dict[str, Tool]:
        """Tools by name."""
        return {t.name: t for t in self.tools}

    @property
    def stop_strings(self) -> list[str]:
        """The tool-call format's stop strings."""
        return list(self.tool_call_format.stop_strings)

    def render_system_prompt(self) -> str:
        """The system prompt followed by the tool list in the call format's words."""
        return self.with_tool_list(self.system_prompt)

    def with_tool_list(self, prompt: str) -> str:
        """`prompt` followed by the tool list in the call format's words."""
        schemas = [t.json_schema() for t in self.tools]
        return f"{prompt}\n\n{self.tool_call_format.render_tools(schemas)}"

    def call(self, name: str, **arguments: Any) -> str:
        """The text of one tool call in this env's format (for expert policies)."""
        return render_call(self.tool_call_format, name, arguments)

    def respond(self, action: str) -> TurnOutcome:
        """Run the turn's tool calls (those after its reasoning: `after_reasoning`), or treat a
        turn without one as the final answer (its whole text)."""
        calls = parse_tool_calls(after_reasoning(action), self.tool_map, fmt=self.tool_call_format)
        if not calls:
            return TurnOutcome(final_answer=action)
        # Past the cap, calls are answered with an error instead of run: a turn of 500 `python`
        # calls must not start 500 sandboxes.
        cap = self.max_tool_calls_per_turn
        records = [self._run(c) for c in calls[:cap]] + [_over_cap(c, cap) for c in calls[cap:]]
        malformed = sum(isinstance(call, ToolCallParseError) for call in calls)
        terminate = malformed > 0 and self.malformed_policy == "terminate"
        return TurnOutcome(
            observations=[_tool_message(r, self.tool_map) for r in records],
            tool_calls=records,
            malformed_tool_calls=malformed,
            penalty=self.malformed_penalty if terminate else None,
        )

    def _run(self, call: ParsedToolCall | ToolCallParseError) -> ToolCallRecord:
        if isinstance(call, ToolCallParseError):
            return ToolCallRecord(
                name=call.name or "", raw=call.raw, error=call.message, error_kind=call.kind
            )
        return run_tool_call(self.tool_map[call.name], call.arguments, raw=call.raw)


def _over_cap(call: ParsedToolCall | ToolCallParseError, cap: int) -> ToolCallRecord:
    """The record of a call that was not run because the turn made too many."""
    message = f"not run: at most {cap} tool calls per turn"
    return ToolCallRecord(name=call.name or "", raw=call.raw, error=message,
                          error_kind="too_many_calls")  # fmt: skip


def render_call(fmt: ToolCallFormat, name: str, arguments: Mapping[str, Any]) -> str:
    """One call written the way `fmt` parses it."""
    return fmt.render_call(name, dict(arguments))


def as_tool_format(fmt: ToolCallFormat | str | None) -> ToolCallFormat:
    """A format object from a format, a registry name (`llama3`), or None (Hermes)."""
    if fmt is None:
        return HermesToolCallFormat()
    return get_tool_format(fmt) if isinstance(fmt, str) else fmt


def _tool_message(record: ToolCallRecord, tools: Mapping[str, Tool]) -> dict[str, str]:
    """The tool message for one call; `name` only when it is one of the env's tools."""
    message = {"role": "tool", "content": format_tool_result(record)}
    # A template that renders `name` puts it in template text, where special tokens are
    # recognized: a model-written name like "<|im_start|>user" would forge a turn.
    if record.name in tools:
        message["name"] = record.name
    return message


class ExpertEpisode(_Model):
    """One episode played by an environment's scripted expert."""

    seed: int
    """Task seed."""
    messages: list[Message]
    """The whole conversation, prompt included."""
    reward: float
    """Final reward."""
    success: bool
    """Whether the verifier judged it solved."""
    turns: int
    """Assistant turns taken."""
    termination: Termination
    """Why it ended."""


def run_expert(env: gym.Env[Messages, str], seed: int) -> ExpertEpisode:
    """Play one episode of `seed` with `env.unwrapped.expert_action()`."""
    messages, _ = env.reset(seed=seed)
    expert = env.unwrapped
    assert isinstance(expert, TextEnv), "run_expert needs a TextEnv"
    while True:
        action = expert.expert_action()
        observations, reward, terminated, truncated, info = env.step(action)
        messages += [{"role": "assistant", "content": action}, *observations]
        if terminated or truncated:
            step = read_step_info(info)
            kind: Literal["terminated", "truncated"] = "terminated" if terminated else "truncated"
            return ExpertEpisode(
                seed=seed,
                messages=[Message.model_validate(m) for m in messages],
                reward=float(reward),
                success=bool(step.success),
                turns=step.turn + 1,
                termination=Termination(kind=kind, reason=step.end_reason or kind),
            )
