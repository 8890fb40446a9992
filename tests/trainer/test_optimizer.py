"""`adamw`: torch's fused AdamW where every parameter supports it, with AdamW's arithmetic."""

from __future__ import annotations

import copy

import torch

from agent_grpo.trainer.optimizer import adamw, fused_supported, load_optimizer_state


def test_fused_on_cpu_and_equal_to_the_per_tensor_loop() -> None:
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(64, 32, generator=g), torch.randn(32, generator=g)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(3)]
    fused_params = [p.clone().requires_grad_() for p in start]
    loop_params = [p.clone().requires_grad_() for p in start]
    fused = adamw(fused_params, lr=1e-2, weight_decay=0.1)
    loop = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1, foreach=False)
    assert fused.defaults["fused"] is True
    for step in grads:
        for params, optimizer in ((fused_params, fused), (loop_params, loop)):
            for p, grad in zip(params, step, strict=True):
                p.grad = grad.clone()
            optimizer.step()
    for a, b, p0 in zip(fused_params, loop_params, start, strict=True):
        # the same formula, rounded differently: a few fp32 ulps of the weights, and of the
        # updates (each about lr), per step
        tolerance = 3 * 8 * torch.finfo(torch.float32).eps * (p0.abs().max() + 1e-2)
        assert (a - b).abs().max() <= tolerance
        assert (a - p0).abs().min() > 0  # it did step


def test_not_fused_where_the_kernel_does_not_run() -> None:
    meta = torch.empty(4, device="meta", requires_grad=True)
    assert not fused_supported([meta])
    assert fused_supported([torch.zeros(2)])
    assert not fused_supported([torch.zeros(2, dtype=torch.long)])


def test_a_checkpoint_from_the_loop_resumes_fused() -> None:
    """Loading a state saved by the per-tensor loop keeps this optimizer fused, and resumes it:
    the next step matches the loop's own next step."""
    g = torch.Generator().manual_seed(1)
    start = torch.randn(16, 8, generator=g)
    grads = [torch.randn(16, 8, generator=g) for _ in range(2)]
    saved = start.clone().requires_grad_()
    loop = torch.optim.AdamW([saved], lr=1e-2, foreach=False)
    saved.grad = grads[0].clone()
    loop.step()
    resumed = saved.detach().clone().requires_grad_()
    fused = adamw([resumed], lr=1e-2)
    load_optimizer_state(
        fused, copy.deepcopy(loop.state_dict())
    )  # as read from disk: no shared moments
    assert fused.param_groups[0]["fused"] is True
    assert fused.state[resumed]["step"].dtype == torch.float32
    for param, optimizer in ((saved, loop), (resumed, fused)):
        param.grad = grads[1].clone()
        optimizer.step()
    tolerance = 3 * 8 * torch.finfo(torch.float32).eps * (start.abs().max() + 1e-2)
    assert (saved - resumed).abs().max() <= tolerance
    assert float(fused.state[resumed]["step"]) == 2.0
