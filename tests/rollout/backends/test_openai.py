"""The OpenAI-compatible backend: request/reply mapping, retries and concurrency against a fake
server, and token-exact generation against a real `vllm serve` subprocess."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.backends.openai import (
    OpenAIBackend,
    OpenAIBackendError,
    RemoteWeightsError,
    api_root,
    completion_request,
    parse_completion,
    retry_delay,
)
from agent_grpo.rollout.collector import CollectOptions
from agent_grpo.testing.tiny_model import save_tiny_llama
from agent_grpo.testing.vllm_serve import vllm_server

EOS = 2


def reply(ids: list[int], logprobs: list[float], finish: str = "stop") -> dict[str, Any]:
    """A vLLM-shaped completion reply with one choice."""
    tokens = [f"token_id:{i}" for i in ids]
    return {
        "choices": [
            {
                "index": 0,
                "text": "t" * len(ids),
                "token_ids": ids,
                "finish_reason": finish,
                "logprobs": {"tokens": tokens, "token_logprobs": logprobs},
            }
        ]
    }


# ---------------------------------------------------------------- pure mapping


def test_request_sends_token_ids_seed_and_neutral_defaults() -> None:
    sampling = SamplingConfig(temperature=0.6, top_p=0.9, top_k=7, max_tokens=5, stop=["</a>"])
    body = completion_request("m", [1, 2, 3], sampling, seed=42)
    assert body["prompt"] == [1, 2, 3] and body["model"] == "m"
    assert (body["temperature"], body["top_p"], body["top_k"]) == (0.6, 0.9, 7)
    assert (body["max_tokens"], body["seed"], body["stop"]) == (5, 42, ["</a>"])
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert body["repetition_penalty"] == 1.0 and body["min_p"] == 0.0
    assert body["stop_token_ids"] == []
    assert completion_request("m", [1], sampling, 0, (0, 2))["stop_token_ids"] == [0, 2]
    json.dumps(body)  # must be plain JSON


def test_parse_reads_ids_from_token_ids_or_from_token_strings() -> None:
    full = reply([5, 9], [-0.5, -0.25], "length")
    generation = parse_completion(full)
    assert (generation.token_ids, generation.logprobs) == ([5, 9], [-0.5, -0.25])
    assert generation.finish_reason == "length"
    del full["choices"][0]["token_ids"]
    assert parse_completion(full).token_ids == [5, 9]


@pytest.mark.parametrize(
    "broken",
    [
        {"token_ids": [5, 8]},  # disagrees with the token strings
        {"finish_reason": "abort"},
        {"logprobs": {"tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-0.5, None]}},
        {"token_ids": None, "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1, -1]}},
    ],
)
def test_parse_rejects_replies_it_cannot_trust(broken: dict[str, Any]) -> None:
    body = reply([5, 9], [-0.5, -0.25])
    body["choices"][0].update(broken)
    with pytest.raises(OpenAIBackendError):
        parse_completion(body)


def test_api_root_accepts_server_root_or_v1() -> None:
    assert api_root("http://h:8000") == api_root("http://h:8000/v1/") == "http://h:8000/v1"


def test_retry_delay_grows_and_honours_retry_after() -> None:
    assert 0.1 <= retry_delay(0, 0.1) <= 0.125
    assert 0.8 <= retry_delay(3, 0.1) <= 1.0
    assert retry_delay(0, 0.1, retry_after="2") == 2.0
    assert retry_delay(20, 1.0) == 30.0


# ---------------------------------------------------------------- fake server


@dataclass
class Script:
    """What the fake server answers, in order, and what it saw."""

    answers: list[tuple[int, float]]
    """(HTTP status, seconds to wait before answering); the last one repeats."""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_answer(self, body: dict[str, Any]) -> tuple[int, float]:
        with self.lock:
            self.bodies.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def _handler(script: Script) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != "/v1/completions":
                self.send_error(404)
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            status, delay = script.next_answer(body)
            time.sleep(delay)
            with script.lock:
                script.in_flight -= 1
            prompt = body["prompt"]
            payload = reply([prompt[-1] + 1, EOS], [-1.0, -0.5]) if status == 200 else {}
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except OSError:
                pass  # the client timed out and hung up

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


@contextmanager
def fake_server(answers: list[tuple[int, float]]) -> Iterator[tuple[str, Script]]:
    script = Script(answers=list(answers))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(script))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", script
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def backend(url: str, model: str = "fake", **kwargs: Any) -> Iterator[OpenAIBackend]:
    client = OpenAIBackend(url, model, backoff_s=0.01, **kwargs)
    try:
        yield client
    finally:
        client.close()


def test_retries_on_503_then_succeeds() -> None:
    answers = [(503, 0.0), (503, 0.0), (200, 0.0)]
    with fake_server(answers) as (url, script), backend(url, max_retries=3) as client:
        [generation] = client.generate([[10, 20]], SamplingConfig(), seeds=[1])
    assert generation.token_ids == [21, EOS] and generation.logprobs == [-1.0, -0.5]
    assert generation.extra["attempts"] == 3.0 and len(script.bodies) == 3
    assert script.bodies[0]["seed"] == 1 and script.bodies[0]["prompt"] == [10, 20]


def test_every_request_stops_on_the_backend_stop_ids() -> None:
    with fake_server([(200, 0.0)]) as (url, script), backend(url, stop_token_ids=[7, 2]) as client:
        client.generate([[1], [2]], SamplingConfig(), seeds=[0, 1])
    assert [b["stop_token_ids"] for b in script.bodies] == [[7, 2], [7, 2]]


def test_gives_up_after_max_retries_and_does_not_retry_a_400() -> None:
    with fake_server([(503, 0.0)]) as (url, script), backend(url, max_retries=2) as client:
        with pytest.raises(OpenAIBackendError, match="after 3 attempts"):
            client.generate([[1]], SamplingConfig(), seeds=[0])
        assert len(script.bodies) == 3
    with fake_server([(400, 0.0)]) as (url, script), backend(url, max_retries=5) as client:
        with pytest.raises(OpenAIBackendError, match="HTTP 400"):
            client.generate([[1]], SamplingConfig(), seeds=[0])
        assert len(script.bodies) == 1


def test_a_timed_out_request_is_retried() -> None:
    answers = [(200, 1.0), (200, 0.0)]  # the first answer comes after the client's timeout
    with fake_server(answers) as (url, _), backend(url, timeout_s=0.2, max_retries=1) as client:
        [generation] = client.generate([[4]], SamplingConfig(), seeds=[0])
    assert generation.token_ids == [5, EOS] and generation.extra["attempts"] == 2.0


def test_concurrency_is_limited_and_order_kept() -> None:
    with fake_server([(200, 0.15)]) as (url, script), backend(url, max_concurrency=2) as client:
        prompts = [[i] for i in range(6)]
        generations = client.generate(prompts, SamplingConfig(), seeds=list(range(6)))
    assert [g.token_ids[0] for g in generations] == [1, 2, 3, 4, 5, 6]
    assert script.max_in_flight == 2


def test_connection_refused_is_retried_then_reported() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens once the socket closes
    refused = pytest.raises(OpenAIBackendError, match="ConnectError")
    with backend(f"http://127.0.0.1:{port}/v1", max_retries=1) as client, refused:
        client.generate([[1]], SamplingConfig(), seeds=[0])


def test_update_weights_raises_a_typed_error_and_generate_checks_seeds() -> None:
    with backend("http://127.0.0.1:9/v1") as client:
        with pytest.raises(RemoteWeightsError, match="managed outside"):
            client.update_weights(torch.nn.Linear(1, 1))
        assert isinstance(RemoteWeightsError("x"), NotImplementedError)
        with pytest.raises(ValueError):
            client.generate([[1], [2]], SamplingConfig(), seeds=[0])


def test_generate_works_from_inside_a_running_event_loop() -> None:
    import asyncio

    async def inside() -> list[int]:
        with fake_server([(200, 0.0)]) as (url, _), backend(url) as client:
            return client.generate([[7]], SamplingConfig(), seeds=[0])[0].token_ids

    assert asyncio.run(inside()) == [8, EOS]


# ---------------------------------------------------------------- real `vllm serve`


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy loop by full forwards: up to `n` ids (EOS kept) and their logprobs."""
    ids: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        while len(ids) < n and (not ids or ids[-1] != EOS):
            row = model(torch.tensor([prompt + ids])).logits[0, -1].log_softmax(-1)  # [V]
            ids.append(int(row.argmax()))
            logprobs.append(row[ids[-1]].item())
    return ids, logprobs


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer) -> Iterator[tuple[LlamaForCausalLM, str]]:
    pytest.importorskip("vllm")
    path = tmp_path_factory.mktemp("served-tiny")
    model = save_tiny_llama(path / "model", tokenizer)
    flags = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20)]
    with vllm_server(str(path / "model"), flags, path / "server.log", 600, name="tiny") as url:
        yield model, url


@pytest.mark.slow
@pytest.mark.vllm
def test_served_greedy_tokens_and_logprobs_equal_hf(served) -> None:
    model, url = served
    prompts = [[1, 520, 9531, 198], [1, 4093, 198, 36218, 15876, 30, 2, 198], [19556, 28]]
    greedy = SamplingConfig(temperature=0.0, max_tokens=12)
    top_k = SamplingConfig(temperature=0.8, top_k=40, max_tokens=8)
    with backend(url, model="tiny") as client:
        generations = client.generate(prompts, greedy, seeds=[0, 1, 2])
        sampled = client.generate([prompts[0], prompts[0]], top_k, seeds=[5, 5])
    for prompt, generation in zip(prompts, generations, strict=True):
        want_ids, want_logprobs = hf_greedy(model, prompt, 12)
        assert generation.token_ids == want_ids
        assert generation.logprobs == pytest.approx(want_logprobs, abs=1e-3)
        assert generation.finish_reason == ("stop" if want_ids[-1] == EOS else "length")

    assert sampled[0].token_ids == sampled[1].token_ids  # the seed reached the server
    ids = prompts[0] + sampled[0].token_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(prompts[0]) - 1 : -1] / 0.8  # [8, V]
    # Processed logprob: renormalised over the 40 kept tokens (the server's logprobs mode).
    want = logits.gather(1, torch.tensor([sampled[0].token_ids]).T)[:, 0]  # [8]
    want = want - logits.topk(40, dim=-1).values.logsumexp(-1)  # [8]
    assert sampled[0].logprobs == pytest.approx(want.tolist(), abs=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Calculator-v0", "PythonSandbox-v0", "Search-v0", "WebApi-v0"])
def test_served_trajectories_pass_the_invariants(served, tokenizer, name) -> None:
    from agent_grpo.rollout.collector import Task, collect_groups
    from agent_grpo.rollout.config import RolloutConfig
    from agent_grpo.trajectory.invariants import check_invariants

    _, url = served
    sampling = SamplingConfig(temperature=1.0, max_tokens=24, stop=["</tool_call>"])
    config = CollectOptions.from_config(RolloutConfig(group_size=2, sampling=sampling))
    with backend(url, model="tiny") as client:
        tasks = [Task(env_id=f"agent_grpo/{name}", seed=3)]
        records = collect_groups(tasks, client, tokenizer, config).records
    assert len(records) == 2 and all(r.lengths.model > 0 for r in records)
    for record in records:
        check_invariants(record, tokenizer)
