"""Activation memory for compute: each decoder layer's MLP is recomputed in backward instead of
keeping its four intermediate `[T, intermediate]` tensors (torch.utils.checkpoint).

The activations the training forward saves for backward are the update's largest transient by far,
and they grow with the tokens of a micro-batch. Recomputing the MLP (gate, up, their SiLU and
product) halves them for one extra MLP forward, most of a layer's forward FLOPs (the sizes,
counted with saved-tensor hooks: docs/benchmarks.md, "Saved activations and MLP recompute").

We depart from whole-layer checkpointing (Hugging Face's `gradient_checkpointing_enable`, verl,
TRL) because the shared-prefix pass (agent_grpo/models/logprobs.py) runs the suffix on top of the
prefix's KV cache: a recomputed attention block would append its keys and values to that cache a
second time. The MLP never touches the cache, so it alone is recomputed.
"""

from __future__ import annotations

import types
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute_mlps"]


def _recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
    """The module's own class `forward`, under checkpoint when autograd is recording. Bound to
    the module with `MethodType`, so `copy.deepcopy` of the model rebinds it to the copy (a
    closure over the original's bound method would keep running the original's weights)."""
    forward = type(self).forward.__get__(self)
    if not torch.is_grad_enabled():  # sampling, pi_old / pi_ref passes: nothing to save
        return cast(Tensor, forward(*args, **kwargs))
    return cast(Tensor, checkpoint(forward, *args, use_reentrant=False, **kwargs))


def recompute_mlps(model: nn.Module) -> int:
    """Make every decoder layer's `mlp` recompute in backward; returns how many. In place: the
    parameters and their names are untouched (checkpoints and weight pushes see no change)."""
    decoder = cast(nn.Module, model.get_decoder())  # type: ignore[operator]
    layers = getattr(decoder, "layers", None)
    mlps = [getattr(layer, "mlp", None) for layer in layers or []]
    if not mlps or any(not isinstance(m, nn.Module) for m in mlps):
        raise NotImplementedError(f"no decoder layers with an `mlp` on {type(model).__name__}")
    for mlp in cast(list[nn.Module], mlps):
        mlp.forward = types.MethodType(_recomputed_forward, mlp)
    return len(mlps)
