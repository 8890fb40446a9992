"""What holding a batch's shared prefix once saves the `hf` backend (`shared_prefix_attention`).

    .venv/bin/python bench/shared_prefix_decode.py [--rounds 3] [--rows 48]

The demo's rollout shape: Calculator-v0's first prompts (a system prompt and tool list that every
task shares, then the task), `--rows` rows as `--rows / 8` tasks x group 8, one assistant turn
of up to 48 tokens at temperature 1, then a second turn on top of the first (the tool result's
place taken by a fixed observation), so the prefix cache serves what turn one left. The embedded
SmolLM2-135M-Instruct, fp32, the backend's defaults otherwise. Each round runs both sides, the
prefix held once and held per row, in turn on fresh backends in this process, with the same
seeds; the figures are the medians over rounds of each call's time. The foreign CPU over the
whole run is reported (`bench/load.py`): a busy machine makes the figures unquotable.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from load import LoadWindow


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Rounds and batch size."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="rounds of both sides")
    p.add_argument("--rows", type=int, default=48, help="rows per call (multiple of 8)")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Time both sides' two turns, round after round; print the medians."""
    import gymnasium

    import agent_grpo.envs  # noqa: F401  (registers the environments)
    from agent_grpo.models.loading import load_model, load_tokenizer
    from agent_grpo.rollout.backends.base import SamplingConfig
    from agent_grpo.rollout.backends.hf import HFBackend, common_prefix_len

    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer, model = load_tokenizer("smollm2-135m-instruct"), load_model("smollm2-135m-instruct")
    env = gymnasium.make("agent_grpo/Calculator-v0")
    tasks = []
    for seed in range(args.rows // 8):
        messages, _ = env.reset(seed=seed)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        tasks.append(list(tokenizer.encode(text, add_special_tokens=False)))
    prompts = [t for t in tasks for _ in range(8)]
    seeds = list(range(len(prompts)))
    sampling = SamplingConfig(temperature=1.0, max_tokens=48)
    glue = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
        add_special_tokens=False,
    )
    times: dict[str, list[list[float]]] = {"once": [], "per row": []}
    tokens: dict[str, list[int]] = {"once": [], "per row": []}
    with LoadWindow() as window:
        for _ in range(args.rounds):
            for side in times:
                backend = HFBackend(model, tokenizer, shared_prefix_attention=side == "once")
                started = time.perf_counter()
                first = backend.generate(prompts, sampling, seeds)
                turn_one = time.perf_counter() - started
                second_prompts = [
                    p + g.token_ids + glue for p, g in zip(prompts, first, strict=True)
                ]
                started = time.perf_counter()
                second = backend.generate(second_prompts, sampling, seeds)
                times[side].append([turn_one, time.perf_counter() - started])
                tokens[side].append(sum(len(g.token_ids) for g in first + second))
                backend.close()
    common = min(common_prefix_len(torch.tensor(prompts[0]), torch.tensor(p)) for p in prompts)
    print(f"{len(prompts)} rows, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens sharing {common}, {args.rounds} rounds, {args.threads} threads")  # fmt: skip
    for side, rounds in times.items():
        one = statistics.median(r[0] for r in rounds)
        two = statistics.median(r[1] for r in rounds)
        sampled = statistics.median(tokens[side])
        print(f"prefix {side:8s} turn 1 {one:6.2f} s  turn 2 {two:6.2f} s  "
              f"sampled tokens {sampled:.0f}  ({sampled / (one + two):.0f} tokens/s)")  # fmt: skip
    quiet = "busy" if window.busy else "quiet"
    print(f"load average {window.loadavg_before} -> {window.loadavg_after}; other processes "
          f"{window.foreign_cores:.2f} cores on average ({quiet})")  # fmt: skip


if __name__ == "__main__":
    main()
