"""The warm start's loss: its demonstrations' common prefix run once gives the plain loss."""

from __future__ import annotations

import torch

from agent_grpo.testing.tiny_model import lively
from agent_grpo.trainer.batch import pack_records
from agent_grpo.trainer.warm_start import expert_record, sft_loss


def test_shared_prefix_sft_loss_and_gradients_equal_the_plain_ones(tiny_model) -> None:
    model, tokenizer = lively(tiny_model[0]), tiny_model[1]
    records = [expert_record(tokenizer, "agent_grpo/Calculator-v0", seed) for seed in range(4)]
    batch = pack_records(records, tokenizer.pad_token_id)
    first_model_token = batch.loss_mask.int().argmax(dim=1)  # [B]
    assert int(first_model_token.min()) > 50  # a long system prompt the rows share
    losses, grads = [], []
    for shared in (False, True):
        model.zero_grad()
        loss = sft_loss(model, batch, batch.num_model_tokens, shared_prefix=shared)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert torch.allclose(losses[0], losses[1], atol=2e-5)
    for plain, shared in zip(*grads, strict=True):
        assert torch.allclose(plain, shared, atol=1e-4, rtol=1e-4)
