"""The `hf` backend: pure sampling/stop/mask/cache helpers on hand-made data, then the decoding loop
on the tiny model against plain full forward passes, and one slow check on the real SmolLM2."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agent_grpo.models.loading import DEFAULT_MODEL, load_model
from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.backends.hf import (
    HFBackend,
    PrefixCache,
    _Row,
    _shared_prefix,
    attention_bias,
    common_prefix_len,
    filter_top_k_top_p,
    inverse_cdf,
    position_ids,
    sample_tokens,
    shared_head,
    stop_hit,
    stop_window,
)
from agent_grpo.rollout.backends.kv_cache import ReservedLayer, reserved_cache
from agent_grpo.testing.prompts import chat_ids
from agent_grpo.testing.reference_sampler import logprob_tolerance, reference_sample
from agent_grpo.testing.tiny_model import build_tiny_model, lively

GREEDY = SamplingConfig(temperature=0.0, max_tokens=12)
QUESTIONS = ["Hi", "What is 17 times 23? Think step by step.", "Name three rivers in Europe."]


# --- sampling ------------------------------------------------------------------------------------


def test_top_p_keeps_smallest_nucleus_and_renormalises():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.25, 0.25, 0.25, 0.25]])
    kept = torch.softmax(filter_top_k_top_p(probs.log(), top_k=0, top_p=0.7), dim=-1)
    # Row 0: 0.5 alone is < 0.7, 0.5 + 0.3 reaches it -> {0.5, 0.3} renormalised to 0.625/0.375.
    # Row 1: ties; mass before the 3rd token is 0.5 < 0.7 -> three tokens kept, 1/3 each.
    assert torch.allclose(kept[0], torch.tensor([0.0, 0.625, 0.0, 0.375]))
    assert sorted(kept[1].tolist()) == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3])
    wider = torch.softmax(filter_top_k_top_p(probs.log(), top_k=0, top_p=0.85), dim=-1)
    assert torch.allclose(wider[0], torch.tensor([0.15, 0.5, 0.0, 0.3]) / 0.95)


def test_top_k_then_top_p_on_the_top_k_distribution():
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    assert torch.allclose(
        torch.softmax(filter_top_k_top_p(logits, top_k=1, top_p=1.0), -1), torch.eye(4)[1:2]
    )
    # Top-2 renormalised is {0.625, 0.375}; mass before the 2nd is 0.625 >= 0.5 -> only the top.
    only_top = torch.softmax(filter_top_k_top_p(logits, top_k=2, top_p=0.5), -1)
    assert torch.allclose(only_top, torch.eye(4)[1:2])
    assert filter_top_k_top_p(logits, top_k=0, top_p=1.0) is logits


def test_inverse_cdf_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]]).expand(5, 4)
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 0.9, 1.0])  # 1.0: the rounding edge
    assert inverse_cdf(probs, uniforms).tolist() == [1, 1, 3, 3, 3]
    trailing_zero = torch.tensor([[0.5, 0.5, 0.0]])
    assert inverse_cdf(trailing_zero, torch.tensor([1.0])).tolist() == [1]


def test_sample_tokens_temperature_and_greedy_logprobs():
    logits = torch.tensor([[0.0, 2 * math.log(3.0)]]).expand(2, 2)  # at T=2: probs 0.25 / 0.75
    tokens, logprobs = sample_tokens(
        logits, SamplingConfig(temperature=2.0), torch.tensor([0.1, 0.5])
    )
    assert tokens.tolist() == [0, 1]
    assert logprobs.tolist() == pytest.approx([math.log(0.25), math.log(0.75)], abs=1e-6)
    # Greedy: argmax, logprob under the raw softmax: 3 - log(e + e^2 + e^3) = -0.40760596.
    tokens, logprobs = sample_tokens(torch.tensor([[1.0, 3.0, 2.0]]), GREEDY, torch.tensor([0.9]))
    assert tokens.tolist() == [1]
    assert logprobs.tolist() == pytest.approx([-0.40760596], abs=1e-6)


# --- stops, masks, prefix cache ------------------------------------------------------------------


def test_stop_hit_on_strings_split_across_tokens(tokenizer):
    ids = tokenizer.encode("hello </tool_call> wörld 你好", add_special_tokens=False)
    text_at = [tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
    for stops in (["</tool_call>"], ["ll>"], ["好"], ["nope", "ö"]):
        window = stop_window(stops)
        fast = [stop_hit(tokenizer, ids[: k + 1], stops, window) for k in range(len(ids))]
        reference = [any(s in text for s in stops) for text in text_at]
        assert fast == reference, stops
        assert sum(fast) > 0
    assert not stop_hit(tokenizer, ids, [], stop_window([]))


def test_attention_bias_and_positions_skip_holes():
    valid = torch.tensor([[False, True, True, False, True], [True, True, True, True, True]])
    bias = attention_bias(valid, query_len=2, dtype=torch.float32)  # queries: slots 3 and 4
    low = torch.finfo(torch.float32).min
    assert bias.shape == (2, 1, 2, 5)
    assert bias[0, 0, 1].tolist() == [low, 0.0, 0.0, low, 0.0]
    assert bias[0, 0, 0].tolist() == [low, 0.0, 0.0, low, low]  # slot 4 is in its future
    assert bias[1, 0, 0].tolist() == [0.0, 0.0, 0.0, 0.0, low]
    assert position_ids(valid, query_len=2)[:, -1].tolist() == [2, 4]
    assert position_ids(valid, query_len=2)[1].tolist() == [3, 4]


def fake_kv(n: int, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [
        (torch.full((1, n, 2), float(i)), torch.full((1, n, 2), -float(i))) for i in range(layers)
    ]


def test_prefix_cache_lookup_uses_longest_common_prefix_and_keeps_one_token():
    cache = PrefixCache(max_entries=8, max_bytes=1 << 20)
    cache.insert([1, 2, 3, 4], fake_kv(4))
    cache.insert([1, 5], fake_kv(2))
    assert cache.lookup([7, 1])[0] == 0 and cache.lookup([7, 1])[1] is None
    n, kv = cache.lookup([1, 2, 3, 4])
    assert n == 3 and kv is not None and kv[1][0].shape == (1, 3, 2)
    assert cache.lookup([1, 2, 9, 9, 9])[0] == 2
    assert cache.lookup([1, 5, 6])[0] == 2
    cache.insert([1, 2, 3, 4, 5, 6], fake_kv(6))  # supersedes [1, 2, 3, 4]
    assert len(cache) == 2


def test_prefix_cache_evicts_least_recently_used_by_count_and_bytes():
    cache = PrefixCache(max_entries=2, max_bytes=1 << 20)
    cache.insert([1, 1], fake_kv(2))
    cache.insert([2, 2], fake_kv(2))
    cache.lookup([1, 1, 0])  # touch [1, 1]: [2, 2] is now the oldest
    cache.insert([3, 3], fake_kv(2))
    assert cache.lookup([2, 2, 0])[0] == 0 and cache.lookup([1, 1, 0])[0] == 2
    entry_bytes = sum(k.nbytes + v.nbytes for k, v in fake_kv(2))
    small = PrefixCache(max_entries=10, max_bytes=2 * entry_bytes)
    for i in range(3):
        small.insert([i, i], fake_kv(2))
    assert len(small) == 2 and small.nbytes == 2 * entry_bytes
    small.insert([9] * 10, fake_kv(10))  # larger than the whole budget: not stored
    assert len(small) == 2
    small.clear()
    assert len(small) == 0 and small.nbytes == 0


# --- the decoding loop on the tiny model ---------------------------------------------------------


@pytest.fixture
def model_and_prompts(tiny_model):
    model, tokenizer = lively(tiny_model[0]), tiny_model[1]
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == 3
    return model, tokenizer, prompts


def full_forward_logprobs(model, sequence: list[int], start: int, temperature: float):
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].float()  # [T, V]
    logprobs = torch.log_softmax(logits[start - 1 : -1] / temperature, dim=-1)  # [N, V]
    return logprobs, logprobs.gather(-1, torch.tensor(sequence[start:])[:, None]).squeeze(-1)


def test_greedy_output_same_alone_and_in_mixed_length_batches(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    alone = [HFBackend(model, tokenizer).generate([p], GREEDY, [0])[0] for p in prompts]
    together = HFBackend(model, tokenizer).generate(prompts, GREEDY, [0, 1, 2])
    chunked = HFBackend(model, tokenizer, max_batch_size=2).generate(prompts[::-1], GREEDY, [0] * 3)
    for a, b, c in zip(alone, together, chunked[::-1], strict=True):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert len(a.token_ids) == 12 and a.finish_reason == "length"


def test_sampler_logprobs_match_a_full_forward_pass(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    sampling = SamplingConfig(temperature=0.7, max_tokens=10)
    gens = HFBackend(model, tokenizer).generate(prompts, sampling, [3, 4, 5])
    for prompt, gen in zip(prompts, gens, strict=True):
        _, expected = full_forward_logprobs(model, prompt + gen.token_ids, len(prompt), 0.7)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4)


def test_top_k_top_p_logprobs_are_of_the_renormalised_nucleus(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    sampling = SamplingConfig(temperature=1.3, top_k=50, top_p=0.9, max_tokens=8)
    gens = HFBackend(model, tokenizer).generate(prompts, sampling, [0, 1, 2])
    for prompt, gen in zip(prompts, gens, strict=True):
        full, _ = full_forward_logprobs(model, prompt + gen.token_ids, len(prompt), 1.3)
        for step, token in enumerate(gen.token_ids):
            top = full[step].topk(50)
            probs = torch.softmax(top.values, dim=-1).tolist()  # descending
            nucleus = [i for i in range(50) if sum(probs[:i]) < 0.9]
            kept = {int(top.indices[i]): probs[i] for i in nucleus}
            assert token in kept
            expected = math.log(kept[token] / sum(kept.values()))
            assert gen.logprobs[step] == pytest.approx(expected, abs=1e-4)


def test_same_seeds_reproduce_and_rows_do_not_depend_on_batch_mates(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    sampling = SamplingConfig(temperature=1.0, max_tokens=10)
    first = HFBackend(model, tokenizer).generate(prompts, sampling, [11, 12, 13])
    second = HFBackend(model, tokenizer).generate(prompts, sampling, [11, 12, 13])
    assert [g.token_ids for g in first] == [g.token_ids for g in second]
    assert [g.logprobs for g in first] == [g.logprobs for g in second]
    for prompt, seed, batched in zip(prompts, [11, 12, 13], first, strict=True):
        alone = HFBackend(model, tokenizer).generate([prompt], sampling, [seed])[0]
        assert alone.token_ids == batched.token_ids
        assert alone.logprobs == pytest.approx(batched.logprobs, abs=1e-5)
    other = HFBackend(model, tokenizer).generate(prompts, sampling, [21, 22, 23])
    assert all(a.token_ids != b.token_ids for a, b in zip(first, other, strict=True))


def test_eos_stop_string_and_length(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    sampling = SamplingConfig(temperature=0.0, max_tokens=30)
    free = HFBackend(model, tokenizer, eos_token_ids=[]).generate(prompts[:1], sampling, [0])[0]
    ids = free.token_ids
    cut = next(j for j in range(3, 30) if ids[j] not in ids[:j])
    by_eos = HFBackend(model, tokenizer, eos_token_ids=[ids[cut]]).generate(
        prompts[:1], sampling, [0]
    )
    assert by_eos[0].token_ids == ids[: cut + 1] and by_eos[0].finish_reason == "stop"
    stop = tokenizer.decode(ids[8:11])[1:]  # spans tokens 8..10
    assert len(stop) >= 2
    expected = next(k for k in range(1, 31) if stop in tokenizer.decode(ids[:k]))
    stopped = HFBackend(model, tokenizer, eos_token_ids=[]).generate(
        prompts[:1], sampling.model_copy(update={"stop": [stop]}), [0]
    )[0]
    assert stopped.token_ids == ids[:expected] and stopped.finish_reason == "stop"
    assert free.finish_reason == "length" and len(ids) == 30


def test_turn_two_reuses_the_prefix_cache_with_identical_results(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    sampling = SamplingConfig(temperature=1.0, max_tokens=8)
    backend = HFBackend(model, tokenizer)
    turn1 = backend.generate(prompts, sampling, [1, 2, 3])
    # Follow-ups of different lengths, so the turn-2 batch has holes between prefix and suffix.
    glue = [
        tokenizer.encode(
            f"<|im_end|>\n<|im_start|>user\n{'And then? ' * (3 * i + 1)}<|im_end|>\n"
            "<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        for i in range(4)
    ]
    turn2 = [p + g.token_ids + glue[i] for i, (p, g) in enumerate(zip(prompts, turn1, strict=True))]
    turn2.append(chat_ids(tokenizer, "A new question, sharing only the system prompt"))
    reused = backend.generate(turn2, sampling, [4, 5, 6, 7])
    fresh = HFBackend(model, tokenizer).generate(turn2, sampling, [4, 5, 6, 7])
    for a, b in zip(reused, fresh, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    for prompt, g, r in zip(prompts, turn1, reused[:3], strict=True):
        assert r.extra["reused_tokens"] == len(prompt) + len(g.token_ids) - 1
    # The new question shares the default system prompt (and chat scaffolding) with every entry.
    shared = max(common_prefix_len(torch.tensor(p), torch.tensor(turn2[3][:-1])) for p in prompts)
    assert reused[3].extra["reused_tokens"] == shared > 10
    assert all(
        r.extra["reused_tokens"] + r.extra["prefill_tokens"] == len(p)
        for r, p in zip(reused, turn2, strict=True)
    )
    # A fresh backend prefills the batch's common prefix once and every row reuses only that.
    common = min(common_prefix_len(torch.tensor(turn2[0]), torch.tensor(p)) for p in turn2)
    assert [f.extra["reused_tokens"] for f in fresh] == [common] * len(turn2)
    # Turn 2's rows were cached from a batch with holes (mixed reuse); turn 3 reads them back.
    turn3 = [p + g.token_ids + glue[i] for i, (p, g) in enumerate(zip(turn2, reused, strict=True))]
    again = backend.generate(turn3, sampling, [8, 9, 10, 11])
    reference = HFBackend(model, tokenizer).generate(turn3, sampling, [8, 9, 10, 11])
    for a, b, p, g in zip(again, reference, turn2, reused, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.extra["reused_tokens"] == len(p) + len(g.token_ids) - 1
    backend.update_weights(model)
    assert backend.generate(turn2[:1], sampling, [4])[0].extra["reused_tokens"] == 0


def test_repeating_a_prompt_reuses_all_but_its_last_token(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    backend = HFBackend(model, tokenizer)
    first = backend.generate(prompts[1:2], GREEDY, [0])[0]
    again = backend.generate(prompts[1:2], GREEDY, [0])[0]
    assert again.extra["reused_tokens"] == len(prompts[1]) - 1
    assert again.token_ids == first.token_ids
    assert backend.stats.reused_tokens == len(prompts[1]) - 1
    assert backend.stats.generated_tokens == 24


def test_update_weights_from_another_module_loads_its_weights(model_and_prompts, tokenizer):
    model, _, prompts = model_and_prompts
    other = lively(build_tiny_model(tokenizer, seed=1)[0])
    backend = HFBackend(model, tokenizer)
    before = backend.generate(prompts, GREEDY, [0, 0, 0])
    backend.update_weights(other)
    after = backend.generate(prompts, GREEDY, [0, 0, 0])
    target = HFBackend(other, tokenizer).generate(prompts, GREEDY, [0, 0, 0])
    for a, t, b in zip(after, target, before, strict=True):
        assert a.token_ids == t.token_ids and a.token_ids != b.token_ids
        assert a.logprobs == pytest.approx(t.logprobs, abs=1e-5)
        # nothing cached under the old weights is reused: only this batch's shared prefix
        assert a.extra["reused_tokens"] == t.extra["reused_tokens"]


def test_bad_inputs_and_the_callers_training_mode(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    backend = HFBackend(model, tokenizer)
    with pytest.raises(ValueError, match="seeds"):
        backend.generate(prompts, GREEDY, [0])
    with pytest.raises(ValueError, match="at least one token"):
        backend.generate([[]], GREEDY, [0])
    model.train()  # the trainer's policy: generating must not leave it in eval mode
    assert backend.generate(prompts[:1], GREEDY, [0])[0].token_ids
    assert model.training
    empty = backend.generate(prompts[:1], GREEDY.model_copy(update={"max_tokens": 0}), [0])[0]
    assert empty.token_ids == [] and empty.finish_reason == "length"


# --- the real model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_greedy_answer(embedded_model_dir, tokenizer):
    """The real model answers through the backend. Its speed is a benchmark
    (bench/rollout_throughput.py), never a timed assertion here."""
    model = load_model(DEFAULT_MODEL)
    prompt = chat_ids(tokenizer, "What is the capital of France?")
    answer = HFBackend(model, tokenizer).generate(
        [prompt], GREEDY.model_copy(update={"max_tokens": 24}), [0]
    )[0]
    assert "Paris" in answer.text, answer.text


def test_a_batch_shares_one_prefill_of_its_common_prompt(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    sampling = SamplingConfig(temperature=1.0, max_tokens=4)
    group = [prompts[0]] * 4  # a GRPO group: G copies of one prompt
    shared = HFBackend(model, tokenizer)
    out = shared.generate(group, sampling, [1, 2, 3, 4])
    assert [g.extra["reused_tokens"] for g in out] == [len(prompts[0]) - 1] * 4
    assert shared.stats.prefill_tokens == len(prompts[0]) - 1 + 4  # once, then 1 token per row
    alone = [HFBackend(model, tokenizer).generate([p], sampling, [s])[0]
             for p, s in zip(group, [1, 2, 3, 4], strict=True)]  # fmt: skip
    for a, b in zip(out, alone, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


# --- the reserved KV cache -----------------------------------------------------------------------


def test_reserved_layer_holds_what_concatenation_would():
    """Writes in place, grows past its reservation, drops rows: always `DynamicLayer`'s tensors."""
    g = torch.Generator().manual_seed(0)
    reserved, dynamic = ReservedLayer(capacity=6), DynamicLayer()
    rows = 3
    for step, width in enumerate([4, 1, 1, 3, 1]):  # 4 + 1 + 1 fits; + 3 outgrows 6 slots
        keys, values = (torch.randn(rows, 2, width, 5, generator=g) for _ in range(2))
        got, want = reserved.update(keys, values), dynamic.update(keys, values)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), step
        assert reserved.get_seq_length() == dynamic.get_seq_length()
        if step == 2:
            for layer in (reserved, dynamic):
                layer.batch_select_indices(torch.tensor([2, 0]))
            assert torch.equal(reserved.keys, dynamic.keys)
            rows = 2
    assert reserved.get_seq_length() == 10
    with pytest.raises(NotImplementedError):
        reserved.crop(-1)  # unsupported, and loud about it: its buffers would go stale


def test_decode_steps_write_in_place(model_and_prompts):
    """Within its reservation a layer's buffer never moves: no per-token copy of the cache."""
    model, _, prompts = model_and_prompts
    cache = reserved_cache(len(prompts[1]) + 3)
    ids = torch.tensor([prompts[1]])
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        start = cache.layers[0].keys.untyped_storage().data_ptr()
        for _ in range(3):
            token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            assert cache.layers[0].keys.untyped_storage().data_ptr() == start
    assert cache.get_seq_length() == len(prompts[1]) + 3


def test_generation_equals_a_plain_dynamic_cache(model_and_prompts, monkeypatch):
    """The same tokens and bitwise the same logprobs as concatenating the cache every step."""
    import agent_grpo.rollout.backends.hf as hf_backend

    model, tokenizer, prompts = model_and_prompts
    sampling = SamplingConfig(temperature=1.0, max_tokens=10)
    seeds = [5, 6, 7, 8]
    batch = [prompts[0], prompts[1], prompts[2], prompts[1]]
    reserved = HFBackend(model, tokenizer).generate(batch, sampling, seeds)
    monkeypatch.setattr(
        hf_backend, "reserved_cache", lambda capacity, past: DynamicCache(ddp_cache_data=past)
    )
    plain = HFBackend(model, tokenizer).generate(batch, sampling, seeds)
    for a, b in zip(reserved, plain, strict=True):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


# --- the decoding loop against the plainest loop (agent_grpo/testing/reference_sampler.py) --------


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0, max_tokens=14),
        SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, max_tokens=14),
        SamplingConfig(temperature=0.0, max_tokens=14),
    ],
    ids=["t1", "top-k-top-p", "greedy"],
)
def test_batched_decoding_samples_what_the_reference_loop_samples(model_and_prompts, sampling):
    """Same seeds, same ids; logprobs within fp32 reduction order. Rows of mixed lengths share a
    batch (one prompt twice, so the shared prefill runs) and stop at different steps on ids
    each of them samples, so finished rows leave the batch while others decode on."""
    model, tokenizer, prompts = model_and_prompts
    batch = [prompts[0], prompts[1], prompts[2], prompts[1], prompts[0]]
    seeds = [3, 1, 4, 1, 5]
    free = [
        reference_sample(model, p, sampling, s, eos_ids=[])
        for p, s in zip(batch, seeds, strict=True)
    ]
    # each row's id at a different step ends it (unless it samples one of the others' sooner)
    eos = {row.token_ids[2 + 2 * i] for i, row in enumerate(free[:4])}
    reference = [reference_sample(model, p, sampling, s, eos_ids=sorted(eos))
                 for p, s in zip(batch, seeds, strict=True)]  # fmt: skip
    assert len({len(r.token_ids) for r in reference}) >= 3  # rows really leave at different steps
    backend = HFBackend(model, tokenizer, eos_token_ids=sorted(eos))
    for attempt in range(2):  # the second call reuses the prefix cache the first one filled
        out = backend.generate(batch, sampling, seeds)
        for got, want, prompt in zip(out, reference, batch, strict=True):
            tolerance = logprob_tolerance(model, len(prompt) + 14, want.largest_logit)
            assert got.token_ids == want.token_ids, attempt
            assert got.logprobs == pytest.approx(want.logprobs, abs=tolerance, rel=0), attempt


def test_repeated_prompts_are_prefilled_once(model_and_prompts):
    """A GRPO batch (G copies of each task): each task's prompt is encoded once, its copies
    reuse all of it but the last token; a prompt seen once gets only the common prefix."""
    model, tokenizer, _ = model_and_prompts
    tasks = [chat_ids(tokenizer, f"Task {i}: " + "spell out every number from one to ten. " * 2)
             for i in range(3)]  # fmt: skip
    batch = [tasks[0]] * 3 + [tasks[1]] * 2 + [tasks[2]]
    backend = HFBackend(model, tokenizer)
    out = backend.generate(batch, SamplingConfig(temperature=1.0, max_tokens=3), list(range(6)))
    common = min(common_prefix_len(torch.tensor(tasks[0]), torch.tensor(t)) for t in tasks[1:])
    assert len(tasks[0]) - 1 - common >= 16  # long enough to be worth a prefill of its own
    assert [g.extra["reused_tokens"] for g in out] == [len(tasks[0]) - 1] * 3 + [
        len(tasks[1]) - 1
    ] * 2 + [common]
    encoded = common + (len(tasks[0]) - 1 - common) + (len(tasks[1]) - 1 - common)
    assert backend.stats.prefill_tokens == encoded + 5 + len(tasks[2]) - common


def test_a_batch_holds_its_shared_prefix_once(model_and_prompts):
    """The prefix every row starts with (here the chat template's system prompt) stays out of
    the rows' caches, one copy beside the batch, turn after turn: greedy decoding gives the
    same tokens, with logprobs within fp32 rounding, as rows that each hold it, and sampled
    logprobs are a full forward pass's. (Sampled tokens are not compared: this tiny model's
    49k near-equal probabilities put a CDF boundary within fp32 rounding of about 1% of draws.)"""
    model, tokenizer, prompts = model_and_prompts
    once = HFBackend(model, tokenizer)
    per_row = HFBackend(model, tokenizer, shared_prefix_attention=False)
    batch = prompts + prompts[1:]  # mixed lengths, two prompts twice
    common = min(common_prefix_len(torch.tensor(batch[0]), torch.tensor(p)) for p in batch)
    assert common >= 16  # long enough to be held once
    glue = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    held_once = []
    for turn in range(3):
        got = once.generate(batch, GREEDY, [0] * 5)
        want = per_row.generate(batch, GREEDY, [0] * 5)
        for a, b in zip(got, want, strict=True):
            assert a.token_ids == b.token_ids, turn
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5), turn
            assert a.extra["reused_tokens"] == b.extra["reused_tokens"], turn
        held_once.append(once.stats.shared_prefix_slots)
        batch = [p + g.token_ids + glue for p, g in zip(batch, got, strict=True)]
    # turn 1: at least the main batch's 4 other rows; later turns reuse more than the prefix
    assert held_once[0] >= 4 * common and held_once[2] > held_once[1] > held_once[0]
    assert per_row.stats.shared_prefix_slots == 0
    sampled = once.generate(batch, SamplingConfig(temperature=1.0, max_tokens=8), [1, 2, 3, 4, 5])
    assert once.stats.shared_prefix_slots > held_once[2]
    for prompt, gen in zip(batch, sampled, strict=True):
        _, expected = full_forward_logprobs(model, prompt + gen.token_ids, len(prompt), 1.0)
        assert torch.allclose(torch.tensor(gen.logprobs), expected, atol=1e-4)


def test_a_shared_prefix_under_bf16_autocast(model_and_prompts):
    """Sampling under bf16 autocast from fp32 weights (`model.dtype: bfloat16`) holds the prefix
    once too: bf16 queries, keys and mask through the two-part attention. Against a full forward
    pass under the same autocast, its logprobs are as close as those of rows that each hold the
    prefix (both differ from it by bf16 rounding in other places)."""
    model, tokenizer, prompts = model_and_prompts
    batch = prompts + prompts[1:]
    once = HFBackend(model, tokenizer, compute_dtype=torch.bfloat16)
    per_row = HFBackend(
        model, tokenizer, compute_dtype=torch.bfloat16, shared_prefix_attention=False
    )
    errors = []
    for backend in (once, per_row):
        worst = 0.0
        for prompt, gen in zip(batch, backend.generate(batch, GREEDY, [0] * 5), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, full = full_forward_logprobs(model, prompt + gen.token_ids, len(prompt), 1.0)
            worst = max(worst, (torch.tensor(gen.logprobs) - full).abs().max().item())
        errors.append(worst)
    assert once.stats.shared_prefix_slots > 0 and per_row.stats.shared_prefix_slots == 0
    assert errors[1] > 0 and errors[0] <= 2 * errors[1] + 1e-3, errors


def test_each_chunk_holds_its_own_shared_prefix(model_and_prompts):
    """With `max_batch_size` 2 the five rows run as chunks of 2, 2 and 1: each chunk of two
    holds its prefix once, the chunk of one holds it in its row, and greedy decoding gives the
    tokens of rows that each hold it."""
    model, tokenizer, prompts = model_and_prompts
    batch = prompts + prompts[1:]
    once = HFBackend(model, tokenizer, max_batch_size=2)
    per_row = HFBackend(model, tokenizer, max_batch_size=2, shared_prefix_attention=False)
    got, want = (b.generate(batch, GREEDY, [0] * 5) for b in (once, per_row))
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    common = min(common_prefix_len(torch.tensor(batch[0]), torch.tensor(p)) for p in batch)
    assert once.stats.shared_prefix_slots >= 2 * common  # two chunks of two rows, at least


def test_the_shared_prefix_is_what_every_row_reuses_and_every_prompt_starts_with():
    """`_shared_prefix`: the shortest reuse, cut where two prompts first differ; none for one
    row or under `MIN_SHARED_PREFIX` (16) tokens; the first row's cached KV, cut to it."""
    kv = [(torch.arange(30.0).view(1, 30, 1), -torch.arange(30.0).view(1, 30, 1))]  # [H, N, D]
    base = list(range(100, 130))

    def rows(prompts, reused):  # type: ignore[no-untyped-def]
        return [_Row(p, n, torch.empty(0)) for p, n in zip(prompts, reused, strict=True)]

    hits = [(25, kv), (22, kv)]

    def other_at(i: int) -> list[int]:  # `base` with token i changed
        return [*base[:i], 0, *base[i + 1 :]]

    shared = _shared_prefix(rows([base, other_at(26)], [25, 22]), hits)
    assert shared is not None and shared.length == 22  # the shorter reuse
    assert torch.equal(shared.layers[0][0].flatten(), torch.arange(22.0))
    shared = _shared_prefix(rows([base, other_at(20)], [25, 22]), hits)
    assert shared is not None and shared.length == 20  # where the prompts differ
    assert _shared_prefix(rows([base, other_at(10)], [25, 22]), hits) is None  # under 16
    assert _shared_prefix(rows([base], [25]), hits[:1]) is None  # one row
    assert _shared_prefix(rows([base, base], [12, 25]), hits) is None  # a short reuse


@given(
    st.lists(st.lists(st.integers(0, 2), max_size=8), min_size=1, max_size=5),
    st.integers(-2, 10),
)
def test_shared_head_is_the_longest_prefix_every_prompt_starts_with(prompts, limit):
    """`shared_head` (used by `_shared_prefix` and the warm-up prefill) against the definition:
    the largest n <= limit (and <= every prompt's length) such that all prompts agree on n."""
    n = 0
    while n < limit and all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    assert shared_head(prompts, limit) == n
