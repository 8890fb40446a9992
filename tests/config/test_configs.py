"""Every shipped config validates; bad keys are reported with the file and the dotted key."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_grpo.config.base import ConfigError, load_config
from agent_grpo.config.jobs import EvalRunConfig, TrainConfig, VLLMBackendConfig

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))
TINY = Path(__file__).parents[2] / "configs/calculator-tiny.yaml"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cls = EvalRunConfig if path.name.startswith("eval") else TrainConfig
    load_config(cls, path)


def test_there_are_configs() -> None:
    assert any(p.name == "calculator.yaml" for p in CONFIGS)


def test_unknown_key_names_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  clip_hihg: 0.3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml[\s\S]*algo\.clip_hihg"):
        load_config(TrainConfig, bad)


def test_overrides_and_discriminated_backend(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\n")
    config = load_config(TrainConfig, path, ["algo.beta=0.04", "rollout.backend.type=vllm"])
    assert config.algo.beta == 0.04
    assert isinstance(config.rollout.backend, VLLMBackendConfig)
    with pytest.raises(ConfigError, match=r"rollout\.backend"):
        load_config(TrainConfig, path, ["rollout.backend.type=tpu"])


def test_every_config_field_has_a_docstring() -> None:
    seen: set[type] = set()

    def walk(cls: type) -> None:
        if cls in seen or not hasattr(cls, "model_fields"):
            return
        seen.add(cls)
        for name, field in cls.model_fields.items():  # type: ignore[attr-defined]
            assert field.description, f"{cls.__name__}.{name} has no docstring"
            for arg in getattr(field.annotation, "__args__", ()) or (field.annotation,):
                walk(arg)

    walk(TrainConfig)
    walk(EvalRunConfig)
    assert len(seen) > 5


def test_training_on_a_remote_server_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  backend: {type: openai, base_url: http://x, model: m}\n")
    with pytest.raises(ConfigError, match="cannot receive the trainer's weights"):
        load_config(TrainConfig, path)


VLLM_WORKERS = ["rollout.workers={type: ray}", "rollout.backend={type: vllm}"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.old_logprobs=sampler", "algo.tis_cap=2.0"], "weights would all be 1"),
        (["algo.mask.low=0.6", "algo.tis_cap=2.0"], "algo.mask and algo.tis_cap"),
        (["algo.dual_clip=1.0"], "algo.dual_clip"),
        (["algo.ratio=seq"], "algo.ratio"),
        (["algo.max_tokens=100"], "would be ignored"),
        (["rollout.group_size=1"], "group of one never learns"),
        (["steps=-1"], "steps"),
        (["algo.minibatches=5"], "some minibatches"),
        (["model.device=gpu"], "model.device"),
        (["algo.epochs=0"], "algo.epochs"),
        # values that once passed and then crashed after the base eval, never ended or
        # sampled the least likely token
        (["warm_start={epochs: 0}"], "warm_start.epochs: Input should be greater than or equal"),
        (["warm_start={batch_size: 0}"], "warm_start.batch_size"),
        (["eval.tasks=-3"], "eval.tasks: Input should be greater than or equal to 1"),
        (["eval.tasks=2000000"], "eval.tasks: Input should be less than or equal to 1000000"),
        (["eval.samples=0"], "eval.samples"),
        (["rollout.sampling.temperature=-1"], "rollout.sampling.temperature"),
        (["rollout.sampling.top_p=0"], "rollout.sampling.top_p"),
        (["rollout.sampling.max_tokens=0"], "rollout.sampling.max_tokens"),
        (["distributed.timeout_s=-1"], "distributed.timeout_s"),
        (["run.name="], "run.name '' must name a directory under run.root"),
        (["run.name=../elsewhere"], "must name a directory under run.root"),
        (["run.name=."], "run.name '.' must name a directory under run.root"),
        (["steps=true"], "steps is true, not a number"),  # pydantic's lax mode: one step
        (["algo.lr=false"], "algo: lr is false, not a number"),
        (["rollout.workers={type: ray, resources: {CPU: 1}}"], "Ray's own resource 'CPU'"),
        (["rollout.workers={type: ray, resources: {node: 0}}"], "with a positive amount"),
        (["rollout.workers={type: ray, weight_sync: nccl}"], "weight_sync"),
        (
            [
                "rollout.partial={}",
                "rollout.tasks_per_step=1",
                "rollout.workers={type: ray, num_workers: 2}",
            ],
            "needs at least as many rollout.tasks_per_step",
        ),
        (
            ["rollout.partial={keep_sampling: true}", "algo.max_staleness=1"],
            "keep_sampling needs Ray rollout workers",
        ),
        (
            ["rollout.partial={keep_sampling: true}", "rollout.workers={type: ray}"],
            "keep_sampling needs algo.max_staleness >= 1",
        ),
        ([*VLLM_WORKERS, "model.lora={}", "rollout.canary={}"], "cannot score the canary"),
        ([*VLLM_WORKERS, "model.lora={r: 600}"], "takes ranks up to 512"),
        (
            ["model.tool_format=qwen"],
            "model.tool_format: unknown tool-call format 'qwen'; known "
            "formats: auto, deepseek_v3, harmony, hermes",
        ),
    ],
)
def test_meaningless_settings_are_refused_before_any_model_work(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, TINY, overrides)


def test_lora_on_ray_workers_with_placement_and_broadcast_loads() -> None:
    workers = "rollout.workers={type: ray, resources: {rollout_node: 1}, weight_sync: broadcast}"
    config = load_config(TrainConfig, TINY, [workers, "model.lora={}", "rollout.canary={}"])
    assert config.rollout.workers.resources == {"rollout_node": 1.0}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "override", ["rollout.sampling.max_tokens=600", "rollout.sampling.max_tokens=512",
                 "eval.max_tokens=900"],
)  # fmt: skip
def test_a_turn_that_fills_the_context_is_refused(override: str) -> None:
    key = override.partition("=")[0]
    with pytest.raises(ConfigError, match=rf"{override} is not less than .*context_tokens=512"):
        load_config(TrainConfig, TINY, [override])
    assert load_config(TrainConfig, TINY, [f"{key}=511"])  # a one-token prompt fits


def test_an_eval_turn_that_fills_the_context_is_refused() -> None:
    with pytest.raises(ValueError, match=r"eval.max_tokens=512 is not less than max_context"):
        EvalRunConfig.model_validate({"max_context_tokens": 512, "eval": {"max_tokens": 512}})


@pytest.mark.parametrize(
    ("cls", "env_id", "anchored"),
    [
        (TrainConfig, "agent_grpo/Dataset-v0", True),
        (EvalRunConfig, "agent_grpo/Dataset-v0", True),
        (TrainConfig, "agent_grpo/Calculator-v0", False),  # declares no file_kwargs
        (TrainConfig, "no_such_module:Env", False),  # preflight names it; loading does not fail
    ],
)
def test_only_the_file_names_an_env_declares_are_read_beside_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: type, env_id: str, anchored: bool
) -> None:
    (tmp_path / "project" / "data").mkdir(parents=True)
    (tmp_path / "project" / "data" / "rows.jsonl").write_text("{}\n")
    path = tmp_path / "project" / "job.yaml"
    path.write_text(f"env:\n  id: {env_id}\n  kwargs:\n    data_files: data/rows.jsonl\n")
    monkeypatch.chdir(tmp_path)
    config = load_config(cls, path)
    full = str((tmp_path / "project" / "data" / "rows.jsonl").resolve())
    assert config.env.kwargs["data_files"] == (full if anchored else "data/rows.jsonl")


@pytest.mark.parametrize(
    ("content", "overrides", "message"),
    [
        (b"steps: 2\nalgo: {lr: 1.0e-5}\nalgo: {lr: 5.0}\n", [],
         r"is not valid YAML: the key 'algo' is set twice at line 3, column 1$"),
        (b"", [], r"is empty \(write \{\} for every default\)$"),
        (b"steps: 2\n# \xff\xfe\n", [], r"is not UTF-8 text \(invalid start byte at byte 11\)$"),
        (b"steps: 2\n", ["a.b.c=["], r"^override 'a.b.c=\[': not a YAML value: expected the node"),
        (b"steps: 2\n", ["algo={lr: 1, lr: 2}"],
         r"^override 'algo=\{lr: 1, lr: 2\}': not a YAML value: the key 'lr' is set twice"),
    ],
    ids=["duplicate-key", "empty", "not-utf8", "override-yaml", "override-duplicate-key"],
)  # fmt: skip
def test_a_config_file_that_does_not_read_as_one_mapping_is_one_line(
    tmp_path, content: bytes, overrides: list[str], message: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as error:
        load_config(TrainConfig, path, overrides)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"is a directory$"):
        load_config(TrainConfig, tmp_path)
    assert load_config(TrainConfig, write(tmp_path / "defaults.yaml", "{}")).steps >= 0
    # a YAML merge (`<<: *anchor`) may repeat the keys it merges: that is what it is for
    merged = "rollout:\n  sampling: &s {max_tokens: 16, temperature: 1.0}\n" \
             "eval: {<<: *s, max_tokens: 8}\n"  # fmt: skip
    assert load_config(TrainConfig, write(tmp_path / "merged.yaml", merged)).eval is not None


def write(path, text: str):  # type: ignore[no-untyped-def]
    path.write_text(text)
    return path
