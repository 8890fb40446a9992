"""The AdamW every trainer here steps (GRPO, the warm start): torch's fused kernel where it runs.

Why fused: torch's default AdamW on CPU is the per-tensor loop of about ten elementwise ops per
parameter (its `foreach` path is CUDA's); the fused kernel does one pass per tensor, several times
faster on CPU (docs/benchmarks.md, "Fused AdamW"). The arithmetic is AdamW's; its rounding differs
from the loop's in the last bits.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["adamw", "fused_supported", "load_optimizer_state"]


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW runs on every one of `params` (CPU or CUDA, floating point)."""
    devices = {"cpu", "cuda"}
    return all(p.device.type in devices and torch.is_floating_point(p) for p in params)


def adamw(
    params: Iterable[torch.Tensor], lr: float, weight_decay: float = 0.01
) -> torch.optim.AdamW:
    """AdamW over `params`, fused when every parameter supports it."""
    params = list(params)
    return torch.optim.AdamW(
        params, lr=lr, weight_decay=weight_decay, fused=fused_supported(params) or None
    )


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """`optimizer.load_state_dict(state)`, keeping the kernel this process chose.

    A checkpoint's param groups carry `fused` and `foreach`, and `load_state_dict` takes them:
    one written before AdamW was fused here would silently turn the fused kernel off. The fused
    kernel wants each `step` as fp32 on its parameter's device, which torch moves it to only
    when the checkpoint itself was fused.
    """
    kernels = [(group.get("fused"), group.get("foreach")) for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, (fused, foreach) in zip(optimizer.param_groups, kernels, strict=True):
        group["fused"], group["foreach"] = fused, foreach
        for param in group["params"] if fused else []:
            step = optimizer.state.get(param, {}).get("step")
            if isinstance(step, torch.Tensor):
                optimizer.state[param]["step"] = step.to(torch.float32).to(param.device)
