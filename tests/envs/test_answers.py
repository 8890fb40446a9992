"""`float_verdict`: a numeric answer within a tolerance, beside `number_verdict`'s exact one."""

from __future__ import annotations

import math

import pytest

from agent_grpo.envs.answers import float_verdict, number_verdict, parse_float


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("3.14159", 3.14159),
        ("-2.5e-3 m/s", -0.0025),
        ("1,234.5", 1234.5),
        ("+7", 7.0),
        (".5", 0.5),
        ("6.02E23", 6.02e23),
        ("about 2. or so", 2.0),
        ("none", None),
    ],
)
def test_parse_float_reads_signs_commas_and_exponents(text: str, value: float | None) -> None:
    assert parse_float(text) == value


def test_within_tolerance_passes_where_exact_match_fails() -> None:
    text = "The root is about this.\nAnswer: 1.41421356"
    assert float_verdict(text, math.sqrt(2)).success  # |diff| / sqrt(2) = 1.7e-9
    assert not number_verdict(text, 1).success
    assert not float_verdict("Answer: 1.4142", math.sqrt(2)).success  # 1e-5 off: default 1e-6
    assert float_verdict("Answer: 1.4142", math.sqrt(2), rel_tol=1e-4).success


def test_near_zero_needs_the_absolute_tolerance() -> None:
    assert float_verdict("Answer: 1e-12", 0.0).success  # abs_tol 1e-9
    assert not float_verdict("Answer: 1e-12", 0.0, abs_tol=0.0).success  # rel_tol alone: never


def test_verdict_fields_match_the_other_verdicts() -> None:
    wrong = float_verdict("Answer: 2.5", 2.0)
    assert (wrong.success, wrong.reward, wrong.detail, wrong.given) == (False, 0.0, "wrong", "2.5")
    right = float_verdict("Answer: 2.0000000001", 2.0)
    assert (right.success, right.reward, right.expected) == (True, 1.0, "2.0")
    assert float_verdict("2.0", 2.0).detail == "no 'Answer:' line"  # the format is rewarded
    assert float_verdict("Answer: two", 2.0).detail == "no number"
    assert not float_verdict("Answer: nan", 2.0).success
