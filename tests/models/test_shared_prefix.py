"""Shared-prefix logprobs (one backbone pass over a group's prompt) equal the plain computation."""

from __future__ import annotations

import pytest
import torch

from agent_grpo.models.logprobs import (
    common_prefix_length,
    length_buckets,
    micro_batch_logprobs,
    prefix_groups,
    shared_prefix_token_logprobs,
    token_logprobs,
)


def group_batch(vocab: int, prefix: int, suffixes: list[int], seed: int = 0):
    """Right-padded rows sharing `prefix` random tokens, then suffixes of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (prefix,), generator=g)
    width = prefix + max(suffixes)
    ids = torch.full((len(suffixes), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(suffixes):
        ids[row, :prefix] = shared
        ids[row, prefix : prefix + n] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, : prefix + n] = 1
    return ids, mask


@pytest.fixture
def sharp_model(tiny_model):
    """The tiny model with weights scaled up so its outputs depend strongly on context."""
    model, _ = tiny_model
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(8)
    return model


def test_common_prefix_length() -> None:
    ids = torch.tensor([[5, 6, 7, 8, 2], [5, 6, 9, 2, 2], [5, 6, 7, 2, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])
    assert common_prefix_length(ids, mask) == 2
    assert common_prefix_length(ids[[0, 2]], mask[[0, 2]]) == 3  # bounded by the shorter row


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_plain_path(sharp_model, temperature) -> None:
    ids, mask = group_batch(sharp_model.config.vocab_size, prefix=23, suffixes=[9, 4, 12, 1])
    targets = mask.clone()
    targets[:, :23] = 0  # score only the suffix (the model tokens), as the trainer does
    plain = token_logprobs(sharp_model, ids, mask, temperature=temperature, target_mask=targets)
    plain.sum().backward()
    plain_grads = [p.grad.clone() for p in sharp_model.parameters()]
    sharp_model.zero_grad()
    shared = shared_prefix_token_logprobs(
        sharp_model, ids, mask, [[0, 1, 2, 3]], temperature=temperature, target_mask=targets
    )
    shared.sum().backward()
    assert torch.allclose(shared, plain, atol=2e-5)
    assert (shared[:, :23] == 0).all() and (shared[mask == 0] == 0).all()
    assert shared[0, 23:32].abs().min() > 0  # the suffix really was scored
    for got, want in zip((p.grad for p in sharp_model.parameters()), plain_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_prefix_reaching_into_scored_tokens(sharp_model) -> None:
    ids, mask = group_batch(sharp_model.config.vocab_size, prefix=10, suffixes=[5, 5])
    with torch.no_grad():
        plain = token_logprobs(sharp_model, ids, mask)
        shared = shared_prefix_token_logprobs(sharp_model, ids, mask, [[0, 1]])
    assert torch.allclose(shared, plain, atol=2e-5)  # prefix targets come from the one pass


def several_groups(vocab: int):
    """Groups with prompts of different lengths (7, 23, 15) and a group of one, interleaved,
    right-padded to one width: what a packed micro-batch of a GRPO step looks like."""
    shapes = [(7, [5, 9]), (23, [3, 12, 1]), (15, [6]), (15, [4, 4])]
    parts = [group_batch(vocab, p, s, seed=k) for k, (p, s) in enumerate(shapes)]
    width = max(ids.shape[1] for ids, _ in parts)
    ids = torch.cat(
        [torch.nn.functional.pad(i, (0, width - i.shape[1]), value=2) for i, _ in parts]
    )
    mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for _, m in parts])
    prompts = [7, 7, 23, 23, 23, 15, 15, 15]
    order = [2, 0, 5, 3, 1, 6, 7, 4]  # members of a group need not be adjacent
    targets = mask.clone()
    for row, n in enumerate(prompts):
        targets[row, :n] = 0
    return ids[order], mask[order], targets[order]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_several_groups_in_one_pass_equal_the_plain_path(sharp_model, temperature) -> None:
    ids, mask, targets = several_groups(sharp_model.config.vocab_size)
    groups = prefix_groups(ids, targets)
    assert sorted(map(sorted, groups)) == [[0, 3, 7], [1, 4], [2], [5, 6]]
    plain = token_logprobs(sharp_model, ids, mask, temperature=temperature, target_mask=targets)
    plain.sum().backward()
    plain_grads = [p.grad.clone() for p in sharp_model.parameters()]
    sharp_model.zero_grad()
    shared = micro_batch_logprobs(sharp_model, ids, mask, targets, temperature=temperature,
                                  shared_prefix=True)  # fmt: skip
    shared.sum().backward()
    assert torch.allclose(shared, plain, atol=2e-5)
    assert (shared[targets == 0] == 0).all()
    assert (shared[targets == 1] != 0).all()  # every model token really was scored
    for got, want in zip((p.grad for p in sharp_model.parameters()), plain_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def backbone_batches(model) -> tuple[list[int], object]:
    """Record the batch size of every backbone pass (the hook handle removes it)."""
    seen: list[int] = []
    hook = model.get_decoder().register_forward_hook(
        lambda module, args, kwargs, out: seen.append(kwargs["input_ids"].shape[0]),
        with_kwargs=True,
    )
    return seen, hook


def test_any_grouping_gives_the_same_logprobs(sharp_model) -> None:
    """Grouping decides who shares a pass, never the values: a group's prefix is what its rows
    really share, even when the grouping is wrong (rows of different prompts together, rows
    sharing one or two tokens), and rows with nothing to share run apart."""
    ids, mask, targets = several_groups(sharp_model.config.vocab_size)
    ids[6, :2] = ids[2, :2]  # rows 2 and 6 (different prompts) now share exactly two tokens
    targets[7] = 0  # a row with nothing to score
    groupings = {
        "by prompt, a row alone": prefix_groups(ids, targets),
        "different prompts in one group": [[0, 3, 7], [1, 2], [4], [5, 6]],
        "sharing two tokens": [[0, 3], [2, 6], [1, 4, 5, 7]],
        "one group": [list(range(8))],
        "all alone": [[r] for r in range(8)],
    }
    with torch.no_grad():
        plain = token_logprobs(sharp_model, ids, mask, target_mask=targets)
        for name, groups in groupings.items():
            shared = shared_prefix_token_logprobs(sharp_model, ids, mask, groups,
                                                  target_mask=targets)  # fmt: skip
            assert torch.allclose(shared, plain, atol=2e-5), name
            assert (shared[7] == 0).all(), name
    # row 6 no longer has row 5's prompt; row 7, with no target, has an empty one
    assert groupings["by prompt, a row alone"] == [[0, 3], [1, 4], [2], [5], [6], [7]]


def test_rows_without_a_prefix_run_apart(sharp_model) -> None:
    """The shared passes hold only rows that share a prefix (three groups: a prefix pass of 3
    rows, a suffix pass of 7); the row alone runs its own plain pass of 1."""
    ids, mask, targets = several_groups(sharp_model.config.vocab_size)
    seen, hook = backbone_batches(sharp_model)
    with torch.no_grad():
        shared_prefix_token_logprobs(sharp_model, ids, mask, [[0, 3, 7], [1, 4], [2], [5, 6]],
                                     target_mask=targets)  # fmt: skip
    hook.remove()
    assert seen == [3, 7, 1]


def test_length_buckets_split_where_padding_costs_more_than_a_pass() -> None:
    lengths = [5, 300, 6, 290, 7]
    # one pass: 5 rows x 300 + 128 = 1628; short and long apart: 3 x 7 + 2 x 300 + 2 x 128 = 877;
    # the long two apart as well: 21 + 290 + 300 + 3 x 128 = 995
    assert length_buckets(lengths, pass_tokens=128) == [[0, 2, 4], [3, 1]]
    assert length_buckets(lengths, pass_tokens=10**6) == [[0, 2, 4, 3, 1]]
    assert length_buckets(lengths, pass_tokens=0) == [[0], [2], [4], [3], [1]]
    assert length_buckets([], pass_tokens=128) == []


def test_suffixes_of_very_different_lengths_run_in_separate_passes(sharp_model) -> None:
    """Two long answers and two short ones: one prefix pass, then the short suffixes and the
    long ones in passes of their own, with the plain path's values and gradients."""
    ids, mask = group_batch(sharp_model.config.vocab_size, prefix=9, suffixes=[300, 2, 3, 280])
    targets = mask.clone()
    targets[:, :9] = 0
    plain = token_logprobs(sharp_model, ids, mask, target_mask=targets)
    plain.sum().backward()
    plain_grads = [p.grad.clone() for p in sharp_model.parameters()]
    sharp_model.zero_grad()
    seen, hook = backbone_batches(sharp_model)
    shared = shared_prefix_token_logprobs(sharp_model, ids, mask, [[0, 1, 2, 3]],
                                          target_mask=targets)  # fmt: skip
    hook.remove()
    assert seen == [1, 2, 2]  # the prefix, the short rows, the long rows
    shared.sum().backward()
    assert torch.allclose(shared, plain, atol=2e-5)
    assert (shared[targets == 1] != 0).all()
    for got, want in zip((p.grad for p in sharp_model.parameters()), plain_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
