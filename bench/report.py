"""Turn `bench/results/*.json` into `docs/benchmarks.md` and `docs/benchmarks.png`.

    .venv/bin/python bench/report.py

Every number in the generated sections comes from a results file (quick runs, `*.quick.json`, are
ignored); a benchmark without results gets a line saying it has not been run. Nothing here
measures. Only clean runs are quoted: a result recorded with `"clean": false` (other processes
took more than the bench's `--max-foreign-cores`, `bench/load.py`) gets one line saying it was
refused, and a result from before that check says it was not checked. The page's last section,
`## Measured by hand`, records figures measured outside `bench/` (each with its machine and
date); the script keeps it as it is.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from record import RESULTS_DIR

ROOT = Path(__file__).resolve().parent.parent
NAMES = ("rollout_throughput", "train_throughput", "train_throughput-notes", "reference_dtype",
         "memory_scaling", "tool_runtime", "lora_memory", "async_rollout",
         "canary_cost", "weight_push")  # fmt: skip
Result = dict[str, Any]


def is_busy(r: Result) -> bool:
    """Recorded as not clean: the machine was busy while it measured."""
    return r.get("clean") is False


def load_results(directory: Path) -> dict[str, Result]:
    """The latest full (non-quick) result of each benchmark that has one."""
    found = {}
    for name in NAMES:
        path = directory / f"{name}.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


def fmt(value: Any, digits: int = 3) -> str:
    """Numbers for a table: 3 significant figures, thousands without decimals."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def kernel_times(ceiling: dict[str, Any]) -> str:
    """One decode step's matmul time per dtype and kernel, as the ceiling child recorded it
    (runs from before oneDNN was measured recorded `decode_matmul_s`, F.linear only)."""
    by_kernel = ceiling.get("decode_matmul_by_kernel") or {
        dtype: {"F.linear": s} for dtype, s in ceiling.get("decode_matmul_s", {}).items()
    }
    return "; ".join(
        f"{dtype} " + ", ".join(f"{kernel} {s * 1e3:.0f} ms" for kernel, s in kernels.items())
        for dtype, kernels in by_kernel.items()
    )


def md_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the rest right-aligned."""
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"
    body = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def quiet_line(r: Result) -> str:
    """What the run measured of other processes' CPU, or that it predates the check."""
    if "clean" not in r:
        return (
            "**Not checked for a quiet machine**: recorded before `bench/load.py` measured other "
            "processes' CPU, so only the load average says how busy the machine was."
        )
    return (
        f"Quiet machine: other processes took {r['foreign_cores']:.2f} cores on average over "
        "the run (`bench/load.py`)."
    )


def run_line(r: Result) -> str:
    """When, how long, the load, and the threads of one run."""
    start, end = r["loadavg_start"], r["loadavg_end"]
    return (
        f"Run {r['started_at'][:19].replace('T', ' ')} ({r['wall_s']:.0f} s), "
        f"{r['machine']['torch_threads']} torch thread(s); load average (1/5/15 min) "
        f"{start[0]:.2f}/{start[1]:.2f}/{start[2]:.2f} at start, "
        f"{end[0]:.2f}/{end[1]:.2f}/{end[2]:.2f} at end. " + quiet_line(r)
    )


def busy_section(name: str, r: Result) -> str:
    """In place of a busy run's figures: that it was refused, and why."""
    why = "; ".join(r.get("busy_parts") or []) or f"{r['foreign_cores']:.2f} cores over the run"
    return (
        f"## {name}\n\nThe latest run ({r['started_at'][:19].replace('T', ' ')}, "
        f"{r['machine']['cpu_model']}) is not quoted: the machine was busy ({why}; other "
        "processes may take at most "
        f"{r['settings'].get('max_foreign_cores', '?')} cores). Run `bench/{name.split('-')[0]}"
        ".py` again on a quiet machine."
    )


def describe_machine(m: dict[str, Any]) -> str:
    """One machine as its results record it: CPU, cores, memory and software."""
    return (
        f"{m['cpu_model']}, {m['usable_cores']} usable cores of {m['cpu_count']}, "
        f"{m['memory_gb']} GB RAM; torch {m['torch']}, transformers {m['transformers']}, "
        f"Python {m['python']}, {m['platform']}"
    )


def machine_section(results: dict[str, Result]) -> str:
    """The machine each run reports (runs may come from different machines), and its load."""
    machines = list(dict.fromkeys(describe_machine(r["machine"]) for r in results.values()))
    rows = [
        [name, r["machine"]["cpu_model"], r["started_at"][:19].replace("T", " "), r["wall_s"],
         f"{r['loadavg_start'][0]:.2f} -> {r['loadavg_end'][0]:.2f}",
         "not checked" if "clean" not in r else r["foreign_cores"],
         "busy: not quoted" if is_busy(r) else ("quoted" if "clean" in r else "unchecked"),
         r["machine"]["torch_threads"]]
        for name, r in results.items()
    ]  # fmt: skip
    return "\n\n".join([
        "## Machine and load",
        "\n".join(f"- {m}." for m in machines),
        "Each run's CPU is in the table below: figures from different machines are not compared. "
        "The machines are shared: other processes ran during these measurements, so the 1-minute "
        "load average (number of runnable processes) is recorded at the start and end of each "
        "run. The load average counts the benchmark's own threads too, so runs since "
        "`bench/load.py` also measure the cores other processes used (machine busy CPU time "
        "minus the benchmark's own, over wall time); a run where that passed the bench's "
        "threshold is not quoted. Runs from before that check are marked unchecked: with a load "
        "above the core count, every number in them is lower than on an idle machine.",
        md_table(["benchmark", "CPU", "started (UTC)", "wall s", "1-min load",
                  "other processes (cores)", "status", "torch threads"], rows),
    ])  # fmt: skip


def rollout_section(r: Result) -> str:
    """Tokens/s per method and environment, and the targets."""
    s, res = r["settings"], r["results"]
    policy = res["policy"]
    parts = [
        "## Rollout throughput (`bench/rollout_throughput.py`)",
        run_line(r),
        f"Workload, identical for every method: {s['tasks']} task(s) x group {s['group_size']} "
        f"per environment, at most {s['max_tokens']} tokens per turn, context {s['max_context']}, "
        f"temperature {s['temperature']}, top-p {s['top_p']}, seed {s['seed']}. Policy: "
        f"`{policy['policy']}`"
        + (f" (embedded model after a warm start on {policy['demos']} expert episodes, "
           "so it calls tools and episodes are multi-turn)" if policy["policy"] == "warm" else "")
        + ". Tokens/s = sampled tokens / wall seconds of the whole collection (environment "
        "steps included; engine start-up excluded and shown apart). The ceiling replays the "
        "best backend's batches on random ids with no environment (see the script).",
    ]  # fmt: skip
    for env_id in s["envs"]:
        rows = []
        for name, m in res["methods"].items():
            if not m.get("ok"):
                error = (m.get("error") or "").strip().splitlines()
                rows.append([name, "did not run: " + (error[0] if error else "?")] + [None] * 7)
                continue
            e = m["envs"][env_id]
            rows.append([name, e.get("trajectories"), e.get("turns_mean"), e["generated_tokens"],
                         e["wall_s"], e["tokens_per_s"], _ratio(res, name, "naive", env_id),
                         _ratio(res, name, "ceiling", env_id), m.get("startup_s")])  # fmt: skip
        parts.append(f"**{env_id}**")
        parts.append(md_table(
            ["method", "trajectories", "turns (mean)", "tokens", "wall s", "tokens/s",
             "x naive", "x ceiling", "start-up s"], rows))  # fmt: skip
        parts.append(_targets_line(res["summary"].get(env_id, {})))
    return "\n\n".join(parts)


def _ratio(res: Result, name: str, base: str, env_id: str) -> float | None:
    """tokens/s of method `name` over that of method `base` (None if either did not run)."""
    methods = res["methods"]
    if not (methods.get(name, {}).get("ok") and methods.get(base, {}).get("ok")):
        return None
    rate = methods[name]["envs"][env_id]["tokens_per_s"]
    return float(rate / methods[base]["envs"][env_id]["tokens_per_s"])


def _targets_line(summary: Result) -> str:
    best = summary.get("best_backend")
    if best is None:
        return "No backend ran, so the targets cannot be checked."
    words = [f"Best backend: `{best}`."]
    if "best_over_naive" in summary:
        met = "met" if summary["naive_target_met"] else "**not met**"
        words.append(f"{summary['best_over_naive']:.2f}x the naive loop (target >= 3x: {met}).")
    if "best_over_ceiling" in summary:
        met = "met" if summary["ceiling_target_met"] else "**not met**"
        words.append(
            f"{summary['best_over_ceiling']:.2f}x the model-only ceiling (target >= 0.75x: {met})."
        )
        if summary["best_over_ceiling"] > 1:
            words.append(
                "Above 1: the ceiling is eager PyTorch, and this engine's own CPU kernels are "
                "faster than it, so the ceiling bounds orchestration overhead, not the engine."
            )
    return " ".join(words)


SIDE_NOTES = {
    "trl": "TRL 1.16 `GRPOTrainer`, fp32, clips gradients at 1.0",
    "hf": "ours, `hf` backend, fp32, defaults (clips at 1.0)",
    "hf-in-backward": "ours, `hf`, fp32, `algo.speed.optimizer_in_backward` (no clipping)",
    "hf-lean": "ours, `hf`, fp32, `algo.speed`: `optimizer_in_backward` and `recompute_mlp`",
    "hf-bf16": "ours, `hf`, `model.dtype: bfloat16` (fp32 master weights, bf16 reference), "
    "optimizer in backward",
    "vllm": "ours, `vllm` backend (fp32 engine, KV cache sized to the job), defaults",
    "vllm-lean": "ours, `vllm`, fp32, optimizer in backward and MLP recompute",
    "vllm-bf16": "ours, `vllm` with a bf16 engine, `model.dtype: bfloat16`, optimizer in backward",
}


def train_section(r: Result) -> str:
    """Whole GRPO steps, ours vs TRL, by phase and against the machine's ceilings."""
    s, res = r["settings"], r["results"]
    sides, ceiling = res["sides"], res.get("ceiling") or {}
    trl = sides.get("trl", {})
    trl_s, trl_mb = (trl["step_s"], trl["peak_rss_mb"]) if trl.get("ok") else (None, None)
    rows, parts, bounds = [], [], []
    for name, x in sides.items():
        if not x["ok"]:
            error = (x.get("error") or "").strip().splitlines()
            rows.append([name, "did not run: " + (error[0] if error else "?")] + [None] * 11)
            continue
        rows.append([name, x["runs"], x["step_s"], trl_s / x["step_s"] if trl_s else None,
                     x["peak_rss_mb"] / 1024, x["peak_rss_mb"] / trl_mb if trl_mb else None,
                     x["completion_tokens"], x["rollout_s"], x.get("ref_s"), x.get("update_s"),
                     x.get("push_s"), x.get("mismatch")])  # fmt: skip
        if "parts_mb" in x:
            parts.append([name, *(x["parts_mb"].get(k) for k in PARTS),
                          *(x["phase_peak_mb"].get(k) for k in ("rollout", "update"))])  # fmt: skip
        if b := x.get("bounds"):
            bounds.append([name, b["rollout_tok_s"], b["rollout_ceiling_tok_s"],
                           b["rollout_fraction"], b.get("rollout_kernel_tok_s"),
                           b.get("rollout_kernel_fraction"), b["update_tok_s"],
                           b["update_ceiling_tok_s"], b["update_fraction"]])  # fmt: skip
    notes = "; ".join(f"`{k}`: {v}" for k, v in SIDE_NOTES.items() if k in sides)
    failed = [f"`{name}` round {i + 1}: " + _last_error_line(run.get("error") or "")
              for name, runs in res.get("raw", {}).items()
              for i, run in enumerate(runs) if not run["ok"]]  # fmt: skip
    out = [
        f"## Whole GRPO steps vs TRL, `{s.get('workload', 'calculator')}` workload "
        "(`bench/train_throughput.py`)",
        run_line(r),
        f"Embedded SmolLM2-135M-Instruct, {s['tasks']} single-turn "
        f"{s.get('env_id', 'agent_grpo/Calculator-v0').split('/')[-1]} prompts x group "
        f"{s['group_size']}, at most {s['max_tokens']} completion tokens, beta {s['beta']} (k3), "
        f"lr {s['lr']}, clip 0.2, token-mean loss, one on-policy optimizer step per step; "
        f"{s['steps']} steps per run, the mean of steps 2-{s['steps']} per run, the median over "
        f"{s['rounds']} round(s) of fresh processes with the sides alternating. Peak RSS is the "
        "whole process's (vLLM's engine runs inside it), with glibc's default allocator "
        f"settings. Sides: {notes}.",
        md_table(["impl", "runs", "s/step", "x TRL", "peak RSS GiB", "x TRL memory",
                  "completion tokens",
                  "rollout s", "pi_ref s", "update s", "weight push s",
                  "sampler/trainer logprob mismatch"], rows),
    ]  # fmt: skip
    if failed:
        out.append("Runs that failed (a side's figures are the medians of the others): "
                   + "; ".join(failed) + ".")  # fmt: skip
    if parts:
        out += [
            "Memory by part (MiB): persistent tensors read off the objects, the engine as the "
            "growth of RSS while it is built, gradients as the most held at once during "
            "backward; then the process's peak RSS during the rollout and the update phases.",
            md_table(["impl", *PARTS, "peak in rollout", "peak in update"], parts),
        ]
    if bounds and ceiling:
        f32, b16 = ceiling["fp32"], ceiling.get("bf16")  # bf16: where a side ran in it
        bf16 = (f", bf16 {b16['layers forward'] / 1e9:.0f} / {b16['layers backward'] / 1e9:.0f}"
                if b16 else "")  # fmt: skip
        rounds = len(res.get("ceiling_runs", []))
        which = (f"the best each rate reached in the run's {rounds} ceiling rounds" if rounds
                 else "one round's figures, the round with the most bandwidth")  # fmt: skip
        out += [
            f"Against the limit. Measured in the same run ({which}): matmul FLOP/s on the "
            f"model's own linear shapes ({ceiling['tokens']} rows) forward / backward: fp32 "
            f"{f32['layers forward'] / 1e9:.0f} / {f32['layers backward'] / 1e9:.0f} GFLOP/s"
            f"{bf16}; "
            f"memory bandwidth {ceiling['bandwidth_gb_s']:.1f} GB/s (reading a 1 GiB buffer). "
            "Update ceiling: the time the update's matmuls (reference forward, policy forward "
            "and backward) take at those rates, with FLOPs counted exactly: 2 x the layers' "
            "parameters per computed token per forward (each group's prompt once and the "
            "tokens every prompt starts with once, as the shared-prefix pass computes them; "
            "twice that for the backward), and the LM head's "
            "2 x vocab x hidden only per scored (model) token. Attention's own FLOPs are not "
            "counted. Rollout: the bandwidth ceiling is bandwidth x batch / (bytes a decode "
            "step reads: every weight and the batch's KV cache at the mean context); the kernel "
            "ceiling is the batch over the time torch's fastest kernel takes for one decode "
            "step's matmuls ("
            + kernel_times(ceiling)
            + f" at {ceiling.get('decode_rows', '?')} rows), which shows how much of the "
            "bandwidth gap the matmul library already leaves.",
            md_table(["impl", "rollout tok/s", "bandwidth ceiling", "fraction", "kernel ceiling",
                      "fraction", "update tok/s", "update ceiling", "fraction"], bounds),
        ]  # fmt: skip
    return "\n\n".join(out)


def _last_error_line(error: str) -> str:
    """The exception line of a child's output tail (its last line naming an Error)."""
    lines = [line.strip(": ").strip() for line in error.splitlines() if "Error" in line]
    return lines[-1] if lines else (error.strip().splitlines() or ["?"])[0]


PARTS = ("policy weights", "reference weights", "optimizer state", "gradients (peak held)",
         "engine (weights, KV cache, runtime)")  # fmt: skip


def memory_section(r: Result) -> str:
    """Peak memory growth vs length, both logprob paths."""
    res = r["results"]
    per_row = res["fp32_logits_mb_per_1k_tokens"] / 1000
    rows = []
    for i, n in enumerate(res["lengths"]):
        chunked, full = res["points"]["chunked"][i], res["points"]["full"][i]
        rows.append([n, chunked.get("rss_growth_mb"), full.get("rss_growth_mb"), n * per_row,
                     chunked.get("seconds"), full.get("seconds")])  # fmt: skip
    slopes = res["slope_mb_per_1k_tokens"]
    slope_text = "; ".join(
        f"`{k}` {v:.0f} MiB per 1k tokens ({v / (per_row * 1000):.2f} fp32 logits rows per token)"
        for k, v in slopes.items()
    )
    return "\n\n".join([
        "## Update memory vs sequence length (`bench/memory_scaling.py`)",
        run_line(r),
        f"Model: `{res['model']}`. One forward + backward of `policy_loss` over the logprobs of "
        "one sequence (batch 1), each point in a fresh process; growth of resident memory over "
        "the section (gradients were allocated before it).",
        md_table(["tokens", "chunked MiB", "full logits MiB", "one [T, V] fp32 MiB",
                  "chunked s", "full s"], rows),
        f"Least-squares slopes: {slope_text}.",
    ])  # fmt: skip


def tools_section(r: Result) -> str:
    """Tool latency and throughput."""
    res = r["results"]["methods"]
    levels = [t["threads"] for t in next(iter(res.values()))["throughput"]]
    latency = [[k, v["latency"]["calls"], v["latency"]["p50_ms"], v["latency"]["p99_ms"],
                v["latency"]["max_ms"], v["latency"]["wrong"]] for k, v in res.items()]  # fmt: skip
    rate = [[k, *(t["calls_per_s"] for t in v["throughput"])] for k, v in res.items()]
    return "\n\n".join([
        "## Tool calls (`bench/tool_runtime.py`)",
        run_line(r),
        md_table(["method", "calls", "p50 ms", "p99 ms", "max ms", "wrong outputs"], latency),
        "Calls per second with N worker threads:",
        md_table(["method", *(f"{n} thread{'s' * (n > 1)}" for n in levels)], rate),
    ])  # fmt: skip


def lora_section(r: Result) -> str:
    """Peak memory of a GRPO step, LoRA vs full fine-tuning."""
    res, s = r["results"], r["settings"]
    rows = [[side, x["trainable_params"], x["process_peak_rss_mb"], x["rss_growth_mb"],
             x["step_s"]] for side, x in res.items()]  # fmt: skip
    return "\n\n".join([
        "## LoRA vs full fine-tuning (`bench/lora_memory.py`)",
        run_line(r),
        f"Model `{s['model']}`, {s['rows']} sequences x {s['tokens']} tokens (half of them model "
        "tokens), 2 steps of the real update with AdamW; each side in a fresh process. LoRA: "
        "rank 16 on every linear layer of the decoder.",
        md_table(["side", "trainable params", "peak RSS MiB", "growth over 2 steps MiB",
                  "s/step"], rows),
    ])  # fmt: skip


def async_section(r: Result) -> str:
    """Synchronous, asynchronous and partial-rollout GRPO on Ray workers."""
    res, s = r["results"], r["settings"]
    rows = [[name, x["trained_tokens_per_s"], x["speedup"], x["x_same_k"], x["idle_fraction"],
             x["step_s"], x["stale_masked_tokens"], json.dumps(x["staleness"])]
            for name, x in res.items()]  # fmt: skip
    return "\n\n".join([
        "## Asynchronous GRPO and partial rollouts on Ray (`bench/async_rollout.py`)",
        run_line(r),
        f"2 Ray rollout workers ({s['backend']} engines), the tiny Llama, {s['steps']} steps (the "
        f"first excluded), long-tailed episodes (one task in 4 takes 6 turns, the others 1 or 2) "
        f"with a {s['latency']} s tool call before every turn but the last, {s['epochs']} update "
        "epochs; `kK` is `algo.max_staleness` K, `-partial` adds "
        f"`rollout.partial={{over_sample: {s['over_sample']}}}` and `-keep` the same with "
        "`keep_sampling: true` (actors sample while the trainer updates). \"x same k\" is a mode's "
        "trained tokens/s over the same k without partial rollouts (the issue's goal: 1.3).",
        md_table(["mode", "trained tokens/s", "x sync", "x same k", "trainer idle", "s/step",
                  "stale-masked tokens", "staleness histogram"], rows),
    ])  # fmt: skip


def weight_push_section(r: Result) -> str:
    """A weight push to Ray rollout actors by each path."""
    res, s = r["results"], r["settings"]
    rows = []
    for key, x in res.items():
        model, path = key.split("|")
        rows.append([model, path, x["params"] / 1e6, x["payload_bytes"] / 2**20,
                     x["trainer_held_s"], x["loaded_s"], x["loopback_bytes"] / 2**20])  # fmt: skip
    return "\n\n".join([
        "## Weight push to Ray rollout actors (`bench/weight_push.py`)",
        run_line(r),
        f"{s['workers']} `hf` rollout actors on a local Ray instance (127.0.0.1); median of "
        f"{s['pushes']} pushes after a warm-up. `trainer held`: until `update_weights` returns; "
        "`all loaded`: until every actor has loaded the weights. Loopback bytes from "
        "`/proc/net/dev` (the object store moves its copy through shared memory on one node).",
        md_table(["model", "path (`weight_sync`)", "params M", "tensors MiB", "trainer held s",
                  "all loaded s", "loopback MiB"], rows),
    ])  # fmt: skip


def _bars(ax: Axes, r: Result) -> None:
    res = r["results"]
    envs = r["settings"]["envs"]
    names = [n for n, m in res["methods"].items() if m.get("ok")]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        values = [res["methods"][name]["envs"][e]["tokens_per_s"] for e in envs]
        ax.bar([j + i * width for j in range(len(envs))], values, width, label=name)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(envs))])
    ax.set_xticklabels([e.split("/")[-1] for e in envs])
    ax.set_ylabel("generated tokens / s")
    ax.set_title("rollout throughput")
    ax.legend(fontsize=7)


def _memory(ax: Axes, r: Result) -> None:
    res = r["results"]
    for path, rows in res["points"].items():
        points = [(n, p["rss_growth_mb"]) for n, p in zip(res["lengths"], rows, strict=True)
                  if p["ok"]]  # fmt: skip
        ax.plot([n for n, _ in points], [g for _, g in points], marker="o", label=path)
    per_row = res["fp32_logits_mb_per_1k_tokens"] / 1000
    ax.plot(res["lengths"], [n * per_row for n in res["lengths"]], "k--", label="one [T,V] fp32")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("peak RSS growth (MiB)")
    ax.set_title(f"update memory ({res['model']} model)")
    ax.legend(fontsize=7)


def _train(ax: Axes, r: Result) -> None:
    sides = {k: v for k, v in r["results"]["sides"].items() if v["ok"]}
    names = list(sides)
    bottom = [0.0] * len(names)
    for key, label in (("rollout_s", "rollout"), ("ref_s", "pi_ref"), ("update_s", "update"),
                       ("push_s", "push")):  # fmt: skip
        values = [v.get(key, 0.0) or 0.0 for v in sides.values()]
        if key == "rollout_s":  # TRL: generation, then the rest of its step
            values = [v["rollout_s"] for v in sides.values()]
        if key == "update_s":
            values = [v.get("update_s", v["step_s"] - v["rollout_s"]) for v in sides.values()]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, fontsize=7, rotation=30)
    ax.set_ylabel("seconds per step")
    ax.set_title(f"whole GRPO step by phase ({r['settings'].get('workload', 'calculator')})")
    ax.legend(fontsize=7)


def _tools(ax: Axes, r: Result) -> None:
    res = r["results"]["methods"]
    names = list(res)
    for i, key in enumerate(("p50_ms", "p99_ms")):
        ax.bar([j + 0.4 * i for j in range(len(names))],
               [res[n]["latency"][key] for n in names], 0.4, label=key[:3])  # fmt: skip
    ax.set_xticks([j + 0.2 for j in range(len(names))])
    ax.set_xticklabels([n.replace(" ", "\n") for n in names], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms, log)")
    ax.set_title("tool call latency")
    ax.legend(fontsize=7)


def chart(results: dict[str, Result], path: Path) -> None:
    """One PNG, one panel per benchmark that has results."""
    panels = [(n, f) for n, f in (("rollout_throughput", _bars), ("train_throughput", _train),
              ("train_throughput-notes", _train), ("memory_scaling", _memory),
              ("tool_runtime", _tools)) if n in results and not is_busy(results[n])]  # fmt: skip
    columns = min(2, len(panels))
    rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(5.2 * columns, 3.8 * rows), squeeze=False)
    for ax, (name, draw) in zip(axes.flat, panels, strict=False):
        draw(ax, results[name])
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reference_section(r: Result) -> str:
    """The bf16 reference against the fp32 one: time, memory, and the logprob gap."""
    m, s = r["results"]["measured"], r["settings"]
    return "\n\n".join([
        "## A bf16 reference (`bench/reference_dtype.py`, `model.reference_dtype`)",
        run_line(r),
        f"Expert episodes of Calculator-v0 and Search-v0 ({s['episodes']} each: {m['rows']} rows, "
        f"{m['tokens']} tokens, {m['model_tokens']} of them model tokens), scored by the embedded "
        "SmolLM2-135M-Instruct through the trainer's reference path, held in fp32 and in bf16; "
        f"best of {s['repeats']} passes each. The gap is bf16 minus fp32 per model token; the "
        "k3 bias is the KL estimate the bf16 reference gives at the first step, where the true "
        "KL is 0.",
        md_table(["reference", "pass s", "x fp32", "weights MiB"],
                 [["fp32", m["fp32_s"], 1.0, m["fp32_weights_mb"]],
                  ["bf16", m["bf16_s"], m["speedup"], m["bf16_weights_mb"]]]),
        md_table(["mean gap", "mean abs gap", "p50 abs", "p99 abs", "max abs", "k3 KL bias",
                  "fp32 logprob mean"],
                 [[m["gap_mean"], m["abs_gap_mean"], m["abs_gap_p50"], m["abs_gap_p99"],
                   m["abs_gap_max"], m["k3_bias_mean"], m["fp32_logprob_mean"]]]),
    ])  # fmt: skip


def canary_section(r: Result) -> str:
    """What one weight-canary check costs, each side, and the engine-trainer gap it reads."""
    res, c = r["results"], r["results"]["canary"]
    rows = [[engine, res[engine]["trainer_s"], res[engine]["engine_s"], res[engine]["check_s"],
             res[engine]["gap_mean"], res[engine]["gap_max"]]
            for engine in ("hf", "vllm") if engine in res]  # fmt: skip
    return "\n\n".join([
        "## The weight canary (`bench/canary_cost.py`, `rollout.canary`)",
        run_line(r),
        f"The embedded SmolLM2-135M-Instruct, {c['sequences']} random sequence(s) of "
        f"{c['length']} tokens, {c['model_tokens']} model tokens in all; each side's median of "
        f"{r['settings']['repeats']} checks after a warm-up (vLLM in fp32, eager). A check costs "
        "the trainer's side plus the engine's; the gap is `canary_gap`'s, between the engine's "
        "logprobs and the trainer's over the model tokens.",
        md_table(["engine", "trainer s", "engine s", "check s", "gap mean", "gap max"], rows),
    ])  # fmt: skip


SECTIONS = {
    "rollout_throughput": rollout_section,
    "train_throughput": train_section,
    "train_throughput-notes": train_section,
    "reference_dtype": reference_section,
    "memory_scaling": memory_section,
    "tool_runtime": tools_section,
    "lora_memory": lora_section,
    "async_rollout": async_section,
    "canary_cost": canary_section,
    "weight_push": weight_push_section,
}


HAND_KEPT = "## Measured by hand"
"""The heading of the page's last section: figures measured outside `bench/`, kept as written."""


def hand_kept(doc: Path) -> str:
    """The hand-kept last section of the existing page, from its heading on ("" if none)."""
    text = doc.read_text() if doc.exists() else ""
    start = text.find("\n" + HAND_KEPT + "\n")
    return text[start + 1 :].rstrip() if start >= 0 else ""


def document(results: dict[str, Result], png_name: str, kept: str = "") -> str:
    """The whole markdown page, ending with the hand-kept section `kept`."""
    parts = [
        "# Benchmarks",
        "Generated by `bench/report.py` from `bench/results/*.json`; do not edit by hand, except "
        f"the last section, `{HAND_KEPT}`, which the script keeps as it is. "
        "Reproduce with `make bench` (or run each `bench/*.py`; `--quick` for a smoke run, "
        "`--help` for the sizes). Sizes below are those of the recorded run.",
    ]
    tail = [kept] if kept else []
    if not results:
        return "\n\n".join([*parts, "No results yet.", *tail]) + "\n"
    parts += [f"![benchmarks]({png_name})", machine_section(results)]
    for name in NAMES:
        if name not in results:
            parts.append(f"## {name}\n\nNot run yet (`bench/{name.split('-')[0]}.py`).")
        elif is_busy(results[name]):
            parts.append(busy_section(name, results[name]))
        else:
            parts.append(SECTIONS[name](results[name]))
    return "\n\n".join([*parts, *tail]) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Read the results, write the page and the chart."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--results", type=Path, default=RESULTS_DIR)
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "benchmarks.png")
    args = p.parse_args(argv)
    results = load_results(args.results)
    if results:
        chart(results, args.png)
    args.doc.write_text(document(results, args.png.name, hand_kept(args.doc)))
    print(f"wrote {args.doc}" + (f" and {args.png}" if results else ""))


if __name__ == "__main__":
    main()
