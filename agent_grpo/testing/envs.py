"""Environments for tests and benchmarks whose shape, not whose task, is the point."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from agent_grpo.envs.text_env import TextEnv, TurnOutcome, Verdict

__all__ = ["LongTailEnv", "long_tail_seeds"]


class LongTailEnv(TextEnv[int]):
    """Episodes of long-tailed length: the task (its seed) fixes how many turns it takes, one in
    `long_every` of them `long_turns`, the others 1 or 2. Every turn before the last gets a tool
    reply after `latency_s` seconds, as a slow tool would; the last turn is the answer, solved
    when its text has an even number of characters (so a group's members differ)."""

    default_max_turns = 16

    def __init__(
        self, latency_s: float = 0.0, long_every: int = 4, long_turns: int = 6, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.latency_s, self.long_every, self.long_turns = latency_s, long_every, long_turns

    def generate_task(self, rng: np.random.Generator) -> int:
        """The number of turns the episode takes."""
        if int(rng.integers(self.long_every)) == 0:
            return self.long_turns
        return 1 + int(rng.integers(2))

    def user_prompt(self, task: int) -> str:
        return f"Look up {task} records, one per turn, then answer."

    def respond(self, action: str) -> TurnOutcome:
        assert self.task is not None
        if self.turn + 1 >= self.task:
            return TurnOutcome(final_answer=action)
        time.sleep(self.latency_s)
        reply = {"role": "tool", "name": "lookup", "content": f"record {self.turn}: {len(action)}"}
        return TurnOutcome(observations=[reply])

    def verify(self, task: int, answer: str) -> Verdict:
        return Verdict(success=len(answer) % 2 == 0)


def long_tail_seeds(turns: list[int], **kwargs: Any) -> list[int]:
    """Distinct seeds, in order, whose `LongTailEnv(**kwargs)` tasks take these many turns."""
    env, out, seed = LongTailEnv(**kwargs), [], 0
    for want in turns:
        while env.generate_task(np.random.default_rng(seed)) != want or seed in out:
            seed += 1
        out.append(seed)
    return out
