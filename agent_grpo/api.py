"""The Python API (docs/python-api.md): `agent_grpo.train`, `agent_grpo.evaluate` and
`agent_grpo.load_run`, the same jobs as `agent-grpo train` and `agent-grpo eval`.

A config is given as its config object, as a mapping shaped like the YAML file, or as the path of
a YAML file, with optional `dotted.key=value` overrides; it is validated, then preflighted
(agent_grpo/preflight.py), exactly as the command line does: a mistake raises `ConfigError` (or
`ModelNotFoundError`) with the one-line message the CLI prints, before any model work. Both jobs
return the `Run` they wrote, ready for analysis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agent_grpo.config.base import ConfigModel, apply_overrides, load_config, validate_config
from agent_grpo.run_dir.reader import Run, load_run

if TYPE_CHECKING:
    from agent_grpo.trainer.trackers import StepCallback

__all__ = ["ConfigLike", "as_config", "evaluate", "load_run", "train"]

C = TypeVar("C", bound=ConfigModel)

ConfigLike = ConfigModel | Mapping[str, Any] | str | Path
"""What the API takes as a config: the config object, a YAML-shaped mapping, or a YAML path."""


def as_config(cls: type[C], config: ConfigLike, overrides: Sequence[str] = ()) -> C:
    """`config` as a validated `cls`, with `dotted.key=value` overrides applied."""
    if isinstance(config, str | Path):
        return load_config(cls, config, list(overrides))
    if isinstance(config, cls) and not overrides:
        return config
    data = config.model_dump(mode="json") if isinstance(config, ConfigModel) else dict(config)
    return validate_config(cls, apply_overrides(data, list(overrides)), f"<{cls.__name__}>")


def train(
    config: ConfigLike,
    *,
    overrides: Sequence[str] = (),
    resume: bool = False,
    accept_config_change: bool = False,
    callbacks: Sequence[StepCallback] = (),
) -> Run:
    """Train as `agent-grpo train` does (base eval, warm start, GRPO, final eval); returns the
    run. `resume` continues the run named by `run.name` from its last checkpoint, refusing a
    changed config unless `accept_config_change` (then recorded in the run directory). Each of
    `callbacks` is called as `callback(step, metrics)` with every GRPO step's `StepMetrics`
    once the step is written (docs/tracking.md)."""
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.trainer.loop import train as train_job

    config = as_config(TrainConfig, config, overrides)
    return Run(
        train_job(
            config, resume=resume, accept_config_change=accept_config_change, callbacks=callbacks
        )
    )


def evaluate(config: ConfigLike, *, overrides: Sequence[str] = ()) -> Run:
    """Evaluate a model on held-out seeds as `agent-grpo eval` does; returns the run, whose
    `final_eval()` holds the metrics."""
    from agent_grpo.config.jobs import EvalRunConfig
    from agent_grpo.evaluation.job import run_eval_job

    return Run(run_eval_job(as_config(EvalRunConfig, config, overrides)))
