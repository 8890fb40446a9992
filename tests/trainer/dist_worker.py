"""torchrun target of `tests/trainer/test_parallel.py`: sharded GRPO steps on a saved case.

Usage: `torchrun --nproc_per_node 2 tests/trainer/dist_worker.py CASE.pt MODEL_DIR OUT_DIR MODE...`
where MODE is `ddp`, `fsdp` (the real `update.minibatch_update`), `ddp_dead` / `fsdp_dead` (a step
where no rank has a trainable row), `ddp_seqmean` / `fsdp_sumnorm` (the other aggregations),
`fsdp_one_row` (the same on the first row alone, so rank 1 has no rows) or `naive` (DDP with the
per-rank token mean, the mistake the test shows). Each mode starts from the saved model, takes
`steps` optimizer steps over the case's global batch, and rank 0 writes `OUT_DIR/MODE.pt` with the
full parameters, the metrics of every step, each rank's model-token count and whether the
parameters were DTensor shards.
`score_ddp` and `score_fsdp` write the `update.batch_logprobs` of the case's batch under a
`wrap_policy` and a `wrap_reference` module instead.

The tests launch it with `agent_grpo.testing.torchrun.run_torchrun`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from agent_grpo.algo.grpo import policy_loss, truncated_is_weights
from agent_grpo.config.jobs import AlgoConfig
from agent_grpo.models.loading import load_model
from agent_grpo.trainer.batch import PackedBatch
from agent_grpo.trainer.parallel import (
    DistContext,
    end_rank,
    full_state_dict,
    global_sum,
    init_distributed,
    shard_rows,
    wrap_policy,
    wrap_reference,
)
from agent_grpo.trainer.update import batch_logprobs, minibatch_update


def naive_update(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer, case: dict[str, Any], ctx: Any
) -> dict[str, float]:
    """DDP with each rank's own token mean and no world-size factor (what NOT to do)."""
    batch: PackedBatch = case["batch"]
    rows = shard_rows(batch.input_ids.shape[0], ctx, batch.group_index)
    part = batch.select(rows)
    width = part.input_ids.shape[1]
    algo: AlgoConfig = case["algo"]
    assert algo.tis_cap is not None
    old = case["old"][rows, :width]  # [b, t]
    logprobs = policy(
        part.input_ids, part.attention_mask, part.loss_mask, case["temperature"], False
    )  # [b, t]
    loss, _ = policy_loss(
        logprobs,
        old,
        part.advantages,
        part.loss_mask,
        ref_logprobs=case["ref"][rows, :width],
        beta=algo.beta,
        is_weights=truncated_is_weights(old, part.sampler_logprobs, part.loss_mask, algo.tis_cap),
    )
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), algo.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(norm)}


def first_row(case: dict[str, Any]) -> dict[str, Any]:
    """The case cut down to its first row."""
    tensors = {k: case[k][:1] for k in ("old", "ref")}
    return {**case, **tensors, "batch": case["batch"].select([0])}


AGGREGATIONS = {"_seqmean": "seq-mean-token-mean", "_sumnorm": "seq-mean-token-sum-norm"}
"""Mode suffixes that switch the case's aggregation."""


def dead(case: dict[str, Any]) -> dict[str, Any]:
    """The case with every advantage 0 and beta 0: no rank has a trainable row."""
    batch = case["batch"]
    zero = PackedBatch(batch.input_ids, batch.attention_mask, batch.loss_mask,
                       batch.sampler_logprobs, batch.advantages * 0, batch.group_index,
                       batch.episode_index)  # fmt: skip
    algo = case["algo"].model_copy(update={"beta": 0.0})
    return {**case, "batch": zero, "old": None, "ref": None, "algo": algo}


def run_mode(case: dict[str, Any], model_dir: str, mode: str, ctx: DistContext) -> dict[str, Any]:
    """`case["steps"]` steps from the saved model in one mode; the full parameters at the end."""
    case = first_row(case) if mode == "fsdp_one_row" else case
    case = dead(case) if mode.endswith("_dead") else case
    for suffix, aggregation in AGGREGATIONS.items():
        if mode.endswith(suffix):
            case = {**case, "algo": case["algo"].model_copy(update={"aggregation": aggregation})}
    policy = wrap_policy(load_model(model_dir), "fsdp" if "fsdp" in mode else "ddp", ctx)
    sharded = all(isinstance(p, DTensor) for p in policy.parameters())
    optimizer = torch.optim.SGD(policy.parameters(), lr=case["lr"])
    history = []
    for _ in range(case["steps"]):
        if mode == "naive":
            history.append(naive_update(policy, optimizer, case, ctx))
            continue
        metrics, seen = minibatch_update(
            policy,
            optimizer,
            case["batch"],
            case["old"],
            case["ref"],
            case["algo"],
            case["temperature"],
            case["max_tokens"],
            ctx,
        )
        history.append({**metrics.model_dump(), "seen": seen})
    rows = shard_rows(case["batch"].input_ids.shape[0], ctx, case["batch"].group_index)
    mine = torch.zeros(ctx.world_size)
    mine[ctx.rank] = case["batch"].select(rows).num_model_tokens if rows else 0
    return {
        "params": full_state_dict(policy),
        "history": history,
        "rank_tokens": global_sum(mine, ctx).tolist(),
        "sharded": sharded,
    }


def score_mode(case: dict[str, Any], model_dir: str, mode: str, ctx: DistContext) -> dict[str, Any]:
    """The case batch's logprobs `[B, T]` under a wrapped policy and a wrapped reference."""
    wrap = "fsdp" if mode == "score_fsdp" else "ddp"
    policy = wrap_policy(load_model(model_dir), wrap, ctx)
    reference = wrap_reference(load_model(model_dir), wrap, ctx)
    args = (case["batch"], case["temperature"], case["algo"], ctx)
    return {
        "policy": batch_logprobs(policy, *args),
        "reference": batch_logprobs(reference, *args),
    }


def main(argv: list[str]) -> None:
    """Run every requested mode; rank 0 saves the results."""
    case_path, model_dir, out_dir, *modes = argv
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ctx = init_distributed()
    case = torch.load(case_path, weights_only=False)
    for mode in modes:
        score = mode.startswith("score_")
        result = (score_mode if score else run_mode)(case, model_dir, mode, ctx)
        if ctx.is_main:
            torch.save(result, Path(out_dir) / f"{mode}.pt")
    # Tear down together: a rank destroying its process group while another still talks to it
    # can abort gloo ("terminate called without an active exception") under load, and so can
    # the interpreter's teardown after FSDP2 (`end_rank`).
    dist.barrier()
    dist.destroy_process_group()
    end_rank(0)


if __name__ == "__main__":
    main(sys.argv[1:])
