"""The `openai` generation backend: token-id prompts to an OpenAI-compatible `/v1/completions`.

Built for a `vllm serve` endpoint; what it relies on that the OpenAI API itself lacks:
- `prompt` is a list of token ids, and the reply carries the sampled ids (`return_token_ids`, and
  `return_tokens_as_token_ids` so the logprob `tokens` read `token_id:123`; the two are checked
  against each other). Text never round-trips through a tokenizer.
- `top_k`, `repetition_penalty`, `min_p`, `skip_special_tokens`, `include_stop_str_in_output`
  and `stop_token_ids` (the chat template's turn end, `trajectory.tokens.turn_end_ids`: the
  server alone stops on EOS only, which need not close a turn) are vLLM extensions. We send
  the neutral sampling values explicitly because vLLM otherwise fills unset ones from the model's
  `generation_config.json`.
- The logprobs are those of the processed distribution only if the server runs with
  `--logprobs-mode processed_logprobs`; a client cannot check this, so it is documented.

One HTTP request per prompt, at most `max_concurrency` in flight, on a private event loop
thread (so `generate` works from sync code and from inside someone else's running loop).
Requests are retried with exponential backoff on connect errors, timeouts, 429 and 5xx: a
completion with a fixed seed has no side effects, so a retry is safe (the server may still finish
the abandoned attempt, which only wastes its time).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import httpx
import torch

from agent_grpo.rollout.backends.base import Generation, SamplingConfig

__all__ = [
    "OpenAIBackend",
    "OpenAIBackendError",
    "RemoteWeightsError",
    "api_root",
    "completion_request",
    "parse_completion",
    "retry_delay",
]

RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TOKEN_ID_PREFIX = "token_id:"
_MAX_DELAY_S = 30.0
T = TypeVar("T")


class OpenAIBackendError(RuntimeError):
    """The server refused a request, kept failing, or answered in a shape we cannot use."""


class RemoteWeightsError(NotImplementedError):
    """A remote server's weights are managed outside this process; the trainer cannot push them."""


def api_root(base_url: str) -> str:
    """The OpenAI API root: `http://host:port` and `http://host:port/v1` both give `.../v1`."""
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else f"{root}/v1"


def completion_request(
    model: str,
    prompt: list[int],
    sampling: SamplingConfig,
    seed: int,
    stop_token_ids: Sequence[int] = (),
) -> dict[str, Any]:
    """The JSON body of one `/v1/completions` request for a token-id prompt that also stops on
    `stop_token_ids` (kept as the last id)."""
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "seed": seed,
        "stop": list(sampling.stop),
        "include_stop_str_in_output": True,
        "stop_token_ids": [int(i) for i in stop_token_ids],
        "skip_special_tokens": False,
        "n": 1,
        "stream": False,
        "logprobs": 1,  # the sampled token's logprob (plus the top one, which we ignore)
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        # Neutral values, sent so that server-side generation_config defaults cannot apply.
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "min_p": 0.0,
    }


def _token_id(token: str) -> int:
    """Parse vLLM's `token_id:123` token spelling."""
    if not token.startswith(_TOKEN_ID_PREFIX):
        raise OpenAIBackendError(
            f"token {token!r} is not of the form 'token_id:N'; is return_tokens_as_token_ids "
            "supported by this server?"
        )
    return int(token.removeprefix(_TOKEN_ID_PREFIX))


def _sampled_ids(choice: dict[str, Any]) -> list[int]:
    """The sampled ids of one choice, from `token_ids` and/or the `token_id:N` logprob tokens."""
    from_tokens = [_token_id(t) for t in (choice.get("logprobs") or {}).get("tokens") or []]
    ids = choice.get("token_ids")
    if ids is None:
        return from_tokens
    if from_tokens and list(ids) != from_tokens:
        raise OpenAIBackendError("token_ids and logprob tokens disagree")
    return [int(i) for i in ids]


def parse_completion(body: dict[str, Any]) -> Generation:
    """Our `Generation` from a non-streaming completion reply with exactly one choice."""
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1:
        raise OpenAIBackendError(f"expected one choice, got {body!r:.300}")
    choice = choices[0]
    token_ids = _sampled_ids(choice)
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if logprobs is None or len(logprobs) != len(token_ids) or None in logprobs:
        raise OpenAIBackendError("the reply lacks a logprob for some sampled token")
    finish_reason = choice.get("finish_reason")
    if finish_reason not in ("stop", "length"):
        raise OpenAIBackendError(f"generation ended with finish_reason={finish_reason!r}")
    return Generation(
        token_ids=token_ids,
        logprobs=[float(x) for x in logprobs],
        finish_reason=finish_reason,
        text=choice.get("text") or "",
    )


def retry_delay(attempt: int, backoff_s: float, retry_after: str | None = None) -> float:
    """Seconds to wait before retry number `attempt + 1`: exponential, jittered, capped."""
    delay = backoff_s * 2**attempt * (1.0 + 0.25 * random.random())  # jitter: no lockstep
    if retry_after is not None and retry_after.strip().isdigit():
        delay = max(delay, float(retry_after))  # a 429/503 that says when to come back
    return min(delay, _MAX_DELAY_S)


class OpenAIBackend:
    """Generation through an OpenAI-compatible completions server (e.g. `vllm serve`)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        max_concurrency: int = 8,
        api_key: str | None = None,
        backoff_s: float = 0.5,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        """Talk to the server at `base_url` (with or without `/v1`) that serves `model`; every
        request also stops on `stop_token_ids` (pass `turn_end_ids(tokenizer).stop_ids`)."""
        if max_concurrency < 1 or max_retries < 0:
            raise ValueError("need max_concurrency >= 1 and max_retries >= 0")
        self.model = model
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        """Ids every request stops on besides the server model's EOS."""
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._limit = max_concurrency
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="openai-backend", daemon=True
        )
        self._thread.start()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = self._run(
            self._open_client(base_url, timeout_s, headers)
        )
        self._semaphore = self._run(self._make_semaphore())

    async def _open_client(
        self, base_url: str, timeout_s: float, headers: dict[str, str]
    ) -> httpx.AsyncClient:
        # Created on the private loop: an AsyncClient's connection pool belongs to one loop.
        limits = httpx.Limits(max_connections=self._limit, max_keepalive_connections=self._limit)
        return httpx.AsyncClient(
            base_url=api_root(base_url),
            timeout=httpx.Timeout(timeout_s),
            limits=limits,
            headers=headers,
        )

    async def _make_semaphore(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self._limit)

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the private loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        """Continue every prompt once, one request each; `seeds[i]` seeds prompt i."""
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if self._client is None:
            raise OpenAIBackendError("the OpenAI backend is closed")
        pairs = zip(prompts, seeds, strict=True)
        bodies = [
            completion_request(self.model, prompt, sampling, seed, self.stop_token_ids)
            for prompt, seed in pairs
        ]
        return self._run(self._complete_all(bodies))

    async def _complete_all(self, bodies: list[dict[str, Any]]) -> list[Generation]:
        tasks = [asyncio.ensure_future(self._complete(body)) for body in bodies]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # one prompt failed for good: stop spending on the others
                task.cancel()
            raise

    async def _complete(self, body: dict[str, Any]) -> Generation:
        start = time.perf_counter()
        async with self._semaphore:
            reply, attempts = await self._post_with_retries(body)
        generation = parse_completion(reply)
        generation.extra.update(latency_s=time.perf_counter() - start, attempts=float(attempts))
        return generation

    async def _post_with_retries(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """POST one completion; retry transient failures; return the reply and attempts used."""
        assert self._client is not None
        failure = ""
        for attempt in range(self.max_retries + 1):
            retry_after = None
            try:
                response = await self._client.post("/completions", json=body)
            except httpx.TransportError as error:  # connect errors, timeouts, dropped sockets
                failure = f"{type(error).__name__}: {error}"
            else:
                if response.status_code == 200:
                    return response.json(), attempt + 1
                failure = f"HTTP {response.status_code}: {response.text[:500]}"
                if response.status_code not in RETRYABLE_STATUS:
                    raise OpenAIBackendError(f"completion request refused: {failure}")
                retry_after = response.headers.get("retry-after")
            if attempt < self.max_retries:
                await asyncio.sleep(retry_delay(attempt, self.backoff_s, retry_after))
        raise OpenAIBackendError(f"gave up after {self.max_retries + 1} attempts: {failure}")

    def update_weights(self, model: torch.nn.Module) -> None:
        """Always raises `RemoteWeightsError`: the server loads and updates its own weights."""
        raise RemoteWeightsError(
            "OpenAIBackend cannot push weights: the server's weights are managed outside this "
            "process (restart it on a new checkpoint, or use vLLM's weight-transfer endpoints). "
            "Use the `vllm` backend for on-policy training."
        )

    def score(
        self, sequences: list[list[int]], targets: list[list[bool]], temperature: float
    ) -> list[list[float]]:
        """Always raises `RemoteWeightsError`: the trainer pushes no weights to check here."""
        raise RemoteWeightsError(
            "OpenAIBackend holds no weights the trainer pushed: rollout.canary needs the hf or "
            "vllm backend"
        )

    def free_caches(self) -> None:
        """Nothing: the server's caches are the server's."""

    def close(self) -> None:
        """Close the HTTP client and stop the private loop; safe to call twice."""
        if self._client is None:
            return
        self._run(self._client.aclose())
        self._client = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
