"""Resuming a run: it continues with the config it started with, or the user says otherwise.

`train --resume` reads the run's `config.yaml` before any model work and compares it with the
config given now. A changed key (`algo.lr`, `seed`, `rollout.group_size`, ...) would make the
resumed steps a different experiment under the old run's name, so it is refused with a one-line
error naming the keys, unless the user accepts the change (`--accept-config-change`, or
`accept_config_change=True` in the Python API). An accepted change is appended to the run's
`config-changes.jsonl` (the step it took effect at, each key's old and new value); `config.yaml`
stays the config the run started with.

A few keys only say how long or how often, and change freely: `steps` (train further), the
checkpoint cadence and the trackers the run reports to.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent_grpo.config.base import ConfigError
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.run_dir.writer import RunWriter

__all__ = [
    "FREE_KEYS",
    "ConfigChange",
    "check_resume",
    "checkpoint_step",
    "config_changes",
    "record_changes",
]

FREE_KEYS = frozenset(
    {
        "steps",
        "eval.every",
        "run.checkpoint_every",
        "run.checkpoint_every_s",
        "run.keep_checkpoints",
        "run.report_to",
        "run.tensorboard",
    }
)
"""Keys a resume may change without being asked: how long the run goes, how often it saves and
evaluates, which trackers it reports to (runs from before `run.report_to` and `eval.every`
resume unasked)."""

CHANGES_FILE = "config-changes.jsonl"
"""Where accepted changes are recorded, in the run directory."""


@dataclass(frozen=True)
class ConfigChange:
    """One key whose value differs between the run's config and the resuming one."""

    key: str
    """Dotted key, e.g. `algo.lr`."""
    old: Any
    """Its value in the run's `config.yaml` (None: the key was not there)."""
    new: Any
    """Its value now (None: the key is gone)."""


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[ConfigChange]:
    """Every dotted key whose value differs between two config mappings, in sorted order."""
    changes: list[ConfigChange] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for key in sorted(set(a) | set(b)):
                walk(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else str(key))
        elif a != b:
            changes.append(ConfigChange(prefix, a, b))

    walk(old, new, "")
    return changes


def check_resume(config: TrainConfig, *, accept_config_change: bool) -> list[ConfigChange]:
    """The run `config` names can be resumed with `config`: it exists, and no key other than
    `FREE_KEYS` changed unless accepted. Returns the accepted changes (for `record_changes`)."""
    path = Path(config.run.root) / config.run.name
    stored = path / "config.yaml"
    if not stored.is_file():
        what = "does not exist" if not path.exists() else "has no config.yaml"
        raise ConfigError(
            f"cannot resume {path}: it {what} (a run stopped before its directory was made "
            "has nothing to resume); run it without --resume"
        )
    try:
        old = yaml.safe_load(stored.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"cannot resume {path}: its config.yaml is not valid YAML") from None
    changes = config_changes(old, config.model_dump(mode="json"))
    changed = [c for c in changes if c.key not in FREE_KEYS]
    if changed and not accept_config_change:
        keys = ", ".join(f"{c.key} ({c.old!r} -> {c.new!r})" for c in changed)
        raise ConfigError(
            f"cannot resume {path} with a different config: {keys}; resume with the run's own "
            "config, or pass --accept-config-change to continue with these changes (recorded "
            f"in {CHANGES_FILE})"
        )
    done = checkpoint_step(path)
    if done is not None and done > config.steps:
        # the loop would not run, and the final evaluation would be written as that of a
        # policy `steps` steps in, which has trained more
        raise ConfigError(
            f"cannot resume {path} with steps={config.steps}: its newest checkpoint is after "
            f"step {done}; set steps to {done} or more"
        )
    return changed


def checkpoint_step(path: Path) -> int | None:
    """The steps done by the newest checkpoint of the run at `path` (None: no checkpoint); a
    `state.json` that does not read is one line naming it."""
    newest = RunWriter(path).latest_checkpoint()
    if newest is None:
        return None
    try:
        step = json.loads((newest / "state.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        step, problem = None, f"{type(error).__name__}: {error}"
    else:
        problem = "" if isinstance(step, int) else f"step {step!r}"
    if problem or step is None:
        raise ConfigError(f"cannot resume {path}: {newest / 'state.json'} does not read "
                          f"({problem[:120]}); move that checkpoint folder away to resume from "
                          "the one before it")  # fmt: skip
    return int(step)


def record_changes(run_path: Path, at_step: int, changes: list[ConfigChange]) -> None:
    """Append accepted changes to the run's `config-changes.jsonl` (nothing when none)."""
    if not changes:
        return
    entry = {
        "step": at_step,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "changes": [{"key": c.key, "old": c.old, "new": c.new} for c in changes],
    }
    with (run_path / CHANGES_FILE).open("a") as out:
        out.write(json.dumps(entry) + "\n")
