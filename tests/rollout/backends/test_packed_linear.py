"""Decode-time linears on oneDNN (`rollout/packed_linear.py`): each layer against `F.linear` within
the rounding bound of its reduction, repacking when the weights change, and the `hf` backend
sampling the same tokens with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.backends.hf import HFBackend
from agent_grpo.rollout.backends.packed_linear import PackedLinears, packing_supported

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN"
)


def rounding_bound(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """The most two fp32 evaluations of `x @ W^T + b` can differ by in any summation order:
    each is within gamma_K ~ K u of the exact sum of |terms| (K terms, u = eps / 2)."""
    k = x.shape[-1] + 1  # the bias is one more term
    terms = x.abs() @ layer.weight.abs().T
    if layer.bias is not None:
        terms = terms + layer.bias.abs()
    return k * torch.finfo(torch.float32).eps * terms


def layers(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 160), nn.Linear(160, 48, bias=False))


def test_small_inputs_run_packed_within_the_rounding_bound_and_large_ones_as_before(monkeypatch):
    model = layers()
    packed = PackedLinears(model, torch.float32, max_rows=8)
    small, large = torch.randn(2, 3, 64), torch.randn(3, 5, 64)  # 6 rows and 15 rows
    first = model[0]
    calls: list[tuple[int, ...]] = []
    kernel = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):  # type: ignore[no-untyped-def]
        calls.append(tuple(x.shape))
        return kernel(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    with torch.inference_mode(), packed.active():
        assert "forward" in first.__dict__
        out_small, out_large = first(small), first(large)
    assert calls == [(2, 3, 64)]  # only the small input took the oneDNN kernel
    assert "forward" not in first.__dict__  # the class's forward is back
    assert out_small.shape == (2, 3, 160)
    error = (out_small - F.linear(small, first.weight, first.bias)).abs()
    assert error.le(rounding_bound(small, first)).all()
    assert torch.equal(out_large, F.linear(large, first.weight, first.bias))  # the same kernel


def test_weights_changed_in_place_are_repacked_and_release_frees_the_copies():
    model = layers()
    packed = PackedLinears(model, torch.float32, max_rows=8)
    x = torch.randn(4, 64)
    with torch.inference_mode(), packed.active():
        before = model(x)
    reordered = {id(p.weight) for p in packed._packed.values()}
    with torch.no_grad():
        model[1].weight.mul_(-2.0)  # what an optimizer step does: in place, version bumped
    with torch.inference_mode(), packed.active():
        after = model(x)
    assert torch.allclose(after, -2.0 * before, rtol=1e-5, atol=1e-6)
    assert id(packed._packed[(model[0],)].weight) in reordered  # the untouched layer kept its copy
    assert id(packed._packed[(model[1],)].weight) not in reordered
    with torch.no_grad():
        model[0].bias.add_(1.0)  # a bias alone changes too
    with torch.inference_mode():
        plain = model(x)
        with packed.active():
            after_bias = model(x)
    assert torch.allclose(after_bias, plain, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(after_bias, after, rtol=1e-3, atol=1e-3)
    packed.release()
    assert not packed._packed


class Block(nn.Module):
    """A decoder layer's linears under the names every family we decode uses."""

    def __init__(self, up_in: int = 64) -> None:
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(64, 64), nn.Linear(64, 16)  # biased, as in Qwen2
        self.v_proj, self.o_proj = nn.Linear(64, 16), nn.Linear(64, 64)
        self.gate_proj = nn.Linear(64, 96, bias=False)
        self.up_proj = nn.Linear(up_in, 96, bias=False)


def test_siblings_run_as_one_matmul_and_each_gets_its_own_output(monkeypatch):
    torch.manual_seed(0)
    block = Block()
    names = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "o_proj")
    packed = PackedLinears(block, torch.float32, max_rows=8)
    x, y = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    calls: list[int] = []
    kernel = torch.ops.mkldnn._linear_pointwise

    def spy(inp, weight, *args):  # type: ignore[no-untyped-def]
        calls.append(weight.shape[0] if weight.dim() == 2 else -1)
        return kernel(inp, weight, *args)

    def check(name: str, inp: torch.Tensor, out: torch.Tensor) -> None:
        layer = getattr(block, name)
        error = (out - F.linear(inp, layer.weight, layer.bias)).abs()
        assert error.le(rounding_bound(inp, layer)).all(), name

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    with torch.inference_mode(), packed.active():
        outs = {name: getattr(block, name)(x) for name in names}
        assert len(calls) == 3  # q/k/v as one, gate/up as one, o alone
        for name, out in outs.items():
            check(name, x, out)
        # another order, another input, a sibling asked twice: right values, computed again
        check("v_proj", y, block.v_proj(y))
        check("q_proj", x, block.q_proj(x))
        check("q_proj", x, block.q_proj(x))
        check("k_proj", x, block.k_proj(x))
        assert len(calls) == 6
    assert {tuple(g) for g in packed._packed} == {
        (block.q_proj, block.k_proj, block.v_proj),
        (block.gate_proj, block.up_proj),
        (block.o_proj,),
    }
    with torch.no_grad():
        block.k_proj.weight.mul_(-2.0)  # one member changed: the group is packed again
    with torch.inference_mode(), packed.active():
        check("k_proj", x, block.k_proj(x))
        check("q_proj", x, block.q_proj(x))


def test_siblings_of_different_input_sizes_stay_apart():
    block = Block(up_in=32)
    packed = PackedLinears(block, torch.float32)
    with torch.inference_mode(), packed.active():
        block.up_proj(torch.randn(2, 32))
    groups = {tuple(g) for g in packed._packed}
    assert (block.gate_proj,) in groups and (block.up_proj,) in groups


def test_bf16_packs_once_what_autocast_computes_per_call():
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("no bf16 oneDNN kernels on this CPU")
    model = layers()
    packed = PackedLinears(model, torch.bfloat16, max_rows=8)
    x = torch.randn(4, 64)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
        with packed.active():
            got = model(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    # bf16 inputs and weights on both sides, fp32 accumulation, one bf16 rounding of the output
    # each (a bf16 ulp apart at most), the bf16 intermediate between the layers included.
    assert torch.allclose(got.float(), expected.float(), rtol=4 * 2**-8, atol=1e-2)


def test_supported_only_for_dense_cpu_floats():
    assert packing_supported(layers(), torch.float32)
    assert not packing_supported(layers(), torch.float64)
    assert not packing_supported(layers().double(), torch.float32)
    assert not packing_supported(nn.Sequential(nn.ReLU()), torch.float32)


def test_hf_backend_samples_the_same_tokens_packed_and_not(tiny_model, monkeypatch):
    from agent_grpo.testing.prompts import chat_ids
    from agent_grpo.testing.tiny_model import lively

    model, tokenizer = lively(tiny_model[0]), tiny_model[1]
    prompts = [chat_ids(tokenizer, q) for q in ("Hi", "What is 17 times 23?", "Rivers?")]
    sampling = SamplingConfig(temperature=0.0, max_tokens=12)
    rows: list[int] = []
    kernel = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):  # type: ignore[no-untyped-def]
        rows.append(x.numel() // x.shape[-1])
        return kernel(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    backend = HFBackend(model, tokenizer)
    assert backend.packed is not None
    packed = backend.generate(prompts, sampling, [0, 1, 2])
    # The decode steps' layers ran on oneDNN (a row per sequence still decoding; the short
    # prefills here fit `max_batch_size` rows too), never more rows than that.
    assert rows.count(len(prompts)) >= 7 * 11 and max(rows) <= backend.max_batch_size
    for layer in model.model.layers:  # each layer's q/k/v and gate/up ran as one matmul
        attention, mlp = layer.self_attn, layer.mlp
        assert (attention.q_proj, attention.k_proj, attention.v_proj) in backend.packed._packed
        assert (mlp.gate_proj, mlp.up_proj) in backend.packed._packed
    # 12 tokens each: the first from the prefill, whose LM head ran on one row per prompt, then
    # 11 decode steps of 4 matmuls a layer (7 unfused) and the head
    assert rows.count(len(prompts)) == 1 + 11 * (4 * len(model.model.layers) + 1)
    monkeypatch.undo()
    plain = HFBackend(model, tokenizer, packed_decode=False).generate(prompts, sampling, [0, 1, 2])
    for a, b in zip(packed, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    backend.update_weights(model)
    assert not backend.packed._packed  # the trainer pushed new weights: the copies are gone
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_an_optimizer_step_then_update_weights_samples_the_new_weights(tiny_model):
    """Fused AdamW writes the weights without bumping their version counters: `update_weights`,
    which the trainer calls after every step, is what refreshes the copies."""
    from agent_grpo.testing.prompts import chat_ids
    from agent_grpo.testing.tiny_model import lively
    from agent_grpo.trainer.optimizer import adamw

    model, tokenizer = lively(tiny_model[0]), tiny_model[1]
    prompts = [chat_ids(tokenizer, q) for q in ("Hi", "What is 17 times 23?")]
    sampling = SamplingConfig(temperature=0.0, max_tokens=8)
    backend = HFBackend(model, tokenizer)
    backend.generate(prompts, sampling, [0, 1])
    optimizer = adamw(list(model.parameters()), lr=0.05)
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    optimizer.step()
    backend.update_weights(model)
    after = backend.generate(prompts, sampling, [0, 1])
    fresh = HFBackend(model, tokenizer, packed_decode=False).generate(prompts, sampling, [0, 1])
    for a, b in zip(after, fresh, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_a_forward_already_on_the_instance_is_put_back():
    model = layers()
    wrapper = model[0].forward  # what a hook library leaves on an instance
    model[0].__dict__["forward"] = wrapper
    with torch.inference_mode(), PackedLinears(model, torch.float32).active():
        assert model[0].__dict__["forward"] is not wrapper
    assert model[0].__dict__["forward"] is wrapper and "forward" not in model[1].__dict__


def test_free_caches_drops_the_packed_weights_and_the_prefix_cache(tiny_model):
    from agent_grpo.testing.prompts import chat_ids

    model, tokenizer = tiny_model
    backend = HFBackend(model, tokenizer)
    backend.generate([chat_ids(tokenizer, "Hi")] * 2, SamplingConfig(max_tokens=4), [0, 1])
    assert backend.packed is not None and backend.packed._packed and len(backend.prefix_cache)
    backend.free_caches()
    assert not backend.packed._packed and not len(backend.prefix_cache)
