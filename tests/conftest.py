"""Shared fixtures: the real SmolLM2 tokenizer, the tiny test model, the embedded model directory.

Session-scoped objects (`tokenizer`, `tiny_model_dir`) are shared by every test: never mutate them
(no added tokens, no changed chat template). `tiny_model` is built fresh for each test.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator

# Set before anything imports huggingface_hub (it reads this once, at import): no test downloads.
os.environ["HF_HUB_OFFLINE"] = "1"

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from agent_grpo.models.loading import (
    DEFAULT_MODEL,
    ModelNotFoundError,
    load_tokenizer,
    resolve_model_path,
)
from agent_grpo.testing.tiny_model import build_tiny_model, save_tiny_model

if "OMP_NUM_THREADS" not in os.environ:
    # Test models are tiny; on a small shared CI box, intra-op threads fight each other and a
    # 135M forward pass goes from 0.5 s to 5+ s.
    torch.set_num_threads(1)


@pytest.fixture
def cli_logging() -> Iterator[None]:
    """For a test that calls `cli.main` in-process: the `agent_grpo` logger as it was after it.

    `main` runs `setup_logging`, whose console handler holds the test's captured stdout and would
    print every later test's log lines into that test's output.
    """
    logger = logging.getLogger("agent_grpo")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    logger.handlers[:], logger.level, logger.propagate = saved


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """Directory of the fetched embedded model; fails with the fix if it is not fetched."""
    try:
        return Path(resolve_model_path(DEFAULT_MODEL))
    except ModelNotFoundError as error:
        pytest.fail(f"{error} (`make test` fetches it first)", pytrace=False)


@pytest.fixture(scope="session")
def tokenizer(embedded_model_dir: Path) -> PreTrainedTokenizerBase:
    """The real SmolLM2 tokenizer (ChatML template, eos = pad = `<|im_end|>` = 2)."""
    return load_tokenizer(embedded_model_dir)


@pytest.fixture
def tiny_model(
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """A fresh tiny SmolLM2-shaped model (seed 0) and the real tokenizer."""
    return build_tiny_model(tokenizer, seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: PreTrainedTokenizerBase
) -> Path:
    """The seed-0 tiny model saved as a Hugging Face directory, for engines that need a path."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0, tokenizer=tokenizer)


@pytest.fixture(scope="session", params=["eos-endoftext", "template-endoftext"])
def eos_not_turn_end(
    request: pytest.FixtureRequest, tokenizer: PreTrainedTokenizerBase
) -> PreTrainedTokenizerBase:
    """A copy of the real tokenizer whose EOS is not what closes an assistant turn: EOS
    `<|endoftext|>` (0) under the ChatML template (turn end `<|im_end|>`, 2), or EOS `<|im_end|>`
    under a template that closes turns with `<|endoftext|>`. Both stop on (0, 2)."""
    other = copy.deepcopy(tokenizer)
    if request.param == "eos-endoftext":
        other.eos_token = "<|endoftext|>"
    else:
        other.chat_template = tokenizer.chat_template.replace("<|im_end|>", "<|endoftext|>")
    return other
