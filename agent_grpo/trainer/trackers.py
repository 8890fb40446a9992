"""Where each step's metrics go besides `metrics.jsonl`: the trackers `run.report_to` names
(TensorBoard, Weights & Biases, Trackio, MLflow), every one local or offline under the run
directory, and the Python API's callbacks (docs/tracking.md).

Trackers get grouped names (`reward/reward_mean`, `loss/loss`, `timing/step_time_s`, ...:
`grouped_name`); `metrics.jsonl` keeps its flat keys. Each library is an optional extra,
imported only when named; `check_trackers` turns a missing one into a one-line `ConfigError`
before any model work.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from agent_grpo.config.base import ConfigError, dump_config
from agent_grpo.config.jobs import TRACKERS, TrainConfig
from agent_grpo.logs import get_logger
from agent_grpo.rollout.summary import TrajectorySummary
from agent_grpo.trainer.metrics import LogprobMismatch, SignalMetrics, StepMetrics, UpdateMetrics

__all__ = [
    "StepCallback",
    "Tracker",
    "Trackers",
    "check_trackers",
    "grouped_metrics",
    "grouped_name",
    "open_trackers",
]

log = get_logger("trackers")

MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}
"""The module each tracker imports; its pip extra has the tracker's name."""

_ROLLOUT = set(TrajectorySummary.model_fields)
_SIGNAL = set(SignalMetrics.model_fields)
_MISMATCH = {*LogprobMismatch.model_fields, "canary_gap"}
_LOSS = {"loss", "approx_kl_old", "kl_ref"}
_UPDATE = set(UpdateMetrics.model_fields) - _LOSS


class StepCallback(Protocol):
    """A user's own logging: called with each step's metrics once they are written."""

    def __call__(self, step: int, metrics: StepMetrics) -> None: ...


def grouped_name(key: str) -> str:
    """The tracker name of a flat `metrics.jsonl` key: `reward/*` (the rollout's rewards and
    each component's mean), `loss/*` (the loss and its KL terms), `update/*` (the rest of the
    policy update), `signal/*`, `mismatch/*` (sampler vs trainer, the canary), `timing/*`
    (seconds and throughput), `eval/*` (a held-out evaluation's, `eval.every`) and `rollout/*`
    (what the episodes did, env and worker counts)."""
    if key.startswith("eval_"):
        return "eval/" + key.removeprefix("eval_")
    if key.startswith("rewards/"):
        return "reward/" + key.removeprefix("rewards/")
    if key.startswith("staleness/"):
        return "rollout/" + key
    if key.startswith("mismatch_staleness/"):
        return "mismatch/staleness/" + key.removeprefix("mismatch_staleness/")
    if key.startswith("mismatch_cause/"):
        return "mismatch/cause/" + key.removeprefix("mismatch_cause/")
    if key in _ROLLOUT:
        return ("reward/" if "reward" in key else "rollout/") + key
    if key in _SIGNAL:
        return "signal/" + key
    if key in _MISMATCH:
        return "mismatch/" + key
    if key in _LOSS:
        return "loss/" + key
    if key in _UPDATE:
        return "update/" + key
    if key.endswith(("_time_s", "_per_s")):
        return "timing/" + key
    return "rollout/" + key


def grouped_metrics(metrics: StepMetrics) -> dict[str, float]:
    """The step's metrics under their grouped names, without the step and without the metrics
    that do not apply (None)."""
    return {
        grouped_name(k): float(v) for k, v in metrics.row().items() if k != "step" and v is not None
    }


class Tracker(Protocol):
    """One tracker's run: takes each step's grouped metrics, and is closed at the end, as
    failed when a step raised (its run must not stay `RUNNING`)."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def check_trackers(config: TrainConfig) -> None:
    """Every tracker `run.report_to` names can be imported: a missing one is a one-line error
    naming its extra, before any model work."""
    for name in config.run.report_to:
        if importlib.util.find_spec(MODULES[name]) is None:
            raise ConfigError(
                f"run.report_to names {name}, which is not installed: "
                f"pip install 'agent-grpo[{name}]'"
            )


class _TensorBoard:
    def __init__(self, path: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(path / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, path: Path, config: TrainConfig) -> None:
        import wandb

        # Offline unless WANDB_MODE says otherwise: the run's files stay under `{run}/wandb`
        # (`wandb sync` uploads them later).
        mode: Any = os.environ.get("WANDB_MODE", "offline")  # wandb checks the name
        settings = wandb.Settings(mode=mode, silent=True)
        self.run = wandb.init(
            project="agent-grpo",
            name=path.name,
            dir=str(path),
            config=config.model_dump(mode="json"),
            settings=settings,
            resume="allow",
            id=_run_id(path),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _Trackio:
    def __init__(self, path: Path, config: TrainConfig, resumed: bool) -> None:
        # Local: trackio's sqlite database, no server, no Space. trackio reads TRACKIO_DIR once,
        # at import: unless the user set it, the database goes under the run directory like
        # every other tracker's files, so the run directory holds all the run recorded.
        if "trackio" not in sys.modules:
            os.environ.setdefault("TRACKIO_DIR", str((path / "trackio").resolve()))
        import trackio
        import trackio.utils

        where = Path(trackio.utils.TRACKIO_DIR)
        if where.resolve() != (path / "trackio").resolve():
            log.info("trackio writes to %s (TRACKIO_DIR), not under the run directory", where)
        self.trackio = trackio
        self.run = trackio.init(
            project="agent-grpo",
            name=path.name,
            config=config.model_dump(mode="json"),
            resume="allow" if resumed else "never",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool = False) -> None:
        self.trackio.finish()


class _Mlflow:
    def __init__(self, path: Path, config: TrainConfig) -> None:
        from mlflow.tracking import MlflowClient

        # A sqlite store under the run directory; `mlflow ui --backend-store-uri` reads it.
        uri = f"sqlite:///{(path / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name("agent-grpo")
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(
                "agent-grpo", artifact_location=(path / "mlflow-artifacts").resolve().as_uri()
            )
        )
        runs = self.client.search_runs(
            [experiment_id], filter_string=f"tags.mlflow.runName = '{path.name}'"
        )
        if runs:  # a resumed run continues its MLflow run
            self.run_id = runs[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=path.name).info.run_id
            # The resolved config as an artifact (a param holds at most a few thousand chars).
            self.client.log_text(self.run_id, dump_config(config), "config.yaml")

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = _millis()
        metrics = [Metric(k, v, stamp, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _millis() -> int:
    import time

    return int(time.time() * 1000)


def _run_id(path: Path) -> str:
    """A wandb run id stable for the run directory, so `--resume` continues the same run."""
    import hashlib

    return hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]


def _open(name: str, path: Path, config: TrainConfig, resumed: bool) -> Tracker:
    if name == "tensorboard":
        return _TensorBoard(path)
    if name == "wandb":
        return _Wandb(path, config)
    if name == "trackio":
        return _Trackio(path, config, resumed)
    return _Mlflow(path, config)


class Trackers:
    """The run's trackers and callbacks, fed each written step by `record_step`."""

    def __init__(self, trackers: Sequence[Tracker], callbacks: Iterable[StepCallback] = ()) -> None:
        self.trackers = list(trackers)
        self.callbacks = list(callbacks)

    def log(self, metrics: StepMetrics) -> None:
        """Send the step to every tracker (grouped names), then to every callback."""
        if self.trackers:
            values = grouped_metrics(metrics)
            for tracker in self.trackers:
                tracker.log(metrics.step, values)
        for callback in self.callbacks:
            callback(metrics.step, metrics)

    def close(self, failed: bool = False) -> None:
        """Finish every tracker's run (wandb and trackio write their last records here); with
        `failed`, as failed (MLflow `FAILED`, wandb exit code 1)."""
        for tracker in self.trackers:
            tracker.close(failed)
        self.trackers = []


def open_trackers(
    path: Path | None,
    config: TrainConfig,
    callbacks: Iterable[StepCallback] = (),
    resumed: bool = False,
) -> Trackers:
    """The trackers `run.report_to` names, each writing under the run directory `path` (None, a
    rank other than 0: no trackers and no callbacks); `resumed` continues each tracker's run."""
    if path is None:
        return Trackers([])
    return Trackers([_open(n, path, config, resumed) for n in config.run.report_to], callbacks)


# The names `run.report_to` takes and the modules above agree.
assert set(MODULES) == set(TRACKERS)
