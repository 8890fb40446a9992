"""The policy as the update sees it: bf16 compute keeps fp32 master weights."""

from __future__ import annotations

import copy

import torch

from agent_grpo.config.jobs import AlgoConfig
from agent_grpo.testing.records import minimal_record
from agent_grpo.trainer.batch import pack_records
from agent_grpo.trainer.parallel import DistContext, wrap_policy
from agent_grpo.trainer.update import minibatch_update
from agent_grpo.trajectory.record import Provenance


def _adam_step(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One AdamW step (lr 1e-3) on a fixed batch; returns each parameter's change."""
    g = torch.Generator().manual_seed(0)
    provenance = [Provenance.PROMPT] * 4 + [Provenance.MODEL] * 8
    records = []
    for i in range(4):
        ids = torch.randint(3, 1000, (12,), generator=g).tolist()
        records.append(
            minimal_record("a", i, float(i), group_size=3, token_ids=ids, provenance=provenance)
        )
    batch = pack_records(records, 2, [1.0, -1.0, 0.5, -0.5])
    policy = wrap_policy(model, "none", DistContext(), compute_dtype=dtype)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    minibatch_update(policy, optimizer, batch, None, None, AlgoConfig(), 1.0, 16)
    return {k: v.detach() - before[k] for k, v in model.named_parameters()}


def test_bf16_compute_moves_the_weights_as_fp32_does(tiny_model) -> None:
    model, _ = tiny_model
    fp32 = _adam_step(copy.deepcopy(model), torch.float32)
    bf16_model = copy.deepcopy(model)
    bf16 = _adam_step(bf16_model, torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in bf16_model.parameters())  # master weights
    a = torch.cat([d.flatten() for d in fp32.values()])
    b = torch.cat([d.flatten() for d in bf16.values()])
    moved = a.abs() > 0.5e-3  # Adam's first step is about lr * sign(g) where g is not ~0
    assert float(moved.float().mean()) > 0.9
    # bf16 gradients differ in the last bits, so a few near-zero components change sign; an
    # update of size lr survives in the fp32 master weights (in bf16 weights, 0.02 + 1e-3
    # rounds back to 0.02 for every |w| > 0.256)
    assert float((b.abs() > 0.5e-3).float().mean()) > 0.9
    assert float((torch.sign(a[moved]) == torch.sign(b[moved])).float().mean()) > 0.9
