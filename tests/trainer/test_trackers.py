"""The trackers `run.report_to` names, each read back from what it stored offline, their grouped
metric names, and the Python API's step callbacks."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import agent_grpo
from agent_grpo.config.base import ConfigError, dump_config, load_config
from agent_grpo.config.jobs import RunConfig, TrainConfig
from agent_grpo.testing.cli_runs import TINY_CONFIG, metrics, tiny_train
from agent_grpo.trainer import trackers
from agent_grpo.trainer.metrics import StepMetrics
from agent_grpo.trainer.resume import check_resume
from agent_grpo.trainer.trackers import grouped_name


def _tiny(tmp_path: Path, model_dir: Path, *settings: str) -> list[str]:
    """The overrides `tiny_train` applies, for runs through the Python API."""
    return [f"model.name_or_path={model_dir}", f"run.root={tmp_path}", "eval=null",
            "warm_start=null", *settings]  # fmt: skip


GROUPS = {"reward", "loss", "update", "signal", "mismatch", "timing", "rollout", "eval"}


def heldout_row() -> list[str]:
    """The flat names a held-out evaluation adds to its step's row (`eval.every`)."""
    from agent_grpo.evaluation.heldout import EvalResult
    from agent_grpo.rollout.summary import summarize_trajectories

    result = EvalResult(tasks=1, samples_per_task=2, pass_at_k=0.5, pass_at={1: 0.5, 2: 0.5},
                        summary=summarize_trajectories([]))  # fmt: skip
    return list(result.row())


def _installed(module: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"{module} is not installed (pip install 'agent-grpo[{module}]')",
    )


def _step0(run: Path) -> dict[str, float]:
    """Step 0's row of metrics.jsonl under the grouped names, the metrics that apply."""
    row = metrics(run)[0]
    assert row["step"] == 0
    return {grouped_name(k): v for k, v in row.items() if k != "step" and v is not None}


def _assert_same(stored: dict[str, float], run: Path) -> None:
    expected = _step0(run)
    assert set(stored) == set(expected)
    assert stored == pytest.approx(expected, rel=1e-6)


GROUPED_NAMES = [
    ("reward_mean", "reward/reward_mean"),
    ("rewards/verifier/mean", "reward/verifier/mean"),
    ("loss", "loss/loss"),
    ("kl_ref", "loss/kl_ref"),
    ("grad_norm", "update/grad_norm"),
    ("step_time_s", "timing/step_time_s"),
    ("rollout_tokens_per_s", "timing/rollout_tokens_per_s"),
    ("success_rate", "rollout/success_rate"),
    ("dead_group_fraction", "signal/dead_group_fraction"),
    ("canary_gap", "mismatch/canary_gap"),
    ("staleness/1", "rollout/staleness/1"),
    ("mismatch_staleness/1", "mismatch/staleness/1"),
    ("mismatch_cause/dtype", "mismatch/cause/dtype"),
    ("worker_failures", "rollout/worker_failures"),
    ("eval_success_rate", "eval/success_rate"),
]
"""Flat metric names and the grouped names trackers show them under."""


def test_every_flat_key_gets_a_group_and_names_stay_distinct() -> None:
    fields = StepMetrics.model_fields
    flat = [k for k in fields if k not in {"rollout", "signal", "mismatch", "update", "times"}]
    for part in ("rollout", "signal", "mismatch", "update", "times"):
        flat += list(fields[part].annotation.model_fields)  # type: ignore[union-attr]
    flat = [k for k in flat if k not in {"step", "reward_means", "staleness", "heldout",
                                         "mismatch_by_staleness", "mismatch_causes"}]  # fmt: skip
    flat += ["rewards/verifier/mean", "rewards/even/mean", "staleness/0", "staleness/2",
             "mismatch_staleness/0", "mismatch_staleness/1", "mismatch_cause/filter",
             "mismatch_cause/kernels", *heldout_row()]  # fmt: skip
    names = [grouped_name(k) for k in flat]
    assert len(set(names)) == len(names)
    assert {n.split("/")[0] for n in names} == GROUPS


@pytest.mark.parametrize(("flat", "grouped"), GROUPED_NAMES)
def test_a_flat_key_is_shown_under_its_group(flat: str, grouped: str) -> None:
    assert grouped_name(flat) == grouped


def test_tensorboard_false_means_no_tracker_unless_report_to_is_set() -> None:
    assert RunConfig().report_to == ["tensorboard"]
    assert RunConfig(tensorboard=False).report_to == []
    assert RunConfig(tensorboard=True).report_to == ["tensorboard"]
    assert RunConfig(tensorboard=False, report_to=["wandb"]).report_to == ["wandb"]
    dumped = RunConfig.model_validate(RunConfig(tensorboard=False).model_dump())
    assert dumped.report_to == []


def test_report_to_refuses_unknown_and_repeated_names() -> None:
    with pytest.raises(ConfigError, match=r"run\.report_to"):
        load_config(TrainConfig, TINY_CONFIG, ["run.report_to=[comet]"])
    with pytest.raises(ConfigError, match="twice"):
        load_config(TrainConfig, TINY_CONFIG, ["run.report_to=[wandb, wandb]"])


def test_a_tracker_not_installed_is_one_line_before_any_run_directory(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(trackers.MODULES, "wandb", "no_such_module_for_wandb")
    with pytest.raises(ConfigError) as caught:
        agent_grpo.train(
            TINY_CONFIG, overrides=_tiny(tmp_path, tiny_model_dir, "run.report_to=[wandb]")
        )
    assert str(caught.value) == (
        "run.report_to names wandb, which is not installed: pip install 'agent-grpo[wandb]'"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_run_from_before_report_to_resumes_unasked(tmp_path: Path) -> None:
    config = load_config(TrainConfig, TINY_CONFIG, [f"run.root={tmp_path}"])
    old = yaml.safe_load(dump_config(config))
    del old["run"]["report_to"]
    old["run"]["tensorboard"] = True
    run = tmp_path / config.run.name
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(old))
    assert check_resume(config, accept_config_change=False) == []


def test_callbacks_get_each_written_step(tmp_path: Path, tiny_model_dir: Path) -> None:
    seen: list[tuple[int, StepMetrics, int]] = []

    def callback(step: int, m: StepMetrics) -> None:
        lines = (tmp_path / "calculator-tiny" / "metrics.jsonl").read_text().splitlines()
        seen.append((step, m, len(lines)))

    overrides = _tiny(tmp_path, tiny_model_dir, "run.report_to=[]")
    run = agent_grpo.train(TINY_CONFIG, overrides=overrides, callbacks=[callback])
    rows = metrics(run.path)
    assert [s for s, _, _ in seen] == [0, 1]
    assert [n for _, _, n in seen] == [1, 2]  # called once the step's row is written
    assert [m.row() for _, m, _ in seen] == rows


def test_tensorboard_stores_the_grouped_names(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tiny_train(tmp_path, tiny_model_dir, "run.report_to=[tensorboard]")
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    stored = {
        tag: s.value for tag in events.Tags()["scalars"] for s in events.Scalars(tag) if s.step == 0
    }
    _assert_same(stored, run)


def _wandb_records(data: bytes) -> list[bytes]:
    """The records of a `.wandb` file: a 7-byte header (`:W&B`, magic, version), then LevelDB's
    log format, 32 KiB blocks of chunks, each `crc32 u32, length u16, type u8` and its bytes
    (types: 1 whole, 2 first, 3 middle, 4 last), a block's tail under 7 bytes padding."""
    assert data[:4] == b":W&B"
    block, at, records, parts = 32768, 7, [], b""
    while at + 7 <= len(data):
        if block - at % block < 7:
            at += block - at % block
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + 7])
        chunk = data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind == 0 and length == 0:
            continue
        parts += chunk
        if kind in (1, 4):
            records.append(parts)
            parts = b""
    return records


@_installed("wandb")
def test_wandb_offline_run_stores_the_grouped_names(tmp_path: Path, tiny_model_dir: Path) -> None:
    from wandb.proto import wandb_internal_pb2

    run = tiny_train(tmp_path, tiny_model_dir, "run.report_to=[wandb]")
    (stored_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    history: dict[int, dict[str, float]] = {}
    for data in _wandb_records(stored_file.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") != "history":
            continue
        items = {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in record.history.item
        }
        history[int(items["_step"])] = items
    stored = {k: v for k, v in history[0].items() if not k.startswith("_")}
    _assert_same(stored, run)


@_installed("mlflow")
def test_mlflow_store_holds_the_grouped_names(tmp_path: Path, tiny_model_dir: Path) -> None:
    from mlflow.tracking import MlflowClient

    run = tiny_train(tmp_path, tiny_model_dir, "run.report_to=[mlflow]")
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("agent-grpo")
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == run.name and found.info.status == "FINISHED"
    stored = {
        key: m.value
        for key in found.data.metrics
        for m in client.get_metric_history(found.info.run_id, key)
        if m.step == 0
    }
    _assert_same(stored, run)


@_installed("mlflow")
def test_a_run_whose_step_raises_ends_its_mlflow_run_failed(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    import agent_grpo.trainer.loop as loop

    real_step = loop.train_step

    def second_step_raises(config, trainer, step, *args, **kwargs):  # type: ignore[no-untyped-def]
        if step == 1:
            raise RuntimeError("the env's server went away")
        return real_step(config, trainer, step, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", second_step_raises)
    with pytest.raises(RuntimeError, match="went away"):
        tiny_train(tmp_path, tiny_model_dir, "run.report_to=[mlflow]", "steps=2")
    (store,) = tmp_path.glob("*/mlflow.db")
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("agent-grpo")
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.status == "FAILED"  # not left RUNNING
    assert client.get_metric_history(found.info.run_id, "loss/loss")  # step 0 was logged


@_installed("trackio")
def test_trackio_database_goes_under_the_run_directory(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    # a fresh interpreter: trackio reads TRACKIO_DIR once, at import
    script = (
        "import sys; from pathlib import Path\n"
        "from agent_grpo.testing.cli_runs import tiny_train\n"
        "print(tiny_train(Path(sys.argv[1]), Path(sys.argv[2]), 'run.report_to=[trackio]'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRACKIO_DIR"}
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(tiny_model_dir)],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    run = Path(done.stdout.strip().splitlines()[-1])
    assert list((run / "trackio").glob("*.db")), sorted(p.name for p in run.iterdir())


@_installed("trackio")
def test_trackio_local_database_holds_the_grouped_names(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trackio
    import trackio.sqlite_storage
    import trackio.utils
    from trackio.sqlite_storage import SQLiteStorage

    for module in (trackio, trackio.utils, trackio.sqlite_storage):  # TRACKIO_DIR, read at import
        monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    run = tiny_train(tmp_path, tiny_model_dir, "run.report_to=[trackio]")
    assert (tmp_path / "trackio").is_dir()
    logs = SQLiteStorage.get_logs("agent-grpo", run=run.name)
    (first,) = [row for row in logs if row["step"] == 0]
    stored = {k: v for k, v in first.items() if k not in {"step", "timestamp"}}
    _assert_same(stored, run)


def test_every_example_config_of_the_tracking_page_validates() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "tracking.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", page, flags=re.S)
    named = set()
    for block in blocks:
        config = TrainConfig.model_validate(yaml.safe_load(block))
        named.update(config.run.report_to)
    assert named == {"tensorboard", "wandb", "trackio", "mlflow"}
    assert len(blocks) == 5  # one with all four, then one per tracker's section
