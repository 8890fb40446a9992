"""The `hf` backend's sampling contract as the plainest possible loop, for equivalence tests.

One row at a time, every token from a full forward pass over the whole sequence (no KV cache, no
batching, no padding, transformers' own `sdpa` attention), one uniform per token from the row's
own `torch.Generator().manual_seed(seed)` drawn with `torch.rand(())`, and `sample_tokens`'s
processed distribution. Whatever the backend does to be fast, it must sample these ids and
record these logprobs up to floating-point reduction order (`logprob_tolerance`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.backends.hf import sample_tokens

__all__ = ["ReferenceRow", "logprob_tolerance", "reference_sample"]

FP32_UNIT_ROUNDOFF = 2.0**-24
"""Relative error of one fp32 rounding."""


class ReferenceRow(NamedTuple):
    """One row as the reference loop samples it."""

    token_ids: list[int]
    """Sampled ids, the stop id included."""
    logprobs: list[float]
    """Each id's logprob under the processed distribution it was drawn from."""
    largest_logit: float
    """The largest |logit| any step saw: the scale of the logits' rounding errors."""


@torch.no_grad()
def reference_sample(
    model: torch.nn.Module,
    prompt: Sequence[int],
    sampling: SamplingConfig,
    seed: int,
    eos_ids: Sequence[int],
) -> ReferenceRow:
    """One row sampled token by token from full forward passes (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    sequence, ids, logprobs, largest = list(prompt), [], [], 0.0
    implementation = model.config._attn_implementation  # type: ignore[union-attr]
    model.set_attn_implementation("sdpa")  # type: ignore[operator]
    try:
        for _ in range(sampling.max_tokens):
            uniform = torch.rand((), generator=generator)
            logits = model(torch.tensor([sequence])).logits[:, -1].float()  # [1, V]
            largest = max(largest, float(logits.abs().max()))
            token, logprob = sample_tokens(logits, sampling, uniform[None])
            ids.append(int(token))
            logprobs.append(float(logprob))
            sequence.append(int(token))
            if ids[-1] in eos_ids:
                break
    finally:
        model.set_attn_implementation(implementation)  # type: ignore[operator]
    return ReferenceRow(ids, logprobs, largest)


def logprob_tolerance(model: torch.nn.Module, tokens: int, largest_logit: float) -> float:
    """How far two fp32 computations of one logprob may drift apart by reduction order alone.

    A reduction over n terms done in another order (a blocked kernel, another batch shape, a
    cache instead of a full pass) differs by about sqrt(n) roundings relative to its terms when
    the rounding errors are independent. Each layer reduces over the hidden width and the MLP
    width (matmuls) and over the `tokens` a query attends to; the errors of the layers add up,
    and a logprob (a logit minus a log-sum-exp, each 1-Lipschitz in the logits) inherits the
    logits' absolute error, whose scale is `largest_logit`. A factor of 8 covers the sqrt(n)
    estimate's spread (a few standard deviations) over every token of a test.
    """
    config: Any = model.config
    widths = (config.hidden_size, config.intermediate_size, max(tokens, 1))
    relative = config.num_hidden_layers * sum(math.sqrt(n) for n in widths) * FP32_UNIT_ROUNDOFF
    return 8 * relative * max(1.0, largest_logit)
