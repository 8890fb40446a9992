"""Shared-prefix logprobs (one backbone pass over a group's prompt) equal the plain computation."""

from __future__ import annotations

import pytest
import torch

from agent_grpo.logprobs import (
    common_prefix_length,
    shared_prefix_token_logprobs,
    token_logprobs,
)


def group_batch(vocab: int, prefix: int, suffixes: list[int], seed: int = 0):
    """Right-padded rows sharing `prefix` random tokens, then suffixes of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (prefix,), generator=g)
    width = prefix + max(suffixes)
    ids = torch.full((len(suffixes), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(suffixes):
        ids[row, :prefix] = shared
        ids[row, prefix : prefix + n] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, : prefix + n] = 1
    return ids, mask


@pytest.fixture
def sharp_model(tiny_model):
    """The tiny model with weights scaled up so its outputs depend strongly on context."""
    model, _ = tiny_model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(8)
    return model


def test_common_prefix_length() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 2], [5, 6, 9, 2, 2], [5, 6, 7, 2, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    assert common_prefix_length(ids, mask) == 2
    assert common_prefix_length(ids[[0, 2]], mask[[0, 2]]) == 3  # bounded by the shorter row


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_plain_path(sharp_model, temperature) -> None:
    ids, mask = group_batch(sharp_model.config.vocab_size, prefix=23, suffixes=[9, 4, 12, 1])
    targets = mask.clone()
    targets[:, :23] = 0  # score only the suffix (the model tokens), as the trainer does
    plain = token_logprobs(sharp_model, ids, mask, temperature=temperature, target_mask=targets)
    plain.sum().backward()
    plain_grads = [p.grad.clone() for p in sharp_model.parameters()]
    sharp_model.zero_grad()
    shared = shared_prefix_token_logprobs(
        sharp_model, ids, mask, 23, temperature=temperature, target_mask=targets
    )
    shared.sum().backward()
    assert torch.allclose(shared, plain, atol=2e-5)
    assert (shared[:, :23] == 0).all() and (shared[mask == 0] == 0).all()
    assert shared[0, 23:32].abs().min() > 0  # the suffix really was scored
    for got, want in zip((p.grad for p in sharp_model.parameters()), plain_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_prefix_reaching_into_scored_tokens(sharp_model) -> None:
    ids, mask = group_batch(sharp_model.config.vocab_size, prefix=10, suffixes=[5, 5])
    with torch.no_grad():
        plain = token_logprobs(sharp_model, ids, mask)
        shared = shared_prefix_token_logprobs(sharp_model, ids, mask, 10)
    assert torch.allclose(shared, plain, atol=2e-5)  # prefix targets come from the one pass
