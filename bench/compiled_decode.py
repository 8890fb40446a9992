"""Does a static-shape, compiled decode step pay on this CPU? (issue 30, the rollout)

    .venv/bin/python bench/compiled_decode.py [--rows 8] [--prompt 96] [--steps 48] [--rounds 3]

One decode step of the embedded SmolLM2-135M-Instruct in fp32, `--rows` rows after random
prompts of `--prompt` tokens, `--steps` steps a round (the context grows by one a step), each
step sampling its tokens and feeding them to the next. The sides take turns within each round,
starting one later each round; each side's figure is its mean step over a round, the median
over rounds:

- `hf`: the `hf` backend as it runs (`HFBackend.generate` with no stop token, so every row
  decodes every step): transformers' own modules, the KV cache written in place, the linear
  layers on oneDNN's packed weights, sampling and the backend's bookkeeping, including the copy
  of every row's KV into the prefix cache as the rows finish (in its last step).
- `static`: the same step as one function over state allocated once per call: per layer, KV
  buffers for the whole context (`[B, H_kv, capacity, D]`) written at the step's slot, attention
  over every slot with the empty ones masked, the weights packed for oneDNN once (q/k/v and
  gate/up fused, as the backend does), `F.rms_norm`; then the backend's `sample_tokens`. No
  shape changes within a call: what a compiler needs to compile the step once.
- `compiled`: `static` with its decoder layer under `torch.compile` (inductor, static shapes):
  one graph that all layers run with their own weights. The packed matmul is an opaque op in
  the graph, because inductor lowers oneDNN's linear only for weights it has frozen itself.
- `frozen` (`--sides` to include; its compile is slow, docs/benchmarks.md says how slow): the
  whole step, on the model's own `nn.Linear`s, under `torch.compile` with inductor's `freezing`,
  which turns the weights into constants and chooses their kernels itself (its CPU inference
  path).

Compile time is the first call's, twice: `first` (into an empty inductor cache: the run sets
`TORCHINDUCTOR_CACHE_DIR` to a fresh folder unless it is set) and `again` (after
`torch._dynamo.reset()` in the same process, which still holds what inductor loaded). A second
run of the same job finds the cache on disk but nothing in memory: run the bench again with the
same `--rows`, `--prompt` and `--steps` (the shapes are the graph's) and `TORCHINDUCTOR_CACHE_DIR`
set to the folder the first run printed, and its `first` figure is that. Break-even: the compile
seconds over what a step saves against `static`. The timed rounds run under
`fail_on_recompile`: a compile inside them would stop the run, not inflate a figure.

The sides compute the same function: the logits of the first two steps of `static`, `compiled`
and `frozen` are compared with the model's own forward on the same ids (max abs difference
printed); the second step reads the KV slot the first wrote, and unwritten slots hold noise, so
a leaking mask shows. What the run does not show: the backend's batches shrink as rows finish,
which a static-shape step would compile again for (or, by torch's default, compile a
dynamic-shape graph for at the second shape, whose speed is not measured here) or pad back to
full size.
"""

from __future__ import annotations

import argparse
import functools
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
    p.add_argument("--threads", type=int, default=2, help="torch threads (the machine's cores)")
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
    """The attention's output projection, packed."""
    gate_up: torch.Tensor
    """The MLP's gate and up projections stacked, packed."""
    down: torch.Tensor
    """The MLP's down projection, packed."""
    norm_in: torch.Tensor
    """The RMSNorm weight before attention."""
    norm_post: torch.Tensor
    """The RMSNorm weight before the MLP."""
    keys: torch.Tensor
    """`[B, H_kv, capacity, D]`: the prompt's keys, then a slot per step."""
    values: torch.Tensor
    """`[B, H_kv, capacity, D]`, as `keys`."""


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


def kv_buffers(prompt_kv: Any, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, keys and values `[B, H_kv, capacity, D]` holding a prefill's cache (a
    transformers `DynamicCache`) in front and noise after: what no step has written yet is
    masked, and noise, unlike zeros, shows when it is not."""
    noise = torch.Generator().manual_seed(0)
    buffers = []
    for layer in prompt_kv.layers:
        pair = []
        for filled in (layer.keys, layer.values):
            shape = (*filled.shape[:2], capacity, filled.shape[-1])
            buffer = torch.randn(shape, generator=noise, dtype=filled.dtype)
            buffer[:, :, : filled.shape[2]] = filled
            pair.append(buffer)
        buffers.append((pair[0], pair[1]))
    return buffers


def static_step(
    model: Any, prompt_kv: Any, rows: int, capacity: int, layer_fn: Callable[..., torch.Tensor]
) -> Step:
    """The `static` step over buffers holding `prompt_kv` (a prefill's cache), with
    `layer_fn` (`decoder_layer`, or a compiled one) for each layer."""
    inner, config = model.model, model.config
    # what `decoder_layer` computes: a Llama layer without biases, with SiLU's gated MLP
    assert not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False)
    assert config.hidden_act == "silu", config.hidden_act

    def pack(weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)

    layers = []
    for block, buffers in zip(inner.layers, kv_buffers(prompt_kv, capacity), strict=True):
        attn, mlp = block.self_attn, block.mlp
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
    caches = kv_buffers(prompt_kv, capacity)

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

    # freezing for this compile only: a global setting would reach every later compile
    compiled = torch.compile(body, options={"freezing": True})

    def step(ids: torch.Tensor, slot: int) -> torch.Tensor:
        positions = torch.full((rows, 1), slot, dtype=torch.long)
        cos, sin = inner.rotary_emb(inner.embed_tokens.weight, positions)
        mask = causal_mask(rows, capacity, slot)
        return compiled(ids, cos[:, None], sin[:, None], torch.tensor([slot]), mask)

    return step


@dataclass
class Workload:
    """What every side decodes, and the model's own logits to check them against."""

    model: Any
    prompts: torch.Tensor
    """`[B, P]` random ids."""
    capacity: int
    """KV slots a row needs: the prompt and every step."""
    references: tuple[torch.Tensor, torch.Tensor]
    """The model's own logits `[B, V]` after the prompt, and after it and its last id again:
    what the first two steps (both fed the prompt's last id) must give."""

    @property
    def last(self) -> torch.Tensor:
        """The first step's ids `[B, 1]`: not an inference tensor, and laid out as the sampled
        ids will be (a compiled step's guards would recompile for either difference)."""
        return self.prompts[:, -1:].contiguous()

    def build(self, side: str) -> Step:
        """A fresh step of `side` over its own buffers, after a fresh prefill."""
        from transformers import DynamicCache

        cache = DynamicCache()
        with torch.inference_mode():
            self.model(input_ids=self.prompts[:, :-1], past_key_values=cache, use_cache=True)
        rows = self.prompts.shape[0]
        if side == "static":
            return static_step(self.model, cache, rows, self.capacity, decoder_layer)
        if side == "compiled":
            return static_step(self.model, cache, rows, self.capacity, compiled_layer())
        return frozen_step(self.model, cache, rows, self.capacity)


@functools.cache
def compiled_layer() -> Callable[..., torch.Tensor]:
    """`decoder_layer` under inductor (compiled at its first call); one wrapper per process, made
    on first use so importing this module does not load the compiler."""
    return torch.compile(decoder_layer)


def build_and_check(
    work: Workload, sides: list[str]
) -> tuple[dict[str, Step], dict[str, tuple[float, float]], dict[str, float]]:
    """Every side but `hf` built and checked; per compiled side its first and again compile
    seconds; per side the largest logit difference from the model's own over two steps."""
    import torch._dynamo

    built: dict[str, Step] = {}
    compile_s: dict[str, tuple[float, float]] = {}
    gaps: dict[str, float] = {}
    prompt_len = work.prompts.shape[1]
    for side in [s for s in sides if s != "hf"]:
        times = []
        for _ in range(2 if side in ("compiled", "frozen") else 1):
            torch._dynamo.reset()  # `again`: the same compile, nothing in dynamo's caches
            built[side] = work.build(side)
            started = time.perf_counter()
            with torch.no_grad():  # inductor does not compile under inference_mode here
                first = built[side](work.last, prompt_len - 1)
            times.append(time.perf_counter() - started)
        with torch.no_grad():
            second = built[side](work.last, prompt_len)
        if len(times) == 2:
            compile_s[side] = (times[0], times[1])
        pairs = zip((first, second), work.references, strict=True)
        gaps[side] = float(max((got - want).abs().max() for got, want in pairs))
    # A later side's reset dropped an earlier side's compiled frames: compile them again here,
    # outside the timed rounds.
    with torch.no_grad():
        for step in built.values():
            step(work.last, prompt_len - 1)
    return built, compile_s, gaps


def time_rounds(
    work: Workload, built: dict[str, Step], backend: Any, sides: list[str], steps: int, rounds: int
) -> dict[str, list[float]]:
    """Per side, its mean seconds a step in each round; sides in turn, starting one later each
    round."""
    from agent_grpo.rollout.backends.base import SamplingConfig
    from agent_grpo.rollout.backends.hf import sample_tokens

    rows, prompt_len = work.prompts.shape
    sampling = SamplingConfig(temperature=1.0, max_tokens=steps)
    per_step: dict[str, list[float]] = {side: [] for side in sides}
    for round_ in range(rounds):
        for side in sides[round_ % len(sides) :] + sides[: round_ % len(sides)]:
            if side == "hf":
                backend.free_caches()
                out = backend.generate(work.prompts.tolist(), sampling, list(range(rows)))
                # `decode_s` starts after the prefill's logits: `steps` samplings, `steps - 1`
                # forwards (the last token is never fed)
                per_step[side].append(out[0].extra["decode_s"] / (steps - 1))
                continue
            generator = torch.Generator().manual_seed(0)
            ids = work.last
            started = time.perf_counter()
            with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
                for slot in range(prompt_len - 1, prompt_len - 1 + steps):
                    uniforms = torch.rand(rows, generator=generator)
                    tokens, _ = sample_tokens(built[side](ids, slot), sampling, uniforms)
                    ids = tokens[:, None]
            per_step[side].append((time.perf_counter() - started) / steps)
    return per_step


def report(
    per_step: dict[str, list[float]],
    compile_s: dict[str, tuple[float, float]],
    gaps: dict[str, float],
) -> None:
    """Each side's median step, compile times and break-even, and its check."""
    medians = {side: 1000 * statistics.median(v) for side, v in per_step.items()}
    for side, ms in medians.items():
        rounds = " ".join(f"{1000 * t:.1f}" for t in per_step[side])
        line = f"{side:9s} {ms:6.1f} ms a step (rounds: {rounds})"
        if side in gaps:
            line += f"; logits of two steps vs the model's forward: max |diff| {gaps[side]:.2e}"
        print(line)
    for side, (first, again) in compile_s.items():
        if "static" not in medians:
            print(f"{side:9s} compile {first:.1f} s first, {again:.1f} s again")
            continue
        saved = medians["static"] - medians[side]
        even = "never"
        if saved > 0:
            even = f"{first / saved * 1000:.0f} steps (first), {again / saved * 1000:.0f} (again)"
        print(f"{side:9s} compile {first:.1f} s first, {again:.1f} s again; {saved:+.1f} ms a "
              f"step against static; pays after {even}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Build and check every side, time them round after round, print the figures."""
    from agent_grpo.models.loading import load_model, load_tokenizer
    from agent_grpo.rollout.backends.hf import HFBackend

    args = parse_args(argv)
    if not CACHE_GIVEN:  # inductor reads it each time it looks for a compiled graph
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compiled-decode-")
    torch.set_num_threads(args.threads)
    tokenizer, model = load_tokenizer("smollm2-135m-instruct"), load_model("smollm2-135m-instruct")
    model.eval()
    seeded = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 40000, (args.rows, args.prompt), generator=seeded)  # [B, P]
    with torch.inference_mode():
        after_prompt = model(input_ids=prompts).logits[:, -1].float()  # [B, V]
        again = torch.cat([prompts, prompts[:, -1:]], dim=1)  # [B, P + 1]
        after_again = model(input_ids=again).logits[:, -1].float()  # [B, V]
    work = Workload(model, prompts, args.prompt + args.steps, (after_prompt, after_again))
    built, compile_s, gaps = build_and_check(work, args.sides)
    backend = HFBackend(model, tokenizer, eos_token_ids=[])
    with LoadWindow() as window:
        per_step = time_rounds(work, built, backend, args.sides, args.steps, args.rounds)
    print(f"{args.rows} rows, prompts of {args.prompt} tokens, {args.steps} steps, "
          f"{args.rounds} rounds, {args.threads} threads; "
          f"inductor cache {os.environ['TORCHINDUCTOR_CACHE_DIR']}")  # fmt: skip
    report(per_step, compile_s, gaps)
    quiet = "busy" if window.busy else "quiet"
    print(f"load average {window.loadavg_before} -> {window.loadavg_after}; other processes "
          f"{window.foreign_cores:.2f} cores on average ({quiet})")  # fmt: skip


if __name__ == "__main__":
    main()
