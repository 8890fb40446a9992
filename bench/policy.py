"""The policy the rollout benchmark samples from: the embedded model, or it after a warm start.

The base SmolLM2-135M-Instruct never emits a tool call, so every episode is one turn and a
"multi-turn" benchmark would measure single-turn decoding. The policy that actually generates
rollouts in `agent-grpo train` is the warm-started one (a supervised pass on expert episodes),
which calls tools and runs 2-5 turns. `warm` rebuilds that here, the same way `train.warm_start`
does (expert demos of Calculator-v0 and Search-v0, one epoch, batch 8, lr 1e-4), and caches it
under `$AGENT_GRPO_HOME/bench/` so later runs reuse it. The weights never change during a
benchmark: it measures generation, not learning.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

from agent_grpo.models.loading import agent_grpo_home, resolve_model_path

__all__ = ["WARM_ENVS", "policy_path", "warm_start_dir"]

WARM_ENVS = ("agent_grpo/Calculator-v0", "agent_grpo/Search-v0")
_STAMP = ".complete"


def warm_start_dir(demos_per_env: int, seed: int) -> Path:
    """Where the warm-started policy for these settings is cached."""
    return agent_grpo_home() / "bench" / f"warm-smollm2-{demos_per_env}x{len(WARM_ENVS)}-s{seed}"


def _build_warm(out: Path, demos_per_env: int, seed: int) -> dict[str, Any]:
    """Supervised pass on expert episodes of every env in WARM_ENVS; saves model + tokenizer."""
    from agent_grpo.envs.text_env import train_seeds
    from agent_grpo.models.loading import load_model, load_tokenizer
    from agent_grpo.trainer.warm_start import expert_record, train_sft

    started = time.perf_counter()
    tokenizer = load_tokenizer("smollm2-135m-instruct")
    model = load_model("smollm2-135m-instruct")
    rng = random.Random(seed)
    demos = [
        expert_record(tokenizer, env_id, s)
        for env_id in WARM_ENVS
        for s in train_seeds(demos_per_env, rng)
    ]
    losses = train_sft(
        model, demos, pad_id=tokenizer.pad_token_id, epochs=1, batch_size=8, lr=1e-4, seed=seed
    )
    staged = out.with_name(out.name + ".partial")
    shutil.rmtree(staged, ignore_errors=True)  # left by an interrupted build
    model.eval().save_pretrained(staged)
    tokenizer.save_pretrained(staged)
    info = {"demos": len(demos), "sft_nll": losses, "build_s": time.perf_counter() - started}
    (staged / _STAMP).write_text(json.dumps(info))
    staged.rename(out)
    return info


def policy_path(kind: str, *, demos_per_env: int = 16, seed: int = 0) -> tuple[str, dict[str, Any]]:
    """Model directory for `base` or `warm` (built and cached on first use), and how it was made."""
    if kind == "base":
        return resolve_model_path("smollm2-135m-instruct"), {"policy": "base"}
    if kind != "warm":
        raise ValueError(f"policy must be base or warm, got {kind!r}")
    out = warm_start_dir(demos_per_env, seed)
    if (out / _STAMP).exists():
        info = json.loads((out / _STAMP).read_text())
        return str(out), {"policy": "warm", "cached": True, **info}
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out, ignore_errors=True)  # no stamp: incomplete
    info = _build_warm(out, demos_per_env, seed)
    return str(out), {"policy": "warm", "cached": False, **info}
