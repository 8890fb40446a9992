"""PythonSandbox-v0: small computations (sums, counting, strings) solved by running Python.

Each problem family has two independent pieces: the reference answer, computed here in plain
Python, and the expert's program, a string run by the sandboxed `python` tool. The expert solving
its tasks therefore checks the family's code against its reference, not a value against itself.
Strings are random letters, so the model cannot recall the answer; it has to compute it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from agent_grpo.envs.answers import exact_verdict, number_verdict
from agent_grpo.envs.text_env import ToolEnv, Verdict
from agent_grpo.tools.python import python

__all__ = ["FAMILIES", "ComputeTask", "PythonSandboxEnv"]


class ComputeTask(BaseModel):
    """One computational problem."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    family: str
    """Problem family (a key of `FAMILIES`)."""
    question: str
    """The question shown to the model."""
    answer: str
    """Reference answer, computed without the sandbox."""
    kind: Literal["number", "text"]
    """How the answer is compared: by value, or character for character."""
    code: str
    """A program that prints the answer (the expert's)."""


def _word(rng: np.random.Generator, low: int = 8, high: int = 15) -> str:
    letters = rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=int(rng.integers(low, high)))
    return "".join(letters)


def _multiples(rng: np.random.Generator) -> ComputeTask:
    n, a, b = int(rng.integers(100, 2000)), int(rng.integers(2, 8)), int(rng.integers(8, 14))
    return ComputeTask(
        family="multiples",
        question=f"What is the sum of all numbers below {n} that are multiples of {a} or {b}?",
        answer=str(sum(x for x in range(n) if x % a == 0 or x % b == 0)),
        kind="number",
        code=f"print(sum(x for x in range({n}) if x % {a} == 0 or x % {b} == 0))",
    )


def _digit_sum(rng: np.random.Generator) -> ComputeTask:
    n, k = int(rng.integers(100, 5000)), int(rng.integers(3, 15))
    count = 0
    for x in range(1, n + 1):
        digits, rest = 0, x
        while rest:
            digits, rest = digits + rest % 10, rest // 10
        count += digits == k
    return ComputeTask(
        family="digit_sum",
        question=f"How many integers from 1 to {n} have a digit sum of {k}?",
        answer=str(count),
        kind="number",
        code=f"print(sum(1 for x in range(1, {n} + 1) if sum(map(int, str(x))) == {k}))",
    )


def _squares(rng: np.random.Generator) -> ComputeTask:
    a = int(rng.integers(1, 50))
    b = a + int(rng.integers(10, 200))
    # Closed form of sum_{x=a}^{b} x^2, so the reference does not share the program's loop.
    total = (b * (b + 1) * (2 * b + 1) - (a - 1) * a * (2 * a - 1)) // 6
    return ComputeTask(
        family="squares",
        question=f"What is the sum of the squares of the integers from {a} to {b}?",
        answer=str(total),
        kind="number",
        code=f"print(sum(x * x for x in range({a}, {b} + 1)))",
    )


def _primes(rng: np.random.Generator) -> ComputeTask:
    n = int(rng.integers(50, 3000))
    sieve = np.ones(n, dtype=bool)
    sieve[:2] = False
    for p in range(2, int(n**0.5) + 1):
        if sieve[p]:
            sieve[p * p :: p] = False
    return ComputeTask(
        family="primes",
        question=f"How many prime numbers are there below {n}?",
        answer=str(int(sieve.sum())),
        kind="number",
        code=(
            f"print(sum(all(x % d for d in range(2, int(x ** 0.5) + 1)) for x in range(2, {n})))"
        ),
    )


def _letter_count(rng: np.random.Generator) -> ComputeTask:
    word = _word(rng, 20, 40)
    letter = word[int(rng.integers(len(word)))]
    return ComputeTask(
        family="letter_count",
        question=f"How many times does the letter '{letter}' appear in '{word}'?",
        answer=str(sum(ch == letter for ch in word)),
        kind="number",
        code=f"print('{word}'.count('{letter}'))",
    )


def _reverse_upper(rng: np.random.Generator) -> ComputeTask:
    word = _word(rng)
    return ComputeTask(
        family="reverse_upper",
        question=f"What is '{word}' written backwards in capital letters?",
        answer="".join(reversed(word.upper())),
        kind="text",
        code=f"print('{word}'[::-1].upper())",
    )


def _sort_letters(rng: np.random.Generator) -> ComputeTask:
    word = _word(rng)
    return ComputeTask(
        family="sort_letters",
        question=f"What is '{word}' with its letters sorted alphabetically?",
        answer="".join(np.sort(np.array(list(word))).tolist()),
        kind="text",
        code=f"print(''.join(sorted('{word}')))",
    )


FAMILIES: dict[str, Callable[[np.random.Generator], ComputeTask]] = {
    "multiples": _multiples,
    "digit_sum": _digit_sum,
    "squares": _squares,
    "primes": _primes,
    "letter_count": _letter_count,
    "reverse_upper": _reverse_upper,
    "sort_letters": _sort_letters,
}
"""Problem generators by family name."""


class PythonSandboxEnv(ToolEnv[ComputeTask]):
    """Compute the answer by running Python with the `python` tool; answer `Answer: <result>`."""

    reusable = True  # every call runs in a new sandbox

    system_prompt = (
        "Solve the problem by running Python code with the python tool; print the result. "
        "Then reply with: Answer: <result>"
    )
    tools = (python,)
    default_max_turns = 4

    def __init__(self, families: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.families = sorted(families or FAMILIES)
        unknown = set(self.families) - set(FAMILIES)
        if unknown:
            raise ValueError(f"unknown families {sorted(unknown)}; known: {sorted(FAMILIES)}")

    def generate_task(self, rng: np.random.Generator) -> ComputeTask:
        """A problem from a random family."""
        family = self.families[int(rng.integers(len(self.families)))]
        return FAMILIES[family](rng)

    def user_prompt(self, task: ComputeTask) -> str:
        """The question."""
        return task.question

    def verify(self, task: ComputeTask, answer: str) -> Verdict:
        """By value for numbers, character for character for strings."""
        if task.kind == "number":
            return number_verdict(answer, int(task.answer))
        return exact_verdict(answer, task.answer)

    def expert_action(self) -> str:
        """Run the family's program once, then answer with what it printed."""
        assert self.task is not None
        done = [c for c in self.tool_calls if c.name == "python" and c.error is None]
        if not done:
            return self.call("python", code=self.task.code)
        return f"Answer: {(done[-1].result or '').strip()}"
