"""Trajectory records -> padded tensors, and micro-batches sized by token count.

Position `t` of every per-token tensor refers to token `t` of the sequence: `loss_mask[b, t]` is
true when token t was sampled by the policy, and the trainer's logprob at t is that of token t
given tokens < t. Missing logprobs are NaN in tensors, and every consumer masks before reducing.

A batch row is one branch of an episode's token tree (`TrajectoryRecord.rows`): an episode whose
template only appended is one row, a forked one several. `episode_index` maps rows back to their
record, so the advantage, the group and the per-sequence aggregations stay per episode.
`advantages` is per token: the episode's on every token of its rows, except where a turn has
an advantage of its own (`TurnRecord.advantage`, turn-level credit), on that turn's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from agent_grpo.models.logprobs import prefix_groups, shared_prefix_tokens
from agent_grpo.trajectory.record import Provenance, TrajectoryRecord, TurnRecord

__all__ = [
    "PackedBatch",
    "episode_rows",
    "micro_batches",
    "micro_batches_by_tokens",
    "pack_records",
    "rows_with_loss",
    "token_versions",
]


@dataclass
class PackedBatch:
    """Right-padded tensors for a list of trajectory records."""

    input_ids: torch.Tensor  # [B, T] long, pad_id past each sequence
    attention_mask: torch.Tensor  # [B, T] long, 1 on real tokens
    loss_mask: torch.Tensor  # [B, T] bool, True exactly on model tokens
    sampler_logprobs: torch.Tensor  # [B, T] float, NaN where the sampler gave none
    advantages: torch.Tensor  # [B, T] float, each token's (its episode's or its turn's)
    group_index: torch.Tensor  # [B] long, rows of one GRPO group share a value
    episode_index: torch.Tensor  # [B] long, the record each row is a branch of

    @property
    def num_model_tokens(self) -> int:
        """Tokens that enter the loss."""
        return int(self.loss_mask.sum())

    def to(self, device: torch.device) -> PackedBatch:
        """The same batch on `device` (itself when it is already there)."""
        if self.input_ids.device == device:
            return self
        return PackedBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.loss_mask.to(device),
            self.sampler_logprobs.to(device),
            self.advantages.to(device),
            self.group_index.to(device),
            self.episode_index.to(device),
        )

    def select(self, rows: Sequence[int]) -> PackedBatch:
        """The sub-batch of `rows`, trimmed to its own longest sequence."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        width = int(self.attention_mask[index].sum(dim=1).max())
        return PackedBatch(
            self.input_ids[index, :width],
            self.attention_mask[index, :width],
            self.loss_mask[index, :width],
            self.sampler_logprobs[index, :width],
            self.advantages[index, :width],
            self.group_index[index],
            self.episode_index[index],
        )


def _logprob_row(values: list[float | None]) -> list[float]:
    return [float("nan") if v is None else v for v in values]


def pack_records(
    records: Sequence[TrajectoryRecord], pad_id: int, advantages: Sequence[float] | None = None
) -> PackedBatch:
    """Pad every row of every record (its branches, in order) on the right into one batch;
    a record's rows share its group and its advantage (by default the record's own), except
    the tokens of a turn with an advantage of its own (turn-level credit), which take that."""
    rows = [(e, row) for e, record in enumerate(records) for row in record.rows()]
    width = max(len(row.token_ids) for _, row in rows)
    batch = len(rows)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)  # [B, T]
    attention = torch.zeros((batch, width), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((batch, width), dtype=torch.bool)  # [B, T]
    sampler = torch.full((batch, width), float("nan"))  # [B, T]
    for b, (_, row) in enumerate(rows):
        n = len(row.token_ids)
        input_ids[b, :n] = torch.tensor(row.token_ids)
        attention[b, :n] = 1
        loss_mask[b, :n] = torch.tensor([p is Provenance.MODEL for p in row.provenance])
        sampler[b, :n] = torch.tensor(_logprob_row(row.sampler_logprobs))
    per_record = advantages if advantages is not None else [r.advantage or 0.0 for r in records]
    values = _per_turn(records, width, [float(a) for a in per_record], lambda t: t.advantage)
    codes: dict[str, int] = {}
    groups = torch.tensor([codes.setdefault(records[e].group_id, len(codes)) for e, _ in rows])
    episodes = torch.tensor([e for e, _ in rows], dtype=torch.long)  # [B]
    return PackedBatch(input_ids, attention, loss_mask, sampler, values, groups, episodes)


def token_versions(records: Sequence[TrajectoryRecord], width: int) -> torch.Tensor:
    """The policy version that sampled each token, `[B, T]` in `pack_records`' row order: a
    turn's own (`TurnRecord.policy_version`, partial rollouts) on its tokens in the branch it
    was sampled in, the record's `policy_version` everywhere else."""
    per_record = [float(r.policy_version) for r in records]
    return _per_turn(records, width, per_record, lambda t: t.policy_version).long()


def _per_turn(
    records: Sequence[TrajectoryRecord],
    width: int,
    per_record: Sequence[float],
    of_turn: Callable[[TurnRecord], float | None],
) -> torch.Tensor:
    """`[B, T]` over every row of every record: its record's value, except on the tokens of a
    turn (in the branch it was sampled in) for which `of_turn` gives one."""
    rows = [(e, row) for e, record in enumerate(records) for row in record.rows()]
    values = torch.tensor([per_record[e] for e, _ in rows])[:, None].repeat(1, width)  # [B, T]
    for b, (e, row) in enumerate(rows):
        for turn in records[e].turns:
            value = of_turn(turn)
            if value is not None and turn.branch == row.branch:
                values[b, turn.token_start : turn.token_end] = value
    return values


def episode_rows(batch: PackedBatch) -> list[list[int]]:
    """The rows of each episode, in episode order (one row each unless it forked)."""
    rows: dict[int, list[int]] = {}
    for b, e in enumerate(batch.episode_index.tolist()):
        rows.setdefault(e, []).append(b)
    return list(rows.values())


def micro_batches_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Split row indices, in order, into groups whose padded size (rows x longest) fits.

    A single sequence longer than `max_tokens` gets a micro-batch of its own.
    """
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i, n in enumerate(lengths):
        if current and max(longest, n) * (len(current) + 1) > max_tokens:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def micro_batches(
    batch: PackedBatch,
    max_tokens: int,
    *,
    by_group: bool,
    rows: Sequence[int] | None = None,
    shared_prefix: bool = False,
    kv_slot_cost: float = 0.2,
) -> list[list[int]]:
    """Row groups for forward passes, token-sized (padded rows x longest <= `max_tokens`); with
    `by_group`, whole GRPO groups share a micro-batch while they fit, and a group is never split
    unless it alone is too large. With `shared_prefix` (the model runs the shared-prefix pass)
    a micro-batch of groups is sized by the tokens that pass computes (`shared_prefix_tokens`:
    prompts once, rows past them, and the rows' copies of their prefix KV at `kv_slot_cost`),
    not as if every row held its own prompt.

    Only `rows` (default: all) are placed. Keeping a group together lets its members share one
    pass over their common prompt (`shared_prefix_token_logprobs`, which runs the prefixes of
    every group in a micro-batch together, and their common head once). Fewer, larger
    micro-batches mean fewer backward passes per optimizer step (each accumulates every
    parameter's gradient once) and larger matmuls; `algo.speed.optimizer_in_backward` holds no
    whole-model gradient only when a minibatch is one micro-batch.
    """
    wanted = list(range(batch.input_ids.shape[0])) if rows is None else list(rows)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    if not by_group:
        parts = micro_batches_by_tokens([lengths[r] for r in wanted], max_tokens)
        return [[wanted[i] for i in part] for part in parts]
    buckets: dict[int, list[int]] = {}
    for row in wanted:
        buckets.setdefault(int(batch.group_index[row]), []).append(row)

    # the pass groups rows by what precedes their first target (a fork's by its own context),
    # a key of the row alone: a micro-batch's grouping is the batch's, restricted to its rows
    prompt_of = {r: k for k, members in enumerate(prefix_groups(batch.input_ids, batch.loss_mask))
                 for r in members}  # fmt: skip

    def size(groups: list[list[int]]) -> int:
        if not shared_prefix:
            return max(lengths[r] for g in groups for r in g) * sum(len(g) for g in groups)
        by_prompt: dict[int, list[int]] = {}
        for r in (r for g in groups for r in g):
            by_prompt.setdefault(prompt_of[r], []).append(r)
        return shared_prefix_tokens(batch.input_ids, batch.attention_mask,
                                    list(by_prompt.values()), kv_slot_cost)  # fmt: skip

    out: list[list[int]] = []
    current: list[list[int]] = []
    for members in buckets.values():
        if size([*current, members]) <= max_tokens:
            current.append(members)
            continue
        if current:
            out.append([r for g in current for r in g])
        current = [members]
        if size(current) > max_tokens:  # split it alone
            parts = micro_batches_by_tokens([lengths[r] for r in members], max_tokens)
            out.extend([members[i] for i in part] for part in parts)
            current = []
    if current:
        out.append([r for g in current for r in g])
    return out


def rows_with_loss(
    batch: PackedBatch, *, skip_zero_advantage: bool, rows: Sequence[int] | None = None
) -> list[int]:
    """The `rows` (default: all) whose loss can be non-zero: rows with a model token, and with
    `skip_zero_advantage` (only valid when beta = 0) only those with a non-zero advantage.

    A skipped zero-advantage row adds exactly 0 to the loss and the gradient; its tokens still
    count in the denominator, so skipping its forward pass changes only the cost.
    """
    keep = batch.loss_mask.any(dim=1)  # [B]
    if skip_zero_advantage:
        keep &= ((batch.advantages != 0) & batch.loss_mask).any(dim=1)  # [B]
    wanted = range(batch.input_ids.shape[0]) if rows is None else rows
    return [r for r in wanted if keep[r]]
