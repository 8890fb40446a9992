"""uid leases are machine-wide: processes with different `$TMPDIR`s never lease the same uid at
once, so neither disposes of the other's cgroup as stale; and a cgroup holding a live call of
another process is never disposed of."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_grpo.sandbox import runner as sandbox
from agent_grpo.sandbox.bwrap import find_bwrap
from agent_grpo.sandbox.cgroup import find_layout
from agent_grpo.sandbox.runner import SandboxError, SandboxLimits, run_sandboxed

UID = 62048
"""The one uid these tests lease (no other test file uses it)."""
needs_root_bwrap_cgroup = pytest.mark.skipif(
    os.geteuid() != 0 or find_bwrap() is None or find_layout() is None,
    reason="uid leases and cgroups need root, bubblewrap and a writable cgroup",
)

# A caller process: one-uid range, says "ready", waits for "go", then makes its calls.
CALLER = f"""\
import json, sys
from agent_grpo.sandbox import runner
from agent_grpo.sandbox.runner import SandboxLimits, run_sandboxed
runner._UID_RANGE = range({UID}, {UID + 1})
print("ready", flush=True)
sys.stdin.readline()
outcomes = []
for _ in range(4):
    try:
        result = run_sandboxed("import time; time.sleep(0.3); print('ok')",
                               limits=SandboxLimits(wall_time_s=5))
        outcomes.append([result.stdout, result.killed_by])
    except Exception as error:
        outcomes.append([repr(error), None])
print(json.dumps(outcomes), flush=True)
"""


def start_caller(tmpdir: str) -> subprocess.Popen[str]:
    env = {**os.environ, "TMPDIR": tmpdir}
    caller = subprocess.Popen(
        [sys.executable, "-c", CALLER], env=env, text=True, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert caller.stdout is not None and caller.stdout.readline() == "ready\n"
    return caller


@pytest.mark.slow  # eight 0.3 s calls in turn on one uid
@needs_root_bwrap_cgroup
def test_processes_with_different_tmpdirs_never_share_a_uid(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    callers = [start_caller(str(tmp_path / name)) for name in ("a", "b")]
    for caller in callers:  # both start their calls together
        assert caller.stdin is not None
        caller.stdin.write("go\n")
        caller.stdin.flush()
    outcomes = [json.loads(caller.communicate(timeout=120)[0]) for caller in callers]
    assert outcomes == [[["ok\n", None]] * 4] * 2


@pytest.fixture
def live_call_of_another_process() -> Iterator[subprocess.Popen[str]]:
    """A cgroup named for `UID` holding a sleeper whose parent, another live process, is its
    caller (as bwrap's monitor is the trainer's child in a call that is still running)."""
    layout = find_layout()
    assert layout is not None
    dirs = list(
        dict.fromkeys(parent / f"agent-grpo-sbx-{UID}" for parent in layout.parents.values())
    )
    for path in dirs:
        path.mkdir()
    procs = " ".join(f"'{d / 'cgroup.procs'}'" for d in dirs)
    script = f"setpriv --reuid={UID} -- sleep 60 & for f in {procs}; do echo $! > $f; done; wait"
    caller = subprocess.Popen(["/bin/sh", "-c", script], text=True)
    try:
        while not (dirs[0] / "cgroup.procs").read_text().strip():
            time.sleep(0.01)
        yield caller
    finally:
        for path in dirs:
            for pid in (path / "cgroup.procs").read_text().split():
                os.kill(int(pid), 9)
        caller.wait(timeout=10)
        for path in dirs:
            path.rmdir()


@needs_root_bwrap_cgroup
def test_a_cgroup_holding_a_live_call_of_another_process_is_not_disposed_of(
    monkeypatch: pytest.MonkeyPatch, live_call_of_another_process: subprocess.Popen[str]
) -> None:
    monkeypatch.setattr(sandbox, "_UID_RANGE", range(UID, UID + 1))
    with pytest.raises(
        SandboxError, match=f"live call of process {live_call_of_another_process.pid}"
    ):
        run_sandboxed("print(1)", limits=SandboxLimits(wall_time_s=2))
    assert live_call_of_another_process.poll() is None  # its sleeper was not killed
