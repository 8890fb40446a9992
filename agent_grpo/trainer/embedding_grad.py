"""The input embedding's gradient added straight into the weight's `.grad`, never built as a
dense `[vocab, hidden]` tensor of its own.

Autograd's embedding backward makes a zero `[V, H]` gradient and adds the looked-up rows into
it; with the LM head tied to the embedding (SmolLM2, small Qwen models) autograd then adds that
into the head's own `[V, H]` gradient: two fresh vocabulary-sized tensors per backbone pass (the
shared-prefix update runs two), slow to fault in on CPU (docs/benchmarks.md, "The update on the
Intel Xeon, profiled"). Here the lookup's backward adds its rows (`index_add_`) into
`weight.grad` itself, as Megatron-LM's gradient-accumulation fusion writes its linear layers'
weight gradients into their `main_grad`. The values are those of autograd's sum up to the order
of the additions.

How: the lookup reads a detached view of the weight, so autograd gives it no gradient edge to
the weight; an empty anchor tensor that requires grad makes autograd run its backward. The
weight's other uses (the tied head) reach `.grad` through autograd as usual, before or after
this write, and both accumulate in place (`zero_grad(set_to_none=True)` leaves `.grad` None, so
the first writer makes it). This holds only where nothing reads a gradient while backward runs:
one process, because DDP's and FSDP's reducers start the all-reduce as soon as autograd has
accumulated a parameter, and no `optimizer_in_backward`, which steps a parameter then too.
For the same reason the weight's own gradient hooks never see this part, and
`torch.autograd.grad(..., [weight])` or `backward(inputs=...)` would leave it out (the trainer
uses neither). `set_up` installs it only where `wanted` says (on CPU too, whose page faults
it avoids: on CUDA `index_add_` adds atomically, in no fixed order), and only on a plain
`nn.Embedding` with no `max_norm`, `scale_grad_by_freq` or `sparse` (Gemma's scaled embedding
keeps autograd's path).
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["add_embedding_grad_in_place", "wanted"]


class _LookupIntoGrad(torch.autograd.Function):
    """`F.embedding(ids, weight)` whose backward adds the rows into `weight.grad` directly."""

    @staticmethod
    def forward(ctx: Any, ids: Tensor, anchor: Tensor, target: nn.Embedding) -> Tensor:
        # `target` is a module, not a tensor argument: autograd makes no edge to its weight
        ctx.save_for_backward(ids)
        ctx.target = target
        return F.embedding(ids, target.weight.detach(), target.padding_idx)  # [..., H]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:
        (ids,) = ctx.saved_tensors
        target: nn.Embedding = ctx.target
        rows = ids.reshape(-1)  # [N]
        values = grad.reshape(-1, grad.shape[-1])  # [N, H]
        if target.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            keep = rows != target.padding_idx  # [N]
            rows, values = rows[keep], values[keep]
        weight = target.weight
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, rows, values.to(weight.grad.dtype))
        return None, None, None


def _forward(self: nn.Embedding, ids: Tensor) -> Tensor:
    """The embedding's lookup; through `_LookupIntoGrad` when autograd will need its gradient."""
    if not (torch.is_grad_enabled() and self.weight.requires_grad):
        return cast(Tensor, type(self).forward(self, ids))
    anchor = torch.empty(0, device=ids.device, requires_grad=True)
    return cast(Tensor, _LookupIntoGrad.apply(ids, anchor, self))


def wanted(distributed: bool, device: torch.device, optimizer_in_backward: bool) -> bool:
    """Whether a run may add the embedding's gradient in place: one process (no reducer reads a
    gradient during backward), no optimizer stepping inside backward, on CPU."""
    return not distributed and not optimizer_in_backward and device.type == "cpu"


def add_embedding_grad_in_place(model: nn.Module) -> bool:
    """Make the model's input embedding add its gradient into `weight.grad` in backward; True if
    it could (a plain `nn.Embedding`). In place, like `recompute_mlps`: parameters, names and
    checkpoints are untouched, and `copy.deepcopy` rebinds the method to the copy."""
    embedding = model.get_input_embeddings()  # type: ignore[operator]
    plain = (
        type(embedding) is nn.Embedding
        and embedding.max_norm is None
        and not embedding.scale_grad_by_freq
        and not embedding.sparse
    )
    if plain:
        embedding.forward = types.MethodType(_forward, embedding)
    return plain
