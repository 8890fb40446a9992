"""`bench/compiled_decode.py` times a decode step written as one function over preallocated KV
buffers; its figures mean something only if that function is the model. Its eager step, on the
tiny model, against the model's own forward over the same ids: two steps, so the second reads
the KV slot the first wrote, over buffers whose unwritten slots hold noise, so a mask that lets
one in shows."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import compiled_decode  # noqa: E402


def test_the_static_step_computes_the_models_logits(tiny_model) -> None:
    model, _ = tiny_model
    model.eval()
    rows, prompt_len, capacity = 3, 7, 12
    ids = torch.randint(5, 1000, (rows, prompt_len + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=ids[:, : prompt_len - 1], past_key_values=cache, use_cache=True)
        step = compiled_decode.static_step(
            model, cache, rows, capacity, compiled_decode.decoder_layer
        )
        for slot in (prompt_len - 1, prompt_len):
            expected = model(input_ids=ids[:, : slot + 1]).logits[:, -1]  # [B, V]
            got = step(ids[:, slot : slot + 1], slot)  # [B, V]
            # fp32 throughout; oneDNN's matmuls and the fused norm sum in another order than
            # F.linear and the model's RMSNorm: ~1e-7 relative per rounding, over sums of at
            # most 128 terms here, on logits of about 0.1 (init std 0.02), so differences of
            # ~1e-7. A wrong slot, position or mask moves them by 1e-3 or more.
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
