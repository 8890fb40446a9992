"""A verifiers v1 environment written with verifiers' own API: Verifiers-v0's default and its docs
example, and what a user's own environment for it looks like.

The shipped arithmetic word problems (`split: train` or `test`), a calculator toolset and one
`@vf.reward` that reads the reply's last `Answer:` line. Only the data file and the calculator's
arithmetic come from agent-grpo; everything else is plain `verifiers.v1`.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import verifiers.v1 as vf

from agent_grpo.envs.dataset_rows import PACKAGE_DIR, SHIPPED_FILES
from agent_grpo.tools.calculator import evaluate, format_number

__all__ = ["WordProblemsTaskset"]

SYSTEM_PROMPT = (
    "Solve the problem; the calculator computes exactly. End your reply with the final answer "
    "on its own line as: Answer: <number>"
)
_ANSWER = re.compile(r"answer:\s*([^\n]*)", re.IGNORECASE)


class WordProblem(vf.TaskData):
    """One word problem and its reference answer."""

    answer: str
    """The reference answer, an integer written out."""


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    """Exact arithmetic for the model (the tool is `calculator_calculate`)."""

    @vf.tool
    async def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly: numbers, + - * / and parentheses."""
        return format_number(evaluate(expression))


class WordProblemTask(vf.Task[WordProblem]):
    """A word problem, scored by its last `Answer:` line."""

    @vf.reward(weight=1.0)
    async def correct(self, task: WordProblem, trace: vf.Trace) -> float:
        """1.0 when the last `Answer:` line is the reference number, else 0.0."""
        found = _ANSWER.findall(trace.last_reply)
        return float(bool(found) and found[-1].strip().replace(",", "") == task.answer)


class WordProblemsConfig(vf.TasksetConfig):
    """Which of the shipped files the problems come from."""

    split: Literal["train", "test"] = "train"
    """`train` (300 problems) or `test` (100)."""


class WordProblemsTaskset(vf.Taskset[WordProblemTask, WordProblemsConfig]):
    """The shipped arithmetic word problems with a calculator."""

    @classmethod
    def toolsets(cls, config: WordProblemsConfig) -> list[vf.Toolset]:
        """One calculator, shared by every task."""
        return [Calculator(vf.ToolsetConfig())]

    def load(self) -> list[WordProblemTask]:
        """One task per line of the split's file."""
        lines = (PACKAGE_DIR / SHIPPED_FILES[self.config.split]).read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        return [
            WordProblemTask(WordProblem(system_prompt=SYSTEM_PROMPT, prompt=row["question"],
                                        answer=str(row["answer"])), self.config.task)
            for row in rows
        ]  # fmt: skip
