"""Each bug found in the trainer's review, with a test that failed before its fix (issue 12)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from agent_grpo.config.base import ConfigError, load_config
from agent_grpo.config.jobs import AlgoConfig, TrainConfig
from agent_grpo.models.loading import load_model
from agent_grpo.models.logprobs import token_logprobs
from agent_grpo.rollout import step as train_rollout
from agent_grpo.rollout.collector import RolloutMetrics, RolloutResult, Task, collect_groups
from agent_grpo.rollout.config import RolloutConfig
from agent_grpo.testing import reward_rules
from agent_grpo.testing.backends import ScriptedBackend
from agent_grpo.testing.reward_rules import reward_override
from agent_grpo.trainer.batch import pack_records
from agent_grpo.trainer.loop import advantages_of, train
from agent_grpo.trainer.parallel import DistContext, wrap_policy
from agent_grpo.trainer.setup import resolve_max_tokens
from agent_grpo.trainer.update import minibatch_update
from agent_grpo.trajectory.record import Lengths, Message, Provenance, Termination, TrajectoryRecord
from agent_grpo.trajectory.tokens import ChatTemplateError

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs/calculator-tiny.yaml"
EVEN = reward_override("even", "even_tokens")

MEMBER_INDEX = f"{reward_rules.__name__}:member_index"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 34"}}</tool_call>'


def record(group: str, index: int, reward: float, kind: str = "terminated") -> TrajectoryRecord:
    return TrajectoryRecord(
        group_id=group, task_id=group, index_in_group=index, group_size=3, env_id="e", seed=0,
        messages=[Message(role="user", content="q")], token_ids=[5, 6, 7],
        provenance=[Provenance.PROMPT, Provenance.MODEL, Provenance.MODEL],
        sampler_logprobs=[None, -1.0, -1.0], reward=reward,
        termination=Termination(kind=kind, reason="env raised" if kind == "error" else "t"),  # type: ignore[arg-type]
        lengths=Lengths(total=3, model=2),
    )  # fmt: skip


def tiny_train(tmp: Path, model_dir: Path, *settings: str) -> Path:
    """Run `train` in-process on the tiny model: no eval, no warm start."""
    overrides = [f"model.name_or_path={model_dir}", f"run.root={tmp}", "eval=null",
                 "warm_start=null", "run.tensorboard=false", *settings]  # fmt: skip
    return train(load_config(TrainConfig, TINY, overrides))


# 4. infrastructure failures are not reward-0 answers


def test_an_infrastructure_failure_is_left_out_of_its_group_baseline() -> None:
    # Group a: rewards [1, 0] count, the error member (reward 0) does not: A = +-0.707 (std of
    # [1, 0] is sqrt(.5)), where counting it would give [1.15, -0.58, -0.58]. Group b keeps one
    # valid member: advantage 0 for all.
    records = [record("a", 0, 1.0), record("a", 1, 0.0), record("a", 2, 0.0, kind="error"),
               record("b", 0, 1.0), record("b", 1, 0.0, kind="error")]  # fmt: skip
    got = advantages_of(records, AlgoConfig()).tolist()
    assert got == pytest.approx([0.7071, -0.7071, 0.0, 0.0, 0.0], abs=1e-3)


# 3. a non-finite loss never reaches the weights


def test_a_non_finite_loss_skips_the_optimizer_step(tiny_model) -> None:
    model, _ = tiny_model
    records = [record("a", i, float(i)) for i in range(3)]
    batch = pack_records(records, 2, [1.0, -1.0, 0.5])
    old = torch.full(batch.input_ids.shape, -1.0)
    old[0, 1] = float("nan")  # pi_old of one model token is NaN: the loss is NaN
    policy = wrap_policy(model, "none", DistContext())
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    metrics, _ = minibatch_update(policy, optimizer, batch, old, None, AlgoConfig(), 1.0, 16)
    assert metrics.skipped_steps == 1 and metrics.optimizer_steps == 0
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert not optimizer.state  # AdamW's moments were never touched either


# 5. DAPO dynamic sampling decides on the total reward


def test_dynamic_sampling_keeps_groups_alive_by_an_extra_reward(monkeypatch) -> None:
    calls: list[int] = []

    def verifier_zero(tasks: list[Task], *args, step: int, run_id: str) -> RolloutResult:
        calls.append(step)
        records = [record(f"s{step}-t{t}", i, 0.0) for t in range(len(tasks)) for i in range(2)]
        return RolloutResult(records=records, metrics=RolloutMetrics())

    monkeypatch.setattr(train_rollout, "collect_groups", verifier_zero)
    config = TrainConfig.model_validate({
        "rollout": {"tasks_per_step": 2, "group_size": 2},
        "algo": {"dynamic_sampling": True},
        "rewards": [{"type": "rule", "name": "idx", "function": MEMBER_INDEX}],
    })  # fmt: skip
    result = train_rollout.collect(config, None, None, [], step=0)  # type: ignore[arg-type]
    assert calls == [0]  # the verifier alone says dead; the total reward says alive
    assert [r.reward for r in result.records] == [0.0, 1.0, 0.0, 1.0]


# 6. meaningless combinations are refused when the config is read


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algo.old_logprobs=sampler", "algo.tis_cap=2.0"], "weights would all be 1"),
        (["algo.max_tokens=100"], "would be ignored"),
        (["rollout.group_size=1"], "group of one never learns"),
        (["steps=-1"], "steps"),
        (["algo.minibatches=5"], "some minibatches"),
        (["model.device=gpu"], "model.device"),
        (["algo.epochs=0"], "algo.epochs"),
    ],
)
def test_meaningless_settings_are_refused_before_any_model_work(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, TINY, overrides)


@pytest.mark.slow
def test_recorded_pi_old_is_the_policy_before_the_update(tmp_path, tiny_model_dir) -> None:
    # old_logprobs=sampler with 2 minibatches: the second minibatch runs after an optimizer
    # step, so its first-pass logprobs are not pi_old (lr 1e-2 makes the difference visible)
    run = tiny_train(tmp_path, tiny_model_dir, EVEN, "run.name=pi-old", "steps=1",
                     "algo.old_logprobs=sampler", "algo.minibatches=2", "algo.lr=1.0e-2",
                     "algo.skip_zero_advantage=false")  # fmt: skip
    lines = (run / "trajectories" / "step_000000.jsonl").read_text().splitlines()
    model = load_model(tiny_model_dir)
    for r in map(json.loads, lines):
        ids = torch.tensor([r["token_ids"]])
        with torch.no_grad():
            want = token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0]
        got = [(i, v) for i, v in enumerate(r["old_logprobs"]) if v is not None]
        assert got, "every record has trainer logprobs"
        assert max(abs(v - float(want[i])) for i, v in got) < 1e-4


# 11. Dr. GRPO's normaliser is a constant


def test_dr_grpo_max_tokens_is_a_constant_of_the_config() -> None:
    # calculator-tiny: sampling.max_tokens 16; Calculator-v0 defaults to max_turns 4
    config = load_config(TrainConfig, TINY, ["algo.aggregation=seq-mean-token-sum-norm"])
    assert resolve_max_tokens(config) == 16 * 4
    config = load_config(TrainConfig, TINY, ["algo.aggregation=seq-mean-token-sum-norm",
                                             "env.kwargs={max_turns: 2}"])  # fmt: skip
    assert resolve_max_tokens(config) == 32
    fixed = ["algo.aggregation=seq-mean-token-sum-norm", "algo.max_tokens=100"]
    assert resolve_max_tokens(load_config(TrainConfig, TINY, fixed)) == 100


# 8. bf16 keeps fp32 master weights


def _adam_step(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One AdamW step (lr 1e-3) on a fixed batch; returns each parameter's change."""
    g = torch.Generator().manual_seed(0)
    records = []
    for i in range(4):
        ids = torch.randint(3, 1000, (12,), generator=g).tolist()
        r = record("a", i, float(i))
        r.token_ids = ids
        r.provenance = [Provenance.PROMPT] * 4 + [Provenance.MODEL] * 8
        r.sampler_logprobs = [None] * 4 + [-1.0] * 8
        records.append(r)
    batch = pack_records(records, 2, [1.0, -1.0, 0.5, -0.5])
    policy = wrap_policy(model, "none", DistContext(), compute_dtype=dtype)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    minibatch_update(policy, optimizer, batch, None, None, AlgoConfig(), 1.0, 16)
    return {k: v.detach() - before[k] for k, v in model.named_parameters()}


def test_bf16_compute_moves_the_weights_as_fp32_does(tiny_model) -> None:
    model, _ = tiny_model
    fp32 = _adam_step(copy.deepcopy(model), torch.float32)
    bf16_model = copy.deepcopy(model)
    bf16 = _adam_step(bf16_model, torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in bf16_model.parameters())  # master weights
    a = torch.cat([d.flatten() for d in fp32.values()])
    b = torch.cat([d.flatten() for d in bf16.values()])
    moved = a.abs() > 0.5e-3  # Adam's first step is about lr * sign(g) where g is not ~0
    assert float(moved.float().mean()) > 0.9
    # bf16 gradients differ in the last bits, so a few near-zero components change sign; an
    # update of size lr survives in the fp32 master weights (in bf16 weights, 0.02 + 1e-3
    # rounds back to 0.02 for every |w| > 0.256)
    assert float((b.abs() > 0.5e-3).float().mean()) > 0.9
    assert float((torch.sign(a[moved]) == torch.sign(b[moved])).float().mean()) > 0.9


# 14. model.device places everything that reaches the loss


def test_every_tensor_reaching_the_loss_is_on_the_configured_device(
    tmp_path, tiny_model_dir, monkeypatch
) -> None:
    from agent_grpo.algo import objective

    seen: set[torch.device] = set()
    real = objective.policy_loss

    def spy(*args, **kwargs):
        tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
        seen.update(t.device for t in tensors)
        return real(*args, **kwargs)

    monkeypatch.setattr(objective, "policy_loss", spy)
    tiny_train(tmp_path, tiny_model_dir, EVEN, "run.name=device", "steps=1", "model.device=cpu",
               "algo.beta=0.04", "algo.tis_cap=2.0")  # fmt: skip
    assert seen == {torch.device("cpu")}


# 4. a broken chat template stops the run instead of zeroing every episode


def test_a_chat_template_that_fails_to_render_stops_the_rollout(tokenizer) -> None:
    broken = copy.deepcopy(tokenizer)
    broken.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}"
        "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    backend = ScriptedBackend(broken, [CALL, "The answer is 408."])
    config = RolloutConfig(group_size=2, sampling={"max_tokens": 64})  # type: ignore[arg-type]
    tasks = [Task(env_id="agent_grpo/Calculator-v0", seed=1)]
    with pytest.raises(ChatTemplateError, match="no tool role"):
        collect_groups(tasks, backend, broken, config)


# 7. rewards reach the advantage in float64


def test_large_close_rewards_are_not_rounded_before_the_advantage() -> None:
    # In float32, 1000.0001 / .0002 / .0003 are 1000.00006 / 1000.00018 / 1000.0003, which the
    # std division turns into [-0.86, -0.22, 1.08] instead of [-1, 0, 1] (times
    # std / (std + eps) = 1e-4 / (1e-4 + 1e-6): the default eps of 1e-6 is 1% of this std).
    records = [record("a", i, r) for i, r in enumerate([1000.0001, 1000.0002, 1000.0003])]
    got = advantages_of(records, AlgoConfig()).tolist()
    shrink = 1e-4 / (1e-4 + 1e-6)
    assert got == pytest.approx([-shrink, 0.0, shrink], abs=1e-4)


# 10. leave_one_out alone is RLOO as published


def test_leave_one_out_alone_is_unscaled_rloo() -> None:
    # r = [3, 0, 0]: r_i - mean(others) = [3 - 0, 0 - 1.5, 0 - 1.5]; no std division
    records = [record("a", i, r) for i, r in enumerate([3.0, 0.0, 0.0])]
    got = advantages_of(records, AlgoConfig(leave_one_out=True)).tolist()
    assert got == pytest.approx([3.0, -1.5, -1.5])
    scaled = advantages_of(records, AlgoConfig(leave_one_out=True, scale="group")).tolist()
    assert scaled == pytest.approx([3.0 / 3**0.5, -1.5 / 3**0.5, -1.5 / 3**0.5], rel=1e-5)
