"""Parallelism as a wrapper: the policy as a `LogprobModel`, under DDP or FSDP2 on W ranks.

The update (`agent_grpo/trainer/update.py`) is one piece of code for 1..W processes. This module
gives it what varies: `DistContext` (rank, world size, device), collectives that are no-ops in
one process, the split of a global batch by GRPO group, and the wrapping of the policy. Nothing
here is a cluster: `torchrun` starts the processes and sets `RANK`, `WORLD_SIZE`, `LOCAL_RANK`;
DDP or FSDP2 (`fully_shard`) syncs gradients.

The rule that makes N processes take exactly the step one process takes, for `token-mean`
(other aggregations swap "tokens" for their own count). One process over the global batch
minimises `L = sum_i l_i / N`, where `l_i` is token i's loss and `N` the global number of model
tokens, so its gradient is `g = sum_i grad l_i / N`. Rank r holds the tokens `S_r` (the `S_r`
partition the batch) and backpropagates

    L_r = W * sum_{i in S_r} l_i / N        (N all-reduced, W = world size)

DDP and FSDP2 *average* gradients over ranks, so every rank ends with

    (1/W) * sum_r grad L_r = (1/W) * sum_r W * sum_{i in S_r} grad l_i / N = g.

Per-rank means (`N_r` in place of `N`, no `W`) give `(1/W) * sum_r sum_{S_r} grad l_i / N_r`,
which weights a token by `1 / (W * N_r)`: tokens on the rank with fewer model tokens count more,
and the step depends on how rows were dealt out. `tests/test_distributed.py` shows both.

Gradient clipping uses the global norm: DDP grads are already the averaged `g` on every rank;
FSDP2 grads are DTensor shards whose per-shard norms `clip_grad_norm` combines with `full_tensor()`.

Where we depart from common practice:
- The policy is wrapped together with `token_logprobs` (`LogprobModel`), so DDP's and FSDP2's
  forward hooks run even though we never call the LM's own `forward` (it would build the full
  `[B, T, V]` logits that `token_logprobs` avoids). In one process it is wrapped the same way,
  so the update never asks which kind of run it is in.
- `model.dtype: bfloat16` keeps fp32 parameters (the optimizer's master weights) and runs the
  forward under bf16 autocast inside `LogprobModel`: AdamW on bf16 weights loses updates of
  size `lr` (0.02 + 1e-5 is 0.02 in bf16).
- Every rank runs the same number of micro-batches: a rank with fewer (or no) rows runs one row
  again with an empty loss mask (zero loss, zero gradient). FSDP2 all-gathers in every forward,
  so unequal counts would deadlock; verl and TRL drop or pad rows instead.
- A torchrun rank ends with `end_rank`: the atexit handlers run, then the process exits without
  the interpreter's teardown. FSDP2 leaves its device mesh, and through it the gloo process
  group, in torch's own caches after `destroy_process_group`; the final garbage collection then
  frees the group while a gloo thread still drops an `AsyncWork`'s tensors, which needs the GIL
  the finalising interpreter no longer hands out, so the thread exits through a `noexcept`
  destructor and the rank aborts ("terminate called without an active exception", SIGABRT;
  5 of 40 runs of `tests/dist_worker.py` beside two busy loops). pytorch/pytorch#179291,
  closed unmerged, describes it; torch 2.13 still does it (seen in a core dump).
- Under FSDP2 the shared-prefix pass (`algo.speed.shared_prefix`) is off: same loss, more compute
  (see `wrap_policy`). DDP keeps it.
- Whole GRPO groups are dealt round-robin to ranks (so a group's shared prompt is run once, on
  one rank), not balanced by tokens: simple and deterministic.
- The reference is sharded under FSDP2 and a whole copy per rank otherwise.
- State moves as whole tensors: `broadcast_module` (rank 0's weights before wrapping),
  `full_optimizer_state` (all-gathered on every rank, for a one-process-layout checkpoint) and
  `load_full_optimizer_state` (every rank gets the whole state and keeps its shards). Simple, and
  checkpoints resume in any mode, but each rank briefly holds the full optimizer state; large
  models want torch.distributed.checkpoint's sharded format (not built).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from agent_grpo.trainer.launch import end_rank, launched_world_size
from agent_grpo.trainer.optimizer import load_optimizer_state
from agent_grpo.trainer.policy import LogprobModel

__all__ = [
    "DistContext",
    "WrapMode",
    "broadcast_module",
    "broadcast_object",
    "clip_grad_norm",
    "end_rank",
    "full_optimizer_state",
    "full_state_dict",
    "global_max",
    "global_sum",
    "grad_sync",
    "init_distributed",
    "launched_world_size",
    "load_full_optimizer_state",
    "resolve_device",
    "shard_rows",
    "shares_prefixes",
    "unwrap_policy",
    "wrap_policy",
    "wrap_reference",
]

WrapMode = Literal["none", "ddp", "fsdp"]
T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job; the default is a single process on the CPU."""

    rank: int = 0
    """Global rank, 0..world_size-1 (`RANK`)."""
    world_size: int = 1
    """Number of processes (`WORLD_SIZE`)."""
    local_rank: int = 0
    """Rank on this node, which picks the GPU (`LOCAL_RANK`)."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Device this rank computes on."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, evaluates and writes checkpoints."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """More than one process: collectives are needed."""
        return self.world_size > 1


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """`model.device` as a torch device: `auto` is this rank's GPU when CUDA is available, else
    the CPU; `cuda` is this rank's GPU; `cuda:N` and `cpu` are themselves."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", local_rank)
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={name} but CUDA is not available on this machine")
    return device


def init_distributed(
    backend: str | None = None, timeout_s: float | None = None, device: str = "auto"
) -> DistContext:
    """Read the `torchrun` variables and join the process group (no-op for a single process).

    `device` is `model.device` (`resolve_device`). `backend` defaults to nccl on CUDA and gloo
    otherwise; `timeout_s` bounds every collective (torch's default: 10 min nccl, 30 gloo).
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = launched_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    placed = resolve_device(device, local_rank)
    cuda = placed.type == "cuda"
    if cuda:
        torch.cuda.set_device(placed)
    if world_size > 1 and not dist.is_initialized():
        chosen = backend or ("nccl" if cuda else "gloo")
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            chosen, device_id=placed if chosen == "nccl" else None, timeout=timeout
        )
    return DistContext(rank, world_size, local_rank, placed)


# ---- collectives and the row split --------------------------------------------------------------


def _all_reduce(x: Tensor, ctx: DistContext, op: dist.ReduceOp.RedOpType) -> Tensor:
    if not ctx.distributed:
        return x
    out = x.detach().clone().to(ctx.device)
    dist.all_reduce(out, op=op)
    return out.to(x.device)


def global_sum(x: Tensor, ctx: DistContext) -> Tensor:
    """Elementwise sum of `x` over all ranks (a copy; `x` itself is untouched)."""
    return _all_reduce(x, ctx, dist.ReduceOp.SUM)


def global_max(x: Tensor, ctx: DistContext) -> Tensor:
    """Elementwise max of `x` over all ranks (a copy)."""
    return _all_reduce(x, ctx, dist.ReduceOp.MAX)


def broadcast_object(value: T, ctx: DistContext) -> T:
    """Rank 0's `value` on every rank (pickled; other ranks pass anything, e.g. None)."""
    if not ctx.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=ctx.device)
    return cast(T, box[0])


def broadcast_module(model: nn.Module, ctx: DistContext) -> nn.Module:
    """Move `model` to `ctx.device` and overwrite its weights with rank 0's, in place.

    FSDP2's `fully_shard` keeps each rank's own values (DDP broadcasts at wrap time), so a model
    changed on rank 0 alone (warm start, checkpoint) must be broadcast before sharding.
    """
    model.to(ctx.device)
    if ctx.distributed:
        for tensor in model.state_dict().values():  # views of the parameters and buffers
            dist.broadcast(tensor, src=0)
    return model


def shard_rows(n_rows: int, ctx: DistContext, group_index: Tensor | None = None) -> list[int]:
    """This rank's rows of a global batch: rows `rank, rank + W, ...`, or with `group_index`
    ([B], a group id per row) every row of groups `rank, rank + W, ...` in order of appearance."""
    if group_index is None:
        return list(range(ctx.rank, n_rows, ctx.world_size))
    order = {g: k for k, g in enumerate(dict.fromkeys(group_index.tolist()))}
    ids = group_index.tolist()
    return [r for r in range(n_rows) if order[ids[r]] % ctx.world_size == ctx.rank]


# ---- wrapping -----------------------------------------------------------------------------------


def _decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face decoder (`model.layers` for Llama/Qwen/...)."""
    decoder = cast(nn.Module, lm.get_decoder())  # type: ignore[operator]
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise NotImplementedError(f"no decoder `layers` to shard on {type(lm).__name__}")
    return list(layers)


def wrap_policy(
    model: nn.Module,
    mode: WrapMode,
    ctx: DistContext,
    compute_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """`LogprobModel(model)` on `ctx.device`: alone (`none`, one process), under DDP, or under
    FSDP2 (each decoder layer, then the root).

    FSDP2 shards `model` in place (its parameters become DTensors); build the optimizer from the
    returned module's parameters after wrapping.
    """
    if (mode == "none") == ctx.distributed:  # "none" on W ranks would train W separate models
        raise ValueError(f"mode {mode!r} does not fit world_size {ctx.world_size}")
    # FSDP2 all-gathers a layer at each call; the shared-prefix pass calls every layer twice, but
    # only for micro-batches of 2+ rows, so ranks would issue different collectives and hang.
    wrapped = LogprobModel(model.to(ctx.device), mode != "fsdp", compute_dtype)
    if mode == "none":
        return wrapped
    if mode == "ddp":
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # No buffers change during training (rotary tables), so skip their per-forward broadcast.
        return nn.parallel.DistributedDataParallel(
            wrapped, device_ids=ids, forward_sync_buffers=False
        )
    return _fully_shard(wrapped)


def _fully_shard(wrapped: LogprobModel) -> LogprobModel:
    """FSDP2 over each decoder layer, then the root (embeddings, final norm, tied head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in _decoder_layers(wrapped.lm):
        fully_shard(layer)
    fully_shard(wrapped)
    return wrapped


def wrap_reference(
    model: nn.Module,
    mode: WrapMode,
    ctx: DistContext,
    compute_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A frozen `LogprobModel(model)` for `update.batch_logprobs`: sharded like the policy
    under FSDP2, a whole copy per rank otherwise (DDP only wraps modules that train).

    Its parameters are cast to `compute_dtype`: a model that never trains needs no fp32 master
    copy, and bf16 autocast would cast every matmul weight to bf16 anyway (norms and the
    embedding lookup, which autocast leaves in fp32, also run in bf16 then). Buffers keep their
    dtype: RoPE's inverse frequencies in bf16 would turn position 1000's angle by about a
    radian."""
    frozen = model.requires_grad_(False).to(ctx.device)
    for param in frozen.parameters():
        param.data = param.data.to(compute_dtype)
    wrapped = LogprobModel(frozen, mode != "fsdp", compute_dtype)
    return _fully_shard(wrapped) if mode == "fsdp" else wrapped


def shares_prefixes(policy: nn.Module, requested: bool) -> bool:
    """Whether a `wrap_policy` / `wrap_reference` module runs the shared-prefix pass when
    `requested` (`algo.speed.shared_prefix`): not under FSDP2, nor for sliding-window models."""
    inner = policy.module if isinstance(policy, nn.parallel.DistributedDataParallel) else policy
    return isinstance(inner, LogprobModel) and inner.shares_prefixes(requested)


def unwrap_policy(policy: nn.Module) -> nn.Module:
    """The Hugging Face model inside a `wrap_policy` result (FSDP2: still sharded)."""
    inner = policy.module if isinstance(policy, nn.parallel.DistributedDataParallel) else policy
    return cast(nn.Module, inner.lm) if isinstance(inner, LogprobModel) else inner


def full_state_dict(policy: nn.Module) -> dict[str, Tensor]:
    """Unsharded CPU state dict of the LM on rank 0, `{}` on the other ranks (every rank must
    call it under FSDP2: it all-gathers the shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    lm = unwrap_policy(policy)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(lm, options=options)
    return {k: cast(Tensor, v).detach().cpu() for k, v in state.items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.state_dict()` with FSDP2 shards gathered: the one-process layout, on every
    rank (every rank must call it). Parameters are numbered as in the one-process optimizer,
    because `wrap_policy` keeps the LM's parameter order."""
    state = optimizer.state_dict()
    return {
        "state": {i: {k: _full(v) for k, v in s.items()} for i, s in state["state"].items()},
        "param_groups": state["param_groups"],
    }


def _full(value: Any) -> Any:
    full = getattr(value, "full_tensor", None)  # a DTensor shard: all-gather it
    value = full() if full is not None else value
    return value.detach().cpu() if isinstance(value, Tensor) else value


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a `full_optimizer_state` (the same on every rank), keeping this rank's shard of
    each tensor shaped like an FSDP2 (DTensor) parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]

    def local(value: Any, param: Tensor) -> Any:
        if not (isinstance(param, DTensor) and isinstance(value, Tensor)):
            return value
        if value.shape != param.shape:  # AdamW's scalar `step`
            return value
        # every rank holds the full value, so each cuts its own shard: no communication
        mesh, placements = param.device_mesh, param.placements
        return distribute_tensor(value.to(param.device), mesh, placements, src_data_rank=None)

    by_index = {
        i: {k: local(v, params[int(i)]) for k, v in s.items()} for i, s in state["state"].items()
    }
    load_optimizer_state(optimizer, {"state": by_index, "param_groups": state["param_groups"]})


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float | None) -> Tensor:
    """The global gradient norm, to which gradients are clipped (`max_norm=None`: measured
    only); DTensor (FSDP2) shards are combined across ranks."""
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([cast(Tensor, p.grad) for p in params])
    full = getattr(total, "full_tensor", None)  # a DTensor norm is a partial (per-shard) one
    total = full() if full is not None else total
    if max_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


@contextlib.contextmanager
def grad_sync(policy: nn.Module, enabled: bool) -> Iterator[None]:
    """DDP: all-reduce only on the last micro-batch. FSDP2 reduce-scatters every backward,
    which keeps gradients sharded (accumulating unsharded would cost the memory FSDP saves);
    one process has nothing to sync."""
    if enabled or not isinstance(policy, nn.parallel.DistributedDataParallel):
        yield
        return
    with policy.no_sync():
        yield
