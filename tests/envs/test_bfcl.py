"""BFCL-v0 against the real bfcl-eval package: BFCL's 200 `multi_turn_base` tasks, its backends
and its multi-turn checker. Ground truth replayed through `reset`/`step` in every tool-call
format scores 200/200, an empty answer 0/200, and the docs example evaluates end to end."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import yaml
from gymnasium.utils.env_checker import check_env
from transformers import PreTrainedTokenizerBase

from agent_grpo.config.base import load_config
from agent_grpo.config.jobs import EvalRunConfig
from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import heldout_seeds, read_step_info, run_expert, train_seeds
from agent_grpo.tools.formats import TOOL_FORMATS

pytest.importorskip("bfcl_eval", reason="pip install --no-deps bfcl-eval 'agent-grpo[bfcl]'")

from agent_grpo.envs.bfcl import TURN_DONE, BfclEnv, bfcl_verdict
from agent_grpo.envs.bfcl_tasks import load_tasks, parse_call

ENV_ID = "agent_grpo/BFCL-v0"
DOCS = Path(__file__).parents[2] / "docs" / "environments.md"


def bfcl(**kwargs: object) -> BfclEnv:
    env = make_env(ENV_ID, **kwargs).unwrapped
    assert isinstance(env, BfclEnv)
    return env


def test_check_env_passes() -> None:
    check_env(bfcl().unwrapped, skip_render_check=True)


def test_the_tasks_are_bfcl_multi_turn_base() -> None:
    tasks = load_tasks()
    assert [t.id for t in tasks] == [f"multi_turn_base_{i}" for i in range(200)]
    assert {len(t.turns) for t in tasks} == set(range(1, 8))
    assert all(len(t.ground_truth) == len(t.turns) for t in tasks)


def test_training_and_heldout_tasks_never_overlap() -> None:
    env = bfcl()
    seen = {split: set() for split in ("train", "heldout")}
    for split, seeds in (("train", train_seeds(300, random.Random(0))),
                         ("heldout", heldout_seeds(40))):  # fmt: skip
        for seed in seeds:
            env.reset(seed=seed)
            assert env.task is not None
            seen[split].add(env.task.id)
    assert not seen["train"] & seen["heldout"]
    assert len(seen["heldout"]) == len(env.task_pool("heldout")) == 40  # every fifth entry
    assert len(env.task_pool("train")) == 160 and len(seen["train"]) > 100


def test_the_prompt_is_the_first_question_with_the_involved_classes_schemas() -> None:
    env = bfcl(heldout_every=1)
    messages, _ = env.reset(seed=heldout_seeds(1)[0])
    task = load_tasks()[0]  # TwitterAPI and GorillaFileSystem
    assert messages[1] == {"role": "user", "content": task.turns[0]}
    assert '"name": "post_tweet"' in messages[0]["content"]  # TwitterAPI
    assert '"name": "mkdir"' in messages[0]["content"]  # GorillaFileSystem
    assert '"name": "book_flight"' not in messages[0]["content"]  # TravelAPI is not involved
    assert '"type": "dict"' not in messages[0]["content"]  # BFCL's types became JSON schema's


def replay(env: BfclEnv, seed: int, actions_per_turn: list[list[str]]) -> float:
    """Play one turn list per user turn, then a turn without a call; checks the protocol."""
    env.reset(seed=seed)
    assert env.task is not None
    turns = env.task.turns
    for index, actions in enumerate(actions_per_turn):
        for action in actions:
            observations, _, terminated, truncated, _ = env.step(action)
            assert [m["role"] for m in observations] == ["tool"] and not terminated
        observations, reward, terminated, truncated, _ = env.step(TURN_DONE)
        if index + 1 < len(turns):
            assert observations == [{"role": "user", "content": turns[index + 1]}]
            assert not terminated and reward == 0.0
    assert terminated and not truncated
    return reward


def ground_truth_actions(env: BfclEnv) -> list[list[str]]:
    """The current task's ground truth, call by call, in the env's tool-call format."""
    assert env.task is not None
    classes = env.task.involved_classes
    calls = [[parse_call(c, classes) for c in turn] for turn in env.task.ground_truth]
    return [[env.tool_call_format.render_call(n, a) for n, a in turn] for turn in calls]


@pytest.mark.parametrize("fmt", sorted(TOOL_FORMATS))
def test_the_ground_truth_scores_200_of_200_in_every_format(fmt: str) -> None:
    env = bfcl(heldout_every=1, tool_call_format=fmt)
    rewards, ids = [], set()
    for seed in heldout_seeds(200):
        env.reset(seed=seed)
        assert env.task is not None
        ids.add(env.task.id)
        rewards.append(replay(env, seed, ground_truth_actions(env)))
    assert sum(rewards) == 200 and len(ids) == 200


def test_an_empty_answer_scores_0_of_200() -> None:
    # Every entry has a turn whose ground truth holds calls (only 3 of 734 turns are empty).
    env = bfcl(heldout_every=1)
    verdicts = []
    for seed in heldout_seeds(200):
        env.reset(seed=seed)
        while True:
            _, _, terminated, truncated, info = env.step("")
            if terminated or truncated:
                break
        verdicts.append(read_step_info(info).verifier)
    assert sum(v["success"] for v in verdicts) == 0
    assert all("empty_turn_model_response" in v["detail"] for v in verdicts)


def test_the_expert_solves_the_heldout_tasks() -> None:
    env = make_env(ENV_ID)
    episodes = [run_expert(env, seed) for seed in heldout_seeds(40)]
    assert all(e.success and e.reward == 1.0 for e in episodes), [e.seed for e in episodes]


def test_a_wrong_call_fails_on_the_state_it_leaves() -> None:
    env = bfcl(heldout_every=1)
    seed = heldout_seeds(2)[1]  # multi_turn_base_1; turn 1 is cd(folder='workspace'), mv(...)
    env.reset(seed=seed)
    right = ground_truth_actions(env)
    assert right[1][1] == env.call("mv", source="log.txt", destination="archive")
    wrong = [right[0], [right[1][0], env.call("mv", source="log.txt", destination="elsewhere")],
             *right[2:]]  # fmt: skip
    assert replay(env, seed, right) == 1.0
    assert replay(env, seed, wrong) == 0.0
    assert env.task is not None
    verdict = bfcl_verdict(env.task, env.turn_calls)
    assert verdict.detail.startswith("multi_turn:instance_state_mismatch")


def test_a_malformed_call_is_an_error_observation_and_is_not_executed() -> None:
    env = bfcl(heldout_every=1)
    env.reset(seed=heldout_seeds(2)[1])
    bad = ["<tool_call>{not json</tool_call>", env.call("no_such_function"),
           env.call("ls", colour="red"), env.call("cd")]  # fmt: skip
    for action in bad:
        observations, _, terminated, truncated, info = env.step(action)
        assert observations[0]["content"].startswith("Error:"), observations
        assert not (terminated or truncated) and read_step_info(info).malformed_tool_calls == 1
    assert env.turn_calls == [[]]  # nothing reached the backends
    observations, *_ = env.step(env.call("ls", a=True))
    assert observations[0]["content"] == '{"current_directory_content": ["workspace"]}'
    assert env.turn_calls == [[["ls(a=True)"]]]


def test_a_wrongly_typed_argument_is_executed_as_bfcl_does() -> None:
    env = bfcl(heldout_every=1)
    env.reset(seed=heldout_seeds(1)[0])
    observations, *_ = env.step(env.call("tail", file_name="nothing.txt", lines="x"))
    assert env.turn_calls == [[["tail(file_name='nothing.txt',lines='x')"]]]
    assert observations[0]["content"] != ""  # the backend's answer, whatever it is


def test_tasks_repeat_in_one_process_from_their_initial_state() -> None:
    from bfcl_eval.eval_checker.multi_turn_eval import multi_turn_utils

    def instances() -> set[str]:  # BFCL keeps every backend instance in these globals
        return {k for k in vars(multi_turn_utils) if k.startswith("agent_grpo_")}

    before = instances()
    env = bfcl(heldout_every=1)
    episodes = [run_expert(env, heldout_seeds(1)[0]) for _ in range(2)]
    assert episodes[0].messages == episodes[1].messages and episodes[1].success
    assert len(instances() - before) == 2  # the open episode's TwitterAPI, GorillaFileSystem
    env.close()
    assert instances() == before  # every episode's and every check's instances are gone


def test_a_bad_kwarg_is_one_line() -> None:
    with pytest.raises(ValueError, match="heldout_every must be at least 1") as error:
        make_env(ENV_ID, heldout_every=0)
    assert "\n" not in str(error.value)


def docs_config(tmp_path: Path, *overrides: str) -> EvalRunConfig:
    """The docs section's YAML example as an eval config, with `overrides`."""
    section = DOCS.read_text().split("### BFCL's multi-turn benchmark", 1)[1]
    example = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert example is not None
    raw = yaml.safe_load(example.group(1))  # what the docs promise: all 200, held out
    assert raw["env"]["kwargs"] == {"heldout_every": 1} and raw["eval"]["tasks"] == 200
    config_file = tmp_path / "bfcl.yaml"
    config_file.write_text(example.group(1))
    return load_config(EvalRunConfig, config_file, [f"run.root={tmp_path}", *overrides])


def test_the_docs_example_evaluates_with_the_tiny_model(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    from agent_grpo.evaluation.job import run_eval_job
    from agent_grpo.testing.cli_runs import metrics

    config = docs_config(tmp_path, f"model.name_or_path={tiny_model_dir}", "eval.tasks=2",
                         "eval.max_tokens=8")  # fmt: skip
    rows = metrics(run_eval_job(config))
    assert rows[0]["eval_tasks"] == 2.0 and rows[0]["eval_success_rate"] == 0.0


def test_the_docs_example_scores_the_ground_truth_through_the_rollout(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    # A random tiny model never ends a turn, so the expert's turns are scripted instead: the
    # rollout (chat template, user observations, token accounting) must carry them to 1.0.
    from agent_grpo.evaluation.heldout import env_stop_strings, evaluate_heldout
    from agent_grpo.testing.backends import ScriptedBackend

    config = docs_config(tmp_path, "eval.tasks=1")
    expert = run_expert(make_env(config.env.id, **config.env.kwargs), heldout_seeds(1)[0])
    script = [m.content for m in expert.messages if m.role == "assistant"]
    result, records = evaluate_heldout(
        ScriptedBackend(tokenizer, script), tokenizer, config.env, config.eval,
        max_context_tokens=config.max_context_tokens, seed=config.seed,
        stop=env_stop_strings(config.env.id, config.env.kwargs), progress=False,
    )  # fmt: skip
    assert result.summary.success_rate == 1.0 and len(records[0].turns) == len(script) == 14
    users = [m for m in records[0].messages if m.role == "user"]
    assert len(users) == 4  # multi_turn_base_0's four user turns


def test_a_call_string_never_carries_an_argument_name_that_is_code() -> None:
    from agent_grpo.envs.bfcl_tasks import call_string

    assert call_string("cd", {"folder": "doc's"}) == 'cd(folder="doc\'s")'
    for hostile in ("a=__import__('os').system('id'),b", "lambda", "x y"):
        with pytest.raises(ValueError, match="not a call BFCL can run"):
            call_string("cd", {hostile: 1})
