"""The sampler/trainer logprob gap, broken down by cause.

Staleness has its own split (`mismatch_staleness/<k>`, `metrics.mismatch_by_staleness`). On the
tokens the trainer's own weights sampled (age 0) three causes remain, and each is isolated by
computing what the trainer would have reported had it shared that part of the engine:

- **filter**: the engine reports the logprob of the distribution it drew from, tempered and then
  cut by top-k/top-p and renormalised (`rollout/backends/base.py`); the trainer scores the tempered
  distribution. On a kept token the two differ by -log M, M the mass the filter kept: this is the
  mean of that over fresh tokens, from the trainer's own logits run through the sampler's filter
  (`processed_logprobs`, the `hf` backend's).
- **dtype**: the engine may hold its weights in another dtype (a bf16 vLLM engine under fp32
  training): mean |trainer in its dtype - trainer in the engine's| (bf16 autocast).
- **kernels**: what is left once the trainer shares the engine's filter and dtype: mean
  |sampler - trainer, filtered, in the engine's dtype|. Different attention and matmul kernels,
  fused ops and packed weights all land here.

Each is a mean of absolute per-token gaps, so they need not add up to `logprob_mismatch_mean`.
A token the trainer's filter would not have kept (possible when the kernels disagree at the
nucleus edge) has no filtered logprob and is left out of the filter and kernel means. The split
costs one more forward pass (no gradient) of the batch's fresh rows in the engine's dtype, so it
runs every `rollout.mismatch_causes_every` steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from pydantic import BaseModel, ConfigDict
from torch import Tensor, nn

from agent_grpo.models.logprobs import position_ids_from_mask
from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.backends.hf import processed_logprobs
from agent_grpo.trainer.batch import PackedBatch
from agent_grpo.trainer.policy import autocast

__all__ = [
    "EngineView",
    "MismatchCauses",
    "causes_sampling",
    "engine_view",
    "mismatch_causes",
]

CHUNK = 256
"""Positions per head chunk: 256 x 49152 fp32 logits (and their sort) is 50 MB."""


class MismatchCauses(BaseModel):
    """Mean |gap| per cause over the fresh model tokens; None where the cause is absent (no
    filter, one dtype) or nothing was scored."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    filter: float | None = None
    """-log of the mass the sampler's top-k/top-p filter kept (its renormalisation)."""
    dtype: float | None = None
    """|trainer in its dtype - trainer in the engine's dtype|."""
    kernels: float | None = None
    """|sampler - trainer with the engine's filter and dtype|: what the kernels leave."""

    def measured(self) -> dict[str, float]:
        """{cause: gap} for each cause that was measured."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


@dataclass
class EngineView:
    """The trainer's logprobs of a batch's fresh tokens as the engine computes them: in the
    engine's dtype, tempered and then through the sampler's filter. NaN off the fresh tokens
    (and on rows without one); -inf where the filter would have dropped the token."""

    tempered: Tensor  # [B, T] log_softmax(logits / temperature) at each token
    processed: Tensor  # [B, T] the same through top-k/top-p and renormalised
    dtype: torch.dtype
    """The engine's dtype the view was computed in."""
    sampling: SamplingConfig
    """The temperature and filter it applied."""


def engine_view(
    model: nn.Module,
    batch: PackedBatch,
    fresh: Tensor,
    sampling: SamplingConfig,
    dtype: torch.dtype,
) -> EngineView:
    """Score the `fresh` tokens (`[B, T]`) of `batch` with a plain causal LM run in `dtype`
    (the weights that sampled them: call it before the update), as the engine would."""
    tempered = torch.full(batch.input_ids.shape, float("nan"))  # [B, T]
    processed = torch.full(batch.input_ids.shape, float("nan"))  # [B, T]
    rows = fresh.any(dim=1).nonzero().flatten().tolist()  # only rows with a fresh token run
    if not rows:
        return EngineView(tempered, processed, dtype, sampling)
    part = batch.select(rows)
    width = part.input_ids.shape[1]
    mask = fresh[rows, :width]  # [b, t]
    device = next(model.parameters()).device
    backbone = cast(nn.Module, model.get_decoder())  # type: ignore[operator]
    head = cast(nn.Module, model.get_output_embeddings())  # type: ignore[operator]
    ids, attention = part.input_ids.to(device), part.attention_mask.to(device)
    b, c = mask[:, 1:].nonzero(as_tuple=True)  # [N] each: the predictor of each fresh token
    index = torch.as_tensor(rows)[b]  # [N] the batch row of each
    with torch.no_grad(), autocast(device, dtype):
        hidden = backbone(input_ids=ids, attention_mask=attention,
                          position_ids=position_ids_from_mask(attention),
                          use_cache=False).last_hidden_state  # fmt: skip  # [b, t, H]
        for start in range(0, b.numel(), CHUNK):
            bb, cc = b[start : start + CHUNK], c[start : start + CHUNK]  # [n]
            logits = head(hidden[bb.to(device), cc.to(device)]).float().cpu()  # [n, V]
            target = part.input_ids[bb, cc + 1][:, None]  # [n, 1]
            rr = index[start : start + CHUNK]
            scaled = torch.log_softmax(logits / sampling.temperature, dim=-1)  # [n, V]
            tempered[rr, cc + 1] = scaled.gather(-1, target)[:, 0]
            processed[rr, cc + 1] = processed_logprobs(logits, sampling).gather(-1, target)[:, 0]
    return EngineView(tempered, processed, dtype, sampling)


def causes_sampling(sampling: SamplingConfig, temperature: float) -> SamplingConfig:
    """The sampler's filter at the trainer's `temperature` (the records' own): a greedy rollout
    (temperature 0) was scored unfiltered, so it has no filter here."""
    if sampling.temperature == 0:
        return SamplingConfig(temperature=temperature)
    return sampling.model_copy(update={"temperature": temperature})


def _mean_abs(gap: Tensor, where: Tensor) -> float | None:
    where = where & torch.isfinite(gap)  # [B, T]
    return float(gap[where].abs().mean()) if bool(where.any()) else None


def mismatch_causes(
    view: EngineView,
    sampler: Tensor,
    trainer: Tensor,
    fresh: Tensor,
    sampling: SamplingConfig,
    trainer_dtype: torch.dtype,
) -> MismatchCauses:
    """The gap's causes over `fresh` (`[B, T]`: model tokens the trainer's own weights sampled)
    from the engine's view of them, the sampler's logprobs and the trainer's own (`[B, T]`
    each, the latter computed in `trainer_dtype`)."""
    filtered = sampling.top_k > 0 or sampling.top_p < 1.0
    return MismatchCauses(
        filter=_mean_abs(view.processed - view.tempered, fresh) if filtered else None,
        dtype=_mean_abs(trainer - view.tempered, fresh) if view.dtype != trainer_dtype else None,
        kernels=_mean_abs(sampler - view.processed, fresh),
    )
