"""Weights from the trainer to the rollout engines by broadcast, over a process group of their own.

The trainer is rank 0 of a group that every rollout actor joins, whatever its rank in a torchrun
job. The group is made directly from torch's public process-group classes over a `TCPStore` the
trainer hosts (bound to port 0, so the OS picks a free port and no other process can take it
first): `ProcessGroupGloo` for CPU tensors, `ProcessGroupNCCL` for CUDA tensors. It is not
torch's default group, so a trainer under torchrun (which has one) and an in-process vLLM engine
(which makes one of its own) keep theirs untouched.

A push broadcasts the tensors in buckets of one dtype (`buckets`): each bucket is one flat
tensor, so a model of a few hundred tensors costs a few collectives, not a few hundred; a tensor
larger than a bucket goes alone, without a copy. The receivers rebuild each named tensor as a
view of its bucket. The names, shapes and dtypes (`TensorSpec`) travel beside the broadcast as
an ordinary call argument.

Where we depart from peers: verl and OpenRLHF also broadcast over a side group (NCCL), made with
vLLM's `StatelessProcessGroup` and PyNccl or with a copy of torch's private
`_new_process_group_helper`; vLLM's own RL weight-transfer engines are NCCL or CUDA IPC only. We
use torch's public classes, gloo and NCCL alike, and the receiving side keeps what it received
until its engine loads it (`agent_grpo/rollout/ray_pool.py`), so a broadcast never waits for a
collection in progress.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Backend as Group  # a process group's backend object

__all__ = [
    "BUCKET_BYTES",
    "GroupAddress",
    "TensorSpec",
    "WeightReceiver",
    "WeightSender",
    "buckets",
    "distinct_tensors",
    "payload_bytes",
    "tensor_specs",
]

BUCKET_BYTES = 256 << 20
"""Largest flat tensor one broadcast carries (a larger single tensor goes alone)."""
GroupBackend = Literal["gloo", "nccl"]


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver needs to rebuild one broadcast tensor."""

    name: str
    """Its name in the pushed mapping (a Hugging Face or peft parameter name)."""
    shape: tuple[int, ...]
    """Its shape."""
    dtype: str
    """Its torch dtype's name, e.g. `float32`."""

    @property
    def numel(self) -> int:
        """Elements in the tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        return self.numel * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class GroupAddress:
    """Where a receiver joins the weight group, and what the group is."""

    host: str
    """The trainer's address (its TCPStore; its gloo device when the backend is gloo)."""
    port: int
    """The TCPStore's port."""
    size: int
    """Members: the trainer (rank 0) and every receiver."""
    backend: GroupBackend
    """`gloo` for CPU tensors, `nccl` for CUDA tensors."""
    timeout_s: float
    """How long a member waits for the others in a collective."""
    bucket_bytes: int = BUCKET_BYTES
    """Largest flat tensor of one broadcast (`buckets`), the same on both sides."""


def distinct_tensors(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` without a second name for the same tensor (a tied LM head is its embedding's
    alias in a state dict): only one copy travels."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()  # (storage, offset, shape)
    out = {}
    for name, tensor in weights.items():
        key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()),
               tuple(tensor.shape))  # fmt: skip
        if key not in seen:
            seen.add(key)
            out[name] = tensor
    return out


def tensor_specs(weights: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The specs of `weights`, in their order."""
    return [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
            for n, t in weights.items()]  # fmt: skip


def payload_bytes(specs: Sequence[TensorSpec]) -> int:
    """Bytes of the tensors themselves (what each receiver gets)."""
    return sum(spec.nbytes for spec in specs)


def buckets(specs: Sequence[TensorSpec], max_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of `specs` grouped into broadcasts: consecutive tensors of one dtype up to
    `max_bytes` together, a tensor of more than `max_bytes` alone. Every index once, in order."""
    out: list[list[int]] = []
    size, dtype = 0, ""
    for i, spec in enumerate(specs):
        if out and spec.dtype == dtype and size + spec.nbytes <= max_bytes:
            out[-1].append(i)
            size += spec.nbytes
        else:
            out.append([i])
            size, dtype = spec.nbytes, spec.dtype
    return out


def _process_group(store: dist.Store, rank: int, address: GroupAddress, host: str) -> Group:
    """This member's side of the group (rank 0: the trainer)."""
    timeout = datetime.timedelta(seconds=address.timeout_s)
    prefixed = dist.PrefixStore("agent-grpo-weights", store)
    if address.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, address.size, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # the one with devices
    options._timeout = timeout
    # Bound to the given address, so traffic stays where the trainer and Ray were told to be
    # (127.0.0.1 in the tests), whatever the host name resolves to.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, address.size, options)


def _broadcast(group: Group, flat: torch.Tensor) -> None:
    """Broadcast `flat` from rank 0 in place."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    # torch's stubs leave the collectives off `Backend`; ProcessGroupGloo/NCCL have them.
    group.broadcast([flat], options).wait()  # type: ignore[attr-defined]


class WeightSender:
    """The trainer's side: hosts the store, then broadcasts each push to every receiver."""

    def __init__(
        self,
        host: str,
        receivers: int,
        backend: GroupBackend,
        timeout_s: float = 600.0,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        """Open the store on `host` (a free port); receivers join with `address`, then
        `connect` completes the group."""
        self.host = host
        self.store = dist.TCPStore(host, 0, receivers + 1, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))  # fmt: skip
        self.address = GroupAddress(host, self.store.port, receivers + 1, backend, timeout_s,
                                    bucket_bytes)  # fmt: skip
        """What each receiver is handed to join."""
        self.group: Group | None = None

    def connect(self) -> None:
        """Form the group; returns once every receiver has joined (they join concurrently)."""
        self.group = _process_group(self.store, 0, self.address, self.host)

    def send(self, weights: Mapping[str, torch.Tensor], specs: Sequence[TensorSpec]) -> None:
        """Broadcast `weights` (in the order of `specs`, which the receivers hold) bucket by
        bucket; returns once every receiver has its copy."""
        if self.group is None:
            raise RuntimeError("WeightSender.send before connect")
        device = "cuda" if self.address.backend == "nccl" else "cpu"
        for bucket in buckets(specs, self.address.bucket_bytes):
            parts = [weights[specs[i].name].detach().reshape(-1) for i in bucket]
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # [sum of numels]
            _broadcast(self.group, flat.to(device).contiguous())

    def close(self) -> None:
        """Leave the group."""
        if self.group is not None:
            self.group.shutdown()
        self.group = None


class WeightReceiver:
    """A rollout actor's side: joins the trainer's group and receives each push."""

    def __init__(self, address: GroupAddress, rank: int, host: str) -> None:
        """Join as `rank` (1..size-1) from this node's address `host`; blocks until the whole
        group has formed."""
        self.address = address
        store = dist.TCPStore(address.host, address.port, address.size, is_master=False,
                              timeout=datetime.timedelta(seconds=address.timeout_s))  # fmt: skip
        self.group = _process_group(store, rank, address, host)
        self.store = store

    def receive(self, specs: Sequence[TensorSpec], device: torch.device) -> dict[str, torch.Tensor]:
        """The broadcast tensors, each a view of its bucket on `device` (the trainer's order)."""
        out: dict[str, torch.Tensor] = {}
        for bucket in buckets(specs, self.address.bucket_bytes):
            parts = [specs[i] for i in bucket]
            dtype = getattr(torch, parts[0].dtype)
            flat = torch.empty(sum(p.numel for p in parts), dtype=dtype, device=device)
            _broadcast(self.group, flat)
            for spec, piece in zip(parts, flat.split([p.numel for p in parts]), strict=True):
                out[spec.name] = piece.view(spec.shape)
        return out

    def close(self) -> None:
        """Leave the group."""
        self.group.shutdown()
