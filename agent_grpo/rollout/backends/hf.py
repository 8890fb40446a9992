"""The `hf` generation backend: our own batched decoding loop over a transformers causal LM.

We do not call `model.generate`: we need the exact logprob of every sampled token under the
distribution it was drawn from, per-row seeds that do not depend on which rows share a batch, and
a KV prefix cache that lives across calls (a multi-turn rollout re-sends the whole conversation
every turn, and re-encoding it each turn makes long episodes quadratic).

Sampling, per step and row: fp32 logits / temperature -> top-k -> top-p (the smallest set of most
likely tokens whose mass reaches top_p) -> renormalise -> inverse-CDF draw with one uniform from
the row's own CPU `torch.Generator` seeded with `seeds[i]` (so a row draws the same numbers alone,
in any batch, on any device). The recorded logprob is log p(token) under exactly that processed,
renormalised distribution (see `agent_grpo.rollout.backends.base`).

Departures from common practice, on purpose:
- temperature 0 is greedy (argmax) and its recorded logprob is under the *un-tempered, unfiltered*
  softmax of the raw logits, not under the point mass it was drawn from (always 0): that is what a
  trainer recomputing at temperature 1 sees, so the two stay comparable.
- Batch layout: every row's KV slots are `[pad][reused prefix][pad][new suffix][sampled...]`. The
  holes are masked by a 4D additive mask we build ourselves (0 / dtype min, never -inf, so a padding
  query that sees nothing yields finite garbage instead of NaN), and position ids count only a
  row's real tokens. That lets rows with different cached prefixes share one prefill. It assumes a
  full-attention decoder with an eager or sdpa attention (no sliding-window layers); the prefill
  mask costs B x Q x K floats.
- Prefix cache: when a row finishes, its KV (prompt + sampled tokens except the last, which was
  never fed) is stored keyed by exactly those token ids. A later prompt reuses its longest common
  prefix with any entry, always prefilling at least one token to get logits. An entry that is a
  prefix of a newer one is dropped (the newer one serves every lookup it did). LRU, bounded by count
  and bytes; cleared by `update_weights` and `close`. Prefilling in pieces is not bitwise equal to
  prefilling at once (different matmul shapes): expect ~1e-6 differences in fp32.
- Stop strings are searched in the decoded text of a row's last `4 * len(longest stop) + 1` new
  tokens (each token adds at least one UTF-8 byte), so a step costs O(1) decoding, not O(length).
  The token that completes a stop string is kept and the row stops right after it.
- A call's prompts share prefills: the common prefix of all of them (an environment's system
  prompt and tool list) and every prompt the call holds more than once (a GRPO group's G copies
  of its task) are each prefilled once and served to the rows from the prefix cache.
- A batch's shared prefix is held once (on CPU, with our attention): when every row reuses at
  least `MIN_SHARED_PREFIX` common leading tokens from the cache, the batch's KV slots start
  after them, one copy of their KV is kept beside the batch (`SharedPrefix`), and attention
  reads that copy once for all rows (`models/shared_prefix_attention.py`); position ids start at
  the prefix's length. Rows retired into the prefix cache get the prefix put back in front. The
  copy is the first row's cached one: a row whose own entry holds those tokens' KV from another
  prefill (in other pieces, so ~1e-6 apart in fp32) reads the first row's values instead.

`Generation.extra` holds `reused_tokens` and `prefill_tokens` (per row) and `prefill_s`/`decode_s`
(of the row's batch); `HFBackend.stats` accumulates token counts over calls.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agent_grpo.models.attention import ATTENTION
from agent_grpo.models.logprobs import common_prefix_length, token_logprobs
from agent_grpo.models.shared_prefix_attention import SharedPrefix
from agent_grpo.rollout.backends.base import Generation, SamplingConfig
from agent_grpo.rollout.backends.kv_cache import reserved_cache
from agent_grpo.rollout.backends.packed_linear import PackedLinears, packing_supported
from agent_grpo.trajectory.tokens import turn_end_ids

__all__ = [
    "BackendStats",
    "HFBackend",
    "PrefixCache",
    "attention_bias",
    "common_prefix_len",
    "filter_top_k_top_p",
    "inverse_cdf",
    "position_ids",
    "processed_logprobs",
    "sample_tokens",
    "shared_head",
    "stop_hit",
    "stop_window",
]

KV = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (keys, values), each `[heads, tokens, head_dim]` for one sequence."""
Finish = Literal["stop", "length"]


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k set, then outside the top-p nucleus of what is left, to -inf."""
    if top_k <= 0 and top_p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)  # [B, V]
    if top_k > 0:
        keep[:, top_k:] = False
    if top_p < 1.0:
        probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)  # [B, V]
        # Mass strictly before each token: the top token always stays, and so does the one that
        # reaches top_p.
        keep &= (probs.cumsum(dim=-1) - probs) < top_p
    filtered = sorted_logits.masked_fill(~keep, float("-inf"))  # [B, V]
    return torch.full_like(logits, float("-inf")).scatter(-1, order, filtered)


def processed_logprobs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probabilities `[B, V]` of the distribution a non-greedy row samples from."""
    # x / 1.0 is x exactly: at temperature 1 the division is skipped, not approximated
    tempered = logits if sampling.temperature == 1.0 else logits / sampling.temperature  # [B, V]
    return torch.log_softmax(filter_top_k_top_p(tempered, sampling.top_k, sampling.top_p), dim=-1)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token `[B]` whose CDF interval holds `u * total`; never a zero-probability token."""
    cdf = probs.cumsum(dim=-1)  # [B, V]
    target = (uniforms.to(cdf) * cdf[:, -1])[:, None]  # [B, 1]
    index = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B]
    # The first CDF entry above the target always adds mass (a zero adds nothing to the sum), so
    # only u * total rounding up to total runs past the end: there, the last token with mass.
    past = index >= probs.shape[-1]  # [B]
    if bool(past.any()):
        last_nonzero = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)  # [B]
        index = torch.where(past, last_nonzero, index)
    return index


def sample_tokens(
    logits: torch.Tensor, sampling: SamplingConfig, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from fp32 `logits [B, V]`; return ids `[B]` and logprobs `[B]`."""
    if sampling.temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)  # [B, V], un-tempered: see module docstring
        tokens = logits.argmax(dim=-1)  # [B]
    else:
        logprobs = processed_logprobs(logits, sampling)  # [B, V]
        tokens = inverse_cdf(logprobs.exp(), uniforms)  # [B]
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def stop_window(stops: Sequence[str]) -> int:
    """How many trailing tokens can hold a stop string (every token adds at least one byte)."""
    return 4 * max((len(s) for s in stops), default=0) + 1


def stop_hit(tokenizer: Any, new_ids: Sequence[int], stops: Sequence[str], window: int) -> bool:
    """Whether a stop string occurs in the decoded text of the last `window` new tokens."""
    if not stops:
        return False
    tail = tokenizer.decode(list(new_ids[-window:]), clean_up_tokenization_spaces=False)
    return any(stop in tail for stop in stops)


def attention_bias(valid: torch.Tensor, query_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask `[B, 1, Q, K]`: the last Q slots query every valid slot up to their own."""
    slots = valid.shape[1]
    query_slots = torch.arange(slots - query_len, slots, device=valid.device)[:, None]  # [Q, 1]
    causal = torch.arange(slots, device=valid.device)[None, :] <= query_slots  # [Q, K]
    allowed = causal[None] & valid[:, None, :]  # [B, Q, K]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=valid.device)  # [B, Q, K]
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def position_ids(valid: torch.Tensor, query_len: int) -> torch.Tensor:
    """Positions `[B, Q]` of the last Q slots: the number of valid slots before each one."""
    return (valid.long().cumsum(dim=-1) - 1).clamp(min=0)[:, -query_len:]


def common_prefix_len(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-D token tensors."""
    n = min(a.shape[0], b.shape[0])
    differs = a[:n] != b[:n]  # [n]
    return int(differs.int().argmax()) if bool(differs.any()) else n


def shared_head(prompts: Sequence[Sequence[int]], limit: int) -> int:
    """Length of the longest prefix every prompt starts with, at most `limit` tokens."""
    limit = max(0, min([limit, *(len(p) for p in prompts)]))
    heads = torch.tensor([list(p[:limit]) for p in prompts], dtype=torch.long)  # [B, n]
    return common_prefix_length(heads, torch.ones_like(heads))


@dataclass
class _Entry:
    tokens: torch.Tensor  # [N] int64, CPU
    kv: KV
    nbytes: int


class PrefixCache:
    """LRU store of per-sequence KV, keyed by the exact token ids it covers."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> tuple[int, KV | None]:
        """Longest reusable prefix of `prompt` (at most all but its last token) and its KV."""
        query = torch.tensor(list(prompt[:-1]), dtype=torch.long)
        best_len, best_key = 0, None
        for key, entry in self._entries.items():
            n = common_prefix_len(entry.tokens, query)
            if n > best_len:
                best_len, best_key = n, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        kv = self._entries[best_key].kv
        return best_len, [(k[:, :best_len], v[:, :best_len]) for k, v in kv]

    def insert(self, tokens: Sequence[int], kv: KV) -> None:
        """Remember `kv` for `tokens`; drop entries it supersedes, then the least recently used."""
        nbytes = sum(k.nbytes + v.nbytes for k, v in kv)
        if self.max_entries <= 0 or nbytes > self.max_bytes:
            return
        ids = torch.tensor(list(tokens), dtype=torch.long)
        superseded = [
            key
            for key, entry in self._entries.items()
            if common_prefix_len(entry.tokens, ids) == entry.tokens.shape[0]
        ]
        for key in superseded:
            self._drop(key)
        self._entries[self._next_key] = _Entry(ids, kv, nbytes)
        self._next_key += 1
        self.nbytes += nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes


def _stack_prefixes(prefixes: list[KV | None], lengths: list[int], skip: int = 0) -> KV:
    """Right-align per-row cached KV past its first `skip` slots into one batch: per layer
    `[B, H, max(lengths), D]`, row b's slots `skip : skip + lengths[b]`."""
    template = next(kv for kv in prefixes if kv is not None)
    width = max(lengths)
    stacked: KV = []
    for layer, (k0, v0) in enumerate(template):
        keys = k0.new_zeros(len(prefixes), k0.shape[0], width, k0.shape[2])  # [B, H, L, D]
        values = v0.new_zeros(len(prefixes), v0.shape[0], width, v0.shape[2])  # [B, H, L, D]
        for row, (kv, n) in enumerate(zip(prefixes, lengths, strict=True)):
            if kv is not None and n > 0:
                keys[row, :, width - n :] = kv[layer][0][:, skip : skip + n]
                values[row, :, width - n :] = kv[layer][1][:, skip : skip + n]
        stacked.append((keys, values))
    return stacked


def _row_kv(
    cache: DynamicCache, row: int, valid_row: torch.Tensor, shared: SharedPrefix | None
) -> KV:
    """One row's KV over the shared prefix (if any) and its valid slots, copied out of the
    batch (so the batch can be freed)."""
    slots = valid_row.nonzero().squeeze(-1)  # [N]: found once, not once per layer
    kv: KV = []
    for i, layer in enumerate(cast(list[DynamicLayer], cache.layers)):
        assert layer.keys is not None and layer.values is not None
        keys = layer.keys[row].index_select(1, slots)  # [H, N, D]
        values = layer.values[row].index_select(1, slots)  # [H, N, D]
        if shared is not None:
            keys = torch.cat([shared.layers[i][0], keys], dim=1)  # [H, P + N, D]
            values = torch.cat([shared.layers[i][1], values], dim=1)  # [H, P + N, D]
        kv.append((keys, values))
    return kv


@dataclass
class BackendStats:
    """Cumulative token counts of one backend, for tests and benchmarks."""

    prefill_tokens: int = 0
    """Prompt tokens run through the model."""
    reused_tokens: int = 0
    """Prompt tokens served from the prefix cache instead."""
    generated_tokens: int = 0
    """Tokens sampled."""
    shared_prefix_slots: int = 0
    """Cache slots batches did not hold per row: each batch's shared prefix (`SharedPrefix`)
    times its rows but one."""


@dataclass
class _Row:
    prompt: list[int]
    reused: int
    uniforms: torch.Tensor
    """`[max_tokens]`: the draws of the row's own generator, one per token it may sample."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: Finish | None = None


@dataclass
class _Batch:
    """The rows still decoding, their KV cache, which cache slots are real, next-token logits."""

    active: list[int]  # indices into the chunk's rows
    cache: DynamicCache
    valid: torch.Tensor  # [B, K] bool
    logits: torch.Tensor  # [B, V] fp32
    uniforms: torch.Tensor  # [B, max_tokens]: the active rows' draws
    shared: SharedPrefix | None = None
    """The prefix every row starts with, held once; `cache` and `valid` cover the slots after
    it."""


def _generator(seed: int) -> torch.Generator:
    """A row's own CPU generator."""
    return torch.Generator().manual_seed(seed)


def _right_aligned(lengths: Sequence[int], width: int) -> torch.Tensor:
    """Bool `[B, width]`, True on the last `lengths[b]` slots of row b."""
    return torch.arange(width)[None, :] >= width - torch.tensor(lengths)[:, None]


MIN_SHARED_PREFIX = 16
"""A batch's common prompt prefix is prefilled once when at least this many tokens are new, and
held once for all rows (`SharedPrefix`) when at least this long."""


def _shared_prefix(
    rows: Sequence[_Row], hits: Sequence[tuple[int, KV | None]]
) -> SharedPrefix | None:
    """The longest prefix every row reuses from the cache and every prompt starts with, taken
    from the first row's cached KV; None under `MIN_SHARED_PREFIX` tokens or for one row."""
    if len(rows) < 2:
        return None
    length = shared_head([row.prompt for row in rows], min(row.reused for row in rows))
    if length < MIN_SHARED_PREFIX:
        return None
    kv = hits[0][1]
    assert kv is not None  # the first row reuses at least `length` tokens
    return SharedPrefix(length, [(k[:, :length], v[:, :length]) for k, v in kv])


class HFBackend:
    """Batched sampling from a transformers causal LM, with exact logprobs and a KV prefix cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        device: str | torch.device | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_batch_size: int = 64,
        prefix_cache_entries: int = 256,
        prefix_cache_bytes: int = 1 << 30,
        compute_dtype: torch.dtype | None = None,
        packed_decode: bool = True,
        shared_prefix_attention: bool = True,
    ) -> None:
        layer_types = getattr(getattr(model, "config", None), "layer_types", None) or []
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(f"HFBackend supports full-attention models only, got {layer_types}")
        self.model = model
        self.tokenizer = tokenizer
        self._device = None if device is None else torch.device(device)
        stops = turn_end_ids(tokenizer).stop_ids if eos_token_ids is None else eos_token_ids
        self.eos_token_ids = frozenset(int(i) for i in stops)
        """Ids a row stops on, kept as its last id; by default the turn end and the EOS."""
        self.max_batch_size = max_batch_size
        self.prefix_cache = PrefixCache(prefix_cache_entries, prefix_cache_bytes)
        self.stats = BackendStats()
        self.compute_dtype = compute_dtype
        """bf16: sample under bf16 autocast from fp32 weights (the trainer's master weights, as
        `model.dtype: bfloat16` keeps them); None: the weights' own dtype."""
        dtype = compute_dtype or next(model.parameters()).dtype
        self.packed = PackedLinears(model, dtype, max_batch_size) if packed_decode else None
        """Decode steps' linear layers on oneDNN with reordered weights (`packed_linear.py`);
        None, or a model it does not support (not on CPU, say): `F.linear` throughout."""
        self.shared_prefix_attention = shared_prefix_attention
        """Hold a batch's common prefix once and attend over it once for all rows (on CPU, with
        our attention implementation: `_holds_prefix_once`)."""

    @property
    def device(self) -> torch.device:
        """Where inputs go: the given device, else wherever the policy's weights are right now."""
        return self._device or next(self.model.parameters()).device

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        """Continue every prompt once (one assistant turn each); `seeds[i]` seeds prompt i."""
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        # Similar lengths together: less padding per chunk. Per-row seeds make order irrelevant.
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: dict[int, Generation] = {}
        was_training = self.model.training
        self.model.eval()  # the trainer's policy: restore its mode afterwards
        try:
            with torch.inference_mode(), self._linears():
                for start in range(0, len(order), self.max_batch_size):
                    chunk = order[start : start + self.max_batch_size]
                    generations = self._generate_chunk(
                        [prompts[i] for i in chunk], sampling, [seeds[i] for i in chunk]
                    )
                    results.update(zip(chunk, generations, strict=True))
        finally:
            self.model.train(was_training)
        return [results[i] for i in range(len(prompts))]

    def update_weights(self, model: torch.nn.Module) -> None:
        """Take the trainer's current weights; every cached KV and packed weight is of old ones."""
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())
        self.free_caches()

    def score(
        self, sequences: list[list[int]], targets: list[list[bool]], temperature: float
    ) -> list[list[float]]:
        """Per-token logprobs of given ids under the engine's current weights (the weight
        canary, `trainer/canary.py`): `out[i][t]` is that of `sequences[i][t]` given the ids
        before it where `targets[i][t]`, else 0. One plain forward per sequence, no cache."""
        out = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode(), self._autocast():
                for ids, wanted in zip(sequences, targets, strict=True):
                    x = torch.tensor([ids], device=self.device)  # [1, T]
                    mask = torch.tensor([wanted], device=self.device)  # [1, T]
                    values = token_logprobs(
                        self.model, x, temperature=temperature, target_mask=mask
                    )  # [1, T]
                    out.append(values[0].float().cpu().tolist())
        finally:
            self.model.train(was_training)
        return out

    def free_caches(self) -> None:
        """Free the prefix cache and the packed weights: both are of weights the trainer is about
        to change (`update_weights` would drop them after the update; this frees them for it)."""
        self.prefix_cache.clear()
        if self.packed is not None:
            self.packed.release()

    def close(self) -> None:
        """Free the prefix cache and the packed weights."""
        self.free_caches()

    def _linears(self) -> contextlib.AbstractContextManager[None]:
        """The packed decode layers when they apply to the model as it is now, else nothing."""
        if self.packed is None or not packing_supported(self.model, self.packed.dtype):
            return contextlib.nullcontext()
        return self.packed.active()

    def _warm_shared_prefix(self, prompts: list[list[int]]) -> None:
        """Prefill the prompts' common prefix once, so every row reuses it from the cache.

        A group's G samples share their whole prompt, and an environment's tasks share their
        system prompt and tool list: without this, the first turn encodes them G x tasks times.
        """
        # leave each row one token to prefill
        prefix_len = shared_head(prompts, min(len(p) for p in prompts) - 1)
        cached, _ = self.prefix_cache.lookup(prompts[0][: prefix_len + 1])
        if len(prompts) < 2 or prefix_len - cached < MIN_SHARED_PREFIX:
            return
        prefix = prompts[0][:prefix_len]
        valid = torch.ones(1, prefix_len, dtype=torch.bool, device=self.device)  # [1, P]
        cache = DynamicCache()
        self._forward(torch.tensor([prefix], device=self.device), valid, cache, None)
        self.prefix_cache.insert(prefix, _row_kv(cache, 0, valid[0], None))
        self.stats.prefill_tokens += prefix_len

    def _warm_repeated_prompts(self, prompts: list[list[int]]) -> None:
        """Prefill every prompt the batch holds more than once (all but its last token) once, in
        one batch, so its copies (a GRPO group's G samples of one task) each prefill one token.
        """
        counts = Counter(tuple(p) for p in prompts)
        heads = [list(p[:-1]) for p, copies in counts.items() if copies > 1]
        hits = [self.prefix_cache.lookup(head) for head in heads]
        todo = [(head, hit) for head, hit in zip(heads, hits, strict=True)
                if len(head) - hit[0] >= MIN_SHARED_PREFIX]  # fmt: skip
        if not todo:
            return
        rows = [_Row(head, hit[0], torch.empty(0)) for head, hit in todo]
        batch = self._prefill(rows, [hit for _, hit in todo], max_tokens=0)
        for b, row in enumerate(rows):
            self.prefix_cache.insert(
                row.prompt, _row_kv(batch.cache, b, batch.valid[b], batch.shared)
            )
        self.stats.prefill_tokens += sum(len(row.prompt) - row.reused for row in rows)

    def _generate_chunk(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        if sampling.max_tokens <= 0:
            return [Generation([], [], "length") for _ in prompts]
        self._warm_shared_prefix(prompts)
        self._warm_repeated_prompts(prompts)
        hits = [self.prefix_cache.lookup(p) for p in prompts]
        # n draws at once are the n single draws in turn (CPU generators fill serially)
        rows = [
            _Row(list(p), n, torch.rand(sampling.max_tokens, generator=_generator(s)))
            for p, (n, _), s in zip(prompts, hits, seeds, strict=True)
        ]
        started = time.perf_counter()
        batch = self._prefill(rows, hits, sampling.max_tokens)
        self.stats.reused_tokens += sum(row.reused for row in rows)
        self.stats.prefill_tokens += sum(len(row.prompt) - row.reused for row in rows)
        prefilled = time.perf_counter()
        while batch.active:
            self._step(rows, batch, sampling)
        timing = {"prefill_s": prefilled - started, "decode_s": time.perf_counter() - prefilled}
        return [self._finish(row, timing) for row in rows]

    def _prefill(
        self, rows: list[_Row], hits: list[tuple[int, KV | None]], max_tokens: int
    ) -> _Batch:
        """One forward over every row's uncached suffix, on top of its reused prefix KV, into a
        cache with room for `max_tokens` more slots. The prefix all rows reuse, when long enough,
        stays out of the batch's cache: held once (`_Batch.shared`)."""
        shared = _shared_prefix(rows, hits) if self._holds_prefix_once() else None
        skip = shared.length if shared is not None else 0
        self.stats.shared_prefix_slots += skip * (len(rows) - 1)
        suffixes = [row.prompt[row.reused :] for row in rows]
        width = max(len(s) for s in suffixes)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # [B, S]
        for b, suffix in enumerate(suffixes):
            ids[b, width - len(suffix) :] = torch.tensor(suffix)
        reused = [row.reused - skip for row in rows]  # cached slots the batch's cache holds
        prefixes = [kv for _, kv in hits]
        past = _stack_prefixes(prefixes, reused, skip) if max(reused) > 0 else None
        valid = torch.cat(
            [
                _right_aligned(reused, max(reused)),
                _right_aligned([len(s) for s in suffixes], width),
            ],
            dim=1,
        ).to(self.device)  # [B, L + S]
        cache = reserved_cache(valid.shape[1] + max_tokens, past)
        logits = self._forward(ids.to(self.device), valid, cache, shared)
        uniforms = torch.stack([row.uniforms for row in rows]) if max_tokens else torch.empty(0)
        uniforms = uniforms.to(self.device)  # [B, max_tokens]
        return _Batch(list(range(len(rows))), cache, valid, logits, uniforms, shared)

    def _holds_prefix_once(self) -> bool:
        """Whether batches hold their shared prefix once: asked for, on CPU (the kernel
        `cascade_attention` uses), and the model on our attention, which takes it."""
        attention = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        return self.shared_prefix_attention and self.device.type == "cpu" and attention == ATTENTION

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Autocast to `compute_dtype` when it is not fp32, else nothing."""
        if self.compute_dtype in (None, torch.float32):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _forward(
        self,
        ids: torch.Tensor,
        valid: torch.Tensor,
        cache: DynamicCache,
        shared: SharedPrefix | None,
    ) -> torch.Tensor:
        """Run the last `ids.shape[1]` slots of `valid` (after the `shared` prefix, if any)
        through the model; last logits `[B, V]`."""
        dtype = self.compute_dtype or next(self.model.parameters()).dtype
        # our attention (`models/attention.py`) takes the prefix from the keyword arguments
        # transformers hands every layer's attention
        extra = {} if shared is None else {"shared_prefix": shared}
        positions = position_ids(valid, ids.shape[1]) + (shared.length if shared is not None else 0)
        with self._autocast():
            out = self.model(
                input_ids=ids,
                attention_mask=attention_bias(valid, ids.shape[1], dtype),
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **extra,
            )
        return out.logits[:, -1].float()

    def _step(self, rows: list[_Row], batch: _Batch, sampling: SamplingConfig) -> None:
        """Sample one token for every active row, retire finished rows, feed the rest."""
        step = len(rows[batch.active[0]].tokens)  # every active row has sampled as many
        tokens, logprobs = sample_tokens(batch.logits, sampling, batch.uniforms[:, step])  # [B]
        keep: list[int] = []
        for b, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
            row = rows[batch.active[b]]
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.finish = self._finish_reason(row.tokens, sampling)
            if row.finish is None:
                keep.append(b)
            else:
                covered = row.prompt + row.tokens[:-1]  # the last token was never fed
                kv = _row_kv(batch.cache, b, batch.valid[b], batch.shared)
                self.prefix_cache.insert(covered, kv)
        if len(keep) < len(batch.active):
            index = torch.tensor(keep, dtype=torch.long, device=batch.valid.device)
            batch.cache.batch_select_indices(index)
            batch.valid, tokens = batch.valid[index], tokens[index]
            batch.uniforms = batch.uniforms[index]
        batch.active = [batch.active[b] for b in keep]
        if keep:
            ones = torch.ones(len(keep), 1, dtype=torch.bool, device=batch.valid.device)
            batch.valid = torch.cat([batch.valid, ones], dim=1)  # [B', K + 1]
            batch.logits = self._forward(tokens[:, None], batch.valid, batch.cache, batch.shared)

    def _finish_reason(self, tokens: list[int], sampling: SamplingConfig) -> Finish | None:
        if tokens[-1] in self.eos_token_ids:
            return "stop"
        if stop_hit(self.tokenizer, tokens, sampling.stop, stop_window(sampling.stop)):
            return "stop"
        return "length" if len(tokens) >= sampling.max_tokens else None

    def _finish(self, row: _Row, timing: dict[str, float]) -> Generation:
        self.stats.generated_tokens += len(row.tokens)
        extra = {
            "reused_tokens": float(row.reused),
            "prefill_tokens": float(len(row.prompt) - row.reused),
            **timing,
        }
        text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
        return Generation(row.tokens, row.logprobs, row.finish or "length", text=text, extra=extra)
