"""Old module paths and moved names fail with an `ImportError` that names the new place."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from agent_grpo.models import loading
from agent_grpo.testing import tiny_model


@pytest.mark.parametrize(
    ("old", "says"),
    [
        ("agent_grpo.env", "moved: import agent_grpo.envs.text_env"),
        ("agent_grpo.train.loop", "moved: import agent_grpo.trainer, whose other modules keep"),
        ("agent_grpo.tools.sandbox", "moved: import agent_grpo.sandbox.runner"),
        ("agent_grpo.rollout.hf_backend", "moved: import agent_grpo.rollout.backends.hf"),
        ("agent_grpo.tools.call_format", "moved: import agent_grpo.tools.formats"),
        ("agent_grpo.toolcalls", "moved: import agent_grpo.tools.formats"),
        ("agent_grpo.testing.templates", "moved: import agent_grpo.inspect.rewriting_templates"),
        # A moved package's import fails before its submodule's, so its one message must carry
        # the submodule's own new home.
        ("agent_grpo.train.config", "agent_grpo.train.config -> agent_grpo.config.jobs"),
        ("agent_grpo.train.workers", "agent_grpo.train.workers -> agent_grpo.rollout.sources"),
        ("agent_grpo.train.evaluation",
         "agent_grpo.train.evaluation -> agent_grpo.evaluation.in_training"),
    ],
)  # fmt: skip
def test_a_moved_module_names_its_new_place(old: str, says: str) -> None:
    done = subprocess.run([sys.executable, "-c", f"import {old}"], capture_output=True, text=True)
    assert done.returncode == 1
    assert says in done.stderr.splitlines()[-1]


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
