"""Verifiers-v0 against the real verifiers package, offline: tasksets built here from verifiers'
own classes, their `@vf.reward`s as the reward, their `@vf.tool`s run on the model's calls, and
every bad input one line before any model work."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from gymnasium.utils.env_checker import check_env

from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import heldout_seeds, read_step_info, run_expert, train_seeds

vf = pytest.importorskip("verifiers.v1", reason="pip install 'agent-grpo[verifiers]'")

ENV = "agent_grpo/Verifiers-v0"
DOCS = Path(__file__).parents[2] / "docs" / "environments.md"


class Sum(vf.TaskData):
    """A sum to work out."""

    answer: str


class SumTask(vf.Task[Sum]):
    """Two weighted rewards: 1.0 for the right number, 0.25 for a reply of at most 3 characters."""

    @vf.reward(weight=1.0)
    async def correct(self, task: Sum, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.reward(weight=0.25)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) <= 3)


class SumsConfig(vf.TasksetConfig):
    """How many sums."""

    n: int = 10


class SumTaskset(vf.Taskset[SumTask, SumsConfig]):
    """`n` sums, `i + 1 = ?`, the system prompt on each task."""

    def load(self) -> list[SumTask]:
        return [SumTask(Sum(idx=i, prompt=f"{i} + 1 = ?", system_prompt="Reply with the number.",
                            answer=str(i + 1))) for i in range(self.config.n)]  # fmt: skip


SECRETS = {"owl": "Tessaly", "fox": "Ostrig"}
LOOKUPS: list[str] = []


class Secret(vf.TaskData):
    """A word whose secret the model must look up."""

    word: str


class Vault(vf.Toolset[vf.ToolsetConfig]):
    """A taskset-wide toolset: the secret of a word."""

    @vf.tool
    async def lookup(self, word: str) -> str:
        """The secret of a word."""
        LOOKUPS.append(word)
        return SECRETS[word]


class Hint(vf.Toolset[vf.ToolsetConfig]):
    """A task's own toolset, told its task by `setup_task`."""

    async def setup_task(self, task: Secret) -> None:
        self.word = task.word

    @vf.tool(name="word")
    def which_word(self) -> str:
        """The word of this task."""
        return self.word


class SecretTask(vf.Task[Secret]):
    """Paid for the secret, and a little for having looked it up (read off the trace)."""

    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Hint(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def found(self, task: Secret, trace: vf.Trace) -> float:
        return float(SECRETS[task.word] in trace.last_reply)

    @vf.reward(weight=0.5)
    async def looked_up(self, trace: vf.Trace) -> float:
        return float(any(m.content == SECRETS[w] for m in trace.tool_messages for w in SECRETS))


class SecretTaskset(vf.Taskset[SecretTask, vf.TasksetConfig]):
    """Two words with secrets; the vault is shared by every task."""

    @classmethod
    def toolsets(cls, config: vf.TasksetConfig) -> list[vf.Toolset]:
        return [Vault(vf.ToolsetConfig())]

    def load(self) -> list[SecretTask]:
        return [SecretTask(Secret(idx=i, prompt=f"The secret of {w}?", word=w))
                for i, w in enumerate(SECRETS)]  # fmt: skip


def sums(count: int) -> SumTaskset:
    """A taskset made by a function (its `args` are the function's)."""
    return SumTaskset(SumsConfig(n=count))


def step_reward(env: Any, seed: int, *turns: str) -> float:
    """The reward of playing `turns` from the task of `seed`."""
    env.reset(seed=seed)
    for turn in turns:
        _, reward, terminated, _, _ = env.step(turn)
    assert terminated
    return float(reward)


def test_check_env_passes_and_the_expert_solves_heldout() -> None:
    env = make_env(ENV, taskset=f"{__name__}:SumTaskset", expert_reply="{answer}")
    check_env(env.unwrapped, skip_render_check=True)
    episodes = [run_expert(env, seed) for seed in heldout_seeds(2)]
    assert [e.reward for e in episodes] == [1.25, 1.25] and all(e.success for e in episodes)


def test_the_prompt_is_the_task_own() -> None:
    env = make_env(ENV, taskset=f"{__name__}:SumTaskset")
    messages, _ = env.reset(seed=heldout_seeds(1)[0])
    assert messages == [{"role": "system", "content": "Reply with the number."},
                        {"role": "user", "content": "8 + 1 = ?"}]  # fmt: skip


class FewShotTask(SumTask):
    """Also paid for answering in one turn: the worked example is the prompt's, not a turn."""

    @vf.reward(weight=0.5)
    async def one_turn(self, trace: vf.Trace) -> float:
        return float(trace.num_turns == 1)


class FewShotTaskset(vf.Taskset[FewShotTask, vf.TasksetConfig]):
    """Sums asked as a conversation: its own system message and a worked example."""

    def load(self) -> list[FewShotTask]:
        shots = [vf.SystemMessage(content="Add."), vf.UserMessage(content="1 + 1"),
                 vf.AssistantMessage(content="2")]  # fmt: skip
        return [FewShotTask(Sum(idx=i, prompt=[*shots, vf.UserMessage(content=f"{i} + 1")],
                            answer=str(i + 1))) for i in range(5)]  # fmt: skip


def test_a_messages_prompt_is_the_conversation_its_system_message_first() -> None:
    env = make_env(ENV, taskset=f"{__name__}:FewShotTaskset")
    messages, _ = env.reset(seed=heldout_seeds(1)[0])
    assert messages == [{"role": "system", "content": "Add."}, {"role": "user", "content": "1 + 1"},
                        {"role": "assistant", "content": "2"},
                        {"role": "user", "content": "4 + 1"}]  # fmt: skip
    assert step_reward(env, heldout_seeds(1)[0], "5") == 1.75  # 1.0 + 0.25 + 0.5


@pytest.mark.parametrize(("reply", "reward"), [("9", 1.25), ("9.0", 0.25), ("ten", 0.25),
                         ("it is 9", 0.0)])  # fmt: skip
def test_the_reward_is_the_task_rubric_weighted(reply: str, reward: float) -> None:
    env = make_env(ENV, taskset=f"{__name__}:SumTaskset")
    assert step_reward(env, heldout_seeds(1)[0], reply) == reward  # held-out task 0: 8 + 1


def test_success_is_the_success_reward() -> None:
    env = make_env(ENV, taskset=f"{__name__}:SumTaskset", success_reward=1.25)
    env.reset(seed=heldout_seeds(1)[0])
    *_, info = env.step("9")
    step = read_step_info(info)
    assert step.success and step.verifier is not None
    assert step.verifier["expected"] == "9" and step.verifier["detail"] == "brief=0.25, correct=1"


def test_tool_calls_run_the_toolsets_functions() -> None:
    env = make_env(ENV, taskset=f"{__name__}:SecretTaskset", heldout_fraction=0.5)
    env.reset(seed=heldout_seeds(1)[0])  # the held-out half: fox
    tools = env.unwrapped.tool_map  # type: ignore[attr-defined]
    assert sorted(tools) == ["hint_word", "vault_lookup"]
    observations, *_ = env.step(env.unwrapped.call("hint_word"))  # type: ignore[attr-defined]
    assert observations == [{"role": "tool", "content": "fox", "name": "hint_word"}]
    LOOKUPS.clear()
    call = env.unwrapped.call("vault_lookup", word="fox")  # type: ignore[attr-defined]
    observations, *_ = env.step(call)
    assert observations[0]["content"] == "Ostrig" and LOOKUPS == ["fox"]
    _, reward, terminated, _, _ = env.step("It is Ostrig.")
    assert terminated and reward == 1.5  # found (1.0) + looked it up, read off the trace (0.5)
    assert step_reward(env, heldout_seeds(1)[0], "It is Ostrig.") == 1.0  # no lookup this time


def test_seeds_index_tasks_and_training_never_sees_a_heldout_one() -> None:
    env = make_env(ENV, taskset=f"{__name__}:SumTaskset")
    prompt = lambda seed: env.reset(seed=seed)[0][1]["content"]  # noqa: E731
    heldout = [prompt(s) for s in heldout_seeds(3)]
    assert heldout == ["8 + 1 = ?", "9 + 1 = ?", "8 + 1 = ?"]  # the last 20%, walked in order
    train = {prompt(s) for s in train_seeds(60, random.Random(0))}
    assert train == {f"{i} + 1 = ?" for i in range(8)}
    assert all(prompt(s) == prompt(s) for s in train_seeds(5, random.Random(1)))


@pytest.mark.parametrize("taskset", ["SumTaskset", "sums"])
def test_heldout_args_build_the_heldout_tasks_and_overlap_is_dropped(taskset: str) -> None:
    key = "n" if taskset == "SumTaskset" else "count"  # the config's field, or the argument
    env = make_env(ENV, taskset=f"{__name__}:{taskset}", args={key: 6}, heldout_args={key: 2})
    tasks = env.unwrapped.tasks  # type: ignore[attr-defined]
    assert [t.data.prompt for t in tasks["heldout"]] == ["0 + 1 = ?", "1 + 1 = ?"]
    assert [t.data.prompt for t in tasks["train"]] == [f"{i} + 1 = ?" for i in range(2, 6)]


def test_the_default_is_the_shipped_verifiers_word_problems() -> None:
    env = make_env(ENV, expert_reply="Answer: {answer}", max_turns=3)
    check_env(env.unwrapped, skip_render_check=True)
    messages, _ = env.reset(seed=heldout_seeds(1)[0])
    assert "calculator_calculate" in messages[0]["content"]
    call = env.unwrapped.call("calculator_calculate", expression="(2 + 4) / 4")  # type: ignore[attr-defined]
    assert env.step(call)[0][0]["content"] == "1.5"
    assert run_expert(env, heldout_seeds(1)[0]).reward == 1.0
    assert step_reward(env, heldout_seeds(1)[0], "Answer: 0") == 0.0


def test_a_reward_plugged_by_the_task_config_is_scored() -> None:
    plugged = {"task": {"rewards": {"correct": {"weight": 2.0}}}}
    env = make_env(ENV, args=plugged, heldout_args={**plugged, "split": "test"})
    env.reset(seed=heldout_seeds(1)[0])
    *_, info = env.step("Answer: 1790")  # the first test problem's answer
    assert read_step_info(info).verifier["detail"] == "correct=2"  # type: ignore[index]
    assert step_reward(env, heldout_seeds(1)[0], "Answer: 1790") == 2.0


class Tally(vf.State):
    """What the episode's tools have counted."""

    count: int = 0


class Counter(vf.Toolset[vf.ToolsetConfig, Tally]):
    """A stateful toolset whose tool is advertised bare (`TOOL_PREFIX = None`)."""

    TOOL_PREFIX = None

    @vf.tool
    async def tick(self) -> str:
        """Count one more."""
        self.state.count += 1
        return str(self.state.count)


class CountTask(vf.Task[Sum, Tally]):
    """Paid the number of ticks, read off `trace.state`."""

    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Counter(vf.ToolsetConfig())]

    @vf.reward
    async def ticks(self, trace: vf.Trace) -> float:
        return float(trace.state.count)


class CountTaskset(vf.Taskset[CountTask, vf.TasksetConfig]):
    def load(self) -> list[CountTask]:
        return [CountTask(Sum(prompt=str(i), answer="1")) for i in range(3)]


def test_a_stateful_toolset_shares_the_episode_state_with_the_rewards() -> None:
    env = make_env(ENV, taskset=f"{__name__}:CountTaskset")
    env.reset(seed=0)
    tick = env.unwrapped.call("tick")  # type: ignore[attr-defined]
    outputs = [env.step(tick)[0][0]["content"] for _ in range(3)]
    assert outputs == ["1", "2", "3"]
    assert env.step("done")[1] == 3.0
    assert step_reward(env, 0, tick, "done") == 1.0  # a new episode starts from a fresh state


class RaisingTask(SumTask):
    @vf.reward
    async def crashes(self, task: Sum) -> float:
        return float(task.answer["x"])  # type: ignore[index]  # the line the error names


class RaisingTaskset(vf.Taskset[RaisingTask, vf.TasksetConfig]):
    def load(self) -> list[RaisingTask]:
        return [RaisingTask(Sum(idx=i, prompt=str(i), answer="1")) for i in range(3)]


def test_a_reward_that_raises_is_one_line_naming_it() -> None:
    env = make_env(ENV, taskset=f"{__name__}:RaisingTaskset")
    env.reset(seed=0)
    with pytest.raises(ValueError) as error:
        env.step("1")
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "the line the error names" in text)  # fmt: skip
    where = f"in crashes ({__file__}:{line})"
    assert str(error.value) == (f"verifiers scoring of RaisingTask failed {where}: TypeError: "
                                "string indices must be integers, not 'str'")  # fmt: skip


class SyncTask(SumTask):
    @vf.reward
    def sync(self) -> float:
        return 1.0


class RuntimeTask(SumTask):
    @vf.reward
    async def in_sandbox(self, runtime: vf.Runtime) -> float:
        return 1.0


def tasks_of(task_type: type) -> Any:
    """A taskset of three tasks of `task_type`."""

    class Tasks(vf.Taskset):
        def load(self) -> list[Any]:
            return [task_type(Sum(idx=i, prompt=str(i), answer="1")) for i in range(3)]

    return Tasks(vf.TasksetConfig())


def sync_tasks() -> Any:
    return tasks_of(SyncTask)


def runtime_tasks() -> Any:
    return tasks_of(RuntimeTask)


def unrewarded_tasks() -> Any:
    return tasks_of(vf.Task)


class SetupTask(SumTask):
    async def setup(self, trace: vf.Trace, runtime: vf.Runtime) -> None:
        return None


def setup_tasks() -> Any:
    return tasks_of(SetupTask)


class EndlessTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self) -> Any:
        return (SumTask(Sum(prompt=str(i), answer="1")) for i in itertools.count())


def plain_reward(trace: vf.Trace) -> float:
    """A reward a task config plugs in, not `async def`."""
    return 1.0


def empty() -> Any:
    return sums(0)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [({"taskset": "no_such_taskset"}, "verifiers taskset 'no_such_taskset' cannot be loaded: "
      "ModuleNotFoundError: taskset 'no_such_taskset' not found"),
     ({"taskset": f"{__name__}:Nope"}, f"verifiers taskset '{__name__}:Nope' cannot be loaded: "
      "AttributeError"),
     ({"taskset": "org/no_such_taskset"}, "cannot be loaded: ModuleNotFoundError: taskset "
      "'org/no_such_taskset' not found"),
     ({"taskset": f"{__name__}:EndlessTaskset"}, "is infinite"),
     ({"taskset": f"{__name__}:SumTaskset", "args": {"colour": "red"}}, "args {'colour': 'red'}: "
      "colour: Extra inputs are not permitted"),
     ({"taskset": f"{__name__}:empty"}, "has no tasks"),
     ({"taskset": f"{__name__}:sums", "args": {"count": 1}}, "no training task is left"),
     ({"taskset": f"{__name__}:sync_tasks"},
      "SyncTask.sync must be `async def`"),
     ({"taskset": f"{__name__}:runtime_tasks"},
      "RuntimeTask.in_sandbox needs a runtime"),
     ({"taskset": f"{__name__}:unrewarded_tasks"}, "has no @vf.reward"),
     ({"taskset": f"{__name__}:setup_tasks"}, "SetupTask.setup runs with a runtime"),
     ({"heldout_args": {"split": "test", "task": {"rewards": {"plain": {
         "fn": f"{__name__}:plain_reward"}}}}}, "WordProblemTask.plain must be `async def`"),
     ({"taskset": f"{__name__}:SumTaskset", "expert_reply": "{solution}"},
      "expert_reply '{solution}' names 'solution', which the task data lacks"),
     ({"tasket": "x"}, "Verifiers-v0 kwargs: tasket: Extra inputs are not permitted")],
    ids=["unknown-id", "unknown-attribute", "hub-id", "infinite", "bad-args", "no-tasks",
         "no-training-task", "sync-reward", "runtime-reward", "no-reward", "runtime-setup",
         "heldout-sync-reward",
         "bad-expert", "unknown-kwarg"],
)  # fmt: skip
def test_bad_input_is_one_line(kwargs: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError) as error:
        make_env(ENV, **kwargs)
    assert problem in str(error.value) and "\n" not in str(error.value)


def test_a_missing_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent_grpo.envs import verifiers_tasks

    real = verifiers_tasks.importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "verifiers" else real(name, *args)

    monkeypatch.setattr(verifiers_tasks.importlib.util, "find_spec", find_spec)
    with pytest.raises(ImportError, match=r"^Verifiers-v0 needs verifiers: pip install "):
        make_env(ENV, taskset=f"{__name__}:SumTaskset")


def test_another_verifiers_release_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent_grpo.envs import verifiers_tasks

    monkeypatch.setattr(verifiers_tasks, "_installed_version", lambda: "0.2.0")
    with pytest.raises(ImportError) as error:
        make_env(ENV, taskset=f"{__name__}:SumTaskset")
    expected = "Verifiers-v0 follows verifiers 0.4.0's v1 API, not 0.2.0's: pip install --no-deps "
    assert str(error.value).startswith(expected + "verifiers==0.4.0 ")
    assert "\n" not in str(error.value)


def docs_example() -> dict[str, Any]:
    """The YAML block of the docs' verifiers section."""
    section = DOCS.read_text().split("### verifiers' environments", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL)
    assert block is not None
    return yaml.safe_load(block.group(1))


def test_the_docs_example_trains_two_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    from agent_grpo.testing.cli_runs import metrics, tiny_train

    env = docs_example()["env"]
    assert step_reward(make_env(env["id"], **env["kwargs"]), heldout_seeds(1)[0],
                       "Answer: 1790") == 1.0  # fmt: skip
    run = tiny_train(tmp_path, tiny_model_dir, f"env.id={env['id']}",
                     f"env.kwargs={json.dumps(env['kwargs'])}", "steps=2")  # fmt: skip
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)


def test_an_env_made_inside_a_running_event_loop_still_scores() -> None:
    import asyncio

    async def play() -> float:  # a notebook's case: verifiers' hooks cannot use asyncio.run here
        env = make_env(ENV, taskset=f"{__name__}:SecretTaskset", heldout_fraction=0.5)
        return step_reward(env, heldout_seeds(1)[0], "It is Ostrig.")

    assert asyncio.run(play()) == 1.0
