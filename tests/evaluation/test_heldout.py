"""Unbiased pass@k (Chen et al. 2021): hand-derived values, and the definition itself (the share
of k-subsets of the n samples that hold a correct one) checked by enumeration."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent_grpo.evaluation.heldout import pass_at, pass_at_curve


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (2, 1, 1, 0.5),  # one of two samples right: a single draw finds it half the time
        (2, 1, 2, 1.0),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3, 2) / C(5, 2)
        (5, 2, 1, 2 / 5),  # pass@1 is the success rate
        (8, 1, 4, 1 - 35 / 70),  # 1 - C(7, 4) / C(8, 4)
        (4, 0, 4, 0.0),
        (4, 4, 1, 1.0),
    ],
)
def test_hand_derived_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at(n, c, k) == pytest.approx(expected, abs=1e-12)


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n),
                                                     st.integers(1, n))))  # fmt: skip
def test_it_is_the_share_of_k_subsets_holding_a_correct_sample(nck: tuple[int, int, int]) -> None:
    n, c, k = nck
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    assert pass_at(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def test_the_curve_averages_tasks_up_to_the_fewest_samples() -> None:
    curve = pass_at_curve([(4, 1), (4, 0), (3, 3)])
    assert list(curve) == [1, 2, 3]  # the third task has 3 samples: pass@4 is not defined for it
    assert curve[1] == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert pass_at(4, 1, 3) == pytest.approx(1 - 1 / 4)  # 1 - C(3, 3) / C(4, 3)
    assert curve[3] == pytest.approx((3 / 4 + 0 + 1) / 3)
    assert pass_at_curve([]) == {}
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at(3, 1, 4)
