"""Warm start: supervised fine-tuning on an environment's expert trajectories.

A 135M model never calls a tool unaided, so GRPO would see only zero-reward groups. The expert
episodes go through the same `TokenBuilder` as rollouts, so the loss covers exactly the `model`
tokens (the expert's turns plus their end-of-turn token) and nothing the environment wrote.
An expert is a deterministic policy: each of its tokens has probability 1, so its records carry
sampler logprob 0.0, which is exact, not a placeholder. The demonstrations of one environment
share its system prompt and tool list: with `algo.speed.shared_prefix` a micro-batch runs that
common prefix once (`shared_prefix_token_logprobs`, the rows as one group), the same loss and
gradients up to rounding.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, Literal

import torch

from agent_grpo.config.jobs import TrainConfig
from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import train_seeds
from agent_grpo.models.logprobs import shared_prefix_token_logprobs, token_logprobs
from agent_grpo.trainer.batch import micro_batches_by_tokens, pack_records
from agent_grpo.trainer.optimizer import adamw
from agent_grpo.trainer.policy import autocast
from agent_grpo.trajectory.record import Message, Termination, TrajectoryRecord
from agent_grpo.trajectory.tree import TokenBuilder

__all__ = ["expert_record", "sft_loss", "train_sft", "warm_start"]


def expert_record(
    tokenizer: Any, env_id: str, seed: int, env_kwargs: dict[str, Any] | None = None
) -> TrajectoryRecord:
    """Run the environment's scripted expert on one seed and record it token by token."""
    env = make_env(env_id, **(env_kwargs or {}))
    try:
        obs, _ = env.reset(seed=seed)
        prompt = [Message.model_validate(m) for m in obs]
        builder = TokenBuilder(tokenizer, prompt)
        turn_end = builder.turn_end.id  # what closes a sampled turn: the template's, not EOS
        reward, done = 0.0, False
        kind: Literal["terminated", "truncated"] = "terminated"
        while not done:
            action = env.unwrapped.expert_action()  # type: ignore[attr-defined]
            ids = [*tokenizer.encode(action, add_special_tokens=False), turn_end]
            builder.add_model_turn(ids, [0.0] * len(ids))
            obs, step_reward, terminated, truncated, _ = env.step(action)
            reward = float(step_reward)
            done = terminated or truncated
            kind = "terminated" if terminated else "truncated"
            if not done:
                builder.add_observations([Message.model_validate(m) for m in obs])
    finally:
        env.close()
    return builder.to_record(
        group_id=f"expert-{seed}",
        task_id=f"{env_id}:{seed}",
        index_in_group=0,
        group_size=1,
        env_id=env_id,
        seed=seed,
        reward=float(reward),
        success=float(reward) > 0,
        termination=Termination(kind=kind, reason="expert"),
    )


def sft_loss(
    model: torch.nn.Module,
    batch: Any,
    denominator: int,
    compute_dtype: torch.dtype = torch.float32,
    shared_prefix: bool = False,
) -> torch.Tensor:
    """Negative log-likelihood summed over model tokens, divided by `denominator`; with
    `shared_prefix` the rows' common prefix runs once."""
    with autocast(batch.input_ids.device, compute_dtype):
        if shared_prefix:
            everyone = [list(range(batch.input_ids.shape[0]))]
            logprobs = shared_prefix_token_logprobs(
                model, batch.input_ids, batch.attention_mask, everyone, target_mask=batch.loss_mask
            )  # [B, T]
        else:
            logprobs = token_logprobs(
                model, batch.input_ids, batch.attention_mask, target_mask=batch.loss_mask
            )  # [B, T]
        logprobs = logprobs.float()
    mask = batch.loss_mask  # [B, T]
    return -torch.where(mask, logprobs, 0.0).sum() / denominator


def train_sft(
    model: torch.nn.Module,
    records: Sequence[TrajectoryRecord],
    *,
    pad_id: int,
    epochs: int,
    batch_size: int,
    lr: float,
    micro_batch_tokens: int = 4096,
    seed: int = 0,
    compute_dtype: torch.dtype = torch.float32,
    shared_prefix: bool = False,
) -> list[float]:
    """Fit the model to the records' model tokens; returns the mean NLL of each optimizer step.

    Batches go to the model's device; `compute_dtype` bf16 runs the forward under autocast."""
    device = next(model.parameters()).device
    optimizer = adamw(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(records), generator=generator).tolist()
        for start in range(0, len(order), batch_size):
            chunk = [records[i] for i in order[start : start + batch_size]]
            batch = pack_records(chunk, pad_id).to(device)
            denominator = max(1, batch.num_model_tokens)
            total = 0.0
            lengths = batch.attention_mask.sum(dim=1).tolist()
            for rows in micro_batches_by_tokens(lengths, micro_batch_tokens):
                loss = sft_loss(model, batch.select(rows), denominator, compute_dtype,
                                shared_prefix)  # fmt: skip
                loss.backward()
                total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(total)
    model.eval()
    return losses


def warm_start(
    config: TrainConfig, policy: torch.nn.Module, tokenizer: Any, compute_dtype: torch.dtype
) -> list[float]:
    """The configured supervised pass on expert demonstrations from training seeds."""
    assert config.warm_start is not None
    ws = config.warm_start
    rng = random.Random(f"{config.seed}/warm-start")
    demos = [
        expert_record(tokenizer, config.env.id, s, config.env.kwargs)
        for s in train_seeds(ws.demos, rng)
    ]
    return train_sft(
        policy, demos, pad_id=tokenizer.pad_token_id, epochs=ws.epochs,
        batch_size=ws.batch_size, lr=ws.lr, micro_batch_tokens=config.algo.speed.micro_batch_tokens,
        seed=config.seed, compute_dtype=compute_dtype,
        shared_prefix=config.algo.speed.shared_prefix,
    )  # fmt: skip
