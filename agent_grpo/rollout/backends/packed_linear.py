"""Decoding's linear layers on oneDNN, with each weight reordered once per version of the policy.

A decode step multiplies a few rows (one per sequence) by every weight matrix of the model, so its
time is how fast the matmul library streams the weights. On CPU, `F.linear` goes to MKL's sgemm,
which at a handful of rows reads the weights far below the machine's bandwidth (and on AMD CPUs
takes a slower code path than on Intel's). oneDNN, with the weight reordered once into its own
blocked layout, is the kernel PyTorch's compiler (inductor, with `freezing`) uses on CPU for the
same job; the kernel ceiling of `bench/train_throughput.py` times both on the model's shapes.

How it is used: `PackedLinears(model, dtype)` reorders every `nn.Linear` weight of the model on the
first decode after `release()`, and `with packed.active():` routes those layers through
oneDNN for the rows that fit `max_rows` (decode steps), leaving larger inputs (prefills) to
`F.linear`. `release()` frees the copies: the backend calls it when a collection or an evaluation
ends (`free_caches`) and when the trainer pushes new weights, so the update reuses that memory.
The copies cost one more copy of the weights (4 bytes a parameter in fp32, 2 in bf16) while a
rollout runs. Like the backend's prefix cache, they rely on `update_weights` after the weights
change: torch's fused AdamW writes the weights without bumping their version counter. The
counter still catches the writes that do bump it (`copy_`, `load_state_dict`, in-place math),
and a copy whose weight moved on is rebuilt.

Departures: with `dtype` bf16 and fp32 weights this is what autocast would do (bf16 matmul, bf16
output) with the weights cast once per version instead of on every call. Results differ from
`F.linear` by the reduction order only (fp32 rounding, ~1e-6 relative), which the sampler/trainer
logprob mismatch metric shows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedLinears", "packing_supported"]

PACKED_DTYPES = (torch.float32, torch.bfloat16)


def packing_supported(model: nn.Module, dtype: torch.dtype) -> bool:
    """True when this torch has oneDNN and the model's linear weights are dense CPU floats."""
    if dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    linears = _linear_layers(model)
    return bool(linears) and all(
        m.weight.device.type == "cpu"
        and m.weight.dtype in PACKED_DTYPES
        and m.weight.layout == torch.strided
        and not hasattr(m.weight, "device_mesh")  # a DTensor shard (FSDP2) is not the weight
        for m in linears
    )


@dataclass
class _Packed:
    weight: torch.Tensor
    """oneDNN's reordered copy of the layer's weight, in the packing dtype."""
    bias: torch.Tensor | None
    """The bias in the packing dtype."""
    version: tuple[int, int] | None
    """The weight's and the bias's `_version` when they were copied (None: inference tensors,
    which keep no version counter, so the copy is rebuilt on every use)."""


class PackedLinears:
    """oneDNN-reordered copies of a model's `nn.Linear` weights, used for small inputs."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, max_rows: int = 64) -> None:
        self.model = model
        self.dtype = dtype
        """The dtype the matmuls run in (the weights are cast to it once per version)."""
        self.max_rows = max_rows
        """Inputs with more rows than this (prefills) go to `F.linear` with the original weight."""
        self._packed: dict[nn.Linear, _Packed] = {}

    def release(self) -> None:
        """Drop every reordered copy (the next `active()` rebuilds them)."""
        self._packed.clear()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Route every `nn.Linear` of the model through its reordered copy for the duration."""
        linears = _linear_layers(self.model)
        # Layers no longer in the model drop out; fresh copies are kept, stale ones rebuilt.
        self._packed = {module: self._fresh(module) for module in linears}
        # An instance attribute shadows the class's forward for this module only; one already
        # there (a hook library's wrapper) is put back afterwards.
        shadowed = {m: m.__dict__["forward"] for m in linears if "forward" in m.__dict__}
        try:
            for module in linears:
                forward = _forward_fn(module, self._packed[module], self.max_rows)
                module.__dict__["forward"] = forward
            yield
        finally:
            for module in linears:
                module.__dict__.pop("forward", None)
                if module in shadowed:
                    module.__dict__["forward"] = shadowed[module]

    def _fresh(self, module: nn.Linear) -> _Packed:
        """The layer's packed copy, reordered again if the weight changed since."""
        packed = self._packed.get(module)
        if packed is not None and packed.version is not None and packed.version == _version(module):
            return packed
        with torch.no_grad():
            weight = module.weight.detach().to(self.dtype)
            bias = None if module.bias is None else module.bias.detach().to(self.dtype)
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight, self.max_rows)
        return _Packed(reordered, bias, _version(module))


def _linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The model's plain `nn.Linear` layers (subclasses may compute something else)."""
    return [m for m in model.modules() if type(m) is nn.Linear]


def _version(module: nn.Linear) -> tuple[int, int] | None:
    """How many times the weight and the bias were written in place through ops that bump the
    counter (`copy_`, `load_state_dict`; not fused AdamW's step)."""
    tensors = [module.weight] if module.bias is None else [module.weight, module.bias]
    if any(t.is_inference() for t in tensors):
        return None
    return module.weight._version, -1 if module.bias is None else module.bias._version


def _forward_fn(
    module: nn.Linear, packed: _Packed, max_rows: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`module`'s forward on its packed weight for inputs of at most `max_rows` rows."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() // max(x.shape[-1], 1) > max_rows:
            weight = module.weight.to(packed.weight.dtype)
            bias = None if module.bias is None else module.bias.to(packed.weight.dtype)
            return F.linear(x.to(packed.weight.dtype), weight, bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.to(packed.weight.dtype).contiguous(), packed.weight, packed.bias, "none", [], ""
        )

    return forward
