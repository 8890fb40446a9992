"""Dataset-v0: tasks from the rows of a dataset of prompts and reference answers.

Rows come from a Hugging Face `datasets` dataset (local JSONL, Parquet or CSV files, or a hub id),
with the columns, splits and verifier named in `env.kwargs` (`DatasetEnvConfig`; a wrong name is
a one-line error naming what there is). Without kwargs it is the shipped arithmetic word problems.
A prompt cell is either text (the user message) or, as in TRL's conversational datasets, a list
of `{role, content}` messages ending with a user message (a leading system message replaces
the system prompt; the tool list is still appended). Tools are built-ins, `module:attribute`
paths, and an MCP server's (`mcp_server`, started at the first reset, like Notes-v0's).

A training seed picks a row of the train split with the seed's generator. Held-out seeds walk the
held-out split in order (`heldout_seeds(n)` is its first `n` rows, each once), so `eval.tasks`
set to the split's size evaluates all of it. The scripted expert answers with the reference: it
demonstrates the answer format, not a way to reach it (a regex reference has no expert).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import Field, ValidationError

from agent_grpo.envs.answers import exact_verdict, text_verdict
from agent_grpo.envs.dataset_rows import DatasetSource, DatasetTask, load_tasks
from agent_grpo.envs.math_verdicts import math_verdict, regex_verdict
from agent_grpo.envs.mcp_env import McpWorkspace
from agent_grpo.envs.text_env import HELDOUT_SEEDS, Messages, ToolEnv, Verdict
from agent_grpo.tools.mcp_client import McpServer
from agent_grpo.tools.tool import Tool

__all__ = ["TOOLS", "DatasetEnv", "DatasetEnvConfig", "named_tool"]

TOOLS = {
    "calculator": "agent_grpo.tools.calculator:calculator",
    "python": "agent_grpo.tools.python:python",
}
"""Tools `tools:` may name; any other entry is a `module:attribute` path to a `Tool`."""
_VERIFIERS: dict[str, Callable[[str, str], Verdict]] = {
    "exact": exact_verdict,
    "text": text_verdict,
    "regex": regex_verdict,
}
_TOOL_ENV_KWARGS = set(inspect.signature(ToolEnv.__init__).parameters) - {"self"}


class DatasetEnvConfig(DatasetSource):
    """Dataset-v0's kwargs: where the rows come from (`DatasetSource`), the tools and prompt."""

    tools: list[str] = []
    """Tools the model may call: `calculator`, `python`, or `module:attribute` paths."""
    mcp_server: McpServer | None = None
    """An MCP server whose tools the model may also call (`{command: [...]}` or `{url: ...}`,
    docs/mcp.md); its tool names must differ from `tools`'."""
    system_prompt: str = (
        "Solve the problem. End your reply with the final answer on its own line as: "
        "Answer: <answer>"
    )
    """The system message (the tool list is appended when there are tools)."""
    math_timeout_s: int = Field(default=5, ge=1)
    """math-verify's timeout for each parse and comparison (whole seconds: it uses SIGALRM)."""


def _config(kwargs: dict[str, Any]) -> DatasetEnvConfig:
    """Validate the kwargs, with every problem (and, for an unknown one, the known ones) on one
    line."""
    try:
        config = DatasetEnvConfig.model_validate(kwargs)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        if any(e["type"] == "extra_forbidden" for e in error.errors()):
            known = sorted({*DatasetEnvConfig.model_fields, *_TOOL_ENV_KWARGS})
            problems += f" (known: {', '.join(known)})"
        raise ValueError(f"Dataset-v0 kwargs: {problems}") from None
    # a server's tool names are known once it runs: then this is checked at the first reset
    call = config.expert_call
    if call and call.tool not in config.tools and config.mcp_server is None:
        raise ValueError(f"expert_call tool {call.tool!r} is not in tools")
    return config


def named_tool(name: str) -> Tool:
    """The tool `tools:` names: a built-in (`TOOLS`) or a `module:attribute` path to a `Tool`."""
    module, _, attribute = TOOLS.get(name, name).partition(":")
    if not attribute:
        raise ValueError(f"unknown tool {name!r}: use {', '.join(TOOLS)} or module:attribute")
    found = getattr(importlib.import_module(module), attribute)
    if not isinstance(found, Tool):
        raise ValueError(f"{name!r} is not a Tool (decorate it with @tool)")
    return found


class DatasetEnv(ToolEnv[DatasetTask]):
    """Answer a dataset row's prompt; the verifier compares with the row's reference answer."""

    file_kwargs = ("data_files",)

    def __init__(self, **kwargs: Any) -> None:
        base = {k: kwargs.pop(k) for k in list(kwargs) if k in _TOOL_ENV_KWARGS}
        super().__init__(**base)
        self.config = _config(kwargs)
        if self.config.verifier == "math" and importlib.util.find_spec("math_verify") is None:
            raise ImportError("verifier math needs math-verify: pip install 'agent-grpo[datasets]'")
        self.tasks = load_tasks(self.config)
        self.named_tools = [named_tool(name) for name in self.config.tools]
        self.tools = list(self.named_tools)
        self.system_prompt = self.config.system_prompt
        server = self.config.mcp_server
        self.workspace = None if server is None else McpWorkspace(server)
        self.concurrent_reset = server is not None  # a server of its own, started at reset
        self.reusable = server is None  # a user's server may keep state across episodes

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Messages, dict[str, Any]]:
        """Take the MCP server's tools if there is one (listed once), then start the episode."""
        if self.workspace is not None:
            self.tools = _all_tools(self.named_tools, self.workspace.tools(), self.config)
        return super().reset(seed=seed, options=options)

    def close(self) -> None:
        """Stop the MCP server, if there is one; a later reset starts it again."""
        if self.workspace is not None:
            self.workspace.close()
        super().close()

    def render_system_prompt(self) -> str:
        """The system prompt, and the tool list when there are tools."""
        return self._system_text(self.system_prompt)

    def _system_text(self, prompt: str) -> str:
        return self.with_tool_list(prompt) if self.tools else prompt

    def generate_task(self, rng: np.random.Generator) -> DatasetTask:
        """A random training row, or the held-out row at this seed's place in `HELDOUT_SEEDS`."""
        rows = self.tasks[self.split]
        if self.split == "heldout":
            return rows[(self.task_seed - HELDOUT_SEEDS.start) % len(rows)]
        return rows[int(rng.integers(len(rows)))]

    def user_prompt(self, task: DatasetTask) -> str:
        """The row's prompt, as it is."""
        return task.prompt

    def opening_messages(self, task: DatasetTask) -> list[dict[str, Any]]:
        """A text row: the system prompt and the row as the user message. A conversational row
        (TRL's format): its messages as they are, after the system prompt; a system message of
        its own takes the system prompt's place (the tool list still follows it)."""
        if not task.messages:
            return super().opening_messages(task)
        messages = [m.model_dump() for m in task.messages]
        prompt = messages.pop(0)["content"] if messages[0]["role"] == "system" else None
        system = self._system_text(self.system_prompt if prompt is None else prompt)
        return [{"role": "system", "content": system}, *messages]

    def verify(self, task: DatasetTask, answer: str) -> Verdict:
        """The configured verifier on the `Answer:` line against the row's reference."""
        if self.config.verifier == "math":
            return math_verdict(answer, task.answer, self.config.math_timeout_s)
        return _VERIFIERS[self.config.verifier](answer, task.answer)

    def expert_action(self) -> str:
        """Make the `expert_call` once if there is one, then answer with the reference (there is
        none to give for a regex)."""
        assert self.task is not None
        if self.config.verifier == "regex":
            raise NotImplementedError("Dataset-v0 has no expert for regex references")
        call = self.config.expert_call
        name = _tool_name(call.tool, self.config) if call else None
        if name and not any(c.name == name and c.error is None for c in self.tool_calls):
            return self.call(name, **self.task.expert_arguments)
        return f"Answer: {self.task.answer}"


def _tool_name(entry: str, config: DatasetEnvConfig) -> str:
    """The name the model calls the tool `tools:` (or the server) lists as `entry` by."""
    return named_tool(entry).name if entry in config.tools else entry


def _all_tools(named: list[Tool], served: list[Tool], config: DatasetEnvConfig) -> list[Tool]:
    """The named tools, then the server's; a name in both, or an `expert_call` tool in neither,
    is a one-line error (McpServer's listing is only known once it runs)."""
    clash = sorted({t.name for t in named} & {t.name for t in served})
    if clash:
        raise ValueError(f"Dataset-v0: the MCP server's tools {clash} clash with tools'")
    names = {t.name for t in served} | set(config.tools)
    if config.expert_call and config.expert_call.tool not in names:
        raise ValueError(
            f"expert_call tool {config.expert_call.tool!r} is neither in tools nor the "
            f"MCP server's {sorted(t.name for t in served)}"
        )
    return [*named, *served]
