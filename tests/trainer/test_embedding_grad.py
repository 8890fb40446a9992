"""The embedding gradient added in place (`trainer/embedding_grad.py`): the gradients autograd
gives, up to the order of the additions, tied and untied, over accumulated micro-batches, with
the padding row left out as `F.embedding` leaves it."""

from __future__ import annotations

import copy

import torch
from torch import nn

from agent_grpo.models.logprobs import micro_batch_logprobs
from agent_grpo.trainer.embedding_grad import add_embedding_grad_in_place, wanted


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    """A weighted shared-prefix logprob loss over 3 rows whose tokens include the padding id
    (2, SmolLM2's `<|im_end|>`) as real tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 1000, (1, 30), generator=g)
    prompt[0, 5] = 2
    ids = torch.cat([prompt.expand(3, -1), torch.randint(0, 1000, (3, 20), generator=g)], dim=1)
    ids[:, -1] = 2
    mask = torch.ones_like(ids)
    target = torch.zeros_like(ids)
    target[:, 30:] = 1
    logprobs = micro_batch_logprobs(model, ids, mask, target, temperature=0.9, shared_prefix=True)
    weights = torch.randn(ids.shape, generator=g)  # [B, T]
    return (logprobs * weights).sum()


def _reorder_bound(grad: torch.Tensor) -> float:
    """How far two fp32 sums of the same terms in another order may drift here: a few roundings
    of the largest partial sum (each element adds at most a few dozen rows)."""
    return 64 * torch.finfo(torch.float32).eps * float(grad.abs().max())


def _compare(model: nn.Module, micro_batches: int) -> nn.Module:
    plain, fused = copy.deepcopy(model).train(), copy.deepcopy(model).train()
    assert add_embedding_grad_in_place(fused)
    for seed in range(micro_batches):  # gradients accumulate across micro-batches
        loss_a, loss_b = _loss(plain, seed), _loss(fused, seed)
        assert loss_a.item() == loss_b.item()  # the forward is the same lookup
        loss_a.backward()
        loss_b.backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=_reorder_bound(p.grad))
    return fused


def test_tied_embeddings_get_autograds_gradient(tiny_model) -> None:
    model, _ = tiny_model
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    _compare(model, micro_batches=2)


def test_untied_embeddings_get_autograds_gradient(tiny_model) -> None:
    model, _ = tiny_model
    untied = copy.deepcopy(model)
    untied.config.tie_word_embeddings = False
    head = untied.get_output_embeddings()
    head.weight = nn.Parameter(head.weight.detach().clone())
    assert untied.get_input_embeddings().weight is not head.weight
    fused = _compare(untied, micro_batches=1)
    # token 2 is the padding id: as with `F.embedding(..., padding_idx)`, its row gets nothing
    assert not fused.get_input_embeddings().weight.grad[2].any()


def test_without_autograd_it_is_the_plain_lookup(tiny_model) -> None:
    model, _ = tiny_model
    fused = copy.deepcopy(model)
    add_embedding_grad_in_place(fused)
    ids = torch.tensor([[5, 2, 900]])
    with torch.no_grad():
        out = fused.get_input_embeddings()(ids)
    assert out.grad_fn is None
    assert torch.equal(out, model.get_input_embeddings()(ids).detach())


def test_only_a_plain_embedding_is_changed() -> None:
    class Scaled(nn.Embedding):  # Gemma's scaled embedding is a subclass with its own forward
        pass

    class LM(nn.Module):
        def __init__(self, embedding: nn.Embedding) -> None:
            super().__init__()
            self.embedding = embedding

        def get_input_embeddings(self) -> nn.Embedding:
            return self.embedding

    assert not add_embedding_grad_in_place(LM(Scaled(10, 4)))
    assert not add_embedding_grad_in_place(LM(nn.Embedding(10, 4, max_norm=1.0)))
    assert add_embedding_grad_in_place(LM(nn.Embedding(10, 4)))


def test_wanted_only_in_one_cpu_process_without_steps_in_backward() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert wanted(distributed=False, device=cpu, optimizer_in_backward=False)
    # a reducer (DDP, FSDP) or an in-backward step would read the gradient before the rows land
    assert not wanted(distributed=True, device=cpu, optimizer_in_backward=False)
    assert not wanted(distributed=False, device=cpu, optimizer_in_backward=True)
    assert not wanted(distributed=False, device=cuda, optimizer_in_backward=False)
