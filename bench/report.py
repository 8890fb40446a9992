"""Turn `bench/results/*.json` into `docs/benchmarks.md` and `docs/benchmarks.png`.

    .venv/bin/python bench/report.py

Every number in the document comes from a results file (quick runs, `*.quick.json`, are ignored);
a benchmark without results gets a line saying it has not been run. Nothing here measures.
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
NAMES = ("rollout_throughput", "train_throughput", "memory_scaling", "tool_runtime",
         "lora_memory", "async_rollout")  # fmt: skip
Result = dict[str, Any]


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


def md_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; the first column left-aligned, the rest right-aligned."""
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"
    body = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def run_line(r: Result) -> str:
    """When, how long, the load, and the threads of one run."""
    start, end = r["loadavg_start"], r["loadavg_end"]
    return (
        f"Run {r['started_at'][:19].replace('T', ' ')} ({r['wall_s']:.0f} s), "
        f"{r['machine']['torch_threads']} torch thread(s); load average (1/5/15 min) "
        f"{start[0]:.2f}/{start[1]:.2f}/{start[2]:.2f} at start, "
        f"{end[0]:.2f}/{end[1]:.2f}/{end[2]:.2f} at end."
    )


def machine_section(results: dict[str, Result]) -> str:
    """The machine every run reports (they share one), and the load during each run."""
    m = next(iter(results.values()))["machine"]
    rows = [
        [name, r["started_at"][:19].replace("T", " "), r["wall_s"],
         f"{r['loadavg_start'][0]:.2f} -> {r['loadavg_end'][0]:.2f}",
         r["machine"]["torch_threads"]]
        for name, r in results.items()
    ]  # fmt: skip
    return "\n\n".join([
        "## Machine and load",
        f"{m['cpu_model']}, {m['usable_cores']} usable cores of {m['cpu_count']}, "
        f"{m['memory_gb']} GB RAM; torch {m['torch']}, transformers {m['transformers']}, "
        f"Python {m['python']}, {m['platform']}.",
        "The machine is shared: other processes ran during these measurements, so the 1-minute "
        "load average (number of runnable processes) is recorded at the start and end of each "
        "run. With a load above the core count, every number here is lower than on an idle "
        "machine, and runs made at different loads are not strictly comparable.",
        md_table(["benchmark", "started (UTC)", "wall s", "1-min load", "torch threads"], rows),
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


def train_section(r: Result) -> str:
    """Ours vs TRL on one GRPO step."""
    s, sides = r["settings"], r["results"]["sides"]
    rows = []
    for name, x in sides.items():
        if not x["ok"]:
            error = (x.get("error") or "").strip().splitlines()
            rows.append([name, "did not run: " + (error[0] if error else "?")] + [None] * 9)
            continue
        spread = "{:.3g}-{:.3g}".format(min(x["update_s_all"]), max(x["update_s_all"]))
        rows.append([name, x["repeats"], x["prompt_tokens"], x["completion_tokens"],
                     x["generate"]["seconds"], x["update"]["seconds"], spread,
                     x["update_tokens_per_s"], x["generate"]["rss_growth_mb"],
                     x["update"]["rss_growth_mb"], x["process_peak_rss_mb"]])  # fmt: skip
    ratio = r["results"].get("ours_over_trl_update_speed")
    algo = sides.get("ours", {}).get("algo", {})
    knobs = ", ".join(f"`{k}={algo[k]}`" for k in ("shared_prefix", "skip_zero_advantage",
                                                   "micro_batch_tokens") if k in algo)  # fmt: skip
    return "\n\n".join([
        "## One GRPO step vs TRL (`bench/train_throughput.py`)",
        run_line(r),
        f"Embedded model, {s['tasks']} Calculator-v0 prompt(s) x group {s['group_size']}, "
        f"completions of exactly {s['completion_length']} tokens, beta {s['beta']}, lr {s['lr']},"
        " one on-policy optimizer step, token-mean loss, each side in a fresh process, sides "
        "alternating; medians over the runs. Generate = ours `collect_groups` with the `hf` "
        "backend, TRL `_generate_and_score_completions`; update = the rest of the step. "
        "`+RSS` is the growth of resident memory over the phase (the first update also "
        "allocates AdamW's two moment buffers and the gradients); the last column is the "
        "whole process's peak." + (f" Our trainer's settings: {knobs}." if knobs else ""),
        md_table(["impl", "runs", "prompt tokens", "completion tokens", "generate s", "update s",
                  "update s range", "update tokens/s", "generate +RSS MiB", "update +RSS MiB",
                  "process peak MiB"], rows),
        "" if ratio is None else f"Update speed, ours / TRL: {ratio:.2f}x.",
    ]).rstrip()  # fmt: skip


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
    """Synchronous vs asynchronous GRPO on Ray workers."""
    res, s = r["results"], r["settings"]
    rows = [[f"max_staleness {k[1:]}", x["trained_tokens_per_s"], x["speedup"],
             x["idle_fraction"], x["step_s"], json.dumps(x["staleness"])]
            for k, x in res.items()]  # fmt: skip
    return "\n\n".join([
        "## Asynchronous GRPO on Ray (`bench/async_rollout.py`)",
        run_line(r),
        f"2 Ray rollout workers, the tiny model, {s['steps']} steps (the first excluded), "
        f"a {s['latency']} s tool call on each of 3 turns, {s['epochs']} update epochs; the same "
        "job synchronous and with `algo.max_staleness` 1 and 2.",
        md_table(["mode", "trained tokens/s", "x sync", "trainer idle", "s/step",
                  "staleness histogram"], rows),
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
    phases = ("generate", "update")
    for i, phase in enumerate(phases):
        ax.bar([j + 0.4 * i for j in range(len(sides))],
               [v[phase]["seconds"] for v in sides.values()], 0.4, label=phase)  # fmt: skip
    ax.set_xticks([j + 0.2 for j in range(len(sides))])
    ax.set_xticklabels(list(sides))
    ax.set_ylabel("seconds")
    ax.set_title("one GRPO step")
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
              ("memory_scaling", _memory), ("tool_runtime", _tools)) if n in results]  # fmt: skip
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


SECTIONS = {
    "rollout_throughput": rollout_section,
    "train_throughput": train_section,
    "memory_scaling": memory_section,
    "tool_runtime": tools_section,
    "lora_memory": lora_section,
    "async_rollout": async_section,
}


def document(results: dict[str, Result], png_name: str) -> str:
    """The whole markdown page."""
    parts = [
        "# Benchmarks",
        "Generated by `bench/report.py` from `bench/results/*.json`; do not edit by hand. "
        "Reproduce with `make bench` (or run each `bench/*.py`; `--quick` for a smoke run, "
        "`--help` for the sizes). Sizes below are those of the recorded run.",
    ]
    if not results:
        return "\n\n".join([*parts, "No results yet."]) + "\n"
    parts += [f"![benchmarks]({png_name})", machine_section(results)]
    for name in NAMES:
        parts.append(SECTIONS[name](results[name]) if name in results else
                     f"## {name}\n\nNot run yet (`bench/{name}.py`).")  # fmt: skip
    return "\n\n".join(parts) + "\n"


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
    args.doc.write_text(document(results, args.png.name))
    print(f"wrote {args.doc}" + (f" and {args.png}" if results else ""))


if __name__ == "__main__":
    main()
