"""The optimizer step inside backward (torchtune's `optimizer_in_bwd`): AdamW steps each parameter
the moment its gradient is complete and frees that gradient at once, so an update never holds a
whole model's gradients (513 MiB of fp32 for the 135M model; one parameter's at a time instead).

What it gives up, and why it is opt-in (`algo.speed.optimizer_in_backward`):
- Clipping to the global gradient norm needs every gradient before the first step, so it is
  refused (`algo.max_grad_norm` must be null). The norm is still measured and logged.
- A non-finite loss is caught before backward and skips the whole step, as without this. A
  non-finite gradient that appears inside backward skips that parameter's step alone (the
  others have stepped already) and is counted as a skipped step.
- One process only: DDP and FSDP reduce gradients in buckets after backward.
- With several micro-batches in a minibatch, gradients accumulate as usual until the last
  micro-batch's backward, which steps and frees them: the saving is whole when a minibatch is
  one micro-batch (`algo.speed.micro_batch_tokens` at least its tokens).

The AdamW state lives in one ordinary `torch.optim.AdamW` over all parameters, the one checkpoints
save and load in the usual layout; each parameter's step is taken by a one-parameter AdamW that
reads and writes that same state, with the same hyperparameters, so the arithmetic per tensor
is AdamW's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

__all__ = ["BackwardSteps"]


class BackwardSteps:
    """Hooks that step `optimizer`'s parameters during the backward passes it is armed for."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        """The AdamW over every parameter, which holds the state (and is checkpointed)."""
        self._single: dict[Tensor, tuple[torch.optim.Optimizer, int]] = {}
        make = cast(Callable[[list[Tensor]], torch.optim.Optimizer], type(optimizer))
        for g, group in enumerate(optimizer.param_groups):
            for param in group["params"]:  # hyperparameters are copied in at every step
                self._single[param] = (make([param]), g)
        self.armed = False
        """Whether the next backward completes the minibatch's gradients (and so steps)."""
        self._squares: list[Tensor] = []
        self.nonfinite = 0
        """Parameters whose step was skipped for a non-finite gradient since `reset`."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._step) for p in self._single]

    def reset(self) -> None:
        """Start a minibatch: disarmed, with no gradient norm or skipped parameter counted."""
        self.armed, self._squares, self.nonfinite = False, [], 0

    def arm(self, armed: bool) -> None:
        """Step in the coming backward (`True`: its gradients are the minibatch's last) or keep
        accumulating (`False`)."""
        self.armed = armed

    def _step(self, param: Tensor) -> None:
        if not self.armed or param.grad is None:
            return
        # one host sync per parameter on a GPU (the finiteness test); cheap next to a step
        square = param.grad.detach().float().pow(2).sum()  # []
        self._squares.append(square)
        if bool(torch.isfinite(square)):
            single, g = self._single[param]
            source = self.optimizer.param_groups[g]
            single.param_groups[0].update({k: v for k, v in source.items() if k != "params"})
            single.state = self.optimizer.state  # load_state_dict replaces the dict
            single.step()
        else:
            self.nonfinite += 1
        param.grad = None  # the point: this gradient's memory goes back now

    def grad_norm(self) -> float:
        """The global L2 norm of the gradients seen since `reset` (0 if none was)."""
        if not self._squares:
            return 0.0
        return float(torch.stack(self._squares).sum().sqrt())

    def close(self) -> None:
        """Remove the hooks: backward passes no longer step."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
