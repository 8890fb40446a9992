"""The one generation interface every backend (hf, vllm, openai) implements.

A backend continues a batch of token-id prompts and returns the exact sampled token ids with the
logprob of each under the distribution it actually sampled from. It never sees text: prompts are
token ids built by `agent_grpo.trajectory.tokens.TokenBuilder`, and sampled ids go back into it
unchanged.

Sampler logprobs are those of the *processed* distribution: logits divided by the temperature,
then restricted by top-k/top-p and renormalised. The trainer recomputes logprobs with the same
temperature (it cannot reproduce a top-p cut token by token), so with top_p < 1 or top_k > 0 the
sampler and trainer logprobs differ by the renormalisation; the trainer logs that mismatch and can
correct for it with truncated importance sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from pydantic import Field

from agent_grpo.config.base import ConfigModel

if TYPE_CHECKING:  # a config names sampling settings without loading torch
    import torch

__all__ = ["Generation", "GenerationBackend", "SamplingConfig"]


class SamplingConfig(ConfigModel):
    """How tokens are sampled for one assistant turn."""

    temperature: float = Field(default=1.0, ge=0.0)
    """Softmax temperature; 0 means greedy."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass; 1.0 disables it."""
    top_k: int = Field(default=0, ge=0)
    """Keep only the k most likely tokens; 0 disables it."""
    max_tokens: int = Field(default=256, ge=1)
    """Most tokens sampled in one assistant turn."""
    stop: list[str] = []
    """Strings that end a turn (kept in the output), for example `</tool_call>`."""
    seed: int = 0
    """Base seed; each trajectory's sampling seed is derived from it and its index."""


@dataclass
class Generation:
    """One continuation: the sampled ids exactly as sampled, and their sampler logprobs."""

    token_ids: list[int]
    """Sampled token ids, including the stop id (turn end or EOS, `trajectory.tokens.TurnEnd`)
    if one was sampled."""
    logprobs: list[float]
    """Logprob of each sampled token under the processed sampling distribution."""
    finish_reason: Literal["stop", "length"]
    """`stop`: a stop id or a stop string; `length`: hit max_tokens."""
    text: str = ""
    """Decoded text, for display only."""
    extra: dict[str, float] = field(default_factory=dict)
    """Backend-specific timings."""


class GenerationBackend(Protocol):
    """A generation engine: batched continuation of token-id prompts."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        """Continue every prompt once (one assistant turn each); `seeds[i]` seeds prompt i."""
        ...

    def update_weights(self, model: torch.nn.Module) -> None:
        """Load the trainer's current weights, dropping any cache computed with old weights."""
        ...

    def score(
        self, sequences: list[list[int]], targets: list[list[bool]], temperature: float
    ) -> list[list[float]]:
        """Per-token logprobs of given ids under the weights the engine holds: `out[i][t]` is
        that of `sequences[i][t]` given the ids before it where `targets[i][t]`, else 0 (the
        weight canary, agent_grpo/trainer/canary.py)."""
        ...

    def free_caches(self) -> None:
        """Drop what the engine holds only to sample faster with the current weights (the `hf`
        loop's KV prefix cache and packed weights); the trainer calls it when a step's
        collection ends, so that its update can use the memory. The next `generate` rebuilds
        what it needs."""
        ...

    def close(self) -> None:
        """Release the engine's resources."""
        ...
