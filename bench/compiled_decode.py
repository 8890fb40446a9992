"""Does a static-shape, compiled decode step pay on this CPU? (issue 30, the rollout)

    .venv/bin/python bench/compiled_decode.py [--rows 8] [--prompt 96] [--steps 48] [--rounds 3]

One decode step of the embedded SmolLM2-135M-Instruct in fp32, `--rows` rows after random
prompts of `--prompt` tokens, `--steps` steps a round (the context grows by one a step), each
step sampling its tokens and feeding them to the next. The sides take turns within each round;
each side's figure is its mean step over a round, the median over rounds:

- `hf`: the `hf` backend as it runs (`HFBackend.generate` with no stop token, so every row
  decodes every step): transformers' own modules, the KV cache written in place, the linear
  layers on oneDNN's packed weights, sampling and the backend's bookkeeping.
- `static`: the same step as one function over state allocated once per call: per layer, KV
  buffers for the whole context (`[B, H_kv, capacity, D]`) written at the step's slot, attention
  over every slot with the empty ones masked, the weights packed for oneDNN once (q/k/v and
  gate/up fused, as the backend does), `F.rms_norm`; then the backend's `sample_tokens`. No
  shape changes within a call: what a compiler needs to compile the step once.
- `compiled`: `static` with its decoder layer under `torch.compile` (inductor, static shapes):
  one graph that all layers run with their own weights. The packed matmul is an opaque op in
  the graph, because inductor lowers oneDNN's linear only for weights it has frozen itself.
- `frozen` (`--sides` to include; its compile takes about a minute here): the whole step, on
  the model's own `nn.Linear`s, under `torch.compile` with inductor's `freezing`, which packs
  the weights itself (inductor's CPU inference path).

Compile time is the first call's, twice: `first` (into an empty inductor cache: the run sets
`TORCHINDUCTOR_CACHE_DIR` to a fresh folder unless it is set) and `again` (after
`torch._dynamo.reset()` in the same process, which still holds what inductor loaded). A second
run of the same job finds the cache on disk but nothing in memory: run the bench again with
`TORCHINDUCTOR_CACHE_DIR` set to the folder the first run printed, and its `first` figure is
that. Break-even: the compile seconds over what a step saves against `static`.

The sides compute the same function: the first step's logits of `static`, `compiled` and `frozen`
are compared with the model's own forward on the same ids (max abs difference printed). What the
run does not show: the backend's batches shrink as rows finish, which a static-shape step would
either recompile for or pad back to full size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CACHE_GIVEN = "TORCHINDUCTOR_CACHE_DIR" in os.environ
"""Whether the caller named inductor's cache; else the run uses a fresh one (read before torch is
imported: inductor sets the variable to its default the first time it looks)."""

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from load import LoadWindow  # noqa: E402

SIDES = ("hf", "static", "compiled", "frozen")
Step = Callable[[torch.Tensor, int], torch.Tensor]
"""`(ids [B, 1], slot) -> fp32 logits [B, V]`: one decode step at context slot `slot`."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Shape, rounds and sides."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="rows decoded together")
    p.add_argument("--prompt", type=int, default=96, help="prompt tokens per row")
    p.add_argument("--steps", type=int, default=48, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every side")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sides", nargs="+", choices=SIDES, default=["hf", "static", "compiled"])
    return p.parse_args(argv)


@torch.library.custom_op("agent_grpo_bench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ W^T` on oneDNN with `weight` reordered by `_reorder_linear_weight` (no bias)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@dataclass
class Layer:
    """One decoder layer's weights (packed) and KV buffers."""

    qkv: torch.Tensor
    """q, k and v projections stacked, packed for oneDNN."""
    out: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    norm_in: torch.Tensor
    norm_post: torch.Tensor
    keys: torch.Tensor
    """`[B, H_kv, capacity, D]`."""
    values: torch.Tensor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as transformers' Llama applies it (`[B, H, 1, D]`)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def decoder_layer(
    x: torch.Tensor,  # [B, 1, hidden]
    cos: torch.Tensor,  # [B, 1, 1, D]
    sin: torch.Tensor,  # [B, 1, 1, D]
    slot: torch.Tensor,  # [1] long: the step's KV slot
    mask: torch.Tensor,  # [B, 1, 1, capacity] additive
    qkv: torch.Tensor,
    out: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    norm_in: torch.Tensor,
    norm_post: torch.Tensor,
    keys: torch.Tensor,  # [B, H_kv, capacity, D]
    values: torch.Tensor,  # [B, H_kv, capacity, D]
    heads: int,
    eps: float,
) -> torch.Tensor:
    """One Llama decoder layer (a `Layer`'s tensors, in order) for one new token per row;
    writes its KV at `slot`. Plain tensors, not the `Layer`: each layer would otherwise be a new
    object to the compiler's guards."""
    batch, _, hidden = x.shape
    kv_heads, dim = keys.shape[1], keys.shape[-1]
    h = F.rms_norm(x, (hidden,), norm_in, eps)
    q, k, v = packed_linear(h, qkv).split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q = rotate(q.view(batch, 1, heads, dim).transpose(1, 2), cos, sin)  # [B, H, 1, D]
    k = rotate(k.view(batch, 1, kv_heads, dim).transpose(1, 2), cos, sin)  # [B, H_kv, 1, D]
    keys.index_copy_(2, slot, k)
    values.index_copy_(2, slot, v.view(batch, 1, kv_heads, dim).transpose(1, 2))
    attended = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=True
    )  # [B, H, 1, D]
    x = x + packed_linear(attended.transpose(1, 2).reshape(batch, 1, heads * dim), out)
    h = F.rms_norm(x, (hidden,), norm_post, eps)
    gate, up = packed_linear(h, gate_up).chunk(2, dim=-1)
    return x + packed_linear(F.silu(gate) * up, down)


def causal_mask(rows: int, capacity: int, slot: int) -> torch.Tensor:
    """Additive mask `[B, 1, 1, capacity]`: the slots up to `slot` are seen, the rest not yet."""
    seen = torch.arange(capacity) <= slot  # [capacity]
    mask = torch.zeros(capacity).masked_fill(~seen, torch.finfo(torch.float32).min)
    return mask.expand(rows, 1, 1, capacity)


def static_step(model: Any, prompt_kv: Any, rows: int, capacity: int, layer_fn: Any) -> Step:
    """The `static` step over buffers holding `prompt_kv` (a prefill's cache), with
    `layer_fn` (`decoder_layer`, or a compiled one) for each layer."""
    inner, config = model.model, model.config
    pack = lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), rows)  # noqa: E731
    layers = []
    for index, block in enumerate(inner.layers):
        attn, mlp = block.self_attn, block.mlp
        keys, values = prompt_kv.layers[index].keys, prompt_kv.layers[index].values
        buffers = [keys.new_zeros(*keys.shape[:2], capacity, keys.shape[-1]) for _ in "kv"]
        buffers[0][:, :, : keys.shape[2]] = keys
        buffers[1][:, :, : values.shape[2]] = values
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        layers.append(
            Layer(
                pack(qkv), pack(attn.o_proj.weight),
                pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                pack(mlp.down_proj.weight), block.input_layernorm.weight.detach(),
                block.post_attention_layernorm.weight.detach(), *buffers,
            )
        )  # fmt: skip
    head, norm = pack(model.lm_head.weight), inner.norm.weight.detach()
    heads, eps = config.num_attention_heads, config.rms_norm_eps

    def step(ids: torch.Tensor, slot: int) -> torch.Tensor:
        x = inner.embed_tokens(ids)  # [B, 1, hidden]
        positions = torch.full((rows, 1), slot, dtype=torch.long)
        cos, sin = inner.rotary_emb(x, positions)  # [B, 1, D] each
        mask, at = causal_mask(rows, capacity, slot), torch.tensor([slot])
        for layer in layers:
            tensors = (layer.qkv, layer.out, layer.gate_up, layer.down, layer.norm_in,
                       layer.norm_post, layer.keys, layer.values)  # fmt: skip
            x = layer_fn(x, cos[:, None], sin[:, None], at, mask, *tensors, heads, eps)
        x = F.rms_norm(x[:, -1], (x.shape[-1],), norm, eps)
        return packed_linear(x, head).float()

    return step


def frozen_step(model: Any, prompt_kv: Any, rows: int, capacity: int) -> Step:
    """The whole step on the model's own modules, for inductor's `freezing` to compile."""
    inner, config = model.model, model.config
    heads, eps = config.num_attention_heads, config.rms_norm_eps
    caches = []
    for layer in prompt_kv.layers:
        buffers = [t.new_zeros(*t.shape[:2], capacity, t.shape[-1]) for t in (layer.keys,) * 2]
        buffers[0][:, :, : layer.keys.shape[2]] = layer.keys
        buffers[1][:, :, : layer.values.shape[2]] = layer.values
        caches.append(buffers)

    def body(ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, at: torch.Tensor,
             mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
        x = inner.embed_tokens(ids)
        batch, _, hidden = x.shape
        for block, (keys, values) in zip(inner.layers, caches, strict=True):
            attn, mlp = block.self_attn, block.mlp
            dim, kv_heads = keys.shape[-1], keys.shape[1]
            h = F.rms_norm(x, (hidden,), block.input_layernorm.weight, eps)
            q = rotate(attn.q_proj(h).view(batch, 1, heads, dim).transpose(1, 2), cos, sin)
            k = rotate(attn.k_proj(h).view(batch, 1, kv_heads, dim).transpose(1, 2), cos, sin)
            keys.index_copy_(2, at, k)
            values.index_copy_(2, at, attn.v_proj(h).view(batch, 1, kv_heads, dim).transpose(1, 2))
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(batch, 1, heads * dim))
            h = F.rms_norm(x, (hidden,), block.post_attention_layernorm.weight, eps)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return model.lm_head(F.rms_norm(x[:, -1], (hidden,), inner.norm.weight, eps)).float()

    compiled = torch.compile(body)

    def step(ids: torch.Tensor, slot: int) -> torch.Tensor:
        positions = torch.full((rows, 1), slot, dtype=torch.long)
        cos, sin = inner.rotary_emb(inner.embed_tokens.weight, positions)
        mask = causal_mask(rows, capacity, slot)
        return compiled(ids, cos[:, None], sin[:, None], torch.tensor([slot]), mask)

    return step


def main(argv: list[str] | None = None) -> None:
    """Time every side round after round; print per-step medians, compile times, checks."""
    import torch._dynamo
    import torch._inductor.config
    from transformers import DynamicCache

    from agent_grpo.models.loading import load_model, load_tokenizer
    from agent_grpo.rollout.backends.base import SamplingConfig
    from agent_grpo.rollout.backends.hf import HFBackend, sample_tokens

    args = parse_args(argv)
    if not CACHE_GIVEN:  # inductor reads it each time it looks for a compiled graph
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compiled-decode-")
    torch.set_num_threads(args.threads)
    tokenizer, model = load_tokenizer("smollm2-135m-instruct"), load_model("smollm2-135m-instruct")
    model.eval()
    rows, steps = args.rows, args.steps
    capacity = args.prompt + steps
    prompts = torch.randint(
        1000, 40000, (rows, args.prompt), generator=torch.Generator().manual_seed(0)
    )
    sampling = SamplingConfig(temperature=1.0, max_tokens=steps)
    backend = HFBackend(model, tokenizer, eos_token_ids=[])

    def prefill() -> Any:
        cache = DynamicCache()
        model(input_ids=prompts[:, :-1], past_key_values=cache, use_cache=True)
        return cache

    compile_s: dict[str, tuple[float, float]] = {}
    gaps: dict[str, float] = {}
    with torch.inference_mode():
        reference = model(input_ids=prompts).logits[:, -1].float()  # [B, V]
    # [B, 1]; not an inference tensor, and laid out as the sampled ids will be: a compiled
    # step's guards would recompile for either difference
    last = prompts[:, -1:].contiguous()

    def build(side: str) -> Step:
        with torch.inference_mode():
            cache = prefill()
        if side == "static":
            return static_step(model, cache, rows, capacity, decoder_layer)
        if side == "compiled":
            return static_step(model, cache, rows, capacity, compiled_layer)
        torch._inductor.config.freezing = True
        return frozen_step(model, cache, rows, capacity)

    compiled_layer = torch.compile(decoder_layer)
    built: dict[str, Step] = {}
    for side in [s for s in args.sides if s != "hf"]:
        times = []
        for _ in range(2 if side in ("compiled", "frozen") else 1):
            # compiled sides: first, then again in this process (see the module docstring)
            torch._dynamo.reset()
            built[side] = build(side)
            started = time.perf_counter()
            with torch.no_grad():  # inductor does not compile under inference_mode here
                logits = built[side](last, args.prompt - 1)
            times.append(time.perf_counter() - started)
        with torch.no_grad():  # a second step: whatever a guard recompiles, it does here
            built[side](last, args.prompt)
        if len(times) == 2:
            compile_s[side] = (times[0], times[1])
        gaps[side] = float((logits - reference).abs().max())

    per_step: dict[str, list[float]] = {side: [] for side in args.sides}
    with LoadWindow() as window:
        for _ in range(args.rounds):
            for side in args.sides:
                if side == "hf":
                    backend.free_caches()
                    out = backend.generate(prompts.tolist(), sampling, list(range(rows)))
                    per_step[side].append(out[0].extra["decode_s"] / (steps - 1))
                    continue
                step = built[side]
                generator = torch.Generator().manual_seed(0)
                ids = last
                started = time.perf_counter()
                with torch.no_grad():
                    for slot in range(args.prompt - 1, args.prompt - 1 + steps):
                        uniforms = torch.rand(rows, generator=generator)
                        tokens, _ = sample_tokens(step(ids, slot), sampling, uniforms)
                        ids = tokens[:, None]
                per_step[side].append((time.perf_counter() - started) / steps)
    cache_dir = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    print(f"{rows} rows, prompts of {args.prompt} tokens, {steps} steps, {args.rounds} rounds, "
          f"{args.threads} threads; inductor cache {cache_dir}")  # fmt: skip
    medians = {side: 1000 * statistics.median(v) for side, v in per_step.items()}
    for side, ms in medians.items():
        rounds = " ".join(f"{1000 * t:.1f}" for t in per_step[side])
        line = f"{side:9s} {ms:6.1f} ms a step (rounds: {rounds})"
        if side in gaps:
            line += f"; first-step logits vs the model's forward: max |diff| {gaps[side]:.2e}"
        print(line)
    for side, (first, again) in compile_s.items():
        saved = medians.get("static", float("nan")) - medians[side]
        even = "never"
        if saved > 0:
            even = f"{first / saved * 1000:.0f} steps (first), {again / saved * 1000:.0f} (again)"
        print(f"{side:9s} compile {first:.1f} s first, {again:.1f} s again; {saved:+.1f} ms a "
              f"step against static; pays after {even}")  # fmt: skip
    quiet = "busy" if window.busy else "quiet"
    print(f"load average {window.loadavg_before} -> {window.loadavg_after}; other processes "
          f"{window.foreign_cores:.2f} cores on average ({quiet})")  # fmt: skip


if __name__ == "__main__":
    main()
