"""The trajectory record: one multi-turn episode as exact tokens, with where each token came from.

A record is the unit that rollouts produce, the trainer consumes, the store writes as one JSON
line, and replay renders. Per-token arrays (`token_ids`, `provenance`, the logprob arrays) all have
length `num_tokens`. Logprob arrays hold `None` wherever a value does not exist (every non-model
token for sampler logprobs), never a placeholder 0.0 that could leak into a loss.

Every text a record holds is valid Unicode: building any record model passes its strings (nested
ones in `arguments` and `verifier` included) through `valid_text`, which replaces lone surrogates
with U+FFFD. Model output can carry them (a JSON `"\\ud800"` escape in tool-call arguments), and
so can tool output (bytes decoded with `surrogateescape`); a surrogate cannot be encoded as UTF-8,
so it would make the record unwritable and the tokenizer fail on the observation. Token ids are
never touched: only text is repaired.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticSerializationError

__all__ = [
    "Lengths",
    "Message",
    "Provenance",
    "Termination",
    "TokenBranch",
    "TokenRow",
    "ToolCallRecord",
    "TrajectoryRecord",
    "TurnRecord",
    "valid_text",
]


class Provenance(StrEnum):
    """Where one token came from. Only `model` tokens are ever trained on."""

    PROMPT = "prompt"
    """The initial conversation (system + user), including the first generation prompt."""
    MODEL = "model"
    """Sampled by the policy; the only provenance with a sampler logprob and a loss."""
    TEMPLATE = "template"
    """Chat-template scaffolding between turns: end-of-turn, role headers, generation prompt."""
    OBSERVATION = "observation"
    """Content of a tool or environment message."""
    CONTEXT = "context"
    """An earlier model turn as a later branch of a forked episode holds it: its sampled ids when
    the template renders them unchanged, else the template's rewrite of them as plain text. Never
    trained here: the turn is trained once, in the branch where it was sampled."""
    PADDING = "padding"
    """Batch padding; never part of a stored trajectory's meaning."""


def valid_text(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD, so it encodes as UTF-8 and JSON."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        # Through UTF-16, a surrogate pair written as two code points becomes its character again;
        # only the unpaired halves are replaced.
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text  # the same object: a `Provenance` member stays one


# Deeper than this, nested values are left as they are, so repairing never exhausts Python's
# stack. Tool-call arguments are capped shallower (`toolcalls.MAX_JSON_DEPTH`); pydantic cannot
# serialize past about 255 levels anyway.
_MAX_TEXT_DEPTH = 100


# Never text, and walking them would cost more than the rest of a record (tens of thousands of
# entries); every other field is repaired, so a new text field is covered without a change here.
# (`forks` holds branches, each repaired by its own validator.)
_PER_TOKEN_FIELDS = frozenset(
    {"token_ids", "provenance", "sampler_logprobs", "old_logprobs", "ref_logprobs", "forks"}
)


def _valid_texts(value: Any, depth: int = 0) -> Any:
    """`value` with `valid_text` applied to every string in it, dict keys included."""
    if isinstance(value, str):
        return valid_text(value)
    if depth >= _MAX_TEXT_DEPTH:
        return value
    if isinstance(value, dict):
        return {_valid_texts(k, depth): _valid_texts(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_valid_texts(v, depth + 1) for v in value]
    if isinstance(value, tuple):
        return tuple(_valid_texts(v, depth + 1) for v in value)
    return value


class _Record(BaseModel):
    # NaN/inf rewards are kept as recorded (JSON NaN/Infinity constants), never turned into null
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, ser_json_inf_nan="constants"
    )

    @model_validator(mode="before")
    @classmethod
    def _repair_text(cls, data: Any) -> Any:
        # Applied to every record model on construction: the one place text enters a record.
        if not isinstance(data, dict):
            return data
        return {k: v if k in _PER_TOKEN_FIELDS else _valid_texts(v) for k, v in data.items()}


class Message(_Record):
    """One chat message, in the shape `tokenizer.apply_chat_template` accepts."""

    role: Literal["system", "user", "assistant", "tool"]
    """Who speaks: the environment writes system/user/tool messages, the policy assistant ones."""
    content: str
    """The message text exactly as rendered into the chat template."""
    name: str | None = None
    """For tool messages, the name of the tool that produced the content."""

    def to_template(self) -> dict[str, str]:
        """The dict form handed to chat templates (no `None` values)."""
        return self.model_dump(exclude_none=True)


class ToolCallRecord(_Record):
    """One tool call the model made, and what came of it."""

    name: str
    """Tool name as the model wrote it (may be unknown)."""
    arguments: dict[str, Any] | None = None
    """Parsed arguments, or None when they could not be parsed."""
    raw: str = ""
    """The exact text of the call as the model wrote it."""
    result: str | None = None
    """The tool's output as sent back to the model; None on error."""
    error: str | None = None
    """Why the call failed (parse error, unknown tool, bad arguments, exception, timeout)."""
    error_kind: str | None = None
    """Machine-readable error class: parse, unknown_tool, invalid_arguments, raised, timeout,
    oversized."""
    latency_s: float = 0.0
    """Wall-clock seconds spent running the tool."""


class TurnRecord(_Record):
    """What happened in one assistant turn."""

    index: int
    """0-based turn number."""
    model_text: str
    """The decoded text of this turn's sampled tokens (for display; the ids are the truth)."""
    token_start: int
    """Index into `token_ids` of this turn's first model token."""
    token_end: int
    """Index one past this turn's last model token."""
    finish_reason: str
    """Why sampling stopped: stop (EOS or stop string), length (max tokens per turn)."""
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    """Tool calls parsed from this turn, in order, with their results or errors."""
    env_latency_s: float = 0.0
    """Seconds the environment step took."""
    branch: int = 0
    """The token branch this turn was sampled (and is trained) in: 0 for the record's own
    arrays, k for `forks[k - 1]`; `token_start`/`token_end` index that branch's ids."""
    reward: float = 0.0
    """The env's reward for this turn alone (`info["turn_reward"]` of its step); the episode's
    reward is the record's `reward`, not repeated here."""
    state: str = ""
    """The state the turn was written from, which turn-level credit groups by: the env's
    `info["state"]` (reset's for the first turn, the previous step's after), else a digest of
    the conversation before the turn."""
    advantage: float | None = None
    """The advantage the trainer gave this turn's tokens when it differs per turn
    (`algo.turn_credit`); None: the record's `advantage`."""
    policy_version: int | None = None
    """The policy version that sampled this turn, when the episode straddled a weight update
    (`rollout.partial`); None: the record's `policy_version`."""


class Termination(_Record):
    """How the episode ended."""

    kind: Literal["terminated", "truncated", "error"]
    """terminated: the task ended (final answer); truncated: a limit outside the task ended it
    (max turns, max tokens, context); error: the environment or engine failed."""
    reason: str
    """Human-readable cause, e.g. `final_answer`, `max_turns`, `max_context`, or the exception."""


class Lengths(_Record):
    """Token and turn counts, by provenance."""

    prompt: int = 0
    """Number of `prompt` tokens."""
    model: int = 0
    """Number of `model` tokens (the ones trained on)."""
    template: int = 0
    """Number of `template` tokens."""
    observation: int = 0
    """Number of `observation` tokens."""
    context: int = 0
    """Number of `context` tokens: earlier turns as later branches of a forked episode hold
    them (0 when the episode never forked)."""
    total: int = 0
    """All tokens of every branch: what the trainer runs through the model."""
    turns: int = 0
    """Assistant turns taken."""
    branches: int = 1
    """Token branches (training rows) of the episode: 1 unless the template or the context
    policy rewrote history."""


class TokenBranch(_Record):
    """A later branch of an episode's token tree: one more training row.

    A branch starts when the next context is not an extension of the tokens held (the chat
    template rewrote an earlier turn, or the context policy replaced messages): it holds the
    from-scratch rendering of its own conversation, whose first `fork_at` ids are those of its
    parent. Turns sampled before the fork are `context` here; turns sampled after it are `model`.
    """

    parent: int
    """The branch it forked from: 0 for the record's own arrays, k for `forks[k - 1]`."""
    fork_at: int
    """How many leading ids it shares with its parent (their longest common prefix)."""
    reason: str
    """Why the branch started, e.g. `template rewrote turn 1` or `context: compact`."""
    messages: list[Message]
    """The conversation this branch renders (after a compaction it differs from the record's
    `messages`, which keep every turn and observation as they happened)."""
    message_turns: list[int | None]
    """For each message of `messages`, the turn whose sampled ids it holds (None for others)."""
    token_ids: list[int]
    """The branch's ids: its conversation rendered, sampled turns as their exact ids."""
    provenance: list[Provenance]
    """Origin of each token."""
    sampler_logprobs: list[float | None]
    """Sampler logprob of each `model` token (None elsewhere)."""
    old_logprobs: list[float | None] | None = None
    """Trainer's pi_old logprobs (filled by the trainer)."""
    ref_logprobs: list[float | None] | None = None
    """Reference logprobs (filled by the trainer when beta > 0)."""

    @model_validator(mode="before")
    @classmethod
    def _repair_branch_text(cls, data: Any) -> Any:
        # The record's validator leaves `forks` alone (per-token arrays); text is repaired here.
        if not isinstance(data, dict):
            return data
        return {
            k: v if k in _PER_TOKEN_FIELDS or k == "message_turns" else _valid_texts(v)
            for k, v in data.items()
        }


@dataclass
class TokenRow:
    """One training row of a record: its own arrays (branch 0) or one of its forks. Assigning
    `old_logprobs`/`ref_logprobs` through `TrajectoryRecord.set_row_logprobs` stores them."""

    branch: int
    """0 for the record's own arrays, k for `forks[k - 1]`."""
    token_ids: list[int]
    """The row's ids."""
    provenance: list[Provenance]
    """Origin of each id."""
    sampler_logprobs: list[float | None]
    """Sampler logprobs (None off model tokens)."""
    old_logprobs: list[float | None] | None
    """The trainer's pi_old logprobs, once scored."""
    ref_logprobs: list[float | None] | None
    """The reference's logprobs, once scored."""


class TrajectoryRecord(_Record):
    """One multi-turn episode: exact tokens with provenance, logprobs, reward and tool history."""

    run_id: str = ""
    """The run this record belongs to."""
    step: int = 0
    """Training step (or eval round) that produced it."""
    group_id: str
    """Id shared by the G samples of the same task in the same step; advantages use only these."""
    task_id: str
    """Prompt id: `{env_id}:{seed}`; the same task across steps has the same task id."""
    index_in_group: int
    """Position of this sample within its group (0..G-1)."""
    group_size: int
    """G, the number of samples in the group."""
    env_id: str
    """Gymnasium id of the environment, e.g. `agent_grpo/Calculator-v0`."""
    seed: int
    """Environment seed: the same seed always gives the same task."""
    messages: list[Message]
    """The whole conversation: prompt messages, assistant turns and observations."""
    prompt_messages_count: int = 0
    """How many leading messages of `messages` are the prompt."""
    token_ids: list[int]
    """Every token of the episode, exactly as the engine was conditioned on / sampled."""
    provenance: list[Provenance]
    """Origin of each token, same length as `token_ids`."""
    sampler_logprobs: list[float | None]
    """Logprob the sampling engine gave each `model` token (None elsewhere)."""
    old_logprobs: list[float | None] | None = None
    """Trainer's logprobs under the policy that sampled (filled by the trainer)."""
    ref_logprobs: list[float | None] | None = None
    """Reference-model logprobs (filled by the trainer when beta > 0)."""
    sampling_temperature: float = 1.0
    """Temperature the model tokens were drawn with; the trainer divides logits by it."""
    reward: float = 0.0
    """Total scalar reward used for the advantage."""
    reward_components: dict[str, float] = Field(default_factory=dict)
    """Every reward source's value before weighting (verifier, rules, reward models, judges)."""
    verifier: dict[str, Any] = Field(default_factory=dict)
    """The environment verifier's result (e.g. expected vs given answer, success flag)."""
    success: bool = False
    """Whether the verifier judged the task solved."""
    advantage: float | None = None
    """Group-relative advantage (filled by the trainer)."""
    policy_version: int = 0
    """Optimizer steps the sampling weights had taken (0: the policy GRPO started from, after
    the warm start) when the episode's first turn was sampled; every member of a group has the
    same. The trainer's version minus this is the record's staleness. With partial rollouts
    later turns may be newer: each turn's own is `TurnRecord.policy_version`."""
    excluded: str | None = None
    """Why this episode was left out of its group's statistics and the loss (an infrastructure
    failure, a non-finite reward); None when it counted. Filled by the trainer."""
    turns: list[TurnRecord] = Field(default_factory=list)
    """Per-turn detail: sampled span, tool calls, latencies."""
    termination: Termination
    """Why the episode ended."""
    lengths: Lengths
    """Counts by provenance."""
    malformed_tool_calls: int = 0
    """Tool calls in this episode that failed to parse or validate."""
    root_messages_count: int | None = None
    """How many leading `messages` branch 0 (the record's own arrays) renders when the episode
    forked; None when it renders them all (it never forked)."""
    forks: list[TokenBranch] = Field(default_factory=list)
    """Later branches of the episode's token tree (`TokenBranch`), in the order they started;
    empty when the template only appended. The record's own arrays are branch 0."""
    group_member_ids: list[str] = Field(default_factory=list)
    """Ids (`{group_id}/{i}`) of every member of this record's group, this one included."""
    content_hash: str | None = None
    """sha256 (hex) of the record's canonical JSON without this field (`store.record_hash`), set
    by the store when it writes the record; `replay --verify` recomputes it, so a changed token id
    is caught even where the invariants still hold. None until written, and in older runs."""

    @property
    def uid(self) -> str:
        """Stable id of this record: `{group_id}/{index_in_group}`."""
        return f"{self.group_id}/{self.index_in_group}"

    @property
    def loss_mask(self) -> list[bool]:
        """True exactly on `model` tokens; derived, so it can never disagree with provenance."""
        return [p is Provenance.MODEL for p in self.provenance]

    def rows(self) -> list[TokenRow]:
        """Every training row: branch 0 (the record's own arrays), then each fork."""
        rows = [
            TokenRow(
                0,
                self.token_ids,
                self.provenance,
                self.sampler_logprobs,
                self.old_logprobs,
                self.ref_logprobs,
            )
        ]
        for k, b in enumerate(self.forks, start=1):
            rows.append(
                TokenRow(
                    k, b.token_ids, b.provenance, b.sampler_logprobs, b.old_logprobs, b.ref_logprobs
                )
            )
        return rows

    def set_row_logprobs(
        self, branch: int, old: list[float | None] | None, ref: list[float | None] | None
    ) -> None:
        """Store the trainer's pi_old (and, when given, reference) logprobs of one row."""
        target: TrajectoryRecord | TokenBranch = self if branch == 0 else self.forks[branch - 1]
        target.old_logprobs = old
        if ref is not None:
            target.ref_logprobs = ref

    def to_json_line(self) -> str:
        """Serialize to one JSON line (no newline inside)."""
        try:
            return self.model_dump_json()
        except PydanticSerializationError:
            # A field assigned after construction skipped `valid_text`; a rebuilt copy has not.
            # Anything else that cannot be serialized (nesting too deep) still raises.
            return type(self).model_validate(self.model_dump()).model_dump_json()

    @classmethod
    def from_json_line(cls, line: str) -> TrajectoryRecord:
        """Parse a record written by `to_json_line`."""
        return cls.model_validate_json(line)
