"""The user-facing examples at the top of the repository (envs/) hold to the built-ins' contract."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from gymnasium.utils.env_checker import check_env

from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import heldout_seeds, run_expert

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def units() -> Iterator[ModuleType]:
    """envs/units.py imported as `envs.units`, as `PYTHONPATH=.` makes it for a user."""
    sys.path.insert(0, str(ROOT))
    try:
        yield importlib.import_module("envs.units")
    finally:
        sys.path.remove(str(ROOT))
        for name in [n for n in sys.modules if n == "envs" or n.startswith("envs.")]:
            del sys.modules[name]


def test_the_units_example_passes_check_env_and_its_expert_solves_it(units: ModuleType) -> None:
    env = units.UnitsEnv()
    check_env(env, skip_render_check=True)
    assert all(run_expert(env, seed).success for seed in heldout_seeds(20))
    env.close()


def test_the_units_example_builds_from_its_module_path(units: ModuleType) -> None:
    env = make_env("envs.units:UnitsEnv", max_turns=2)
    observation, _ = env.reset(seed=3)
    assert "metres" in observation[-1]["content"]
    assert env.unwrapped.max_turns == 2
    env.close()


def test_the_convert_tool_refuses_an_unknown_unit(units: ModuleType) -> None:
    with pytest.raises(ValueError, match="unknown unit 'cubit'"):
        units.convert(value=1.0, unit="cubit")


def test_the_examples_are_short() -> None:
    assert len((ROOT / "envs" / "units.py").read_text().splitlines()) < 100
