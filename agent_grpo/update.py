"""The policy update: epochs of minibatch optimizer steps over one step's packed batch.

Gradients are accumulated over token-sized micro-batches whose losses share the whole
minibatch's denominator, so how a batch is split never changes the update. Under torchrun the
same update is sharded by group (agent_grpo/distributed.py).
"""

from __future__ import annotations

import torch

from agent_grpo.batch import (
    PackedBatch,
    loss_denominator,
    micro_batch_loss,
    micro_batches,
    rows_with_loss,
)
from agent_grpo.distributed import (
    DistContext,
    distributed_batch_logprobs,
    distributed_minibatch_update,
)
from agent_grpo.logprobs import micro_batch_logprobs
from agent_grpo.train_config import AlgoConfig

__all__ = ["batch_logprobs", "grpo_update", "merge_metrics", "minibatch_update"]


@torch.no_grad()
def batch_logprobs(
    model: torch.nn.Module,
    batch: PackedBatch,
    temperature: float,
    algo: AlgoConfig,
    ctx: DistContext | None = None,
) -> torch.Tensor:
    """Per-token logprobs [B, T] of a whole batch, micro-batch by micro-batch (no grad); under
    torchrun (`ctx`) each rank scores its groups and every rank gets all rows."""
    if ctx is not None and ctx.distributed:
        return distributed_batch_logprobs(model, batch, temperature, algo, ctx)
    out = torch.full(batch.input_ids.shape, float("nan"))  # [B, T]
    for rows in micro_batches(batch, algo.micro_batch_tokens, by_group=algo.shared_prefix):
        part = batch.select(rows)
        values = micro_batch_logprobs(
            model,
            part.input_ids,
            part.attention_mask,
            part.loss_mask,
            temperature=temperature,
            shared_prefix=algo.shared_prefix,
        )  # [b, t]
        out[rows, : values.shape[1]] = values.float()
    return out


def merge_metrics(parts: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Merge micro-batch metrics: min/max stay min/max, counts add, the rest token-weighted."""
    total = sum(w for w, _ in parts) or 1.0
    merged: dict[str, float] = {}
    for key in parts[0][1]:
        values = [m[key] for _, m in parts if key in m]
        if key == "ratio_min":
            merged[key] = min(values)
        elif key == "ratio_max":
            merged[key] = max(values)
        elif key in ("num_tokens", "loss"):
            merged[key] = sum(values)
        else:
            merged[key] = sum(w * m[key] for w, m in parts if key in m) / total
    return merged


def minibatch_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    algo: AlgoConfig,
    temperature: float,
) -> tuple[dict[str, float], torch.Tensor]:
    """One optimizer step over a minibatch, accumulating gradients over token-sized micro-batches.

    `old=None` means on-policy: pi_old is this very forward pass, detached (ratio 1), which saves
    a separate no-grad pass. Returns the metrics and the trainer's logprobs [B, T] (detached).
    """
    max_tokens = algo.max_tokens or int(batch.loss_mask.sum(dim=1).max())
    denominator = max(1, loss_denominator(batch, algo.aggregation, max_tokens))
    # with beta = 0 (no ref), a zero-advantage row adds exactly 0: its forward pass is skipped
    skip = algo.skip_zero_advantage and ref is None
    seen = torch.full(batch.input_ids.shape, float("nan"))  # [B, T]
    parts: list[tuple[float, dict[str, float]]] = []
    for rows in micro_batches(
        batch,
        algo.micro_batch_tokens,
        by_group=algo.shared_prefix,
        rows=rows_with_loss(batch, skip_zero_advantage=skip),
    ):
        part = batch.select(rows)
        width = part.input_ids.shape[1]
        logprobs = micro_batch_logprobs(
            policy,
            part.input_ids,
            part.attention_mask,
            part.loss_mask,
            temperature=temperature,
            shared_prefix=algo.shared_prefix,
        )  # [b, t]
        seen[rows, :width] = logprobs.detach()
        loss, metrics = micro_batch_loss(
            logprobs,
            part,
            None if old is None else old[rows, :width],
            None if ref is None else ref[rows, :width],
            algo,
            loss_mask=part.loss_mask,
            max_tokens=max_tokens,
            denominator=denominator,
        )
        loss.backward()
        parts.append(
            (float(part.num_model_tokens), {"loss": float(loss.detach()), **metrics.as_dict()})
        )
    merged = merge_metrics(parts) if parts else {"loss": 0.0, "num_tokens": 0.0}
    merged["grad_norm"] = float(
        torch.nn.utils.clip_grad_norm_(policy.parameters(), algo.max_grad_norm)
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return merged, seen


def grpo_update(
    policy: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    old: torch.Tensor | None,
    ref: torch.Tensor | None,
    algo: AlgoConfig,
    temperature: float,
    seed: int,
    ctx: DistContext | None = None,
) -> tuple[dict[str, float], torch.Tensor]:
    """`epochs` passes of `minibatches` optimizer steps over the step's batch.

    Returns the mean metrics and the logprobs of the first pass (= pi_old when on-policy). Under
    torchrun (`ctx`) every rank passes the same batch and each trains on its groups.
    """
    policy.train()
    generator = torch.Generator().manual_seed(seed)
    rows = batch.input_ids.shape[0]
    first_pass = torch.full(batch.input_ids.shape, float("nan"))  # [B, T]
    history: list[dict[str, float]] = []
    for epoch in range(algo.epochs):
        order = torch.randperm(rows, generator=generator)
        for chunk in order.chunk(algo.minibatches):
            index = chunk.tolist()
            part = batch.select(index)
            width = part.input_ids.shape[1]
            part_old = None if old is None else old[index, :width]  # [b, t]
            part_ref = None if ref is None else ref[index, :width]  # [b, t]
            if ctx is not None and ctx.distributed:
                metrics, seen = distributed_minibatch_update(
                    policy, optimizer, part, part_old, part_ref, algo, temperature, ctx
                )
            else:
                metrics, seen = minibatch_update(
                    policy, optimizer, part, part_old, part_ref, algo, temperature
                )
            history.append(metrics)
            if epoch == 0:
                first_pass[index, :width] = seen
    policy.eval()
    return {key: sum(h[key] for h in history) / len(history) for key in history[0]}, first_pass
