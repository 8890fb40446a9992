"""The measured side of `rollout_throughput.py`: each method runs in its own fresh process.

Methods:
- `hf`, `vllm`, `openai`: `collect_groups` with that backend (for `openai`, against a `vllm serve`
  this worker starts on 127.0.0.1 and stops again).
- `naive`: what one writes without a rollout engine: for each trajectory, one at a time, and each
  turn, render the whole conversation with the chat template, re-encode it, and `model.generate`.
- `ceiling`: no environment, no orchestration: a plain batched prefill + KV-cache decode loop on
  random token ids that replays a measured run's schedule (see `replay_ceiling`).

The ceiling prefills only what a perfect prefix cache would have to (each row's tokens that are new
since its own previous turn) and its decode attends over those tokens only, so it is an upper bound
on speed: real decoding also attends over the cached context. It samples by argmax.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

from agent_grpo.config.base import ConfigModel
from agent_grpo.envs.registry import make_env
from agent_grpo.envs.text_env import read_step_info, train_seeds
from agent_grpo.models.loading import load_model, load_tokenizer
from agent_grpo.rollout.backends.base import Generation, GenerationBackend, SamplingConfig
from agent_grpo.rollout.collector import CollectOptions, Task, collect_groups
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.testing.vllm_serve import vllm_server

__all__ = [
    "RolloutSpec",
    "TracingBackend",
    "perfect_cache_schedule",
    "replay_ceiling",
    "run_worker",
]

Schedule = list[list[tuple[int, int]]]
"""Per backend call, per row: (tokens to prefill with a perfect prefix cache, tokens generated)."""


class RolloutSpec(ConfigModel):
    """The workload every method runs, identically."""

    env_ids: list[str]
    """Environments to roll out in."""
    tasks: int
    """Distinct tasks per environment."""
    group_size: int
    """Trajectories per task."""
    max_tokens: int
    """Most tokens per assistant turn."""
    max_context: int
    """Longest episode in tokens."""
    temperature: float
    """Sampling temperature."""
    top_p: float
    """Nucleus mass."""
    seed: int
    """Seed of the task list and of sampling."""
    model_path: str
    """The policy's model directory."""
    kv_cache_mb: int
    """vLLM KV-cache size (CPU), MiB."""
    server_timeout_s: float
    """How long `vllm serve` may take to become healthy."""
    schedules: dict[str, Schedule] = {}
    """For `ceiling`: the schedule to replay, per environment."""

    def task_list(self, env_id: str) -> list[Task]:
        """The same tasks for every method."""
        rng = random.Random(f"bench-rollout/{self.seed}")
        return [Task(env_id=env_id, seed=s) for s in train_seeds(self.tasks, rng)]

    def sampling(self, env_id: str) -> SamplingConfig:
        """Sampling settings, with the environment's stop strings."""
        env = make_env(env_id)
        try:
            stop = list(getattr(env.unwrapped, "stop_strings", []))
        finally:
            env.close()
        return SamplingConfig(
            temperature=self.temperature,
            top_p=self.top_p,
            max_tokens=self.max_tokens,
            stop=stop,
            seed=self.seed,
        )


class TracingBackend:
    """A backend wrapper that keeps every call's prompts and sampled ids (for the ceiling)."""

    def __init__(self, inner: GenerationBackend) -> None:
        self.inner = inner
        self.calls: list[list[tuple[list[int], list[int]]]] = []

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        """Delegate, and remember (prompt, sampled ids) of every row."""
        generations = self.inner.generate(prompts, sampling, seeds)
        self.calls.append(
            [(list(p), list(g.token_ids)) for p, g in zip(prompts, generations, strict=True)]
        )
        return generations

    def update_weights(self, model: torch.nn.Module) -> None:
        """Delegate."""
        self.inner.update_weights(model)

    def free_caches(self) -> None:
        """Delegate."""
        self.inner.free_caches()

    def close(self) -> None:
        """Delegate."""
        self.inner.close()


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differs = a[:n] != b[:n]  # [n]
    return int(differs.argmax()) if differs.any() else n


def perfect_cache_schedule(calls: list[list[tuple[list[int], list[int]]]]) -> Schedule:
    """Each row's prefill under a perfect prefix cache (always at least one token) and output."""
    seen: list[np.ndarray] = []
    schedule: Schedule = []
    for call in calls:
        rows = []
        for prompt, generated in call:
            query = np.asarray(prompt[:-1])
            reuse = max((_common_prefix(query, s) for s in seen), default=0)
            rows.append((len(prompt) - reuse, len(generated)))
        seen += [np.asarray(prompt + generated[:-1]) for prompt, generated in call]
        schedule.append(rows)
    return schedule


@torch.inference_mode()
def replay_ceiling(model: PreTrainedModel, schedule: Schedule, seed: int = 0) -> float:
    """Seconds for a plain batched prefill + decode loop doing `schedule`'s work (see module)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = int(model.config.vocab_size)
    total = 0.0
    for call in schedule:
        lengths = [g for _, g in call if g > 0]
        if not lengths:
            continue
        prefill = max(1, round(sum(p for p, g in call if g > 0) / len(lengths)))
        ids = torch.randint(3, vocab, (len(lengths), prefill), generator=generator)  # [B, P]
        started = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1)  # token: [B]
        alive = list(range(len(lengths)))
        for step in range(1, max(lengths)):  # the first token came from the prefill logits
            keep = [i for i, row in enumerate(alive) if lengths[row] > step]
            if len(keep) < len(alive):
                cache.batch_select_indices(torch.tensor(keep))
                token, alive = token[keep], [alive[i] for i in keep]
            out = model(input_ids=token[:, None], past_key_values=cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1)  # [B']
        total += time.perf_counter() - started
    return total


def _collect(backend: GenerationBackend, tokenizer: Any, spec: RolloutSpec, env_id: str) -> dict:
    """One timed `collect_groups` over the spec's tasks; its metrics and replayable schedule."""
    traced = TracingBackend(backend)
    config = CollectOptions.from_config(
        RolloutConfig(
            group_size=spec.group_size,
            max_context_tokens=spec.max_context,
            sampling=spec.sampling(env_id),
        )
    )
    result = collect_groups(spec.task_list(env_id), traced, tokenizer, config)
    m = result.metrics
    schedule = perfect_cache_schedule(traced.calls)
    return {
        "trajectories": m.trajectories,
        "generated_tokens": m.generated_tokens,
        "wall_s": m.wall_time_s,
        "tokens_per_s": m.tokens_per_s,
        "model_s": m.model_time_s,
        "env_s": m.env_time_s,
        "turns_mean": m.turns_mean,
        "tool_calls": m.tool_calls,
        "truncated": m.truncated,
        "errors": m.errors,
        "success_rate": sum(r.success for r in result.records) / max(1, len(result.records)),
        "reused_prefix_tokens": m.reused_prefix_tokens,
        "perfect_cache_prefill_tokens": sum(p for call in schedule for p, _ in call),
        "schedule": schedule,
    }


def _warm_up(backend: GenerationBackend) -> None:
    """One short call, so one-time set-up (allocations, kernel selection) is not timed."""
    backend.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingConfig(max_tokens=4), [0])


def _collect_all(backend: GenerationBackend, spec: RolloutSpec) -> dict[str, dict]:
    tokenizer = load_tokenizer(spec.model_path)
    _warm_up(backend)
    return {env_id: _collect(backend, tokenizer, spec, env_id) for env_id in spec.env_ids}


def worker_hf(spec: RolloutSpec) -> dict[str, Any]:
    """Our in-process batched backend with its KV prefix cache."""
    from agent_grpo.rollout.backends.hf import HFBackend

    started = time.perf_counter()
    backend = HFBackend(load_model(spec.model_path), load_tokenizer(spec.model_path))
    startup = time.perf_counter() - started
    envs = _collect_all(backend, spec)
    backend.prefix_cache.clear()
    return {"startup_s": startup, "envs": envs}


def worker_vllm(spec: RolloutSpec) -> dict[str, Any]:
    """The in-process vLLM engine (CPU build here)."""
    from agent_grpo.rollout.backends.vllm import VLLMBackend

    backend = VLLMBackend(
        spec.model_path,
        max_model_len=spec.max_context,
        kv_cache_memory_bytes=spec.kv_cache_mb << 20,
        enforce_eager=True,  # CUDA graphs / torch.compile: minutes of start-up on CPU
    )
    try:
        return {"startup_s": backend.start_time_s, "envs": _collect_all(backend, spec)}
    finally:
        backend.close()


def worker_openai(spec: RolloutSpec) -> dict[str, Any]:
    """`OpenAIBackend` against a `vllm serve` started here (start-up reported, not timed)."""
    from agent_grpo.rollout.backends.openai import OpenAIBackend

    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-vllm-serve-{os.getpid()}.log"
    started = time.perf_counter()
    flags = ["--max-model-len", str(spec.max_context), "--kv-cache-memory-bytes",
             str(spec.kv_cache_mb << 20)]  # fmt: skip
    with vllm_server(spec.model_path, flags, log, spec.server_timeout_s) as url:
        startup = time.perf_counter() - started
        rows = spec.tasks * spec.group_size
        backend = OpenAIBackend(url, "bench", timeout_s=600.0, max_concurrency=rows)
        try:
            envs = _collect_all(backend, spec)
        finally:
            backend.close()
    log.unlink()  # kept only when the server failed: its errors are in the raised message too
    return {"startup_s": startup, "envs": envs}


def _naive_episode(model: Any, tokenizer: Any, task: Task, spec: RolloutSpec, seed: int) -> dict:
    """One trajectory, re-rendering and re-encoding the whole conversation every turn."""
    from transformers import GenerationConfig

    sampling = spec.sampling(task.env_id)
    config = GenerationConfig(
        do_sample=spec.temperature > 0, temperature=spec.temperature or 1.0, top_p=spec.top_p,
        top_k=0, max_new_tokens=spec.max_tokens, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, stop_strings=sampling.stop or None,
    )  # fmt: skip
    env = make_env(task.env_id)
    messages, _ = env.reset(seed=task.seed)
    tokens = turns = calls = 0
    success = False
    while True:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids  # [1, T]
        if ids.shape[1] >= spec.max_context:
            break
        torch.manual_seed(seed + turns)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=config, tokenizer=tokenizer
        )  # [1, T + n]
        new = out[0, ids.shape[1] :].tolist()
        tokens, turns = tokens + len(new), turns + 1
        reply = tokenizer.decode(new, skip_special_tokens=True)
        stopped = new[-1] == tokenizer.eos_token_id or any(s in reply for s in sampling.stop)
        if not stopped:  # cut at max_tokens: the collector ends such an episode too
            break
        observation, _, terminated, truncated, info = env.step(reply)
        calls += len(read_step_info(info).tool_calls)
        messages = [*messages, {"role": "assistant", "content": reply}, *observation]
        if terminated or truncated:
            success = bool(read_step_info(info).success)
            break
    env.close()
    return {"tokens": tokens, "turns": turns, "tool_calls": calls, "success": success}


def worker_naive(spec: RolloutSpec) -> dict[str, Any]:
    """The naive loop: one trajectory at a time, whole conversation re-encoded every turn."""
    model: Any = load_model(spec.model_path)
    tokenizer = load_tokenizer(spec.model_path)
    warm = tokenizer("hello", return_tensors="pt").input_ids
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False)
    envs = {}
    for env_id in spec.env_ids:
        started = time.perf_counter()
        episodes = [
            _naive_episode(model, tokenizer, task, spec, seed=spec.seed * 1000 + 10 * t + j)
            for t, task in enumerate(spec.task_list(env_id))
            for j in range(spec.group_size)
        ]
        wall = time.perf_counter() - started
        tokens = sum(e["tokens"] for e in episodes)
        envs[env_id] = {
            "trajectories": len(episodes),
            "generated_tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "turns_mean": sum(e["turns"] for e in episodes) / len(episodes),
            "tool_calls": sum(e["tool_calls"] for e in episodes),
            "success_rate": sum(e["success"] for e in episodes) / len(episodes),
        }
    return {"startup_s": 0.0, "envs": envs}


def worker_ceiling(spec: RolloutSpec) -> dict[str, Any]:
    """Replay each environment's schedule with no environment and no orchestration."""
    model = load_model(spec.model_path)
    replay_ceiling(model, [[(8, 4)]])  # warm-up, untimed
    envs = {}
    for env_id, schedule in spec.schedules.items():
        seconds = replay_ceiling(model, schedule, seed=spec.seed)
        tokens = sum(g for call in schedule for _, g in call)
        envs[env_id] = {
            "generated_tokens": tokens,
            "wall_s": seconds,
            "tokens_per_s": tokens / seconds,
            "batch_calls": len(schedule),
            "prefill_tokens": sum(p for call in schedule for p, g in call if g > 0),
        }
    return {"startup_s": 0.0, "envs": envs}


WORKERS = {
    "hf": worker_hf,
    "vllm": worker_vllm,
    "openai": worker_openai,
    "naive": worker_naive,
    "ceiling": worker_ceiling,
}


def run_worker(method: str, spec: RolloutSpec) -> dict[str, Any]:
    """Run one method's measurement in this (fresh) process."""
    return WORKERS[method](spec)
