"""Final-answer parsing and verdicts shared by the built-in environments.

Every built-in env asks for the same answer line, `Answer: <answer>`, so a small model learns one
format. The answer is the text after the last `Answer:` (case-insensitive), up to the end of that
line. Without an `Answer:` line there is no answer and the verdict is a failure: we reward the
format, not a number that happens to appear somewhere in the text.

Where we depart from exact match: numbers compare by value (`1,234`, `1234.0` and `1234` agree),
and text answers compare by normalized words (case, punctuation and a leading `the` ignored), with
a little slack: the expected words may sit inside a slightly longer answer ("the river Ousel" for
"Ousel"), but not inside an answer that lists many candidates. `exact_verdict` is for answers
where case and every character matter (a transformed string); `float_verdict` for answers with
no exact value, which agree within a tolerance (`1.5e-3` and 0.0015; `3.1416` and pi with
`rel_tol=1e-5`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import TypeVar

from agent_grpo.envs.text_env import Verdict

N = TypeVar("N")

__all__ = [
    "ANSWER_FORMAT",
    "MAX_NUMBER_CHARS",
    "exact_verdict",
    "extract_answer",
    "float_verdict",
    "number_verdict",
    "parse_float",
    "parse_number",
    "text_verdict",
]

ANSWER_FORMAT = "Answer: <answer>"
"""How every built-in env asks for the final answer."""
TEXT_SLACK_WORDS = 3
"""Extra words a text answer may have around the expected words."""
MAX_NUMBER_CHARS = 1000
"""A longer number is no number (a wrong answer): no task expects one, and past 4,300 digits
Python refuses to convert it (`ValueError`)."""

_ANSWER = re.compile(r"answer\s*:", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_FLOAT = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_WORD = re.compile(r"[a-z0-9]+")


def extract_answer(text: str) -> str | None:
    """The text after the last `Answer:` up to the end of its line, stripped; None if absent."""
    matches = list(_ANSWER.finditer(text))
    if not matches:
        return None
    return text[matches[-1].end() :].strip().split("\n", 1)[0].strip()


def parse_number(text: str) -> Fraction | None:
    """The first number in `text` (commas as thousands separators allowed), exactly; or None
    (also for one longer than `MAX_NUMBER_CHARS`)."""
    match = _NUMBER.search(text)
    if match is None or len(match.group()) > MAX_NUMBER_CHARS:
        return None
    return Fraction(match.group().replace(",", ""))


def number_verdict(text: str, expected: int | Fraction) -> Verdict:
    """Success iff the answer line's first number equals `expected`."""
    return _numeric_verdict(text, str(expected), parse_number, lambda value: value == expected)


def parse_float(text: str) -> float | None:
    """The first number in `text` as a float (commas as thousands separators, and an exponent
    as in `1.5e-3`, allowed); or None."""
    match = _FLOAT.search(text)
    return float(match.group().replace(",", "")) if match else None


def float_verdict(
    text: str, expected: float, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9
) -> Verdict:
    """Success iff the answer line's first number is within tolerance of `expected`
    (`math.isclose`: relative `rel_tol`, or absolute `abs_tol` for answers near zero), for
    answers no exact value can be asked for (a root, a mean, a physical quantity)."""

    def close(value: float) -> bool:
        return math.isclose(value, float(expected), rel_tol=rel_tol, abs_tol=abs_tol)

    return _numeric_verdict(text, str(expected), parse_float, close)


def _numeric_verdict(
    text: str, expected: str, parse: Callable[[str], N | None], matches: Callable[[N], bool]
) -> Verdict:
    """The verdict on the answer line's first number, read by `parse` and judged by `matches`."""
    answer = extract_answer(text)
    if answer is None:
        return Verdict(success=False, expected=expected, detail="no 'Answer:' line")
    value = parse(answer)
    if value is None:
        return Verdict(success=False, expected=expected, given=answer, detail="no number")
    ok = matches(value)
    return Verdict(success=ok, expected=expected, given=answer, detail="" if ok else "wrong")


def _words(text: str) -> list[str]:
    words = _WORD.findall(text.lower())
    return words[1:] if words[:1] == ["the"] else words


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def text_verdict(text: str, expected: str) -> Verdict:
    """Success iff the answer line holds the expected words, with at most a few extra words."""
    answer = extract_answer(text)
    if answer is None:
        return Verdict(success=False, expected=expected, detail="no 'Answer:' line")
    given, wanted = _words(answer), _words(expected)
    ok = _contains(given, wanted) and len(given) <= len(wanted) + TEXT_SLACK_WORDS
    return Verdict(success=ok, expected=expected, given=answer, detail="" if ok else "wrong")


def exact_verdict(text: str, expected: str) -> Verdict:
    """Success iff the answer line is exactly `expected` (surrounding quotes and spaces ignored)."""
    answer = extract_answer(text)
    if answer is None:
        return Verdict(success=False, expected=expected, detail="no 'Answer:' line")
    given = answer.strip().strip("'\"`").strip()
    ok = given == expected
    return Verdict(success=ok, expected=expected, given=answer, detail="" if ok else "wrong")
