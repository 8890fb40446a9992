"""HTTP tools: `http_get` and `http_post` against one JSON service, with httpx.

The model writes only a path (`/items/3`); the base URL is fixed by the environment, so the tools
cannot reach any other host. Every call opens and closes its own client: no connection outlives a
call, which keeps the service's shutdown clean. An HTTP error status is a result, not a tool
error: the model sees `404 {"error": ...}` and can correct itself, as a program would. Proxies
from the environment are ignored (`trust_env=False`); the service is local.
"""

import ssl
from collections.abc import Callable
from functools import cache
from typing import Any

import httpx

from agent_grpo.tools.tool import Tool, tool

__all__ = ["http_request", "make_http_tools"]


@cache
def _tls_context() -> ssl.SSLContext:
    # Building a verifying TLS context loads the CA bundle, which is slow (docs/benchmarks.md,
    # "Verifying TLS context"); httpx would do it for every new client, even for plain-HTTP URLs.
    # Built once, shared by every call.
    return httpx.create_ssl_context()


def http_request(
    base_url: str, method: str, path: str, body: Any = None, timeout_s: float = 5.0
) -> str:
    """Send one request and return `<status> <body text>`."""
    if not path.startswith("/") or "://" in path:
        raise ValueError(f"path must start with '/' (e.g. /items), got {path!r}")
    with httpx.Client(timeout=timeout_s, trust_env=False, verify=_tls_context()) as client:
        response = client.request(method, base_url.rstrip("/") + path, json=body)
    return f"{response.status_code} {response.text}"


def make_http_tools(base_url: Callable[[], str], timeout_s: float = 5.0) -> list[Tool]:
    """`http_get(path)` and `http_post(path, body)` against the service at `base_url()`."""

    @tool(timeout_s=timeout_s + 1.0)
    def http_get(path: str) -> str:
        """Send a GET request to the API path, e.g. /items; returns status and JSON."""
        return http_request(base_url(), "GET", path, timeout_s=timeout_s)

    @tool(timeout_s=timeout_s + 1.0)
    def http_post(path: str, body: dict[str, Any]) -> str:
        """Send a POST request with a JSON body to the API path; returns status and JSON."""
        return http_request(base_url(), "POST", path, body, timeout_s=timeout_s)

    return [http_get, http_post]
