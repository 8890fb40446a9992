"""Preflight refuses a train or eval whose env runs code in the sandbox when the sandbox cannot
run here (bubblewrap missing): one line naming the problem and both fixes, before any model work,
instead of a run that trains on episodes whose every tool call fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_grpo.config.base import ConfigError, load_config
from agent_grpo.config.jobs import EnvConfig, EvalRunConfig, TrainConfig
from agent_grpo.preflight import PreflightError, check_env, preflight_eval, preflight_train
from agent_grpo.sandbox import runner as sandbox
from agent_grpo.testing.cli_runs import TINY_CONFIG
from agent_grpo.tools.python import python

ROOT = Path(__file__).resolve().parents[2]
SANDBOXED_ENV = "agent_grpo/PythonSandbox-v0"
REFUSAL = (
    f"env {SANDBOXED_ENV} runs code in the sandbox (tool python): bubblewrap (bwrap) is not "
    "installed: refusing to run model-written code. Install bubblewrap 0.8+"
)


@pytest.fixture
def no_bwrap(monkeypatch: pytest.MonkeyPatch) -> None:
    """bubblewrap missing, and the weak fallback not opted into."""
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    monkeypatch.delenv(sandbox.FALLBACK_ENV, raising=False)


@pytest.mark.usefixtures("no_bwrap")
def test_train_and_eval_of_a_sandboxed_env_are_refused_in_one_line(tiny_model_dir: Path) -> None:
    overrides = [f"model.name_or_path={tiny_model_dir}", f"env.id={SANDBOXED_ENV}"]
    train = load_config(TrainConfig, TINY_CONFIG, overrides)
    evaluate = load_config(EvalRunConfig, ROOT / "configs" / "eval-calculator.yaml", overrides)
    for preflight, config in ((preflight_train, train), (preflight_eval, evaluate)):
        with pytest.raises(PreflightError) as refused:
            preflight(config)  # type: ignore[operator]
        message = str(refused.value)
        assert isinstance(refused.value, ConfigError) and "\n" not in message
        assert message.startswith(REFUSAL)
        assert f"{sandbox.FALLBACK_ENV}=rlimits" in message


@pytest.mark.usefixtures("no_bwrap")
def test_the_opted_in_fallback_and_envs_without_the_sandbox_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_env(EnvConfig(id="agent_grpo/Calculator-v0"))
    monkeypatch.setenv(sandbox.FALLBACK_ENV, "rlimits")
    check_env(EnvConfig(id=SANDBOXED_ENV))


def test_the_python_tool_declares_that_it_needs_the_sandbox() -> None:
    assert python.needs_sandbox
