"""The policy update: epochs of minibatch optimizer steps over one step's packed batch, for 1..W
ranks with the same code.

Every rank passes the same global batch. Each trains on its GRPO groups (`shard_rows`; in one
process, all of them), accumulating gradients over token-sized micro-batches whose losses share
the whole minibatch's denominator (all-reduced), so neither the micro-batch split nor the number
of ranks changes the update (agent_grpo/trainer/parallel.py derives why). In one process every
collective is the identity and no micro-batch is padding.

A non-finite loss or gradient norm skips the optimizer step (weights and optimizer state stay
as they were), logs an error and counts it in `UpdateMetrics.skipped_steps`. With
`algo.speed.optimizer_in_backward` a non-finite loss still skips the whole step, but a non-finite
gradient can only skip its own parameter's step (the others have stepped): it is counted the
same way (agent_grpo/trainer/backward_steps.py).

A minibatch without learning signal (every trained token's advantage is 0 and there is no KL
term, so the loss is 0 by construction) takes no optimizer step either, and counts it in
`UpdateMetrics.idle_steps`: AdamW given a zero gradient still moves every weight along its
momentum. Without this rule the weights moved or not depending on `skip_zero_advantage` (a
skipped row has no gradient at all, a zero-advantage row that runs has a zero one), a speed knob
that must change only the cost.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.algo.objective import grpo_micro_batch_loss, loss_denominator
from agent_grpo.logs import get_logger
from agent_grpo.models.logprobs import kv_slot_cost
from agent_grpo.trainer.backward_steps import BackwardSteps
from agent_grpo.trainer.batch import PackedBatch, episode_rows, micro_batches, rows_with_loss
from agent_grpo.trainer.metrics import UpdateMetrics, UpdateStats
from agent_grpo.trainer.parallel import (
    DistContext,
    clip_grad_norm,
    global_max,
    global_sum,
    grad_sync,
    shard_rows,
    shares_prefixes,
    unwrap_policy,
)

__all__ = ["batch_logprobs", "grpo_update", "minibatch_update"]

log = get_logger("train")


def _minibatch_scale(
    batch: PackedBatch, rows: list[int], algo: AlgoConfig, max_tokens: int, ctx: DistContext
) -> float:
    """The loss denominator of the whole (global) minibatch, summed over ranks' `rows`."""
    local = (
        loss_denominator(batch.loss_mask[rows], algo, max_tokens, batch.episode_index[rows])
        if rows
        else 0
    )
    return max(1.0, float(global_sum(torch.tensor(float(local), dtype=torch.float64), ctx)))


def _sequence_tokens(batch: PackedBatch) -> Tensor:
    """`[B]`: the model tokens of each row's whole episode (all its branches in the batch)."""
    per_row = batch.loss_mask.sum(dim=1)  # [B]
    size = int(batch.episode_index.max()) + 1 if len(per_row) else 0
    per_episode = torch.zeros(size, dtype=per_row.dtype).index_add_(
        0, batch.episode_index, per_row
    )  # [E]
    return per_episode[batch.episode_index]  # [B]


def _micro_batches(
    batch: PackedBatch, rows: list[int], algo: AlgoConfig, ctx: DistContext, model: nn.Module
) -> list[tuple[list[int], bool]]:
    """This rank's micro-batches for `model` (a `wrap_policy` / `wrap_reference` module) as
    (rows, trains?), padded to the ranks' largest count.

    A padding micro-batch reruns one row with its loss masked out (parallel.py's docstring);
    in one process there is none.
    """
    local = micro_batches(
        batch, algo.speed.micro_batch_tokens, by_group=algo.speed.shared_prefix, rows=rows,
        shared_prefix=shares_prefixes(model, algo.speed.shared_prefix),
        kv_slot_cost=kv_slot_cost(unwrap_policy(model)),
    )  # fmt: skip
    count = int(global_max(torch.tensor(len(local)), ctx))
    filler = [rows[-1] if rows else 0]
    return [(g, True) for g in local] + [(filler, False)] * (count - len(local))


def _gather_rows(values: Tensor, written: Tensor, ctx: DistContext) -> Tensor:
    """Every rank's rows of a `[B, T]` tensor (each row written by one rank); NaN where none."""
    total = global_sum(values, ctx)  # [B, T]
    return torch.where(global_sum(written, ctx) > 0, total, float("nan"))  # [B, T]


def _any_rank(rows: list[int], ctx: DistContext) -> bool:
    """Whether any rank has a row in its `rows` (the same answer on every rank)."""
    return bool(global_sum(torch.tensor(float(len(rows)), dtype=torch.float64), ctx) > 0)


def minibatch_update(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    old: Tensor | None,
    ref: Tensor | None,
    algo: AlgoConfig,
    temperature: float,
    max_tokens: int,
    ctx: DistContext | None = None,
    in_backward: BackwardSteps | None = None,
) -> tuple[UpdateMetrics, Tensor]:
    """One optimizer step over a minibatch (this rank's groups of it).

    `policy` is a `wrap_policy` module; `old`, `ref` are `[B, T]` (`old=None`: on-policy, pi_old
    is this very forward pass, detached). With `in_backward` (`algo.speed.optimizer_in_backward`)
    the last micro-batch's backward steps `optimizer`'s parameters one by one. Returns the metrics,
    identical on every rank, and the trainer's logprobs `[B, T]` of the rows that were run (NaN
    elsewhere).
    """
    ctx = ctx or DistContext()
    rows = shard_rows(batch.input_ids.shape[0], ctx, batch.group_index)
    denominator = _minibatch_scale(batch, rows, algo, max_tokens, ctx)
    # every loss-mask token, run or skipped: `skip_zero_advantage` must not change the count
    local_tokens = batch.loss_mask[rows].sum() if rows else torch.tensor(0)
    trained_tokens = float(global_sum(local_tokens.to(torch.float64), ctx))
    # with beta = 0 (no ref), a zero-advantage row adds exactly 0: its forward pass is skipped
    live = rows_with_loss(batch, skip_zero_advantage=True, rows=rows)
    skip = algo.speed.skip_zero_advantage and ref is None
    run = live if skip else rows_with_loss(batch, skip_zero_advantage=False, rows=rows)
    micro = _micro_batches(batch, run, algo, ctx, policy)
    signal = ref is not None or _any_rank(live, ctx)
    sequence_tokens = _sequence_tokens(batch)  # [B]
    seen = torch.zeros(batch.input_ids.shape)  # [B, T]
    written = torch.zeros(batch.input_ids.shape)  # [B, T]
    stats = UpdateStats()
    if in_backward is not None:
        in_backward.reset()
    for k, (group, trains) in enumerate(micro):
        part = batch.select(group).to(ctx.device)
        width = part.input_ids.shape[1]
        # a padding micro-batch scores every real token, so every parameter is in the graph
        # (DDP needs that), and masks all of them out of the loss
        mask = part.loss_mask if trains else torch.zeros_like(part.loss_mask)  # [b, t]
        targets = part.loss_mask if trains else part.attention_mask.bool()  # [b, t]
        with grad_sync(policy, enabled=k == len(micro) - 1):
            logprobs = policy(part.input_ids, part.attention_mask, targets, temperature,
                              algo.speed.shared_prefix)  # fmt: skip  # [b, t]
            out = grpo_micro_batch_loss(
                logprobs,
                None if old is None else old[group, :width].to(ctx.device),
                None if ref is None else ref[group, :width].to(ctx.device),
                part.sampler_logprobs,
                part.advantages,
                mask,
                algo,
                max_tokens=max_tokens,
                denominator=denominator,
                sequence_tokens=sequence_tokens[group].to(ctx.device),
            )
            if in_backward is not None:  # a non-finite loss never reaches a step
                loss_so_far = stats.loss + float(out.loss.detach())
                in_backward.arm(signal and k == len(micro) - 1 and math.isfinite(loss_so_far))
            (out.loss * ctx.world_size).backward()  # DDP/FSDP average over ranks
        seen[group, :width] += logprobs.detach().cpu() * trains
        written[group, :width] += trains
        stats.add(float(out.loss.detach()), out.metrics, out.tis_capped)
    stats = UpdateStats.from_tensors(
        global_sum(stats.sums(), ctx), global_max(stats.extremes(), ctx)
    )
    if in_backward is not None:
        in_backward.arm(False)
        grad_norm = in_backward.grad_norm()
        skipped = in_backward.nonfinite > 0 or not math.isfinite(stats.loss)
        if skipped:
            log.error("non-finite loss %s or gradient (%d parameters): those steps skipped",
                      stats.loss, in_backward.nonfinite)  # fmt: skip
    else:
        grad_norm = float(clip_grad_norm(policy.parameters(), algo.max_grad_norm))
        skipped = not (math.isfinite(grad_norm) and math.isfinite(stats.loss))
        if skipped:  # the same decision on every rank: both figures are global
            log.error("non-finite loss %s or gradient norm %s: optimizer step skipped, weights "
                      "untouched", stats.loss, grad_norm)  # fmt: skip
        elif signal:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = UpdateMetrics.of_step(stats, grad_norm, ref is not None, skipped, trained_tokens,
                                    idle=not signal)  # fmt: skip
    return metrics, _gather_rows(seen, written, ctx)


def grpo_update(
    policy: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    old: Tensor | None,
    ref: Tensor | None,
    algo: AlgoConfig,
    temperature: float,
    max_tokens: int,
    seed: int,
    ctx: DistContext | None = None,
    in_backward: BackwardSteps | None = None,
) -> tuple[UpdateMetrics, Tensor]:
    """`epochs` passes of `minibatches` optimizer steps over the step's batch.

    Returns the mean metrics and the logprobs of the first pass (= pi_old when there is a
    single pass; with more, rows of later minibatches were scored by an updated policy).
    """
    policy.train()
    generator = torch.Generator().manual_seed(seed)
    first_pass = torch.full(batch.input_ids.shape, float("nan"))  # [B, T]
    history: list[UpdateMetrics] = []
    episodes = episode_rows(batch)  # a forked episode's rows share a minibatch
    for epoch in range(algo.epochs):
        order = torch.randperm(len(episodes), generator=generator)
        for chunk in order.chunk(algo.minibatches):
            index = [row for e in chunk.tolist() for row in episodes[e]]
            part = batch.select(index)
            width = part.input_ids.shape[1]
            metrics, seen = minibatch_update(
                policy, optimizer, part,
                None if old is None else old[index, :width],
                None if ref is None else ref[index, :width],
                algo, temperature, max_tokens, ctx, in_backward,
            )  # fmt: skip
            history.append(metrics)
            if epoch == 0:
                first_pass[index, :width] = seen
    policy.eval()
    return UpdateMetrics.mean(history), first_pass


@torch.no_grad()
def batch_logprobs(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float,
    algo: AlgoConfig,
    ctx: DistContext | None = None,
) -> Tensor:
    """Per-token logprobs `[B, T]` of a whole batch under a `wrap_policy` / `wrap_reference`
    module, micro-batch by micro-batch, each rank scoring its groups; every rank gets all rows
    (NaN on rows without model tokens)."""
    ctx = ctx or DistContext()
    rows = shard_rows(batch.input_ids.shape[0], ctx, batch.group_index)
    micro = _micro_batches(batch, rows_with_loss(batch, skip_zero_advantage=False, rows=rows),
                           algo, ctx, model)  # fmt: skip
    values = torch.zeros(batch.input_ids.shape)  # [B, T]
    written = torch.zeros(batch.input_ids.shape)  # [B, T]
    was_training = model.training
    model.eval()
    for group, real in micro:
        part = batch.select(group).to(ctx.device)
        width = part.input_ids.shape[1]
        logprobs = model(part.input_ids, part.attention_mask, part.loss_mask, temperature,
                         algo.speed.shared_prefix)  # fmt: skip  # [b, t]
        values[group, :width] += logprobs.cpu() * real
        written[group, :width] += real
    model.train(was_training)
    return _gather_rows(values, written, ctx)
