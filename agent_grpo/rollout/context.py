"""Context policies: what an episode does when its next turn would not fit `max_context_tokens`.

`stop` ends it (truncated, `max_context`), as before. The others rewrite the oldest tool
observations, oldest first and only as many as the next turn needs: `drop` replaces each with a
placeholder, `truncate` keeps its first characters, `compact` replaces them with one summary
written by a function of the user's (each observation after the first becomes a one-line
pointer to it, so every tool call still has a reply). Every rewrite goes through the token tree
(`TokenBuilder.replace_messages`), so the episode forks: turns sampled before it keep their exact
context and gradient in the branch they were sampled in, and later turns train in the rewritten
one. The newest `keep_last` observations and every prompt message are never touched.

The summary is a function of the user's (`summarizer: module:function`), or the policy itself
(`summarizer: policy`): the collector asks the model being trained, greedily and at most
`summary_max_tokens`, to summarise the observations under `summary_prompt` (`summary_request`).
Departure from peers that train that extra turn: its tokens are not trained (no reward is
attributable to a summary) and not kept as ids; its text takes the observations' place and is
tokenized as text like every rewritten message, in the new branch. The fork's messages record it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

from pydantic import Field, field_validator

from agent_grpo.config.base import ConfigModel
from agent_grpo.trajectory.record import Message

__all__ = [
    "COMPACTED",
    "CompactObservations",
    "ContextPolicy",
    "DropObservations",
    "StopAtLimit",
    "TruncateObservations",
    "first_lines",
    "fitting_rewrite",
    "load_summarizer",
    "rewritable",
    "rewrite_for",
    "summary_request",
]

POLICY_SUMMARIZER = "policy"
"""`summarizer: policy`: the policy being trained writes the summary."""
SUMMARY_HEADER = "[summary of earlier tool outputs]"
"""The first line of every summary, so a reader (and the model) can tell it from an output."""
COMPACTED = "[in the summary above]"
"""What each compacted observation after the first (which holds the summary) becomes."""


class StopAtLimit(ConfigModel):
    """End the episode (truncated, `max_context`) when the next turn would not fit."""

    type: Literal["stop"] = "stop"
    """Policy name."""


class DropObservations(ConfigModel):
    """Replace the oldest tool observations with a placeholder until the next turn fits."""

    type: Literal["drop"] = "drop"
    """Policy name."""
    keep_last: int = Field(default=1, ge=0)
    """The newest observations that are never rewritten."""
    placeholder: str = "[output dropped to fit the context]"
    """What a dropped observation becomes (the tool message stays, so the turn still reads as
    answered)."""


class TruncateObservations(ConfigModel):
    """Cut the oldest tool observations to their first `max_chars` until the next turn fits."""

    type: Literal["truncate"] = "truncate"
    """Policy name."""
    keep_last: int = Field(default=1, ge=0)
    """The newest observations that are never rewritten."""
    max_chars: int = Field(default=200, ge=0)
    """Characters of each rewritten observation kept, followed by a `[truncated]` mark."""


class CompactObservations(ConfigModel):
    """Replace the oldest tool observations with one summary until the next turn fits."""

    type: Literal["compact"] = "compact"
    """Policy name."""
    keep_last: int = Field(default=1, ge=0)
    """The newest observations that are never rewritten."""
    summarizer: str = "agent_grpo.rollout.context:first_lines"
    """`module:function` called with the observations being compacted (a list of `Message`),
    returning the summary's text; it takes the first observation's place, and each of the
    others becomes `[in the summary above]` (every tool call keeps a reply after it: templates
    that rewrite assistant turns locate each between the messages around it). `policy`: the
    policy writes it (`summary_prompt`, greedy)."""
    summary_prompt: str = (
        "Summarize the tool outputs below in a few short lines. Keep every number, name and "
        "fact a later step may need; drop everything else."
    )
    """`summarizer: policy`: the system message of the summary request; the observations,
    numbered, are its user message."""
    summary_max_tokens: int = Field(default=96, ge=1)
    """`summarizer: policy`: the most tokens the summary may take."""

    @field_validator("summarizer")
    @classmethod
    def _loads(cls, path: str) -> str:
        if path != POLICY_SUMMARIZER:
            load_summarizer(path)  # a missing module or function is a config error, up front
        return path


ContextPolicy = Annotated[
    StopAtLimit | DropObservations | TruncateObservations | CompactObservations,
    Field(discriminator="type"),
]


def first_lines(messages: Sequence[Message]) -> str:
    """The default summary: each compacted observation's first line, cut to 80 characters; an
    earlier summary among them keeps its lines, and what it replaced (`COMPACTED`) adds none."""
    lines: list[str] = []
    for m in messages:
        head, *rest = m.content.splitlines() or [""]
        if head == SUMMARY_HEADER:  # compacted before: its lines already are first lines
            lines += [line.removeprefix("- ") for line in rest]
        elif m.content != COMPACTED:
            lines.append(head[:80])
    return SUMMARY_HEADER + "\n" + "\n".join(f"- {line}" for line in lines)


def summary_request(policy: CompactObservations, messages: Sequence[Message]) -> list[Message]:
    """The chat the policy answers with a summary of `messages` (`summarizer: policy`)."""
    outputs = "\n\n".join(f"[tool output {i + 1}]\n{m.content}" for i, m in enumerate(messages))
    return [Message(role="system", content=policy.summary_prompt),
            Message(role="user", content=outputs)]  # fmt: skip


def load_summarizer(path: str) -> Callable[[Sequence[Message]], str]:
    """The `module:function` a `compact` policy names (a clear error when it does not exist)."""
    module, _, name = path.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"rollout.context.summarizer {path!r} cannot be loaded: {error}") from None
    if not callable(function):
        raise ValueError(f"rollout.context.summarizer {path!r} is not a function")
    return function


def rewritable(
    policy: DropObservations | TruncateObservations | CompactObservations,
    messages: Sequence[Message],
    prompt_messages_count: int,
) -> list[int]:
    """Indices of the observations `policy` may rewrite, oldest first: every tool message after
    the prompt but the newest `keep_last`."""
    found = [i for i, m in enumerate(messages) if i >= prompt_messages_count and m.role == "tool"]
    return found[: max(0, len(found) - policy.keep_last)]


def fitting_rewrite(
    policy: DropObservations | TruncateObservations | CompactObservations,
    messages: Sequence[Message],
    prompt_messages_count: int,
    fits: Callable[[dict[int, Message | None]], bool],
    summarize: Callable[[Sequence[Message]], str] | None = None,
) -> dict[int, Message | None]:
    """The rewrite of the fewest oldest observations that `fits` (the next turn fits the context
    after it), else of all the rewritable ones; empty when no observation changes."""
    rewrite: dict[int, Message | None] = {}
    for count in range(1, len(rewritable(policy, messages, prompt_messages_count)) + 1):
        rewrite = rewrite_for(policy, messages, prompt_messages_count, count, summarize)
        # an empty rewrite (`truncate` with the oldest outputs short already) is no reason to
        # stop: longer ones may come after them
        if rewrite and fits(rewrite):
            break
    return rewrite


def rewrite_for(
    policy: DropObservations | TruncateObservations | CompactObservations,
    messages: Sequence[Message],
    prompt_messages_count: int,
    count: int,
    summarize: Callable[[Sequence[Message]], str] | None = None,
) -> dict[int, Message | None]:
    """The rewrite of the `count` oldest rewritable observations of `messages` (fewer when there
    are fewer): message index -> its replacement; empty when none of them changes (`truncate`:
    all short already). Pure; the caller grows `count` until the next turn fits or every
    rewritable observation is in."""
    candidates = rewritable(policy, messages, prompt_messages_count)[:count]
    if not candidates:
        return {}
    if isinstance(policy, DropObservations):
        return {
            i: messages[i].model_copy(update={"content": policy.placeholder}) for i in candidates
        }
    if isinstance(policy, TruncateObservations):
        cut: dict[int, Message | None] = {}
        for i in candidates:
            text = messages[i].content
            if len(text) > policy.max_chars:
                cut[i] = messages[i].model_copy(
                    update={"content": text[: policy.max_chars] + " [truncated]"}
                )
        return cut
    summary = (summarize or first_lines)([messages[i] for i in candidates])
    out: dict[int, Message | None] = {
        i: messages[i].model_copy(update={"content": COMPACTED}) for i in candidates[1:]
    }
    out[candidates[0]] = messages[candidates[0]].model_copy(update={"content": summary})
    return out
