"""`sdpa_gqa` (agent_grpo/models/attention.py): transformers' `sdpa` without repeating the KV heads
when a mask is passed on CPU; the same logits and gradients as `sdpa`, through the grouped
kernel."""

from __future__ import annotations

import torch

from agent_grpo.models.attention import ATTENTION
from agent_grpo.testing.tiny_model import build_tiny_model


def forward_backward(model, ids, mask):  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits  # [B, T, V]
    logits.logsumexp(-1).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def test_masked_grouped_attention_equals_sdpa_and_keeps_heads_grouped(tokenizer, monkeypatch):
    model, _ = build_tiny_model(tokenizer, seed=0)
    assert model.config._attn_implementation == ATTENTION  # what every model loads with
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    torch.manual_seed(0)
    ids = torch.randint(0, 49152, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :4] = 0  # left padding: the mask cannot be dropped
    mask[2, :1] = 0

    calls: list[tuple[int, int, bool]] = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append((query.shape[1], key.shape[1], kwargs.get("enable_gqa", False)))
        return kernel(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    grouped = forward_backward(model, ids, mask)
    assert calls and all(q > k and gqa for q, k, gqa in calls)  # never repeated to every head
    calls.clear()
    model.set_attn_implementation("sdpa")
    repeated = forward_backward(model, ids, mask)
    assert calls and all(q == k for q, k, _ in calls)  # sdpa copies the KV heads out
    # Same math, other kernels: fp32 rounding apart (a 2-layer model of width 64).
    torch.testing.assert_close(grouped[0], repeated[0], rtol=1e-5, atol=1e-5)
    assert grouped[1].keys() == repeated[1].keys()
    for name in grouped[1]:
        torch.testing.assert_close(grouped[1][name], repeated[1][name], rtol=1e-4, atol=1e-5)


def test_saved_models_do_not_name_it(tokenizer, tmp_path):
    """Another engine (vLLM) loads what we save: the choice stays in this process."""
    from agent_grpo.testing.tiny_model import save_tiny_model

    path = save_tiny_model(tmp_path, seed=0, tokenizer=tokenizer)
    assert ATTENTION not in (path / "config.json").read_text()
