"""docs/config.md is generated from the config models and up to date; every key it lists is a
real key with the default it shows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, Field

from agent_grpo.config.base import ConfigModel, apply_overrides, validate_config
from agent_grpo.config.schema import entry_points, key_docs, schema_markdown, type_text

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "config.md"
REGENERATE = "regenerate it: agent-grpo config --schema > docs/config.md"


def test_docs_config_md_is_up_to_date() -> None:
    assert PAGE.read_text() == schema_markdown(), f"docs/config.md is out of date; {REGENERATE}"


@pytest.mark.slow
def test_cli_prints_the_page() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "agent_grpo.cli", "config", "--schema"],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == schema_markdown()


def _value(config: Any, key: str) -> Any:
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _default_of(cls: Any, key: str) -> Any:
    """`key`'s default: in `cls()`, or with its section given empty where that is None."""
    parts = key.split(".")
    for i in range(1, len(parts)):
        section = ".".join(parts[:i])
        if _value(cls(), section) is None:
            return _value(validate_config(cls, apply_overrides({}, [f"{section}={{}}"])), key)
    return _value(cls(), key)


@pytest.mark.parametrize(("command", "cls"), entry_points(), ids=lambda x: str(x))
def test_every_listed_key_exists_with_the_default_shown(command: str, cls: Any) -> None:
    plain = [r for r in key_docs(cls, cls()) if not r.variant and "[]" not in r.key]
    checked = 0
    for row in plain:
        if not row.default.startswith("`"):  # a section, or a required key
            continue
        shown = yaml.safe_load(row.default.strip("`"))
        config = validate_config(cls, apply_overrides({}, [f"{row.key}={row.default.strip('`')}"]))
        for value in (_value(config, row.key), _default_of(cls, row.key)):
            if isinstance(value, BaseModel):  # a section chosen by `type`: `{type: hf}`
                value = {k: v for k, v in value.model_dump().items() if k in shown}
            assert value == shown, row.key
        checked += 1
    assert checked > 20


def test_every_field_of_every_section_is_listed() -> None:
    keys = {r.key for _, cls in entry_points() for r in key_docs(cls)}
    for key in ("algo.clip_high", "rollout.sampling.max_tokens", "rewards[].function",
                "rollout.backend.gpu_memory_utilization", "warm_start.demos", "backend.base_url",
                "distributed.mode", "run.keep_checkpoints", "env.kwargs"):  # fmt: skip
        assert key in keys


class Inner(ConfigModel):
    """A section."""

    size: int = Field(default=3, gt=0, le=9)
    """How big."""


class Outer(ConfigModel):
    """A config."""

    mode: Literal["a", "b"] = "a"
    """Which mode,
    over two lines."""
    inner: Inner = Inner(size=5)
    """The section."""
    maybe: Inner | None = None
    """An optional section."""
    name: str
    """Required."""


def test_rows_have_type_default_and_one_line_docstring() -> None:
    rows = {r.key: r for r in key_docs(Outer)}
    assert (rows["mode"].type, rows["mode"].default) == ('"a" | "b"', '`"a"`')
    assert rows["mode"].doc == "Which mode, over two lines."
    assert (rows["inner.size"].type, rows["inner.size"].default) == ("int (> 0, <= 9)", "`5`")
    assert (rows["maybe"].type, rows["maybe"].default) == ("section | null", "`null`")
    assert rows["maybe.size"].default == "`3`"  # the class default, when the section is given
    assert rows["name"].default == "required"
    assert type_text(list[int] | None) == "list of int | null"
