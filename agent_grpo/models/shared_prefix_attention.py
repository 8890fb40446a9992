"""Attention for a batch whose rows all start with one prefix, its keys and values held once.

A rollout's rows share a long prefix: the environment's system prompt and tool list, most of
every Calculator-v0 episode's tokens in the demo (docs/benchmarks.md, "The demo, profiled").
Held per row, that prefix's keys and values are most of what a decode step's attention reads,
and reading them is most of its attention's time. Here the batch's cache holds
only each row's own slots after the prefix, and attention is computed in two parts merged by
their softmax normalisers: every row's queries against the one copy of the prefix (all rows'
queries as one long sequence, so the prefix is read once), and each row's queries against its
own slots, under the row's mask. This is cascade attention (Juravsky et al., "Hydragen", 2024;
FlashInfer's cascade wrappers; vLLM's cascade attention), here on torch's CPU kernel.

Exactness: each part is torch's fused CPU attention kernel, which also returns the log of its
softmax normaliser; the two outputs are averaged with weights from those normalisers, which is
softmax attention over the concatenated keys up to rounding (~1e-7 in fp32). Every query sits
after the prefix, so the prefix needs no mask. CPU only: the kernel that returns the normaliser
is torch's CPU flash attention (`_scaled_dot_product_flash_attention_for_cpu`). Under CPU
autocast the inputs take autocast's dtype, as `sdpa`'s would; the two parts are merged in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SharedPrefix", "cascade_attention"]


@dataclass(frozen=True)
class SharedPrefix:
    """The keys and values of the prefix every row of a batch starts with, one copy per layer."""

    length: int
    """Tokens in the prefix: the rows' own cache slots start at this position."""
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    """Per layer (keys, values), each `[H_kv, P, D]`, rotary embedding applied as cached."""


def cascade_attention(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, K, D]: each row's own slots
    value: torch.Tensor,  # [B, H_kv, K, D]
    mask: torch.Tensor,  # [B, 1, Q, K] additive (0 / dtype min) over the rows' own slots
    prefix_key: torch.Tensor,  # [H_kv, P, D]
    prefix_value: torch.Tensor,  # [H_kv, P, D]
    scale: float,
) -> torch.Tensor:
    """Attention `[B, Q, H, D]` (transformers' layout) over `prefix + own slots` for every row.

    Query head `h` reads KV head `h // (H / H_kv)`, as transformers' `repeat_kv` groups them.
    """
    # The fused kernel takes one dtype; autocast, which would pick it for `sdpa`, does not
    # cover this private op, so pick it as autocast would.
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    query, key, value, mask, prefix_key, prefix_value = (
        t.to(dtype) for t in (query, key, value, mask, prefix_key, prefix_value)
    )
    batch, heads, q_len, dim = query.shape
    # The prefix: every row's queries as one sequence of B*Q queries against its one copy.
    rows_as_queries = query.transpose(0, 1).reshape(1, heads, batch * q_len, dim)  # [1,H,B*Q,D]
    shared, shared_lse = _flash(rows_as_queries, prefix_key[None], prefix_value[None], None, scale)
    shared = shared.view(heads, batch, q_len, dim).transpose(0, 1)  # [B, H, Q, D]
    shared_lse = shared_lse.view(heads, batch, q_len).transpose(0, 1)  # [B, H, Q]
    own, own_lse = _flash(query, key, value, mask, scale)  # [B, H, Q, D], [B, H, Q]
    top = torch.maximum(shared_lse, own_lse)  # [B, H, Q]
    shared_w = (shared_lse - top).exp_()[..., None]  # [B, H, Q, 1]
    own_w = (own_lse - top).exp_()[..., None]  # [B, H, Q, 1]
    out = (shared.float() * shared_w + own.float() * own_w) / (shared_w + own_w)  # [B, H, Q, D]
    return out.to(query.dtype).transpose(1, 2).contiguous()  # [B, Q, H, D]


def _flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention: output `[B, H, Q, D]` and its log-normaliser `[B, H, Q]`
    (fp32); grouped KV heads are read as they are."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=mask, scale=scale
    )
    return out, lse.float()
