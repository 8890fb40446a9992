"""The configs of rollouts: the generation backend (a discriminated union on `type`) and how
groups are sampled: what a user sets. The collector takes its own arguments
(`collector.CollectOptions`), built from this config by training and set directly by evaluation.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from agent_grpo.config.base import ConfigModel
from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.context import ContextPolicy, StopAtLimit

__all__ = [
    "BackendConfig",
    "CanaryConfig",
    "HFBackendConfig",
    "LocalWorkers",
    "OpenAIBackendConfig",
    "PartialConfig",
    "RayWorkers",
    "RolloutConfig",
    "VLLMBackendConfig",
    "WorkersConfig",
]


class HFBackendConfig(ConfigModel):
    """Generate with transformers in the training process (shares the policy's weights)."""

    type: Literal["hf"] = "hf"
    """Backend name."""
    max_batch_size: int = 64
    """Most sequences decoded together."""
    packed_decode: bool = True
    """On CPU, decode steps run the linear layers on oneDNN with the weights reordered once per
    weight update (`agent_grpo/rollout/backends/packed_linear.py`), which streams them faster than
    `F.linear` at a few rows; it holds one more copy of the weights while a rollout runs.
    false: `F.linear` throughout."""
    shared_prefix_attention: bool = True
    """On CPU, the prefix every row of a batch starts with (an environment's system prompt and
    tools) keeps one copy of its keys and values, and attention reads it once for all rows
    (`agent_grpo/models/shared_prefix_attention.py`) instead of once per row. false: every row
    holds the whole prefix in its own cache."""


class VLLMBackendConfig(ConfigModel):
    """Generate with an in-process vLLM engine; weights are pushed after each optimizer step."""

    type: Literal["vllm"] = "vllm"
    """Backend name."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The engine's weights and KV cache. bfloat16 halves both and the bytes each decode step
    reads, at the price of a larger sampler/trainer logprob mismatch (logged every step)."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest sequence the engine accepts; None: the job's longest episode
    (`rollout.max_context_tokens`)."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Most sequences decoded together; None: the most a step or an evaluation samples at
    once (tasks x group size)."""
    kv_cache_memory_bytes: int | None = Field(default=None, ge=1)
    """KV cache size; None: enough for `max_num_seqs` sequences of `max_model_len` tokens (vLLM's
    own default on CPU takes half the machine's memory). `VLLM_CPU_KVCACHE_SPACE` (GiB), when
    set, wins over this."""
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


class LocalWorkers(ConfigModel):
    """Rollouts in the trainer's process, on its own engine (`backend`): no Ray needed."""

    type: Literal["local"] = "local"
    """Workers kind."""


class RayWorkers(ConfigModel):
    """Rollouts on Ray actors, each with its own engine (`backend`) and environments; whole
    groups go to one worker. With `algo.max_staleness > 0` they sample ahead of the trainer."""

    type: Literal["ray"] = "ray"
    """Workers kind."""
    num_workers: int = Field(default=2, ge=1)
    """Rollout actors."""
    address: str | None = None
    """An existing Ray cluster (`auto`, `host:port` or `ray://host:port`). None joins the cluster
    in `RAY_ADDRESS` when that is set (as under `ray job submit`), and otherwise starts a private
    local instance, never a cluster some `ray start` left running on the machine."""
    num_cpus_per_worker: float = Field(default=1.0, gt=0)
    """CPUs Ray reserves for each actor."""
    num_gpus_per_worker: float = Field(default=0.0, ge=0)
    """GPUs Ray reserves for each actor."""
    resources: dict[str, float] = {}
    """Custom Ray resources each actor needs, e.g. `{rollout_node: 1}` to place the actors on
    the nodes started with `ray start --resources '{"rollout_node": 1}'` (docs/scaling.md).
    CPUs and GPUs are the two fields above."""
    weight_sync: Literal["object_store", "broadcast"] = "broadcast"
    """How a push reaches the actors. `broadcast`: the trainer broadcasts the tensors over a
    process group it shares with the actors (gloo for CPU weights, NCCL for CUDA weights;
    agent_grpo/rollout/weight_sync.py). `object_store`: one `ray.put` that every actor reads.
    Timings of both: docs/benchmarks.md; why the default: docs/scaling.md."""

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(
                    f"rollout.workers.resources names Ray's own resource {name!r}: set "
                    "num_cpus_per_worker / num_gpus_per_worker instead"
                )
            if not name or amount <= 0:
                raise ValueError(
                    f"rollout.workers.resources: {name!r}: {amount} must be a named resource "
                    "with a positive amount"
                )
        return value


WorkersConfig = Annotated[LocalWorkers | RayWorkers, Field(discriminator="type")]


class PartialConfig(ConfigModel):
    """Partial rollouts (agent_grpo/rollout/partial.py): groups still running when a step has
    its groups continue, from where they are, on the weights that step pushes, instead of
    holding the step back. A turn trains while it is at most `algo.max_staleness` versions old
    and is context after that, so with `max_staleness: 0` only a carried episode's turns
    sampled after the last update train."""

    over_sample: int = Field(default=2, ge=1)
    """Groups kept in flight beyond `tasks_per_step`: each step trains the first
    `tasks_per_step` to finish, oldest first; the slowest carry on into later steps."""
    keep_sampling: bool = False
    """Ray workers keep sampling while the trainer updates and load each push between two
    turns as it arrives (agent_grpo/rollout/streaming.py), instead of running turns only inside
    a step's call, behind the pushes queued before it. Fewer carried turns pass
    `algo.max_staleness` and the engines do not wait for the update; but which version samples
    a turn then depends on timing, so two runs of one config differ. Needs
    `rollout.workers: {type: ray}` and `algo.max_staleness` >= 1; `over_sample` near
    `max_staleness * tasks_per_step` measured best (docs/scaling.md)."""


class CanaryConfig(ConfigModel):
    """The weight canary: after a push, every engine scores a few fixed sequences and the
    trainer compares those logprobs with its own (agent_grpo/trainer/canary.py). An engine
    that still holds older weights, or whose logprobs sit further than `max_gap` from the
    trainer's, stops the run with one line naming it."""

    every: int = Field(default=1, ge=1)
    """Check after every this many pushes."""
    sequences: int = Field(default=2, ge=1)
    """How many of the first step's trajectories make the canary (each scored whole)."""
    max_gap: float = Field(default=0.1, gt=0.0)
    """Largest mean |engine - trainer| logprob over the canary's model tokens, in nats: far
    above kernel and dtype differences (docs/scaling.md), far below what a missed push of a
    trained policy leaves."""


class RolloutConfig(ConfigModel):
    """How groups are sampled each step."""

    backend: BackendConfig = HFBackendConfig()
    """Generation engine."""
    workers: WorkersConfig = LocalWorkers()
    """Where rollouts run: in the trainer's process (`local`) or on Ray actors (`ray`)."""
    partial: PartialConfig | None = None
    """Partial rollouts: a weight update does not wait for the episodes in flight
    (`PartialConfig`; `{}` turns them on); None: every step's groups run to their end on one
    policy."""
    tasks_per_step: int = Field(default=8, ge=1)
    """Distinct tasks (prompts) per step."""
    group_size: int = Field(default=8, ge=1)
    """G: samples per task."""
    max_context_tokens: int = Field(default=1024, ge=1)
    """Longest context in tokens (of any branch of an episode)."""
    context: ContextPolicy = StopAtLimit()
    """What an episode does when its next turn (`sampling.max_tokens`) would not fit
    `max_context_tokens`: `stop`, or rewrite the oldest tool observations (`drop`, `truncate`,
    `compact` with a summary) through the token tree (agent_grpo/rollout/context.py)."""
    env_step_timeout_s: float = Field(default=60.0, gt=0)
    """Deadline for one environment step."""
    check_renders: bool = False
    """Also render every branch of every episode from scratch and require it to equal the
    branch's ids (`trajectory.invariants.check_branch_renders`): a chat template's renders per
    branch more per episode. The cheap invariants run on every record regardless."""
    sampling: SamplingConfig = SamplingConfig()
    """Sampling settings for training rollouts."""
    mismatch_causes_every: int = Field(default=0, ge=0)
    """Every this many steps, split the sampler/trainer logprob gap of the tokens the trainer's
    own weights sampled into the sampling filter's, the engine dtype's and the kernels' shares
    (`mismatch_cause/<name>`, agent_grpo/trainer/mismatch.py): one more forward pass without
    gradient. 0: never. Staleness's share is logged every step (`mismatch_staleness/<k>`)."""
    canary: CanaryConfig | None = None
    """Check after weight pushes that every engine holds the pushed weights (`CanaryConfig`;
    `{}` checks every push); None: no check."""
    stop_on_env_error: bool = False
    """Stop at the first env step or verifier that raises or hangs (after its one retry), with
    the env, the seed and the model's action, instead of recording the episode as an error."""
    on_failure: Literal["exclude", "drop_group"] = "exclude"
    """What an infrastructure failure (env or engine failure after its retry, a reward source
    that could not score, a non-finite reward) does to its group. `exclude`: the episode alone
    leaves the group's statistics and the loss, and the rest of the group trains, its baseline
    the mean (and std) of the survivors; the survivors are the episodes that did not fail, so
    when failures correlate with the outcome (long episodes time out, and long episodes are the
    failing ones) the baseline is biased towards the easy members. `drop_group`: the whole group
    leaves the statistics and the loss (tinker-cookbook, NeMo-RL), which removes that partial-group
    bias but biases the batch towards tasks that never fail, and throws the survivors' samples
    away. Excluded episodes are counted in `excluded_trajectories`, groups left with no counted
    member in `dropped_groups`."""
