"""A rollout worker's engine and how it takes a weight push: into the torch model an `hf` backend
samples from, by name into a vLLM engine, or as a LoRA adapter (`agent_grpo/rollout/adapters.py`).

A push is a mapping of names to tensors: the policy's parameters under their Hugging Face names
(full fine-tuning), or the adapter's tensors under peft's names (LoRA). Whichever way they
travelled (`agent_grpo/rollout/ray_pool.py`), `EngineWeights.load` makes the engine sample with
them and drops whatever it cached with the old ones.

A vLLM worker holds no torch copy of the model: the engine loads the pushed tensors itself
(`VLLMBackend.load_weights`), so the worker's memory is the engine's.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from agent_grpo.config.jobs import LoraSettings
from agent_grpo.models.loading import load_model
from agent_grpo.rollout.adapters import (
    load_adapter_state,
    lora_config,
    vllm_lora_args,
    write_adapter,
)
from agent_grpo.rollout.backends.base import GenerationBackend
from agent_grpo.rollout.backends.factory import EngineLimits, build_backend, build_vllm
from agent_grpo.rollout.backends.vllm import VLLMBackend
from agent_grpo.rollout.config import BackendConfig, VLLMBackendConfig

__all__ = ["EngineSpec", "EngineWeights", "load_into_model", "start_engine"]


class EngineWeights(Protocol):
    """Where a worker's pushes go."""

    def load(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Make the engine sample with `weights` (policy `version`) from now on."""
        ...

    def close(self) -> None:
        """Release what the weights hold outside the engine (adapter directories)."""
        ...


def load_into_model(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy `weights` into `model` by state-dict name; every parameter must receive a value
    (under its own name or a tied alias's) and every name must be the model's."""
    state = model.state_dict(keep_vars=True)
    unknown = [name for name in weights if name not in state]
    if unknown:
        raise KeyError(f"pushed weights the model does not have: {unknown[:3]}")
    landed = set()
    with torch.no_grad():
        for name, tensor in weights.items():
            state[name].copy_(tensor)
            landed.add(id(state[name]))
    missing = [n for n, p in model.named_parameters() if id(p) not in landed]
    if missing:
        raise KeyError(f"a push left parameters without a value: {missing[:3]}")


@dataclass
class ModelWeights:
    """An `hf` engine: the backend samples from `model`, which takes the pushes (a peft model
    with LoRA, which takes the adapter's)."""

    model: torch.nn.Module
    """The model the backend samples from."""
    backend: GenerationBackend
    """The backend over it."""
    adapter: bool
    """Whether `model` is a peft model and pushes are its adapter."""

    def load(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Copy into the model, then let the backend drop what it cached with the old ones."""
        if self.adapter:
            load_adapter_state(self.model, weights)
        else:
            load_into_model(self.model, weights)
        self.backend.update_weights(self.model)

    def close(self) -> None:
        """Nothing outside the model."""


@dataclass
class VLLMWeights:
    """A `vllm` engine: full weights go in by name; an adapter is written to a local directory
    per version and the engine switches to it, keeping the newest `keep` versions."""

    backend: VLLMBackend
    """The engine."""
    lora: LoraSettings | None
    """The adapter's settings when pushes are adapters."""
    keep: int = 1
    """Adapter versions kept on disk (the engine keeps as many loaded: `max_loras`)."""
    directory: Path | None = None
    """Where adapter versions are written (made on the first one)."""

    def load(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Load full weights into the engine, or save the adapter and switch to it."""
        if self.lora is None:
            self.backend.load_weights(list(weights.items()))
            return
        if self.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="agent-grpo-adapters-"))
        path = write_adapter(self.directory / f"v{version}", self.lora, weights)
        self.backend.use_adapter(path, adapter_id=version + 1)  # vLLM's ids start at 1
        shutil.rmtree(self.directory / f"v{version - self.keep}", ignore_errors=True)

    def close(self) -> None:
        """Remove the adapter directories."""
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


@dataclass(frozen=True)
class EngineSpec:
    """What a rollout worker's engine is built from (the pool hands each actor one)."""

    model_path: str
    """The model's directory or hub id."""
    backend: BackendConfig
    """Which engine samples (`hf` or `vllm`) and its settings."""
    limits: EngineLimits
    """Context and token limits the engine is sized for."""
    dtype: str = "float32"
    """The torch dtype an `hf` engine loads the model in."""
    lora: LoraSettings | None = None
    """With LoRA, the adapter the pushes carry (the base model stays as loaded)."""
    adapters: int = 1
    """How many adapter versions a vLLM engine with LoRA keeps loaded."""


def start_engine(spec: EngineSpec, tokenizer: object) -> tuple[GenerationBackend, EngineWeights]:
    """A worker's backend over `spec`'s model (with `lora`, the base model under a fresh
    adapter, whose values the first push sets) and where its pushes go."""
    backend, lora = spec.backend, spec.lora
    if isinstance(backend, VLLMBackendConfig):
        if lora is not None:
            kwargs = {**backend.engine_kwargs, **vllm_lora_args(lora, spec.adapters)}
            backend = backend.model_copy(update={"engine_kwargs": kwargs})
        vllm = build_vllm(backend, spec.model_path, spec.limits)
        return vllm, VLLMWeights(vllm, lora, keep=spec.adapters)
    model = load_model(spec.model_path, dtype=getattr(torch, spec.dtype))
    if lora is not None:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(lora))
    engine = build_backend(backend, model, tokenizer, spec.model_path, None, spec.limits)
    return engine, ModelWeights(model, engine, adapter=lora is not None)
