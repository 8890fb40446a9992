"""The policy as the update sees it: a causal LM whose `forward` returns the per-token logprobs
of a micro-batch (`models/logprobs.py`), so DDP and FSDP2 hooks wrap every call
(`trainer/parallel.py` wraps it), and pi_ref of a LoRA policy is the same module with its adapter
off.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor, nn

from agent_grpo.models.logprobs import micro_batch_logprobs, prefix_sharing_supported

__all__ = ["LogprobModel", "autocast"]


class LogprobModel(nn.Module):
    """A causal LM whose `forward` is `micro_batch_logprobs`, so DDP/FSDP hooks wrap every call;
    with a `compute_dtype` other than the parameters' it runs under autocast."""

    def __init__(
        self,
        lm: nn.Module,
        allow_shared_prefix: bool = True,
        compute_dtype: torch.dtype = torch.float32,
        adapter_disabled: bool = False,
    ) -> None:
        super().__init__()
        self.lm = lm
        self.allow_shared_prefix = allow_shared_prefix
        self.compute_dtype = compute_dtype
        self.adapter_disabled = adapter_disabled
        """A peft model run with its adapter off: LoRA's reference, sharing the policy's base."""

    def shares_prefixes(self, requested: bool) -> bool:
        """Whether `forward(..., shared_prefix=requested)` runs the shared-prefix pass."""
        return requested and self.allow_shared_prefix and prefix_sharing_supported(self.lm)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        target_mask: Tensor,
        temperature: float,
        shared_prefix: bool,
    ) -> Tensor:
        """`micro_batch_logprobs` of the LM: `[b, t]` fp32, 0 off `target_mask`."""
        off: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if self.adapter_disabled:
            off = self.lm.disable_adapter()  # type: ignore[operator]
        with off, autocast(input_ids.device, self.compute_dtype):
            return micro_batch_logprobs(
                self.lm,
                input_ids,
                attention_mask,
                target_mask,
                temperature=temperature,
                shared_prefix=self.shares_prefixes(shared_prefix),
            ).float()


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on `device` when `dtype` is bf16 (fp32 parameters stay fp32), else nothing."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
