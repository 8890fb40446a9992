"""`agent-grpo export`: a run's latest weights as a Hugging Face directory, its adapter naming the
base model as anyone can load it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from agent_grpo.export import export_run, public_model_id
from agent_grpo.models.loading import DEFAULT_MODEL, embedded_model_dir, load_model
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.testing.tiny_model import save_tiny_model
from agent_grpo.trainer.lora import LoraSettings, wrap_lora


def test_public_model_id_names_embedded_models_and_hub_snapshots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AGENT_GRPO_HOME", str(tmp_path / "home"))
    assert public_model_id(str(embedded_model_dir(DEFAULT_MODEL))) == DEFAULT_MODEL
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "0a1b"
    assert public_model_id(str(snapshot)) == "HuggingFaceTB/SmolLM2-135M"
    assert public_model_id(str(tmp_path / "my-model")) == str(tmp_path / "my-model")  # no name
    assert public_model_id("Org/model") == "Org/model"


def test_an_exported_adapter_names_its_base_by_its_public_id(
    tmp_path: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    # The base as the trainer loads a hub id: from its snapshot in the hub cache.
    snapshot = tmp_path / "hub" / "models--Org--tiny-base" / "snapshots" / "abc123"
    save_tiny_model(snapshot, tokenizer=tokenizer)
    run = RunWriter.create(tmp_path / "runs", run_id="lora")
    checkpoint = run.path / "checkpoints" / "step_000001"
    wrap_lora(load_model(snapshot), LoraSettings(r=4, alpha=8)).save_pretrained(
        checkpoint / "model"
    )
    tokenizer.save_pretrained(checkpoint / "model")
    (checkpoint / "state.json").write_text(json.dumps({"step": 1}))
    saved = json.loads((checkpoint / "model" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(snapshot)  # the local path peft recorded

    out = export_run(run.path, tmp_path / "exported")
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "Org/tiny-base"
    assert {k: v for k, v in adapter.items() if k != "base_model_name_or_path"} == {
        k: v for k, v in saved.items() if k != "base_model_name_or_path"
    }
    assert (out / "model" / "config.json").is_file()


def test_a_checkpoint_holding_a_symlink_is_not_exported(tmp_path: Path) -> None:
    from agent_grpo.config.base import ConfigError

    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "id_rsa").write_text("private")
    run = RunWriter.create(tmp_path / "runs", run_id="r")
    checkpoint = run.path / "checkpoints" / "step_000001"
    (checkpoint / "model").mkdir(parents=True)
    (checkpoint / "state.json").write_text(json.dumps({"step": 1}))
    (checkpoint / "model" / "extra").symlink_to(secret)
    with pytest.raises(ConfigError, match=r"model/extra is a symlink: export copies"):
        export_run(run.path, tmp_path / "exported")
    assert not (tmp_path / "exported").exists()
