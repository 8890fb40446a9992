"""Built-ins that declare `TextEnv.reusable` play the same episode on a used instance as on a new
one: `agent_grpo/rollout/env_pool.py` resets them for later episodes instead of building them
again, so a reset that left anything behind (a note in the store, an order in the inventory, a
backend session) would train the next episode on a wrong start with no error."""

from __future__ import annotations

import functools

import gymnasium as gym
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agent_grpo.envs  # noqa: F401  (registers the built-ins)
from agent_grpo.envs import BUILTIN_ENVS
from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import HELDOUT_SEEDS, TRAIN_SEEDS, ExpertEpisode, run_expert
from agent_grpo.rollout.env_pool import is_reusable

REUSABLE = {"BFCL-v0", "Calculator-v0", "Dataset-v0", "Logs-v0", "Notes-v0", "PythonSandbox-v0",
            "ReasoningGym-v0", "Search-v0", "WebApi-v0"}  # fmt: skip
SEEDS = st.sampled_from([*TRAIN_SEEDS[:50], *HELDOUT_SEEDS[:50]])


def test_the_reusable_built_ins_are_the_ones_checked_here() -> None:
    """Opting a built-in in (or out) is deliberate: this list and the envs' own flags agree."""
    flagged = set()
    for name in BUILTIN_ENVS:
        try:
            env = make_env(f"agent_grpo/{name}")
        except Exception:  # needs a server or kwargs of its own: not reusable by default
            continue
        if is_reusable(env):
            flagged.add(name)
        env.close()
    assert flagged == REUSABLE


@functools.cache
def fresh_episode(name: str, seed: int) -> ExpertEpisode:
    env = make_env(f"agent_grpo/{name}")
    try:
        return run_expert(env, seed)
    finally:
        env.close()


def play(env: gym.Env, seed: int, turns: int) -> None:
    """Up to `turns` expert turns of `seed`'s episode (an episode cut short, as a token limit
    cuts one, leaves its env mid-episode)."""
    env.reset(seed=seed)
    for _ in range(turns):
        _, _, terminated, truncated, _ = env.step(env.unwrapped.expert_action())
        if terminated or truncated:
            return


@pytest.mark.parametrize("name", sorted(REUSABLE))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(before=st.lists(st.tuples(SEEDS, st.integers(0, 4)), min_size=1, max_size=3), seed=SEEDS)
def test_a_used_env_plays_the_episode_a_new_one_plays(
    name: str, before: list[tuple[int, int]], seed: int
) -> None:
    env = make_env(f"agent_grpo/{name}")
    try:
        for earlier, turns in before:
            play(env, earlier, turns)
        assert run_expert(env, seed) == fresh_episode(name, seed)
    finally:
        env.close()
