"""Calculator-v0: chained multi-digit arithmetic, solved with one `calculator` call.

A small model gets `(347 * 29) - 1181` wrong unaided; with the tool it only has to copy the
expression into a call and the result into `Answer: <number>`. Difficulty is set by the number
of operations and the digits of the operands (multiplications use shorter operands so results
stay readable).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from agent_grpo.envs.answers import number_verdict
from agent_grpo.envs.text_env import ToolEnv, Verdict
from agent_grpo.tools.calculator import calculator, evaluate

__all__ = ["ArithmeticTask", "CalculatorEnv", "make_expression"]


class ArithmeticTask(BaseModel):
    """One arithmetic problem."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    expression: str
    """The expression as shown to the model, e.g. `(347 * 29) - 1181`."""
    answer: int
    """Its value."""


def _operand(rng: np.random.Generator, digits: int) -> int:
    return int(rng.integers(10 ** (digits - 1), 10**digits))


def make_expression(
    rng: np.random.Generator, num_ops: int, digits: int, mul_digits: int, ops: str
) -> str:
    """A left-nested expression `((a op b) op c) ...` with `num_ops` operators drawn from `ops`."""
    text = str(_operand(rng, digits))
    for i in range(num_ops):
        op = str(rng.choice(list(ops)))
        operand = _operand(rng, mul_digits if op == "*" else digits)
        left = f"({text})" if i > 0 else text
        text = f"{left} {op} {operand}"
    return text


class CalculatorEnv(ToolEnv[ArithmeticTask]):
    """Compute an arithmetic expression with the calculator tool; answer `Answer: <number>`."""

    reusable = True  # no state outside the base class's

    system_prompt = (
        "Solve the arithmetic problem. First call the calculator tool with the expression. "
        "Then reply with the result as: Answer: <number>"
    )
    tools = (calculator,)
    default_max_turns = 4

    def __init__(
        self,
        num_ops: int = 2,
        digits: int = 3,
        mul_digits: int = 2,
        ops: str = "+-*",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if num_ops < 1 or digits < 1 or mul_digits < 1 or not set(ops) <= set("+-*") or not ops:
            raise ValueError("need num_ops >= 1, digits >= 1, mul_digits >= 1, ops from '+-*'")
        self.num_ops, self.digits, self.mul_digits, self.ops = num_ops, digits, mul_digits, ops

    def generate_task(self, rng: np.random.Generator) -> ArithmeticTask:
        """A random expression of the configured difficulty and its exact value."""
        expression = make_expression(rng, self.num_ops, self.digits, self.mul_digits, self.ops)
        return ArithmeticTask(expression=expression, answer=int(evaluate(expression)))

    def user_prompt(self, task: ArithmeticTask) -> str:
        """Ask for the value."""
        return f"What is {task.expression}?"

    def verify(self, task: ArithmeticTask, answer: str) -> Verdict:
        """Exact numeric match of the `Answer:` line."""
        return number_verdict(answer, task.answer)

    def expert_action(self) -> str:
        """Call the calculator once, then answer with its result."""
        assert self.task is not None
        done = [c for c in self.tool_calls if c.name == "calculator" and c.error is None]
        if not done:
            return self.call("calculator", expression=self.task.expression)
        return f"Answer: {done[-1].result}"
