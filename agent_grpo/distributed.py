"""Data-parallel training on torch.distributed: DDP or FSDP2, launched by `torchrun`.

Nothing here is a cluster: `torchrun` starts the processes and sets `RANK`, `WORLD_SIZE`,
`LOCAL_RANK`; DDP or FSDP2 (`fully_shard`) syncs gradients. This module only adds what GRPO needs
on top: a split of the global batch by GRPO group and the normalisation that makes N processes take
exactly the step one process would take over the same global batch.

The rule, for `token-mean` (other aggregations swap "tokens" for their own count). One process
over the global batch minimises `L = sum_i l_i / N`, where `l_i` is token i's loss and `N` the
global number of model tokens, so its gradient is `g = sum_i grad l_i / N`. Rank r holds the
tokens `S_r` (the `S_r` partition the batch) and backpropagates

    L_r = W * sum_{i in S_r} l_i / N        (N all-reduced, W = world size)

DDP and FSDP2 *average* gradients over ranks, so every rank ends with

    (1/W) * sum_r grad L_r = (1/W) * sum_r W * sum_{i in S_r} grad l_i / N = g.

Per-rank means (`N_r` in place of `N`, no `W`) give `(1/W) * sum_r sum_{S_r} grad l_i / N_r`,
which weights a token by `1 / (W * N_r)`: tokens on the rank with fewer model tokens count more,
and the step depends on how rows were dealt out. `tests/test_distributed.py` shows both.
The same all-reduced denominator is used for `seq-mean-token-mean` (sequences with at least one
model token) and `seq-mean-token-sum-norm` (`rows * max_tokens`, with the global longest span).

Gradient clipping uses the global norm: DDP grads are already the averaged `g` on every rank;
FSDP2 grads are DTensor shards whose per-shard norms `clip_grad_norm` combines with `full_tensor()`.

Where we depart from common practice:
- The policy is wrapped together with `token_logprobs` (`LogprobModel`), so DDP's and FSDP2's
  forward hooks run even though we never call the LM's own `forward` (it would build the full
  `[B, T, V]` logits that `token_logprobs` avoids).
- Every rank runs the same number of micro-batches: a rank with fewer (or no) rows runs one row
  again with an empty loss mask (zero loss, zero gradient). FSDP2 all-gathers in every forward,
  so unequal counts would deadlock; verl and TRL drop or pad rows instead.
- Under FSDP2 the shared-prefix pass (`algo.shared_prefix`) is off: same loss, more compute
  (see `wrap_policy`). DDP keeps it.
- Whole GRPO groups are dealt round-robin to ranks (so a group's shared prompt is run once, on
  one rank), not balanced by tokens: simple and deterministic.
- pi_old and pi_ref passes (`distributed_batch_logprobs`) are split the same way; the reference
  is sharded under FSDP2 and a whole copy per rank under DDP (DDP only wraps modules that train).
- State moves as whole tensors: `broadcast_module` (rank 0's weights before wrapping),
  `full_optimizer_state` (all-gathered on every rank, for a one-process-layout checkpoint) and
  `load_full_optimizer_state` (every rank gets the whole state and keeps its shards). Simple, and
  checkpoints resume in any mode, but each rank briefly holds the full optimizer state; large
  models want torch.distributed.checkpoint's sharded format (not built).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from agent_grpo.batch import (
    PackedBatch,
    loss_denominator,
    micro_batch_loss,
    micro_batches,
    rows_with_loss,
)
from agent_grpo.grpo import PolicyLossMetrics
from agent_grpo.logprobs import micro_batch_logprobs
from agent_grpo.train_config import AlgoConfig

__all__ = [
    "DistContext",
    "LogprobModel",
    "WrapMode",
    "broadcast_module",
    "broadcast_object",
    "clip_grad_norm",
    "distributed_batch_logprobs",
    "distributed_minibatch_update",
    "full_optimizer_state",
    "full_state_dict",
    "global_denominator",
    "global_max",
    "global_metrics",
    "global_sum",
    "init_distributed",
    "load_full_optimizer_state",
    "shard_rows",
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


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> DistContext:
    """Read the `torchrun` variables and join the process group (no-op for a single process).

    `backend` defaults to nccl when CUDA is available and gloo otherwise; `timeout_s` bounds every
    collective (torch's default: 10 min for nccl, 30 for gloo).
    """
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        chosen = backend or ("nccl" if cuda else "gloo")
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            chosen, device_id=device if chosen == "nccl" else None, timeout=timeout
        )
    return DistContext(rank, world_size, local_rank, device)


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


def global_denominator(
    batch: PackedBatch, rows: list[int], algo: AlgoConfig, ctx: DistContext
) -> tuple[float, int]:
    """The loss denominator of the whole global batch (summed over ranks' `rows`), and the
    longest model span (`max_tokens` of `seq-mean-token-sum-norm`) unless `algo` fixes it."""
    local = batch.select(rows) if rows else None
    span = int(local.loss_mask.sum(dim=1).max()) if local else 0
    max_tokens = algo.max_tokens or int(global_max(torch.tensor(span), ctx))
    count = loss_denominator(local, algo.aggregation, max_tokens) if local else 0
    total = float(global_sum(torch.tensor(count, dtype=torch.float64), ctx))
    return max(1.0, total), max_tokens


# ---- wrapping -----------------------------------------------------------------------------------


class LogprobModel(nn.Module):
    """A causal LM whose `forward` is `micro_batch_logprobs`, so DDP/FSDP hooks wrap every call."""

    def __init__(self, lm: nn.Module, allow_shared_prefix: bool = True) -> None:
        super().__init__()
        self.lm = lm
        self.allow_shared_prefix = allow_shared_prefix

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        target_mask: Tensor,
        temperature: float,
        shared_prefix: bool,
    ) -> Tensor:
        """`micro_batch_logprobs` of the LM: `[b, t]`, 0 off `target_mask`."""
        return micro_batch_logprobs(
            self.lm,
            input_ids,
            attention_mask,
            target_mask,
            temperature=temperature,
            shared_prefix=shared_prefix and self.allow_shared_prefix,
        )


def _decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a Hugging Face decoder (`model.layers` for Llama/Qwen/...)."""
    decoder = cast(nn.Module, lm.get_decoder())  # type: ignore[operator]
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise NotImplementedError(f"no decoder `layers` to shard on {type(lm).__name__}")
    return list(layers)


def wrap_policy(model: nn.Module, mode: WrapMode, ctx: DistContext) -> nn.Module:
    """`LogprobModel(model)` on `ctx.device`, under DDP or FSDP2 (each decoder layer, then root).

    FSDP2 shards `model` in place (its parameters become DTensors); build the optimizer from the
    returned module's parameters after wrapping.
    """
    if (mode == "none") == ctx.distributed:  # "none" on W ranks would train W separate models
        raise ValueError(f"mode {mode!r} does not fit world_size {ctx.world_size}")
    # FSDP2 all-gathers a layer at each call; the shared-prefix pass calls every layer twice, but
    # only for micro-batches of 2+ rows, so ranks would issue different collectives and hang.
    wrapped = LogprobModel(model.to(ctx.device), allow_shared_prefix=mode != "fsdp")
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


def wrap_reference(model: nn.Module, mode: WrapMode, ctx: DistContext) -> nn.Module:
    """A frozen `LogprobModel(model)` for `distributed_batch_logprobs`: sharded like the policy
    under FSDP2, a whole copy per rank otherwise (DDP only wraps modules that train)."""
    wrapped = LogprobModel(model.requires_grad_(False).to(ctx.device), mode != "fsdp")
    return _fully_shard(wrapped) if mode == "fsdp" else wrapped


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
    optimizer.load_state_dict({"state": by_index, "param_groups": state["param_groups"]})


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> Tensor:
    """Clip to the global gradient norm; DTensor (FSDP2) shards are combined across ranks."""
    params = [p for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm([cast(Tensor, p.grad) for p in params])
    full = getattr(total, "full_tensor", None)  # a DTensor norm is a partial (per-shard) one
    total = full() if full is not None else total
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# ---- the sharded minibatch update ---------------------------------------------------------------


def _to_device(batch: PackedBatch, device: torch.device) -> PackedBatch:
    fields = dataclasses.fields(batch)
    return PackedBatch(**{f.name: getattr(batch, f.name).to(device) for f in fields})


def _local_micro_batches(
    batch: PackedBatch, rows: list[int], algo: AlgoConfig, ctx: DistContext
) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches as (global rows, trains?), padded to the ranks' largest count.

    A padding micro-batch reruns one row with its loss masked out (see module doc).
    """
    local = micro_batches(batch, algo.micro_batch_tokens, by_group=algo.shared_prefix, rows=rows)
    count = int(global_max(torch.tensor(len(local)), ctx))
    filler = [rows[-1] if rows else 0]
    return [(g, True) for g in local] + [(filler, False)] * (count - len(local))


@contextlib.contextmanager
def _grad_sync(policy: nn.Module, enabled: bool) -> Iterator[None]:
    """DDP: all-reduce only on the last micro-batch. FSDP2 reduce-scatters every backward,
    which keeps gradients sharded (accumulating unsharded would cost the memory FSDP saves)."""
    if enabled or not isinstance(policy, nn.parallel.DistributedDataParallel):
        yield
        return
    with policy.no_sync():
        yield


def _micro_batch_loss(
    policy: nn.Module,
    part: PackedBatch,
    trains: bool,
    old: Tensor | None,
    ref: Tensor | None,
    algo: AlgoConfig,
    temperature: float,
    scale: tuple[int, float],
) -> tuple[Tensor, Tensor, PolicyLossMetrics]:
    """Logprobs `[b, t]`, loss and metrics of one micro-batch, as in `update.minibatch_update`.

    `scale` is (max_tokens, denominator) of the global minibatch. A padding micro-batch
    (`trains=False`) scores every real token, so every parameter is in the graph (DDP needs
    that), and masks all of them out of the loss.
    """
    mask = part.loss_mask if trains else torch.zeros_like(part.loss_mask)  # [b, t]
    targets = part.loss_mask if trains else part.attention_mask.bool()  # [b, t]
    logprobs = policy(
        part.input_ids, part.attention_mask, targets, temperature, algo.shared_prefix
    )  # [b, t]
    loss, metrics = micro_batch_loss(
        logprobs, part, old, ref, algo, loss_mask=mask, max_tokens=scale[0], denominator=scale[1]
    )
    return logprobs, loss, metrics


def global_metrics(
    parts: list[tuple[float, dict[str, float]]], ctx: DistContext
) -> dict[str, float]:
    """Merge (model tokens, metrics) of all ranks' micro-batches as `train.merge_metrics` does:
    loss and num_tokens add up, ratio_min/max are the extremes over micro-batches with tokens
    (1.0 if none has one), the rest are token-weighted means."""
    keys, summed = list(parts[0][1]), ("loss", "num_tokens")
    local = torch.zeros(len(keys) + 1, dtype=torch.float64)  # [K + 1]; last: total tokens
    for weight, metrics in parts:
        row = [metrics[k] * (1 if k in summed else weight) for k in keys]
        local += torch.tensor([*row, weight], dtype=torch.float64)
    added: list[float] = global_sum(local, ctx).tolist()
    out = {k: added[i] / (1 if k in summed else added[-1] or 1) for i, k in enumerate(keys)}
    live = [m for w, m in parts if w > 0]
    low = min((m["ratio_min"] for m in live), default=float("inf"))
    high = max((m["ratio_max"] for m in live), default=float("-inf"))
    low = -float(global_max(torch.tensor(-low, dtype=torch.float64), ctx))  # min = -max(-x)
    high = float(global_max(torch.tensor(high, dtype=torch.float64), ctx))
    out["ratio_min"] = low if low != float("inf") else 1.0
    out["ratio_max"] = high if high != float("-inf") else 1.0
    return out


def _gather_rows(values: Tensor, written: Tensor, ctx: DistContext) -> Tensor:
    """Every rank's rows of a `[B, T]` tensor (each row written by one rank); NaN where none."""
    total = global_sum(values, ctx)  # [B, T]
    return torch.where(global_sum(written, ctx) > 0, total, float("nan"))  # [B, T]


def distributed_minibatch_update(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    old: Tensor | None,
    ref: Tensor | None,
    algo: AlgoConfig,
    temperature: float,
    ctx: DistContext,
) -> tuple[dict[str, float], Tensor]:
    """`update.minibatch_update` over this rank's groups of a global minibatch (same step, any W).

    Every rank passes the same global `batch`, `old`, `ref` (`[B, T]`; `old=None`: on-policy) and
    a `wrap_policy` module. Returns the global metrics and the trainer logprobs `[B, T]` of the
    rows that were run (NaN elsewhere), identical on every rank.
    """
    rows = shard_rows(batch.input_ids.shape[0], ctx, batch.group_index)
    denominator, max_tokens = global_denominator(batch, rows, algo, ctx)
    skip = algo.skip_zero_advantage and ref is None
    micro = _local_micro_batches(
        batch, rows_with_loss(batch, skip_zero_advantage=skip, rows=rows), algo, ctx
    )
    seen = torch.zeros(batch.input_ids.shape)  # [B, T]
    written = torch.zeros(batch.input_ids.shape)  # [B, T]
    parts: list[tuple[float, dict[str, float]]] = []
    for k, (group, trains) in enumerate(micro):
        part = _to_device(batch.select(group), ctx.device)
        width = part.input_ids.shape[1]
        old_part, ref_part = (
            None if x is None else x[group, :width].to(ctx.device) for x in (old, ref)
        )
        with _grad_sync(policy, enabled=k == len(micro) - 1):
            logprobs, loss, metrics = _micro_batch_loss(
                policy,
                part,
                trains,
                old_part,
                ref_part,
                algo,
                temperature,
                (max_tokens, denominator),
            )
            (loss * ctx.world_size).backward()  # DDP/FSDP average over ranks; see module doc
        seen[group, :width] += logprobs.detach().float().cpu() * trains
        written[group, :width] += trains
        weight = float(part.num_model_tokens) * trains
        parts.append((weight, {"loss": float(loss.detach()), **metrics.as_dict()}))
    merged = global_metrics(parts, ctx)
    merged["grad_norm"] = float(clip_grad_norm(policy.parameters(), algo.max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return merged, _gather_rows(seen, written, ctx)


@torch.no_grad()
def distributed_batch_logprobs(
    model: nn.Module, batch: PackedBatch, temperature: float, algo: AlgoConfig, ctx: DistContext
) -> Tensor:
    """`update.batch_logprobs` split over ranks: each scores its groups' rows with a
    `wrap_policy` or `wrap_reference` module, every rank gets all rows `[B, T]` (NaN on rows
    without model tokens)."""
    rows = shard_rows(batch.input_ids.shape[0], ctx, batch.group_index)
    micro = _local_micro_batches(
        batch, rows_with_loss(batch, skip_zero_advantage=False, rows=rows), algo, ctx
    )
    values = torch.zeros(batch.input_ids.shape)  # [B, T]
    written = torch.zeros(batch.input_ids.shape)  # [B, T]
    for group, real in micro:
        part = _to_device(batch.select(group), ctx.device)
        width = part.input_ids.shape[1]
        logprobs = model(
            part.input_ids, part.attention_mask, part.loss_mask, temperature, algo.shared_prefix
        )  # [b, t]
        values[group, :width] += logprobs.float().cpu() * real
        written[group, :width] += real
    return _gather_rows(values, written, ctx)
