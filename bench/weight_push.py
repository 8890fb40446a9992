"""A weight push to Ray rollout workers by each path, `object_store` and `broadcast`, timed.

    .venv/bin/python bench/weight_push.py [--quick] [--workers 2] [--pushes 3]

For the embedded SmolLM2-135M (fp32, as the trainer pushes it) and for a randomly initialised
Llama of about 1B parameters (bf16: two fp32 copies per actor, one loaded and one arriving,
would not fit this machine's memory beside the trainer's), a local Ray instance on 127.0.0.1
runs `--workers` `hf` rollout actors, and the driver pushes the weights `--pushes` times after
one warm-up push (which forms the broadcast group). Per push: the seconds the trainer is held
(`update_weights` returns), the seconds until every actor has loaded the weights (a call queued
behind the load returns), the bytes of the tensors, and the bytes that crossed the loopback
interface (`/proc/net/dev`; the object store on one node moves its copy through shared memory,
so little shows there). Medians over the pushes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from load import TreeCpu
from record import add_common_flags, bench_run, print_table, set_threads

from agent_grpo.models.embedded import DEFAULT_MODEL
from agent_grpo.models.loading import load_model, load_tokenizer, resolve_model_path
from agent_grpo.rollout.weight_sync import distinct_tensors

PATHS = ("object_store", "broadcast")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Workers, pushes, models."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pushes", type=int, default=3, help="timed pushes after one warm-up")
    p.add_argument("--layers-1b", type=int, default=20, help="decoder layers of the large model")
    args = p.parse_args(argv)
    if args.quick:
        args.pushes, args.layers_1b = 1, 2
    return args


def loopback_bytes() -> int:
    """Bytes received on the loopback interface since boot."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[0])
    return 0


def large_model(out: Path, layers: int) -> Path:
    """A random Llama with SmolLM2's tokenizer, hidden 2048, `layers` layers (20: 1.0B
    parameters), saved in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    model.tie_weights()  # to_empty gave the head storage of its own
    with torch.no_grad():  # small random values: the transport does not read them
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    model.save_pretrained(out)
    load_tokenizer(resolve_model_path(DEFAULT_MODEL)).save_pretrained(out)
    return out


def time_pushes(path: str, model_dir: Path, dtype: str, args: argparse.Namespace) -> dict:
    """Start the actors, push `1 + args.pushes` times by `path`; the medians of the timed ones."""
    import ray

    from agent_grpo.rollout.config import HFBackendConfig
    from agent_grpo.rollout.ray_pool import RayRolloutPool

    weights = load_model(str(model_dir), dtype=getattr(torch, dtype)).state_dict()
    pool = RayRolloutPool(args.workers, str(model_dir), HFBackendConfig(packed_decode=False),
                          dtype=dtype, weight_sync=path)  # type: ignore[arg-type]  # fmt: skip
    held, loaded, wire = [], [], []
    try:
        ray.get([w.ping.remote() for w in pool.workers])  # actors started
        for push in range(1 + args.pushes):
            lo, start = loopback_bytes(), time.perf_counter()
            pool.update_weights(weights, version=push + 1)
            returned = time.perf_counter()
            ray.get([w.ping.remote() for w in pool.workers])  # queued behind each load
            done = time.perf_counter()
            if push:  # the first forms the broadcast group and warms every path up
                held.append(returned - start)
                loaded.append(done - start)
                wire.append(loopback_bytes() - lo)
        return {
            "trainer_held_s": statistics.median(held),
            "loaded_s": statistics.median(loaded),
            "payload_bytes": pool.last_push_bytes,
            "loopback_bytes": statistics.median(wire),
            "params": sum(t.numel() for t in distinct_tensors(weights).values()),
        }
    finally:
        pool.close()


def main(argv: list[str] | None = None) -> int:
    """Both models, both paths, on one local Ray instance; print and record."""
    args = parse_args(argv)
    set_threads(args.threads)
    import ray

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    here = Path(__file__).resolve().parent.parent
    rows, results = [], {}
    # Ray's raylet and actors are this process's descendants: their CPU is the benchmark's own,
    # not other processes' load, so the window counts the whole process tree and closes
    # before Ray stops (workers orphaned at shutdown would leave the tree uncounted).
    tree = TreeCpu(os.getpid())  # killed actors' engine processes stay counted
    ray.init(address="local", num_cpus=max(2, args.workers), include_dashboard=False,
             log_to_driver=False,
             _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                                       "PYTHONPATH": str(here)}})  # fmt: skip
    try:
        with tempfile.TemporaryDirectory() as tmp, bench_run("weight_push", args, tree) as run:
            models = {"smollm2-135m (fp32)": (Path(resolve_model_path(DEFAULT_MODEL)), "float32"),
                      "random 1B (bf16)": (large_model(Path(tmp) / "1b", args.layers_1b),
                                           "bfloat16")}  # fmt: skip
            for label, (model_dir, dtype) in models.items():
                for path in PATHS:
                    r = time_pushes(path, model_dir, dtype, args)
                    results[f"{label}|{path}"] = r
                    rows.append([label, path, r["params"] / 1e6, r["payload_bytes"] / 2**20,
                                 r["trainer_held_s"], r["loaded_s"],
                                 r["loopback_bytes"] / 2**20])  # fmt: skip
            run.results = results
    finally:
        ray.shutdown()
    print_table(f"a weight push to {args.workers} hf rollout actors on one machine (median of "
                f"{args.pushes})", ["model", "path", "params M", "tensors MiB", "trainer held s",
                                    "all loaded s", "loopback MiB"], rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
