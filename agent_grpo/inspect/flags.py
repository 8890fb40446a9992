"""What `inspect` flags on a step of `metrics.jsonl`: the problems a mean reward hides.

The same conditions as the step line of a running trainer (`agent_grpo.trainer.step_log.
step_flags`), read back from a flat metrics row so that a finished run, or one trained before the
step line had flags, shows them too: no learning signal (every group dead: loss 0 and grad norm
0), env or verifier exceptions, non-finite rewards, malformed tool calls, truncation, skipped
optimizer steps. A key missing from the row (an older run, an eval row) raises no flag.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["row_flags"]


def _value(row: Mapping[str, Any], key: str) -> float | None:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _positive(row: Mapping[str, Any], key: str) -> float:
    """The row's finite value of `key` when above 0, else 0."""
    value = _value(row, key)
    return value if value is not None and value > 0 else 0.0


def _all_dead(row: Mapping[str, Any]) -> bool:
    fraction = _value(row, "dead_group_fraction")
    if fraction is not None:
        return fraction >= 1.0
    # Rows without the signal metrics: a step that moved nothing at all.
    loss, grad = _value(row, "loss"), _value(row, "grad_norm")
    return loss == 0.0 and grad == 0.0


def row_flags(row: Mapping[str, Any]) -> list[str]:
    """Short flags for one metrics row, most serious first; [] for a healthy step."""
    flags = ["all groups dead"] if _all_dead(row) else []
    if errors := _positive(row, "error_fraction"):
        flags.append(f"env/verifier errors {errors:.0%}")
    if nonfinite := _positive(row, "nonfinite_rewards"):
        flags.append(f"non-finite rewards {nonfinite:g}")
    if malformed := _positive(row, "malformed_call_rate"):
        flags.append(f"malformed calls {malformed:.0%}")
    if truncated := _positive(row, "truncated_fraction"):
        flags.append(f"truncated {truncated:.0%}")
    if skipped := _positive(row, "skipped_steps"):
        flags.append(f"skipped steps {skipped:g}")
    return flags
