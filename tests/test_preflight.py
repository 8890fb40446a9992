"""Validation before any model work: each config mistake is one line (`error: ...`, exit 2, no
traceback) through the CLI, and leaves no run directory; the checks behind it, one by one."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from agent_grpo.config.base import ConfigError, load_config, validate_config
from agent_grpo.config.jobs import EnvConfig, ModelConfig, TrainConfig
from agent_grpo.envs import BUILTIN_ENVS
from agent_grpo.envs.calculator import ArithmeticTask, CalculatorEnv
from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import TextEnv
from agent_grpo.models.loading import ModelNotFoundError, check_model_source, resolve_model_path
from agent_grpo.preflight import (
    PreflightError,
    bind_tool_format,
    chat_template_of,
    check_env,
    constructor_arguments,
    kwargs_problem,
    preflight_train,
    resolve_env,
    same_observation,
)
from agent_grpo.testing.cli_runs import TINY_CONFIG

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# Environments with a broken reset or constructor (also written out for the CLI's subprocess)

ENV_MODULE = '''
import random
from agent_grpo.envs.calculator import ArithmeticTask, CalculatorEnv


class GlobalRandomEnv(CalculatorEnv):
    """Draws its task from the global `random`, not from the seed."""

    def generate_task(self, rng):
        a, b = random.randint(0, 10**6), random.randint(0, 10**6)
        return ArithmeticTask(expression=f"{a} + {b}", answer=a + b)


class TextResetEnv(CalculatorEnv):
    """Returns the question's text as its observation, not the chat messages."""

    def reset(self, *, seed=None, options=None):
        messages, info = super().reset(seed=seed, options=options)
        return messages[-1]["content"], info


class RaisingVerifierEnv(CalculatorEnv):
    """A verifier with a bug: it raises on every answer."""

    def verify(self, task, answer):
        return {"ok": 1}["score"]


class SolvedRaisingVerifierEnv(CalculatorEnv):
    """A verifier with a bug on the path of a right answer only."""

    def verify(self, task, answer):
        verdict = super().verify(task, answer)
        return {"wrong": verdict}["right"] if verdict.success else verdict
'''


class GlobalRandomEnv(CalculatorEnv):
    """Draws its task from the global `random`, not from the seed: every reset differs."""

    def generate_task(self, rng: np.random.Generator) -> ArithmeticTask:
        a, b = random.randint(0, 10**6), random.randint(0, 10**6)
        return ArithmeticTask(expression=f"{a} + {b}", answer=a + b)


class PerInstanceEnv(CalculatorEnv):
    """Deterministic within one instance, but each instance adds its own offset: resetting
    one env twice agrees, two group members do not."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.offset = random.randint(1, 10**6)

    def generate_task(self, rng: np.random.Generator) -> ArithmeticTask:
        a = int(rng.integers(100)) + self.offset
        return ArithmeticTask(expression=f"{a} + 0", answer=a)


class TextResetEnv(CalculatorEnv):
    """Returns the question's text as its observation, not the chat messages."""

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        messages, info = super().reset(seed=seed, options=options)
        return messages[-1]["content"], info


class BareResetEnv(CalculatorEnv):
    """Returns the messages without the info dict."""

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        return super().reset(seed=seed, options=options)[0]


class RoleResetEnv(CalculatorEnv):
    """A prompt message with a role chat templates do not know."""

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        messages, info = super().reset(seed=seed, options=options)
        return [{"role": "narrator", "content": "hi"}, *messages], info


class RaisingResetEnv(CalculatorEnv):
    """A task generator with a bug."""

    def generate_task(self, rng: np.random.Generator) -> ArithmeticTask:
        return ArithmeticTask(expression="1 + 1", answer=int("two"))


class RaisingVerifierEnv(CalculatorEnv):
    """A verifier with a bug: it raises on every answer."""

    def verify(self, task: ArithmeticTask, answer: str) -> Any:
        return {"ok": 1}["score"]  # the line the error names


class SolvedRaisingVerifierEnv(CalculatorEnv):
    """A verifier with a bug on the path of a right answer only: a wrong answer passes it."""

    def verify(self, task: ArithmeticTask, answer: str) -> Any:
        verdict = super().verify(task, answer)
        return {"wrong": verdict}["right"] if verdict.success else verdict  # the right path


class NoExpertEnv(CalculatorEnv):
    """A text env that keeps `TextEnv`'s expert_action, which says it has none."""

    expert_action = TextEnv.expert_action


class RaisingExpertEnv(CalculatorEnv):
    """An expert with a bug of its own."""

    def expert_action(self) -> str:
        return f"Answer: {self.task.solution}"  # type: ignore[union-attr]


class PlainChatEnv(gym.Env[Any, str]):
    """A gymnasium env of the user's own, not a TextEnv: one question, any answer ends it."""

    action_space = observation_space = gym.spaces.Text(256)

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        return [{"role": "user", "content": "Say hi."}], {}

    def step(self, action: str) -> Any:
        return [], 1.0, True, False, {}


class ShortStepEnv(CalculatorEnv):
    """A step that returns gymnasium's old 4-tuple."""

    def step(self, action: str) -> Any:
        observation, reward, terminated, _, info = super().step(action)
        return observation, reward, terminated, info


class NumberStateEnv(CalculatorEnv):
    """Names its state with a number, where turn-level credit reads text."""

    def reset(self, *, seed: int | None = None, options: Any = None) -> Any:
        messages, info = super().reset(seed=seed, options=options)
        return messages, {**info, "state": 3}


class WordTurnRewardEnv(CalculatorEnv):
    """A turn reward that is not a number."""

    def step(self, action: str) -> Any:
        observation, reward, terminated, truncated, info = super().step(action)
        return observation, reward, terminated, truncated, {**info, "turn_reward": "high"}


class SwallowingEnv(CalculatorEnv):
    """Takes `flavour` through `**kwargs` without naming it: no signature shows it."""

    def __init__(self, **kwargs: Any) -> None:
        self.flavour = kwargs.pop("flavour", "plain")
        super().__init__(**kwargs)


class BuggyEnv(CalculatorEnv):
    """A constructor with a TypeError of its own, which no argument causes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        len(3)  # type: ignore[arg-type]


def needs_size(size: int, **kwargs: Any) -> CalculatorEnv:
    """A function entry point that needs `size` and passes anything else on."""
    return CalculatorEnv(num_ops=size, **kwargs)


def here(name: str) -> str:
    return f"{__name__}:{name}"


# ---------------------------------------------------------------------------------------------
# Through the CLI: each mistake is one line


# `agent-grpo ARGS`, which also writes the modules it had imported when it exited to
# `modules.txt`: a mistake must be reported before the trainer (torch's and transformers' import,
# seconds) is loaded.
CLI = """import atexit, sys
from agent_grpo import cli
atexit.register(lambda: open("modules.txt", "w").write("\\n".join(sorted(sys.modules))))
sys.exit(cli.main(sys.argv[1:]))
"""


def agent_grpo(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`agent-grpo ARGS` in a fresh interpreter, with `preflight_envs` importable."""
    (cwd / "preflight_envs.py").write_text(ENV_MODULE)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        cwd=cwd, env=env, text=True, capture_output=True, timeout=600,
    )  # fmt: skip


def imported(cwd: Path) -> list[str]:
    """The modules the last `agent_grpo(cwd, ...)` had imported when it exited."""
    return (cwd / "modules.txt").read_text().split()


def fake_checkpoint(root: Path) -> Path:
    """A checkpoint directory's shape: the model in `model/`, trainer state beside it."""
    checkpoint = root / "checkpoints" / "step_000002"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "model" / "config.json").write_text("{}")
    (checkpoint / "state.json").write_text(json.dumps({"step": 2}))
    return checkpoint


RESET = "env preflight_envs:GlobalRandomEnv: reset(seed=0) is not deterministic"
MISTAKES = {
    "env-id": (["env.id=agent_grpo/Calculater-v0"], "Did you mean: `Calculator`?"),
    "env-kwargs": (["env.kwargs={max_turn: 3}"], "'max_turn' (did you mean max_turns?)"),
    "model-name": (["model.name_or_path=smollm2-135m-instrct"], "did you mean smollm2-135m-in"),
    "checkpoint": (["model.name_or_path={checkpoint}"], "did you mean {checkpoint}/model?"),
    "reset": (["env.id=preflight_envs:GlobalRandomEnv"], RESET),
    "steps": (["steps=-1"], "steps: Input should be greater than or equal to 0"),
    "group-size": (["rollout.group_size=1"], "rollout.group_size=1: GRPO's advantage is relative"),
    "reset-type": (["env.id=preflight_envs:TextResetEnv"], "observation must be the prompt as a"),
    "verifier": (
        ["env.id=preflight_envs:RaisingVerifierEnv"],
        "raised KeyError: 'score' (at {cwd}/preflight_envs.py:",
    ),
    "verifier-on-a-right-answer": (
        ["env.id=preflight_envs:SolvedRaisingVerifierEnv"],
        "(warm_start imitates it) raised KeyError: 'right' (at {cwd}/preflight_envs.py:",
    ),
    "vllm-head-size": (  # the tiny model's heads of 16, which vLLM's CPU kernels do not take
        ["rollout.backend={type: vllm}"],
        "its attention head size is 16, and this vLLM's CPU attention takes 32, 64,",
    ),
    "mcp-command": (
        ["env.id=agent_grpo/Notes-v0", "env.kwargs={mcp_server: {command: [no-such-mcp-server]}}"],
        "error: env.kwargs.mcp_server: could not start the MCP server: FileNotFoundError",
    ),
}


WITHOUT_TORCH = {"env-id", "env-kwargs", "steps", "group-size", "reset", "reset-type"}
"""Mistakes found before anything imports torch (the rest check a model's files or an engine)."""


@pytest.mark.slow
@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_config_mistake_is_one_line_and_makes_no_run_dir(
    mistake: str, tmp_path: Path, tiny_model_dir: Path
) -> None:
    overrides, expected = MISTAKES[mistake]
    if mistake == "vllm-head-size":
        _needs_vllm_on_cpu()
    checkpoint = str(fake_checkpoint(tmp_path / "old-run"))
    overrides = [o.replace("{checkpoint}", checkpoint) for o in overrides]
    runs = tmp_path / "runs"
    done = agent_grpo(
        tmp_path, "train", str(TINY_CONFIG), f"model.name_or_path={tiny_model_dir}",
        f"run.root={runs}", *overrides,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert expected.replace("{checkpoint}", checkpoint).replace("{cwd}", str(tmp_path)) in lines[0]
    assert "Traceback" not in done.stderr + done.stdout
    assert not runs.exists()
    loaded = imported(tmp_path)
    assert "agent_grpo.trainer.loop" not in loaded  # reported before the trainer loads
    if mistake in WITHOUT_TORCH:  # nor torch: a mistake in the config or the env, in a second
        assert "torch" not in loaded


@pytest.mark.slow
def test_eval_checks_before_loading_too(tmp_path: Path, tiny_model_dir: Path) -> None:
    runs = tmp_path / "runs"
    done = agent_grpo(
        tmp_path, "eval", str(ROOT / "configs" / "eval-calculator.yaml"),
        f"model.name_or_path={tiny_model_dir}", f"run.root={runs}", "env.kwargs={num_ops: 0}",
    )  # fmt: skip
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("error: env.kwargs {'num_ops': 0} of agent_grpo/Calculator-v0:")
    assert not runs.exists()
    assert not {"agent_grpo.evaluation.job", "torch"} & set(imported(tmp_path))


@pytest.mark.parametrize(
    ("config", "size"),
    [
        ({"head_dim": 64, "hidden_size": 576, "num_attention_heads": 3}, 64),  # head_dim wins
        ({"hidden_size": 576, "num_attention_heads": 9}, 64),
        ({"text_config": {"head_dim": 256}, "hidden_size": 8}, 256),  # a multimodal model's text
        ({"vocab_size": 10}, None),
    ],
)
def test_a_models_head_size_is_read_from_its_config(config: dict[str, Any], size: int) -> None:
    from agent_grpo.rollout.backends.vllm import model_head_size

    assert model_head_size(config) == size


def _needs_vllm_on_cpu() -> None:
    """Skip where vLLM is not installed, or a GPU gives it other attention kernels."""
    pytest.importorskip("vllm")
    import torch

    if torch.cuda.is_available():
        pytest.skip("vLLM's CPU attention is checked on machines without a GPU")


def test_only_a_vllm_engine_on_cpu_is_held_to_vllms_cpu_head_sizes(
    tiny_model_dir: Path, embedded_model_dir: Path, tmp_path: Path
) -> None:
    from agent_grpo.config.jobs import HFBackendConfig, VLLMBackendConfig
    from agent_grpo.preflight import check_engine

    _needs_vllm_on_cpu()

    check_engine(VLLMBackendConfig(), str(embedded_model_dir))  # heads of 64
    check_engine(HFBackendConfig(), str(tiny_model_dir))  # heads of 16: the hf engine runs them
    for gpus in (None, 0, 1):  # no GPU here: this process's engine (evaluations) runs on CPU
        with pytest.raises(PreflightError, match="attention head size is 16"):
            check_engine(VLLMBackendConfig(), str(tiny_model_dir), gpus=gpus)
    adapter = tmp_path / "adapter"  # a LoRA adapter: its base model's heads
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tiny_model_dir)})
    )
    with pytest.raises(PreflightError, match="attention head size is 16"):
        check_engine(VLLMBackendConfig(), str(adapter))


def test_train_runs_the_preflight_before_making_a_run_dir(tmp_path: Path) -> None:
    config = load_config(
        TrainConfig, TINY_CONFIG, [f"run.root={tmp_path / 'runs'}", "env.id=Calc-v0"]
    )
    from agent_grpo.trainer.loop import train

    with pytest.raises(PreflightError, match=r"env\.id 'Calc-v0'"):
        train(config)
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------
# The environment id and entry point


@pytest.mark.parametrize(
    ("env_id", "message"),
    [
        ("agent_grpo/Calculater-v0", "in namespace agent_grpo. Did you mean: `Calculator`?"),
        ("Calculator-v0", "Did you mean `agent_grpo/Calculator-v0`?"),  # not gymnasium's: ours
        ("agent-grpo/Calculator-v0", "Did you mean: `agent_grpo`?"),
        ("agent_grpo/Calculator-v7", "It provides versioned environments: [ `v0` ]"),
        ("no_such_module:Env", "cannot import no_such_module: No module named 'no_such_module'"),
        ("agent_grpo.envs.calculator:CalcEnv", "did you mean agent_grpo.envs.calculator:Calcu"),
    ],
)
def test_a_bad_env_id_names_it_and_what_was_meant(env_id: str, message: str) -> None:
    with pytest.raises(PreflightError) as info:
        resolve_env(env_id)
    assert str(info.value).startswith(f"env.id {env_id!r}: ") and message in str(info.value)
    assert "\n" not in str(info.value)


def test_ids_make_env_accepts_resolve() -> None:
    spec, creator = resolve_env("agent_grpo/Calculator")  # no version: gym.make takes the latest
    assert spec.id == "agent_grpo/Calculator-v0" and creator is CalculatorEnv
    assert resolve_env("agent_grpo.envs.calculator:CalculatorEnv")[1] is CalculatorEnv


# ---------------------------------------------------------------------------------------------
# Constructor arguments


def test_arguments_are_read_through_kwargs_up_the_mro() -> None:
    args = constructor_arguments(CalculatorEnv)
    assert args is not None and not args.open_ended and args.required == []
    assert args.names[:4] == ["num_ops", "digits", "mul_digits", "ops"]  # its own, then ToolEnv's
    assert {"max_turns", "malformed_policy", "render_mode"} <= set(args.names)
    assert kwargs_problem(CalculatorEnv, {"num_ops": 1, "max_turns": 2}) is None
    problem = kwargs_problem(CalculatorEnv, {"max_turn": 2})
    assert problem is not None and problem.startswith(
        "CalculatorEnv takes no argument 'max_turn' (did you mean max_turns?); it takes: num_ops,"
    )


def test_a_function_entry_point_with_kwargs_takes_any_name_but_needs_its_own() -> None:
    args = constructor_arguments(needs_size)
    assert args is not None and args.open_ended and args.required == ["size"]
    assert kwargs_problem(needs_size, {"size": 1, "anything": 2}) is None
    assert kwargs_problem(needs_size, {"anything": 2}) == "needs_size needs size"


def test_a_wrong_kwarg_is_one_line_naming_env_and_argument() -> None:
    with pytest.raises(PreflightError) as info:
        check_env(EnvConfig(id="agent_grpo/Calculator-v0", kwargs={"num_opps": 1}))
    assert str(info.value).startswith(
        "env.kwargs of agent_grpo/Calculator-v0: CalculatorEnv takes no argument 'num_opps' "
        "(did you mean num_ops?)"
    )
    with pytest.raises(PreflightError, match=r"^env\.kwargs of .*: needs_size needs size$"):
        check_env(EnvConfig(id=here("needs_size")))


def test_a_rejected_value_is_one_line() -> None:
    with pytest.raises(PreflightError, match=r"^env\.kwargs \{'digits': 0\} of agent_grpo/Calc"):
        check_env(EnvConfig(id="agent_grpo/Calculator-v0", kwargs={"digits": 0}))


def test_an_argument_no_signature_shows_is_never_refused() -> None:
    check_env(EnvConfig(id=here("SwallowingEnv"), kwargs={"flavour": "spicy"}))


def test_a_type_error_of_the_env_itself_keeps_its_traceback() -> None:
    with pytest.raises(TypeError, match="has no len") as info:
        check_env(EnvConfig(id=here("BuggyEnv")))
    assert not isinstance(info.value, PreflightError)


# ---------------------------------------------------------------------------------------------
# Deterministic reset


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_builtin_envs_pass(name: str) -> None:
    check_env(EnvConfig(id=f"agent_grpo/{name}"))


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_builtin_experts_play_an_episode_or_are_said_to_be_missing(name: str) -> None:
    try:
        check_env(EnvConfig(id=f"agent_grpo/{name}"), expert=True)
    except PreflightError as error:  # an env whose default config has no expert (Verifiers-v0)
        assert "warm_start imitates the env's scripted expert, and it has none (" in str(error)


@pytest.mark.parametrize(
    ("cls", "where"), [("GlobalRandomEnv", "the same env"), ("PerInstanceEnv", "a second env")]
)
def test_a_nondeterministic_reset_stops_the_run_with_the_env_name(cls: str, where: str) -> None:
    with pytest.raises(PreflightError) as info:
        check_env(EnvConfig(id=here(cls)))
    message = str(info.value)
    assert message.startswith(f"env {here(cls)}: reset(seed=0) is not deterministic: {where}")
    assert "each member of a group would get a different task" in message
    assert " + " in message and "\n" not in message  # shows where the prompts differ


# ---------------------------------------------------------------------------------------------
# One reset and one turn


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        ("TextResetEnv", "reset()'s observation must be the prompt as a list of chat messages "
                         "({'role': ..., 'content': ...}); got str 'What is"),
        ("BareResetEnv", "reset() must return (observation, info), got list [{'role': 'system'"),
        ("RoleResetEnv", "list of chat messages ({'role': ..., 'content': ...}); message 0 "
                         "dict {'role': 'narrator', 'content': 'hi'}: role: Input should be"),
        ("RaisingResetEnv", "reset(seed=0) raised ValueError: invalid literal for int() with "
                            "base 10: 'two' (at "),
        ("ShortStepEnv", "the turn 'Answer: 0' raised ValueError: not enough values to unpack "
                         "(expected 5, got 4) (at "),
        ("NumberStateEnv", "reset()'s info['state'] must be text (the state's name), got 3"),
        ("WordTurnRewardEnv", "step()'s info['turn_reward'] must be a finite number, got 'high'"),
    ],
)  # fmt: skip
def test_a_reset_or_step_of_the_wrong_shape_is_one_line(cls: str, message: str) -> None:
    with pytest.raises(PreflightError) as info:
        check_env(EnvConfig(id=here(cls)))
    assert str(info.value).startswith(f"env {here(cls)}: ") and "\n" not in str(info.value)
    assert message in str(info.value)


def test_a_raising_verifier_is_one_line_naming_its_line() -> None:
    with pytest.raises(PreflightError) as info:
        check_env(EnvConfig(id=here("RaisingVerifierEnv")))
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "the line the error names" in text)  # fmt: skip
    assert str(info.value) == (
        f"env {here('RaisingVerifierEnv')}: the turn 'Answer: 0' raised KeyError: 'score' "
        f'(at {__file__}:{line} in verify: return {{"ok": 1}}["score"]  # the line the '
        "error names)"
    )


def test_a_verifier_that_raises_on_a_right_answer_stops_at_the_experts_turn() -> None:
    env = EnvConfig(id=here("SolvedRaisingVerifierEnv"))
    check_env(env)  # the plain turn's wrong answer never reaches the bug
    with pytest.raises(PreflightError) as info:
        check_env(env, expert=True)
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if text.endswith("# the right path"))  # fmt: skip
    message, name = str(info.value), here("SolvedRaisingVerifierEnv")
    assert message.startswith(f"env {name}: the expert's turn 'Answer: ")
    assert message.endswith(
        f"(warm_start imitates it) raised KeyError: 'right' (at {__file__}:{line} in verify: "
        'return {"wrong": verdict}["right"] if verdict.success else verdict  # the right path)'
    )


def test_a_warm_start_needs_the_env_to_have_an_expert() -> None:
    env = EnvConfig(id=here("NoExpertEnv"))
    check_env(env)  # without a warm start it needs none
    with pytest.raises(PreflightError) as info:
        check_env(env, expert=True)
    assert str(info.value) == (
        f"env {here('NoExpertEnv')}: warm_start imitates the env's scripted expert, and it has "
        "none (NoExpertEnv has no expert policy); write its expert_action() or set "
        "warm_start: null"
    )


@pytest.mark.filterwarnings("ignore:.*not within the observation space")  # chat messages
def test_a_gymnasium_env_without_expert_action_is_said_to_have_none() -> None:
    env = EnvConfig(id=here("PlainChatEnv"))
    check_env(env)
    with pytest.raises(PreflightError, match=r"it has none \(PlainChatEnv has no expert_action\)"):
        check_env(env, expert=True)


def test_an_expert_that_raises_is_one_line_naming_its_line() -> None:
    with pytest.raises(PreflightError) as info:
        check_env(EnvConfig(id=here("RaisingExpertEnv")), expert=True)
    assert str(info.value).startswith(
        f"env {here('RaisingExpertEnv')}: expert_action() raised AttributeError: "
        "'ArithmeticTask' object has no attribute 'solution' (at "
    )
    assert str(info.value).endswith('in expert_action: return f"Answer: {self.task.solution}"  '
                                    "# type: ignore[union-attr])")  # fmt: skip


def test_preflight_train_plays_the_expert_only_with_a_warm_start() -> None:
    overrides = [f"env.id={here('NoExpertEnv')}"]
    with pytest.raises(PreflightError, match="warm_start imitates the env's scripted expert"):
        preflight_train(load_config(TrainConfig, TINY_CONFIG, overrides))
    preflight_train(load_config(TrainConfig, TINY_CONFIG, [*overrides, "warm_start=null"]))


def test_an_mcp_server_that_cannot_start_is_one_line_naming_its_key() -> None:
    pytest.importorskip("mcp")
    kwargs = {"mcp_server": {"command": ["no-such-mcp-server", "--db", "x"]}}
    with pytest.raises(PreflightError) as info:
        check_env(EnvConfig(id="agent_grpo/Notes-v0", kwargs=kwargs))
    assert str(info.value) == (
        "env.kwargs.mcp_server: could not start the MCP server: FileNotFoundError: [Errno 2] "
        "No such file or directory: 'no-such-mcp-server'"
    )


def test_same_observation_compares_nested_values() -> None:
    a = {"x": np.arange(3), "m": [{"role": "user", "content": "hi"}]}
    assert same_observation(a, {"x": np.arange(3), "m": [{"role": "user", "content": "hi"}]})
    assert not same_observation(a, {"x": np.arange(1, 4), "m": a["m"]})
    assert not same_observation(a, {"x": a["x"], "m": [{"role": "user", "content": "ho"}]})
    assert not same_observation([1, 2], [1, 2, 3])


# ---------------------------------------------------------------------------------------------
# The model


def test_a_near_miss_of_an_embedded_name_says_which() -> None:
    for typo in ("smollm2-135m-instrct", "SmolLM2-135M-Instruct", "smollm2-135m-instruct "):
        with pytest.raises(ModelNotFoundError, match="did you mean smollm2-135m-instruct"):
            resolve_model_path(typo)
    assert resolve_model_path("gpt2") == "gpt2"  # a bare hub id far from ours goes to the hub
    assert resolve_model_path("org/smollm2-135m-instrct") == "org/smollm2-135m-instrct"


def test_a_checkpoint_or_run_dir_points_at_its_model(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "run")
    with pytest.raises(ModelNotFoundError, match="is a training checkpoint") as info:
        resolve_model_path(str(checkpoint))
    assert str(info.value).endswith(f"did you mean {checkpoint / 'model'}?")
    with pytest.raises(ModelNotFoundError, match="is a run directory") as info:
        resolve_model_path(str(tmp_path / "run"))
    assert str(info.value).endswith(f"did you mean {checkpoint / 'model'}?")
    assert resolve_model_path(str(checkpoint / "model")) == str(checkpoint / "model")


def test_a_mistyped_path_suggests_its_sibling(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_path(str(checkpoint.parent / "step_00002"))
    assert str(info.value).endswith(f"does not exist: did you mean {checkpoint / 'model'}?")
    with pytest.raises(ModelNotFoundError, match=r"does not exist$"):
        resolve_model_path(str(tmp_path / "elsewhere" / "model"))


def test_model_files_are_checked_without_loading(tmp_path: Path, tiny_model_dir: Path) -> None:
    check_model_source(str(tiny_model_dir))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors weights"):
        check_model_source(str(tmp_path))


def test_a_lora_adapter_is_checked_through_its_base(tmp_path: Path, tiny_model_dir: Path) -> None:
    adapter = tmp_path / "run" / "checkpoints" / "step_000001" / "model"
    adapter.mkdir(parents=True)
    (adapter / "tokenizer.json").write_text("{}")
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tiny_model_dir)})
    )
    check_model_source(str(adapter))
    with pytest.raises(ModelNotFoundError, match="is a training checkpoint"):
        check_model_source(str(adapter.parent))
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tmp_path / "gone")})
    )
    with pytest.raises(ModelNotFoundError, match="gone does not exist"):
        check_model_source(str(adapter))


def test_an_uncached_hub_id_offline_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError, match=r"hub is offline \(HF_HUB_OFFLINE\)"):
        check_model_source("some-org/no-such-model")
    with pytest.raises(ModelNotFoundError, match="not an embedded model, a local directory or"):
        check_model_source("not a model")


def test_preflight_train_checks_the_model_first(tmp_path: Path) -> None:
    config = TrainConfig.model_validate(
        {"model": {"name_or_path": str(tmp_path / "nope")}, "env": {"id": "Nope-v0"}}
    )
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        preflight_train(config)


# ---------------------------------------------------------------------------------------------
# The tool-call format


class PlainEnv(TextEnv[int]):
    """An env without tools: it takes no tool-call format."""


def model_dir(root: Path, template: Any, as_jinja: bool = False) -> Path:
    """A directory holding only a tokenizer config with `template` (enough to read it)."""
    root.mkdir(parents=True, exist_ok=True)
    if as_jinja:
        (root / "chat_template.jinja").write_text(template)
    (root / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return root


LLAMA31 = "<|start_header_id|>{{ 'Environment: ipython' }}{{ '<|python_tag|>' }}<|eot_id|>"


def test_auto_binds_hermes_for_the_embedded_chatml_model() -> None:
    config = load_config(TrainConfig, TINY_CONFIG)
    preflight_train(config)
    assert config.env.kwargs["tool_call_format"] == "hermes"
    preflight_train(config)  # a second preflight (a config read back from config.yaml) agrees
    assert config.env.kwargs["tool_call_format"] == "hermes"


def test_a_named_format_is_bound_without_reading_the_template(tmp_path: Path) -> None:
    model = ModelConfig(name_or_path=str(model_dir(tmp_path / "m", None)), tool_format="llama3")
    env = EnvConfig(kwargs={"max_turns": 2})
    assert bind_tool_format(model, env) == "llama3"
    assert env.kwargs == {"max_turns": 2, "tool_call_format": "llama3"}
    check_env(env)  # the env builds with it, and says its stop strings in that format
    built = make_env(env.id, **env.kwargs)
    assert built.unwrapped.tool_call_format.name == "llama3"  # type: ignore[attr-defined]


def test_auto_reads_the_template_of_a_local_model(tmp_path: Path) -> None:
    jinja = model_dir(tmp_path / "jinja", LLAMA31, as_jinja=True)
    templates = [{"name": "default", "template": "<|im_start|>"},
                 {"name": "tool_use", "template": "<tool_call>"}]  # fmt: skip
    named = model_dir(tmp_path / "named", templates)
    assert chat_template_of(str(jinja)) == LLAMA31
    assert chat_template_of(str(named)) == "<|im_start|>\n<tool_call>"
    env = EnvConfig()
    assert bind_tool_format(ModelConfig(name_or_path=str(jinja)), env) == "llama3"
    assert env.kwargs == {"tool_call_format": "llama3"}


def test_a_template_of_no_known_format_is_one_line_before_any_model_work(tmp_path: Path) -> None:
    path = model_dir(tmp_path / "m", "{{ '<|header_start|>' }}{% if tools %}{% endif %}")
    with pytest.raises(PreflightError) as error:
        bind_tool_format(ModelConfig(name_or_path=str(path)), EnvConfig())
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"model {path}: model.tool_format=auto: ")
    assert "tool-call markup of no known format; set model.tool_format to one of" in message


def test_a_format_in_env_kwargs_is_kept_unless_the_model_says_otherwise() -> None:
    env = EnvConfig(kwargs={"tool_call_format": "mistral"})
    assert bind_tool_format(ModelConfig(), env) == "mistral"  # auto: taken as given
    with pytest.raises(PreflightError, match=r"disagrees with model\.tool_format=harmony"):
        bind_tool_format(ModelConfig(tool_format="harmony"), env)
    with pytest.raises(PreflightError, match="unknown tool-call format 'qwen'"):
        bind_tool_format(ModelConfig(), EnvConfig(kwargs={"tool_call_format": "qwen"}))


def test_an_env_without_tools_takes_no_format() -> None:
    env = EnvConfig(id=here("PlainEnv"))
    assert bind_tool_format(ModelConfig(tool_format="llama3"), env) is None
    assert env.kwargs == {}


def test_an_unknown_format_name_is_refused_when_the_config_loads() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(TrainConfig, TINY_CONFIG, ["model.tool_format=gpt"])
    assert str(error.value).endswith(
        "model.tool_format: unknown tool-call format 'gpt'; known formats: auto, deepseek_v3, "
        "harmony, hermes, llama3, mistral, mistral_v11, qwen3_coder"
    )


# ---------------------------------------------------------------------------------------------
# Config errors are one line


def test_several_bad_keys_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        validate_config(TrainConfig, {"steps": -1, "algo": {"clip_hihg": 1}}, "x.yaml")
    assert str(info.value) == (
        "invalid config x.yaml: steps: Input should be greater than or equal to 0; "
        "algo.clip_hihg: Extra inputs are not permitted"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1\nb: 2\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: .* at line 2, column 2$") as info:
        load_config(TrainConfig, bad)
    assert "\n" not in str(info.value)
