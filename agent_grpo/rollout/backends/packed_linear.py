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

Sibling layers that read the same input (a layer's `q_proj`, `k_proj`, `v_proj`, and its
`gate_proj`, `up_proj`: `FUSED_SIBLINGS`) are packed as one weight and run as one matmul, as
vLLM's `QKVParallelLinear` and `MergedColumnParallelLinear` do: one wider matmul streams the same
bytes with fewer kernel calls. The first sibling called with an input computes every sibling's
output; each of the others takes its slice when called with that very tensor, once, and computes
the whole group again otherwise, so a model that calls them in another order or on different
inputs gets the same values, only without the saving. This assumes the tensor is unchanged
between the siblings' calls (inference tensors keep no version counter to check; every decoder
`HFBackend` runs calls them back to back) and one decoding thread at a time.

Departures: with `dtype` bf16 and fp32 weights this is what autocast would do (bf16 matmul, bf16
output) with the weights cast once per version instead of on every call. Results differ from
`F.linear` by the reduction order only (fp32 rounding, ~1e-6 relative), which the sampler/trainer
logprob mismatch metric shows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FUSED_SIBLINGS", "PackedLinears", "packing_supported"]

PACKED_DTYPES = (torch.float32, torch.bfloat16)

FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Names of sibling `nn.Linear`s that the decoder families `HFBackend` runs (Llama, Qwen2/3,
Mistral) apply to one input; vLLM's `packed_modules_mapping` names the same groups."""


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
    """oneDNN's reordered copy of the group's weights, stacked along the output dim, in the
    packing dtype."""
    bias: torch.Tensor | None
    """The group's biases, stacked, in the packing dtype."""
    version: tuple[int, ...] | None
    """Every member's weight's and bias's `_version` when they were copied (None: inference
    tensors, which keep no version counter, so the copy is rebuilt on every use)."""


@dataclass
class _Shared:
    """A group's last output, for the siblings not yet served from it."""

    input: torch.Tensor | None = None
    """The tensor the output was computed from (held, so its identity cannot be reused)."""
    output: torch.Tensor | None = None
    """`[..., sum of the members' out_features]`."""
    waiting: set[int] = field(default_factory=set)
    """Members (by index) that may still take their slice of `output`."""


Group = tuple[nn.Linear, ...]
"""Layers packed as one weight: a `FUSED_SIBLINGS` group, or one layer alone."""


class PackedLinears:
    """oneDNN-reordered copies of a model's `nn.Linear` weights, used for small inputs."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, max_rows: int = 64) -> None:
        self.model = model
        self.dtype = dtype
        """The dtype the matmuls run in (the weights are cast to it once per version)."""
        self.max_rows = max_rows
        """Inputs with more rows than this (prefills) go to `F.linear` with the original weight."""
        self._packed: dict[Group, _Packed] = {}

    def release(self) -> None:
        """Drop every reordered copy (the next `active()` rebuilds them)."""
        self._packed.clear()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Route every `nn.Linear` of the model through its reordered copy for the duration."""
        groups = _groups(self.model)
        # Layers no longer in the model drop out; fresh copies are kept, stale ones rebuilt.
        self._packed = {group: self._fresh(group) for group in groups}
        linears = [m for group in groups for m in group]
        # An instance attribute shadows the class's forward for this module only; one already
        # there (a hook library's wrapper) is put back afterwards.
        shadowed = {m: m.__dict__["forward"] for m in linears if "forward" in m.__dict__}
        try:
            for group in groups:
                shared = _Shared()  # dropped on exit: it holds the last input and output
                for index, module in enumerate(group):
                    forward = _forward_fn(group, index, self._packed[group], shared, self.max_rows)
                    module.__dict__["forward"] = forward
            yield
        finally:
            for module in linears:
                module.__dict__.pop("forward", None)
                if module in shadowed:
                    module.__dict__["forward"] = shadowed[module]

    def _fresh(self, group: Group) -> _Packed:
        """The group's packed copy, reordered again if a member's weight changed since."""
        packed = self._packed.get(group)
        version = _version(group)
        if packed is not None and packed.version is not None and packed.version == version:
            return packed
        with torch.no_grad():
            weight = torch.cat([m.weight.detach().to(self.dtype) for m in group])
            biases = [m.bias for m in group if m.bias is not None]
            bias = torch.cat([b.detach().to(self.dtype) for b in biases]) if biases else None
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight, self.max_rows)
        return _Packed(reordered, bias, version)


def _linear_layers(model: nn.Module) -> list[nn.Linear]:
    """The model's plain `nn.Linear` layers (subclasses may compute something else)."""
    return [m for m in model.modules() if type(m) is nn.Linear]


def _groups(model: nn.Module) -> list[Group]:
    """Every plain `nn.Linear` of the model once: `FUSED_SIBLINGS` that share a parent, an input
    size, a dtype and whether they have a bias together, every other layer alone."""
    grouped: list[Group] = []
    for parent in model.modules():
        children = dict(parent.named_children())
        for names in FUSED_SIBLINGS:
            members = tuple(children.get(name) for name in names)
            if all(type(m) is nn.Linear for m in members):
                group = cast(Group, members)
                alike = {(m.in_features, m.weight.dtype, m.bias is None) for m in group}
                if len(alike) == 1:
                    grouped.append(group)
    fused = {m for group in grouped for m in group}
    return grouped + [(m,) for m in _linear_layers(model) if m not in fused]


def _version(group: Group) -> tuple[int, ...] | None:
    """How many times each member's weight and bias were written in place through ops that bump
    the counter (`copy_`, `load_state_dict`; not fused AdamW's step)."""
    tensors = [t for m in group for t in (m.weight, m.bias) if t is not None]
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


def _forward_fn(
    group: Group, index: int, packed: _Packed, shared: _Shared, max_rows: int
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`group[index]`'s forward on the group's packed weight for inputs of at most `max_rows`
    rows: its slice of the group's output for that input."""
    module = group[index]
    start = sum(m.out_features for m in group[:index])
    stop = start + module.out_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() // max(x.shape[-1], 1) > max_rows:
            weight = module.weight.to(packed.weight.dtype)
            bias = None if module.bias is None else module.bias.to(packed.weight.dtype)
            return F.linear(x.to(packed.weight.dtype), weight, bias)
        if len(group) == 1:
            return _matmul(x, packed)
        if shared.input is not x or index not in shared.waiting:
            shared.input, shared.waiting = x, set(range(len(group)))
            shared.output = _matmul(x, packed)
        assert shared.output is not None
        out = shared.output[..., start:stop]
        shared.waiting.discard(index)
        if not shared.waiting:  # every sibling served: hold no tensors between calls
            shared.input = shared.output = None
        return out

    return forward


def _matmul(x: torch.Tensor, packed: _Packed) -> torch.Tensor:
    """`x @ weight^T + bias` on oneDNN with the packed weight, in the packing dtype."""
    return torch.ops.mkldnn._linear_pointwise(
        x.to(packed.weight.dtype).contiguous(), packed.weight, packed.bias, "none", [], ""
    )
