"""BFCL-v0: the Berkeley Function Calling Leaderboard's v4 multi-turn tasks, scored by its checker.

A task is one of BFCL's 200 `multi_turn_base` entries (`agent_grpo.envs.bfcl_tasks`): one to seven
user turns over its pure-Python backends (a file system, a trading bot, a vehicle, ...). The
system prompt holds the involved classes' function docs as tool schemas in the env's tool-call
format; the first user message is the first turn's question. Each call the model makes is run on
the episode's backend instances by BFCL's own `execute_multi_turn_func_call`, and its result is
the tool message. A turn without a call ends the user turn: the next user message is the
observation, and after the last one the episode ends and BFCL's `multi_turn_checker` re-executes
the model's calls and the ground truth on fresh instances, comparing state and results turn by
turn. The reward is 1 when it accepts every turn, else 0, so the success rate over all 200 tasks
is BFCL's multi-turn accuracy (correct entries / entries).

Where we depart from BFCL's inference loop (`BaseHandler.inference_multi_turn_FC`):

- Calls are read by our tool-call formats, not by a vendor API or BFCL's prompt decoders. A call
  that does not parse, names no function of the task, or has an unknown or missing argument
  comes back as an `Error:` tool message (as in every ToolEnv) and is not executed: in BFCL such
  a call changes no state either (Python refuses it), and BFCL ends the user turn at a step that
  does not parse, where we let the model try again. Argument types are not checked: BFCL runs
  whatever was decoded, and a wrongly typed value can still work on its backends.
- BFCL gives up on an entry after 20 steps in one user turn; we bound the whole episode by
  `max_turns` assistant turns, and a truncated episode scores 0, as BFCL's force-quit does.
- Held-out seeds walk the held-out tasks in order (every `heldout_every`-th entry) and training
  seeds draw from the rest. `heldout_every: 1` holds out all 200, which is BFCL's benchmark;
  there training seeds draw from the same 200, so that setting is for `agent-grpo eval` only.
- BFCL keeps backend instances in `multi_turn_utils`' module globals, keyed by model name and
  entry id. Each episode and each check here uses a fresh unique name and removes its instances
  afterwards, so tasks can repeat in one process and memory does not grow.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from typing import Any, ClassVar

import numpy as np

from agent_grpo.envs.bfcl_tasks import (
    CATEGORY,
    BfclTask,
    bfcl_eval,
    call_string,
    function_docs,
    json_schema_parameters,
    load_tasks,
    parse_call,
)
from agent_grpo.envs.text_env import HELDOUT_SEEDS, ToolEnv, TurnOutcome, Verdict, render_call
from agent_grpo.tools.schema_args import JsonSchemaArgs, schema_args_model, without_titles
from agent_grpo.tools.tool import Tool

__all__ = ["TURN_DONE", "BackendSession", "BfclEnv", "bfcl_verdict", "system_prompt"]

TURN_DONE = "I have completed this request."
"""The expert's turn without a call, which ends a user turn."""
TurnCalls = list[list[list[str]]]
"""Per user turn, per step (assistant turn with calls), the call strings executed."""


def system_prompt() -> str:
    """BFCL's own words for the task and for multi-turn behaviour (its `classic` style), without
    its Python-list call syntax: the tool-call format says how to call."""
    from bfcl_eval.constants.default_prompts import PROMPT_STYLE_TEMPLATES

    style = PROMPT_STYLE_TEMPLATES["classic"]
    return f"{style['persona']} {style['task']}\n\n{style['multiturn_behavior']}"


def _unique_name() -> str:
    """A model name no other episode or check uses (it keys BFCL's backend instances)."""
    return f"agent_grpo_{uuid.uuid4().hex}"


def _forget(name: str) -> None:
    """Remove the backend instances BFCL keeps in its module globals for model name `name`."""
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    prefix = re.sub(r"[-./:]", "_", f"{name}_")  # BFCL's own instance-name rewrite
    for key in [k for k in vars(multi_turn_utils) if k.startswith(prefix)]:
        delattr(multi_turn_utils, key)


class BackendSession:
    """One episode's backend instances: calls run on them in order; `close` removes them."""

    def __init__(self, task: BfclTask) -> None:
        self.task = task
        self.name = _unique_name()

    def execute(self, call: str) -> str:
        """Run one call string with BFCL's `execute_multi_turn_func_call`; its result text."""
        from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils import (
            execute_multi_turn_func_call,
        )

        results, _ = execute_multi_turn_func_call(
            [call], self.task.initial_config, list(self.task.involved_classes), self.name,
            self.task.id,
        )  # fmt: skip
        return str(results[0])

    def close(self) -> None:
        """Drop the instances (a later `execute` starts from the initial state again)."""
        _forget(self.name)


def bfcl_verdict(task: BfclTask, calls: TurnCalls) -> Verdict:
    """BFCL's `multi_turn_checker` on the calls of each turn: success when it accepts all."""
    from bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker import multi_turn_checker

    name = _unique_name()
    truth = [list(turn) for turn in task.ground_truth]
    try:
        result = multi_turn_checker(calls, truth, task.test_entry(), CATEGORY, name)
    except Exception as error:  # its asserts; a verifier must never raise
        result = {"valid": False, "error_type": "checker_raised",
                  "error_message": f"{type(error).__name__}: {error}"}  # fmt: skip
    finally:
        _forget(name)  # its model and ground-truth instances both start with `name`
    detail = "" if result["valid"] else f"{result['error_type']}: {result['error_message']}"
    return Verdict(success=bool(result["valid"]), expected=json.dumps(truth),
                   given=json.dumps(calls), detail=detail)  # fmt: skip


@functools.cache
def _args_model(name: str, parameters: str) -> type[JsonSchemaArgs]:
    """The argument model of one BFCL function (`parameters` as JSON, so it can be cached): it
    shows the whole schema but checks only the argument names. BFCL executes whatever was
    decoded, and a value of the wrong type can still work (its own ground truth passes
    `ticket_id='ticket_001'` to an integer parameter), so types are left to the backend."""
    schema = json_schema_parameters(json.loads(parameters))
    names = {"type": "object", "properties": {k: {} for k in schema.get("properties", {})},
             "required": schema.get("required", [])}  # fmt: skip
    model = schema_args_model(name, names)
    model.shown_schema = without_titles(schema)
    return model


class BfclEnv(ToolEnv[BfclTask]):
    """A BFCL multi-turn entry: call its backends turn by turn; BFCL's checker is the reward."""

    reusable = True  # reset builds a new backend session for the task

    default_max_turns: ClassVar[int] = 40

    def __init__(self, heldout_every: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        bfcl_eval()
        if heldout_every < 1:
            raise ValueError(f"heldout_every must be at least 1, got {heldout_every}")
        self.heldout_every = heldout_every
        self.system_prompt = system_prompt()
        self.session: BackendSession | None = None
        self.turn_calls: TurnCalls = []
        self._step_calls: list[str] = []

    @property
    def user_turn(self) -> int:
        """The index of the user turn the episode is in."""
        return len(self.turn_calls) - 1

    def task_pool(self, split: str) -> list[BfclTask]:
        """The tasks of a split: held-out ones are every `heldout_every`-th entry."""
        tasks = load_tasks()
        if self.heldout_every == 1:
            return list(tasks)
        heldout = split == "heldout"
        return [t for t in tasks if (t.index % self.heldout_every == 0) == heldout]

    def generate_task(self, rng: np.random.Generator) -> BfclTask:
        """The held-out task at this seed's place in `HELDOUT_SEEDS`, or a random training one."""
        pool = self.task_pool(self.split)
        if self.split == "heldout":
            return pool[(self.task_seed - HELDOUT_SEEDS.start) % len(pool)]
        return pool[int(rng.integers(len(pool)))]

    def opening_messages(self, task: BfclTask) -> list[dict[str, str]]:
        """Start the episode's backends and tools, then the system prompt and first question."""
        self.close()
        self.session = BackendSession(task)
        self.turn_calls, self._step_calls = [[]], []
        self.tools = [self._tool(doc) for c in task.involved_classes for doc in function_docs(c)]
        return super().opening_messages(task)

    def _tool(self, doc: dict[str, Any]) -> Tool:
        return Tool(
            name=doc["name"],
            description=doc["description"],
            args_model=_args_model(doc["name"], json.dumps(doc["parameters"])),
            fn=functools.partial(self._execute, doc["name"]),
            is_async=False,
            timeout_s=10.0,
            max_output_chars=8000,
        )

    def _execute(self, function: str, /, **arguments: Any) -> str:
        """Run one validated call on the episode's backends, keeping it for the checker
        (`function` is positional-only: BFCL's `find` has an argument called `name`)."""
        assert self.session is not None
        # BFCL `eval`s this string. It is safe to: the parser has checked the function and the
        # argument names against the task's functions, and the values are JSON values (repr'd).
        call = call_string(function, arguments)
        self._step_calls.append(call)
        return self.session.execute(call)

    def user_prompt(self, task: BfclTask) -> str:
        """The first turn's user message."""
        return task.turns[0]

    def respond(self, action: str) -> TurnOutcome:
        """Run the turn's calls; a turn without one moves to the next user turn, or ends the
        episode after the last."""
        assert self.task is not None
        self._step_calls = []
        outcome = super().respond(action)
        if self._step_calls:
            self.turn_calls[-1].append(self._step_calls)
        if outcome.final_answer is None or self.user_turn + 1 == len(self.task.turns):
            return outcome
        self.turn_calls.append([])
        question = self.task.turns[self.user_turn]
        return TurnOutcome(observations=[{"role": "user", "content": question}])

    def verify(self, task: BfclTask, answer: str) -> Verdict:
        """BFCL's multi-turn checker on every turn's calls (the last turn's text is not read)."""
        del answer  # BFCL scores the calls and the state they leave, not the words
        return bfcl_verdict(task, self.turn_calls)

    def expert_action(self) -> str:
        """The ground truth's next call of this user turn, one per step, then `TURN_DONE`."""
        assert self.task is not None
        done = sum(len(step) for step in self.turn_calls[-1])
        truth = self.task.ground_truth[self.user_turn]
        if done >= len(truth):
            return TURN_DONE
        name, arguments = parse_call(truth[done], self.task.involved_classes)
        return render_call(self.tool_call_format, name, arguments)  # `name` may be an argument

    def close(self) -> None:
        """Remove the episode's backend instances."""
        if self.session is not None:
            self.session.close()
            self.session = None
