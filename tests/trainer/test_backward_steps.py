"""`algo.speed.optimizer_in_backward`: AdamW stepped inside backward gives the ordinary AdamW update
(clipping off), frees every gradient as it is applied, resumes from the same state layout, and
refuses what it cannot do."""

from __future__ import annotations

import copy

import pytest
import torch

from agent_grpo.config.jobs import AlgoConfig, SpeedConfig, TrainConfig
from agent_grpo.testing.records import group_records
from agent_grpo.trainer.backward_steps import BackwardSteps
from agent_grpo.trainer.batch import pack_records
from agent_grpo.trainer.parallel import DistContext, wrap_policy
from agent_grpo.trainer.update import minibatch_update


def _records() -> list:
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 1000, (n,), generator=g).tolist()

    system = ids(6)  # both groups' prompts start alike: a packed micro-batch shares a prefix
    records = group_records("a", system + ids(7), [ids(5), ids(3), ids(6)], [1.0, -0.5, -0.5])
    return records + group_records("b", system + ids(3), [ids(4), ids(7)], [0.7, -0.7])


HYPER = {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1}
"""Not AdamW's defaults: each parameter's step must use the master optimizer's settings."""


def _train(model: torch.nn.Module, algo: AlgoConfig, steps: int, in_backward: bool,
           state: dict | None = None):  # fmt: skip
    """`steps` minibatch updates on a copy of `model`; returns it, the metrics, the optimizer."""
    model = copy.deepcopy(model)
    policy = wrap_policy(model, "none", DistContext())
    optimizer = torch.optim.AdamW(policy.parameters(), **HYPER)
    hooks = BackwardSteps(optimizer) if in_backward else None
    if state is not None:  # as a resume does: the hooks exist, then the state is loaded
        optimizer.load_state_dict(state)
    batch = pack_records(_records(), 2)
    metrics = []
    for _ in range(steps):
        m, _ = minibatch_update(policy, optimizer, batch, None, None, algo, 1.0, 16,
                                in_backward=hooks)  # fmt: skip
        metrics.append(m)
    return model, metrics, optimizer


@pytest.mark.parametrize("micro_batch_tokens", [10**6, 30])  # one micro-batch; several
def test_in_backward_is_adamw_without_clipping(tiny_model, micro_batch_tokens: int) -> None:
    model, _ = tiny_model
    plain = AlgoConfig(max_grad_norm=None, speed=SpeedConfig(micro_batch_tokens=micro_batch_tokens))
    fused = AlgoConfig(
        max_grad_norm=None,
        speed=SpeedConfig(micro_batch_tokens=micro_batch_tokens, optimizer_in_backward=True),
    )
    a, a_metrics, a_opt = _train(model, plain, 2, in_backward=False)
    b, b_metrics, b_opt = _train(model, fused, 2, in_backward=True)
    moved = sum(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(a.parameters(), model.parameters(), strict=True)
    )
    assert moved > 0  # the comparison is between two real updates
    # the same AdamW arithmetic per tensor, in the same order: equal to fp32 rounding
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q)
    for x, y in zip(a_metrics, b_metrics, strict=True):
        assert x.grad_norm == pytest.approx(y.grad_norm, rel=1e-5)
        assert x.loss == pytest.approx(y.loss, rel=1e-6)
        assert y.skipped_steps == 0
    # the state is in the ordinary layout: every parameter's moments, under the same keys
    sa, sb = a_opt.state_dict()["state"], b_opt.state_dict()["state"]
    assert sa.keys() == sb.keys() and len(sa) == len(list(model.parameters()))
    for i in sa:
        torch.testing.assert_close(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"])


def test_no_gradient_outlives_its_step(tiny_model) -> None:
    model, _ = tiny_model
    model = copy.deepcopy(model)
    policy = wrap_policy(model, "none", DistContext())
    params = list(policy.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    hooks = BackwardSteps(optimizer)
    live: list[int] = []
    # registered after BackwardSteps' hooks, so these run right after each parameter's step
    for p in params:
        p.register_post_accumulate_grad_hook(
            lambda _: live.append(sum(q.grad is not None for q in params))
        )
    algo = AlgoConfig(max_grad_norm=None, speed=SpeedConfig(optimizer_in_backward=True))
    batch = pack_records(_records(), 2)  # both groups fit one micro-batch: one backward
    minibatch_update(policy, optimizer, batch, None, None, algo, 1.0, 16, in_backward=hooks)
    # each gradient is freed by its step, before the next parameter's gradient completes
    assert len(live) == len(params) and max(live) == 0
    assert all(p.grad is None for p in params)


def test_norm_and_counts_start_afresh_each_minibatch(tiny_model) -> None:
    """A minibatch with nothing to train reports no norm, not the previous minibatch's."""
    model, _ = tiny_model
    policy = wrap_policy(copy.deepcopy(model), "none", DistContext())
    optimizer = torch.optim.AdamW(policy.parameters(), **HYPER)
    hooks = BackwardSteps(optimizer)
    algo = AlgoConfig(max_grad_norm=None, speed=SpeedConfig(optimizer_in_backward=True))
    batch = pack_records(_records(), 2)
    first, _ = minibatch_update(policy, optimizer, batch, None, None, algo, 1.0, 16,
                                in_backward=hooks)  # fmt: skip
    dead = pack_records(_records(), 2)
    dead.advantages.zero_()  # every row skipped (beta 0): no forward, no backward
    second, _ = minibatch_update(policy, optimizer, dead, None, None, algo, 1.0, 16,
                                 in_backward=hooks)  # fmt: skip
    assert first.grad_norm > 0 and second.grad_norm == 0 and second.skipped_steps == 0


def test_resumes_from_the_checkpointed_state(tiny_model) -> None:
    model, _ = tiny_model
    algo = AlgoConfig(max_grad_norm=None, speed=SpeedConfig(optimizer_in_backward=True))
    straight, _, _ = _train(model, algo, 2, in_backward=True)
    first, _, optimizer = _train(model, algo, 1, in_backward=True)
    resumed, _, _ = _train(first, algo, 1, in_backward=True, state=optimizer.state_dict())
    for p, q in zip(straight.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(p, q)


def test_non_finite_loss_steps_nothing(tiny_model) -> None:
    model, _ = tiny_model
    records = _records()
    records[0].advantage = float("nan")
    policy = wrap_policy(copy.deepcopy(model), "none", DistContext())
    before = [p.detach().clone() for p in policy.parameters()]
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    algo = AlgoConfig(max_grad_norm=None, speed=SpeedConfig(optimizer_in_backward=True))
    metrics, _ = minibatch_update(policy, optimizer, pack_records(records, 2), None, None, algo,
                                  1.0, 16, in_backward=BackwardSteps(optimizer))  # fmt: skip
    assert metrics.skipped_steps == 1
    for p, q in zip(before, policy.parameters(), strict=True):
        assert torch.equal(p, q)


def test_refused_with_clipping_or_ranks() -> None:
    with pytest.raises(ValueError, match="max_grad_norm: null"):
        AlgoConfig(speed=SpeedConfig(optimizer_in_backward=True))
    with pytest.raises(ValueError, match="DDP and FSDP"):
        TrainConfig.model_validate({
            "algo": {"speed": {"optimizer_in_backward": True}, "max_grad_norm": None},
            "distributed": {"mode": "ddp"},
        })  # fmt: skip


def test_reference_dtype_holds_a_bf16_reference_under_fp32_training(tiny_model) -> None:
    """`model.reference_dtype: bfloat16` with `model.dtype: float32`: the policy keeps fp32, the
    reference is held and run in bf16; with LoRA (no reference of its own) it is refused."""
    from agent_grpo.trainer.setup import share_models

    model, _ = tiny_model
    config = TrainConfig.model_validate({"model": {"reference_dtype": "bfloat16"},
                                         "algo": {"beta": 0.04}})  # fmt: skip
    policy, reference = share_models(copy.deepcopy(model), copy.deepcopy(model), config,
                                     DistContext())  # fmt: skip
    assert reference is not None
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    with pytest.raises(ValueError, match=r"model\.reference_dtype with model\.lora"):
        TrainConfig.model_validate({"model": {"reference_dtype": "bfloat16", "lora": {}}})


def test_bf16_reference_keeps_no_fp32_copy(tiny_model) -> None:
    """With `model.dtype: bfloat16` the frozen reference is held in bf16 (half the bytes) and
    scores like the fp32 weights under bf16 autocast, to bf16's resolution."""
    from agent_grpo.trainer.parallel import wrap_reference
    from agent_grpo.trainer.update import batch_logprobs

    model, _ = tiny_model
    ctx = DistContext()
    fp32 = wrap_reference(copy.deepcopy(model), "none", ctx, torch.float32)
    autocast = wrap_policy(copy.deepcopy(model), "none", ctx, torch.bfloat16)
    held = wrap_reference(copy.deepcopy(model), "none", ctx, torch.bfloat16)
    assert {p.dtype for p in held.parameters()} == {torch.bfloat16}
    # RoPE's inverse frequencies stay fp32: in bf16 they would turn late positions' angles
    assert {b.dtype for b in held.buffers() if b.is_floating_point()} == {torch.float32}
    assert sum(p.numel() * p.element_size() for p in held.parameters()) * 2 == sum(
        p.numel() * p.element_size() for p in fp32.parameters()
    )
    batch = pack_records(_records(), 2)
    algo = AlgoConfig()
    exact = batch_logprobs(fp32, batch, 1.0, algo)
    ours = batch_logprobs(held, batch, 1.0, algo)
    mixed = batch_logprobs(autocast, batch, 1.0, algo)
    scored = batch.loss_mask
    # bf16 keeps 8 mantissa bits (relative error 2^-9 per rounding); the reference held in bf16
    # differs from fp32 by the same order as autocast does (which also rounds every matmul)
    err_ours = (ours - exact)[scored].abs().max()
    err_mixed = (mixed - exact)[scored].abs().max()
    assert err_ours > 0  # bf16 really ran
    print(f"bf16-held {float(err_ours):.3g}, autocast {float(err_mixed):.3g}")
    assert err_ours < 4 * err_mixed + 2**-6
