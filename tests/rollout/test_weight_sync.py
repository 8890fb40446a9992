"""The broadcast weight group: buckets by hand, and a trainer with two receivers (threads of this
process, gloo on 127.0.0.1) that end with exactly the sender's tensors."""

from __future__ import annotations

import threading

import torch

from agent_grpo.rollout.weight_sync import (
    TensorSpec,
    WeightReceiver,
    WeightSender,
    buckets,
    distinct_tensors,
    payload_bytes,
    tensor_specs,
)


def spec(name: str, numel: int, dtype: str = "float32") -> TensorSpec:
    """A 1-d tensor's spec."""
    return TensorSpec(name, (numel,), dtype)


def test_buckets_join_neighbours_of_one_dtype_up_to_the_limit() -> None:
    # fp32 sizes in bytes: 40, 40, 80, 400 (alone: over the limit), 8, then bf16 20, then fp32 4
    specs = [spec("a", 10), spec("b", 10), spec("c", 20), spec("big", 100), spec("d", 2),
             spec("h", 10, "bfloat16"), spec("e", 1)]  # fmt: skip
    assert buckets(specs, max_bytes=160) == [[0, 1, 2], [3], [4], [5], [6]]
    assert buckets(specs, max_bytes=1000) == [[0, 1, 2, 3, 4], [5], [6]]
    assert payload_bytes(specs) == 4 * (10 + 10 + 20 + 100 + 2 + 1) + 2 * 10


def test_a_tied_weight_travels_once() -> None:
    embed = torch.randn(5, 3)
    weights = {"embed.weight": embed, "norm.weight": torch.ones(3), "lm_head.weight": embed}
    assert list(distinct_tensors(weights)) == ["embed.weight", "norm.weight"]
    # the same storage at another offset or shape is another tensor
    flat = torch.arange(12.0)
    assert len(distinct_tensors({"x": flat[:6], "y": flat[6:], "z": flat.view(3, 4)})) == 3


def test_two_receivers_get_the_sender_s_tensors_exactly() -> None:
    torch.manual_seed(0)
    weights = {
        "layers.0.weight": torch.randn(16, 8),
        "layers.0.bias": torch.randn(16),
        "embed": torch.randn(64, 8),  # 2 KiB: alone in its bucket below
        "scale": torch.randn(4).to(torch.bfloat16),
        "layers.1.weight": torch.randn(8, 16).t(),  # not contiguous
    }
    specs = tensor_specs(weights)
    sender = WeightSender("127.0.0.1", receivers=2, backend="gloo", timeout_s=60,
                          bucket_bytes=1024)  # fmt: skip
    assert len(buckets(specs, 1024)) == 4  # several broadcasts, one of them bf16
    got: dict[int, dict[str, torch.Tensor]] = {}

    def receive(rank: int) -> None:
        receiver = WeightReceiver(sender.address, rank, "127.0.0.1")
        got[rank] = receiver.receive(specs, torch.device("cpu"))
        receiver.close()

    threads = [threading.Thread(target=receive, args=(rank,)) for rank in (1, 2)]
    for thread in threads:
        thread.start()
    sender.connect()
    sender.send(weights, specs)
    for thread in threads:
        thread.join(timeout=60)
    sender.close()
    for rank in (1, 2):
        assert list(got[rank]) == list(weights)
        for name, tensor in weights.items():
            assert got[rank][name].dtype == tensor.dtype
            assert torch.equal(got[rank][name], tensor), (rank, name)
