"""What the update's shared-prefix pass costs, replayed on a finished run's own batches.

    .venv/bin/python bench/update_replay.py [--run runs/calculator] [--steps 0,1,2] [--rounds 2]

Each recorded step's trajectories (`trajectories/step_*.jsonl`, with the advantages they were
trained with) go through one `minibatch_update` from the policy GRPO started from
(`checkpoints/step_000000`, restored before every call), with the run's own algorithm config,
on three sides in turn:

- `as is`: micro-batches sized by the tokens the shared-prefix pass computes
  (`shared_prefix_tokens`), the prompts' common head (an environment's system prompt and
  tools) run once per micro-batch (`_prefix_pass`), and the LM head's logprobs through
  `_HeadLogprobs`, whose backward recomputes each chunk's logits once;
- `checkpointed head`: the same, but each chunk of the LM head under `torch.utils.checkpoint`
  (as before `_HeadLogprobs`, and still for heads it cannot stand in for);
- `per group`: that, and as before the common head ran once: micro-batches sized as padded
  rows x longest, and every group's prompt run whole (`PASS_TOKENS` made too large for a head
  pass to pay).

All sides compute the same loss and gradients up to rounding (the bench prints the largest
difference of loss and gradient norm from `as is`). Per step it prints the median seconds over
rounds and the tokens the backbone passes took (padding included). The foreign CPU over the run
is reported (`bench/load.py`): a busy machine makes the figures unquotable.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
from load import LoadWindow


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run, its steps, rounds."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", type=Path, default=Path("runs/calculator"), help="a finished run")
    p.add_argument("--steps", default="0,1,2", help="comma-separated recorded steps")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every side")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


@contextlib.contextmanager
def checkpointed_head() -> Iterator[None]:
    """Every chunk of the LM head checkpointed, as for heads `_HeadLogprobs` cannot serve."""
    import agent_grpo.models.logprobs as logprobs

    with mock.patch.object(logprobs, "_fusable_head", lambda head, hidden: None):
        yield


@contextlib.contextmanager
def per_group() -> Iterator[None]:
    """The checkpointed head, with padded micro-batch sizing and no common-head pass."""
    import agent_grpo.models.logprobs as logprobs
    import agent_grpo.trainer.update as update

    with (
        checkpointed_head(),
        mock.patch.object(logprobs, "PASS_TOKENS", 1 << 62),
        mock.patch.object(update, "shares_prefixes", lambda model, requested: False),
    ):
        yield


def main(argv: list[str] | None = None) -> None:
    """Replay each step on every side, round after round; print the medians."""
    import yaml

    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.models.loading import load_model
    from agent_grpo.trainer.batch import pack_records
    from agent_grpo.trainer.optimizer import adamw
    from agent_grpo.trainer.policy import LogprobModel
    from agent_grpo.trainer.update import minibatch_update
    from agent_grpo.trajectory.record import TrajectoryRecord

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = TrainConfig.model_validate(yaml.safe_load((args.run / "config.yaml").read_text()))
    lm = load_model(str(args.run / "checkpoints" / "step_000000" / "model"), dtype=torch.float32)
    start = {k: v.clone() for k, v in lm.state_dict().items()}
    policy = LogprobModel(lm)
    tokens: list[int] = []
    lm.get_decoder().register_forward_hook(
        lambda module, a, kwargs, out: tokens.append(kwargs["input_ids"].numel()),
        with_kwargs=True,
    )
    sides: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
        "as is": contextlib.nullcontext,
        "checkpointed head": checkpointed_head,
        "per group": per_group,
    }
    steps = [int(s) for s in args.steps.split(",")]
    seconds: dict[tuple[str, int], list[float]] = {(side, s): [] for side in sides for s in steps}
    computed: dict[tuple[str, int], int] = {}
    results: dict[tuple[str, int], tuple[float, float]] = {}
    with LoadWindow() as window:
        for _ in range(args.rounds):
            for s in steps:
                path = args.run / "trajectories" / f"step_{s:06d}.jsonl"
                records = [TrajectoryRecord.model_validate_json(line)
                           for line in path.read_text().splitlines()]  # fmt: skip
                batch = pack_records(records, pad_id=0)
                for side, patch in sides.items():
                    lm.load_state_dict(start)
                    optimizer = adamw(list(lm.parameters()), lr=config.algo.lr,
                                      weight_decay=config.algo.weight_decay)  # fmt: skip
                    tokens.clear()
                    with patch():
                        began = time.perf_counter()
                        metrics, _ = minibatch_update(
                            policy, optimizer, batch, None, None, config.algo,
                            config.rollout.sampling.temperature, config.rollout.max_context_tokens,
                        )  # fmt: skip
                        seconds[side, s].append(time.perf_counter() - began)
                    computed[side, s] = sum(tokens)
                    results[side, s] = (metrics.loss, metrics.grad_norm)
    print(f"{args.run}: steps {steps}, {args.rounds} rounds, {args.threads} threads")
    for s in steps:
        for side in sides:
            print(f"step {s} {side:17s} {statistics.median(seconds[side, s]):6.1f} s  backbone "
                  f"tokens {computed[side, s]:6d}  loss {results[side, s][0]:+.6f}  "
                  f"grad norm {results[side, s][1]:.6f}")  # fmt: skip
    total = {side: sum(statistics.median(seconds[side, s]) for s in steps) for side in sides}
    print("all steps: " + ", ".join(f"{side} {t:.1f} s" for side, t in total.items()))
    others = [(side, s) for side in sides if side != "as is" for s in steps]
    gap = max(abs(results["as is", s][0] - results[side, s][0]) for side, s in others)
    norm_gap = max(abs(results["as is", s][1] - results[side, s][1]) for side, s in others)
    print(f"largest difference from `as is`: loss {gap:.2e}, gradient norm {norm_gap:.2e}")
    quiet = "busy" if window.busy else "quiet"
    print(f"load average {window.loadavg_before} -> {window.loadavg_after}; other processes "
          f"{window.foreign_cores:.2f} cores on average ({quiet})")  # fmt: skip


if __name__ == "__main__":
    main()
