"""A brand-new environment written with the public API only, as `docs/environments.md` shows.

The environment below (from `# Invented countries` to the end of `CapitalsEnv`) is the docs
example, verbatim (a test checks it), so if the documented code stops working, these tests fail.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from pydantic import BaseModel

from agent_grpo.envs.answers import text_verdict
from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import ToolEnv, Verdict, heldout_seeds, read_step_info, run_expert
from agent_grpo.tools.tool import tool

# Invented countries, so a model cannot know the answers: it has to look them up.
CAPITALS = {
    "Velmoria": "Ostrig",
    "Quandar": "Pell",
    "Sirrath": "Kovno Vale",
    "Bramwyn": "Tessaly",
    "Orune": "Dask",
    "Liskaro": "Mirrow",
}


@tool
def lookup(country: str) -> str:
    """Look up the capital of a country."""
    capital = CAPITALS.get(country.strip().title())
    if capital is None:
        raise ValueError(f"no country named {country!r}")
    return capital


class CapitalTask(BaseModel):
    """One question: a country and its capital."""

    country: str
    capital: str


class CapitalsEnv(ToolEnv[CapitalTask]):
    """Name the capital of an invented country, using the lookup tool."""

    system_prompt = "Find the capital with the lookup tool. Then reply with: Answer: <capital>"
    tools = (lookup,)
    default_max_turns = 3

    def generate_task(self, rng: np.random.Generator) -> CapitalTask:
        country = sorted(CAPITALS)[int(rng.integers(len(CAPITALS)))]
        return CapitalTask(country=country, capital=CAPITALS[country])

    def user_prompt(self, task: CapitalTask) -> str:
        return f"What is the capital of {task.country}?"

    def verify(self, task: CapitalTask, answer: str) -> Verdict:
        return text_verdict(answer, task.capital)

    def expert_action(self) -> str:
        assert self.task is not None
        found = [c.result for c in self.tool_calls if c.error is None]
        if not found:
            return self.call("lookup", country=self.task.country)
        return f"Answer: {found[-1]}"


ENV_ID = "my_envs/Capitals-v0"


@pytest.fixture
def registered() -> Iterator[str]:
    gym.register(id=ENV_ID, entry_point=CapitalsEnv, kwargs={"max_turns": 3})
    yield ENV_ID
    gym.registry.pop(ENV_ID)


def test_registered_custom_env_runs_with_scripted_policy(registered: str) -> None:
    env = gym.make(registered)
    check_env(env.unwrapped)
    episodes = [run_expert(env, seed) for seed in heldout_seeds(20)]
    env.close()
    assert all(e.success and e.reward == 1.0 and e.turns == 2 for e in episodes)
    countries = {e.messages[1].content for e in episodes}
    assert len(countries) > 1  # different seeds, different tasks
    first = episodes[0]
    assert [m.role for m in first.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert '"name": "lookup"' in first.messages[0].content  # the tool list is in the prompt


def test_hand_written_policy_and_tool_errors(registered: str) -> None:
    env = make_env(registered)
    obs, _ = env.reset(seed=5)
    country = obs[1]["content"].removeprefix("What is the capital of ").rstrip("?")
    # A wrong country: the tool raises, the model gets an error message and another turn.
    call = '<tool_call>{"name": "lookup", "arguments": {"country": "Atlantis"}}</tool_call>'
    obs, reward, terminated, truncated, info = env.step(call)
    assert obs[0]["content"] == (
        "Error: tool lookup raised ValueError: no country named 'Atlantis'"
    )
    assert (reward, terminated, truncated) == (0.0, False, False)
    call = call.replace("Atlantis", country)
    obs, *_ = env.step(call)
    assert obs == [{"role": "tool", "name": "lookup", "content": CAPITALS[country]}]
    _, reward, terminated, _, info = env.step(f"The capital is known.\nAnswer: {obs[0]['content']}")
    assert (reward, terminated, read_step_info(info).success) == (1.0, True, True)
    env.close()


def test_path_form_needs_no_registration() -> None:
    env = make_env(f"{__name__}:CapitalsEnv", max_turns=1)
    env.reset(seed=0)
    call = env.unwrapped.call("lookup", country="Orune")  # type: ignore[attr-defined]
    _, reward, terminated, truncated, info = env.step(call)
    assert (reward, terminated, truncated) == (0.0, False, True)  # one turn, no answer
    assert read_step_info(info).end_reason == "max_turns"
    env.close()


def test_docs_example_is_this_file() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    block = re.search(r"```python\n(.*?)```", docs, re.DOTALL)
    assert block is not None
    code = block.group(1)
    body = code[code.index("# Invented countries") :]
    assert body in Path(__file__).read_text()
    assert len(code.splitlines()) < 100
