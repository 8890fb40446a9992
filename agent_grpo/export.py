"""`agent-grpo export RUN`: the run's latest weights as a plain Hugging Face model directory.

A LoRA run's checkpoint holds the adapter alone; its export holds the base model with the
adapter merged (`OUT/model`, loadable by anything that loads transformers models) and the
adapter itself (`OUT/adapter`, for peft or vLLM's LoRA support). The adapter's
`base_model_name_or_path` is the base model's public name where it has one (`public_model_id`),
not the path it was loaded from on this machine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from agent_grpo.config.base import ConfigError
from agent_grpo.models.loading import (
    ADAPTER_CONFIG,
    EMBEDDED_MODELS,
    embedded_model_dir,
    load_model,
    load_tokenizer,
)
from agent_grpo.run_dir.writer import RunWriter
from agent_grpo.trainer.lora import is_adapter_dir

__all__ = ["export_run", "public_model_id"]


def export_run(run_path: str | Path, out: str | Path) -> Path:
    """Write the latest checkpoint of `run_path` to `out` (see the module docstring)."""
    try:
        run = RunWriter.open(run_path)
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None
    checkpoint = run.latest_checkpoint()
    if checkpoint is None:
        raise ConfigError(f"{run.path} has no checkpoint to export")
    source, out = checkpoint / "model", Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists; export writes a new directory")
    # what is exported gets shared: a link in a checkpoint (its author put it there) would
    # copy whatever it points at (~/.ssh, say) into the export
    links = [p for p in (source, *source.rglob("*")) if p.is_symlink()]
    if links:
        raise ConfigError(f"{links[0]} is a symlink: export copies a checkpoint's own files, "
                          "never what a link points at")  # fmt: skip
    load_model(source).save_pretrained(out / "model")  # merged when `source` is an adapter
    load_tokenizer(source).save_pretrained(out / "model")
    if is_adapter_dir(source):
        shutil.copytree(source, out / "adapter")
        config_file = out / "adapter" / ADAPTER_CONFIG
        config = json.loads(config_file.read_text())
        base = config.get("base_model_name_or_path")
        if isinstance(base, str):
            config["base_model_name_or_path"] = public_model_id(base)
            config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def public_model_id(name_or_path: str) -> str:
    """The name a model loads by on any machine: an embedded model's name for its directory
    (`agent-grpo model fetch` makes it anywhere), `org/name` for a snapshot in the Hugging Face
    hub cache (`.../models--org--name/snapshots/REV`); anything else unchanged."""
    path = Path(name_or_path).expanduser()
    if not path.is_absolute():
        return name_or_path  # already a name (an embedded model's or a hub id), or relative
    resolved = path.resolve()
    for name in EMBEDDED_MODELS:
        if resolved == embedded_model_dir(name).resolve():
            return name
    parts = resolved.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    return name_or_path
