"""Per-token logprobs of a causal LM, without ever holding a `[B, T, V]` fp32 logits tensor.

A 49k-152k vocabulary makes the full fp32 logits of a training batch the largest tensor in the
step (B=16, T=4096, V=152k is 40 GB), twice over once autograd saves it for `log_softmax`. So
`token_logprobs` runs the backbone once, then applies the output head to `chunk_size` tokens at a
time and keeps only each token's `logit[target] - logsumexp(logits)`. The backward recomputes one
chunk's logits at a time instead of keeping every chunk's alive: for a plain linear head in
`_HeadLogprobs`, which turns them in place into the chunk's gradient; for any other head (a bias,
autocast, an adapter) by running the chunk under `torch.utils.checkpoint`. Padding targets
are skipped, not computed and thrown away.

Alignment: `out[:, t]` is `log p(input_ids[:, t] | input_ids[:, :t])`. Position 0 (and, in a
left-padded row, the first real token) has no prefix and padding has no meaning: all are 0 in the
output, and callers mask them (only model tokens are trained on). This is the layout of
`TrajectoryRecord.token_ids` and its logprob arrays.

Where we depart from common practice: TRL materialises the full logits and then loops over rows
for the log-softmax; verl can use fused Triton kernels. We stay in plain PyTorch (an autograd
function of a few matmuls and in-place ops) and accept a Python loop over chunks (and one
recomputation of the head in the backward). Models that
post-process logits beyond the output head (Gemma's soft-capping, Cohere's logit scale) are refused
rather than silently mis-scored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

__all__ = [
    "common_head",
    "common_prefix_length",
    "kv_slot_cost",
    "length_buckets",
    "micro_batch_logprobs",
    "position_ids_from_mask",
    "prefix_groups",
    "prefix_sharing_supported",
    "reference_token_logprobs",
    "shared_prefix_token_logprobs",
    "shared_prefix_tokens",
    "token_logprobs",
]

DEFAULT_CHUNK_SIZE = 1024
"""Tokens per head chunk: 1024 x 49152 fp32 logits is 200 MB, x 152k (Qwen) is 620 MB."""


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions 0, 1, ... counted over real tokens only (right or left padding); 0 on padding."""
    positions = attention_mask.long().cumsum(-1) - 1  # [B, T]
    return torch.where(attention_mask.bool(), positions, 0)  # [B, T]


def _has_prefix(attention_mask: Tensor) -> Tensor:
    """`[B, T-1]`: token t+1 is real and so is the position t that predicts it.

    Excludes padding, and with left padding the first real token (its predictor is padding).
    """
    mask = attention_mask.bool()  # [B, T]
    return mask[:, 1:] & mask[:, :-1]  # [B, T-1]


def _check_plain_head(model: nn.Module) -> None:
    """Refuse models whose logits are not simply `lm_head(hidden)`."""
    config = getattr(model, "config", None)
    for name in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, name, None) not in (None, 1.0):
            raise NotImplementedError(f"token_logprobs does not support {name} models")


def _upcast(logits: Tensor) -> Tensor:
    """At least fp32 (bf16 logsumexp over a large vocabulary is too coarse); fp64 stays fp64."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _chunk_logprobs(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """`log_softmax(head(hidden) / temperature)` at `targets`, for one chunk of tokens."""
    logits = _upcast(head(hidden))  # [N, V]
    if temperature != 1.0:  # x / 1 == x exactly: skip a vocabulary-wide copy and its backward
        logits = logits / temperature
    picked = logits.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    return picked - torch.logsumexp(logits, dim=-1)  # [N]


class _HeadLogprobs(torch.autograd.Function):
    """`log_softmax(hidden @ weight.T / temperature)` at `targets`, for one chunk of tokens,
    keeping only the chunk's hidden states and log-normalisers for the backward.

    The backward recomputes the logits once and turns them in place into the gradient
    `g * (onehot(target) - softmax) / temperature`: the four matmuls of checkpointing the plain
    computation, without its second forward's log-sum-exp, the one-hot gradient scattered into a
    fresh vocabulary-sized zero tensor and the sum of the two (each a pass over `[N, V]`).
    """

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float
    ) -> Tensor:
        logits = _upcast(F.linear(hidden, weight))  # [N, V]
        if temperature != 1.0:
            logits.div_(temperature)
        normaliser = torch.logsumexp(logits, dim=-1)  # [N]
        ctx.save_for_backward(hidden, weight, targets, normaliser)
        ctx.temperature = temperature
        return logits.gather(-1, targets[:, None]).squeeze(-1) - normaliser  # [N]

    @staticmethod
    @once_differentiable  # the in-place ops below build no graph of their own
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor | None, None, None]:
        hidden, weight, targets, normaliser = ctx.saved_tensors
        temperature: float = ctx.temperature
        logits = _upcast(F.linear(hidden, weight))  # [N, V]
        if temperature != 1.0:
            logits.div_(temperature)
        coeff = logits.sub_(normaliser[:, None]).exp_().mul_(-grad[:, None])  # -g * softmax
        coeff.scatter_add_(1, targets[:, None], grad[:, None])  # + g at the target
        if temperature != 1.0:
            coeff.div_(temperature)
        coeff = coeff.to(weight.dtype)  # [N, V]
        grad_weight = coeff.T @ hidden if ctx.needs_input_grad[1] else None  # [V, H]
        return coeff @ weight, grad_weight, None, None  # [N, H]


def _fusable_head(head: nn.Module, hidden: Tensor) -> Tensor | None:
    """The weight of a head `_HeadLogprobs` can stand in for: a plain bias-free `nn.Linear` (not
    an adapter's wrapper) whose weight is an ordinary parameter in the hidden states' dtype,
    outside autocast (whose casts the module call makes); else None. Under FSDP2 the root's
    forward has gathered the head's weight into an ordinary parameter by now, and its gradient
    reaches that parameter as through the module call."""
    weight = getattr(head, "weight", None)
    plain = (
        type(head) is nn.Linear
        and head.bias is None
        and type(weight) is nn.Parameter
        and weight.dtype == hidden.dtype
        and not torch.is_autocast_enabled(hidden.device.type)
    )
    return weight if plain else None


def _hidden_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Final hidden states of the backbone (after its last norm), `[B, T, H]`."""
    backbone = cast(nn.Module, model.get_decoder())  # type: ignore[operator]
    out = backbone(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return cast(Tensor, out.last_hidden_state)


def _head_logprobs(
    model: nn.Module,
    hidden: Tensor,
    input_ids: Tensor,
    valid: Tensor,
    temperature: float,
    chunk_size: int,
) -> Tensor:
    """Apply the output head chunk by chunk where `valid` [B, T-1] says a target is wanted."""
    batch, length = input_ids.shape
    index = valid.reshape(-1).nonzero().squeeze(-1)  # [N]
    flat_hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])[index]  # [N, H]
    targets = input_ids[:, 1:].reshape(-1)[index]  # [N]
    head = cast(nn.Module, model.get_output_embeddings())  # type: ignore[operator]
    use_checkpoint = torch.is_grad_enabled() and flat_hidden.requires_grad
    weight = _fusable_head(head, flat_hidden) if use_checkpoint else None
    pieces = []
    for start in range(0, targets.numel(), chunk_size):
        h, y = flat_hidden[start : start + chunk_size], targets[start : start + chunk_size]
        if weight is not None:
            piece = _HeadLogprobs.apply(h, weight, y, temperature)
        elif use_checkpoint:
            piece = checkpoint(_chunk_logprobs, head, h, y, temperature, use_reentrant=False)
        else:
            piece = _chunk_logprobs(head, h, y, temperature)
        pieces.append(cast(Tensor, piece))  # [n]
    values = torch.cat(pieces) if pieces else _upcast(hidden.new_zeros(0))  # [N]
    flat = values.new_zeros(batch * (length - 1)).index_copy(0, index, values)  # [B*(T-1)]
    first = values.new_zeros(batch, 1)  # [B, 1]
    return torch.cat([first, flat.view(batch, length - 1)], dim=1)  # [B, T]


def _wanted(attention_mask: Tensor, target_mask: Tensor | None) -> Tensor:
    """`[B, T-1]` targets to score: real, with a real predictor, and in `target_mask` if given."""
    valid = _has_prefix(attention_mask)  # [B, T-1]
    return valid if target_mask is None else valid & target_mask[:, 1:].bool()


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    target_mask: Tensor | None = None,
) -> Tensor:
    """Logprob of each token given its prefix, `[B, T]`, computed `chunk_size` tokens at a time.

    At least fp32 (fp64 models give fp64). `out[:, 0]`, the first real token of a left-padded
    row, and padded positions are 0. With `target_mask` [B, T], only those tokens are scored
    (the rest are 0): the trainer passes the loss mask, so the output head never runs on prompt
    or tool tokens.
    Differentiable when grad is enabled (each chunk's logits recomputed in the backward); under
    `torch.no_grad()` it simply loops over chunks.
    """
    _check_plain_head(model)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    hidden = _hidden_states(model, input_ids, attention_mask)  # [B, T, H]
    wanted = _wanted(attention_mask, target_mask)  # [B, T-1]
    return _head_logprobs(model, hidden, input_ids, wanted, temperature, chunk_size)


def shared_prefix_token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    groups: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    target_mask: Tensor | None = None,
) -> Tensor:
    """`token_logprobs` for right-padded rows whose `groups` (row indices) share prefixes.

    The G samples of a GRPO group share the whole prompt (often most of the sequence), so the
    backbone runs once over each group's common prefix, all groups in one pass, and every row's
    suffix attends to its group's cached keys and values in a second pass; gradients flow back
    through the cache into the prefix pass. Same result as `token_logprobs` on the full rows,
    for about `sum(prefix) + sum(suffix)` tokens of work instead of `G * (prefix + suffix)` per
    group, in two passes whatever the number of groups (the matmuls get the rows of all of them).
    The groups' prompts usually start alike too (one environment's system prompt and tools):
    that common head runs once, in a pass of its own before the groups' prefixes
    (`_prefix_pass`).

    Rows with no prefix to share (a group of one, or whose rows share at most one token) run
    apart through `token_logprobs`: in the suffix pass they would widen every row to their whole
    length. Models with sliding-window layers run the plain path: right-padded prefixes would
    put padding inside a shorter group's window.
    """
    _check_plain_head(model)
    cached = _cached_lengths(input_ids, attention_mask, groups)
    shared = [(list(g), n) for g, n in zip(groups, cached, strict=True) if n >= 1]
    if not prefix_sharing_supported(model):
        shared = []
    shared_rows = [r for g, _ in shared for r in g]
    alone = sorted(set(range(input_ids.shape[0])) - set(shared_rows))
    parts = []
    if shared:
        local = {r: i for i, r in enumerate(shared_rows)}
        ids, mask, targets = _rows(input_ids, attention_mask, target_mask, shared_rows)
        parts.append(_grouped_prefix_logprobs(
            model, ids, mask, [[local[r] for r in g] for g, _ in shared], [n for _, n in shared],
            temperature, chunk_size, targets))  # fmt: skip
    if alone:
        ids, mask, targets = _rows(input_ids, attention_mask, target_mask, alone)
        parts.append(token_logprobs(model, ids, mask, temperature=temperature,
                                    chunk_size=chunk_size, target_mask=targets))  # fmt: skip
    length = input_ids.shape[1]
    out = torch.cat([F.pad(part, (0, length - part.shape[1])) for part in parts])  # [B, T]
    order = torch.tensor(shared_rows + alone, device=input_ids.device)
    return out.index_select(0, torch.argsort(order))  # back to the rows' own order


def _rows(
    input_ids: Tensor, attention_mask: Tensor, target_mask: Tensor | None, rows: list[int]
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The `rows` of a right-padded batch, cut to the longest of them."""
    index = torch.tensor(rows, device=input_ids.device)
    width = int(attention_mask.index_select(0, index).sum(dim=1).max())

    def cut(x: Tensor) -> Tensor:
        return x.index_select(0, index)[:, :width]

    return cut(input_ids), cut(attention_mask), None if target_mask is None else cut(target_mask)


def _cached_lengths(
    input_ids: Tensor, attention_mask: Tensor, groups: Sequence[Sequence[int]]
) -> list[int]:
    """Each group's prefix that the shared pass caches: its rows' common prefix but the last
    token (whose state predicts the next token, so it starts the suffix); 0 for one row."""
    return [max(0, common_prefix_length(input_ids[list(g)], attention_mask[list(g)]) - 1)
            if len(g) > 1 else 0 for g in groups]  # fmt: skip


def common_head(heads: Tensor, cached: list[int]) -> int:
    """The tokens every group's cached prefix starts with (`heads` [C, T], a row of each
    group), when running them once rather than C times saves more than a pass costs; else 0."""
    shortest = heads[:, : min(cached)]  # [C, n]
    head = common_prefix_length(shortest, torch.ones_like(shortest))
    return head if (len(cached) - 1) * head > PASS_TOKENS else 0


def shared_prefix_tokens(
    input_ids: Tensor,
    attention_mask: Tensor,
    groups: Sequence[Sequence[int]],
    kv_slot_cost: float = 0.0,
) -> int:
    """Tokens `shared_prefix_token_logprobs` computes for these right-padded rows, grouped as it
    groups them (`prefix_groups`), padding included, at most: what a micro-batch's activations
    grow with. Its suffix passes count as one (`length_buckets` splits them only where that pads
    less); the rows that run apart as rows x their longest. Each suffix row also holds a copy of
    its group's prefix keys and values, `kv_slot_cost` tokens' worth a slot (`kv_slot_cost`)."""
    cached = _cached_lengths(input_ids, attention_mask, groups)
    lengths = attention_mask.sum(dim=1).tolist()  # [B]
    alone = [lengths[r] for g, n in zip(groups, cached, strict=True) if n < 1 for r in g]
    shared = [(list(g), n) for g, n in zip(groups, cached, strict=True) if n >= 1]
    total = len(alone) * max(alone, default=0)
    if shared:
        prefixes = [n for _, n in shared]
        head = common_head(input_ids[[g[0] for g, _ in shared]], prefixes)
        total += head + len(prefixes) * (max(prefixes) - head)
        suffixes = [lengths[r] - n for g, n in shared for r in g]
        total += len(suffixes) * max(suffixes)
        total += math.ceil(len(suffixes) * max(prefixes) * kv_slot_cost)
    return total


def kv_slot_cost(model: nn.Module) -> float:
    """What one slot of a suffix row's copy of its prefix KV costs, in computed tokens: a layer
    holds its keys and values twice (gathered per row, then concatenated with the row's own),
    4 x KV heads x head size, where a computed token saves about 20 hidden sizes of activations
    (SmolLM2: 11.5k floats a layer at hidden 576); so 1/5 x KV heads / attention heads (1/15 for
    SmolLM2's 3 of 9), 1/5 where the config does not say."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads <= 0:
        return 0.2
    kv_heads = getattr(config, "num_key_value_heads", None)
    return 0.2 * (kv_heads if isinstance(kv_heads, int) and kv_heads > 0 else heads) / heads


def prefix_sharing_supported(model: nn.Module) -> bool:
    """Whether every attention layer sees the whole sequence (no sliding window), which the
    shared-prefix pass needs."""
    config = getattr(model, "config", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return all(kind == "full_attention" for kind in layer_types)
    window = getattr(config, "sliding_window", None)
    return not (window and getattr(config, "use_sliding_window", True))


def _grouped_prefix_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    groups: list[list[int]],
    cached: list[int],
    temperature: float,
    chunk_size: int,
    target_mask: Tensor | None = None,
) -> Tensor:
    """`shared_prefix_token_logprobs` when every group has `cached[c] >= 1` prefix tokens; rows
    whose suffixes differ much in length run their suffixes in separate passes
    (`length_buckets`), so short rows are not padded to the longest."""
    rows = input_ids.shape[0]
    device = input_ids.device
    start = torch.zeros(rows, dtype=torch.long)  # [B]: where each row's suffix starts
    source = torch.zeros(rows, dtype=torch.long)  # [B]: its group's row in the prefix pass
    for c, members in enumerate(groups):
        for r in members:
            start[r], source[r] = cached[c], c
    start, source = start.to(device), source.to(device)
    first_rows = torch.tensor([g[0] for g in groups], device=device)
    backbone = cast(nn.Module, model.get_decoder())  # type: ignore[operator]
    prefix = _prefix_pass(backbone, input_ids.index_select(0, first_rows), cached)
    suffix_lengths = attention_mask.sum(dim=1) - start  # [B]
    passes = length_buckets(suffix_lengths.tolist())
    pieces = [
        _suffix_hidden(backbone, prefix, input_ids, start, source, suffix_lengths, pass_rows)
        for pass_rows in passes
    ]  # each [b, T, H]
    order = torch.tensor([r for pass_rows in passes for r in pass_rows], device=device)
    hidden = torch.cat(pieces).index_select(0, torch.argsort(order))  # [B, T, H], rows in order
    wanted = _wanted(attention_mask, target_mask)  # [B, T-1]
    return _head_logprobs(model, hidden, input_ids, wanted, temperature, chunk_size)


@dataclass
class _Prefixes:
    """Each group's prefix as the suffix passes read it: slot = position, padding after."""

    hidden: Tensor  # [C, P, H] final hidden states
    layers: list[tuple[Tensor, Tensor]]  # per layer (keys, values), each [C, heads, P, d]


def _prefix_pass(backbone: nn.Module, heads: Tensor, cached: list[int]) -> _Prefixes:
    """The backbone over each group's prefix (`heads[c, :cached[c]]`, `heads` [C, T]).

    The groups' common head (the system prompt and tool list every task of an environment
    shares) runs once when that saves more than a pass costs (`PASS_TOKENS`), and each group's
    rest runs on top of its KV: a micro-batch of C groups then computes that head once, not C
    times. Gradients flow back into the head pass through both its hidden states and its KV.
    """
    count, width = len(cached), max(cached)  # C, P
    device = heads.device
    slots = torch.arange(width, device=device)  # [P]
    valid = slots[None] < torch.tensor(cached, device=device)[:, None]  # [C, P], right-padded
    root = common_head(heads, cached)  # R
    if root == 0:
        out = backbone(input_ids=heads[:, :width], attention_mask=valid.long(), use_cache=True)
        layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return _Prefixes(out.last_hidden_state, layers)
    shared = backbone(input_ids=heads[:1, :root], use_cache=True)  # over [1, R] tokens
    layers = [(layer.keys.expand(count, -1, -1, -1), layer.values.expand(count, -1, -1, -1))
              for layer in shared.past_key_values.layers]  # fmt: skip
    hidden = shared.last_hidden_state.expand(count, -1, -1)  # [C, R, H]
    if root == width:  # every group's prefix is the common head
        return _Prefixes(hidden, layers)
    rest = backbone(
        input_ids=heads[:, root:width],  # [C, P - R]
        attention_mask=valid.long(),  # [C, P]: the head's R slots, then each group's own
        position_ids=torch.where(valid[:, root:], slots[root:], 0),  # [C, P - R]
        past_key_values=DynamicCache(ddp_cache_data=layers),
        use_cache=True,
    )
    layers = [(layer.keys, layer.values) for layer in rest.past_key_values.layers]
    # each [C, heads, P, d]
    return _Prefixes(torch.cat([hidden, rest.last_hidden_state], dim=1), layers)


def _suffix_hidden(
    backbone: nn.Module,
    prefix: _Prefixes,
    input_ids: Tensor,
    start: Tensor,
    source: Tensor,
    suffix_lengths: Tensor,
    rows: list[int],
) -> Tensor:
    """One suffix pass over `rows`, each on its group's prefix KV; their hidden states `[b, T,
    H]` laid out as the rows' own tokens (prefix slots from the prefix pass)."""
    device = input_ids.device
    index = torch.tensor(rows, device=device)
    start, source = start.index_select(0, index), source.index_select(0, index)  # [b]
    length = input_ids.shape[1]
    width = prefix.hidden.shape[1]  # P
    # each row's group's prefix KV; index_select's backward is index_add into the prefix pass
    cache = DynamicCache(ddp_cache_data=[
        (keys.index_select(0, source), values.index_select(0, source))
        for keys, values in prefix.layers
    ])  # fmt: skip
    suffix_width = int(suffix_lengths.index_select(0, index).max())  # S
    steps = torch.arange(suffix_width, device=device)  # [S]
    suffix_slots = (start[:, None] + steps[None]).clamp(max=length - 1)  # [b, S]
    suffix_valid = steps[None] < suffix_lengths.index_select(0, index)[:, None]  # [b, S]
    prefix_valid = torch.arange(width, device=device)[None] < start[:, None]  # [b, P]
    suffix = backbone(
        input_ids=input_ids.index_select(0, index).gather(1, suffix_slots),  # [b, S]
        attention_mask=torch.cat([prefix_valid, suffix_valid], dim=1).long(),  # [b, P + S]
        position_ids=torch.where(suffix_valid, start[:, None] + steps[None], 0),  # [b, S]
        past_key_values=cache,
        use_cache=True,
    )
    both = torch.cat([prefix.hidden.index_select(0, source), suffix.last_hidden_state], 1)
    # [b, P + S, H]
    positions = torch.arange(length, device=device)[None]  # [1, T]
    take = torch.where(positions < start[:, None], positions, width + positions - start[:, None])
    take = take.clamp(max=both.shape[1] - 1)  # [b, T]: padding reads any slot, never scored
    return both.gather(1, take[..., None].expand(-1, -1, both.shape[-1]))  # [b, T, H]


PASS_TOKENS = 128
"""What one more suffix pass costs, in padded tokens' worth of work (its dispatch, and the lower
efficiency of smaller matmuls): rows run in another pass when that saves more padding than this.
Chosen from the update timings in docs/benchmarks.md ("Suffix passes by length")."""


def length_buckets(lengths: Sequence[int], pass_tokens: int = PASS_TOKENS) -> list[list[int]]:
    """Rows (indices into `lengths`) in passes of similar length: of the splits of the rows
    sorted by length, the one with the fewest padded tokens (a pass's rows x its longest)
    plus `pass_tokens` a pass."""
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    best = [0] + [math.inf] * len(order)  # best[k]: cost of the k shortest rows
    cut = [0] * (len(order) + 1)  # cut[k]: where the last pass of that best split starts
    for end in range(1, len(order) + 1):
        for first in range(end):
            cost = best[first] + (end - first) * lengths[order[end - 1]] + pass_tokens
            if cost < best[end]:
                best[end], cut[end] = cost, first
    passes, end = [], len(order)
    while end > 0:
        passes.append(order[cut[end] : end])
        end = cut[end]
    return passes[::-1]


def prefix_groups(input_ids: Tensor, target_mask: Tensor) -> list[list[int]]:
    """Rows with the same prompt (every token before their first target), in order of first row.

    Only who shares a prefix pass depends on this; each group's prefix is then its rows' actual
    common prefix (`common_prefix_length`), so any grouping gives the same logprobs.
    """
    first = target_mask.bool().int().argmax(dim=1).tolist()  # [B]: 0 where nothing is scored
    out: dict[tuple[int, ...], list[int]] = {}
    for row, stop in enumerate(first):
        out.setdefault(tuple(input_ids[row, :stop].tolist()), []).append(row)
    return list(out.values())


def common_prefix_length(input_ids: Tensor, attention_mask: Tensor) -> int:
    """Length of the token prefix every (right-padded) row shares."""
    lengths = attention_mask.sum(dim=1)  # [G]
    same = (input_ids == input_ids[:1]).all(dim=0)  # [T]
    limit = int(lengths.min())
    differs = (~same[:limit]).nonzero()
    return int(differs[0]) if differs.numel() else limit


def micro_batch_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    target_mask: Tensor,
    *,
    temperature: float,
    shared_prefix: bool,
) -> Tensor:
    """The trainer's logprobs `[b, t]` of the `target_mask` tokens (0 elsewhere); with
    `shared_prefix`, the rows' common prefix runs once (`shared_prefix_token_logprobs`)."""
    if not shared_prefix:
        return token_logprobs(
            model, input_ids, attention_mask, temperature=temperature, target_mask=target_mask
        )
    groups = prefix_groups(input_ids, target_mask)
    return shared_prefix_token_logprobs(
        model, input_ids, attention_mask, groups, temperature=temperature, target_mask=target_mask
    )


def reference_token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> Tensor:
    """The plain full-logits computation of `token_logprobs` (the test reference; O(B*T*V))."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    logits = _upcast(out.logits[:, :-1]) / temperature  # [B, T-1, V]
    logprobs = F.log_softmax(logits, dim=-1)  # [B, T-1, V]
    picked = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    picked = torch.where(_has_prefix(attention_mask), picked, 0.0)  # [B, T-1]
    return F.pad(picked, (1, 0))  # [B, T]
