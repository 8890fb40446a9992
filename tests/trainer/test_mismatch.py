"""The sampler/trainer gap split by cause: by hand, the engine's view against the model's own
logits, and a run that logs it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.backends.hf import processed_logprobs
from agent_grpo.testing.cli_runs import tiny_train
from agent_grpo.testing.records import minimal_record
from agent_grpo.testing.reward_rules import reward_override
from agent_grpo.testing.tiny_model import save_tiny_llama
from agent_grpo.trainer.batch import pack_records
from agent_grpo.trainer.mismatch import EngineView, engine_view, mismatch_causes
from agent_grpo.trajectory.record import Provenance

NAN, INF = float("nan"), float("inf")


def test_each_cause_is_its_own_mean_gap_over_the_fresh_tokens() -> None:
    # token 1: kept by the filter (mass e^-0.5 -> 0.5), token 2: dropped by the trainer's filter
    # (-inf: out of the filter and kernel means); token 3 is not fresh and holds junk
    view = EngineView(
        tempered=torch.tensor([[NAN, -1.0, -2.0, 9.0]]),
        processed=torch.tensor([[NAN, -0.5, -INF, 9.0]]),
        dtype=torch.bfloat16,
        sampling=SamplingConfig(top_p=0.9),
    )
    sampler = torch.tensor([[NAN, -0.6, -1.8, 7.0]])
    trainer = torch.tensor([[NAN, -1.1, -2.1, 3.0]])
    fresh = torch.tensor([[False, True, True, False]])
    causes = mismatch_causes(view, sampler, trainer, fresh, view.sampling, torch.float32)
    assert causes.filter == pytest.approx(0.5)
    assert causes.dtype == pytest.approx(0.1)  # |-1.1 + 1.0|, |-2.1 + 2.0|
    assert causes.kernels == pytest.approx(0.1)  # |-0.6 + 0.5|; token 2's is infinite
    # no filter and one dtype: only the kernels are measured
    same = EngineView(view.tempered, view.tempered, torch.float32, SamplingConfig())
    alone = mismatch_causes(same, sampler, trainer, fresh, same.sampling, torch.float32)
    assert alone.measured() == {"kernels": pytest.approx((0.4 + 0.2) / 2)}


def test_the_engine_view_is_the_models_own_logits_through_the_samplers_filter(
    tiny_model, tokenizer
) -> None:
    model, _ = tiny_model
    ids = tokenizer.encode("Compute 12 * 34 and answer with the number.", add_special_tokens=False)
    prov = [Provenance.PROMPT] * 4 + [Provenance.MODEL] * (len(ids) - 4)
    records = [minimal_record("g", token_ids=ids, provenance=prov),
               minimal_record("g", 1, token_ids=ids[:6], provenance=prov[:6])]  # fmt: skip
    batch = pack_records(records, tokenizer.pad_token_id)
    fresh = batch.loss_mask.clone()
    fresh[0, 7] = False  # a stale token in the middle is not scored
    sampling = SamplingConfig(temperature=0.7, top_k=50, top_p=0.8)
    view = engine_view(model, batch, fresh, sampling, torch.float32)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    for b, t in fresh.nonzero().tolist():
        row = logits[b, t - 1][None].float()  # the prediction of token t
        want = torch.log_softmax(row / 0.7, dim=-1)[0, batch.input_ids[b, t]]
        assert float(view.tempered[b, t]) == pytest.approx(float(want), abs=1e-5)
        kept = processed_logprobs(row, sampling)[0, batch.input_ids[b, t]]
        assert math.isinf(float(kept)) == math.isinf(float(view.processed[b, t]))
        if math.isfinite(float(kept)):
            assert float(view.processed[b, t]) == pytest.approx(float(kept), abs=1e-5)
    assert torch.isnan(view.tempered[~fresh]).all() and torch.isnan(view.processed[~fresh]).all()


@pytest.mark.slow
def test_a_run_logs_the_filters_share_and_what_the_kernels_leave(tmp_path, tiny_model_dir) -> None:
    run = tiny_train(tmp_path, tiny_model_dir, reward_override("even", "even_tokens"),
                     "run.name=causes", "steps=2", "rollout.sampling.top_p=0.9",
                     "rollout.mismatch_causes_every=1")  # fmt: skip
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        # the renormalisation of a 0.9 nucleus is far above kernel noise; fp32 on both sides
        assert row["mismatch_cause/filter"] > 1e-3 and row["mismatch_cause/kernels"] < 1e-3
        assert "mismatch_cause/dtype" not in row and row["mismatch_causes_time_s"] > 0


@pytest.mark.slow
def test_a_bf16_vllm_engine_under_fp32_training_logs_the_dtypes_share(tmp_path, tokenizer) -> None:
    model_dir = tmp_path / "tiny-llama"  # head_dim 32: vLLM's CPU attention takes no 16
    save_tiny_llama(model_dir, tokenizer)
    run = tiny_train(tmp_path, model_dir, reward_override("even", "even_tokens"),
                     "run.name=vllm-bf16", "steps=1", "rollout.mismatch_causes_every=1",
                     "rollout.backend={type: vllm, dtype: bfloat16}")  # fmt: skip
    [row] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["excluded_trajectories"] == 0  # the engine sampled every episode
    # bf16 rounds logprobs at about 2^-8 relative: far above fp32's kernel noise
    assert row["mismatch_cause/dtype"] > 1e-4 and "mismatch_cause/filter" not in row
    assert math.isfinite(row["mismatch_cause/kernels"])
