"""LoRA through peft: only the adapter trains, the reference is the base
model with the adapter off, a zero adapter takes full fine-tuning's first step, and a LoRA run
checkpoints, resumes and exports."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from agent_grpo.config.base import ConfigError, load_config
from agent_grpo.config.jobs import AlgoConfig, LoraSettings, TrainConfig
from agent_grpo.models.loading import load_model
from agent_grpo.models.logprobs import token_logprobs
from agent_grpo.testing.cli_runs import agent_grpo, deterministic
from agent_grpo.testing.records import minimal_record
from agent_grpo.testing.reward_rules import reward_override
from agent_grpo.trainer.batch import pack_records
from agent_grpo.trainer.loop import train
from agent_grpo.trainer.lora import wrap_lora
from agent_grpo.trainer.parallel import DistContext, wrap_policy
from agent_grpo.trainer.policy import LogprobModel
from agent_grpo.trainer.update import minibatch_update
from agent_grpo.trajectory.record import Provenance

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs/calculator-tiny.yaml"
EVEN = reward_override("even", "even_tokens")
LORA = "model.lora={r: 16, alpha: 32, dropout: 0.0}"  # configs/calculator-lora.yaml's

# A group of three one-prompt-token, two-model-token episodes.
EPISODE = {
    "group_size": 3,
    "token_ids": [5, 6, 7],
    "provenance": [Provenance.PROMPT, Provenance.MODEL, Provenance.MODEL],
}


def batch():
    """4 rows with 8 model tokens each after a 4-token prompt, advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    records = []
    for i in range(4):
        r = minimal_record("a", i, float(i), **EPISODE)
        r.token_ids = torch.randint(3, 1000, (12,), generator=g).tolist()
        r.provenance = [Provenance.PROMPT] * 4 + [Provenance.MODEL] * 8
        r.sampler_logprobs = [None] * 4 + [-1.0] * 8
        records.append(r)
    return pack_records(records, 2, [1.0, -1.0, 0.5, -0.5])


def step(model: torch.nn.Module, lr: float = 1e-2):
    """One AdamW step of the GRPO update over `batch()`; returns its metrics."""
    policy = wrap_policy(model, "none", DistContext())
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr)
    metrics, _ = minibatch_update(policy, optimizer, batch(), None, None, AlgoConfig(), 1.0, 16)
    return metrics


def test_only_the_adapter_trains_and_the_reference_is_the_base_model(tiny_model) -> None:
    base, _ = tiny_model
    frozen = copy.deepcopy(base.state_dict())
    lora = wrap_lora(copy.deepcopy(base), LoraSettings(r=4, alpha=8))
    before = {k: v.detach().clone() for k, v in lora.named_parameters()}
    step(lora)
    changed = {k for k, v in lora.named_parameters() if not torch.equal(v, before[k])}
    assert changed and all("lora_" in k for k in changed)  # the base weights never move
    assert any("lora_A" in k for k in changed) and any("lora_B" in k for k in changed)
    b = batch()
    reference = LogprobModel(lora, adapter_disabled=True)
    with torch.no_grad():
        got = reference(b.input_ids, b.attention_mask, b.loss_mask, 1.0, False)
        base.load_state_dict(frozen)
        want = token_logprobs(base, b.input_ids, b.attention_mask, target_mask=b.loss_mask)
        adapted = LogprobModel(lora)(b.input_ids, b.attention_mask, b.loss_mask, 1.0, False)
    torch.testing.assert_close(got, want)  # adapter off: exactly the base model
    assert not torch.allclose(adapted[b.loss_mask], want[b.loss_mask])  # the adapter is live


def test_a_zero_adapter_takes_full_fine_tunings_first_loss(tiny_model) -> None:
    base, _ = tiny_model
    full = step(copy.deepcopy(base))
    lora = step(wrap_lora(copy.deepcopy(base), LoraSettings(r=4, alpha=8)))
    assert lora.loss == pytest.approx(full.loss, rel=1e-6, abs=1e-7)  # B = 0: same model
    assert lora.trained_tokens == full.trained_tokens == 32


def test_lora_with_fsdp_is_refused() -> None:
    with pytest.raises(ConfigError, match="not built"):
        load_config(TrainConfig, TINY, [LORA, "distributed.mode=fsdp"])


@pytest.mark.slow
def test_a_lora_run_checkpoints_resumes_and_exports(tmp_path: Path, tiny_model_dir: Path) -> None:
    common = [f"model.name_or_path={tiny_model_dir}", f"run.root={tmp_path}", "eval=null",
              "run.tensorboard=false", "algo.beta=0.04", "algo.lr=1.0e-3", EVEN, LORA]  # fmt: skip
    whole = train(load_config(TrainConfig, TINY, [*common, "run.name=whole"]))
    train(load_config(TrainConfig, TINY, [*common, "run.name=resumed", "steps=1"]))
    resumed = train(load_config(TrainConfig, TINY, [*common, "run.name=resumed"]), resume=True)
    rows = [[json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            for run in (whole, resumed)]  # fmt: skip
    assert [r["step"] for r in rows[1]] == [0, 1]
    assert deterministic(rows[1][1]) == pytest.approx(deterministic(rows[0][1]), rel=1e-5)
    assert rows[0][1]["kl_ref"] > 0  # the adapter moved the policy away from the base
    checkpoint = sorted((whole / "checkpoints").iterdir())[-1] / "model"
    assert (checkpoint / "adapter_config.json").is_file()
    assert not (checkpoint / "model.safetensors").exists()  # the adapter alone
    out = tmp_path / "exported"
    agent_grpo("export", str(whole), "--out", str(out), cwd=tmp_path)
    assert (out / "adapter" / "adapter_config.json").is_file()
    merged, from_adapter = load_model(out / "model"), load_model(checkpoint)
    ids = torch.tensor([list(range(5, 25))])
    with torch.no_grad():
        want = token_logprobs(from_adapter, ids, torch.ones_like(ids))
        torch.testing.assert_close(token_logprobs(merged, ids, torch.ones_like(ids)), want)
        base = token_logprobs(load_model(tiny_model_dir), ids, torch.ones_like(ids))
    assert not torch.allclose(want, base)  # the export carries the trained adapter


def test_an_engine_with_its_own_weights_gets_the_adapter_merged(tiny_model) -> None:
    from agent_grpo.rollout.backends.hf import HFBackend
    from agent_grpo.trainer.trainer import engine_copy

    base, tokenizer = tiny_model
    lora = wrap_lora(base, LoraSettings(r=4, alpha=8))
    step(lora)
    assert engine_copy(lora, HFBackend(lora, tokenizer)) is lora  # hf samples the policy itself

    class OwnWeights:  # what vLLM is to the trainer: an engine holding a copy of the weights
        """No `model` attribute shared with the trainer."""

    merged = engine_copy(lora, OwnWeights())  # type: ignore[arg-type]
    assert not hasattr(merged, "disable_adapter") and not any(
        "lora_" in k for k in merged.state_dict()
    )
    ids = torch.tensor([list(range(5, 25))])
    with torch.no_grad():
        want = token_logprobs(lora, ids, torch.ones_like(ids))
        torch.testing.assert_close(token_logprobs(merged, ids, torch.ones_like(ids)), want)


def test_the_documented_config_is_the_shipped_one() -> None:
    import yaml

    doc = (ROOT / "docs/lora.md").read_text()
    block = doc.split("```yaml\n", 1)[1].split("```", 1)[0]
    shipped = yaml.safe_load((ROOT / "configs/calculator-lora.yaml").read_text())
    assert yaml.safe_load(block)["model"] == shipped["model"]
    config = load_config(TrainConfig, ROOT / "configs/calculator-lora.yaml", [])
    assert config.model.lora == LoraSettings(r=16, alpha=32, dropout=0.0)
