"""The typed config of `agent-grpo train` and `agent-grpo eval`, loaded from `configs/*.yaml`.

Variants are named types chosen by `type` (a discriminated union), never import paths in YAML:
the generation backend (`hf`, `vllm`, `openai`) and each extra reward source.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from agent_grpo.config import ConfigModel
from agent_grpo.rewards import RewardSourceConfig
from agent_grpo.rollout.backend import SamplingConfig

__all__ = [
    "AlgoConfig",
    "BackendConfig",
    "DistributedConfig",
    "EnvConfig",
    "EvalConfig",
    "EvalRunConfig",
    "HFBackendConfig",
    "ModelConfig",
    "OpenAIBackendConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "VLLMBackendConfig",
    "WarmStartConfig",
]


class ModelConfig(ConfigModel):
    """Which policy to train."""

    name_or_path: str = "smollm2-135m-instruct"
    """An embedded model name, a local Hugging Face directory, or a Hugging Face hub id."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the policy and reference model."""


class EnvConfig(ConfigModel):
    """Which environment the tasks come from."""

    id: str = "agent_grpo/Calculator-v0"
    """Registered gymnasium id or `package.module:Class`."""
    kwargs: dict[str, Any] = {}
    """Keyword arguments for the environment constructor (e.g. max_turns, difficulty)."""


class HFBackendConfig(ConfigModel):
    """Generate with transformers in the training process (shares the policy's weights)."""

    type: Literal["hf"] = "hf"
    """Backend name."""
    max_batch_size: int = 64
    """Most sequences decoded together."""


class VLLMBackendConfig(ConfigModel):
    """Generate with an in-process vLLM engine; weights are pushed after each optimizer step."""

    type: Literal["vllm"] = "vllm"
    """Backend name."""
    max_model_len: int = 4096
    """Longest sequence the engine accepts."""
    gpu_memory_utilization: float = 0.5
    """Fraction of accelerator memory vLLM may take (the trainer needs the rest)."""
    engine_kwargs: dict[str, Any] = {}
    """Extra `vllm.LLM` arguments."""


class OpenAIBackendConfig(ConfigModel):
    """Generate with a remote OpenAI-compatible completions server (e.g. `vllm serve`)."""

    type: Literal["openai"] = "openai"
    """Backend name."""
    base_url: str
    """Server root, e.g. http://127.0.0.1:8000."""
    model: str
    """Model name the server serves."""
    timeout_s: float = 120.0
    """Per-request timeout."""
    max_retries: int = 3
    """Retries on connection errors, 429 and 5xx."""
    max_concurrency: int = 16
    """Requests in flight at once."""


BackendConfig = Annotated[
    HFBackendConfig | VLLMBackendConfig | OpenAIBackendConfig, Field(discriminator="type")
]


class RolloutConfig(ConfigModel):
    """How groups are sampled each step."""

    backend: BackendConfig = HFBackendConfig()
    """Generation engine."""
    tasks_per_step: int = 8
    """Distinct tasks (prompts) per step."""
    group_size: int = 8
    """G: samples per task."""
    max_context_tokens: int = 1024
    """Longest episode in tokens."""
    env_step_timeout_s: float = 60.0
    """Deadline for one environment step."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings for training rollouts."""


class AlgoConfig(ConfigModel):
    """GRPO: group-relative advantages and a PPO-clipped token loss."""

    type: Literal["grpo"] = "grpo"
    """Algorithm name."""
    scale: Literal["group", "none"] = "group"
    """Divide advantages by the group std (`group`) or not (`none`, Dr. GRPO)."""
    leave_one_out: bool = False
    """Baseline is the mean of the other samples (RLOO) instead of the group mean."""
    clip_low: float = 0.2
    """Lower clip: ratios below 1 - clip_low stop pushing down."""
    clip_high: float = 0.2
    """Upper clip: ratios above 1 + clip_high stop pushing up (DAPO raises it to 0.28)."""
    beta: float = 0.0
    """Weight of KL(pi || pi_ref); 0 skips the reference model entirely."""
    kl: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    """How per-token losses become one number."""
    max_tokens: int | None = None
    """Normaliser for `seq-mean-token-sum-norm` (defaults to the longest model span)."""
    lr: float = 1e-5
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    epochs: int = 1
    """Passes over each step's batch (ratios leave 1 only from the second pass on)."""
    minibatches: int = 1
    """Optimizer steps per epoch; the batch is split into this many minibatches."""
    micro_batch_tokens: int = 4096
    """Most tokens per forward/backward; gradients are accumulated across micro-batches."""
    shared_prefix: bool = True
    """Run the backbone once over each group's shared prompt (same result, less compute)."""
    skip_zero_advantage: bool = True
    """With beta = 0, skip the forward pass of rows with zero advantage (they add exactly 0)."""
    old_logprobs: Literal["trainer", "sampler"] = "trainer"
    """Where pi_old comes from: recomputed by the trainer, or the sampler's logprobs."""
    tis_cap: float | None = None
    """Cap of truncated importance sampling weights exp(trainer - sampler); None disables."""
    drop_dead_groups: bool = False
    """Leave zero-variance groups out of the loss denominator."""
    dynamic_sampling: bool = False
    """Oversample tasks until the batch has `tasks_per_step` groups with reward variance."""
    dynamic_sampling_max_rounds: int = 3
    """Most extra collection rounds per step for dynamic sampling."""


class WarmStartConfig(ConfigModel):
    """Supervised warm start on the environment's expert trajectories (model tokens only)."""

    demos: int = 64
    """Expert episodes to imitate."""
    epochs: int = 1
    """Passes over the demonstrations."""
    batch_size: int = 8
    """Episodes per optimizer step."""
    lr: float = 1e-4
    """AdamW learning rate."""


class EvalConfig(ConfigModel):
    """Evaluation on held-out seeds."""

    tasks: int = 64
    """Held-out tasks to evaluate."""
    samples: int = 1
    """Samples per task (k of pass@k)."""
    temperature: float = 0.0
    """Sampling temperature; 0 is greedy."""
    max_tokens: int = 96
    """Most tokens per assistant turn."""


class DistributedConfig(ConfigModel):
    """Data-parallel training under `torchrun` (docs/scaling.md)."""

    mode: Literal["none", "ddp", "fsdp"] = "none"
    """`none`: one process. `ddp`: every rank holds the whole model and gradients are averaged.
    `fsdp`: FSDP2 shards each decoder layer over the ranks. ddp and fsdp need
    `torchrun --nproc_per_node N -m agent_grpo.cli train ...` with N >= 2."""
    timeout_s: float = 3600.0
    """How long a rank waits in a collective (e.g. for rank 0's rollouts and evaluations)."""


class RunConfig(ConfigModel):
    """Where outputs go."""

    root: str = "runs"
    """Directory holding run directories."""
    name: str = "run"
    """Run name; the run directory is `{root}/{name}`."""
    checkpoint_every: int = 0
    """Save a checkpoint every N steps (and always at the end); 0 saves only at the end."""
    log_trajectories: bool = True
    """Write every trajectory record to the run directory."""
    tensorboard: bool = True
    """Also write each step's metrics as TensorBoard scalars under `{run}/tensorboard`."""


class TrainConfig(ConfigModel):
    """`agent-grpo train`: base eval -> warm start -> GRPO -> final eval."""

    seed: int = 0
    """Seed for task sampling, sampling and initialisation."""
    steps: int = 10
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
    eval: EvalConfig | None = EvalConfig()
    """Held-out evaluation before and after training; None skips it."""
    run: RunConfig = RunConfig()
    """Output location and checkpointing."""
    distributed: DistributedConfig = DistributedConfig()
    """One process, or DDP / FSDP2 under torchrun."""

    @model_validator(mode="after")
    def _trainable_backend(self) -> TrainConfig:
        if isinstance(self.rollout.backend, OpenAIBackendConfig):
            raise ValueError(
                "rollout.backend.type=openai cannot receive the trainer's weights after each "
                "step; train with hf or vllm, and use openai with `agent-grpo eval`"
            )
        return self


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
