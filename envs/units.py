"""Units-v0, an example of a user's own environment: convert a length with a `convert` tool.

A complete tool environment in one file (docs/environments.md explains each piece): a typed tool,
a task drawn only from the generator it is given, a verifier, and a scripted expert for the warm
start. Train it from the repository's root without registering anything:

    PYTHONPATH=. agent-grpo train configs/calculator.yaml env.id=envs.units:UnitsEnv
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from agent_grpo.envs.answers import float_verdict
from agent_grpo.envs.text_env import ToolEnv, Verdict
from agent_grpo.tools.tool import tool

METRES_PER_UNIT = {"inch": 0.0254, "foot": 0.3048, "yard": 0.9144, "mile": 1609.344}
"""The units the tool knows, in metres each."""


@tool
def convert(value: float, unit: str) -> str:
    """Convert a length in `unit` (inch, foot, yard or mile) to metres."""
    factor = METRES_PER_UNIT.get(unit.strip().lower())
    if factor is None:
        raise ValueError(f"unknown unit {unit!r}; known: {', '.join(METRES_PER_UNIT)}")
    return f"{value * factor:.4f}"


class UnitsTask(BaseModel):
    """One question: a length in some unit, and its value in metres."""

    value: float
    unit: str
    metres: float


class UnitsEnv(ToolEnv[UnitsTask]):
    """How many metres is a length given in inches, feet, yards or miles? Use the tool."""

    system_prompt = "Convert with the convert tool, then reply with: Answer: <metres>"
    tools = (convert,)
    default_max_turns = 3

    def generate_task(self, rng: np.random.Generator) -> UnitsTask:
        unit = sorted(METRES_PER_UNIT)[int(rng.integers(len(METRES_PER_UNIT)))]
        value = float(rng.integers(2, 500))
        return UnitsTask(value=value, unit=unit, metres=value * METRES_PER_UNIT[unit])

    def user_prompt(self, task: UnitsTask) -> str:
        return f"How many metres is {task.value:g} {task.unit}?"

    def verify(self, task: UnitsTask, answer: str) -> Verdict:
        return float_verdict(answer, task.metres, rel_tol=1e-3)

    def expert_action(self) -> str:
        assert self.task is not None
        results = [c.result for c in self.tool_calls if c.error is None]
        if not results:
            return self.call("convert", value=self.task.value, unit=self.task.unit)
        return f"Answer: {results[-1]}"
