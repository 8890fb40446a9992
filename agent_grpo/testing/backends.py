"""A generation backend that answers from a fixed script, for rollout tests without a model."""

from __future__ import annotations

from typing import Any, Literal

import torch

from agent_grpo.rollout.backends.base import Generation, SamplingConfig

__all__ = ["ScriptedBackend", "SeededFinal"]


class ScriptedBackend:
    """Answers turn k of every prompt with `script[k]` (k = assistant turns already taken; the
    last entry repeats), cut at `max_tokens` (finish `length`), else finish `stop`."""

    def __init__(
        self,
        tokenizer: Any,
        script: list[str],
        *,
        eos: bool = True,
        logprob: float = -0.5,
        turn_marker: tuple[str, int] = ("<|im_start|>assistant", 1),
        stop_strings: tuple[str, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.eos = eos
        """Append EOS to a turn that stopped; False ends it as a stop string does (no EOS
        sampled: the chat template closes the turn)."""
        self.logprob = logprob
        """The sampler logprob reported for every generated token."""
        self.calls: list[int] = []
        """The batch size of every `generate` call."""
        self.turn_marker = turn_marker
        """Text a prompt holds once per turn taken, and how often it holds it before the first
        (ChatML: `<|im_start|>assistant`, once in the generation prompt)."""
        self.marker = tokenizer.encode(turn_marker[0], add_special_tokens=False)
        self.stop_strings = stop_strings
        """A turn that ends with one of these gets no EOS, as an engine stopping there."""

    def _turn(self, prompt: list[int]) -> int:
        n = len(self.marker)
        starts = sum(prompt[i : i + n] == self.marker for i in range(len(prompt) - n + 1))
        return starts - self.turn_marker[1]

    def _copy(self, script: list[str]) -> ScriptedBackend:
        return ScriptedBackend(
            self.tokenizer,
            script,
            eos=self.eos,
            logprob=self.logprob,
            turn_marker=self.turn_marker,
            stop_strings=self.stop_strings,
        )

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        """One scripted turn per prompt."""
        self.calls.append(len(prompts))
        out = []
        for prompt in prompts:
            text = self.script[min(self._turn(prompt), len(self.script) - 1)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)[: sampling.max_tokens]
            finish: Literal["stop", "length"] = (
                "length" if len(ids) == sampling.max_tokens else "stop"
            )
            if self.eos and finish == "stop" and not text.endswith(self.stop_strings):
                ids = [*ids, self.tokenizer.eos_token_id]
            out.append(Generation(ids, [self.logprob] * len(ids), finish, text))
        return out

    def update_weights(self, model: torch.nn.Module) -> None:
        """Nothing to update."""

    def score(
        self, sequences: list[list[int]], targets: list[list[bool]], temperature: float
    ) -> list[list[float]]:
        """The scripted logprob on every target: a script holds no weights to check."""
        return [[self.logprob if t else 0.0 for t in row] for row in targets]

    def free_caches(self) -> None:
        """Nothing cached."""

    def close(self) -> None:
        """Nothing to release."""


class SeededFinal(ScriptedBackend):
    """`ScriptedBackend` whose turns past the script answer `Answer: <seed % 10>` (in `final`,
    for a family that writes answers in its own markup): scripted tool calls, then a final
    answer that differs between members, so groups have reward variance (for training tests
    that need several turns, which a random tiny model never takes)."""

    def __init__(
        self, tokenizer: Any, script: list[str], *, final: str = "{}", **options: Any
    ) -> None:
        super().__init__(tokenizer, script, **options)
        self.final = final
        """How the family writes its final answer, `{}` standing for it (Harmony: a final
        channel message)."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seeds: list[int]
    ) -> list[Generation]:
        """Scripted turns while the script lasts, then a seed-dependent answer."""
        out = []
        for prompt, seed in zip(prompts, seeds, strict=True):
            turn = self._turn(prompt)
            answer = self.final.format(f"Answer: {seed % 10}")
            script = self.script if turn < len(self.script) else [answer]
            one = self._copy([script[min(turn, len(script) - 1)]])
            out += one.generate([prompt], sampling, [seed])
        self.calls.append(len(prompts))
        return out
