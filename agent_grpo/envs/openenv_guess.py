"""GuessNumber: a small OpenEnv environment, written on OpenEnv's own base classes.

OpenEnv-v0 runs it when no other environment is named, and the docs example trains on it. It is
what OpenEnv's `done` and `reward` are for: a multi-turn game that pays only at its end. Guess a
secret whole number from 1 to `high` (drawn from the reset seed) with "higher" / "lower" hints; a
right guess ends the episode with reward 1, `max_guesses` wrong ones with reward 0. A guess below
1 fails the Action's own validation, as any OpenEnv server would reject it. `app()` serves it the
way OpenEnv serves its environments: `uvicorn --factory agent_grpo.envs.openenv_guess:app`.
"""

from __future__ import annotations

import random
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

__all__ = ["GuessAction", "GuessNumberEnvironment", "GuessObservation", "app"]


class GuessAction(Action):
    """Guess the secret number."""

    guess: int = Field(ge=1, description="The whole number you guess (at least 1).")


class GuessObservation(Observation):
    """What the game says: its rules at reset, then whether the guess was right."""

    message: str = Field(default="", description="The game's words to the player.")


class GuessNumberEnvironment(Environment):
    """Find a secret number from higher/lower hints; reward 1 for finding it."""

    SUPPORTS_CONCURRENT_SESSIONS = True  # no state outside the instance

    def __init__(self, high: int = 100, max_guesses: int = 7) -> None:
        super().__init__()
        self.high, self.max_guesses = high, max_guesses
        self.secret = 0
        self._state = State(step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        """Draw the secret from `seed` and state the rules."""
        self.secret = random.Random(seed).randint(1, self.high)
        self._state = State(episode_id=episode_id, step_count=0)
        rules = f"I am thinking of a whole number from 1 to {self.high}. Guess it: after each "
        return GuessObservation(message=rules + f"guess I say higher or lower. You have "
                                f"{self.max_guesses} guesses.")  # fmt: skip

    def step(
        self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any
    ) -> GuessObservation:
        """Judge one guess: right ends the game with reward 1, the last wrong one with 0."""
        self._state.step_count += 1
        if action.guess == self.secret:
            return GuessObservation(message=f"{action.guess} is right.", done=True, reward=1.0)
        hint = "higher" if action.guess < self.secret else "lower"
        over = self._state.step_count >= self.max_guesses
        left = " No guesses left." if over else ""
        return GuessObservation(message=f"{action.guess} is wrong: {hint}.{left}", done=over,
                                reward=0.0)  # fmt: skip

    @property
    def state(self) -> State:
        """The episode id and how many guesses were made."""
        return self._state


def app(max_sessions: int = 64) -> Any:
    """The game as an OpenEnv server (FastAPI: `/ws` sessions, `/reset`, `/step`, `/schema`)."""
    from openenv.core.env_server.http_server import create_fastapi_app

    return create_fastapi_app(GuessNumberEnvironment, GuessAction, GuessObservation,
                              max_concurrent_envs=max_sessions)  # fmt: skip
