"""The wheel installs `agent_grpo` with `agent_grpo.envs` and `agent_grpo.tools`, nothing else.

The wheel is built from a copy of the source tree (so the checkout's `build/` and egg-info are
untouched), installed with `--no-deps` into a fresh venv, and imported from that venv with the
main venv's site-packages on PYTHONPATH: dependencies resolve, but agent_grpo must come from the
wheel (PYTHONPATH does not run the main venv's editable-install `.pth` hook).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCE_IGNORE = shutil.ignore_patterns(
    ".git", ".venv", "build", "dist", "runs", "*.egg-info", "__pycache__", ".*_cache", "tests"
)

IMPORT_CHECK = """
import importlib.util, json, agent_grpo, agent_grpo.envs, agent_grpo.tools
print(json.dumps({
    "agent_grpo": agent_grpo.__file__,
    "envs": agent_grpo.envs.__file__,
    "tools": agent_grpo.tools.__file__,
}))
"""


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env, cwd=cwd)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project wheel, built without isolation (no network) from a copy of the source."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"
    shutil.copytree(REPO, source, ignore=SOURCE_IGNORE)
    out = root / "dist"
    # No isolation: no network. Skip the check for the `wheel` build requirement: setuptools
    # >= 70.1 builds wheels itself, and `make install` does not install `wheel`.
    build = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check"]
    _run([*build, "-o", str(out), str(source)])
    (built,) = out.glob("agent_grpo-*.whl")
    return built


@pytest.mark.slow
def test_wheel_holds_only_the_agent_grpo_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"agent_grpo", f"{wheel.name.split('-py')[0]}.dist-info"}
    for module in ("agent_grpo/envs/__init__.py", "agent_grpo/tools/__init__.py"):
        assert module in names
    assert "agent_grpo/py.typed" in names


@pytest.mark.slow
def test_wheel_installs_and_imports_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    # The main venv's pip installs into the fresh one (pip >= 22.3); avoids bootstrapping pip.
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel)])
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    out = _run([str(python), "-c", IMPORT_CHECK], env=env, cwd=tmp_path)
    files = {key: Path(value) for key, value in json.loads(out).items()}
    for key, path in files.items():
        assert path.is_relative_to(venv), f"{key} imported from {path}, not the fresh venv"
    site = files["agent_grpo"].parent.parent
    assert not (site / "envs").exists() and not (site / "tools").exists()
    assert (venv / "bin" / "agent-grpo").is_file()
