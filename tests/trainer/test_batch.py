"""Packing records into tensors and splitting batches by token count."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from agent_grpo.inspect.rewriting_templates import THINKING_PROMPT, with_template
from agent_grpo.models.logprobs import prefix_groups, shared_prefix_tokens
from agent_grpo.testing.records import builder_record, minimal_record
from agent_grpo.trainer.batch import (
    PackedBatch,
    episode_rows,
    micro_batches,
    micro_batches_by_tokens,
    pack_records,
    token_versions,
)
from agent_grpo.trajectory.record import Message, Provenance, TrajectoryRecord
from agent_grpo.trajectory.tree import TokenBuilder

P, M, T, OBS = Provenance.PROMPT, Provenance.MODEL, Provenance.TEMPLATE, Provenance.OBSERVATION


def make_record(provenance: list[Provenance], advantage: float = 0.0) -> TrajectoryRecord:
    """A record whose token ids are 100 + position and logprobs -0.1 * position, so a packed
    tensor shows which position each value came from."""
    return minimal_record(
        token_ids=[100 + i for i in range(len(provenance))],
        provenance=provenance,
        sampler_logprobs=[-0.1 * i if p is M else None for i, p in enumerate(provenance)],
        advantage=advantage,
    )


def test_pack_records_pads_right_and_masks_only_model_tokens() -> None:
    a = make_record([P, P, M, M, T, OBS, M], advantage=1.5)
    b = make_record([P, M, M], advantage=-0.5)
    batch = pack_records([a, b], pad_id=2)
    assert batch.input_ids.tolist() == [
        [100, 101, 102, 103, 104, 105, 106],
        [100, 101, 102, 2, 2, 2, 2],
    ]
    assert batch.attention_mask.tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [
        [False, False, True, True, False, False, True],
        [False, True, True, False, False, False, False],
    ]
    assert batch.advantages.tolist() == [[1.5] * 7, [-0.5] * 7]  # every token: its episode's
    # logprobs exist exactly under the loss mask; everything else is NaN, never 0.0
    assert torch.equal(~torch.isnan(batch.sampler_logprobs), batch.loss_mask)
    assert math.isclose(float(batch.sampler_logprobs[0, 6]), -0.6, abs_tol=1e-6)
    assert batch.num_model_tokens == 5


def test_select_trims_to_the_sub_batch_width() -> None:
    batch = pack_records([make_record([P] * 9), make_record([P, M])], pad_id=0)
    part = batch.select([1])
    assert part.input_ids.shape == (1, 2)
    assert part.loss_mask.tolist() == [[False, True]]


def test_micro_batches_golden() -> None:
    # padded cost = rows x longest: [5,5] -> 10 fits 10; adding 3 -> 15 > 10
    assert micro_batches_by_tokens([5, 5, 3, 2, 12, 1], 10) == [[0, 1], [2, 3], [4], [5]]


@given(st.lists(st.integers(1, 50), min_size=1, max_size=40), st.integers(1, 120))
def test_micro_batches_cover_every_row_once_in_order_and_fit(
    lengths: list[int], budget: int
) -> None:
    groups = micro_batches_by_tokens(lengths, budget)
    assert [i for g in groups for i in g] == list(range(len(lengths)))
    for group in groups:
        cost = max(lengths[i] for i in group) * len(group)
        assert cost <= budget or len(group) == 1


def test_micro_batches_pack_whole_groups_and_split_only_a_group_too_large() -> None:
    """Groups share a micro-batch while rows x longest fits; a group is split only when it alone
    does not fit, and then by tokens."""
    sizes = {"a": (2, 5), "b": (3, 4), "c": (4, 10), "d": (1, 3)}  # rows, tokens
    records = []
    for group, (rows, tokens) in sizes.items():
        for _ in range(rows):
            record = make_record([P] * (tokens - 1) + [M])
            records.append(record.model_copy(update={"group_id": group}))
    batch = pack_records(records, pad_id=0)
    # a + b: 5 rows x 5 = 25 <= 30; c alone is 4 x 10 = 40: split 3 + 1; d starts afresh
    assert micro_batches(batch, 30, by_group=True) == [[0, 1, 2, 3, 4], [5, 6, 7], [8], [9]]
    assert micro_batches(batch, 30, by_group=True, rows=[0, 1, 9]) == [[0, 1, 9]]
    assert micro_batches(batch, 10, by_group=False) == [
        [0, 1],
        [2, 3],
        [4],
        [5],
        [6],
        [7],
        [8],
        [9],
    ]


def _groups_sharing_a_head() -> PackedBatch:
    """3 GRPO groups x 2 rows of 215 tokens: a 200-token head every prompt starts with, a
    10-token task of the group's own, then 5 model tokens differing from the first."""
    head = list(range(10, 210))
    ids, groups = [], []
    for g in range(3):
        for r in range(2):
            ids.append([*head, *[1000 + 10 * g + t for t in range(10)], *[2000 + 10 * r] * 5])
            groups.append(g)
    tokens = torch.tensor(ids)  # [6, 215]
    loss_mask = torch.zeros_like(tokens, dtype=torch.bool)
    loss_mask[:, 210:] = True
    nan = torch.full(tokens.shape, float("nan"))
    return PackedBatch(tokens, torch.ones_like(tokens), loss_mask, nan, torch.ones(tokens.shape),
                       torch.tensor(groups), torch.arange(6))  # fmt: skip


def test_micro_batches_sized_by_the_tokens_the_shared_prefix_pass_computes() -> None:
    """Each group caches 209 prompt tokens (the 210th starts the suffix: 6 tokens a row). One
    group: 209 + 2 x 6 = 221. Two: the 200-token head once ((2 - 1) x 200 > 128 saved),
    200 + 2 x 9 + 4 x 6 = 242; three: 200 + 3 x 9 + 6 x 6 = 263. Padded, each row is 215."""
    batch = _groups_sharing_a_head()
    assert shared_prefix_tokens(batch.input_ids, batch.attention_mask, [[0, 1]]) == 221
    assert shared_prefix_tokens(batch.input_ids, batch.attention_mask, [[0, 1], [2, 3]]) == 242

    def sized(budget: int, kv_slot_cost: float = 0.0) -> list[list[int]]:
        return micro_batches(batch, budget, by_group=True, shared_prefix=True,
                             kv_slot_cost=kv_slot_cost)  # fmt: skip

    assert sized(263) == [list(range(6))]
    assert sized(262) == [[0, 1, 2, 3], [4, 5]]
    assert sized(220) == [[0], [1], [2], [3], [4], [5]]
    assert micro_batches(batch, 430, by_group=True) == [[0, 1], [2, 3], [4, 5]]  # padded
    # each suffix row's copy of the 209-slot prefix KV: 6 x 209 x 0.1 -> 126 more tokens
    assert sized(263 + 125, kv_slot_cost=0.1) == [[0, 1, 2, 3], [4, 5]]
    assert sized(263 + 126, kv_slot_cost=0.1) == [list(range(6))]


def test_a_fork_is_sized_as_the_pass_groups_it() -> None:
    """Rows 2 and 3 fork rows 0 and 1 (their tokens, then 10 of their own, only those trained):
    the pass groups a row by what precedes its first target, so each fork runs alone at its
    full 225 tokens; with rows 0 and 1 (209 prefix + 2 x 6) that is 671 tokens, not the 273 of
    one GRPO group of 4 rows sharing 209."""
    batch = _groups_sharing_a_head().select([0, 1])
    forks = torch.cat([batch.input_ids, torch.arange(3000, 3020).view(2, 10)], dim=1)
    ids = torch.cat([F.pad(batch.input_ids, (0, 10)), forks])  # [4, 225]
    mask = torch.ones_like(ids)
    mask[:2, 215:] = 0
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[:2, 210:215] = True
    loss_mask[2:, 215:] = True
    nan = torch.full(ids.shape, float("nan"))
    forked = PackedBatch(ids, mask, loss_mask, nan, torch.ones(ids.shape), torch.zeros(4).long(),
                         torch.tensor([0, 1, 0, 1]))  # fmt: skip
    groups = prefix_groups(forked.input_ids, forked.loss_mask)
    assert groups == [[0, 1], [2], [3]]
    assert shared_prefix_tokens(forked.input_ids, forked.attention_mask, groups) == 671
    # too large alone, the group is split by padded rows x longest: 2 x 215, 2 x 225
    assert micro_batches(forked, 670, by_group=True, shared_prefix=True, kv_slot_cost=0) == [
        [0, 1], [2, 3]
    ]  # fmt: skip
    assert micro_batches(forked, 671, by_group=True, shared_prefix=True, kv_slot_cost=0) == [
        [0, 1, 2, 3]
    ]  # fmt: skip


def _forked_record(tokenizer: PreTrainedTokenizerBase) -> TrajectoryRecord:
    """Three turns under a generation prompt that opens reasoning: a branch per turn."""
    tok = with_template(tokenizer, THINKING_PROMPT)
    builder = TokenBuilder(tok, [Message(role="user", content="2+3?")])
    for k in range(3):
        ids = [*tok.encode(f"turn {k}", add_special_tokens=False), builder.turn_end.id]
        builder.add_model_turn(ids, [-0.25] * len(ids))
        if k < 2:
            builder.add_observations([Message(role="tool", content=f"obs {k}")])
    return builder_record(builder, advantage=0.5)


def test_pack_records_gives_every_branch_a_row_with_its_episodes_advantage(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    forked, plain = _forked_record(tokenizer), minimal_record("g7", advantage=-1.0)
    batch = pack_records([plain, forked], pad_id=2)
    assert batch.episode_index.tolist() == [0, 1, 1, 1]
    assert batch.advantages[:, 0].tolist() == [-1.0, 0.5, 0.5, 0.5]
    assert (batch.advantages == batch.advantages[:, :1]).all()  # no turn has its own
    assert batch.group_index.tolist() == [0, 0, 0, 0]  # one group: g7
    assert [len(r.token_ids) for r in forked.rows()] == batch.attention_mask[1:].sum(1).tolist()
    # each sampled token is a loss token in exactly one row
    assert int(batch.loss_mask[1:].sum()) == forked.lengths.model
    assert batch.loss_mask[1:].sum(1).tolist() == [4, 4, 4]  # "turn k" (3 ids) and its end
    assert episode_rows(batch) == [[0], [1, 2, 3]]


def test_token_versions_put_each_turns_version_on_its_tokens_in_its_own_branch(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    # a partial rollout's episode: its three turns sampled by versions 3, 4 and 4, each in a
    # branch of its own (the thinking prompt forks every turn); the plain record has none
    forked, plain = _forked_record(tokenizer), minimal_record("g7", policy_version=5)
    forked.policy_version = 3
    for turn, version in zip(forked.turns, [3, 4, 4], strict=True):
        turn.policy_version = version
    batch = pack_records([plain, forked], pad_id=2)
    versions = token_versions([plain, forked], batch.input_ids.shape[1])
    assert versions.shape == batch.input_ids.shape and versions[0].eq(5).all()
    for row, turn in zip(range(1, 4), forked.turns, strict=True):
        span = versions[row, turn.token_start : turn.token_end].tolist()
        assert turn.branch == row - 1 and span == [turn.policy_version] * 4
        # the other turns' tokens in this row (context) keep the record's version
        others = versions[row].clone()
        others[turn.token_start : turn.token_end] = 3
        assert others.eq(3).all()
