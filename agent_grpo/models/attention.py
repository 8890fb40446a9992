"""Grouped-query attention with a mask, without copying the keys and values (on CPU).

transformers' `sdpa` attention repeats every KV head to its query heads (`repeat_kv`: a copy of
the layer's whole keys and values, on every call) whenever a mask is passed, because the fused
CUDA kernels take grouped heads only without one. torch's CPU kernel takes grouped heads with a
mask (`enable_gqa`), and our decode loop and our update always pass masks (padding, the shared
prefix). `sdpa_gqa`, registered with transformers' `AttentionInterface`, is its `sdpa` with that
one change: masked calls on CPU go to `scaled_dot_product_attention(..., enable_gqa=True)`, and
every other call (no mask, another device, a position bias, a paged cache) to `sdpa` itself.
A call given a `shared_prefix` (the `hf` backend passes one through the model's keyword
arguments) attends over that prefix's one copy and each row's own slots
(`shared_prefix_attention.py`).

Skipping the copy makes an `hf` rollout faster with the same tokens (docs/benchmarks.md,
"Grouped-query attention without the KV copy"). The values are `sdpa`'s up to the kernel's
reduction order.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from agent_grpo.models.shared_prefix_attention import SharedPrefix, cascade_attention

__all__ = ["ATTENTION", "sdpa_gqa_forward", "use_grouped_sdpa"]

ATTENTION = "sdpa_gqa"
"""The attention implementation our models load with (`models.load_model`)."""


def sdpa_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, K, D]
    value: torch.Tensor,  # [B, H_kv, K, D]
    attention_mask: torch.Tensor | None,  # [B, 1, Q, K] (bool, or additive float)
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa`, with a masked grouped-query call on CPU left grouped; with a
    `shared_prefix` (the `hf` backend's decoding), attention over it and the rows' own slots."""
    prefix: SharedPrefix | None = kwargs.get("shared_prefix")
    if prefix is not None:
        assert attention_mask is not None, "the rows' own slots need their mask"
        # decoding only: no dropout, and no model whose attention takes more than q, k, v, mask
        assert (
            dropout == 0.0 and kwargs.get("s_aux") is None and kwargs.get("position_bias") is None
        )
        prefix_key, prefix_value = prefix.layers[module.layer_idx]  # type: ignore[index]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = cascade_attention(
            query, key, value, attention_mask, prefix_key, prefix_value, scale
        )  # [B, Q, H, D]
        return out, None
    grouped = query.shape[1] != key.shape[1]
    plain = (
        attention_mask is None
        or not grouped
        or query.device.type != "cpu"
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or kwargs.get("output_attentions", False)
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # With a mask, `sdpa` never sets is_causal: the mask says everything.
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        enable_gqa=True,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None  # [B, Q, H, D]


AttentionInterface.register(ATTENTION, sdpa_gqa_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)  # the masks `sdpa` gets


def use_grouped_sdpa(model: torch.nn.Module) -> None:
    """Switch a transformers model that runs `sdpa` attention to `sdpa_gqa` (any other choice,
    eager or flash attention, is left as it is)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(ATTENTION)  # type: ignore[operator]
