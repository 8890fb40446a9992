"""Chunked `token_logprobs` equals the full-logits reference, and never holds full logits;
shared-prefix logprobs (one backbone pass over a group's prompt) equal the plain computation."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaForCausalLM

import agent_grpo.models.logprobs as logprobs_module
from agent_grpo.models.logprobs import (
    common_prefix_length,
    length_buckets,
    micro_batch_logprobs,
    prefix_groups,
    reference_token_logprobs,
    shared_prefix_token_logprobs,
    token_logprobs,
)
from agent_grpo.testing.tiny_model import tiny_model_config

VOCAB = tiny_model_config().vocab_size


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_model_config()).eval()


def _padded_batch(lengths: list[int], total: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Random ids, right-padded to `total` with pad id 2 (SmolLM2's eos) and a matching mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(lengths), total), generator=generator)  # [B, T]
    mask = torch.arange(total)[None, :] < torch.tensor(lengths)[:, None]  # [B, T]
    return torch.where(mask, ids, 2), mask.long()


@pytest.mark.parametrize("chunk_size", [1, 7, 10, 64])
def test_chunked_equals_reference(model: LlamaForCausalLM, chunk_size: int) -> None:
    ids, mask = _padded_batch([13, 9, 4], 13)  # 12 + 8 + 3 = 23 real targets
    with torch.no_grad():
        expected = reference_token_logprobs(model, ids, mask, temperature=0.7)
        got = token_logprobs(model, ids, mask, temperature=0.7, chunk_size=chunk_size)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert got[:, 0].eq(0).all() and got[mask == 0].eq(0).all()
    assert got[:, 1:][mask[:, 1:].bool()].lt(0).all()  # real logprobs are negative


def test_temperature_divides_logits(model: LlamaForCausalLM) -> None:
    # Near-uniform tiny model: logprobs sit near -log(V) = -10.8, and a hotter temperature
    # flattens them further toward it; T=1 and T=0.5 must differ.
    ids, mask = _padded_batch([8], 8)
    with torch.no_grad():
        hot = token_logprobs(model, ids, mask, temperature=2.0)
        cold = token_logprobs(model, ids, mask, temperature=0.5)
    uniform = -torch.log(torch.tensor(float(VOCAB)))
    assert (hot[0, 1:] - uniform).abs().max() < (cold[0, 1:] - uniform).abs().max()


def test_padding_does_not_change_a_sequence(model: LlamaForCausalLM) -> None:
    ids, mask = _padded_batch([13, 6], 13)
    with torch.no_grad():
        batched = token_logprobs(model, ids, mask, chunk_size=5)
        alone = token_logprobs(model, ids[1:, :6], chunk_size=5)
    torch.testing.assert_close(batched[1, :6], alone[0], atol=1e-5, rtol=0)


def test_left_padding_does_not_change_a_sequence(model: LlamaForCausalLM) -> None:
    ids, mask = _padded_batch([6], 6)
    left_ids = torch.cat([torch.full((1, 4), 2), ids], 1)  # [1, 10]: 4 pads, then the sequence
    left_mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), mask], 1)  # [1, 10]
    with torch.no_grad():
        alone = token_logprobs(model, ids, mask)
        left = token_logprobs(model, left_ids, left_mask, chunk_size=3)
        expected = reference_token_logprobs(model, left_ids, left_mask)
    torch.testing.assert_close(left[:, 4:], alone, atol=1e-5, rtol=0)
    assert left[:, :5].eq(0).all()  # padding, then the first real token: no prefix, no logprob
    torch.testing.assert_close(left, expected, atol=1e-5, rtol=0)


def _grads(model: LlamaForCausalLM, loss: Tensor) -> list[Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize(
    ("dtype", "chunk_size", "atol"), [(torch.float32, 4, 1e-4), (torch.float64, 7, 1e-9)]
)
def test_gradients_equal_reference(
    model: LlamaForCausalLM, dtype: torch.dtype, chunk_size: int, atol: float, temperature: float
) -> None:
    # fp32 gradients reach ~9 here, so 1e-4 is float noise; fp64 pins the math itself.
    model = copy.deepcopy(model).double() if dtype == torch.float64 else model
    ids, mask = _padded_batch([11, 7], 11, seed=3)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(4), dtype=dtype)
    full = reference_token_logprobs(model, ids, mask, temperature=temperature)  # [B, T]
    chunked = token_logprobs(model, ids, mask, temperature=temperature, chunk_size=chunk_size)
    assert "_HeadLogprobsBackward" in _graph_nodes(chunked)  # the fused head's own backward
    assert chunked.dtype == dtype
    expected, got = _grads(model, (full * weights).sum()), _grads(model, (chunked * weights).sum())
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=atol, rtol=atol)


def _graph_nodes(out: Tensor) -> set[str]:
    """The names of the autograd nodes `out` depends on."""
    seen, todo, names = set(), [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_heads_the_fused_function_cannot_stand_in_for_are_checkpointed(model) -> None:
    """Under bf16 autocast (whose casts the head's module call makes) and for a head with a
    bias, each chunk runs the plain computation under `checkpoint`, with the same values."""
    ids, mask = _padded_batch([9, 6], 9, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = token_logprobs(model, ids, mask, chunk_size=4)
    assert "_HeadLogprobsBackward" not in _graph_nodes(out)
    biased = copy.deepcopy(model)
    head = biased.lm_head
    biased.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    with torch.no_grad():
        biased.lm_head.weight.copy_(head.weight)
        biased.lm_head.bias.zero_()
    out = token_logprobs(biased, ids, mask, chunk_size=4)
    assert "_HeadLogprobsBackward" not in _graph_nodes(out)
    torch.testing.assert_close(out, token_logprobs(model, ids, mask), atol=1e-5, rtol=0)


# --- memory ----------------------------------------------------------------------------------


class PeakLiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the mode and still alive at once.

    Each op's new output storages are tracked through weak references, so a storage counts
    from the op that made it until it is freed (including ones autograd saves for backward).
    Views and in-place results share an input's storage and are not counted twice.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor) and _key(t) not in inputs:
                storage = t.untyped_storage()
                self.live[_key(t)] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _key(t: Tensor) -> int:
    return StorageWeakRef(t.untyped_storage()).cdata


@contextmanager
def frozen_head(model: LlamaForCausalLM) -> Iterator[None]:
    """Freeze the tied embedding/head so its [V, H] gradient does not dominate the peak."""
    weight = model.get_output_embeddings().weight
    weight.requires_grad_(False)
    try:
        yield
    finally:
        weight.requires_grad_(True)


def _peak_forward_backward(fn: Callable[[], Tensor]) -> int:
    with PeakLiveBytes() as mode:
        fn().sum().backward()
    return mode.peak


@pytest.mark.slow
def test_chunked_peak_memory_is_far_below_full_logits(
    model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids, mask = _padded_batch([128, 128], 128, seed=5)
    full_logits_bytes = 2 * 128 * VOCAB * 4  # B * T * V fp32 = 50 MB; one chunk of 8 is 1.6 MB
    with frozen_head(model):
        reference = _peak_forward_backward(lambda: reference_token_logprobs(model, ids, mask))
        fused = _peak_forward_backward(lambda: token_logprobs(model, ids, mask, chunk_size=8))
        # a head `_HeadLogprobs` cannot stand in for: each chunk checkpointed
        monkeypatch.setattr(logprobs_module, "_fusable_head", lambda head, hidden: None)
        chunked = _peak_forward_backward(lambda: token_logprobs(model, ids, mask, chunk_size=8))
        # The same chunk loop without checkpointing keeps every chunk's logits for backward.
        monkeypatch.setattr(logprobs_module, "checkpoint", lambda f, *a, use_reentrant: f(*a))
        uncheckpointed = _peak_forward_backward(
            lambda: token_logprobs(model, ids, mask, chunk_size=8)
        )
    # The measurement sees full logits when they exist, so the bounds below can fail.
    assert reference > full_logits_bytes
    assert uncheckpointed > full_logits_bytes / 2
    # Measured: 8.8 MB checkpointed, about 4.4 chunks of logits (forward, softmax and grads) +
    # activations; 4.0 MB fused (one chunk of logits, made the gradient in place).
    assert chunked < full_logits_bytes / 4
    assert fused < full_logits_bytes / 4


# ---- Shared-prefix logprobs (one backbone pass over a group's prompt) equal the plain computation.


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


def groups_with_a_common_head(vocab: int, head: int, tails: list[int], suffixes: list[list[int]]):
    """Groups whose prompts are one `head` of random tokens then a tail of their own (`tails`,
    0: the head is the whole prompt), each row a random suffix of the given length: a micro-batch
    of several tasks of one environment (its system prompt and tools, then the task)."""
    g = torch.Generator().manual_seed(7)
    common = torch.randint(3, vocab, (head,), generator=g)
    rows, prompts = [], []
    for tail, lengths in zip(tails, suffixes, strict=True):
        prompt = torch.cat([common, torch.randint(3, vocab, (tail,), generator=g)])
        for n in lengths:
            rows.append(torch.cat([prompt, torch.randint(3, vocab, (n,), generator=g)]))
            prompts.append(len(prompt))
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=2) for r in rows])
    mask = torch.stack([(torch.arange(width) < len(r)).long() for r in rows])
    targets = mask.clone()
    for row, n in enumerate(prompts):
        targets[row, :n] = 0
    return ids, mask, targets


@pytest.mark.parametrize("score_prompts", [False, True])
@pytest.mark.parametrize(
    ("tails", "passes"),
    [
        ([5, 0, 12], [1, 3, 7]),  # the head once, the groups' tails, the suffixes
        ([0, 0, 0], [1, 7]),  # every prompt is the head: no pass for the tails
    ],
)
def test_the_groups_common_head_runs_once(sharp_model, tails, passes, score_prompts) -> None:
    """Three groups whose prompts start with the same 80 tokens: (3 - 1) x 79 > `PASS_TOKENS`
    tokens saved, so the head runs in a pass of one row and the groups' own tails on its KV;
    the values and every gradient are the plain path's, also when the prompts' tokens are
    scored (their logprobs then come from the head's and the tails' hidden states)."""
    assert (len(tails) - 1) * 79 > logprobs_module.PASS_TOKENS
    suffixes = [[4, 9], [6, 2, 3], [5, 7]]
    ids, mask, targets = groups_with_a_common_head(sharp_model.config.vocab_size, 80, tails,
                                                   suffixes)  # fmt: skip
    if score_prompts:
        targets = mask.clone()
        targets[:, 0] = 0  # the first token has no logprob
    plain = token_logprobs(sharp_model, ids, mask, target_mask=targets)
    plain.sum().backward()
    plain_grads = [p.grad.clone() for p in sharp_model.parameters()]
    sharp_model.zero_grad()
    seen, hook = backbone_batches(sharp_model)
    groups = [[0, 1], [2, 3, 4], [5, 6]]  # the GRPO groups, as the trainer's micro-batch has them
    shared = shared_prefix_token_logprobs(sharp_model, ids, mask, groups, target_mask=targets)
    hook.remove()
    assert seen == passes
    shared.sum().backward()
    assert torch.allclose(shared, plain, atol=2e-5)
    assert (shared[targets == 1] != 0).all()
    for got, want in zip((p.grad for p in sharp_model.parameters()), plain_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_a_short_common_head_runs_with_the_groups(sharp_model) -> None:
    """Two groups sharing 40 tokens save (2 - 1) x 40 <= `PASS_TOKENS`: one prefix pass."""
    ids, mask, targets = groups_with_a_common_head(sharp_model.config.vocab_size, 40, [3, 6],
                                                   [[4, 9], [2, 5]])  # fmt: skip
    seen, hook = backbone_batches(sharp_model)
    with torch.no_grad():
        shared = micro_batch_logprobs(sharp_model, ids, mask, targets, temperature=1.0,
                                      shared_prefix=True)  # fmt: skip
        hook.remove()
        plain = token_logprobs(sharp_model, ids, mask, target_mask=targets)
    assert seen == [2, 4]
    assert torch.allclose(shared, plain, atol=2e-5)


@pytest.mark.parametrize("case", ["several groups", "common head", "long and short suffixes"])
def test_shared_prefix_tokens_bounds_what_the_passes_compute(sharp_model, case) -> None:
    """`shared_prefix_tokens` (what the trainer sizes micro-batches by) is at least the tokens
    the backbone passes really take, padding included, and not far above them."""
    vocab = sharp_model.config.vocab_size
    if case == "several groups":
        ids, mask, targets = several_groups(vocab)
    elif case == "common head":
        ids, mask, targets = groups_with_a_common_head(vocab, 80, [5, 0, 12],
                                                       [[4, 9], [6, 2, 3], [5, 7]])  # fmt: skip
    else:
        ids, mask = group_batch(vocab, prefix=9, suffixes=[300, 2, 3, 280])
        targets = mask.clone()
        targets[:, :9] = 0
    groups = prefix_groups(ids, targets)
    computed: list[int] = []
    hook = sharp_model.get_decoder().register_forward_hook(
        lambda module, args, kwargs, out: computed.append(kwargs["input_ids"].numel()),
        with_kwargs=True,
    )
    with torch.no_grad():
        shared_prefix_token_logprobs(sharp_model, ids, mask, groups, target_mask=targets)
    hook.remove()
    bound = logprobs_module.shared_prefix_tokens(ids, mask, groups)
    assert sum(computed) <= bound <= 2 * sum(computed), (computed, bound)
