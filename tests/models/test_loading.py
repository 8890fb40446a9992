"""Embedded model loading, the tiny test model, and the load error paths (fetching and
assembling embedded models: test_embedded.py)."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, PreTrainedTokenizerBase

from agent_grpo.models import loading as models
from agent_grpo.models.loading import (
    CorruptModelError,
    ModelNotFoundError,
    check_model_source,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from agent_grpo.testing.tiny_model import build_tiny_model, tiny_model_config

CONVERSATION = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": '<tool_call>{"name": "add"}</tool_call>'},
    {"role": "tool", "content": "5"},
    {"role": "user", "content": "Thanks <|im_end|> bye"},
]
# The ChatML text SmolLM2's template must render for CONVERSATION, written out by hand.
CONVERSATION_TEXT = (
    "<|im_start|>system\nYou are a calculator.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>{"name": "add"}</tool_call><|im_end|>\n'
    "<|im_start|>tool\n5<|im_end|>\n"
    "<|im_start|>user\nThanks <|im_end|> bye<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def _template_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    return list(ids)


# ---------------------------------------------------------------------------------------------
# The real embedded model


# Observed once (2026-11-30, transformers 5.19, torch 2.13 CPU) by greedy-decoding this prompt
# with the freshly fetched model: "The capital of France is Paris.<|im_end|>".
FRANCE_PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_GREEDY_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]


def _greedy_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    model = load_model(models.DEFAULT_MODEL)
    prompt = torch.tensor([_template_ids(tokenizer, FRANCE_PROMPT)])  # [1, T]
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)  # [1, T + 8]
    return out[0, prompt.shape[1] :].tolist()


@pytest.mark.slow
def test_embedded_model_greedy_answer_is_pinned_and_stable(
    embedded_model_dir: Path, tokenizer: PreTrainedTokenizerBase
) -> None:
    assert huggingface_hub.constants.HF_HUB_OFFLINE, "conftest must put the hub offline"
    first = _greedy_ids(tokenizer)
    second = _greedy_ids(tokenizer)
    assert first == FRANCE_GREEDY_IDS
    assert second == first
    assert tokenizer.decode(first) == "The capital of France is Paris.<|im_end|>"


def test_chat_template_renders_chatml(tokenizer: PreTrainedTokenizerBase) -> None:
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert text == CONVERSATION_TEXT
    ids = _template_ids(tokenizer, CONVERSATION)
    # 5 messages + the generation prompt open 6 turns; 5 turns end, and text in a message that
    # looks like `<|im_end|>` becomes that special token too (the token builder must know).
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 6
    assert ids.count(tokenizer.eos_token_id) == 6
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.pad_token_id == 2


def test_chat_template_adds_default_system_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    text = tokenizer.apply_chat_template(FRANCE_PROMPT, add_generation_prompt=True, tokenize=False)
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, "
        "trained by Hugging Face<|im_end|>\n<|im_start|>user\n"
    )


def test_tiny_and_embedded_share_tokenizer(
    tokenizer: PreTrainedTokenizerBase, tiny_model_dir: Path
) -> None:
    tiny = load_tokenizer(tiny_model_dir)  # round trip through save_tiny_model
    assert tiny.get_vocab() == tokenizer.get_vocab()
    assert len(tiny) == len(tokenizer) == 49152
    assert tiny.all_special_tokens == tokenizer.all_special_tokens
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(tiny, attr) == getattr(tokenizer, attr), attr
    assert _template_ids(tiny, CONVERSATION) == _template_ids(tokenizer, CONVERSATION)


def test_tiny_config_is_smollm2_scaled_down(embedded_model_dir: Path) -> None:
    real = AutoConfig.from_pretrained(embedded_model_dir)
    tiny = tiny_model_config()
    for key in ("model_type", "vocab_size", "hidden_act", "tie_word_embeddings", "rope_parameters"):
        assert getattr(tiny, key) == getattr(real, key), key
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings"):
        assert getattr(tiny, key) == getattr(real, key), key
    assert tiny.rms_norm_eps == pytest.approx(real.rms_norm_eps)
    sizes = (tiny.num_hidden_layers, tiny.hidden_size, tiny.num_attention_heads)
    assert (*sizes, tiny.num_key_value_heads, tiny.intermediate_size) == (2, 64, 4, 2, 128)


# ---------------------------------------------------------------------------------------------
# The tiny model


def test_tiny_model_is_deterministic_per_seed(tokenizer: PreTrainedTokenizerBase) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, _ = build_tiny_model(tokenizer, seed=0)
    assert torch.equal(torch.rand(3), expected_next), "building must not move the global RNG"
    b, _ = build_tiny_model(tokenizer, seed=0)
    c, _ = build_tiny_model(tokenizer, seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(
        sa["model.layers.0.mlp.up_proj.weight"], sc["model.layers.0.mlp.up_proj.weight"]
    )


def test_tiny_model_shape_and_generation_ids(tiny_model: Any) -> None:
    model, tokenizer = tiny_model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2
    assert model.generation_config.pad_token_id == 2
    ids = torch.tensor([_template_ids(tokenizer, CONVERSATION)])  # [1, T]
    with torch.no_grad():
        logits = model(ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], 49152)


def test_saved_tiny_model_loads_to_same_logits(tiny_model: Any, tiny_model_dir: Path) -> None:
    fresh, _ = tiny_model
    loaded = load_model(tiny_model_dir)
    ids = torch.tensor([[1, 9690, 198, 504, 3575, 2]])  # [1, 6]
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, loaded(ids).logits)
    assert loaded.generation_config.eos_token_id == 2


# ---------------------------------------------------------------------------------------------
# Resolving names and paths


def test_home_defaults_to_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENT_GRPO_HOME", raising=False)
    assert models.agent_grpo_home() == Path.home() / ".cache" / "agent-grpo"


def test_resolve_missing_embedded_model_says_how_to_fetch(home: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not fetched") as info:
        resolve_model_path("smollm2-135m-instruct")
    assert "agent-grpo model fetch" in str(info.value) and "make model" in str(info.value)


def test_resolve_incomplete_embedded_model(home: Path) -> None:
    (home / "models" / "smollm2-135m-instruct").mkdir(parents=True)
    with pytest.raises(ModelNotFoundError, match=r"incomplete \(no \.complete stamp"):
        resolve_model_path("smollm2-135m-instruct")


def test_resolve_paths_and_hub_ids(tmp_path: Path) -> None:
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    for missing in (str(tmp_path / "nope"), "runs/demo/checkpoint", "./nope"):
        with pytest.raises(ModelNotFoundError, match="does not exist"):
            resolve_model_path(missing)


def _fake_model_dir(root: Path, weights: bytes | None) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}")
    (root / ".complete").write_text("{}")
    if weights is not None:
        (root / "model.safetensors").write_bytes(weights)
    return root


def _truncated_safetensors(tmp_path: Path) -> bytes:
    save_file({"w": torch.arange(64.0)}, tmp_path / "ok.safetensors")
    return (tmp_path / "ok.safetensors").read_bytes()[:-16]


@pytest.mark.parametrize("kind", ["garbage", "truncated"])
def test_corrupt_embedded_weights_name_file_and_refetch(
    home: Path, tmp_path: Path, kind: str
) -> None:
    data = b"garbage" if kind == "garbage" else _truncated_safetensors(tmp_path)
    model_dir = _fake_model_dir(home / "models" / "smollm2-135m-instruct", data)
    with pytest.raises(CorruptModelError) as info:
        load_model("smollm2-135m-instruct")
    assert str(model_dir / "model.safetensors") in str(info.value)
    assert "agent-grpo model fetch --force" in str(info.value)


def test_missing_weights_and_config_are_named(tmp_path: Path) -> None:
    model_dir = _fake_model_dir(tmp_path / "m", weights=None)
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors") as info:
        load_model(model_dir)
    assert "re-save or re-download" in str(info.value)  # not ours: no fetch hint
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match=r"config\.json is missing"):
        load_model(model_dir)
    with pytest.raises(ModelNotFoundError, match=r"tokenizer\.json is missing"):
        load_tokenizer(model_dir)


def test_a_second_embedded_model_names_itself_in_the_fetch_hint(home: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not fetched") as info:
        resolve_model_path("gemma3-270m")
    assert "`agent-grpo model fetch gemma3-270m` (or `make model`)" in str(info.value)
    model_dir = _fake_model_dir(home / "models" / "gemma3-270m", b"garbage")
    with pytest.raises(CorruptModelError, match="agent-grpo model fetch gemma3-270m --force"):
        load_model("gemma3-270m")
    assert model_dir.is_dir()


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub not offline, with an empty cache: a hub id must be asked for."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


def _hub_at(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", url)


def test_an_uncached_hub_id_without_network_is_one_line_at_once(
    online: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as closed:  # a port nothing listens on: the connection is refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    _hub_at(monkeypatch, f"http://127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(ModelNotFoundError) as info:
        check_model_source("HuggingFaceTB/nonexistent-model")
    assert time.monotonic() - started < 5  # one request, not transformers' minute of retries
    assert str(info.value).startswith(
        "model 'HuggingFaceTB/nonexistent-model' is not a local directory, an embedded model or "
        f"in the hub cache, and the Hugging Face hub (http://127.0.0.1:{port}) cannot be reached "
        "(ConnectError: "
    )
    assert "\n" not in str(info.value)


def test_a_hub_id_the_hub_does_not_know_is_one_line(
    online: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _hub_at(monkeypatch, f"http://127.0.0.1:{server.server_port}")
        with pytest.raises(ModelNotFoundError, match=r"has no model of that id \(a private"):
            check_model_source("HuggingFaceTB/nonexistent-model")
    finally:
        server.shutdown()
        server.server_close()
