"""Environment registration: built-ins, entry-point plugins, ids and `module:Class` paths."""

from __future__ import annotations

import importlib.metadata
import logging
import warnings
from importlib.metadata import EntryPoint

import gymnasium as gym
import pytest

from agent_grpo.envs import BUILTIN_ENVS, register_builtin_envs, registry
from agent_grpo.envs.calculator import CalculatorEnv
from agent_grpo.envs.registry import ENTRY_POINT_GROUP, list_envs, make_env, register_envs
from agent_grpo.envs.text_env import TextEnv

PLUGIN_ID = "test_plugin/Calc-v3"


def register_test_plugin() -> None:
    """What a third-party package's entry point does: register its envs."""
    gym.register(id=PLUGIN_ID, entry_point=CalculatorEnv, kwargs={"num_ops": 1})


def broken_plugin() -> None:
    """A plugin whose registration fails."""
    raise ImportError("missing dependency")


def test_builtins_are_registered_lazily_and_idempotently() -> None:
    for name, entry_point in BUILTIN_ENVS.items():
        spec = gym.spec(f"agent_grpo/{name}")
        assert spec.entry_point == entry_point  # a string: nothing imported to register
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # re-registering would warn "Overriding environment"
        register_builtin_envs()
        register_envs(force=True)


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_make_env_by_id_passes_kwargs(name: str) -> None:
    env = make_env(f"agent_grpo/{name}", max_turns=3)
    assert isinstance(env.unwrapped, TextEnv) and env.unwrapped.max_turns == 3
    env.close()


def test_make_env_by_path() -> None:
    env = make_env("agent_grpo.envs.calculator:CalculatorEnv", num_ops=1)
    assert type(env.unwrapped) is CalculatorEnv and env.spec is not None
    _, _ = env.reset(seed=0)
    assert isinstance(env.unwrapped, CalculatorEnv) and env.unwrapped.task is not None
    assert env.unwrapped.task.expression.count(" ") == 2  # one operator: "a op b"
    assert "agent_grpo.envs.calculator:CalculatorEnv" not in gym.registry  # registry untouched


class ClosedToolEnv(CalculatorEnv):
    """A tool env whose constructor takes no keyword at all."""

    def __init__(self) -> None:
        super().__init__()


def test_make_env_sets_the_tool_call_format_on_any_tool_env() -> None:
    env = make_env("agent_grpo/Calculator-v0", tool_call_format="llama3")
    assert isinstance(env.unwrapped, CalculatorEnv)
    assert env.unwrapped.tool_call_format.name == "llama3" and env.unwrapped.stop_strings == []
    closed = make_env(f"{__name__}:ClosedToolEnv", tool_call_format="harmony")
    assert closed.unwrapped.tool_call_format.name == "harmony"  # type: ignore[attr-defined]
    default = make_env("agent_grpo/Calculator-v0").unwrapped
    assert default.tool_call_format.name == "hermes"  # type: ignore[attr-defined]


def test_make_env_refuses_an_unknown_format_before_building() -> None:
    with pytest.raises(ValueError, match="unknown tool-call format 'qwen'; known formats"):
        make_env("agent_grpo/Calculator-v0", tool_call_format="qwen")


def test_make_env_unknown_id_raises() -> None:
    with pytest.raises(gym.error.Error):
        make_env("agent_grpo/Nope-v0")
    with pytest.raises(ModuleNotFoundError):
        make_env("no_such_module:Env")


def test_list_envs_has_the_builtins() -> None:
    listed = {e.id: e for e in list_envs()}
    for name, entry_point in BUILTIN_ENVS.items():
        assert listed[f"agent_grpo/{name}"].entry_point == entry_point
        assert listed[f"agent_grpo/{name}"].source == "builtin"


def test_entry_point_plugins_are_discovered(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    entries = [
        importlib.metadata.EntryPoint(
            "mine", f"{__name__}:register_test_plugin", ENTRY_POINT_GROUP
        ),
        importlib.metadata.EntryPoint("broken", f"{__name__}:broken_plugin", ENTRY_POINT_GROUP),
    ]
    calls: list[str] = []

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        calls.append(group)
        return entries if group == ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_plugin_ids", {})
    gym.registry.pop(PLUGIN_ID, None)
    # setup_logging() (run by CLI tests) stops propagation, so listen on our logger itself.
    logger = logging.getLogger("agent_grpo")
    logger.addHandler(caplog.handler)
    try:
        register_envs()
        register_envs()  # once per process: the second call does not scan again
        assert calls == [ENTRY_POINT_GROUP]
        assert "broken" in caplog.text and "missing dependency" in caplog.text
        listed = {e.id: e for e in list_envs()}
        assert listed[PLUGIN_ID].source == "mine"
        env = make_env(PLUGIN_ID)
        assert env.unwrapped.num_ops == 1  # type: ignore[attr-defined]
        env.close()
    finally:
        logger.removeHandler(caplog.handler)
        gym.registry.pop(PLUGIN_ID, None)
