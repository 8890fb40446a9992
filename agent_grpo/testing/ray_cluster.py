"""A real multi-node Ray cluster on one machine, for tests: a head and worker nodes, each started
with `ray start --block` (a raylet, an object store and ports of its own) with
`--node-ip-address 127.0.0.1`. Ray advertises the machine's own address in place of a loopback
one (`resolve_ip_for_localhost`), which Linux routes over the loopback device all the same;
`interface_bytes` lets a test check that no traffic left it. On exit, also when the test
failed, every process of every node is killed by id: `ray stop` would stop every Ray process on
the machine, other people's too."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agent_grpo.testing.torchrun import free_port, kill_tree

__all__ = ["RayCluster", "interface_bytes", "ray_cluster"]

HOST = "127.0.0.1"


@dataclass
class RayCluster:
    """A running cluster."""

    address: str
    """`HOST:PORT` of the head's GCS, what `ray.init(address=...)` joins."""
    nodes: list[subprocess.Popen[str]] = field(default_factory=list)
    """The `ray start --block` process of each node, the head first."""
    logs: list[Path] = field(default_factory=list)
    """Each started node's output, in the order of `nodes`."""

    def log_tails(self) -> str:
        """The end of every node's log, for a test's failure message."""
        return "\n".join(f"--- {log.name}\n{_log_tail(log)}" for log in self.logs)


def interface_bytes() -> dict[str, int]:
    """Bytes received so far on each network interface of this machine (`/proc/net/dev`)."""
    out = {}
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        out[name.strip()] = int(fields.split()[0])
    return out


WORKER_PORTS = 200
"""Ports in each node's worker range."""


def _node_ports(worker_low: int) -> list[str]:
    """`ray start` flags giving a node ports of its own (two nodes on one machine would
    otherwise both take Ray's fixed defaults), worker ports from `worker_low` on."""
    flags = []
    for flag in ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                 "--metrics-export-port"):  # fmt: skip
        flags += [flag, str(free_port())]
    high = worker_low + WORKER_PORTS - 1
    return [*flags, "--min-worker-port", str(worker_low), "--max-worker-port", str(high)]


def _worker_ranges(count: int) -> list[int]:
    """The first port of `count` disjoint worker-port ranges, all below Linux's ephemeral range
    (32768 on), where `free_port` takes the nodes' other ports: a range that overlapped one of
    them, or another node's range, made a node exit at start (seen under load in CI)."""
    starts = random.sample(range(10000, 32768 - WORKER_PORTS, WORKER_PORTS), count)
    return sorted(starts)


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """`ray start --block ARGS` in a session of its own, its output in `log`."""
    ray = str(Path(sys.executable).parent / "ray")
    with log.open("w") as out:
        return subprocess.Popen([ray, "start", "--block", "--node-ip-address", HOST, *args],
                                env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip


def _log_tail(log: Path, lines: int = 15) -> str:
    """The last lines of a node's log, for an error message."""
    text = log.read_text(errors="replace") if log.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _wait_started(node: subprocess.Popen[str], log: Path, timeout_s: float) -> bool:
    """Until `ray start` reports its node running (True), or the node exits (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.poll() is not None:
            return False
        if log.exists() and "Ray runtime started" in log.read_text(errors="replace"):
            return True
        time.sleep(0.5)
    raise TimeoutError(f"a Ray node did not start in {timeout_s} s; its log:\n{_log_tail(log)}")


def _wait_for_port(port: int, node: subprocess.Popen[str], timeout_s: float) -> None:
    """Until the head's GCS accepts connections; fails if the node exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if node.poll() is not None:
            raise RuntimeError(f"the Ray head exited with {node.returncode}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            return
        time.sleep(0.5)
    raise TimeoutError(f"the Ray head did not listen on {HOST}:{port} in {timeout_s} s")


def _stop(node: subprocess.Popen[str]) -> None:
    """Kill a node: every process below its `ray start`, then its session's process group."""
    kill_tree(node)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(node.pid, signal.SIGKILL)


START_TRIES = 3
"""Starts of a worker node that exited at once before the cluster gives up."""


@contextlib.contextmanager
def ray_cluster(
    workers: int,
    worker_resources: dict[str, float],
    env: dict[str, str],
    cpus_per_node: int = 1,
    timeout_s: float = 120.0,
) -> Iterator[RayCluster]:
    """A head (no custom resources) and `workers` worker nodes with `worker_resources`, each
    with `cpus_per_node` CPUs and a small object store, all on 127.0.0.1; `env` is every node's
    environment (its workers inherit it). Stopped on exit, whatever happened."""
    # No token: the nodes listen on loopback only, and a token would tie the test to whatever
    # ~/.ray/auth_token an earlier local `ray.init` left (the driver sets the same mode).
    # Unbuffered: the start is seen by "Ray runtime started." in the node's log.
    env = {**env, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
           "PYTHONUNBUFFERED": "1"}  # fmt: skip
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
    port = free_port()
    common = ["--num-cpus", str(cpus_per_node), "--object-store-memory", str(100 * 2**20),
              "--disable-usage-stats"]  # fmt: skip
    cluster = RayCluster(address=f"{HOST}:{port}")
    ranges = _worker_ranges(1 + workers * START_TRIES)
    try:
        head = ["--head", "--port", str(port), "--include-dashboard", "false",
                "--ray-client-server-port", str(free_port()), "--temp-dir", str(temp)]  # fmt: skip
        log = temp / "head.log"
        cluster.nodes.append(_start([*head, *common, *_node_ports(ranges.pop())], env, log))
        cluster.logs.append(log)
        _wait_for_port(port, cluster.nodes[0], timeout_s)
        for i in range(workers):
            args = ["--address", cluster.address, "--resources", json.dumps(worker_resources)]
            for attempt in range(START_TRIES):  # a port taken between `free_port` and start
                log = temp / f"worker-{i}-{attempt}.log"
                node = _start([*args, *common, *_node_ports(ranges.pop())], env, log)
                cluster.nodes.append(node)
                cluster.logs.append(log)
                if _wait_started(node, log, timeout_s):
                    break
            else:
                raise RuntimeError(f"Ray worker node {i} exited at start {START_TRIES} times; "
                                   f"its log:\n{_log_tail(log)}")  # fmt: skip
        yield cluster
    finally:
        for node in reversed(cluster.nodes):
            _stop(node)
        shutil.rmtree(temp, ignore_errors=True)
