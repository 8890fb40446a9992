"""Where a rollout worker's pushes go: a torch model by name (tied aliases included), or LoRA
adapter versions on disk for a vLLM engine, the newest `keep` of them kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agent_grpo.config.jobs import LoraSettings
from agent_grpo.rollout.adapters import ADAPTER_FILE, vllm_lora_args
from agent_grpo.rollout.engine_weights import VLLMWeights, load_into_model
from agent_grpo.testing.tiny_model import build_tiny_model


def test_a_model_takes_a_push_by_name_with_its_tied_head(tokenizer: Any) -> None:
    model, _ = build_tiny_model(tokenizer, seed=0)
    new, _ = build_tiny_model(tokenizer, seed=1)
    weights = dict(new.named_parameters())  # no lm_head: tied to the embedding
    assert "lm_head.weight" not in weights
    load_into_model(model, {k: v.detach() for k, v in weights.items()})
    for (name, got), want in zip(model.state_dict().items(), new.state_dict().values(),
                                 strict=True):  # fmt: skip
        assert torch.equal(got, want), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_a_push_with_unknown_or_missing_weights_is_refused(tokenizer: Any) -> None:
    model, _ = build_tiny_model(tokenizer, seed=0)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    with pytest.raises(KeyError, match=r"does not have: \['lora\.weight'\]"):
        load_into_model(model, {**state, "lora.weight": torch.zeros(1)})
    state.pop("model.norm.weight")
    with pytest.raises(KeyError, match=r"without a value: \['model\.norm\.weight'\]"):
        load_into_model(model, state)


class AdapterEngine:
    """Records the adapters a vLLM engine was switched to."""

    def __init__(self) -> None:
        self.adapters: list[tuple[Path, int]] = []

    def use_adapter(self, path: Path, adapter_id: int) -> None:
        self.adapters.append((Path(path), adapter_id))


def test_adapter_versions_go_to_disk_and_the_oldest_leave() -> None:
    engine = AdapterEngine()
    lora = LoraSettings(r=4)
    weights = VLLMWeights(engine, lora, keep=2)  # type: ignore[arg-type]
    for version in range(4):
        weights.load({"base_model.model.x.lora_A.weight": torch.full((4, 8), version)}, version)
    assert weights.directory is not None
    assert sorted(p.name for p in weights.directory.iterdir()) == ["v2", "v3"]
    assert [i for _, i in engine.adapters] == [1, 2, 3, 4]  # vLLM ids start at 1
    path = engine.adapters[-1][0]
    assert (path / "adapter_config.json").is_file() and (path / ADAPTER_FILE).is_file()
    weights.close()
    assert not weights.directory.exists()


@pytest.mark.parametrize(("r", "rank"), [(1, 1), (4, 8), (16, 16), (17, 32), (512, 512)])
def test_vllm_reserves_the_smallest_rank_it_accepts(r: int, rank: int) -> None:
    args = vllm_lora_args(LoraSettings(r=r), adapters=3)
    assert args == {"enable_lora": True, "max_loras": 3, "max_cpu_loras": 3, "max_lora_rank": rank}
