"""Start and stop a `vllm serve` (OpenAI-compatible server) on 127.0.0.1, for the `openai`
backend's tests and for benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

__all__ = ["vllm_server"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_healthy(server: subprocess.Popen[bytes], url: str, log: Path, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited {server.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vllm serve not healthy after {limit_s:.0f}s: {log.read_text()[-3000:]}")


def _stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's own process group (API server, engine core, worker), then SIGKILL."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


@contextmanager
def vllm_server(
    model_path: str, flags: list[str], log: Path, timeout_s: float, name: str = "bench"
) -> Iterator[str]:
    """`vllm serve` of `model_path` as model `name`; yields its `/v1` URL; stops it after.

    Always fp32, eager (no CUDA graphs or torch.compile: minutes of start-up on CPU), processed
    logprobs (what the `openai` backend expects) and no `generation_config.json` defaults.
    """
    port = _free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
        "--served-model-name", name, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm", *flags,
    ]  # fmt: skip
    # The in-process backend sets this to 0; the server needs its own engine process.
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    with log.open("wb") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        _wait_healthy(server, f"http://127.0.0.1:{port}/health", log, timeout_s)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        _stop(server)
