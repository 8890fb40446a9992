"""One-token bandits: sample groups, reward one answer, and GRPO must make it more likely.

These tie `group_advantages`, `policy_loss` and `token_logprobs` together the way the trainer
does; a sign error, a wrong alignment or a mask that drops the answer token stops learning.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlamaForCausalLM

from agent_grpo.algo.grpo import group_advantages, policy_loss
from agent_grpo.models.logprobs import token_logprobs
from agent_grpo.testing.tiny_model import tiny_model_config


def test_logits_bandit_learns_the_rewarded_arm() -> None:
    # Five arms, uniform start (p = 0.2); 4 groups of 8 samples per step, reward 1 for arm 3.
    torch.manual_seed(0)
    logits = torch.zeros(5, requires_grad=True)
    optimizer = torch.optim.Adam([logits], lr=0.1)
    group_ids = torch.arange(32) // 8  # [B]
    mask = torch.ones(32, 1, dtype=torch.bool)  # [B, T=1]
    for _ in range(20):
        with torch.no_grad():
            actions = torch.multinomial(F.softmax(logits, -1), 32, replacement=True)  # [B]
        advantages = group_advantages((actions == 3).float(), group_ids)  # [B]
        logprobs = F.log_softmax(logits, -1)[actions][:, None]  # [B, 1]
        loss, metrics = policy_loss(logprobs, logprobs.detach(), advantages, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert metrics.ratio_mean == 1.0 and metrics.clip_frac == 0.0  # on-policy step
    assert F.softmax(logits, -1)[3].item() > 0.9


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_model_config())


CANDIDATES = torch.tensor([100, 200, 300, 400])
"""The answers the bandit offers (sampling is restricted to them, like a top-k cut)."""
REWARDED = 2
"""Index into CANDIDATES of the one answer that earns reward 1 (token 300)."""


def _next_token_probs(model: LlamaForCausalLM, prompts: Tensor) -> Tensor:
    """Full-vocabulary probabilities of each prompt's next token."""
    with torch.no_grad():
        return F.softmax(model(prompts).logits[:, -1].float(), -1)  # [P, V]


@pytest.mark.slow
def test_tiny_llama_bandit_through_token_logprobs() -> None:
    # Two prompts, a group of 8 one-token answers each, drawn from the model's distribution
    # restricted to 4 candidates (so each starts near 1/4). Each step samples, then takes two
    # clipped updates against the sampling-time logprobs, all through token_logprobs.
    model = _tiny_llama()
    prompts = torch.tensor([[5, 17, 300, 41], [9, 9, 1000, 2]])  # [P, 4]
    group_ids = torch.arange(16) // 8  # [B]
    before = _next_token_probs(model, prompts)[:, CANDIDATES]  # [P, 4]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        probs = _next_token_probs(model, prompts)[:, CANDIDATES]  # [P, 4]
        picks = torch.multinomial(probs, 8, replacement=True, generator=generator)  # [P, 8]
        answers = CANDIDATES[picks].reshape(16, 1)  # [B, 1]
        ids = torch.cat([prompts.repeat_interleave(8, 0), answers], 1)  # [B, 5]
        mask = torch.zeros_like(ids, dtype=torch.bool)  # [B, 5]
        mask[:, -1] = True  # only the answer token is the model's
        advantages = group_advantages((picks.reshape(16) == REWARDED).float(), group_ids)  # [B]
        with torch.no_grad():
            old = token_logprobs(model, ids, chunk_size=7)  # [B, 5]
        for _ in range(2):
            logprobs = token_logprobs(model, ids, chunk_size=7)  # [B, 5]
            loss, _ = policy_loss(logprobs, old, advantages, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    after = _next_token_probs(model, prompts)[:, CANDIDATES]  # [P, 4]
    share_before = before[:, REWARDED] / before.sum(-1)  # [P]
    share_after = after[:, REWARDED] / after.sum(-1)  # [P]
    assert ((share_before > 0.15) & (share_before < 0.35)).all(), share_before
    # Measured: share 0.27 / 0.25 -> 0.86 / 0.86; full-vocabulary p of token 300 x4.3 / x5.0.
    assert (share_after > 0.75).all(), share_after
    assert (after[:, REWARDED] > 3 * before[:, REWARDED]).all()
