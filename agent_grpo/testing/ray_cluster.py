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


def interface_bytes() -> dict[str, int]:
    """Bytes received so far on each network interface of this machine (`/proc/net/dev`)."""
    out = {}
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, fields = line.partition(":")
        out[name.strip()] = int(fields.split()[0])
    return out


def _node_ports() -> list[str]:
    """`ray start` flags giving a node ports of its own (two nodes on one machine would
    otherwise both take Ray's fixed defaults), worker ports from a range of its own."""
    flags = []
    for flag in ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                 "--metrics-export-port"):  # fmt: skip
        flags += [flag, str(free_port())]
    low = random.randrange(20000, 60000, 200)
    return [*flags, "--min-worker-port", str(low), "--max-worker-port", str(low + 199)]


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """`ray start --block ARGS` in a session of its own, its output in `log`."""
    ray = str(Path(sys.executable).parent / "ray")
    with log.open("w") as out:
        return subprocess.Popen([ray, "start", "--block", "--node-ip-address", HOST, *args],
                                env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip


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
    env = {**env, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))  # short: Ray's socket paths
    port = free_port()
    common = ["--num-cpus", str(cpus_per_node), "--object-store-memory", str(100 * 2**20),
              "--disable-usage-stats"]  # fmt: skip
    cluster = RayCluster(address=f"{HOST}:{port}")
    try:
        head = ["--head", "--port", str(port), "--include-dashboard", "false",
                "--ray-client-server-port", str(free_port()), "--temp-dir", str(temp)]  # fmt: skip
        cluster.nodes.append(_start([*head, *common, *_node_ports()], env, temp / "head.log"))
        _wait_for_port(port, cluster.nodes[0], timeout_s)
        for i in range(workers):
            args = ["--address", cluster.address, "--resources", json.dumps(worker_resources)]
            log = temp / f"worker-{i}.log"
            cluster.nodes.append(_start([*args, *common, *_node_ports()], env, log))
        yield cluster
    finally:
        for node in reversed(cluster.nodes):
            _stop(node)
        shutil.rmtree(temp, ignore_errors=True)
