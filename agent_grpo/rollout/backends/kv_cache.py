"""The `hf` backend's KV cache: transformers' `DynamicCache` with room reserved for the decode.

`DynamicLayer.update` concatenates each new token's keys and values onto the whole cache, so a
decode step copies every layer's cache once: O(length) per token, O(length^2) per answer.
Here each layer's keys and values live in buffers sized, at prefill, for the prompt plus every
token the call may sample; a step writes its slot in place and the layer exposes the filled
part as a view. What attention reads is the same tensor values as
`DynamicLayer` would hand it, so outputs do not change (tests/test_hf_backend.py compares).

The copies grow with the context, so the saving is largest for long prompts, where they dominate
a decode step (docs/benchmarks.md, "`hf` KV cache written in place").

Only what the backend does with a cache is supported: update, the filled `keys`/`values`, and
`batch_select_indices` when rows finish; `crop`, `reset`, `batch_repeat_interleave`, beam
reordering and offloading raise rather than leave the buffers stale. Every row's slots for
prompt plus `max_tokens` are held from the prefill on, even when answers finish early.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

BatchKV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each `[B, H, L, D]`."""

__all__ = ["ReservedLayer", "reserved_cache"]


class ReservedLayer(DynamicLayer):
    """One layer's KV in buffers `[B, H, capacity, D]`; `keys`/`values` view the filled slots."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        """Slots reserved at the first update; outgrowing them doubles the buffers (a copy)."""
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `[B, H, n, D]` new keys and values after the filled slots; return the filled."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        filled = self.get_seq_length()  # the exposed view's length (0 before any update)
        end = filled + key_states.shape[-2]
        if self._keys is None or self._values is None or end > self._keys.shape[-2]:
            self._reserve(key_states, value_states, max(end, self.capacity, 2 * filled), filled)
        assert self._keys is not None and self._values is not None
        self._keys[:, :, filled:end] = key_states
        self._values[:, :, filled:end] = value_states
        self._expose(end)
        return self.keys, self.values  # type: ignore[return-value]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (a copy of the buffers: only when rows finish)."""
        if self._keys is None or self._values is None:
            return
        filled = self.get_seq_length()
        self._keys, self._values = self._keys[indices], self._values[indices]
        self._expose(filled)

    def _unsupported(self, *args: object, **kwargs: object) -> None:
        raise NotImplementedError("ReservedLayer supports update and batch_select_indices only")

    crop = reset = batch_repeat_interleave = reorder_cache = offload = prefetch = _unsupported

    def _reserve(
        self, keys: torch.Tensor, values: torch.Tensor, capacity: int, filled: int
    ) -> None:
        old_keys, old_values = self._keys, self._values
        batch, heads = keys.shape[:2]
        self._keys = keys.new_empty(batch, heads, capacity, keys.shape[-1])
        self._values = values.new_empty(batch, heads, capacity, values.shape[-1])
        if old_keys is not None and old_values is not None and filled:
            self._keys[:, :, :filled] = old_keys[:, :, :filled]
            self._values[:, :, :filled] = old_values[:, :, :filled]

    def _expose(self, filled: int) -> None:
        assert self._keys is not None and self._values is not None
        self.keys = self._keys[:, :, :filled]
        self.values = self._values[:, :, :filled]


def reserved_cache(capacity: int, past: BatchKV | None = None) -> DynamicCache:
    """A `DynamicCache` of `ReservedLayer`s of `capacity` slots, holding `past` (per layer
    `[B, H, L, D]` keys and values) if given."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = partial(ReservedLayer, capacity)  # type: ignore[assignment]
    for layer, (keys, values) in enumerate(past or []):
        cache.update(keys, values, layer)
    return cache
