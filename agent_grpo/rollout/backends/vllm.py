"""The `vllm` generation backend: an in-process `vllm.LLM` fed token ids, never text.

Where we depart from the usual way of running vLLM for RL:
- The engine runs inside this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so `update_weights`
  hands the trainer's tensors straight to the worker's `reload_weights`: no checkpoint on disk, no
  NCCL weight-transfer group. The price is that the engine loop shares the trainer's process.
  Inside a Ray rollout actor the same engine takes the tensors the actor received
  (`load_weights`; agent_grpo/rollout/weight_sync.py), and a LoRA adapter as a directory in
  peft's format (`use_adapter`), run with vLLM's own LoRA support.
- `logprobs_mode="processed_logprobs"` is forced. vLLM's default returns logprobs of the raw
  logits, not of the temperature/top-k/top-p distribution a token was actually drawn from.
  Under greedy sampling (temperature 0) vLLM returns the logprob under the unscaled logits.
- Stop strings are matched on text that keeps special tokens and are kept in the output, so the
  returned ids end exactly where sampling stopped (the last id may run past the stop string).
- Besides the model's EOS, every request stops on the chat template's turn end
  (`trajectory.tokens.turn_end_ids`, as `stop_token_ids`): vLLM alone stops on EOS only, which
  need not close a turn.
- Every prompt gets its own `SamplingParams` with its own seed, so a trajectory's random draws do
  not depend on which other prompts share its batch.
- On CPU, vLLM's worker replaces `torch.set_num_threads` with a no-op (in-process, that also blocks
  vLLM's own drop to 1 serving thread), so the thread count must be chosen before the engine
  starts (`cpu_threads`); `close` puts the real function back. On a busy 2-core box, 1 thread
  decodes several times faster than 2 (docs/backends.md, "Threads").
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

from agent_grpo.rollout.backends.base import Generation, SamplingConfig
from agent_grpo.trajectory.tokens import turn_end_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput

__all__ = [
    "LORA_PROMPT_LOGPROBS",
    "VLLMBackend",
    "VLLMBackendError",
    "cpu_head_size_problem",
    "model_head_size",
    "repack_cpu_lm_head",
    "to_generation",
    "to_sampling_params",
    "trainer_weights",
]

_LOGPROBS_MODE = "processed_logprobs"
LORA_PROMPT_LOGPROBS = (
    "vLLM cannot score given ids under a LoRA adapter: its prompt logprobs apply the adapter's "
    "logits mapping per sequence, not per token (the CPU build fails; vllm-project/vllm#29955, "
    "#51594)"
)
"""Why `VLLMBackend.score` refuses to run with an adapter (the weight canary needs it)."""
EngineDType = Literal["auto", "float16", "bfloat16", "float32"]
_FINISH_REASONS: dict[str | None, Literal["stop", "length"]] = {"stop": "stop", "length": "length"}


class VLLMBackendError(RuntimeError):
    """The vLLM engine could not be set up or returned something we cannot use."""


def to_sampling_params(
    sampling: SamplingConfig, seed: int, stop_token_ids: Sequence[int] = ()
) -> SamplingParams:
    """vLLM sampling parameters for one prompt: our config, this prompt's seed, sampled logprob,
    and the ids it stops on besides EOS (kept as the last id)."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,  # vLLM also reads 0 as "disabled"
        max_tokens=sampling.max_tokens,
        stop=list(sampling.stop) or None,
        include_stop_str_in_output=True,
        stop_token_ids=list(stop_token_ids),
        skip_special_tokens=False,
        seed=seed,
        logprobs=0,  # only the sampled token's logprob, not a top-k list
    )


def to_generation(output: CompletionOutput) -> Generation:
    """Our `Generation` from one vLLM completion: exact ids, sampled-token logprobs, reason."""
    token_ids = list(output.token_ids)
    if output.logprobs is None or len(output.logprobs) != len(token_ids):
        raise VLLMBackendError("vLLM returned no logprob for some sampled token")
    finish_reason = _FINISH_REASONS.get(output.finish_reason)
    if finish_reason is None:
        raise VLLMBackendError(f"generation ended with finish_reason={output.finish_reason!r}")
    logprobs = [output.logprobs[i][tok].logprob for i, tok in enumerate(token_ids)]
    return Generation(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=finish_reason,
        text=output.text,
    )


def trainer_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainer model's parameters in Hugging Face checkpoint naming, detached."""
    # named_parameters drops the second name of tied weights (lm_head), as save_pretrained does.
    return [(name, param.detach()) for name, param in model.named_parameters()]


def repack_cpu_lm_head(model: torch.nn.Module) -> int:
    """Rebuild the CPU GEMM's packed copy of the LM head from its current weight; returns count.

    On CPU, vLLM packs the LM head weight into a private copy at load time. `reload_weights`
    re-packs only layers that received weights, and a head tied to the embeddings receives none,
    so without this the engine samples from the old head (how far off: docs/benchmarks.md).
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    heads = [head for head in heads if hasattr(head, "cpu_linear")]  # only the CPU GEMM packs
    for head in heads:
        head.quant_method.process_weights_after_loading(head)
    return len(heads)


def model_head_size(model_config: dict[str, Any]) -> int | None:
    """The attention head size a Hugging Face `config.json` describes (a multimodal model's text
    part: `text_config`); None when it names neither `head_dim` nor the sizes it follows from."""
    text = model_config.get("text_config") or model_config
    if text.get("head_dim"):
        return int(text["head_dim"])
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    return int(hidden) // int(heads) if hidden and heads else None


def cpu_head_size_problem(model_config: dict[str, Any], model: str) -> str | None:
    """Why vLLM's CPU attention cannot run `model` (whose `config.json` is `model_config`): its
    head size is not one the installed vLLM's CPU kernels take. Without this, vLLM starts and
    the first request or weight push fails far from the cause."""
    size, supported = model_head_size(model_config), _cpu_attention_head_sizes()
    if size is None or supported is None or size in supported:
        return None
    return (
        f"the vllm backend cannot run {model!r} on CPU: its attention head size is {size}, and "
        f"this vLLM's CPU attention takes {', '.join(map(str, supported))}; use the hf backend"
    )


def _cpu_attention_head_sizes() -> list[int] | None:
    """The head sizes the installed vLLM's CPU attention takes; None where this vLLM keeps them
    elsewhere (a private module: the check then passes rather than block a run that may work).
    Its import warns that Triton has no CPU backend; a check that finds nothing wrong must not
    print, so vLLM's logger is held at errors for the import (its own configuration runs first,
    in `vllm.logger`)."""
    import logging

    import vllm.logger  # noqa: F401  (configures vLLM's loggers, which the import below uses)

    vllm_log = logging.getLogger("vllm")
    level = vllm_log.level
    vllm_log.setLevel(logging.ERROR)
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())
    except (ImportError, AttributeError):
        return None
    finally:
        vllm_log.setLevel(level)


def _require_in_process_engine() -> None:
    """Make vLLM build its engine in this process; fail if an earlier engine fixed it otherwise."""
    import vllm.envs

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # vLLM caches its env vars once the first engine starts; then our setting may come too late.
    if vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING:
        raise VLLMBackendError(
            "VLLMBackend needs an in-process engine, but vLLM already cached "
            "VLLM_ENABLE_V1_MULTIPROCESSING=1 in this process; set it to 0 before starting vLLM"
        )


class VLLMBackend:
    """Generation with an in-process vLLM engine; weights are pushed from the trainer in memory."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: EngineDType = "float32",
        max_model_len: int = 4096,
        gpu_memory_utilization: float = 0.5,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        cpu_threads: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        """Start the engine; `engine_kwargs` go to `vllm.LLM` (e.g. `kv_cache_memory_bytes`).

        `cpu_threads` sets torch's intra-op threads before the engine starts: vLLM's CPU worker
        then freezes `torch.set_num_threads` for the whole process until `close`.
        `stop_token_ids` default to `turn_end_ids` of the engine's tokenizer.
        """
        mode = engine_kwargs.pop("logprobs_mode", _LOGPROBS_MODE)
        if mode != _LOGPROBS_MODE:
            raise VLLMBackendError(f"logprobs_mode must be {_LOGPROBS_MODE!r}, got {mode!r}")
        _require_in_process_engine()
        from vllm import LLM

        self._set_num_threads = torch.set_num_threads
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        start = time.perf_counter()
        self._llm: LLM | None = LLM(
            str(model_path),
            dtype=dtype,
            max_model_len=max_model_len,
            # On GPU this leaves room for the trainer; on CPU it is ignored once
            # kv_cache_memory_bytes (or VLLM_CPU_KVCACHE_SPACE) sizes the cache.
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            logprobs_mode=_LOGPROBS_MODE,
            **engine_kwargs,
        )
        # Seconds to load weights, allocate the KV cache and warm up; reported in docs/backends.md.
        self.start_time_s = time.perf_counter() - start
        if stop_token_ids is None:
            # A Hugging Face model's engine tokenizer is its (cached) transformers tokenizer.
            engine_tokenizer = cast("PreTrainedTokenizerBase", self._llm.get_tokenizer())
            stop_token_ids = turn_end_ids(engine_tokenizer).stop_ids
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        """Ids every request stops on (kept as its last id), besides the model's EOS."""
        self.adapter: LoRARequest | None = None
        """The LoRA adapter every request runs with (`use_adapter`); None: the base weights."""

    @property
    def llm(self) -> LLM:
        """The underlying `vllm.LLM`; raises once the backend is closed."""
        if self._llm is None:
            raise VLLMBackendError("the vLLM backend is closed")
        return self._llm

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        """Continue every prompt once; `seeds[i]` seeds prompt i's sampling."""
        from vllm.inputs import TokensPrompt

        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if not prompts:
            return []
        requests = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts]
        params = [to_sampling_params(sampling, seed, self.stop_token_ids) for seed in seeds]
        start = time.perf_counter()
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.adapter)
        batch_s = time.perf_counter() - start
        generations = [to_generation(out.outputs[0]) for out in outputs]
        for generation in generations:
            generation.extra["batch_generate_s"] = batch_s
        return generations

    def update_weights(self, model: torch.nn.Module) -> None:
        """Copy the trainer's weights into the engine, then drop KV blocks cached with old ones."""
        self.load_weights(trainer_weights(model))

    def load_weights(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as in the Hugging Face checkpoint (all of the model's, or some)
        into the engine, then drop KV blocks cached with the old weights."""
        self.llm.collective_rpc(
            "reload_weights",
            kwargs={"weights_iterator": list(weights), "is_checkpoint_format": True},
        )
        self.llm.apply_model(repack_cpu_lm_head)
        # Without this, a prompt prefix seen before the update reuses KV from the old weights.
        if not self.llm.reset_prefix_cache():
            raise VLLMBackendError("vLLM refused to reset its prefix cache (requests running?)")

    def use_adapter(self, path: str | Path, adapter_id: int) -> None:
        """Sample and score with the LoRA adapter saved at `path` (peft's format) from now on;
        `adapter_id` (>= 1) names this version of it. The engine must have been started with
        LoRA enabled (`enable_lora`); it keeps the most recent `max_loras` versions loaded.
        KV cached under another adapter is never reused for this one (vLLM keys its prefix
        cache by adapter)."""
        from vllm.lora.request import LoRARequest

        self.adapter = LoRARequest(f"adapter-{adapter_id}", adapter_id, str(path))

    def score(
        self, sequences: list[list[int]], targets: list[list[bool]], temperature: float
    ) -> list[list[float]]:
        """Per-token logprobs of given ids (the `GenerationBackend` contract): vLLM's prompt
        logprobs of each sequence, one token generated and thrown away. Not under a LoRA
        adapter (`use_adapter`): see `LORA_PROMPT_LOGPROBS`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.adapter is not None:
            raise VLLMBackendError(LORA_PROMPT_LOGPROBS)
        params = SamplingParams(max_tokens=1, temperature=temperature, prompt_logprobs=0,
                                detokenize=False)  # fmt: skip
        requests = [TokensPrompt(prompt_token_ids=list(ids)) for ids in sequences]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        out = []
        for output, ids, wanted in zip(outputs, sequences, targets, strict=True):
            scored = output.prompt_logprobs  # per position, {id: Logprob}; None at position 0
            if scored is None or len(scored) != len(ids):
                raise VLLMBackendError("vLLM returned no prompt logprobs for a canary sequence")
            row = []
            for position, token, want in zip(scored, ids, wanted, strict=True):
                row.append(position[token].logprob if want and position is not None else 0.0)
            out.append(row)
        return out

    def free_caches(self) -> None:
        """Nothing: the engine's KV cache (its prefix cache included) is allocated once, at its
        configured size, and kept."""

    def close(self) -> None:
        """Shut the engine down and free its memory; later calls raise `VLLMBackendError`."""
        if self._llm is None:
            return
        self._llm.llm_engine.engine_core.shutdown()
        self._llm = None
        torch.set_num_threads = self._set_num_threads
        gc.collect()
