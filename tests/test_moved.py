"""Old module paths and moved names fail with an `ImportError` that names the new place."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from agent_grpo.models import loading
from agent_grpo.testing import tiny_model


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("agent_grpo.env", "agent_grpo.envs.text_env"),
        ("agent_grpo.train.loop", "agent_grpo.trainer"),
        ("agent_grpo.tools.sandbox", "agent_grpo.sandbox.runner"),
        ("agent_grpo.rollout.hf_backend", "agent_grpo.rollout.backends.hf"),
        ("agent_grpo.tools.call_format", "agent_grpo.tools.formats"),
        ("agent_grpo.toolcalls", "agent_grpo.tools.formats"),
        ("agent_grpo.testing.templates", "agent_grpo.inspect.rewriting_templates"),
    ],
)
def test_a_moved_module_names_its_new_place(old: str, new: str) -> None:
    done = subprocess.run([sys.executable, "-c", f"import {old}"], capture_output=True, text=True)
    assert done.returncode == 1
    assert f"moved: import {new}" in done.stderr.splitlines()[-1]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("agent_grpo.train.config", "agent_grpo.config.jobs"),
        ("agent_grpo.train.evaluation", "agent_grpo.evaluation.in_training"),
        ("agent_grpo.train.workers", "agent_grpo.rollout.sources"),
    ],
)
def test_a_submodule_of_a_moved_package_names_its_own_new_place(old: str, new: str) -> None:
    # The package's import fails first, so its one message must carry the submodule's new home.
    done = subprocess.run([sys.executable, "-c", f"import {old}"], capture_output=True, text=True)
    assert done.returncode == 1
    assert f"{old} -> {new}" in done.stderr.splitlines()[-1]


@pytest.mark.parametrize("name", ["build_tiny_model", "save_tiny_model", "tiny_model_config"])
def test_a_tiny_model_name_imported_from_loading_names_its_new_module(name: str) -> None:
    assert callable(getattr(tiny_model, name))
    moved = f"agent_grpo.models.loading.{name} moved: import it from agent_grpo.testing.tiny_model"
    with pytest.raises(ImportError, match=re.escape(moved)):
        exec(f"from agent_grpo.models.loading import {name}", {})


def test_a_name_loading_never_had_fails_as_usual() -> None:
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
        exec("from agent_grpo.models.loading import no_such_name", {})
    assert not hasattr(loading, "no_such_name")


@pytest.mark.parametrize(
    ("name", "new"),
    [
        ("verify_record", "agent_grpo.inspect.verify"),
        ("Divergence", "agent_grpo.inspect.verify"),
        ("logprob_drift", "agent_grpo.inspect.drift"),
        ("recompute_logprobs", "agent_grpo.inspect.drift"),
    ],
)
def test_a_record_check_imported_from_curves_names_its_new_module(name: str, new: str) -> None:
    moved = f"agent_grpo.inspect.curves.{name} moved: import it from {new}"
    with pytest.raises(ImportError, match=re.escape(moved)):
        exec(f"from agent_grpo.inspect.curves import {name}", {})
