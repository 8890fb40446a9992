"""ReasoningGym-v0 against the real reasoning-gym package: the task is the package's item at the
episode's seed, the reward is the package's own `score_answer`, and a bad task or config is one
line before any model work."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from gymnasium.utils.env_checker import check_env

from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import heldout_seeds, run_expert, train_seeds

reasoning_gym = pytest.importorskip(
    "reasoning_gym", reason="pip install 'agent-grpo[reasoning-gym]'"
)

TASKS = ["countdown", "chain_sum", "basic_arithmetic"]


@pytest.mark.parametrize("task", TASKS)
def test_check_env_passes_and_the_expert_scores_one_on_heldout(task: str) -> None:
    env = make_env("agent_grpo/ReasoningGym-v0", task=task)
    check_env(env.unwrapped, skip_render_check=True)
    episodes = [run_expert(env, seed) for seed in heldout_seeds(5)]
    assert all(e.success and e.reward == 1.0 for e in episodes), [e.reward for e in episodes]


def test_the_task_is_the_package_item_at_the_seed() -> None:
    env = make_env("agent_grpo/ReasoningGym-v0", task="countdown", config={"min_numbers": 3,
                   "max_numbers": 4}, dataset_seed=7)  # fmt: skip
    theirs = reasoning_gym.create_dataset("countdown", min_numbers=3, max_numbers=4, seed=7, size=1)
    seeds = [*train_seeds(3, random.Random(0)), *heldout_seeds(3)]
    for seed in seeds:
        messages, _ = env.reset(seed=seed)
        assert messages[1]["content"] == theirs[seed]["question"]
        assert "<answer>" in messages[0]["content"]  # reasoning-gym's own system prompt
    questions = {env.reset(seed=s)[0][1]["content"] for s in seeds}
    assert len(questions) == len(seeds)  # training and held-out seeds index different items


@pytest.mark.parametrize(
    "reply",
    ["", "<answer></answer>", "<answer>1 + 2</answer>", "no tags at all",
     "Answer: 3 * 4", "<answer>x</answer> then <answer>{ref}</answer>"],
)  # fmt: skip
def test_the_reward_is_the_package_own_score(reply: str) -> None:
    env = make_env("agent_grpo/ReasoningGym-v0", task="countdown")
    theirs = reasoning_gym.create_dataset("countdown", seed=0, size=1)
    seed = heldout_seeds(1)[0]
    env.reset(seed=seed)
    entry = theirs[seed]
    reply = reply.replace("{ref}", entry["answer"])
    _, reward, terminated, _, _ = env.step(reply)
    extracted = reasoning_gym.utils.extract_answer(reply)
    if extracted is None and reply.startswith("Answer:"):
        extracted = reply.removeprefix("Answer:").strip()
    assert terminated and reward == theirs.score_answer(extracted, entry)


def test_a_calculator_tool_can_be_added() -> None:
    env = make_env("agent_grpo/ReasoningGym-v0", task="countdown", tools=["calculator"])
    messages, _ = env.reset(seed=heldout_seeds(1)[0])
    assert "calculator" in messages[0]["content"]


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [({"task": "no_such_task"}, "reasoning-gym has no task 'no_such_task'"),
     ({"task": "countdown", "config": {"min_numbers": 9, "max_numbers": 2}}, "config"),
     ({"task": "countdown", "config": {"colour": "red"}}, "colour")],
    ids=["unknown-task", "invalid-config", "unknown-config-key"],
)  # fmt: skip
def test_a_bad_task_or_config_is_one_line(kwargs: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as error:
        make_env("agent_grpo/ReasoningGym-v0", **kwargs)
    assert "\n" not in str(error.value)


def test_the_docs_example_trains_two_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    from agent_grpo.testing.cli_runs import metrics, tiny_train

    run = tiny_train(tmp_path, tiny_model_dir, "env.id=agent_grpo/ReasoningGym-v0",
                     "env.kwargs={task: countdown, tools: [calculator]}", "steps=2")  # fmt: skip
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
