"""The built-in environments and the TextEnv/ToolEnv contract they share.

Covers: gymnasium's env checker on every built-in, seed determinism, the scripted experts'
success on held-out tasks, the malformed-call policies, tools that raise or hang, truncation,
and the pieces underneath (answer parsing, the calculator, BM25, the shipped corpus, the
inventory service's lifecycle).
"""

from __future__ import annotations

import json
import math
import socket
import threading
import time
import warnings
from fractions import Fraction

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import agent_grpo.envs  # noqa: F401  (registers the built-ins)
from agent_grpo.envs.answers import exact_verdict, extract_answer, number_verdict, text_verdict
from agent_grpo.envs.calculator import CalculatorEnv
from agent_grpo.envs.search import HELDOUT_EVERY, SearchEnv
from agent_grpo.envs.search_corpus import CORPUS_PATH, build_corpus, dump_corpus
from agent_grpo.envs.text_env import (
    HELDOUT_SEEDS,
    STEP_INFO_KEY,
    MessagesSpace,
    StepInfo,
    TextSpace,
    ToolEnv,
    Verdict,
    heldout_seeds,
    read_step_info,
    run_expert,
    split_of,
)
from agent_grpo.envs.webapi import WebApiEnv
from agent_grpo.testing.waiting import wait_until
from agent_grpo.tools.calculator import CalculatorError, evaluate
from agent_grpo.tools.search import BM25Index, Document
from agent_grpo.tools.tool import tool

BUILTINS = ["Calculator-v0", "PythonSandbox-v0", "Search-v0", "WebApi-v0"]


def make(name: str, **kwargs: object) -> gym.Env:
    return gym.make(f"agent_grpo/{name}", **kwargs)


@pytest.mark.parametrize("name", BUILTINS)
def test_check_env_passes_without_warnings(name: str) -> None:
    env = make(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize("name", BUILTINS)
def test_same_seed_same_task_and_other_seed_other_task(name: str) -> None:
    env = make(name)
    first, info = env.reset(seed=11)
    again, _ = env.reset(seed=11)
    prompts = {env.reset(seed=s)[0][1]["content"] for s in range(12, 20)}
    env.close()
    assert first == again and info == {"seed": 11, "split": "train"}
    assert [m["role"] for m in first] == ["system", "user"]
    assert len(prompts) >= 6  # eight seeds, nearly all distinct tasks


@pytest.mark.parametrize("name", BUILTINS)
def test_expert_is_deterministic(name: str) -> None:
    env = make(name)
    seed = HELDOUT_SEEDS.start + 3
    one, two = run_expert(env, seed), run_expert(env, seed)
    env.close()
    assert one == two
    assert one.success and one.reward == 1.0 and one.termination.reason == "final_answer"


@pytest.mark.parametrize(
    ("name", "n_tasks"),
    [
        ("Calculator-v0", 200),
        ("Search-v0", 200),
        ("WebApi-v0", 200),
        # Each python call spawns a sandboxed process (~0.15 s), so fewer tasks here.
        pytest.param("PythonSandbox-v0", 30, marks=pytest.mark.slow),
    ],
)
def test_expert_solves_heldout_tasks(name: str, n_tasks: int) -> None:
    env = make(name)
    episodes = [run_expert(env, seed) for seed in heldout_seeds(n_tasks)]
    env.close()
    solved = sum(e.success for e in episodes)
    assert solved >= math.ceil(0.99 * n_tasks), f"{name}: expert solved {solved}/{n_tasks}"
    assert all(e.reward == (1.0 if e.success else 0.0) for e in episodes)


def test_seed_split() -> None:
    assert heldout_seeds(3) == [HELDOUT_SEEDS.start + i for i in range(3)]
    assert split_of(5) == "train" and split_of(heldout_seeds(1)[0]) == "heldout"
    assert not set(heldout_seeds(100)) & set(range(10**6))


def test_search_heldout_people_never_appear_in_training_tasks() -> None:
    env = SearchEnv()
    corpus = env.corpus
    heldout_people = {p.name for i, p in enumerate(corpus.people) if i % HELDOUT_EVERY == 0}
    train_people = set()
    for seed in range(300):
        env.reset(seed=seed)
        assert env.task is not None
        train_people.add(env.task.person)
    env.reset(seed=heldout_seeds(1)[0])
    assert env.task is not None and env.task.person in heldout_people
    assert train_people and not train_people & heldout_people


# --- malformed calls, tool failures, truncation -------------------------------------------------

MALFORMED = {
    "bad_json": ('<tool_call>{"name": "calculator", "arguments": {</tool_call>', "not valid JSON"),
    "unknown_tool": (
        '<tool_call>{"name": "abacus", "arguments": {"expression": "1+1"}}</tool_call>',
        "unknown tool 'abacus'; available tools: calculator",
    ),
    "wrong_type": (
        '<tool_call>{"name": "calculator", "arguments": {"expression": 12}}</tool_call>',
        "expression: Input should be a valid string",
    ),
    "missing_argument": (
        '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
        "expression: Field required",
    ),
    "unclosed": ('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}', "closed"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("policy", ["feedback", "terminate"])
def test_malformed_call_gives_error_observation(case: str, policy: str) -> None:
    action, needle = MALFORMED[case]
    env = CalculatorEnv(malformed_policy=policy, malformed_penalty=-0.5)
    env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step(action)
    assert len(obs) == 1 and obs[0]["role"] == "tool"
    assert obs[0]["content"].startswith("Error:") and needle in obs[0]["content"]
    step = read_step_info(info)
    assert step.malformed_tool_calls == 1 and step.malformed_tool_calls_total == 1
    assert step.tool_calls[0].error_kind is not None and step.tool_calls[0].raw
    if policy == "feedback":
        assert (reward, terminated, truncated, step.success) == (0.0, False, False, None)
        env.step(action)  # counted per trajectory
        assert env.malformed_tool_calls == 2
    else:
        assert (reward, terminated, truncated, step.success) == (-0.5, True, False, False)
        assert step.end_reason == "malformed_tool_call"


def test_valid_and_malformed_calls_in_one_turn_all_get_a_message() -> None:
    env = CalculatorEnv()
    env.reset(seed=1)
    action = env.call("calculator", expression="6 * 7") + MALFORMED["unknown_tool"][0]
    obs, *_, info = env.step(action)
    assert obs[0]["content"] == "42"
    assert obs[1]["content"].startswith("Error: unknown tool")
    assert read_step_info(info).malformed_tool_calls == 1


_release = threading.Event()


@tool
def explode(x: int) -> str:
    """Always fails."""
    raise RuntimeError(f"boom at {x}")


@tool(timeout_s=0.2)
def hang(x: int) -> str:
    """Never returns in time."""
    _release.wait(10)
    return "late"


class FlakyToolsEnv(ToolEnv[int]):
    """A custom env whose tools fail: one raises, one hangs."""

    system_prompt = "Call tools."
    tools = (explode, hang)

    def generate_task(self, rng: np.random.Generator) -> int:
        return int(rng.integers(10))

    def user_prompt(self, task: int) -> str:
        return f"Task {task}"

    def verify(self, task: int, answer: str) -> Verdict:
        return Verdict(success=answer == str(task))


@pytest.mark.parametrize("policy", ["feedback", "terminate"])
@pytest.mark.parametrize(
    ("name", "needle"), [("explode", "raised RuntimeError: boom at 3"), ("hang", "timed out")]
)
def test_failing_tool_gives_error_observation(policy: str, name: str, needle: str) -> None:
    env = FlakyToolsEnv(malformed_policy=policy)
    env.reset(seed=0)
    _release.clear()
    start = time.perf_counter()
    obs, reward, terminated, truncated, info = env.step(env.call(name, x=3))
    _release.set()  # let the abandoned thread of `hang` finish
    assert time.perf_counter() - start < 5
    assert obs == [{"role": "tool", "name": name, "content": obs[0]["content"]}]
    assert obs[0]["content"].startswith("Error:") and needle in obs[0]["content"]
    # A failing tool is not a malformed call: the episode goes on under both policies.
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert read_step_info(info).malformed_tool_calls == 0


def test_max_turns_truncates() -> None:
    env = CalculatorEnv(max_turns=2)
    env.reset(seed=4)
    call = env.call("calculator", expression="1 + 1")
    assert env.step(call)[2:4] == (False, False)
    obs, reward, terminated, truncated, info = env.step(call)
    step = read_step_info(info)
    assert (reward, terminated, truncated, step.success) == (0.0, False, True, False)
    assert obs[0]["content"] == "2"  # the last turn's tool result is still returned
    assert step.end_reason == "max_turns"
    with pytest.raises(RuntimeError, match="reset"):
        env.step("Answer: 2")


def test_final_answer_on_last_turn_is_verified_not_truncated() -> None:
    env = CalculatorEnv(max_turns=1)
    env.reset(seed=4)
    assert env.task is not None
    _, reward, terminated, truncated, info = env.step(f"Answer: {env.task.answer}")
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert read_step_info(info).verifier == {
        "success": True,
        "reward": 1.0,
        "expected": str(env.task.answer),
        "given": str(env.task.answer),
        "detail": "",
    }


def test_wrong_answer_fails_and_step_info_survives_json() -> None:
    env = CalculatorEnv()
    env.reset(seed=4)
    assert env.task is not None
    _, reward, terminated, _, info = env.step(f"Answer: {env.task.answer + 1}")
    assert (reward, terminated) == (0.0, True)
    back = read_step_info(json.loads(json.dumps({STEP_INFO_KEY: info[STEP_INFO_KEY].model_dump()})))
    assert isinstance(back, StepInfo) and back == info[STEP_INFO_KEY] and back.success is False


def test_spaces() -> None:
    text, messages = TextSpace(max_length=5, seed=0), MessagesSpace(seed=0)
    assert "abc" in text and "abcdef" not in text and 3 not in text
    assert all(text.sample() in TextSpace() for _ in range(20))
    assert all(messages.sample() in messages for _ in range(20))
    assert [{"role": "tool", "content": "x", "name": "calc"}] in messages
    bad_messages = [
        [{"role": "robot", "content": "x"}],
        [{"role": "user"}],
        [{"role": "user", "content": "x", "id": 1}],
        {"role": "user"},
    ]
    for bad in bad_messages:
        assert bad not in messages


# --- answers, tools, corpus, service ------------------------------------------------------------


def test_answer_parsing_and_verdicts() -> None:
    assert extract_answer("think...\nAnswer: 12\nAnswer:  1,234 apples\nbye") == "1,234 apples"
    assert extract_answer("the answer is 5") is None
    assert number_verdict("Answer: 1,234.0", 1234).success
    assert number_verdict("answer: -7", -7).success
    assert not number_verdict("Answer: 1234", 1235).success
    assert not number_verdict("1234", 1234).success  # no Answer: line
    assert number_verdict("Answer: 0.5", Fraction(1, 2)).reward == 1.0
    assert text_verdict("Answer: the river Ousel.", "Ousel").success
    assert not text_verdict("Answer: Ousel or Bram or Kell or Dunn or Vey", "Ousel").success
    assert not text_verdict("Answer: Ouse", "Ousel").success
    assert exact_verdict("Answer: 'ABC'", "ABC").success
    assert not exact_verdict("Answer: abc", "ABC").success


def test_calculator_tool() -> None:
    assert evaluate("(347 * 29) - 1181") == 8882
    assert evaluate("0.1 + 0.2") == Fraction(3, 10)
    assert evaluate("7 / 2") == Fraction(7, 2) and evaluate("-7 // 2") == -4
    assert evaluate("2 ^ 10") == 1024 and evaluate("3 × 4") == 12
    for bad, message in [
        ("__import__('os')", "not allowed"),
        ("x + 1", "not allowed"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "exponent"),
        ("1 +", "cannot parse"),
        ("1 << 3", "not supported"),
    ]:
        with pytest.raises(CalculatorError, match=message):
            evaluate(bad)


def test_bm25_matches_hand_computed_scores() -> None:
    docs = [
        Document(id="a", title="cat", text="cat sat"),
        Document(id="b", title="dog", text="dog dog cat"),
        Document(id="c", title="bird", text="bird"),
    ]
    index = BM25Index(docs, k1=1.5, b=0.75)
    # avg length = (3 + 4 + 2) / 3 = 3; "dog": df = 1, idf = ln(1 + 2.5 / 1.5); in doc b tf = 3,
    # length 4: norm = 1.5 * (0.25 + 0.75 * 4 / 3) = 1.875, score = idf * 3 * 2.5 / 4.875.
    idf = math.log(1 + 2.5 / 1.5)
    assert index.score("dog", 1) == pytest.approx(idf * 7.5 / 4.875)
    assert [d.id for d, _ in index.search("dog")] == ["b"]
    assert [d.id for d, _ in index.search("cat")] == ["a", "b"]  # doc a: tf 2, shorter
    assert index.search("zebra") == []


def test_shipped_corpus_is_the_seeded_build() -> None:
    assert CORPUS_PATH.read_text() == dump_corpus(build_corpus())


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def test_webapi_server_starts_lazily_and_close_leaks_nothing() -> None:
    before = _threads()
    env = WebApiEnv()
    assert env._service is None and _threads() == before
    env.reset(seed=2)
    url = env.service_url
    run_expert(env, 3)
    env.close()
    env.close()  # idempotent
    # abandoned tool threads finish their (short) requests
    assert wait_until(lambda: not _threads() - before, 5)
    host, port = url.removeprefix("http://").split(":")
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=1):
        pass


def test_webapi_verifies_state_not_words() -> None:
    env = WebApiEnv()
    env.reset(seed=HELDOUT_SEEDS.start + 5)
    task = env.task
    assert task is not None
    listing = env.call("http_get", path="/items")
    env.step(listing)
    item = next(i for i in task.initial.items if i.name == task.item)
    # Ordering one unit of the wrong item changes the state: the task fails whatever is said.
    other = next(i for i in task.initial.items if i.name != task.item and i.stock > 0)
    _, _, _, _, info = env.step(
        env.call("http_post", path="/orders", body={"item_id": other.id, "quantity": 1})
    )
    assert (
        json.loads(read_step_info(info).tool_calls[0].result.split(" ", 1)[1])["item_id"]
        == other.id
    )
    _, reward, terminated, _, info = env.step(f"Answer: {item.stock}")
    env.close()
    assert (reward, terminated) == (0.0, True)
    assert "differs" in read_step_info(info).verifier["detail"]
