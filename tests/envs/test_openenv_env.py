"""OpenEnv-v0 against the real openenv package, in process and over a server on localhost: the
prompt is the env's reset observation for the seed, the env's rewards summed are the reward at
the end (truncation included), its `done` is `terminated`, a refused action is an `Error:`
message, and a bad configuration is one line before any model work."""

from __future__ import annotations

import json
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from gymnasium.utils.env_checker import check_env
from pydantic import Field

from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import heldout_seeds, read_step_info, train_seeds

pytest.importorskip("openenv", reason="pip install 'agent-grpo[openenv]'")
uvicorn = pytest.importorskip("uvicorn")

from openenv.core.env_server.http_server import create_fastapi_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from agent_grpo.envs import openenv_guess  # noqa: E402
from agent_grpo.envs.openenv_env import observation_text  # noqa: E402

ENV_ID = "agent_grpo/OpenEnv-v0"
ECHO = f"{__name__}:EchoEnvironment"
GUESS_ACTION = "agent_grpo.envs.openenv_guess:GuessAction"
WORDS = ("apple", "river", "stone", "cloud")


class EchoAction(Action):
    """A message to echo."""

    message: str = Field(description="What to say.")


class EchoObservation(Observation):
    """The echoed message and its length (two fields: rendered as JSON unless one is named)."""

    echoed_message: str = ""
    message_length: int = 0


class EchoEnvironment(Environment):
    """OpenEnv's echo env, plus a seeded word to say: 0.5 for each message with the word, `bye`
    ends the episode, and `crash` is refused by raising."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.word = ""

    def reset(self, seed: int | None = None, **kwargs: Any) -> EchoObservation:
        self.word = random.Random(seed).choice(WORDS)
        return EchoObservation(echoed_message=f"Say {self.word}.")

    def step(self, action: EchoAction, **kwargs: Any) -> EchoObservation:  # type: ignore[override]
        if action.message == "crash":
            raise ValueError("cannot echo 'crash'")
        reward = 0.5 if self.word in action.message else 0.0
        return EchoObservation(echoed_message=action.message, message_length=len(action.message),
                               reward=reward, done=action.message == "bye")  # fmt: skip

    @property
    def state(self) -> State:
        return State()


def secret(seed: int) -> int:
    """The guessing game's number for `seed`, from the package-side env itself."""
    game = openenv_guess.GuessNumberEnvironment()
    game.reset(seed=seed)
    return game.secret


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[[Any], str]]:
    """Start OpenEnv FastAPI apps with uvicorn on localhost (free ports); yields `url_of(app)`."""
    servers: list[tuple[Any, threading.Thread]] = []

    def url_of(app: Any) -> str:
        # log_level critical: OpenEnv's server logs a traceback when a client closes its session.
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        servers.append((server, thread))
        return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

    yield url_of
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def guess_url(serve: Callable[[Any], str]) -> str:
    return serve(openenv_guess.app())


@pytest.fixture(scope="module")
def echo_url(serve: Callable[[Any], str]) -> str:
    return serve(create_fastapi_app(EchoEnvironment, EchoAction, EchoObservation,
                                    max_concurrent_envs=8))  # fmt: skip


@pytest.fixture(scope="module")
def template_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The echo environment OpenEnv's own `openenv init` writes (its template), importable."""
    from openenv.cli.commands.init import init

    root = tmp_path_factory.mktemp("openenv-init")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", str(root))  # no `uv` found: init skips `uv lock`, which needs the net
        init(env_name="tiny_echo", output_dir=str(root))
    sys.path.insert(0, str(root))
    yield "tiny_echo.server.tiny_echo_environment:TinyEchoEnvironment"
    sys.path.remove(str(root))
    for name in [m for m in sys.modules if m == "tiny_echo" or m.startswith("tiny_echo.")]:
        del sys.modules[name]


def where(kind: str, guess_url: str) -> dict[str, str]:
    """The kwargs of the guessing game in process or on its server."""
    if kind == "in-process":
        return {}
    return {"base_url": guess_url, "action": GUESS_ACTION}


def play_binary_search(env: Any) -> tuple[list[tuple[float, bool, bool]], int]:
    """Play the guessing game with `act` calls by bisection on the hints: each step's (reward,
    terminated, truncated), and the last guess."""
    low, high, steps = 1, 100, []
    while True:
        guess = (low + high) // 2
        obs, reward, terminated, truncated, _ = env.step(env.unwrapped.call("act", guess=guess))
        steps.append((reward, terminated, truncated))
        if terminated or truncated:
            return steps, guess
        low, high = (guess + 1, high) if "higher" in obs[0]["content"] else (low, guess - 1)


@pytest.mark.parametrize("kwargs", [{}, {"action_field": "guess"},
                                    {"environment": ECHO, "action_field": "message"}],
                         ids=["tool-mode", "text-mode", "echo-text-mode"])  # fmt: skip
def test_check_env_passes(kwargs: dict[str, str]) -> None:
    env = make_env(ENV_ID, **kwargs)
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


def test_the_env_openenv_init_writes_runs_as_written(template_env: str) -> None:
    env = make_env(ENV_ID, environment=template_env, action_field="message",
                   observation_field="echoed_message", max_turns=2)  # fmt: skip
    check_env(env.unwrapped, skip_render_check=True)
    messages, _ = env.reset(seed=0)  # its reset() takes no seed, so none is passed
    assert messages[1] == {"role": "user", "content": "Tiny Echo environment ready!"}
    assert env.step("hi")[:4] == ([{"role": "user", "content": "hi"}], 0.0, False, False)
    _, reward, terminated, truncated, _ = env.step("hello")
    # 0.1 a character, paid each step and never done: the turn limit ends it, with the sum
    assert (terminated, truncated) == (False, True) and reward == pytest.approx(0.2 + 0.5)
    env.close()


@pytest.mark.parametrize("kind", ["in-process", "server"])
def test_the_prompt_is_the_reset_observation_of_the_seed(kind: str, guess_url: str) -> None:
    env = make_env(ENV_ID, **where(kind, guess_url))
    rules = openenv_guess.GuessNumberEnvironment().reset(seed=0).message
    for seed in [*train_seeds(3, random.Random(0)), *heldout_seeds(2)]:
        messages, info = env.reset(seed=seed)
        assert messages[1] == {"role": "user", "content": rules} and info["seed"] == seed
        assert '"name": "act"' in messages[0]["content"]  # the Action's fields as a tool
    env.close()


@pytest.mark.parametrize("kind", ["in-process", "server"])
def test_done_is_terminated_and_the_reward_is_paid_at_the_end(kind: str, guess_url: str) -> None:
    env = make_env(ENV_ID, **where(kind, guess_url), max_turns=7)
    found = {}
    for seed in heldout_seeds(4):
        env.reset(seed=seed)
        steps, found[seed] = play_binary_search(env)  # bisection finds it within 7 guesses
        assert steps[-1] == (1.0, True, False)
        assert all(s == (0.0, False, False) for s in steps[:-1])
    assert found == {seed: secret(seed) for seed in found}  # the env was reset with our seed
    assert len(set(found.values())) > 1
    env.close()


def test_running_out_of_guesses_is_done_with_reward_zero() -> None:
    env = make_env(ENV_ID, environment_kwargs={"max_guesses": 2}, action_field="guess")
    seed = heldout_seeds(1)[0]
    env.reset(seed=seed)
    wrong = 1 if secret(seed) != 1 else 2
    obs, reward, terminated, *_ = env.step(str(wrong))
    assert (obs[0]["role"], reward, terminated) == ("user", 0.0, False)
    obs, reward, terminated, truncated, info = env.step(str(wrong))
    assert obs[0]["content"].endswith("No guesses left.")
    assert (reward, terminated, truncated, read_step_info(info).success) == (
        0.0,
        True,
        False,
        False,
    )


@pytest.mark.parametrize("kind", ["in-process", "server"])
def test_rewards_are_summed_and_truncation_keeps_them(kind: str, echo_url: str) -> None:
    where_ = {"environment": ECHO} if kind == "in-process" else {"base_url": echo_url}
    env = make_env(ENV_ID, **where_, action_field="message", max_turns=3)
    messages, _ = env.reset(seed=5)
    word = random.Random(5).choice(WORDS)
    # two fields, none named: the observation is its fields as JSON
    assert json.loads(messages[1]["content"]) == {"echoed_message": f"Say {word}.",
                                                  "message_length": 0}  # fmt: skip
    results = [env.step(text)[1:4] for text in (word, "nothing", f"{word}!")]
    assert results == [(0.0, False, False), (0.0, False, False), (1.0, False, True)]  # 0.5 + 0.5
    env.reset(seed=5)
    assert env.step(word)[1:4] == (0.0, False, False)
    _, reward, terminated, truncated, info = env.step("bye")
    assert (reward, terminated, truncated) == (0.5, True, False)
    assert read_step_info(info).success is False  # 0.5 < success_reward 1.0
    env.close()


def test_a_named_observation_field_is_the_text() -> None:
    env = make_env(ENV_ID, environment=ECHO, action_field="message",
                   observation_field="echoed_message")  # fmt: skip
    for seed in range(8):  # the seed reaches the env's reset: each prompt is its seed's word
        messages, _ = env.reset(seed=seed)
        assert messages[1]["content"] == f"Say {random.Random(seed).choice(WORDS)}."
    assert env.step("hello")[0] == [{"role": "user", "content": "hello"}]


def test_observation_text() -> None:
    assert observation_text({"message": "hi"}) == "hi"
    assert observation_text({"a": "x", "b": [1, "é"]}) == '{"a": "x", "b": [1, "é"]}'
    assert observation_text({"a": "x", "b": [1, 2]}, "b") == "[1, 2]"
    with pytest.raises(ValueError, match="no field 'c'; its fields: a, b"):
        observation_text({"a": "x", "b": 1}, "c")


@pytest.mark.parametrize(
    ("kind", "env_kwargs", "action", "error"),
    [("in-process", {"action_field": "guess"}, "fifty",
      "Error: the environment rejected the action: guess: Input should be a valid integer"),
     ("in-process", {"environment": ECHO, "action_field": "message"}, "crash",
      "Error: the environment rejected the action: cannot echo 'crash'"),
     ("server", {"action_field": "guess"}, "fifty",
      "Error: the environment rejected the action: Server error: Invalid message"),
     ("server", {"action_field": "guess", "action": GUESS_ACTION},
      "fifty", "Error: the environment rejected the action: guess: Input should be a valid"),
     ("server", {"environment": ECHO, "action_field": "message"}, "crash",
      "Error: the environment rejected the action: Server error: cannot echo 'crash'")],
    ids=["validation", "step-raises", "server-validation", "server-validation-named",
         "server-step-raises"],
)  # fmt: skip
def test_a_refused_action_is_an_error_message_and_the_episode_goes_on(
    kind: str, env_kwargs: dict[str, str], action: str, error: str, guess_url: str, echo_url: str
) -> None:
    if kind == "server":
        url = echo_url if env_kwargs.get("environment") == ECHO else guess_url
        env_kwargs = {k: v for k, v in env_kwargs.items() if k != "environment"} | {"base_url": url}
    env = make_env(ENV_ID, **env_kwargs)
    env.reset(seed=0)
    obs, reward, terminated, truncated, _ = env.step(action)
    assert obs[0]["role"] == "user" and obs[0]["content"].startswith(error), obs
    assert "\n" not in obs[0]["content"] and (reward, terminated, truncated) == (0, False, False)
    obs, *_ = env.step("1")  # the session still answers
    assert not obs[0]["content"].startswith("Error")
    env.close()


def test_tool_mode_checks_the_action_and_reports_a_raising_step() -> None:
    env = make_env(ENV_ID)
    env.reset(seed=0)
    obs, _, _, _, info = env.step(env.unwrapped.call("act", guess=0))  # type: ignore[attr-defined]
    assert obs[0]["content"].startswith("Error: invalid arguments for act: guess: Input should "
                                        "be greater than or equal to 1")  # fmt: skip
    assert read_step_info(info).malformed_tool_calls == 1
    echo = make_env(ENV_ID, environment=ECHO)
    echo.reset(seed=0)
    obs, _, terminated, _, info = echo.step(echo.unwrapped.call("act", message="crash"))  # type: ignore[attr-defined]
    assert obs[0]["content"] == "Error: tool act raised ActionRejected: cannot echo 'crash'"
    assert read_step_info(info).tool_calls[0].error_kind == "raised" and not terminated


def test_a_turn_without_a_call_ends_a_tool_mode_episode_with_the_sum_so_far() -> None:
    env = make_env(ENV_ID, environment=ECHO)
    env.reset(seed=5)
    word = random.Random(5).choice(WORDS)
    call = env.unwrapped.call("act", message=word)  # type: ignore[attr-defined]
    obs, reward, *_ = env.step(call + call)  # two calls, two steps
    assert [json.loads(o["content"])["echoed_message"] for o in obs] == [word, word]
    _, reward, terminated, _, info = env.step("done")
    assert (reward, terminated, read_step_info(info).success) == (1.0, True, True)


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [({"environment": "no_such_module:Env"}, "environment='no_such_module:Env': No module named"),
     ({"environment": f"{__name__}:Nope"}, "has no attribute 'Nope'"),
     ({"environment": "agent_grpo.envs.openenv_guess"}, "expected module:Class"),
     ({"environment": GUESS_ACTION}, "is not an OpenEnv Environment"),
     ({"environment": ECHO, "base_url": "http://127.0.0.1:1"}, "not both"),
     ({"action_field": "message"}, "GuessAction has no field 'message'; its fields: metadata, "
                                   "guess"),
     ({"action": f"{__name__}:EchoObservation"}, "is not an OpenEnv Action class"),
     ({"environment_kwargs": {"colour": "red"}}, "environment_kwargs {'colour': 'red'}"),
     ({"base_url": "http://127.0.0.1:1"}, "needs the env's Action class"),
     ({"base_url": "http://127.0.0.1:1", "action_field": "guess"}, "no OpenEnv server at http")],
    ids=["no-module", "no-class", "no-colon", "not-an-environment", "both", "unknown-field",
         "not-an-action", "bad-environment-kwargs", "tool-mode-needs-action", "unreachable"],
)  # fmt: skip
def test_a_bad_configuration_is_one_line(kwargs: dict[str, Any], problem: str) -> None:
    with pytest.raises((ValueError, ConnectionError), match=re.escape(problem)) as error:
        make_env(ENV_ID, **kwargs)
    assert "\n" not in str(error.value)


def test_a_missing_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "openenv" else real(name, *a))  # fmt: skip
    with pytest.raises(ImportError, match=re.escape("pip install 'agent-grpo[openenv]'")):
        make_env(ENV_ID)


def docs_examples() -> list[dict[str, Any]]:
    """The YAML blocks of the OpenEnv section of docs/environments.md."""
    docs = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    section = docs.split("### OpenEnv environments\n", 1)[1].split("\n## ", 1)[0]
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", section, re.DOTALL)]


def test_the_docs_server_example_plays_against_a_server(guess_url: str) -> None:
    kwargs = docs_examples()[1]["env"]["kwargs"]
    assert kwargs["base_url"] == "http://127.0.0.1:8000"  # what the docs' uvicorn line serves
    env = make_env(docs_examples()[1]["env"]["id"], **{**kwargs, "base_url": guess_url})
    env.reset(seed=heldout_seeds(1)[0])
    steps, guess = play_binary_search(env)
    assert steps[-1] == (1.0, True, False) and guess == secret(heldout_seeds(1)[0])
    env.close()


def test_the_docs_example_trains_two_steps(tmp_path: Path, tiny_model_dir: Path) -> None:
    from agent_grpo.run_dir.reader import load_run
    from agent_grpo.testing.cli_runs import metrics, tiny_train

    example = docs_examples()[0]
    overrides = [f"env.{key}={json.dumps(value)}" for key, value in example["env"].items()]
    overrides += [f"{k}={json.dumps(v)}" for k, v in example.items() if k != "env"]
    run = tiny_train(tmp_path, tiny_model_dir, *overrides, "steps=2")
    rows = metrics(run)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    rules = openenv_guess.GuessNumberEnvironment().reset(seed=0).message
    records = load_run(run).trajectories()
    assert records and all(r.messages[1].content == rules for r in records)  # the game's prompt
