"""Logs-v0: add up the errors of several long service logs, read one `read_log` call at a time.

Built to outgrow the context: each log is a few hundred tokens of heartbeat noise under one
`errors: N` line, so with a small `max_context_tokens` the outputs of every call do not fit and
the episode must rewrite its oldest observations (`rollout.context`: `compact` keeps each log's
first line, which is all the answer needs; `drop` loses it). A log's text is a function of its
name alone, so the tool needs no state and a replay re-runs it exactly.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from agent_grpo.envs.answers import number_verdict
from agent_grpo.envs.text_env import ToolEnv, Verdict
from agent_grpo.tools.tool import tool

__all__ = ["LogsEnv", "LogsTask", "log_text", "read_log"]

NOISE_LINES = 24
"""Heartbeat lines under each log's `errors: N` line."""


def log_text(name: str) -> tuple[str, int]:
    """The text of log `name` and its error count (the first line says it)."""
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    errors = int(rng.integers(0, 10))
    noise = [f"{i:03d} INFO heartbeat ok id={int(rng.integers(10**6))}" for i in range(NOISE_LINES)]
    return "\n".join([f"errors: {errors}", *noise]), errors


@tool
def read_log(log: str) -> str:
    """Read the service log called `log` (one of the names in the question)."""
    if not log.startswith("svc-") or len(log) > 40:
        raise ValueError(f"no log named {log!r}: names look like svc-3-1")
    return log_text(log)[0]


class LogsTask(BaseModel):
    """Which logs to read, and the total their first lines add up to."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    names: tuple[str, ...]
    """The logs' names, in the order the question lists them."""
    total: int
    """The sum of their error counts."""


class LogsEnv(ToolEnv[LogsTask]):
    """Read every named log with `read_log`, then answer the total error count."""

    reusable = True  # no state outside the base class's

    system_prompt = (
        "Read each log named in the question with the read_log tool, one call per turn. "
        "Each log starts with a line `errors: N`. Then reply with the total as: Answer: <number>"
    )
    tools = (read_log,)
    default_max_turns = 6

    def __init__(self, logs: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logs = logs

    def generate_task(self, rng: np.random.Generator) -> LogsTask:
        base = int(rng.integers(10**4))
        names = tuple(f"svc-{base}-{k}" for k in range(self.logs))
        return LogsTask(names=names, total=sum(log_text(n)[1] for n in names))

    def user_prompt(self, task: LogsTask) -> str:
        return f"How many errors do the logs {', '.join(task.names)} report in total?"

    def verify(self, task: LogsTask, answer: str) -> Verdict:
        return number_verdict(answer, task.total)

    def expert_action(self) -> str:
        assert self.task is not None
        read = len([c for c in self.tool_calls if c.error is None])
        if read < len(self.task.names):
            return self.call("read_log", log=self.task.names[read])
        return f"Answer: {self.task.total}"
