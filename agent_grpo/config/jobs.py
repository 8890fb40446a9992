"""The typed config of `agent-grpo train` and `agent-grpo eval`, loaded from `configs/*.yaml`.

Variants are named types chosen by `type` (a discriminated union), never import paths in YAML:
the generation backend (`hf`, `vllm`, `openai`) and each extra reward source.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, Self, get_args

from pydantic import Field, field_validator, model_validator

from agent_grpo.algo.config import AlgoConfig, SpeedConfig
from agent_grpo.config.base import ConfigModel, anchor_file_names
from agent_grpo.envs.text_env import HELDOUT_SEEDS
from agent_grpo.rewards import RewardSourceConfig
from agent_grpo.rollout.config import (
    BackendConfig,
    HFBackendConfig,
    OpenAIBackendConfig,
    RayWorkers,
    RolloutConfig,
    VLLMBackendConfig,
)

__all__ = [
    "TRACKERS",
    "AlgoConfig",
    "BackendConfig",
    "DistributedConfig",
    "EnvConfig",
    "EvalConfig",
    "EvalRunConfig",
    "HFBackendConfig",
    "LoraSettings",
    "ModelConfig",
    "OpenAIBackendConfig",
    "RolloutConfig",
    "RunConfig",
    "SpeedConfig",
    "TrackerName",
    "TrainConfig",
    "TrainEvalConfig",
    "VLLMBackendConfig",
    "WarmStartConfig",
]


class LoraSettings(ConfigModel):
    """A LoRA adapter on the policy (peft); the base weights stay frozen."""

    r: int = Field(default=16, ge=1)
    """Rank of each adapter."""
    alpha: int = Field(default=32, ge=1)
    """Scale: the update is `alpha / r * B @ A`."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input (training only)."""
    target_modules: list[str] = [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    ]  # fmt: skip
    """Names of the linear layers that get an adapter (Llama/Qwen naming)."""


class ModelConfig(ConfigModel):
    """Which policy to train."""

    name_or_path: str = "smollm2-135m-instruct"
    """An embedded model name, a local Hugging Face directory, or a Hugging Face hub id."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the forward passes (training and `hf` sampling). Parameters, and so the
    optimizer's master weights, stay fp32; bfloat16 runs under autocast. The frozen reference
    (`algo.beta > 0`) is held in this dtype unless `reference_dtype` says otherwise: it has no
    optimizer to keep fp32 weights for."""
    reference_dtype: Literal["float32", "bfloat16"] | None = None
    """The frozen reference's weights and forward pass; None: `dtype`. `bfloat16` under fp32
    training halves the reference's memory and about halves its forward's time on a CPU with
    bf16 matmuls, at a logprob gap measured in `bench/reference_dtype.py` (docs/performance.md,
    "A bf16 reference"): the k3 KL estimate then starts slightly above 0. Full fine-tuning
    only: with LoRA the reference is the policy itself with its adapter off."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter (peft) instead of every weight; None: full fine-tuning."""
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the policy, the reference and every batch tensor live: `auto` (this rank's GPU if
    CUDA is available, else the CPU), `cpu`, `cuda` (this rank's GPU) or `cuda:N`."""
    tool_format: str = "auto"
    """How the model writes tool calls and how a tool env announces its tools (docs/models.md):
    `hermes`, `qwen3_coder`, `llama3`, `mistral`, `mistral_v11`, `harmony`, `deepseek_v3`, or
    `auto`: read from the tokenizer's chat template, `hermes` for a ChatML template without
    tool markup (the embedded and test models), refused for any other template that shows no
    known format. Preflight writes the chosen name into `env.kwargs.tool_call_format`, where
    every env of the run (rollouts, evaluation, warm start, replay) is built from."""

    @field_validator("tool_format")
    @classmethod
    def _known_tool_format(cls, value: str) -> str:
        from agent_grpo.tools.formats.registry import AUTO, get_tool_format

        if value != AUTO:
            get_tool_format(value)  # ValueError naming the known formats
        return value


class EnvConfig(ConfigModel):
    """Which environment the tasks come from."""

    id: str = "agent_grpo/Calculator-v0"
    """Registered gymnasium id or `package.module:Class`."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for the environment constructor (e.g. max_turns, difficulty)."""

    @classmethod
    def anchor_files(cls, raw: dict[str, Any], folder: Path) -> None:
        """The kwargs the env declares as file names (`TextEnv.file_kwargs`)."""
        kwargs = raw.get("kwargs")
        if not isinstance(kwargs, dict) or not kwargs:
            return
        from agent_grpo.envs.registry import file_kwargs  # only a config with env kwargs pays

        for name in file_kwargs(str(raw.get("id", cls.model_fields["id"].default))):
            if name in kwargs:
                kwargs[name] = anchor_file_names(kwargs[name], folder)


class WarmStartConfig(ConfigModel):
    """Supervised warm start on the environment's expert trajectories (model tokens only)."""

    demos: int = Field(default=64, ge=1)
    """Expert episodes to imitate."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the demonstrations."""
    batch_size: int = Field(default=8, ge=1)
    """Episodes per optimizer step."""
    lr: float = Field(default=1e-4, gt=0.0)
    """AdamW learning rate."""


class EvalConfig(ConfigModel):
    """Evaluation on held-out seeds."""

    tasks: int = Field(default=64, ge=1, le=len(HELDOUT_SEEDS))
    """Held-out tasks to evaluate."""
    samples: int = Field(default=1, ge=1)
    """Samples per task (k of pass@k)."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 is greedy."""
    max_tokens: int = Field(default=96, ge=1)
    """Most tokens per assistant turn."""


class TrainEvalConfig(EvalConfig):
    """Held-out evaluation in a training run: before it, after the warm start, at its end, and
    every `every` steps between."""

    every: int = Field(default=0, ge=0)
    """Also evaluate after every this many GRPO steps (the policy those steps trained); the
    figures join that step's row of `metrics.jsonl` under the final evaluation's names
    (`eval_success_rate`, `eval_pass_at_k`, ...) with `eval_after_steps`, so a run's held-out
    curve is one column. 0: only before and after training. Each evaluation costs what the final
    one does; under torchrun the other ranks wait for it within `distributed.timeout_s`."""


class DistributedConfig(ConfigModel):
    """Data-parallel training under `torchrun` (docs/scaling.md)."""

    mode: Literal["none", "ddp", "fsdp"] = "none"
    """`none`: one process. `ddp`: every rank holds the whole model and gradients are averaged.
    `fsdp`: FSDP2 shards each decoder layer over the ranks. ddp and fsdp need
    `torchrun --nproc_per_node N -m agent_grpo.cli train ...` with N >= 2."""
    timeout_s: float = Field(default=3600.0, gt=0.0)
    """How long a rank waits in a collective (e.g. for rank 0's rollouts and evaluations)."""


TrackerName = Literal["tensorboard", "wandb", "trackio", "mlflow"]
"""A tracker `run.report_to` can name (agent_grpo/trainer/trackers.py)."""
TRACKERS: tuple[str, ...] = get_args(TrackerName)


class RunConfig(ConfigModel):
    """Where outputs go."""

    root: str = "runs"
    """Directory holding run directories."""
    name: str = "run"
    """Run name; the run directory is `{root}/{name}` (a name in use takes a timestamp:
    `{name}-YYYYmmdd-HHMMSS`, which the stored config names)."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Also save a checkpoint every N steps; 0: by `checkpoint_every_s` alone. A run always
    saves one before its first GRPO step (base eval and warm start done) and one at the end."""
    checkpoint_every_s: float = Field(default=300.0, ge=0.0)
    """Save a checkpoint after the first step that ends this many seconds after the last one
    (0 turns the clock off): a crash costs at most about this much training."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Keep the newest K checkpoints and delete older ones (each holds weights and AdamW
    state: about 1.6 GB for the 135M demo model)."""
    log_trajectories: bool = True
    """Write every trajectory record to the run directory."""
    report_to: list[TrackerName] = ["tensorboard"]
    """Trackers each step's metrics also go to, under grouped names (`reward/*`, `loss/*`,
    `timing/*`, ...), each writing under the run directory and offline (docs/tracking.md):
    `tensorboard` (`{run}/tensorboard`), `wandb` (offline, `{run}/wandb`), `trackio` (its local
    database), `mlflow` (`{run}/mlflow.db`). Each but TensorBoard is an extra:
    `pip install 'agent-grpo[wandb]'`. `[]`: metrics.jsonl alone."""
    tensorboard: bool | None = None
    """Older spelling, kept for existing configs: when `report_to` is not set, `false` means
    `report_to: []`; when it is set, `report_to` alone decides."""

    @model_validator(mode="after")
    def _fold_tensorboard(self) -> Self:
        if self.tensorboard is False and "report_to" not in self.model_fields_set:
            self.report_to = []
        if len(set(self.report_to)) != len(self.report_to):
            raise ValueError(f"run.report_to names a tracker twice: {self.report_to}")
        return self

    @field_validator("name")
    @classmethod
    def _a_directory_under_root(cls, name: str) -> str:
        parts = Path(name).parts
        if not name.strip() or not parts or Path(name).is_absolute() or ".." in parts:
            raise ValueError(f"run.name {name!r} must name a directory under run.root")
        return name


MOVED_TO_SPEED = "it moved to algo.speed (the switches that never change the result)"
"""What a config that still sets a speed switch directly under `algo` is told."""


class TrainConfig(ConfigModel):
    """`agent-grpo train`: base eval -> warm start -> GRPO -> final eval."""

    retired_keys: ClassVar[dict[str, str]] = {
        "rollout.progress": "it did nothing in training (the run's display shows each phase); "
        "delete the key",
        "rollout.check_invariants": "the token invariants are always checked (their cost is "
        "small next to sampling); delete the key",
        "algo.micro_batch_tokens": MOVED_TO_SPEED,
        "algo.shared_prefix": MOVED_TO_SPEED,
        "algo.skip_zero_advantage": MOVED_TO_SPEED,
        "algo.recompute_mlp": MOVED_TO_SPEED,
        "algo.optimizer_in_backward": MOVED_TO_SPEED,
    }

    seed: int = 0
    """Seed for task sampling, sampling and initialisation."""
    steps: int = Field(default=10, ge=0)
    """GRPO steps."""
    model: ModelConfig = ModelConfig()
    """Policy model."""
    env: EnvConfig = EnvConfig()
    """Environment."""
    rollout: RolloutConfig = RolloutConfig()
    """Group sampling."""
    algo: AlgoConfig = AlgoConfig()
    """The policy update."""
    rewards: list[RewardSourceConfig] = []
    """Extra reward sources added to the verifier's reward, each with a weight."""
    warm_start: WarmStartConfig | None = None
    """Supervised warm start before GRPO; None skips it."""
    eval: TrainEvalConfig | None = TrainEvalConfig()
    """Held-out evaluation before and after training (and every `eval.every` steps); None
    skips it."""
    run: RunConfig = RunConfig()
    """Output location and checkpointing."""
    distributed: DistributedConfig = DistributedConfig()
    """One process, or DDP / FSDP2 under torchrun."""

    @model_validator(mode="after")
    def _learnable(self) -> TrainConfig:
        rows = self.rollout.tasks_per_step * self.rollout.group_size
        if self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: GRPO's advantage is relative to "
                "the other members of a group, so a group of one never learns; use 2 or more"
            )
        if self.algo.minibatches > rows:
            raise ValueError(
                f"algo.minibatches={self.algo.minibatches} is more than the {rows} trajectories "
                "of a step (rollout.tasks_per_step x rollout.group_size): some minibatches "
                "would be empty"
            )
        return self

    @model_validator(mode="after")
    def _in_backward_alone(self) -> TrainConfig:
        if self.algo.speed.recompute_mlp and self.distributed.mode == "fsdp":
            raise ValueError("algo.speed.recompute_mlp with distributed.mode=fsdp is not built")
        if self.algo.speed.optimizer_in_backward and self.distributed.mode != "none":
            raise ValueError(
                "algo.speed.optimizer_in_backward with distributed.mode="
                f"{self.distributed.mode} is not built: DDP and FSDP reduce gradients after "
                "backward, not one by one"
            )
        return self

    @model_validator(mode="after")
    def _engine_fits_episodes(self) -> TrainConfig:
        _check_engine_length(self.rollout.backend, self.rollout.max_context_tokens, "rollout.")
        context = self.rollout.max_context_tokens
        _check_turn_fits(self.rollout.sampling.max_tokens, "rollout.sampling.", context, "rollout.")
        if self.eval is not None:
            _check_turn_fits(self.eval.max_tokens, "eval.", context, "rollout.")
        return self

    @model_validator(mode="after")
    def _async_needs_workers(self) -> TrainConfig:
        ray, partial = self.rollout.workers.type == "ray", self.rollout.partial is not None
        if self.algo.max_staleness > 0 and not (ray or partial):
            raise ValueError(
                f"algo.max_staleness={self.algo.max_staleness} trains samples older than the "
                "trainer's weights, which only rollout workers (rollout.workers={type: ray}) "
                "or partial rollouts (rollout.partial={}) take"
            )
        if partial and self.algo.dynamic_sampling:
            raise ValueError("rollout.partial with algo.dynamic_sampling is not built")
        keep_sampling = self.rollout.partial is not None and self.rollout.partial.keep_sampling
        if keep_sampling and not ray:
            raise ValueError(
                "rollout.partial.keep_sampling needs Ray rollout workers "
                "(rollout.workers={type: ray}): the trainer's own engine cannot sample while it "
                "trains"
            )
        if keep_sampling and self.algo.max_staleness < 1:
            raise ValueError(
                "rollout.partial.keep_sampling needs algo.max_staleness >= 1: at 0, every turn "
                "sampled during an update would be too old to train"
            )
        workers = self.rollout.workers
        if (
            partial
            and isinstance(workers, RayWorkers)
            and (self.rollout.tasks_per_step < workers.num_workers)
        ):
            raise ValueError(
                f"rollout.partial on {workers.num_workers} Ray workers needs at least as many "
                f"rollout.tasks_per_step (got {self.rollout.tasks_per_step}): a worker asked for "
                "no finished group would never advance its groups in flight"
            )
        if ray and self.algo.dynamic_sampling:
            raise ValueError("algo.dynamic_sampling with rollout.workers.type=ray is not built")
        vllm = isinstance(self.rollout.backend, VLLMBackendConfig)
        if ray and vllm and self.model.lora is not None and self.model.lora.r > 512:
            raise ValueError(
                f"model.lora.r={self.model.lora.r} on vllm Ray workers: vLLM's LoRA support "
                "takes ranks up to 512"
            )
        if ray and vllm and self.model.lora is not None and self.rollout.canary is not None:
            raise ValueError(
                "rollout.canary with model.lora on vllm Ray workers: the workers run the "
                "adapter with vLLM's LoRA support, which cannot score the canary's ids "
                "(vllm-project/vllm#29955); use the hf backend or set rollout.canary=null"
            )
        return self

    @model_validator(mode="after")
    def _reference_dtype_needs_own_reference(self) -> TrainConfig:
        if self.model.reference_dtype is not None and self.model.lora is not None:
            raise ValueError(
                "model.reference_dtype with model.lora: LoRA's reference is the policy itself "
                "with its adapter off, computed in model.dtype; remove one of the two"
            )
        return self

    @model_validator(mode="after")
    def _lora_in_one_process(self) -> TrainConfig:
        if self.model.lora is not None and self.distributed.mode != "none":
            raise ValueError(
                f"model.lora with distributed.mode={self.distributed.mode} is not built: train "
                "LoRA in one process (distributed.mode=none)"
            )
        return self

    @model_validator(mode="after")
    def _trainable_backend(self) -> TrainConfig:
        if isinstance(self.rollout.backend, OpenAIBackendConfig):
            raise ValueError(
                "rollout.backend.type=openai cannot receive the trainer's weights after each "
                "step; train with hf or vllm, and use openai with `agent-grpo eval`"
            )
        return self


def _check_engine_length(backend: BackendConfig, longest: int, prefix: str) -> None:
    """A vLLM engine shorter than the job's longest episode would refuse episodes mid-run."""
    if isinstance(backend, VLLMBackendConfig) and (backend.max_model_len or longest) < longest:
        raise ValueError(
            f"{prefix}backend.max_model_len={backend.max_model_len} is shorter than "
            f"{prefix}max_context_tokens={longest}: the engine would refuse such episodes "
            "mid-run; raise it, or leave it unset to follow max_context_tokens"
        )


def _check_turn_fits(max_tokens: int, tokens_prefix: str, context: int, prefix: str) -> None:
    """A turn of `max_tokens` must leave room in the context for at least a one-token prompt:
    longer, every turn would be cut to whatever room is left, and `max_tokens` would mean
    nothing."""
    if max_tokens >= context:
        raise ValueError(
            f"{tokens_prefix}max_tokens={max_tokens} is not less than "
            f"{prefix}max_context_tokens={context}: a turn that long leaves no room for the "
            f"prompt; lower {tokens_prefix}max_tokens or raise {prefix}max_context_tokens"
        )


class EvalRunConfig(ConfigModel):
    """`agent-grpo eval`: evaluate a model on an environment's held-out seeds."""

    seed: int = 0
    """Seed for sampling."""
    model: ModelConfig = ModelConfig()
    """Model to evaluate (a checkpoint directory works)."""
    env: EnvConfig = EnvConfig()
    """Environment."""
    backend: BackendConfig = HFBackendConfig()
    """Generation engine."""
    max_context_tokens: int = 1024
    """Longest episode in tokens."""
    eval: EvalConfig = EvalConfig()
    """What to evaluate."""
    run: RunConfig = RunConfig(name="eval")
    """Output location."""

    @model_validator(mode="after")
    def _engine_fits_episodes(self) -> EvalRunConfig:
        _check_engine_length(self.backend, self.max_context_tokens, "")
        _check_turn_fits(self.eval.max_tokens, "eval.", self.max_context_tokens, "")
        return self
