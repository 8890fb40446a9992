"""Dataset-v0: tasks from dataset rows, its column mapping, splits and seeds, and its verifiers.

Covers: gymnasium's checker and the expert; one-line errors for every mapping mistake; seeds that
pick rows reproducibly; a held-out split that training never sees (even where the dataset's splits
overlap) and that held-out seeds walk in order; JSONL, CSV and Parquet files; math-verify's
verdicts on a hand-checked table, off the main thread, without touching this process's alarm, and
with a hung worker killed; the shipped word problems against their generator; the docs example;
two GRPO steps on the shipped config.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
from gymnasium.utils.env_checker import check_env

from agent_grpo.config.base import load_config
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.envs import math_verdicts
from agent_grpo.envs.answers import number_verdict, parse_number
from agent_grpo.envs.dataset import DatasetEnv, DatasetEnvConfig
from agent_grpo.envs.dataset_rows import PACKAGE_DIR, SHIPPED_FILES
from agent_grpo.envs.math_verdicts import NO_VERDICT, math_equivalent, math_verdict, regex_verdict
from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import (
    HELDOUT_SEEDS,
    heldout_seeds,
    read_step_info,
    run_expert,
    train_seeds,
)

ROOT = Path(__file__).resolve().parents[2]
TRAIN = [{"q": f"What is {n} + {n}?", "a": str(2 * n)} for n in range(1, 9)]
TEST = [{"q": "What is 100 + 100?", "a": "200"}, {"q": "What is 1 + 1?", "a": "2"}]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def files(
    tmp: Path, train: list[dict[str, Any]] = TRAIN, test: list[dict[str, Any]] = TEST
) -> dict:
    """Dataset-v0 kwargs for a train and a test JSONL file in `tmp`, columns `q` and `a`."""
    data_files = {"train": write_jsonl(tmp / "train.jsonl", train),
                  "test": write_jsonl(tmp / "test.jsonl", test)}  # fmt: skip
    return {"data_files": data_files, "prompt_column": "q", "answer_column": "a"}


def prompt(env: Any, seed: int) -> str:
    return env.reset(seed=seed)[0][1]["content"]


def shipped(split: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for line in (PACKAGE_DIR / SHIPPED_FILES[split]).read_text().split("\n")
        if line
    ]


# --- the environment ---


@pytest.mark.parametrize("kwargs", [{}, {"tools": ["calculator"]}], ids=["plain", "calculator"])
def test_check_env_passes_and_the_expert_solves_heldout(kwargs: dict[str, Any]) -> None:
    env = make_env("agent_grpo/Dataset-v0", **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    episodes = [run_expert(env, seed) for seed in heldout_seeds(20)]
    assert all(e.success and e.reward == 1.0 and e.turns == 1 for e in episodes)
    assert ('"name": "calculator"' in episodes[0].messages[0].content) == bool(kwargs)


def test_default_is_the_shipped_word_problems() -> None:
    env = DatasetEnv()
    assert [len(env.tasks["train"]), len(env.tasks["heldout"])] == [300, 100]
    assert env.tasks["heldout"][0].prompt == shipped("test")[0]["question"]
    assert env.tasks["heldout"][0].answer == str(shipped("test")[0]["answer"])


def test_shipped_files_are_the_generators_output(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "make_word_problems.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True,
                   capture_output=True)  # fmt: skip
    for name in SHIPPED_FILES.values():
        assert (tmp_path / Path(name).name).read_bytes() == (PACKAGE_DIR / name).read_bytes()
    train, test = (
        {r["question"] for r in shipped("train")},
        {r["question"] for r in shipped("test")},
    )
    assert len(train) == 300 and len(test) == 100 and not train & test
    for row in shipped("train") + shipped("test"):  # the expression is the story's arithmetic
        assert eval(row["expression"]) == row["answer"]


def test_expert_call_shows_the_tool_then_answers() -> None:
    config = load_config(TrainConfig, ROOT / "configs/dataset-arithmetic.yaml")
    env = make_env(config.env.id, **config.env.kwargs)
    episode = run_expert(env, heldout_seeds(1)[0])
    assert episode.success and episode.turns == 2
    assert '"name": "calculator"' in episode.messages[2].content
    assert episode.messages[3].content == str(shipped("test")[0]["answer"])


# --- column mapping ---

MAPPING_ERRORS: dict[str, tuple[dict[str, Any], str]] = {
    "prompt column": ({"prompt_column": "question"},
                      r"^prompt_column 'question' is not a column of 'test'; its columns: q, a$"),
    "answer column": ({"answer_column": "solution"},
                      r"^answer_column 'solution' is not a column of 'test'; its columns: q, a$"),
    "expert column": ({"tools": ["calculator"], "expert_call": {"tool": "calculator",
                       "arguments": {"expression": "expr"}}},
                      r"^expert_call column 'expr' is not a column of 'test'; its columns: q, a$"),
    "split": ({"heldout_split": "validation"},
              r"^the dataset has no split 'validation'; its splits: test, train$"),
    "unknown kwarg": ({"prompt_col": "q"},
                      r"^Dataset-v0 kwargs: prompt_col: Extra inputs .* \(known: .*prompt_column"),
    "verifier": ({"verifier": "fuzzy"}, r"^Dataset-v0 kwargs: verifier: Input should be 'math'"),
    "answer pattern": ({"answer_pattern": r"####\s*(.+)"},
                       r"^answer_pattern finds nothing in row 0 of 'test': '200'$"),
    "tool": ({"tools": ["abacus"]}, r"^unknown tool 'abacus': use calculator, python or module"),
    "not a tool": ({"tools": ["json:dumps"]}, r"^'json:dumps' is not a Tool"),
    "expert tool": ({"expert_call": {"tool": "calculator", "arguments": {}}},
                    r"^expert_call tool 'calculator' is not in tools$"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(MAPPING_ERRORS))
def test_mapping_errors_are_one_line_naming_what_there_is(tmp_path: Path, case: str) -> None:
    overrides, message = MAPPING_ERRORS[case]
    with pytest.raises(ValueError) as error:
        make_env("agent_grpo/Dataset-v0", **{**files(tmp_path), **overrides})
    assert "\n" not in str(error.value)
    assert re.search(message, str(error.value)), str(error.value)


@pytest.mark.parametrize("row", [{"q": "What is 5 + 5?"}, {"q": "What is 5 + 5?", "a": None}],
                         ids=["missing", "null"])  # fmt: skip
def test_a_row_without_an_answer_is_one_line_never_the_reference_none(
    tmp_path: Path, row: dict[str, Any]
) -> None:
    # `datasets` fills a missing cell with None, which once became the reference "None": the
    # expert demonstrated `Answer: None` and the exact verifier rewarded it
    with pytest.raises(ValueError, match=r"^row 1 of 'train' has no 'a' \(answer_column\)$"):
        make_env("agent_grpo/Dataset-v0", **files(tmp_path, train=[TRAIN[0], row, *TRAIN[1:]]))


def test_data_files_that_do_not_load_are_one_line(tmp_path: Path) -> None:
    kwargs = files(tmp_path)
    missing = {**kwargs["data_files"], "train": str(tmp_path / "nothere.jsonl")}
    with pytest.raises(ValueError, match=r"^dataset 'json': Unable to find '.*nothere.jsonl'"):
        make_env("agent_grpo/Dataset-v0", **{**kwargs, "data_files": missing})
    (tmp_path / "train.csv").write_text("q,a\nWhat is 1 + 1?,2\nWhat is 2 + 2?,4,extra\n")
    (tmp_path / "test.csv").write_text("q,a\nWhat is 3 + 3?,6\n")
    csv = {"train": str(tmp_path / "train.csv"), "test": str(tmp_path / "test.csv")}
    with pytest.raises(ValueError, match=r"^dataset 'csv' does not load: .*Expected 2 fields"
                       ) as error:  # fmt: skip
        make_env("agent_grpo/Dataset-v0", **{**kwargs, "data_files": csv})
    assert "\n" not in str(error.value)


def test_missing_heldout_rows_and_empty_training_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^the data file of split 'test' is empty: /"):
        make_env("agent_grpo/Dataset-v0", **files(tmp_path, test=[]))
    with pytest.raises(ValueError, match="every prompt of split 'train' is also held out"):
        make_env("agent_grpo/Dataset-v0", **files(tmp_path, train=TEST))


# --- seeds and splits ---


def test_seeds_pick_rows_reproducibly() -> None:
    first, second = DatasetEnv(), DatasetEnv()
    seeds = train_seeds(40)
    forward = [prompt(first, s) for s in seeds]
    assert [prompt(second, s) for s in reversed(seeds)] == forward[::-1]  # no state carries over
    assert len(set(forward)) > 30  # different seeds, different rows
    # Pinned: the row a seed picks is part of what a task id means across versions.
    assert prompt(first, 0) == (
        "Yuki has 559 marbles. Yuki buys 67 crates with 30 marbles in each. "
        "How many marbles does Yuki have now?"
    )


def test_heldout_split_never_appears_in_training(tmp_path: Path) -> None:
    # Test row "What is 1 + 1?" is also a train row: the dataset's splits overlap.
    env = make_env("agent_grpo/Dataset-v0", **files(tmp_path))
    held = {row["q"] for row in TEST}
    trained = {prompt(env, s) for s in train_seeds(500)}
    assert trained == {row["q"] for row in TRAIN} - held
    assert not trained & held
    assert all(env.reset(seed=s)[1]["split"] == "train" for s in train_seeds(20))


def test_heldout_seeds_walk_the_heldout_split_in_order(tmp_path: Path) -> None:
    env = make_env("agent_grpo/Dataset-v0", **files(tmp_path))
    assert [prompt(env, s) for s in heldout_seeds(4)] == [row["q"] for row in TEST * 2]
    assert prompt(env, HELDOUT_SEEDS.start + 1) == TEST[1]["q"]
    assert (
        DatasetEnv().reset(seed=heldout_seeds(100)[-1])[0][1]["content"]
        == (shipped("test")[-1]["question"])
    )


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_csv_and_parquet_files_give_the_same_tasks(tmp_path: Path, fmt: str) -> None:
    import datasets

    jsonl = make_env("agent_grpo/Dataset-v0", **files(tmp_path)).unwrapped
    data_files = {}
    for split, rows in (("train", TRAIN), ("test", TEST)):
        path = tmp_path / f"{split}.{fmt}"
        table = datasets.Dataset.from_list(rows)
        table.to_csv(str(path), index=False) if fmt == "csv" else table.to_parquet(str(path))
        data_files[split] = str(path)
    other = make_env("agent_grpo/Dataset-v0", data_files=data_files, prompt_column="q",
                     answer_column="a").unwrapped  # fmt: skip
    assert other.tasks == jsonl.tasks  # type: ignore[attr-defined]


def test_relative_files_are_found_here_then_in_the_package(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    env = DatasetEnv(data_files=SHIPPED_FILES)  # no data/ here: the package's files
    assert len(env.tasks["heldout"]) == 100
    (tmp_path / "data").mkdir()
    for split, rows in (("train", TRAIN), ("test", TEST)):
        write_jsonl(tmp_path / SHIPPED_FILES[split], rows)
    env = DatasetEnv(data_files=SHIPPED_FILES, prompt_column="q", answer_column="a")
    assert [t.prompt for t in env.tasks["heldout"]] == [row["q"] for row in TEST]


def test_a_config_next_to_its_data_trains_from_any_directory(
    tmp_path: Path, monkeypatch: Any
) -> None:
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    write_jsonl(project / "data" / "train.jsonl", TRAIN)
    write_jsonl(project / "data" / "test.jsonl", TEST)
    (project / "job.yaml").write_text(
        "env:\n  id: agent_grpo/Dataset-v0\n  kwargs:\n    prompt_column: q\n"
        "    answer_column: a\n    data_files: {train: data/train.jsonl, test: [data/test.jsonl]}\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(TrainConfig, project / "job.yaml")
    data_files = config.env.kwargs["data_files"]
    assert data_files == {"train": str(project / "data" / "train.jsonl"),
                          "test": [str(project / "data" / "test.jsonl")]}  # fmt: skip
    env = DatasetEnv(**config.env.kwargs)
    assert [t.prompt for t in env.tasks["heldout"]] == [row["q"] for row in TEST]
    # a file that exists from here keeps meaning the one here
    (elsewhere / "data").mkdir()
    write_jsonl(elsewhere / "data" / "train.jsonl", TRAIN[:3])
    config = load_config(TrainConfig, project / "job.yaml")
    assert config.env.kwargs["data_files"]["train"] == "data/train.jsonl"


def _chat(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in turns]


def test_trl_conversational_prompts_become_the_episode_messages(tmp_path: Path) -> None:
    train = [{"prompt": _chat(("user", f"What is {n} + {n}?")), "a": str(2 * n)}
             for n in range(1, 5)]  # fmt: skip
    chat = _chat(("system", "You are terse."), ("user", "Hi"), ("assistant", "Hello."),
                 ("user", "What is 1 + 1?"))  # fmt: skip
    test = [
        {"prompt": chat, "a": "2"},
        {"prompt": _chat(("user", "What is 100 + 100?")), "a": "200"},
    ]
    kwargs = files(tmp_path, train, test) | {"prompt_column": "prompt", "tools": ["calculator"]}
    env = make_env("agent_grpo/Dataset-v0", **kwargs)
    messages, _ = env.reset(seed=heldout_seeds(2)[0])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("You are terse.")  # the row's own system prompt
    assert "calculator" in messages[0]["content"]  # with the tool list after it
    assert messages[1:] == test[0]["prompt"][1:]  # as written, not the text of a Python list
    messages, _ = env.reset(seed=heldout_seeds(2)[1])
    assert messages[1:] == [{"role": "user", "content": "What is 100 + 100?"}]
    assert messages[0]["content"].startswith("Solve the problem.")  # no system message: ours
    messages, _ = env.reset(seed=train_seeds(1, __import__("random").Random(0))[0])
    assert messages[1]["content"].startswith("What is") and len(messages) == 2
    check_env(make_env("agent_grpo/Dataset-v0", **kwargs).unwrapped, skip_render_check=True)


@pytest.mark.parametrize(
    ("cell", "problem"),
    [
        ({"role": "user", "content": "hi"}, "holds dict"),
        ([1, 2], "not chat messages"),
        ([{"role": "robot", "content": "hi"}], "not chat messages"),
        (_chat(("user", "a"), ("system", "b")), "system message may only come first"),
        (_chat(("user", "a"), ("assistant", "b")), "must end with a user message"),
    ],
    ids=["dict", "list-of-numbers", "unknown-role", "late-system", "ends-with-assistant"],
)
def test_a_prompt_cell_that_is_neither_text_nor_messages_is_one_line(
    tmp_path: Path, cell: Any, problem: str
) -> None:
    # in both splits: `datasets` casts every split to one schema, so a dict cell next to text
    # cells arrives as its JSON text (a text prompt, which it then is)
    kwargs = files(tmp_path, [{"prompt": cell, "a": "4"}], [{"prompt": cell, "a": "2"}])
    with pytest.raises(ValueError, match=re.escape(problem)) as error:
        DatasetEnv(**kwargs | {"prompt_column": "prompt"})
    assert "row 0 of 'test'" in str(error.value) and "\n" not in str(error.value)


# --- verifiers ---

# Each row checked by hand: (reference, the model's answer line, equal?).
MATH_TABLE = [
    ("72", "72", True),
    ("72", "72.0", True),
    ("1234", "1,234", True),
    ("1,234", "1234", True),
    ("-3", "- 3", True),
    ("72", "73", False),
    ("\\frac{1}{2}", "0.5", True),
    ("\\frac{1}{2}", "1/2", True),
    ("0.5", "\\frac12", True),
    ("0.5", "$\\frac{1}{2}$", True),
    ("0.33", "1/3", False),
    ("\\sqrt{2}", "2^{1/2}", True),
    ("\\sqrt{2}", "1.41421356", True),  # math-verify compares numbers rounded to 6 places
    ("\\sqrt{2}", "1.414", False),
    ("x + 1", "1 + x", True),
    ("2x", "x + x", True),
    ("x + 1", "x + 2", False),
    ("\\{1, 2\\}", "\\{2, 1\\}", True),
    ("10\\%", "0.1", True),
    ("\\pi", "3.14159", False),
    ("12", "\\boxed{12}", True),
    ("12", "12 apples", True),
    ("5", "five", False),
    ("1", "1" * 5000, False),
]


@pytest.mark.parametrize(("expected", "answer", "equal"), MATH_TABLE)
def test_math_verdicts_hand_checked(expected: str, answer: str, equal: bool) -> None:
    verdict = math_verdict(f"Let me see.\nAnswer: {answer}", expected)
    assert verdict.success is equal, verdict
    assert verdict.reward == float(equal)


def test_math_verdict_needs_an_answer_line() -> None:
    verdict = math_verdict("The result is 72.", "72")
    assert not verdict.success and verdict.detail == "no 'Answer:' line"


def test_math_verify_runs_off_the_main_thread() -> None:
    results: list[bool | None] = []
    threads = [threading.Thread(target=lambda: results.append(math_equivalent("1/2", "0.5")))
               for _ in range(6)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == [True] * 6


def test_math_verify_leaves_this_process_alarm_alone() -> None:
    # math-verify run here would call signal.alarm(0) after each step, cancelling this timer.
    old_handler = signal.signal(signal.SIGALRM, lambda *_: None)
    old_delay, _ = signal.setitimer(signal.ITIMER_REAL, 1000.0)
    try:
        assert math_equivalent("2x", "x + x") is True
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
    finally:
        signal.setitimer(signal.ITIMER_REAL, old_delay)
        signal.signal(signal.SIGALRM, old_handler)
    assert 900 < remaining <= 1000


def test_a_hung_worker_is_killed_and_replaced(monkeypatch: Any) -> None:
    hang = "import time; print('ready', flush=True); time.sleep(600)"
    monkeypatch.setattr(math_verdicts, "WORKER_COMMAND", [sys.executable, "-c", hang])
    monkeypatch.setattr(math_verdicts, "MAX_STEPS", 1)
    monkeypatch.setattr(math_verdicts, "GRACE_S", 0.0)
    math_verdicts._stop_worker()
    started = time.perf_counter()
    verdict = math_verdict("Answer: 3", "3", timeout_s=1)
    assert time.perf_counter() - started < 10
    assert not verdict.success and verdict.detail == NO_VERDICT
    assert math_verdicts._worker is None  # killed; the next check starts a fresh one
    monkeypatch.undo()
    assert math_equivalent("3", "3.0") is True


def test_regex_and_exact_verifiers(tmp_path: Path) -> None:
    train = [{"q": "Name a primary colour.", "a": "(?i)(red|blue|yellow)"}]
    test = [{"q": "Name a vowel.", "a": "[aeiou]"}]
    env = make_env("agent_grpo/Dataset-v0", **files(tmp_path, train, test), verifier="regex")
    env.reset(seed=train_seeds(1)[0])
    assert env.step("Answer: Blue")[1] == 1.0
    env.reset(seed=heldout_seeds(1)[0])
    assert read_step_info(env.step("Answer: b")[4]).verifier == {
        "success": False, "reward": 0.0, "expected": "[aeiou]", "given": "b", "detail": "no match"
    }  # fmt: skip
    assert regex_verdict("Answer: e", "[aeiou]").success
    assert not regex_verdict("Answer: ea", "[aeiou]").success  # the whole answer must match
    with pytest.raises(NotImplementedError):
        env.unwrapped.expert_action()  # type: ignore[attr-defined]
    (tmp_path / "exact").mkdir()
    exact = make_env("agent_grpo/Dataset-v0", **files(tmp_path / "exact"), verifier="exact")
    exact.reset(seed=heldout_seeds(1)[0])
    assert exact.step("Answer: 200.0")[1] == 0.0  # exact: text, not value


def test_gsm8k_style_answer_pattern(tmp_path: Path) -> None:
    rows = [
        {"question": "Q1", "answer": "Step one.\n#### 1,234"},
        {"question": "Q2", "answer": "#### 5"},
    ]
    kwargs = {"data_files": {"train": write_jsonl(tmp_path / "a.jsonl", rows[:1]),
                             "test": write_jsonl(tmp_path / "b.jsonl", rows[1:])},
              "answer_pattern": r"####\s*(.+)"}  # fmt: skip
    env = make_env("agent_grpo/Dataset-v0", **kwargs)
    env.reset(seed=train_seeds(1)[0])
    assert env.unwrapped.task.answer == "1,234"  # type: ignore[attr-defined]
    assert env.step("Answer: 1234")[1] == 1.0


def test_tools_by_path() -> None:
    env = DatasetEnv(tools=["agent_grpo.tools.calculator:calculator"])
    assert [t.name for t in env.tools] == ["calculator"]


def test_over_long_numbers_are_wrong_answers() -> None:
    assert parse_number("1" * 5000) is None
    assert parse_number("1" * 1000) == int("1" * 1000)
    verdict = number_verdict("Answer: " + "9" * 5000, 9)
    assert not verdict.success and verdict.detail == "no number"
    assert math_verdict("Answer: " + "9" * 5000, "9").detail == "too long"


# --- the docs page and the shipped config ---


def docs_blocks(kind: str) -> list[str]:
    return re.findall(
        rf"```{kind}\n(.*?)```", (ROOT / "docs" / "datasets.md").read_text(), re.DOTALL
    )


def test_docs_example_runs(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    monkeypatch.chdir(tmp_path)
    python, yaml_config = docs_blocks("python")[0], docs_blocks("yaml")[0]
    exec(compile(python, "docs/datasets.md", "exec"), {"__name__": "__main__"})
    assert "'success': True" in capsys.readouterr().out
    (tmp_path / "my-data.yaml").write_text(yaml_config)
    config = load_config(TrainConfig, tmp_path / "my-data.yaml")
    env = make_env(config.env.id, **config.env.kwargs)
    assert prompt(env, heldout_seeds(1)[0]) == "What is 7 * 8?"


CAPITALS = [("France", "Paris"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Japan", "Tokyo")]


def capitals_example(tmp_path: Path, monkeypatch: Any) -> TrainConfig:
    """The docs' MCP example written into `tmp_path` (the current directory), with its data:
    the config it loads. `python` in the server command is this interpreter."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    server = next(b for b in docs_blocks("python") if b.startswith("# capitals_server.py"))
    (tmp_path / "capitals_server.py").write_text(server)
    rows = [{"q": f"What is the capital of {c}?", "a": city, "country": c} for c, city in CAPITALS]
    (tmp_path / "capitals").mkdir()
    write_jsonl(tmp_path / "capitals" / "train.jsonl", rows[:2])
    write_jsonl(tmp_path / "capitals" / "test.jsonl", rows[2:])
    config = next(b for b in docs_blocks("yaml") if b.startswith("# capitals.yaml"))
    (tmp_path / "capitals.yaml").write_text(config)
    return load_config(TrainConfig, tmp_path / "capitals.yaml")


def test_docs_mcp_example_calls_the_servers_tool(tmp_path: Path, monkeypatch: Any) -> None:
    config = capitals_example(tmp_path, monkeypatch)
    env = make_env(config.env.id, **config.env.kwargs)
    check_env(env.unwrapped, skip_render_check=True)  # starts the server
    episodes = [run_expert(env, seed) for seed in heldout_seeds(2)]
    assert [e.success for e in episodes] == [True, True]
    assert [e.messages[3].content for e in episodes] == ["Nairobi", "Tokyo"]  # the server's
    messages, _ = env.reset(seed=heldout_seeds(1)[0])
    assert '"name": "capital"' in messages[0]["content"]  # the schema the model sees
    call = '<tool_call>{"name": "capital", "arguments": {"country": "Mars"}}</tool_call>'
    observation = env.step(call)[0][0]["content"]
    assert observation.startswith("Error: tool capital raised McpToolError: no country 'Mars'")
    env.close()
    assert not env.unwrapped.workspace.workdir.exists()  # type: ignore[attr-defined]


def test_a_server_tool_named_like_a_listed_tool_is_one_line_at_the_first_reset(
    tmp_path: Path, monkeypatch: Any
) -> None:
    config = capitals_example(tmp_path, monkeypatch)
    server = tmp_path / "capitals_server.py"
    server.write_text(server.read_text().replace("def capital(", "def calculator("))
    env = make_env(config.env.id, **{**config.env.kwargs, "tools": ["calculator"],
                                     "expert_call": None})  # fmt: skip
    with pytest.raises(ValueError, match=r"^Dataset-v0: the MCP server's tools \['calculator'\] "
                                         r"clash with tools'$"):  # fmt: skip
        env.reset(seed=heldout_seeds(1)[0])
    env.close()


def test_an_expert_call_to_no_tool_is_one_line_at_the_first_reset(
    tmp_path: Path, monkeypatch: Any
) -> None:
    config = capitals_example(tmp_path, monkeypatch)
    expert_call = {"tool": "capitol", "arguments": {"country": "country"}}
    env = make_env(config.env.id, **{**config.env.kwargs, "expert_call": expert_call})
    with pytest.raises(ValueError, match=r"^expert_call tool 'capitol' is neither in tools nor "
                                         r"the MCP server's \['capital'\]$"):  # fmt: skip
        env.reset(seed=heldout_seeds(1)[0])
    env.close()


def test_docs_table_lists_every_kwarg() -> None:
    text = (ROOT / "docs" / "datasets.md").read_text()
    for field in DatasetEnvConfig.model_fields:
        assert f"| `{field}` |" in text, field


@pytest.mark.slow
def test_two_grpo_steps_on_the_shipped_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    from agent_grpo.trainer.loop import train

    overrides = [f"model.name_or_path={tiny_model_dir}", f"run.root={tmp_path}", "run.name=d",
                 "steps=2", "rollout.tasks_per_step=2", "rollout.group_size=2",
                 "rollout.sampling.max_tokens=16", "warm_start.demos=2", "warm_start.batch_size=2",
                 "eval.tasks=2", "eval.max_tokens=16", "run.tensorboard=false"]  # fmt: skip
    run = train(load_config(TrainConfig, ROOT / "configs/dataset-arithmetic.yaml", overrides))
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [0, 1]
    train_prompts = {row["question"] for row in shipped("train")}
    records = [json.loads(line) for path in sorted((run / "trajectories").glob("step_*.jsonl"))
               for line in path.read_text().splitlines()]  # fmt: skip
    assert len(records) == 2 * 2 * 2  # steps x tasks x group size
    for record in records:
        assert record["messages"][1]["content"] in train_prompts
        assert record["seed"] not in HELDOUT_SEEDS
