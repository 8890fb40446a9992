"""`algo.speed.recompute_mlp`: the same gradients, fewer saved activations (counted exactly with
saved-tensor hooks, so this memory regression test needs no RSS and no timing)."""

from __future__ import annotations

import copy

import pytest
import torch

from agent_grpo.config.jobs import TrainConfig
from agent_grpo.models.logprobs import micro_batch_logprobs
from agent_grpo.trainer.recompute import recompute_mlps


def _loss_and_saved(model: torch.nn.Module) -> tuple[torch.Tensor, int]:
    """A shared-prefix logprob loss over 3 rows, and the bytes autograd saved for backward."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 1000, (1, 40), generator=g)
    ids = torch.cat([prompt.expand(3, -1), torch.randint(3, 1000, (3, 24), generator=g)], dim=1)
    mask = torch.ones_like(ids)
    target = torch.zeros_like(ids)
    target[:, 40:] = 1
    saved: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:  # a saved weight costs no memory
            saved[id(t)] = t.numel() * t.element_size()  # a tensor saved twice counts once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logprobs = micro_batch_logprobs(model, ids, mask, target, temperature=1.0,
                                        shared_prefix=True)  # fmt: skip
    return -logprobs.sum(), sum(saved.values())


def test_same_gradients_less_saved_memory(tiny_model) -> None:
    model, _ = tiny_model
    plain, lean = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    assert recompute_mlps(lean) == len(lean.model.layers)
    loss_a, saved_a = _loss_and_saved(plain)
    loss_b, saved_b = _loss_and_saved(lean)
    loss_a.backward()
    loss_b.backward()
    assert loss_a.item() == loss_b.item()
    for p, q in zip(plain.parameters(), lean.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    # the MLP's gate, up, SiLU and product (4 x intermediate per token) are no longer kept;
    # the tiny model's intermediate is 2x its hidden size: still over a third of it all
    print(f"saved {saved_a} -> {saved_b} bytes")
    assert saved_b < 0.7 * saved_a, (saved_a, saved_b)


def test_refused_under_fsdp() -> None:
    with pytest.raises(ValueError, match=r"recompute_mlp with distributed\.mode=fsdp"):
        TrainConfig.model_validate(
            {"algo": {"speed": {"recompute_mlp": True}}, "distributed": {"mode": "fsdp"}}
        )


def test_a_copy_recomputes_its_own_weights(tiny_model) -> None:
    """The reference is a deepcopy of the policy: its MLPs must run its own (frozen) weights,
    not the live policy's."""
    model, _ = tiny_model
    policy = copy.deepcopy(model)
    recompute_mlps(policy)
    reference = copy.deepcopy(policy)
    for p in policy.parameters():  # the policy trains on; the copy must not follow
        p.data.add_(0.05)
    x = torch.randn(1, 3, policy.config.hidden_size)
    mlp, frozen = policy.model.layers[0].mlp, reference.model.layers[0].mlp
    with torch.no_grad():
        assert torch.equal(frozen(x), type(frozen).forward(frozen, x))
        assert not torch.equal(frozen(x), mlp(x))
