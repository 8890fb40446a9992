"""`cascade_attention` (agent_grpo/models/shared_prefix_attention.py): attention over one
copy of a prefix plus each row's own slots is attention over their concatenation. A hand-derived
case first, then torch's own attention over the concatenated keys as the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agent_grpo.models.shared_prefix_attention import cascade_attention

MIN = torch.finfo(torch.float32).min


def additive(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[B, Q, K]` bool -> the `[B, 1, Q, K]` 0 / dtype-min mask the `hf` backend builds."""
    mask = torch.zeros(allowed.shape, dtype=dtype)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def test_a_zero_query_averages_every_visible_value():
    """q = 0 scores every slot 0, so the output is the plain mean of the values it may see: the
    prefix's two (1 and 3) and the row's own unmasked ones. Row 0 sees its 5 -> (1+3+5)/3 = 3;
    row 1 sees 10 and 20 -> (1+3+10+20)/4 = 8.5."""
    query = torch.zeros(2, 1, 1, 1)  # [B, H, Q, D]
    prefix_key = torch.randn(1, 2, 1)  # any keys: the scores are all 0
    prefix_value = torch.tensor([[[1.0], [3.0]]])  # [H_kv, P, D]
    key = torch.randn(2, 1, 2, 1)
    value = torch.tensor([[[[7.0], [5.0]]], [[[10.0], [20.0]]]])  # [B, H_kv, K, D]
    mask = additive(torch.tensor([[[False, True]], [[True, True]]]))  # row 0's slot 0 is padding
    out = cascade_attention(query, key, value, mask, prefix_key, prefix_value, scale=1.0)
    assert out.shape == (2, 1, 1, 1)  # [B, Q, H, D]
    assert out.flatten().tolist() == pytest.approx([3.0, 8.5], abs=1e-6)


def case(
    batch: int,
    q_len: int,
    own: int,
    prefix: int,
    dtype: torch.dtype,
    seed: int,
    reference_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random grouped-query inputs (9 query heads on 3 KV heads, as SmolLM2's), own slots with
    padding holes and a causal block for the last `q_len`; the output in `dtype`, and the
    reference (attention over the concatenated keys) in `reference_dtype`."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 9, 3, 16
    query = torch.randn(batch, q_len, heads, dim, generator=g).transpose(1, 2)  # as transformers
    key, value = (torch.randn(batch, kv_heads, own, dim, generator=g) for _ in range(2))
    prefix_key, prefix_value = (torch.randn(kv_heads, prefix, dim, generator=g) for _ in range(2))
    valid = torch.rand(batch, own, generator=g) > 0.3
    valid[:, -q_len:] = True  # the queries' own slots
    causal = torch.arange(own)[None, :] <= torch.arange(own - q_len, own)[:, None]  # [Q, K]
    allowed = causal[None] & valid[:, None, :]  # [B, Q, K]
    inputs = [t.to(dtype) for t in (query, key, value)]
    prefixes = [t.to(dtype) for t in (prefix_key, prefix_value)]
    full_key = torch.cat([prefix_key.expand(batch, -1, -1, -1), key], dim=2)
    full_value = torch.cat([prefix_value.expand(batch, -1, -1, -1), value], dim=2)
    full_allowed = torch.cat([torch.ones(batch, q_len, prefix, dtype=torch.bool), allowed], -1)
    reference = F.scaled_dot_product_attention(
        *(t.to(reference_dtype) for t in (query, full_key, full_value)),
        attn_mask=additive(full_allowed, reference_dtype), enable_gqa=True, scale=dim**-0.5,
    ).transpose(1, 2)  # fmt: skip
    got = cascade_attention(
        *inputs, additive(allowed, dtype), *prefixes, scale=dim**-0.5
    )  # [B, Q, H, D]
    return got, reference


@pytest.mark.parametrize(
    ("batch", "q_len", "own", "prefix"),
    [(5, 1, 9, 20), (4, 6, 11, 17), (1, 1, 1, 3), (3, 4, 4, 1)],
    ids=["decode", "prefill-with-holes", "one-row-one-slot", "one-prefix-slot"],
)
def test_equals_attention_over_the_concatenated_keys(batch, q_len, own, prefix):  # type: ignore[no-untyped-def]
    got, reference = case(batch, q_len, own, prefix, torch.float32, seed=batch * 100 + q_len)
    assert got.dtype == torch.float32 and got.shape == reference.shape
    # outputs are convex combinations of unit-normal values: fp32 rounding of sums of ~30 terms
    torch.testing.assert_close(got, reference, atol=1e-5, rtol=0)


def test_bf16_inputs_match_bf16_attention_over_the_concatenation():
    """bf16 in, bf16 out, within bf16 output rounding (8-bit mantissa) of torch's attention over
    the concatenated bf16 keys (what the prefix held per row computes)."""
    got, _ = case(4, 3, 10, 24, torch.bfloat16, seed=7)
    reference = case(4, 3, 10, 24, torch.bfloat16, seed=7, reference_dtype=torch.bfloat16)[1]
    assert got.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference.float(), atol=2**-7, rtol=2**-7)


def test_a_query_whose_own_slots_are_all_masked_reads_the_prefix_alone():
    """A padding query (left padding in a prefill) sees none of its row's slots: it gets the
    prefix's attention, finite, not NaN."""
    query = torch.randn(1, 9, 1, 16)
    key, value = torch.randn(1, 3, 4, 16), torch.randn(1, 3, 4, 16)
    prefix_key, prefix_value = torch.randn(3, 8, 16), torch.randn(3, 8, 16)
    nothing = additive(torch.zeros(1, 1, 4, dtype=torch.bool))
    out = cascade_attention(query, key, value, nothing, prefix_key, prefix_value, 0.25)
    alone = F.scaled_dot_product_attention(
        query, prefix_key[None], prefix_value[None], enable_gqa=True, scale=0.25
    ).transpose(1, 2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, alone, atol=1e-6, rtol=0)
