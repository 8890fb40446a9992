"""The in-process vLLM backend against plain Hugging Face forwards.

Engine tests run vLLM's CPU build on a tiny Llama (head_dim 32: the smallest head size the CPU
attention kernels accept) and on the embedded SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerBase

from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.backends.hf import HFBackend
from agent_grpo.rollout.collector import CollectOptions
from agent_grpo.testing.tiny_model import save_tiny_llama

pytest.importorskip("vllm")

from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput

from agent_grpo.rollout.backends.vllm import (
    VLLMBackend,
    VLLMBackendError,
    to_generation,
    to_sampling_params,
)

pytestmark = pytest.mark.vllm

EOS = 2  # <|im_end|>
TINY_KV_BYTES = 64 << 20
SMOL_KV_BYTES = 256 << 20  # 30 layers x 3 KV heads x 64 dims x fp32: ~94 MB for 2048 tokens


def hf_next_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Full-vocab log-softmax of the next-token logits at every position of `ids`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # [T, V]
    return logits.log_softmax(-1)  # [T, V]


def sampled_logprobs(model: torch.nn.Module, prompt: list[int], sampled: list[int]) -> list[float]:
    """Trainer-side recomputation: logprob of each sampled token at temperature 1."""
    logprobs = hf_next_logprobs(model, prompt + sampled)  # [T, V]
    positions = range(len(prompt) - 1, len(prompt) + len(sampled) - 1)
    return [logprobs[pos, tok].item() for pos, tok in zip(positions, sampled, strict=True)]


def processed_logprobs(logits: torch.Tensor, temperature: float, k: int, p: float) -> torch.Tensor:
    """Reference for vLLM's processed distribution: temperature, then top-k, then top-p."""
    scaled = logits / temperature  # [V]
    ascending, order = scaled.sort()
    ascending[: ascending.numel() - k] = -float("inf")
    mass_at_or_below = ascending.softmax(-1).cumsum(-1)  # [V]
    drop = mass_at_or_below <= 1 - p
    drop[-1] = False  # the most likely token always survives
    ascending[drop] = -float("inf")
    return torch.empty_like(scaled).scatter_(0, order, ascending).log_softmax(-1)  # [V]


def chat_prompt(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """SmolLM2 chat-template ids for one user message, ending in the assistant header."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns a BatchEncoding here, older versions a plain list
    return list(ids if isinstance(ids, list) else ids["input_ids"])


# ---------------------------------------------------------------- pure mapping, no engine


def test_sampling_params_carry_every_field_and_the_seed() -> None:
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, top_k=5, max_tokens=33, stop=["</x>"])
    params = to_sampling_params(sampling, seed=1234)
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.9, 5)
    assert (params.max_tokens, params.seed, params.logprobs) == (33, 1234, 0)
    assert params.stop == ["</x>"] and params.include_stop_str_in_output
    assert not params.skip_special_tokens
    assert to_sampling_params(sampling, seed=1, stop_token_ids=(0, 2)).stop_token_ids == [0, 2]


def test_to_generation_reads_the_sampled_tokens_logprob_not_the_top_one() -> None:
    top = {7: Logprob(logprob=-0.1, rank=1), 9: Logprob(logprob=-2.5, rank=2)}
    output = CompletionOutput(
        index=0,
        text="ab",
        token_ids=[9, 7],
        cumulative_logprob=None,
        logprobs=[top, {7: Logprob(logprob=-0.3, rank=1)}],
        finish_reason="length",
    )
    generation = to_generation(output)
    assert generation.token_ids == [9, 7]
    assert generation.logprobs == [-2.5, -0.3]
    assert generation.finish_reason == "length"


@pytest.mark.parametrize(
    ("logprobs", "reason"), [(None, "stop"), ([{7: Logprob(logprob=-0.1)}], "abort")]
)
def test_to_generation_rejects_missing_logprobs_and_aborts(logprobs, reason) -> None:
    output = CompletionOutput(0, "a", [7], None, logprobs, finish_reason=reason)
    with pytest.raises(VLLMBackendError):
        to_generation(output)


# ---------------------------------------------------------------- tiny model engine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer) -> Iterator[tuple[LlamaForCausalLM, VLLMBackend]]:
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_tiny_llama(path, tokenizer)
    backend = VLLMBackend(
        path, max_model_len=2048, kv_cache_memory_bytes=TINY_KV_BYTES, enforce_eager=True
    )
    yield model, backend
    backend.close()


@pytest.mark.slow
def test_logprobs_are_those_of_the_processed_distribution(tiny) -> None:
    model, backend = tiny
    prompt = [1, 520, 9531, 198, 19556]
    sampling = SamplingConfig(temperature=0.7, top_k=50, top_p=0.8, max_tokens=6)
    [generation] = backend.generate([prompt], sampling, seeds=[3])
    ids = prompt + generation.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # [T, V]
    for i, (tok, got) in enumerate(zip(generation.token_ids, generation.logprobs, strict=True)):
        row = logits[len(prompt) - 1 + i]  # [V]
        want = processed_logprobs(row, 0.7, 50, 0.8)[tok].item()
        raw = row.log_softmax(-1)[tok].item()
        assert got == pytest.approx(want, abs=1e-3)
        assert abs(got - raw) > 0.1  # would pass with vLLM's default raw logprobs otherwise


@pytest.mark.slow
def test_per_prompt_seeds_reproduce_and_differ(tiny) -> None:
    _, backend = tiny
    prompt = [1, 520, 9531, 198]
    sampling = SamplingConfig(temperature=1.0, max_tokens=12)
    first = backend.generate([prompt, prompt, prompt], sampling, seeds=[11, 12, 11])
    alone = backend.generate([prompt], sampling, seeds=[11])
    assert first[0].token_ids == first[2].token_ids == alone[0].token_ids
    assert first[0].token_ids != first[1].token_ids
    assert all(len(g.token_ids) == len(g.logprobs) == 12 for g in first)
    assert {g.finish_reason for g in first} == {"length"}
    with pytest.raises(ValueError):
        backend.generate([prompt], sampling, seeds=[1, 2])


@pytest.mark.slow
def test_update_weights_makes_engine_agree_with_trained_model(tmp_path, tokenizer) -> None:
    model = save_tiny_llama(tmp_path, tokenizer)
    backend = VLLMBackend(
        tmp_path, max_model_len=2048, kv_cache_memory_bytes=TINY_KV_BYTES, enforce_eager=True
    )
    try:
        # 300 tokens: two full 128-token KV blocks, so a stale prefix cache would be reused.
        prompt = [1 + (i * 7919) % 40000 for i in range(300)]
        greedy = SamplingConfig(temperature=0.0, max_tokens=8)
        before = backend.generate([prompt], greedy, seeds=[0])[0]
        old = sampled_logprobs(model, prompt, before.token_ids)
        assert before.logprobs == pytest.approx(old, abs=1e-3)

        target = torch.tensor([prompt[:64] + before.token_ids])  # [1, 72]
        optimizer = torch.optim.SGD(model.parameters(), lr=5.0)
        for _ in range(3):
            optimizer.zero_grad()
            model(target, labels=target).loss.backward()
            optimizer.step()
        model.eval()
        new = sampled_logprobs(model, prompt, before.token_ids)
        assert max(abs(a - b) for a, b in zip(old, new, strict=True)) > 0.05

        stale = backend.generate([prompt], greedy, seeds=[0])[0]
        stale_new = sampled_logprobs(model, prompt, stale.token_ids)
        assert max(abs(a - b) for a, b in zip(stale.logprobs, stale_new, strict=True)) > 0.05

        backend.update_weights(model)
        after = backend.generate([prompt], greedy, seeds=[0])[0]
        assert after.logprobs == pytest.approx(
            sampled_logprobs(model, prompt, after.token_ids), abs=1e-3
        )
    finally:
        backend.close()
    with pytest.raises(VLLMBackendError):
        backend.generate([prompt], greedy, seeds=[0])


@pytest.mark.slow
def test_engine_stops_on_the_template_turn_end_not_only_on_eos(tmp_path, tokenizer) -> None:
    # EOS stays `<|im_end|>` (2, all vLLM stops on by itself); the template closes turns with
    # `<|endoftext|>` (0). A zeroed final norm makes every logit 0: greedy picks id 0 every step.
    closes = copy.deepcopy(tokenizer)
    closes.chat_template = tokenizer.chat_template.replace("<|im_end|>", "<|endoftext|>")
    model = save_tiny_llama(tmp_path, closes)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    model.save_pretrained(tmp_path)
    backend = VLLMBackend(
        tmp_path, max_model_len=2048, kv_cache_memory_bytes=TINY_KV_BYTES, enforce_eager=True
    )
    try:
        assert backend.stop_token_ids == (0, 2)  # read off the engine's own tokenizer
        greedy = SamplingConfig(temperature=0.0, max_tokens=5)
        [generation] = backend.generate([[1, 520, 9531, 198]], greedy, seeds=[0])
    finally:
        backend.close()
    assert generation.token_ids == [0] and generation.finish_reason == "stop"


# ---------------------------------------------------------------- real SmolLM2


@pytest.fixture(scope="module")
def smol(embedded_model_dir) -> Iterator[VLLMBackend]:
    backend = VLLMBackend(
        embedded_model_dir,
        max_model_len=2048,
        kv_cache_memory_bytes=SMOL_KV_BYTES,
        enforce_eager=True,
    )
    yield backend
    backend.close()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Plain greedy loop with a KV cache, up to `n` tokens or EOS (kept), like the engine."""
    ids, past, out = torch.tensor([prompt]), None, []
    with torch.no_grad():
        for _ in range(n):
            step = model(ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            out.append(int(step.logits[0, -1].argmax()))
            if out[-1] == EOS:
                break
            ids = torch.tensor([out[-1:]])
    return out


@pytest.mark.slow
def test_smollm2_greedy_tokens_equal_hf_greedy(smol, embedded_model_dir, tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()
    texts = ["What is 17 * 23?", "Name three primary colors.", "Write a haiku about rain."]
    prompts = [chat_prompt(tokenizer, text) for text in texts]
    greedy = SamplingConfig(temperature=0.0, max_tokens=16)
    generations = smol.generate(prompts, greedy, seeds=[0, 1, 2])
    assert max(len(g.token_ids) for g in generations) == 16  # not all cut short by EOS
    ours = HFBackend(model, tokenizer).generate(prompts, greedy, seeds=[0, 1, 2])
    for prompt, generation, hf in zip(prompts, generations, ours, strict=True):
        assert generation.token_ids == hf_greedy(model, prompt, 16)
        assert generation.token_ids == hf.token_ids  # the hf backend, batched, agrees too
        assert generation.logprobs == pytest.approx(
            sampled_logprobs(model, prompt, generation.token_ids), abs=1e-3
        )


@pytest.mark.slow
def test_smollm2_stops_on_eos_and_on_stop_strings(smol, tokenizer) -> None:
    prompt = chat_prompt(tokenizer, "Say hi.")
    free = smol.generate([prompt], SamplingConfig(temperature=0.0, max_tokens=64), [0])[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] == EOS  # kept in the ids

    stop = tokenizer.decode(free.token_ids[2:3])
    cut = SamplingConfig(temperature=0.0, max_tokens=64, stop=[stop])
    stopped = smol.generate([prompt], cut, [0])[0]
    end = next(k for k in range(1, 64) if stop in tokenizer.decode(free.token_ids[:k]))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:end]
    assert stopped.text.endswith(stop)


BUILTIN_ENVS = ["Calculator-v0", "PythonSandbox-v0", "Search-v0", "WebApi-v0"]


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILTIN_ENVS)
def test_collected_trajectories_pass_the_invariants(tiny, tokenizer, name) -> None:
    from agent_grpo.rollout.collector import Task, collect_groups
    from agent_grpo.rollout.config import RolloutConfig
    from agent_grpo.trajectory.invariants import check_invariants

    _, backend = tiny
    sampling = SamplingConfig(temperature=1.0, max_tokens=24, stop=["</tool_call>"])
    config = CollectOptions.from_config(RolloutConfig(group_size=2, sampling=sampling))
    records = collect_groups(
        [Task(env_id=f"agent_grpo/{name}", seed=3)], backend, tokenizer, config
    ).records
    assert len(records) == 2 and all(r.lengths.model > 0 for r in records)
    for record in records:
        check_invariants(record, tokenizer)


@pytest.mark.slow
def test_score_gives_the_models_own_logprobs_of_given_ids(tiny) -> None:
    # The weight canary's engine side: vLLM's prompt logprobs of fixed ids, at temperature 1,
    # equal the model's log-softmax (fp32 both sides), 0 off the targets.
    model, backend = tiny
    ids = [[1, 520, 9531, 198, 19556, 42], [1, 7, 8]]
    targets = [[False, False, True, True, True, True], [False, True, True]]
    got = backend.score(ids, targets, 1.0)
    for row, seq, wanted in zip(got, ids, targets, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].float()  # [T, V]
        want = [logits[t - 1].log_softmax(-1)[tok].item() if w else 0.0
                for t, (tok, w) in enumerate(zip(seq, wanted, strict=True))]  # fmt: skip
        assert row == pytest.approx(want, abs=1e-3)
