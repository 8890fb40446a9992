"""Whole GRPO steps, ours vs TRL's `GRPOTrainer` on the same work, against the machine's limits.

    .venv/bin/python bench/train_throughput.py [--quick] [--sides trl hf vllm ...]

The workload: the embedded SmolLM2-135M-Instruct in fp32, single-turn prompts of one of the
built-in envs (system prompt with the tool schema plus the task), `tasks` prompts x group `G` per
step, at most `max-tokens` completion tokens (EOS ends a completion early on both sides),
temperature 1, top-p 1, KL weight `beta` with the k3 estimator, clip 0.2, token-mean loss (TRL's
`dapo`), AdamW with the same lr, one on-policy optimizer step per step (TRL
`num_iterations=1`). `steps` steps per run; the first is warm-up and steps 2..N are "steady".
Every side runs in a fresh process, the sides alternate, `rounds` times; tables show medians.
`--workload` picks the sizes (`WORKLOADS`): `calculator` is the one the code was tuned on (issue
18), `notes` one it was not (prompts about twice as long, groups of 8, answers twice as long);
`make bench` runs both.

A run where other processes took more than `--max-foreign-cores` of the machine (`load.py`) is
busy: medians use the clean runs only, a side without one is reported as busy, and the results
file says `"clean": false`, which `bench/report.py` does not quote.

Sides: `trl` (TRL's trainer, rewards from a seeded random function: the reward values do not
change the compute), and ours through the real `agent_grpo.train` loop (the env's verifier as
reward) with a backend and settings per side (`SIDES`). Peak RSS is the whole process's
(`ru_maxrss`; vLLM's engine runs in our process). Per phase, ours reports the step's own timings
(`metrics.jsonl`) and the RSS it reached, and the persistent memory by part (weights, reference,
optimizer state, gradients at their peak, engine incl. its KV cache).

Ceilings, measured in the same run (`ceiling` child, once per round): matmul FLOP/s on the model's
own linear shapes (forward and both backward products, fp32, and bf16 where a side runs in it), the
memory bandwidth of streaming a buffer far larger than the caches, and the time torch's own kernels
take for one decode step's matmuls at the step's batch (every weight read once, `rows` rows; the
fastest of `F.linear`, oneDNN on reordered weights, and oneDNN with each layer's q/k/v and gate/up
stacked into one weight). Each phase is reported against its bound:
- update (reference + policy forward, backward): the time its matmuls take at the measured
  FLOP/s, over the time it took. FLOPs counted exactly: 2 x (layer parameters) per computed
  token per forward (4x for the backward), and the LM head's 2 x (vocab x hidden) only for the
  scored (model) tokens, which are all the head runs on. Attention's own FLOPs are not counted.
- rollout: tokens/s against bandwidth x rows / (bytes a decode step must read: every weight and
  the batch's KV cache at the mean context), and against the kernel ceiling (rows / the time of
  the step's matmuls), which says how much of the bandwidth gap is the matmul library's.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from isolated import (
    PeakWindow,
    child_env,
    current_rss_mb,
    exit_on_sigterm,
    process_peak_rss_mb,
    run_isolated,
    write_child_result,
)
from record import add_common_flags, bench_run, console, print_table, set_threads

MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Workload:
    """One comparison's sizes; both sides sample single-turn prompts of `env_id`."""

    env_id: str
    tasks: int
    """Prompts per step."""
    group_size: int
    max_tokens: int
    """Most completion tokens."""
    max_context: int
    """Our `rollout.max_context_tokens` (prompt plus answer fit)."""
    prompt_tokens: int
    """The prompts' length in SmolLM2 tokens (measured once): sizes the ceilings' update batch."""


WORKLOADS = {
    "calculator": Workload("agent_grpo/Calculator-v0", 2, 4, 48, 512, 246),
    "notes": Workload("agent_grpo/Notes-v0", 1, 8, 96, 768, 466),
}
"""`calculator` is what the step was tuned on; `notes` was not (issue 30)."""

IN_BACKWARD = {"speed": {"optimizer_in_backward": True}, "max_grad_norm": None}
"""No whole-model gradient buffer (agent_grpo/trainer/backward_steps.py); no clipping then."""
LEAN = {**IN_BACKWARD, "speed": {**IN_BACKWARD["speed"], "recompute_mlp": True}}
"""Also recompute the MLPs in backward (agent_grpo/trainer/recompute.py)."""
SIDES: dict[str, dict[str, Any]] = {
    "hf": {"backend": {"type": "hf"}},
    "hf-in-backward": {"backend": {"type": "hf"}, "algo": IN_BACKWARD},
    "hf-lean": {"backend": {"type": "hf"}, "algo": LEAN},
    "hf-bf16": {"backend": {"type": "hf"}, "dtype": "bfloat16", "algo": IN_BACKWARD},
    "vllm": {"backend": {"type": "vllm"}},
    "vllm-lean": {"backend": {"type": "vllm"}, "algo": LEAN},
    "vllm-bf16": {"backend": {"type": "vllm", "dtype": "bfloat16"}, "dtype": "bfloat16",
                  "algo": IN_BACKWARD},
}  # fmt: skip
"""Our sides: the rollout backend, `model.dtype` (the trainer's compute dtype; bf16 also holds
the reference in bf16) and algo settings over the shared ones."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Sizes and settings; `--worker` is internal."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common_flags(p)
    # the issue's comparison runs on both cores (TRL as a user runs it), and so does `make bench`
    p.set_defaults(threads=2)
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default="calculator",
        help="env and sizes (WORKLOADS); the three flags below override its sizes",
    )
    p.add_argument("--tasks", type=int, default=None, help="prompts per step")
    p.add_argument("--group-size", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None, help="most completion tokens")
    p.add_argument("--steps", type=int, default=5, help="steps per run; the first is warm-up")
    p.add_argument("--beta", type=float, default=0.04, help="KL weight (k3)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sides", nargs="+", default=["trl", "hf", "hf-lean", "vllm", "vllm-lean",
                                                  "vllm-bf16"],
                   choices=["trl", *SIDES])  # fmt: skip
    p.add_argument("--algo", default="{}", help="JSON: algo settings for our sides")
    p.add_argument("--rounds", type=int, default=2, help="runs per side, alternating sides")
    p.add_argument("--worker-timeout", type=float, default=1800.0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    workload = WORKLOADS[args.workload]
    args.env_id = workload.env_id
    args.tasks = workload.tasks if args.tasks is None else args.tasks
    args.group_size = workload.group_size if args.group_size is None else args.group_size
    args.max_tokens = workload.max_tokens if args.max_tokens is None else args.max_tokens
    if args.quick:
        args.tasks, args.group_size, args.max_tokens, args.steps, args.rounds = 1, 2, 8, 2, 1
    return args


# ---- our side: the real training loop, its phases watched -----------------------------------


def our_config(args: argparse.Namespace, side: str, root: str) -> dict[str, Any]:
    """The `agent-grpo train` config of one of our sides."""
    spec = SIDES[side]
    return {
        "seed": args.seed, "steps": args.steps,
        "model": {"name_or_path": MODEL, "dtype": spec.get("dtype", "float32")},
        "env": {"id": args.env_id, "kwargs": {"max_turns": 1}},
        "rollout": {"backend": spec["backend"], "tasks_per_step": args.tasks,
                    "group_size": args.group_size,
                    "max_context_tokens": WORKLOADS[args.workload].max_context,
                    "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": args.max_tokens}},
        "algo": {"beta": args.beta, "kl": "k3", "lr": args.lr, "clip_low": 0.2, "clip_high": 0.2,
                 "aggregation": "token-mean", **spec.get("algo", {}), **json.loads(args.algo)},
        "warm_start": None, "eval": None,
        "run": {"root": root, "name": "bench", "checkpoint_every_s": 0, "report_to": []},
    }  # fmt: skip


def _bytes_mb(tensors: Any) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def computed_tokens(batch: Any) -> int:
    """Tokens one forward over `batch` computes with `algo.speed.shared_prefix`: each group's prompt
    once (up to its first model token), the tokens every group's prompt starts with once where
    the pass runs them apart (`common_head`), then every row's model-token span."""
    from agent_grpo.models.logprobs import common_head

    first = batch.loss_mask.float().argmax(dim=1)  # [B]: where each row's model tokens start
    trained = batch.loss_mask.any(dim=1)  # [B]
    prompts: dict[int, int] = {}
    row_of: dict[int, int] = {}
    for b, (g, start, t) in enumerate(
        zip(batch.group_index.tolist(), first.tolist(), trained.tolist(), strict=True)
    ):
        if t:
            prompts[g] = min(prompts.get(g, start), start)
            row_of.setdefault(g, b)
    lengths = batch.attention_mask.sum(dim=1)  # [B]
    rows = [int(lengths[b]) - prompts[g] for b, g in enumerate(batch.group_index.tolist())
            if g in prompts and bool(trained[b])]  # fmt: skip
    # The pass caches each group's prompt but its last token (which predicts the first model one).
    cached = [prompts[g] - 1 for g in row_of]
    head = common_head(batch.input_ids[list(row_of.values())], cached) if cached else 0
    return sum(prompts.values()) - (len(prompts) - 1) * head + sum(rows)


class Watch:
    """Wraps the loop's phase functions: the peak RSS each phase reaches, and the persistent
    memory by part, read off the objects the loop passes them."""

    def __init__(self) -> None:
        self.peaks: dict[str, list[float]] = {}
        self.parts: dict[str, float] = {}
        self.grad_peak_mb = 0.0
        self.update_tokens: list[int] = []
        self.scored_tokens: list[int] = []
        self.prompt_tokens: list[float] = []

    def phase(self, name: str, fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            with PeakWindow() as window:
                out = fn(*a, **k)
            self.peaks.setdefault(name, []).append(window.peak_mb)
            return out

        return wrapped

    def engine(self, fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            before = current_rss_mb()
            backend = fn(*a, **k)
            self.parts["engine (weights, KV cache, runtime)"] = current_rss_mb() - before
            return backend

        return wrapped

    def update(self, fn: Any) -> Any:
        def wrapped(policy: Any, optimizer: Any, *a: Any, **k: Any) -> Any:
            hooks = [p.register_post_accumulate_grad_hook(self._count_grads)
                     for p in policy.parameters() if p.requires_grad]  # fmt: skip
            self.update_tokens.append(computed_tokens(a[0]))
            self.scored_tokens.append(int(a[0].loss_mask.sum()))
            first = a[0].loss_mask.float().argmax(dim=1)  # [B]: each row's prompt length
            self.prompt_tokens.append(float(first.float().mean()))
            with PeakWindow() as window:
                out = fn(policy, optimizer, *a, **k)
            for hook in hooks:
                hook.remove()
            self.peaks.setdefault("update", []).append(window.peak_mb)
            self.parts["policy weights"] = _bytes_mb(policy.parameters())
            state = [v for s in optimizer.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor) and v.numel() > 1]  # fmt: skip
            self.parts["optimizer state"] = _bytes_mb(state)
            self.parts["gradients (peak held)"] = self.grad_peak_mb
            return out

        return wrapped

    def _count_grads(self, param: torch.Tensor) -> None:
        """After each parameter's gradient is accumulated: the gradient bytes alive now."""
        del param
        live = getattr(self, "_policy_params", None)
        if live is None:
            return
        held = _bytes_mb(p.grad for p in live if p.grad is not None)
        self.grad_peak_mb = max(self.grad_peak_mb, held)

    def reference(self, fn: Any) -> Any:
        def wrapped(model: Any, *a: Any, **k: Any) -> Any:
            with PeakWindow() as window:
                out = fn(model, *a, **k)
            self.peaks.setdefault("pi_ref", []).append(window.peak_mb)
            self.parts["reference weights"] = _bytes_mb(model.parameters())
            return out

        return wrapped


def worker_ours(args: argparse.Namespace) -> dict[str, Any]:
    """One of our sides: `agent_grpo.trainer.loop.train` on the side's config."""
    import agent_grpo.trainer.loop as loop
    import agent_grpo.trainer.setup as setup
    from agent_grpo.config.jobs import TrainConfig
    from agent_grpo.rollout.sources import LocalRollouts

    # The loop's phase functions, wrapped where the code that calls them looks them up (the
    # setup builds the engine and the Trainer; the loop calls the rest).
    watch = Watch()
    setup.build_backend = watch.engine(setup.build_backend)  # type: ignore[attr-defined]
    loop.batch_logprobs = watch.reference(loop.batch_logprobs)  # type: ignore[attr-defined]
    loop.grpo_update = watch.update(loop.grpo_update)  # type: ignore[attr-defined]
    loop.push_weights = watch.phase("weight push", loop.push_weights)  # type: ignore[attr-defined]
    LocalRollouts.collect = watch.phase("rollout", LocalRollouts.collect)  # type: ignore[method-assign]
    make_trainer = setup.Trainer

    def trainer(**k: Any) -> Any:
        watch._policy_params = [p for p in k["policy"].parameters() if p.requires_grad]  # type: ignore[attr-defined]
        return make_trainer(**k)

    setup.Trainer = trainer  # type: ignore[attr-defined,assignment,misc]
    root = tempfile.mkdtemp(prefix="bench-ours-")
    config = TrainConfig.model_validate(our_config(args, args.worker, root))
    started = time.perf_counter()
    path = loop.train(config)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time_s" in r]
    shutil.rmtree(root)  # two checkpoints of 1.6 GB each: a full bench would fill the disk
    return {
        "steps": steps,
        "peaks": watch.peaks,
        "parts": watch.parts,
        "wall_s": wall,
        "update_tokens": watch.update_tokens,
        "scored_tokens": watch.scored_tokens,
        "prompt_tokens": watch.prompt_tokens,
    }


# ---- TRL's side ------------------------------------------------------------------------------


def prompts(env_id: str, n: int, seed: int) -> list[list[dict[str, Any]]]:
    """The chat prompts of `n` training seeds of `env_id` (single turn)."""
    from agent_grpo.envs.registry import make_env
    from agent_grpo.envs.text_env import train_seeds

    env = make_env(env_id, max_turns=1)
    out = [env.reset(seed=s)[0] for s in train_seeds(n, random.Random(seed))]
    env.close()
    return out


def worker_trl(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's `GRPOTrainer.train()` for `steps` steps; each step and its generation timed."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from agent_grpo.models.loading import load_model, load_tokenizer

    tokenizer, model = load_tokenizer(MODEL), load_model(MODEL)
    rows = args.tasks * args.group_size
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), use_cpu=True, bf16=False,
        per_device_train_batch_size=rows, gradient_accumulation_steps=1,
        num_generations=args.group_size, max_completion_length=args.max_tokens,
        temperature=1.0, top_p=1.0, top_k=0, beta=args.beta, epsilon=0.2, loss_type="dapo",
        learning_rate=args.lr, weight_decay=0.0, max_grad_norm=1.0, num_iterations=1,
        max_steps=args.steps, logging_steps=1, report_to=[], save_strategy="no", seed=args.seed,
        dataloader_num_workers=0, log_completions=False,
    )  # fmt: skip
    rng = random.Random(args.seed)

    def reward(completions: list[Any], **_: Any) -> list[float | None]:
        return [rng.random() for _ in completions]

    dataset = Dataset.from_list(
        [{"prompt": p} for p in prompts(args.env_id, args.tasks * args.steps, args.seed)]
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                          train_dataset=dataset, processing_class=tokenizer)  # fmt: skip
    steps: list[dict[str, Any]] = []
    generate_inner = trainer._generate_and_score_completions

    def timed_generate(batch: Any) -> Any:
        started = time.perf_counter()
        out = generate_inner(batch)
        steps[-1]["generate_s"] = time.perf_counter() - started
        steps[-1]["completion_tokens"] = int(out["completion_mask"].sum())
        return out

    class StepClock(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            steps.append({"started": time.perf_counter()})

        def on_step_end(self, *_: Any, **__: Any) -> None:
            steps[-1]["step_time_s"] = time.perf_counter() - steps[-1].pop("started")

    trainer._generate_and_score_completions = timed_generate  # type: ignore[method-assign,assignment]
    trainer.add_callback(StepClock())
    trainer.train()
    shutil.rmtree(config.output_dir, ignore_errors=True)
    return {"steps": steps}


# ---- ceilings --------------------------------------------------------------------------------


@functools.cache
def model_config() -> Any:
    """The embedded model's transformers config, read once per process."""
    from transformers import AutoConfig

    from agent_grpo.models.loading import resolve_model_path

    return AutoConfig.from_pretrained(resolve_model_path(MODEL))


def model_shapes() -> tuple[list[tuple[int, int]], int, int, int]:
    """The embedded model's matmul shapes (in, out) per token, its layer count, its parameter
    count and its vocabulary."""
    c = model_config()
    head_dim = c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    h, m = c.hidden_size, c.intermediate_size
    layer = [(h, h), (h, kv), (h, kv), (h, h), (h, m), (h, m), (m, h)]  # q k v o gate up down
    params = c.num_hidden_layers * sum(i * o for i, o in layer) + c.vocab_size * c.hidden_size
    return layer, c.num_hidden_layers, params, c.vocab_size


BEST_OF = 5
"""Timed calls per ceiling kernel (the best kept); 1 in a `--quick` run, whose ceiling is a
smoke test (it took 200 of the quick run's 230 s at 5)."""


def _best_of(fn: Any, repeats: int | None = None) -> float:
    repeats = BEST_OF if repeats is None else repeats
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def matmul_flops(tokens: int, dtype: torch.dtype) -> dict[str, float]:
    """FLOP/s of the model's linear layers on `tokens` rows: forward (x W^T), backward (g W and
    g^T x), each layer shape weighted by its FLOPs, plus the LM head."""
    layer, _, _, vocab = model_shapes()
    hidden = model_config().hidden_size
    out = {}
    for name, shapes in (("layers", layer), ("lm head", [(hidden, vocab)])):
        flops = seconds_f = seconds_b = 0.0
        for i, o in shapes:
            x, w = torch.randn(tokens, i, dtype=dtype), torch.randn(o, i, dtype=dtype)
            g = torch.randn(tokens, o, dtype=dtype)
            seconds_f += _best_of(lambda x=x, w=w: x @ w.T)
            seconds_b += _best_of(lambda g=g, w=w, x=x: (g @ w, g.T @ x))
            flops += 2.0 * tokens * i * o
        out[f"{name} forward"] = flops / seconds_f
        out[f"{name} backward"] = 2 * flops / seconds_b
    return out


def bandwidth_gb_s() -> float:
    """GB/s of reading a 1 GiB fp32 buffer (a sum: one read per byte, nothing written)."""
    x = torch.ones(2**28)
    return x.numel() * 4 / _best_of(lambda: x.sum(), repeats=3) / 1e9


def decode_matmul_s(rows: int, dtype: torch.dtype) -> dict[str, float]:
    """Seconds one decode step's matmuls take at `rows` rows, every layer's weights and the LM
    head each read once (fresh weights per layer, as in the model: no cache reuse), per kernel:
    `F.linear` (MKL on x86), oneDNN on weights reordered once (`rollout/packed_linear.py`), and
    oneDNN with q/k/v and gate/up each stacked into one weight (what the `hf` backend decodes
    with: `FUSED_SIBLINGS`)."""
    layer, layers, _, vocab = model_shapes()
    hidden = model_config().hidden_size
    shapes = layer * layers + [(hidden, vocab)]
    q, k, v, out_proj, gate, up, down = layer
    fused = [(q[0], q[1] + k[1] + v[1]), out_proj, (gate[0], gate[1] + up[1]), down]
    stacked = fused * layers + [(hidden, vocab)]
    inputs = {i: torch.randn(rows, i, dtype=dtype) for i, _ in shapes}
    weights = [torch.randn(o, i, dtype=dtype) for i, o in shapes]
    times = {"F.linear": _best_of(lambda: [inputs[w.shape[1]] @ w.T for w in weights])}
    bf16_ok = dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if torch.backends.mkldnn.is_available() and bf16_ok:
        linear = torch.ops.mkldnn._linear_pointwise
        for name, kernel_shapes in (("oneDNN", shapes), ("oneDNN fused", stacked)):
            packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(o, i, dtype=dtype), rows)
                      for i, o in kernel_shapes]  # fmt: skip
            pairs = [(inputs[i], p) for (i, _), p in zip(kernel_shapes, packed, strict=True)]
            times[name] = _best_of(lambda pairs=pairs: [linear(x, p, None, "none", [], "")
                                                        for x, p in pairs])  # fmt: skip
            del packed, pairs
    return times


def model_sizes() -> dict[str, int]:
    """Parameter counts of the layers and the head, and the KV bytes a token holds in fp32."""
    c = model_config()
    layer, layers, params, vocab = model_shapes()
    head_dim = c.hidden_size // c.num_attention_heads
    return {
        "params": params,
        "layer_params": layers * sum(i * o for i, o in layer),
        "head_params": vocab * c.hidden_size,
        "kv_bytes_per_token": layers * 2 * c.num_key_value_heads * head_dim * 4,
    }


def worker_ceiling(args: argparse.Namespace) -> dict[str, Any]:
    """The machine's bounds for this workload (see the module docstring)."""
    prompt = WORKLOADS[args.workload].prompt_tokens
    tokens = args.tasks * prompt + args.tasks * args.group_size * args.max_tokens  # one update
    rows = args.tasks * args.group_size
    # bf16 only where a side runs in it: on a CPU without bf16 instructions its matmuls take a
    # minute even at one timed call (most of a `--quick` run's time)
    dtypes = {"fp32": torch.float32}
    if any("bf16" in side for side in args.sides):
        dtypes["bf16"] = torch.bfloat16
    return {
        "tokens": tokens,
        **{name: matmul_flops(tokens, dtype) for name, dtype in dtypes.items()},
        "bandwidth_gb_s": bandwidth_gb_s(),
        "decode_rows": rows,
        "decode_matmul_by_kernel": {
            name: decode_matmul_s(rows, dtype) for name, dtype in dtypes.items()
        },
        **model_sizes(),
    }


# ---- the comparison --------------------------------------------------------------------------


def measure(side: str, args: argparse.Namespace) -> dict[str, Any]:
    """One side in a fresh process."""
    console.print(f"[bold]{side}[/bold] ...")
    flags = ["--worker", side, "--threads", str(args.threads), "--workload", args.workload,
             "--tasks", str(args.tasks),
             "--group-size", str(args.group_size), "--max-tokens", str(args.max_tokens),
             "--steps", str(args.steps), "--beta", str(args.beta), "--lr", str(args.lr),
             "--seed", str(args.seed), "--algo", args.algo, "--sides", *args.sides]  # fmt: skip
    flags += ["--quick"] if args.quick else []
    env = child_env(args.threads)
    # glibc's own allocator settings, as a user runs: the low mmap threshold `child_env` sets for
    # exact memory windows makes every large tensor a fresh mmap, which slows the update through
    # page faults (docs/benchmarks.md, "Low mmap threshold in the whole-step bench"); peak RSS is
    # what a user's process really reaches
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    child = run_isolated(Path(__file__), flags, env=env, timeout_s=args.worker_timeout,
                         max_foreign_cores=args.max_foreign_cores)  # fmt: skip
    if not child.load["clean"]:
        foreign = child.load["foreign_cores"]
        console.print(f"[red]{side}: busy machine[/red] (other processes took {foreign:.2f} "
                      "cores): left out of the medians")  # fmt: skip
    if not child.ok:
        console.print(f"[red]{side} did not run:[/red] {(child.error or '')[-1500:]}")
        return {"ok": False, "error": child.error, "load": child.load}
    # the child's own figure: its `PeakWindow` resets lower what ru_maxrss reports
    peak = max(child.result.pop("peak_rss_mb"), child.max_rss_mb)
    return {"ok": True, "process_peak_rss_mb": peak, "load": child.load, **child.result}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def steady(run: dict[str, Any], key: str) -> float:
    """Mean of `key` over the steady steps (2..N) of one run."""
    values = [s.get(key, 0.0) for s in run["steps"][1:]] or [s.get(key, 0.0) for s in run["steps"]]
    return sum(values) / len(values)


def best_ceiling(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ceiling as the best each rate reached in any of `runs` (each round measures it
    again): the most FLOP/s of every matmul and the most bandwidth, the shortest decode matmuls.
    One round's figures alone made a fraction flatter whenever that round ran slow: this
    machine's matmul rate moved by 40% between two runs the same day."""
    best = dict(runs[0])
    for dtype in [k for k, v in best.items() if isinstance(v, dict) and "layers forward" in v]:
        best[dtype] = {op: max(r[dtype][op] for r in runs) for op in best[dtype]}
    best["bandwidth_gb_s"] = max(r["bandwidth_gb_s"] for r in runs)
    best["decode_matmul_by_kernel"] = {
        dtype: {kernel: min(r["decode_matmul_by_kernel"][dtype][kernel] for r in runs)
                for kernel in kernels}
        for dtype, kernels in best["decode_matmul_by_kernel"].items()
    }  # fmt: skip
    return best


def clean_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs that finished on a quiet machine (old results without a load record count)."""
    return [r for r in runs if r["ok"] and r.get("load", {}).get("clean", True)]


def summarise(side: str, runs: list[dict[str, Any]], ceiling: dict[str, Any]) -> dict[str, Any]:
    """One side's medians over its clean runs, and each phase against its ceiling; a side
    without a clean run is summarised over its busy ones and marked `clean: false`."""
    finished = [r for r in runs if r["ok"]]
    if not finished:
        return {"ok": False, "error": runs[0]["error"]}
    ok = clean_runs(runs) or finished
    out: dict[str, Any] = {
        "ok": True,
        "clean": ok[0].get("load", {}).get("clean", True),
        "runs": len(ok),
        "busy_runs": len(finished) - len(clean_runs(runs)),
        "step_s": _median([steady(r, "step_time_s") for r in ok]),
        "step_s_all": [round(steady(r, "step_time_s"), 3) for r in ok],
        "peak_rss_mb": _median([r["process_peak_rss_mb"] for r in ok]),
    }
    if side == "trl":
        out["rollout_s"] = _median([steady(r, "generate_s") for r in ok])
        out["completion_tokens"] = _median([steady(r, "completion_tokens") for r in ok])
        out["train_s"] = out["step_s"] - out["rollout_s"]
        return out
    for key, name in (("rollout_wait_time_s", "rollout_s"), ("reference_time_s", "ref_s"),
                      ("old_logprobs_time_s", "old_s"), ("update_time_s", "update_s"),
                      ("weight_push_time_s", "push_s"), ("logprob_mismatch_mean", "mismatch"),
                      ("model_tokens_mean", "model_tokens_mean")):  # fmt: skip
        out[name] = _median([steady(r, key) for r in ok])
    rows = ok[0]["steps"][0]["trajectories"]
    out["completion_tokens"] = out["model_tokens_mean"] * rows
    for key in ("update_tokens", "scored_tokens", "prompt_tokens"):  # steady steps' means
        out[key] = _median([sum(r[key][1:]) / max(1, len(r[key]) - 1) for r in ok])
    out["parts_mb"] = ok[0]["parts"]
    out["phase_peak_mb"] = {k: max(v) for k, v in ok[0]["peaks"].items()}
    out["bounds"] = bounds(side, out, ceiling, rows)
    return out


def bounds(side: str, r: dict[str, Any], ceiling: dict[str, Any], rows: int) -> dict[str, Any]:
    """Rollout and update throughput as fractions of the machine's ceilings for them."""
    if not ceiling or "layer_params" not in ceiling:
        return {}
    dtype = "bf16" if "bf16" in side else "fp32"
    flops = ceiling[dtype]
    forwards = 2 if r["ref_s"] > 0 else 1  # the policy's, and the reference's

    def matmul_s(params: int, tokens: float, part: str) -> float:
        """Seconds the matmuls of `forwards` forward passes and one backward (two products per
        weight) over `tokens` take at the measured FLOP/s."""
        flops_per_pass = 2.0 * params * tokens
        return flops_per_pass * (
            forwards / flops[f"{part} forward"] + 2 / flops[f"{part} backward"]
        )

    ideal_s = matmul_s(ceiling["layer_params"], r["update_tokens"], "layers") + matmul_s(
        ceiling["head_params"], r["scored_tokens"], "lm head"
    )
    update_s = r["update_s"] + r["ref_s"] + r["old_s"]
    engine_bf16 = "bf16" in side and "vllm" in side
    weight_bytes = ceiling["params"] * (2 if engine_bf16 else 4)
    context = r["prompt_tokens"] + r["model_tokens_mean"] / 2  # mean over a row's decode steps
    kv_bytes = ceiling["kv_bytes_per_token"] / (2 if engine_bf16 else 1) * rows * context
    decode_ceiling = ceiling["bandwidth_gb_s"] * 1e9 / (weight_bytes + kv_bytes) * rows  # tok/s
    kernels = ceiling["decode_matmul_by_kernel"]["bf16" if engine_bf16 else "fp32"]
    kernel_ceiling = rows / min(kernels.values())  # the fastest kernel torch has for the step
    rollout_tok_s = r["completion_tokens"] / max(r["rollout_s"], 1e-9)
    return {
        "update_tok_s": r["update_tokens"] / max(update_s, 1e-9),
        "update_ceiling_tok_s": r["update_tokens"] / ideal_s,
        "update_fraction": ideal_s / max(update_s, 1e-9),
        "rollout_tok_s": rollout_tok_s,
        "rollout_ceiling_tok_s": decode_ceiling,
        "rollout_fraction": rollout_tok_s / decode_ceiling,
        "rollout_kernel_tok_s": kernel_ceiling,
        "rollout_kernel_fraction": rollout_tok_s / kernel_ceiling,
    }


def print_results(sides: dict[str, dict[str, Any]], ceiling: dict[str, Any]) -> None:
    """The comparison table, the phases, and the ceilings."""
    trl = sides.get("trl", {}).get("step_s") if sides.get("trl", {}).get("ok") else None
    rows = []
    for name, r in sides.items():
        if not r["ok"]:
            rows.append([name, "did not run"] + [None] * 9)
            continue
        rows.append([name, r["step_s"], (trl / r["step_s"]) if trl else None,
                     r["peak_rss_mb"] / 1024, r["completion_tokens"], r["rollout_s"],
                     r.get("ref_s"), r.get("update_s"), r.get("push_s"),
                     r.get("mismatch")])  # fmt: skip
    print_table("steady GRPO step (medians over rounds)",
                ["impl", "s/step", "x TRL", "peak RSS GiB", "completion tok", "rollout s",
                 "pi_ref s", "update s", "push s", "logprob mismatch"], rows)  # fmt: skip
    for name, r in sides.items():
        if r.get("ok") and "parts_mb" in r:
            parts = [[k, v] for k, v in r["parts_mb"].items()]
            parts += [[f"peak RSS in {k}", v] for k, v in r["phase_peak_mb"].items()]
            print_table(f"{name}: memory by part (MiB)", ["part", "MiB"], parts)
    if ceiling:
        bound_rows = [[n, b["rollout_tok_s"], b["rollout_ceiling_tok_s"], b["rollout_fraction"],
                       b["rollout_kernel_tok_s"], b["rollout_kernel_fraction"],
                       b["update_tok_s"], b["update_ceiling_tok_s"], b["update_fraction"]]
                      for n, r in sides.items()
                      if r.get("ok") and (b := r.get("bounds"))]  # fmt: skip
        print_table("phases against their ceilings",
                    ["impl", "rollout tok/s", "bandwidth ceiling", "fraction", "kernel ceiling",
                     "fraction", "update tok/s", "ceiling", "fraction"], bound_rows)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Measure each side in its own process, alternating, and write the results."""
    global BEST_OF
    args = parse_args(argv)
    set_threads(args.threads)
    if args.worker:
        exit_on_sigterm()
        BEST_OF = 1 if args.quick else BEST_OF
        torch.manual_seed(args.seed)
        workers = {"trl": worker_trl, "ceiling": worker_ceiling}
        result = workers.get(args.worker, worker_ours)(args)
        write_child_result(args.result, {**result, "peak_rss_mb": process_peak_rss_mb()})
        return
    name = "train_throughput" + ("" if args.workload == "calculator" else f"-{args.workload}")
    with bench_run(name, args) as run:
        runs: dict[str, list[dict[str, Any]]] = {side: [] for side in args.sides}
        ceilings = []
        for _ in range(args.rounds):
            ceilings.append(measure("ceiling", args))
            for side in args.sides:
                runs[side].append(measure(side, args))
        ok = clean_runs(ceilings) or [c for c in ceilings if c["ok"]]
        ceiling = best_ceiling(ok) if ok else {}
        run.results["ceiling"] = ceiling
        run.results["ceiling_runs"] = ceilings
        run.results["raw"] = runs
        sides = run.results["sides"] = {s: summarise(s, r, ceiling) for s, r in runs.items()}
        run.busy_parts += [f"{s}: no clean run" for s, x in sides.items()
                           if x["ok"] and not x["clean"]]  # fmt: skip
        if ceiling and not ceiling.get("load", {}).get("clean", True):
            run.busy_parts.append("ceiling: no clean run")
        print_results(sides, ceiling)


if __name__ == "__main__":
    main()
