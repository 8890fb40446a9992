"""The rollout-worker half of scripts/device-check.sh (issue 26), apart from device_check.py's
trainer checks: weight pushes from GPU weights, and a vLLM engine as a Ray actor on a GPU.

1. gloo push from CUDA weights: the trainer's tensors on cuda:0 broadcast to a process on the CPU
   (a trainer on a GPU, rollout actors without one). Any GPU machine.
2. NCCL push: the trainer's tensors on cuda:0 broadcast to a process on cuda:1
   (`agent_grpo/rollout/weight_sync.py`, the path `weight_sync: broadcast` takes when actors
   have GPUs). Needs 2 GPUs: NCCL refuses two ranks on one device.
3. vLLM actor: one Ray rollout actor with the `vllm` backend on a GPU samples Calculator-v0
   groups; new weights are broadcast to it; its canary logprobs then match the trainer's. Needs
   vllm and ray.

Each check that cannot run here prints why and is skipped; the others assert and print their
figures. Argument: the directory with the real tokenizer and SmolLM2-135M's config.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

from agent_grpo.rollout.weight_sync import (
    GroupAddress,
    WeightReceiver,
    WeightSender,
    distinct_tensors,
    payload_bytes,
    tensor_specs,
)


def skip(check: str, why: str) -> None:
    """Say which check is skipped and why."""
    print(f"SKIP {check}: {why}")


def random_weights(source: Path, device: str) -> dict[str, torch.Tensor]:
    """SmolLM2-135M's shape with random weights (seed 0), on `device`, a tied weight once."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(source))
    return {k: v.to(device) for k, v in distinct_tensors(model.state_dict()).items()}


def receive(address: GroupAddress, specs: list[Any], device: str, out: Any) -> None:
    """A receiver process: join as rank 1, receive on `device`, send back each tensor's sum."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    receiver = WeightReceiver(address, 1, "127.0.0.1")
    got = receiver.receive(specs, torch.device(device))
    out.put({name: float(t.double().sum()) for name, t in got.items()})
    receiver.close()


def push_check(name: str, source: Path, backend: str, receiver_device: str) -> None:
    """Broadcast cuda:0 weights to one receiver process on `receiver_device`; sums must match."""
    weights = random_weights(source, "cuda:0")
    specs = tensor_specs(weights)
    sender = WeightSender("127.0.0.1", receivers=1, backend=backend)  # type: ignore[arg-type]
    context = mp.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=receive, args=(sender.address, specs, receiver_device, out))
    process.start()
    torch.cuda.set_device(0)
    sender.connect()
    start = time.perf_counter()
    sender.send(weights, specs)
    torch.cuda.synchronize()
    sums = out.get(timeout=600)
    seconds = time.perf_counter() - start
    process.join(timeout=60)
    sender.close()
    for key, tensor in weights.items():
        want = float(tensor.double().sum())
        assert abs(sums[key] - want) <= 1e-9 * max(1.0, abs(want)), (key, sums[key], want)
    size = payload_bytes(specs)
    print(
        f"{name}: {len(specs)} tensors, {size / 2**20:.0f} MiB to {receiver_device} in "
        f"{seconds:.2f} s ({size / seconds / 2**30:.2f} GiB/s); every tensor arrived intact"
    )


def nccl_alone_check(source: Path) -> None:
    """With one GPU: the trainer's NCCL weight group forms and broadcasts with itself alone
    (the process-group construction `weight_sync` uses, on this torch and NCCL)."""
    weights = random_weights(source, "cuda:0")
    torch.cuda.set_device(0)
    sender = WeightSender("127.0.0.1", receivers=0, backend="nccl")
    sender.connect()
    sender.send(weights, tensor_specs(weights))
    torch.cuda.synchronize()
    sender.close()
    print("NCCL weight group: formed and broadcast on its one rank")


def vllm_actor_check(source: Path) -> None:
    """One vLLM rollout actor on the GPU: sample, take a broadcast push, score the canary."""
    import ray

    from agent_grpo.models.loading import load_model
    from agent_grpo.rollout.backends.base import SamplingConfig
    from agent_grpo.rollout.backends.factory import EngineLimits
    from agent_grpo.rollout.backends.hf import HFBackend
    from agent_grpo.rollout.collector import CollectOptions, Task
    from agent_grpo.rollout.config import RolloutConfig, VLLMBackendConfig
    from agent_grpo.rollout.ray_pool import RayRolloutPool

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        torch.manual_seed(0)
        LlamaForCausalLM(AutoConfig.from_pretrained(source)).save_pretrained(model_dir)
        tokenizer = AutoTokenizer.from_pretrained(source)
        tokenizer.save_pretrained(model_dir)
        collector = CollectOptions.from_config(
            RolloutConfig(
                group_size=2, max_context_tokens=512, sampling=SamplingConfig(max_tokens=32)
            )
        )
        ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False,
                 log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(Path.cwd())}})  # fmt: skip
        try:
            start = time.perf_counter()
            pool = RayRolloutPool(1, str(model_dir), VLLMBackendConfig(gpu_memory_utilization=0.3),
                                  collector, limits=EngineLimits(max_seqs=4, max_len=512),
                                  num_gpus_per_worker=1, weight_sync="broadcast")  # fmt: skip
            tasks = [Task(env_id="agent_grpo/Calculator-v0", seed=s) for s in (1, 2)]
            result = pool.collect(tasks, step=0, run_id="device")
            assert len(result.records) == 4 and result.metrics.generated_tokens > 0
            print(
                f"vLLM actor: engine up and 4 episodes sampled in "
                f"{time.perf_counter() - start:.1f} s, {result.metrics.generated_tokens} tokens"
            )
            model = load_model(str(model_dir))
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.02 * torch.randn_like(param))
            start = time.perf_counter()
            pool.update_weights(model.state_dict(), version=1)
            sequences = [r.token_ids for r in result.records[:2]]
            targets = [[p == "model" for p in r.provenance] for r in result.records[:2]]
            [(version, scores)] = pool.score(sequences, targets)
            print(
                f"vLLM actor: push of {pool.last_push_bytes / 2**20:.0f} MiB and canary in "
                f"{time.perf_counter() - start:.2f} s"
            )
            want = HFBackend(model, tokenizer).score(sequences, targets, 1.0)
            gaps = [abs(a - b) for row, wrow, trow in zip(scores, want, targets, strict=True)
                    for a, b, t in zip(row, wrow, trow, strict=True) if t]  # fmt: skip
            gap = sum(gaps) / len(gaps)
            assert version == 1 and gap < 0.05, (version, gap)
            print(
                f"vLLM actor: holds version 1; canary gap to the trainer (CPU fp32) mean "
                f"{gap:.2e}, max {max(gaps):.2e}"
            )
            pool.close()
        finally:
            ray.shutdown()


def main() -> None:
    """Each check this machine can run."""
    assert torch.cuda.is_available(), "no CUDA device"
    source = Path(sys.argv[1])
    push_check("gloo push from CUDA weights", source, "gloo", "cpu")
    if torch.cuda.device_count() < 2:
        nccl_alone_check(source)
        skip("NCCL push", f"{torch.cuda.device_count()} GPU here; NCCL needs a device per rank")
    else:
        push_check("NCCL push", source, "nccl", "cuda:1")
    missing = [m for m in ("vllm", "ray") if importlib.util.find_spec(m) is None]
    if missing:
        skip("vLLM actor", f"{' and '.join(missing)} not importable on this machine")
    else:
        vllm_actor_check(source)


if __name__ == "__main__":
    main()
