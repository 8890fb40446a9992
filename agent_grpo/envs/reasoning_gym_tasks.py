"""ReasoningGym-v0: any of reasoning-gym's procedural tasks, scored by its own `score_answer`.

`env.kwargs: {task: countdown, config: {min_numbers: 3}, tools: [calculator]}` trains on
reasoning-gym's `countdown` generator (`reasoning_gym.create_dataset(task, **config)`), with
the calculator tool if asked. Nothing of the task is rewritten: the user message is the task's
`question`, the system prompt is reasoning-gym's own `default` one (answer in `<answer>` tags),
and the reward is the dataset's own `score_answer(answer, entry)`, partial credit included
(countdown gives 0.05 for an expression that uses the right numbers but misses the target);
success is a score of 1.

Where we depart: reasoning-gym draws item `i` from `Random(config seed + i)`; our seed is that
`i`, with the dataset's seed fixed (`dataset_seed`), so training and held-out seeds, which never
overlap, index different items. The answer is the last `<answer>...</answer>` block, else our
`Answer:` line. The expert answers with the task's reference answer (a format demonstration).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from agent_grpo.envs.answers import extract_answer as answer_line
from agent_grpo.envs.dataset import named_tool
from agent_grpo.envs.text_env import ToolEnv, Verdict

__all__ = ["ReasoningGymEnv", "ReasoningGymTask"]


class ReasoningGymTask(BaseModel):
    """One item of a reasoning-gym dataset."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int
    """The item's index in the dataset (our task seed)."""
    entry: dict[str, Any]
    """The item as reasoning-gym made it: `question`, `answer`, `metadata`."""


def _reasoning_gym() -> Any:
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ImportError(
            "ReasoningGym-v0 needs reasoning-gym: pip install 'agent-grpo[reasoning-gym]'"
        )
    import reasoning_gym

    return reasoning_gym


class ReasoningGymEnv(ToolEnv[ReasoningGymTask]):
    """Answer a reasoning-gym task; its own `score_answer` is the reward."""

    reusable = True  # no state outside the base class's

    def __init__(
        self,
        task: str = "countdown",
        config: dict[str, Any] | None = None,
        tools: list[str] | tuple[str, ...] = (),
        dataset_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        rg = _reasoning_gym()
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import SYSTEM_PROMPTS

        if task not in DATASETS:
            raise ValueError(f"reasoning-gym has no task {task!r}; its {len(DATASETS)} tasks "
                             f"include {', '.join(sorted(DATASETS)[:12])}, ...")  # fmt: skip
        try:
            # size only bounds its iterator; items are drawn by index
            self.dataset = rg.create_dataset(task, **{**(config or {}), "seed": dataset_seed,
                                                      "size": 1})  # fmt: skip
        except (TypeError, ValueError, AssertionError) as error:
            raise ValueError(f"reasoning-gym task {task!r} config {config}: {error}") from None
        self.task_name = task
        self.tools = [named_tool(name) for name in tools]
        self.system_prompt = SYSTEM_PROMPTS["default"].strip()

    def render_system_prompt(self) -> str:
        """reasoning-gym's system prompt, and the tool list when there are tools."""
        return super().render_system_prompt() if self.tools else self.system_prompt

    def generate_task(self, rng: np.random.Generator) -> ReasoningGymTask:
        """The dataset's item at this episode's seed."""
        del rng  # reasoning-gym seeds each item itself, from the index
        return ReasoningGymTask(index=self.task_seed, entry=self.dataset[self.task_seed])

    def user_prompt(self, task: ReasoningGymTask) -> str:
        """The item's question, as reasoning-gym wrote it."""
        return str(task.entry["question"])

    def verify(self, task: ReasoningGymTask, answer: str) -> Verdict:
        """The dataset's own `score_answer` on the last `<answer>` block (else `Answer:` line)."""
        from reasoning_gym.utils import extract_answer

        given = extract_answer(answer)
        given = given if given is not None else answer_line(answer)
        score = float(self.dataset.score_answer(given, task.entry))
        detail = "" if score >= 1.0 else f"{self.task_name} score {score:g}"
        return Verdict(success=score >= 1.0, reward=score, expected=str(task.entry["answer"]),
                       given=given, detail=detail)  # fmt: skip

    def expert_action(self) -> str:
        """The task's reference answer in reasoning-gym's answer tags."""
        assert self.task is not None
        return f"<answer>{self.task.entry['answer']}</answer>"
