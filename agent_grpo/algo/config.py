"""`AlgoConfig`: every knob of the GRPO update, with the combinations that mean nothing refused.

Validation happens when the YAML is loaded, before any model work, so a meaningless combination
is a one-line error naming the keys instead of a silently different algorithm.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from agent_grpo.algo.choices import Aggregation, KLKind, MaskLevel, RatioLevel, advantage_scale
from agent_grpo.config.base import ConfigModel

__all__ = ["AlgoConfig", "MaskConfig", "SpeedConfig", "TurnCreditConfig"]


class MaskConfig(ConfigModel):
    """Masked importance sampling (MIS; IcePop with the defaults): trained tokens whose
    trainer/sampler ratio pi_old / mu leaves [low, high] get weight 0, the others their ratio
    (`agent_grpo.algo.masking`). Where truncation (`tis_cap`) keeps a far-off token at a capped
    weight, masking drops it."""

    low: float = Field(default=0.5, gt=0.0, le=1.0)
    """Lower end of the band (IcePop: 0.5)."""
    high: float = Field(default=5.0, ge=1.0)
    """Upper end of the band (IcePop: 5)."""
    level: MaskLevel = "token"
    """`token`: each token's own ratio; `sequence`: the product of a row's token ratios, the
    whole row kept or dropped (verl's `rollout_rs: sequence`)."""


class TurnCreditConfig(ConfigModel):
    """Turn-level credit (GiGPO's step-level groups, `agent_grpo.algo.turn_credit`): each turn's
    tokens get the episode advantage plus `weight` times a step advantage, the turn's return
    compared with the returns of the group's turns from the same state."""

    type: Literal["gigpo"] = "gigpo"
    """The credit rule (one so far)."""
    weight: float = Field(default=1.0, ge=0.0)
    """omega, the step advantage's weight (GiGPO: 1)."""
    discount: float = Field(default=1.0, gt=0.0, le=1.0)
    """gamma of the turns' returns-to-go (GiGPO: 0.95)."""


class SpeedConfig(ConfigModel):
    """Switches that change how fast the update runs and how much memory it holds, never what
    it computes: each gives the same loss and gradients up to floating-point rounding (the
    tests compare each against its off position, tests/trainer/test_knobs.py)."""

    micro_batch_tokens: int = Field(default=4096, ge=1)
    """Most tokens per forward/backward: padded rows x longest row or, with `shared_prefix`,
    the tokens that pass computes (prompts once, then every row past its prompt, padded to the
    longest, and each row's copy of its prompt's keys and values at their share of a token's
    memory); whole groups share a micro-batch while they fit, and gradients are accumulated
    across micro-batches."""
    shared_prefix: bool = True
    """Run the backbone once over each group's shared prompt, the prompts of every group in a
    micro-batch in one pass and the tokens they all start with (an environment's system prompt
    and tools) once (less compute); the warm start runs its demonstrations' common prefix once
    per micro-batch."""
    skip_zero_advantage: bool = True
    """With beta = 0, skip the forward pass of rows with zero advantage (they add exactly 0)."""
    recompute_mlp: bool = False
    """Recompute each decoder layer's MLP in backward instead of keeping its activations: about
    half the saved activations for one extra MLP forward (agent_grpo/trainer/recompute.py;
    measured in docs/benchmarks.md)."""
    optimizer_in_backward: bool = False
    """Step AdamW inside backward, each parameter as soon as its gradient is complete, and free
    that gradient at once: the update never holds a whole model's gradients. Needs
    `algo.max_grad_norm: null` and one process (agent_grpo/trainer/backward_steps.py)."""


class AlgoConfig(ConfigModel):
    """GRPO: group-relative advantages and a PPO-clipped token loss."""

    type: Literal["grpo"] = "grpo"
    """Algorithm name."""
    scale: Literal["group", "none"] | None = None
    """Divide advantages by the group std (`group`) or not (`none`, Dr. GRPO). Unset: `group`,
    except with `leave_one_out`, where it is `none` (RLOO as published)."""
    leave_one_out: bool = False
    """Baseline is the mean of the other samples (RLOO) instead of the group mean."""
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Lower clip: ratios below 1 - clip_low stop pushing down."""
    clip_high: float = Field(default=0.2, ge=0.0)
    """Upper clip: ratios above 1 + clip_high stop pushing up (DAPO raises it to 0.28)."""
    beta: float = Field(default=0.0, ge=0.0)
    """Weight of KL(pi || pi_ref); 0 skips the reference model entirely."""
    kl: KLKind = "k2"
    """KL estimator in the loss. As a loss, k2's expected gradient is that of KL(pi || pi_ref),
    k3's that of KL(pi_ref || pi) and k1's is zero (docstring of `agent_grpo.algo.grpo`)."""
    aggregation: Aggregation = "token-mean"
    """How per-token losses become one number: `token-mean` (DAPO) divides the minibatch's
    summed token losses by its trained tokens; `seq-mean-token-mean` (DeepSeekMath) averages
    each sequence's token mean; `seq-mean-token-sum-norm` (Dr. GRPO) divides by R x
    `max_tokens`, R the sequences with a trained token: verl's mode of that name with
    `loss_scale_factor: max_tokens`, and TRL's `loss_type: dr_grpo`. Sequences with no trained
    token (excluded, dropped, or dead under `drop_dead_groups`) are in no denominator."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Constant normaliser L of `seq-mean-token-sum-norm` (verl's `loss_scale_factor`, TRL's
    `max_completion_length`); unset, it is `rollout.sampling.max_tokens` times the
    environment's `max_turns`."""
    lr: float = Field(default=1e-5, gt=0.0)
    """AdamW learning rate."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    max_grad_norm: float | None = Field(default=1.0, gt=0.0)
    """Gradient clipping norm; null: no clipping (the norm is still logged)."""
    epochs: int = Field(default=1, ge=1)
    """Passes over each step's batch (ratios leave 1 only from the second pass on)."""
    minibatches: int = Field(default=1, ge=1)
    """Optimizer steps per epoch; the batch is split into this many minibatches."""
    old_logprobs: Literal["trainer", "sampler"] = "trainer"
    """Where pi_old comes from: recomputed by the trainer, or the sampler's logprobs."""
    tis_cap: float | None = Field(default=None, gt=0.0)
    """Cap of truncated importance sampling weights exp(pi_old - sampler); None disables."""
    mask: MaskConfig | None = None
    """Masked importance sampling instead of truncation (`MaskConfig`; `{}` is IcePop's band);
    None disables."""
    ratio: RatioLevel = "token"
    """Importance ratio of the clipped loss: per `token` (PPO, GRPO) or per `sequence`, the
    geometric mean of a row's token ratios (GSPO, Zheng et al. 2025). GSPO's paper clips the
    sequence ratio far tighter (clip_low 3e-4, clip_high 4e-4) than PPO's 0.2."""
    dual_clip: float | None = Field(default=None, gt=1.0)
    """Dual-clip PPO's c: the loss of a negative-advantage token is capped at -c * A, so a ratio
    far above 1 cannot dominate the update (verl's `clip_ratio_c`, default there 3); None
    disables."""
    drop_dead_groups: bool = False
    """Leave zero-variance groups out of the loss denominator."""
    dynamic_sampling: bool = False
    """Oversample tasks until the batch has `tasks_per_step` groups with reward variance."""
    dynamic_sampling_max_rounds: int = Field(default=3, ge=1)
    """Most extra collection rounds per step for dynamic sampling."""
    max_staleness: int = Field(default=0, ge=0)
    """Asynchronous GRPO: workers sample up to this many policy versions ahead of the trainer
    (0: synchronous). Needs `rollout.workers.type: ray`; a group older than this is dropped."""
    turn_credit: TurnCreditConfig | None = None
    """Turn-level credit for multi-turn episodes (`TurnCreditConfig`; GiGPO); None: every token
    of an episode takes the episode's advantage."""
    speed: SpeedConfig = SpeedConfig()
    """Speed and memory switches that never change the result (`SpeedConfig`)."""

    @property
    def advantage_scale(self) -> Literal["group", "none"]:
        """The resolved `scale`: RLOO is unscaled unless `scale: group` is asked for."""
        return advantage_scale(self.scale, self.leave_one_out)

    @property
    def single_pass(self) -> bool:
        """One optimizer step over the whole batch: the loss's own forward pass is pi_old."""
        return self.epochs == 1 and self.minibatches == 1

    @model_validator(mode="after")
    def _meaningful(self) -> AlgoConfig:
        if self.old_logprobs == "sampler" and self.tis_cap is not None:
            raise ValueError(
                "algo.tis_cap corrects pi_old for the sampler's mismatch, but "
                "algo.old_logprobs=sampler makes pi_old the sampler: the weights would all be 1. "
                "Use old_logprobs=trainer with tis_cap, or drop tis_cap"
            )
        if self.mask is not None and self.tis_cap is not None:
            raise ValueError(
                "algo.mask and algo.tis_cap are two corrections of the same weight (masking "
                "drops far-off tokens, truncation caps them); set one"
            )
        if self.old_logprobs == "sampler" and self.mask is not None:
            raise ValueError(
                "algo.mask corrects pi_old for the sampler's mismatch, but "
                "algo.old_logprobs=sampler makes pi_old the sampler: every ratio would be 1. "
                "Use old_logprobs=trainer with mask, or drop mask"
            )
        if self.max_tokens is not None and self.aggregation != "seq-mean-token-sum-norm":
            raise ValueError(
                f"algo.max_tokens is the normaliser of aggregation seq-mean-token-sum-norm; "
                f"with aggregation {self.aggregation} it would be ignored"
            )
        if self.turn_credit is not None and self.leave_one_out and self.scale == "group":
            raise ValueError(
                "algo.turn_credit with leave_one_out is the unbiased step baseline, which is "
                "unscaled: scale: group would weight states by how little their returns vary. "
                "Drop scale, or leave_one_out for GiGPO's scaled mean baseline"
            )
        if self.speed.optimizer_in_backward and self.max_grad_norm is not None:
            raise ValueError(
                "algo.speed.optimizer_in_backward steps each parameter before the next gradient "
                "exists, so clipping to the global norm (algo.max_grad_norm="
                f"{self.max_grad_norm}) cannot happen; set algo.max_grad_norm: null"
            )
        return self
