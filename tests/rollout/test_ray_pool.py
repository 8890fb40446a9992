"""Ray rollout workers give the trajectories one process gives, before and after a weight push.

A local Ray instance (2 CPUs, no dashboard, bound to 127.0.0.1) runs 2 workers with the tiny
model. 3 tasks split as [0, 1] and [2], so the second worker's group ids must be renumbered.
A random tiny model never writes a tool call, so `ChatterEnv` (below) answers every turn with a
tool message for 3 turns: episodes are multi-turn, and the backend's prefix cache is used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from agent_grpo.config.jobs import LoraSettings
from agent_grpo.envs.text_env import TextEnv, TurnOutcome
from agent_grpo.models.loading import load_model
from agent_grpo.rollout.backends.base import SamplingConfig
from agent_grpo.rollout.backends.factory import EngineLimits
from agent_grpo.rollout.backends.hf import HFBackend
from agent_grpo.rollout.collector import CollectOptions, RolloutMetrics, Task, collect_groups
from agent_grpo.rollout.config import RolloutConfig, VLLMBackendConfig
from agent_grpo.rollout.ray_pool import merge_metrics, split_tasks
from agent_grpo.testing.reward_rules import reward_override
from agent_grpo.testing.tiny_model import build_tiny_model, save_tiny_llama
from agent_grpo.trajectory.record import TrajectoryRecord

# A local Ray instance with vLLM actors: Ray's memory monitor kills actors when the machine's
# memory runs high, which another worker's engines can make it.
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[2]


class ChatterEnv(TextEnv[int]):
    """Replies to every turn with a tool message until `max_turns` (then truncated)."""

    def generate_task(self, rng: Any) -> int:
        return int(rng.integers(100))

    def user_prompt(self, task: int) -> str:
        return f"Tell me about the number {task}."

    def respond(self, action: str) -> TurnOutcome:
        reply = {"role": "tool", "name": "echo", "content": f"heard {len(action)} characters"}
        return TurnOutcome(observations=[reply])


CHATTER = f"{__name__}:ChatterEnv"
TASKS = [
    Task(env_id=CHATTER, seed=1, env_kwargs={"max_turns": 3}),
    Task(env_id="agent_grpo/Calculator-v0", seed=12),
    Task(env_id=CHATTER, seed=3, env_kwargs={"max_turns": 3}),
]
COLLECTOR = CollectOptions.from_config(
    RolloutConfig(
        group_size=2,
        max_context_tokens=512,
        # "e" ends most turns within a few tokens; the rest hit max_tokens and end the episode.
        sampling=SamplingConfig(temperature=1.0, max_tokens=12, stop=["e"], seed=5),
    )
)


def test_split_tasks_keeps_blocks_contiguous_and_balanced():
    assert split_tasks(3, 2) == [range(0, 2), range(2, 3)]
    assert split_tasks(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]
    assert split_tasks(1, 4) == [range(0, 1)]
    assert split_tasks(0, 2) == []


def test_merge_metrics_adds_counts_and_takes_the_slowest_time():
    a = RolloutMetrics(trajectories=2, generated_tokens=10, model_time_s=1.0, turns_mean=1.0)
    b = RolloutMetrics(trajectories=6, generated_tokens=30, model_time_s=3.0, turns_mean=3.0)
    merged = merge_metrics([a, b], wall_time_s=4.0)
    assert (merged.trajectories, merged.generated_tokens) == (8, 40)
    assert merged.model_time_s == 3.0
    assert merged.tokens_per_s == 10.0
    assert merged.turns_mean == pytest.approx((2 * 1 + 6 * 3) / 8)


def without_timings(record: TrajectoryRecord) -> dict[str, Any]:
    """Everything but sampler logprobs (compared with a tolerance) and wall-clock latencies."""
    data = record.model_dump(exclude={"sampler_logprobs"})
    for turn in data["turns"]:
        turn.pop("env_latency_s")
        for call in turn["tool_calls"]:
            call.pop("latency_s")
    return data


FP32_GEMM_RTOL = 16 * torch.finfo(torch.float32).eps
"""An actor runs the driver's arithmetic on one torch thread, and oneDNN splits a GEMM's
reduction by thread count: a logprob of magnitude 11 came back 1.9e-6 (1.5 eps relative) apart."""


def assert_same_trajectories(
    got: list[TrajectoryRecord],
    want: list[TrajectoryRecord],
    rtol: float = FP32_GEMM_RTOL,
    atol: float = 1e-6,
) -> None:
    """Same ids, provenance, messages and groups; sampler logprobs within `rtol` and `atol`
    (by default, fp32 rounding)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert without_timings(g) == without_timings(w), w.uid
        ours = [float("nan") if v is None else v for v in g.sampler_logprobs]
        theirs = [float("nan") if v is None else v for v in w.sampler_logprobs]
        torch.testing.assert_close(
            torch.tensor(ours), torch.tensor(theirs), rtol=rtol, atol=atol, equal_nan=True
        )


def whole_collection(pool: Any, worker: int) -> list[TrajectoryRecord]:
    """Every task of `TASKS` collected on one worker of `pool`: the same batch, so the same
    arithmetic, as one local `collect_groups` call. (A split collection batches fewer
    sequences per engine, and a GEMM over fewer rows may round differently; with a random
    tiny model's nearly flat distributions such a difference can flip a sampled token.)"""
    return pool.wait(pool.submit(TASKS, step=3, run_id="r", workers=[worker])).records


def local_records(model: torch.nn.Module, tokenizer: Any, step: int) -> list[TrajectoryRecord]:
    """The single-process reference: `collect_groups` with an in-process hf backend."""
    backend = HFBackend(model, tokenizer)
    return collect_groups(TASKS, backend, tokenizer, COLLECTOR, step=step, run_id="r").records


@pytest.fixture(scope="module")
def ray_local() -> Any:
    """A private local Ray instance on loopback, shut down after this module."""
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'agent-grpo[ray]')")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage report to the network
    ray.init(
        address="local",  # never a cluster some `ray start` left on the machine
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=100 * 2**20,
        log_to_driver=False,
        # Workers import this module (as tests.rollout.test_ray_pool) to build ChatterEnv.
        runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}},
    )
    yield ray
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("weight_sync", ["object_store", "broadcast"])
def test_ray_workers_match_local_collection_before_and_after_update(
    ray_local: Any, tiny_model_dir: Path, tokenizer: Any, weight_sync: str
) -> None:
    from agent_grpo.rollout.ray_pool import RayRolloutPool

    with RayRolloutPool(2, str(tiny_model_dir), collector=COLLECTOR,
                        weight_sync=weight_sync) as pool:  # type: ignore[arg-type]  # fmt: skip
        before = pool.collect(TASKS, step=3, run_id="r")
        assert_same_trajectories(
            before.records, local_records(load_model(tiny_model_dir), tokenizer, 3)
        )
        assert [r.group_id for r in before.records] == ["s3-t0"] * 2 + ["s3-t1"] * 2 + ["s3-t2"] * 2
        assert before.metrics.trajectories == 6
        assert max(len(r.turns) for r in before.records) == 3  # multi-turn episodes happened
        assert before.metrics.generated_tokens == sum(r.lengths.model for r in before.records)

        new_model, _ = build_tiny_model(tokenizer, seed=1)
        pool.update_weights(new_model.state_dict())
        # the tied LM head is the embedding's alias: it travels once
        assert pool.last_push_bytes == 4 * sum(p.numel() for p in new_model.parameters())
        after = pool.collect(TASKS, step=3, run_id="r")
        assert_same_trajectories(after.records, local_records(new_model, tokenizer, 3))
        changed = [
            a.token_ids != b.token_ids for a, b in zip(after.records, before.records, strict=True)
        ]
        assert all(changed)


@pytest.mark.slow
def test_a_dead_worker_s_groups_go_to_another(ray_local: Any, tiny_model_dir: Path) -> None:
    from agent_grpo.rollout.ray_pool import RayRolloutPool

    with RayRolloutPool(2, str(tiny_model_dir), collector=COLLECTOR) as pool:
        pending = pool.submit(TASKS, step=4, run_id="r")
        ray_local.kill(pool.workers[1])  # mid-collection: its block [2] is lost with it
        result = pool.wait(pending)
        assert result.metrics.worker_failures == 1 and len(pool.workers) == 1
        assert [r.group_id for r in result.records] == ["s4-t0"] * 2 + ["s4-t1"] * 2 + ["s4-t2"] * 2


@pytest.mark.slow
def test_a_broadcast_after_a_worker_died_reaches_the_survivors(
    ray_local: Any, tiny_model_dir: Path, tokenizer: Any
) -> None:
    from agent_grpo.rollout.ray_pool import RayRolloutPool

    with RayRolloutPool(2, str(tiny_model_dir), collector=COLLECTOR,
                        weight_sync="broadcast") as pool:  # fmt: skip
        first, _ = build_tiny_model(tokenizer, seed=1)
        pool.update_weights(first.state_dict(), version=1)  # forms the group of 3
        ray_local.kill(pool.workers[1])
        second, _ = build_tiny_model(tokenizer, seed=2)
        pool.update_weights(second.state_dict(), version=2)  # a group of 2, formed again
        assert len(pool.workers) == 1
        result = pool.collect(TASKS, step=3, run_id="r")
        assert {r.policy_version for r in result.records} == {2}
        want = local_records(second, tokenizer, 3)
        for record in want:
            record.policy_version = 2
        assert_same_trajectories(result.records, want)


# ------------------------------------------------------------------ vLLM engines as actors

VLLM_CONFIG = VLLMBackendConfig(engine_kwargs={"enforce_eager": True})
VLLM_LIMITS = EngineLimits(max_seqs=6, max_len=512)  # the largest collection: 3 tasks x 2
VLLM_ATOL = 1e-4
"""Sampler logprobs of two vLLM engines holding the same weights (or one a LoRA adapter and the
other the weights it merges into), on the same batch. Engines in two processes may split a GEMM
over different thread counts, and an unmerged adapter adds `s * (x A) B` to `x W` where the
merged one computes `x (W + s B A)`: both reorder fp32 sums. Reordering a dot product of K terms
moves it by at most about K * eps * sum|terms| (eps = 2**-24); with K <= 128, 2 layers and
|logit| < 20 here, a few such errors stay well under 1e-4. A token is sampled differently only
when two candidates' keys in the sampler differ by less than that, which the peaked tiny Llama
(initializer range 0.2) makes rare."""


def vllm_collection(backend: Any, tokenizer: Any, step: int) -> list[TrajectoryRecord]:
    """`collect_groups` on an in-process vLLM engine."""
    return collect_groups(TASKS, backend, tokenizer, COLLECTOR, step=step, run_id="r").records


def assert_close_trajectories(got: list[TrajectoryRecord], want: list[TrajectoryRecord]) -> None:
    """`assert_same_trajectories` with sampler logprobs within `VLLM_ATOL`."""
    assert_same_trajectories(got, want, rtol=0, atol=VLLM_ATOL)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Path:
    """The tiny model with head_dim 32, which vLLM's CPU attention runs."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, tokenizer)
    return path


@pytest.fixture(scope="module")
def local_vllm(llama_dir: Path) -> Any:
    """An in-process engine with the actors' settings: the reference collection."""
    pytest.importorskip("vllm")
    from agent_grpo.rollout.backends.factory import build_vllm

    backend = build_vllm(VLLM_CONFIG, str(llama_dir), VLLM_LIMITS)
    yield backend
    backend.close()


def vllm_pool(workers: int, llama_dir: Path, **options: Any) -> Any:
    """A pool of vLLM actors with `local_vllm`'s settings, so their collections compare."""
    from agent_grpo.rollout.ray_pool import RayRolloutPool

    return RayRolloutPool(
        workers, str(llama_dir), VLLM_CONFIG, COLLECTOR, limits=VLLM_LIMITS, **options
    )


def perturbed(model_dir: Path, seed: int) -> torch.nn.Module:
    """The saved model with every weight moved by noise of 0.02 (new weights to push)."""
    model = load_model(model_dir)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    return model


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_actors_match_a_local_vllm_collection_before_and_after_a_push(
    ray_local: Any, llama_dir: Path, local_vllm: Any, tokenizer: Any
) -> None:
    with vllm_pool(2, llama_dir, weight_sync="broadcast") as pool:
        before = vllm_collection(local_vllm, tokenizer, 3)
        for worker in (0, 1):
            assert_close_trajectories(whole_collection(pool, worker), before)
        assert max(len(r.turns) for r in before) == 3  # multi-turn episodes happened
        # both actors at once, the tasks split 2 + 1 and renumbered: the same groups
        split = pool.collect(TASKS, step=3, run_id="r").records
        assert [(r.uid, r.group_id) for r in split] == [(r.uid, r.group_id) for r in before]

        model = perturbed(llama_dir, seed=1)
        pool.update_weights(model.state_dict(), version=1)
        local_vllm.update_weights(model)
        after = vllm_collection(local_vllm, tokenizer, 3)
        for record in after:
            record.policy_version = 1
        for worker in (0, 1):
            assert_close_trajectories(whole_collection(pool, worker), after)
        # had the push not arrived, the actors would have sampled `before` again
        assert any(a.token_ids != b.token_ids for a, b in zip(after, before, strict=True))
        # the actors hold the pushed weights: their canary scores are the engine's own
        sequences = [r.token_ids for r in after[:2]]
        targets = [[p == "model" for p in r.provenance] for r in after[:2]]
        own = local_vllm.score(sequences, targets, 1.0)
        for version, scores in pool.score(sequences, targets):
            assert version == 1
            for row, want_row in zip(scores, own, strict=True):
                assert row == pytest.approx(want_row, abs=VLLM_ATOL)


# ------------------------------------------------------------------ LoRA: the adapter travels

LORA = LoraSettings(r=4, alpha=8)


def with_adapter(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`model` under a LoRA adapter whose A and B are random (B = 0 would change nothing)."""
    from agent_grpo.trainer.lora import wrap_lora

    peft_model = wrap_lora(model, LORA)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return peft_model.eval()


@pytest.mark.slow
def test_lora_workers_receive_the_adapter_alone(
    ray_local: Any, tiny_model_dir: Path, tokenizer: Any
) -> None:
    from agent_grpo.rollout.adapters import adapter_state
    from agent_grpo.rollout.ray_pool import RayRolloutPool

    with RayRolloutPool(2, str(tiny_model_dir), collector=COLLECTOR, lora=LORA,
                        weight_sync="broadcast") as pool:  # fmt: skip
        for version, seed in ((1, 1), (2, 2)):
            policy = with_adapter(load_model(tiny_model_dir), seed)
            adapter = adapter_state(policy)
            pool.update_weights(adapter, version)
            lora_numbers = sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n)
            assert pool.last_push_bytes == 4 * lora_numbers
            assert set(adapter) == {n.replace(".default", "") for n, _ in
                                    policy.named_parameters() if "lora_" in n}  # fmt: skip
            assert lora_numbers < 0.05 * sum(p.numel() for p in policy.parameters())
            want = local_records(policy, tokenizer, 3)  # the peft model itself samples
            for record in want:
                record.policy_version = version
            for worker in (0, 1):
                assert_same_trajectories(whole_collection(pool, worker), want)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_vllm_lora_worker_samples_what_the_merged_weights_sample(
    ray_local: Any, llama_dir: Path, local_vllm: Any, tokenizer: Any
) -> None:
    from agent_grpo.rollout.adapters import adapter_state
    from agent_grpo.trainer.lora import merged_copy

    with vllm_pool(1, llama_dir, lora=LORA, adapters=2) as pool:
        for version in (1, 2):
            policy = with_adapter(load_model(llama_dir), seed=version)
            pool.update_weights(adapter_state(policy), version)
            local_vllm.update_weights(merged_copy(policy))
            want = vllm_collection(local_vllm, tokenizer, 3)
            for record in want:
                record.policy_version = version
            assert_close_trajectories(whole_collection(pool, 0), want)
        # vLLM's prompt logprobs under an adapter are broken (the weight canary's scores)
        with pytest.raises(ray_local.exceptions.RayTaskError, match="cannot score given ids"):
            pool.score([want[0].token_ids], [[True] * len(want[0].token_ids)])


def train_tiny(root: Path, model_dir: Path, name: str, *settings: str) -> Path:
    """2 GRPO steps of calculator-tiny in this process (Ray, when asked, joins `ray_local`)."""
    from agent_grpo.config.base import load_config
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.trainer.loop import train

    rule = reward_override("even", "even_tokens")
    overrides = [f"model.name_or_path={model_dir}", f"run.root={root}", f"run.name={name}",
                 "eval=null", "run.tensorboard=false", rule, *settings]  # fmt: skip
    config_path = Path(__file__).resolve().parents[2] / "configs/calculator-tiny.yaml"
    return train(load_config(TrainConfig, config_path, overrides))


@pytest.mark.slow
def test_synchronous_ray_training_is_the_local_run(
    ray_local: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # With the weight canary on: every push is checked on both actors (their version and their
    # logprobs, which are the trainer's to fp32 rounding), and on the local engine.
    local = train_tiny(tmp_path, tiny_model_dir, "local", "rollout.canary={}")
    remote = train_tiny(tmp_path, tiny_model_dir, "ray", "rollout.canary={}",
                        "rollout.workers={type: ray, num_workers: 2}")  # fmt: skip
    assert_same_runs(local, remote, "model.safetensors")
    rows = metrics_rows(local)
    assert all(row["canary_gap"] == 0.0 for row in rows)  # the hf engine samples the policy


def metrics_rows(run: Path) -> list[dict[str, float]]:
    """The deterministic part of each metrics row of a run."""
    import json

    from agent_grpo.testing.cli_runs import deterministic

    return [deterministic(json.loads(x)) for x in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_runs(local: Path, remote: Path, weights_file: str) -> None:
    """The 2 steps' records (ids, tokens, rewards, one policy version per step) equal, every
    metric within fp32 rounding, the final weights (`model/<weights_file>`) within 1e-6."""
    from safetensors.torch import load_file

    from agent_grpo.run_dir.writer import RunWriter

    for run in (local, remote):
        assert RunWriter.open(run).steps() == [0, 1]
    for step in (0, 1):
        a, b = (
            RunWriter.open(local).read_trajectories(step),
            RunWriter.open(remote).read_trajectories(step),
        )
        assert [(r.uid, r.token_ids, r.reward) for r in a] == [
            (r.uid, r.token_ids, r.reward) for r in b
        ]
        assert {r.policy_version for r in b} == {step}
    for got, want in zip(metrics_rows(remote), metrics_rows(local), strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    weights = [load_file(sorted((r / "checkpoints").iterdir())[-1] / "model" / weights_file)
               for r in (local, remote)]  # fmt: skip
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_lora_training_on_ray_workers_is_the_local_run(
    ray_local: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The warm start trains the adapter, so every push (the adapter alone) matters. One worker:
    it samples each step in one batch, as the local engine does (a split batch may round a GEMM
    differently, and a LoRA model's flat distributions then flip a token; see
    `whole_collection`)."""
    lora = "model.lora={r: 4, alpha: 8}"
    local = train_tiny(tmp_path, tiny_model_dir, "lora-local", lora, "rollout.canary={}")
    remote = train_tiny(tmp_path, tiny_model_dir, "lora-ray", lora, "rollout.canary={}",
                        "rollout.workers={type: ray, num_workers: 1}")  # fmt: skip
    assert_same_runs(local, remote, "adapter_model.safetensors")
    rows = metrics_rows(remote)
    assert all(row["canary_gap"] == 0.0 for row in rows)  # the worker runs the pushed adapter


@pytest.mark.slow
def test_asynchronous_training_stays_within_its_staleness(
    ray_local: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    import json

    from agent_grpo.run_dir.writer import RunWriter

    run = train_tiny(tmp_path, tiny_model_dir, "async", "steps=3", "algo.max_staleness=1",
                     "rollout.workers={type: ray, num_workers: 2}")  # fmt: skip
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert steps[0]["staleness/0"] == 4  # step 0 was sampled by the starting policy
    for row in steps[1:]:  # later steps were sampled one version behind the trainer
        assert row.get("staleness/1") == 4 and "staleness/2" not in row
        assert row["mismatch_staleness/1"] > 0 and "mismatch_staleness/0" not in row  # its gap
    for step in (1, 2):
        assert {r.policy_version for r in RunWriter.open(run).read_trajectories(step)} == {step - 1}


LONG_TAIL = ["env.id=agent_grpo.testing.envs:LongTailEnv", "env.kwargs={long_every: 2}",
             "rollout.sampling.stop=[e]", "warm_start=null"]  # fmt: skip
"""A workload whose groups outlast a step: half the tasks take 6 turns."""


def partial_stream(tasks_per_step: int) -> Any:
    """The task stream of a long-tailed job of `tasks_per_step` tasks a step."""
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.rollout.partial import TaskStream

    config = TrainConfig.model_validate(
        {"env": {"id": "agent_grpo.testing.envs:LongTailEnv", "kwargs": {"long_every": 2}},
         "rollout": {"tasks_per_step": tasks_per_step}}
    )  # fmt: skip
    return TaskStream(config)


@pytest.mark.slow
def test_a_partial_worker_carries_what_a_local_partial_collector_does(
    ray_local: Any, tiny_model_dir: Path, tokenizer: Any
) -> None:
    from agent_grpo.rollout.collector import Collection
    from agent_grpo.rollout.partial import PartialCollector
    from agent_grpo.rollout.ray_pool import RayRolloutPool

    stream, mine = partial_stream(2), partial_stream(2)
    local = PartialCollector(Collection(HFBackend(load_model(tiny_model_dir), tokenizer),
                                        tokenizer, COLLECTOR, run_id="r"))  # fmt: skip
    with RayRolloutPool(1, str(tiny_model_dir), collector=COLLECTOR) as pool:
        for step in range(3):  # 2 groups a step, 2 more in flight, no push: version 0 throughout
            got = pool.wait(pool.submit_partial(stream, 2, 2, step, "r"))
            want = local.collect(mine.take(4 - local.in_flight), 2, step, 0)
            assert_same_trajectories(got.records, want.records)
            assert got.metrics.in_flight_groups == want.metrics.in_flight_groups == 2
            assert len(pool.held[pool.workers[0]]) == 2 and pool.owed[pool.workers[0]] == 0


@pytest.mark.slow
@pytest.mark.parametrize("keep_sampling", [False, True])
def test_a_dead_partial_workers_groups_start_over_on_another(
    ray_local: Any, tiny_model_dir: Path, keep_sampling: bool
) -> None:
    from agent_grpo.rollout.ray_pool import RayRolloutPool

    stream = partial_stream(4)
    with RayRolloutPool(2, str(tiny_model_dir), collector=COLLECTOR,
                        keep_sampling=keep_sampling) as pool:  # fmt: skip
        first = pool.wait(pool.submit_partial(stream, 4, 2, 0, "r"))
        taken = {r.group_id for r in first.records}
        pending = pool.submit_partial(stream, 4, 2, 1, "r")
        dead = pool.workers[1]
        lost = set(pool.held[dead])  # its groups in flight and the ones it was just given
        ray_local.kill(dead)
        second = pool.wait(pending)
        assert second.metrics.worker_failures == 1 and len(pool.workers) == 1
        assert len({r.group_id for r in second.records}) == 4
        assert not taken & {r.group_id for r in second.records}  # no group trained twice
        survivor = pool.workers[0]
        assert lost <= set(pool.held[survivor]) | {r.group_id for r in second.records}


@pytest.mark.slow
def test_partial_ray_training_is_the_local_partial_run(
    ray_local: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # One worker holds the groups in flight the local engine holds, in the same batches.
    partial = [*LONG_TAIL, "rollout.partial={over_sample: 2}", "steps=3"]
    local = train_tiny(tmp_path, tiny_model_dir, "partial-local", *partial)
    remote = train_tiny(tmp_path, tiny_model_dir, "partial-ray", *partial,
                        "rollout.workers={type: ray, num_workers: 1}")  # fmt: skip
    from agent_grpo.run_dir.writer import RunWriter

    for step in (0, 1, 2):
        a, b = (RunWriter.open(run).read_trajectories(step) for run in (local, remote))
        assert [(r.uid, r.token_ids, r.reward, [t.policy_version for t in r.turns]) for r in a] == [
            (r.uid, r.token_ids, r.reward, [t.policy_version for t in r.turns]) for r in b
        ]
    rows = metrics_rows(remote)
    assert [r["in_flight_groups"] for r in rows if "loss" in r] == [2, 2, 2]
    for got, want in zip(rows, metrics_rows(local), strict=True):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_asynchronous_partial_training_trains_no_token_staler_than_the_bound(
    ray_local: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from agent_grpo.run_dir.writer import RunWriter

    run = train_tiny(tmp_path, tiny_model_dir, "partial-async", *LONG_TAIL, "steps=4",
                     "rollout.partial={over_sample: 2}", "algo.max_staleness=1",
                     "algo.tis_cap=2.0", "rollout.workers={type: ray, num_workers: 2}")  # fmt: skip
    store = RunWriter.open(run)
    assert store.steps() == [0, 1, 2, 3]
    for step in store.steps():
        for record in store.read_trajectories(step):
            assert record.old_logprobs is not None
            for turn in record.turns:
                assert turn.policy_version is not None and turn.policy_version <= step
                trained = record.old_logprobs[turn.token_start : turn.token_end]
                if step - turn.policy_version > 1:  # older than the bound: context only
                    assert all(v is None for v in trained)


@pytest.mark.slow
def test_actors_that_keep_sampling_train_each_group_once_within_the_bound(
    ray_local: Any, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`keep_sampling`: which version samples a turn depends on timing, so this checks what
    must hold whatever the timing: every group trained once, turn versions that never run
    backwards or ahead of the step, no trained token older than the bound, and every push
    verified on both actors by the canary (at the version the trainer pushed); and that the
    turns were the actors' sampling loops' (a call-driven worker runs none)."""
    from agent_grpo.rollout.ray_pool import RayRolloutPool
    from agent_grpo.run_dir.writer import RunWriter

    loop_turns: list[int] = []
    close = RayRolloutPool.close

    def counting_close(pool: RayRolloutPool) -> None:
        loop_turns.extend(ray_local.get([w.sampled_turns.remote() for w in pool.workers]))
        close(pool)

    monkeypatch.setattr(RayRolloutPool, "close", counting_close)
    run = train_tiny(tmp_path, tiny_model_dir, "keep-sampling", *LONG_TAIL, "steps=4",
                     "rollout.partial={over_sample: 2, keep_sampling: true}",
                     "algo.max_staleness=1", "algo.tis_cap=2.0", "rollout.canary={}",
                     "rollout.workers={type: ray, num_workers: 2}")  # fmt: skip
    store = RunWriter.open(run)
    assert store.steps() == [0, 1, 2, 3]
    groups: list[str] = []
    for step in store.steps():
        records = store.read_trajectories(step)
        groups += sorted({r.group_id for r in records})
        assert len({r.group_id for r in records}) == 2  # tasks_per_step finished groups
        for record in records:
            versions = [t.policy_version for t in record.turns]
            assert None not in versions and versions == sorted(versions)  # type: ignore[type-var]
            assert versions[-1] <= step and record.policy_version == versions[0]
            assert record.old_logprobs is not None
            for turn in record.turns:
                trained = record.old_logprobs[turn.token_start : turn.token_end]
                if step - turn.policy_version > 1:  # older than the bound: context only
                    assert all(v is None for v in trained)
    assert len(groups) == len(set(groups))  # no group trained twice
    rows = [r for r in metrics_rows(run) if "loss" in r]
    assert all(r["canary_gap"] == 0.0 for r in rows)  # every push reached both actors
    assert len(loop_turns) == 2 and min(loop_turns) > 0
