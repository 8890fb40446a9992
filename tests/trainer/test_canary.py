"""The weight canary (trainer/canary.py): the gap by hand, the one-line errors, and an HF engine
whose push did not arrive caught against the trainer's own logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from agent_grpo.models.loading import load_model
from agent_grpo.rollout.backends.hf import HFBackend
from agent_grpo.rollout.sources import LocalRollouts
from agent_grpo.testing.cli_runs import metrics, tiny_train
from agent_grpo.testing.records import minimal_record
from agent_grpo.testing.reward_rules import reward_override
from agent_grpo.testing.tiny_model import build_tiny_model, lively
from agent_grpo.trainer.canary import (
    Canary,
    CanaryError,
    CanaryGap,
    EngineScore,
    canary_from_records,
    canary_gap,
    check_canary,
    check_engines,
    trainer_scores,
)
from agent_grpo.trainer.policy import LogprobModel
from agent_grpo.trajectory.record import Provenance

EVEN = reward_override("even", "even_tokens")
LOGPROB_ATOL = 64 * torch.finfo(torch.float32).eps * math.log(49152)
"""fp32 logprobs (at most about log V in size) from two code paths that reduce in other orders:
a few dozen ulps at most, on any CPU; a missed push moves them by orders of magnitude more."""


def test_gap_by_hand_ignores_unmasked_junk() -> None:
    engine = torch.tensor([[0.0, -1.0, -2.0, 99.0], [0.0, -0.5, math.nan, -3.0]])
    trainer = torch.tensor([[0.0, -1.5, -2.0, -99.0], [0.0, -0.25, 7.0, -2.0]])
    mask = torch.tensor([[False, True, True, False], [False, True, False, True]])
    gap = canary_gap(engine, trainer, mask)
    # masked gaps: 0.5, 0.0, 0.25, 1.0 -> max 1.0, mean 1.75 / 4
    assert gap == CanaryGap(max=1.0, mean=0.4375, tokens=4)


def test_nan_on_a_model_token_is_an_infinite_gap() -> None:
    gap = canary_gap(torch.tensor([[0.0, math.nan]]), torch.tensor([[0.0, -1.0]]),
                     torch.tensor([[False, True]]))  # fmt: skip
    assert gap.max == math.inf
    with pytest.raises(CanaryError):
        check_canary("engine 0", 4, 4, gap, 1e-3)


def test_no_model_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="no model tokens"):
        canary_gap(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool))


def test_stale_version_names_the_engine() -> None:
    ok = CanaryGap(max=0.0, mean=0.0, tokens=3)
    with pytest.raises(CanaryError) as caught:
        check_canary("engine 1 (ray actor on node X)", 3, 4, ok, 1e-3)
    assert str(caught.value) == (
        "engine 1 (ray actor on node X) holds policy version 3 after the push of version 4"
    )
    check_canary("engine 0", 4, 4, ok, 1e-3)  # the right version and no gap passes
    check_canary("engine 0", None, 4, ok, 1e-3)  # an engine that reports no version


def test_gap_above_the_bound_is_one_line() -> None:
    with pytest.raises(CanaryError) as caught:
        check_canary("engine 0", 4, 4, CanaryGap(max=0.83, mean=0.2, tokens=5), 1e-3)
    message = str(caught.value)
    assert "\n" not in message
    assert message == (
        "engine 0: canary logprobs differ from the trainer's by 0.2 on average (bound 0.001) "
        "after the push of version 4: the weights did not arrive"
    )


def _trainer_logprobs(model: torch.nn.Module, ids: list[list[int]], targets: list[list[bool]]):
    x, m = torch.tensor(ids), torch.tensor(targets)
    with torch.no_grad():
        return LogprobModel(model)(x, torch.ones_like(x), m, 1.0, False)  # [N, T]


def test_hf_score_equals_the_trainer_and_catches_a_push_that_did_not_arrive(tokenizer) -> None:
    policy = lively(build_tiny_model(tokenizer, seed=0)[0])
    engine = HFBackend(lively(build_tiny_model(tokenizer, seed=0)[0]), tokenizer)
    ids = [[5, 17, 300, 42, 7, 9], [11, 12, 13, 14, 15, 16]]
    targets = [[False, False, True, True, True, False], [False, True, True, True, True, True]]
    mask = torch.tensor(targets)

    scored = torch.tensor(engine.score(ids, targets, 1.0))  # [N, T]
    gap = canary_gap(scored, _trainer_logprobs(policy, ids, targets), mask)
    assert gap.max < LOGPROB_ATOL  # fp32 engine copy vs fp32 trainer
    check_canary("engine 0", 1, 1, gap, 1e-3)

    with torch.no_grad():  # an optimizer step the engine never received
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.update_weights = lambda model: None  # type: ignore[method-assign]
    engine.update_weights(policy)
    scored = torch.tensor(engine.score(ids, targets, 1.0))
    gap = canary_gap(scored, _trainer_logprobs(policy, ids, targets), mask)
    with pytest.raises(CanaryError, match="engine 0: canary logprobs differ"):
        check_canary("engine 0", 2, 2, gap, 1e-3)

    del engine.update_weights  # the real push: the gap closes again
    engine.update_weights(policy)
    scored = torch.tensor(engine.score(ids, targets, 1.0))
    assert canary_gap(scored, _trainer_logprobs(policy, ids, targets), mask).max < LOGPROB_ATOL


def _canary() -> Canary:
    return Canary(sequences=[[1, 2, 3], [4, 5]], targets=[[False, True, True], [False, True]])


def test_check_engines_keeps_the_pushed_scores_and_returns_the_worst_gap() -> None:
    canary = _canary()
    trainer = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]], dtype=torch.float64)
    near = EngineScore("engine 0", 1, [[0.0, -1.01, -2.0], [0.0, -0.5]])
    far = EngineScore("engine 1", 1, [[0.0, -1.0, -2.03], [0.0, -0.5]])
    worst = check_engines([near, far], canary, trainer, 1, 0.1)
    assert worst.mean == pytest.approx(0.01) and canary.last is trainer  # 0.03 / 3 tokens


def test_an_engine_that_did_not_follow_the_push_fails_below_the_bound() -> None:
    # The update moved the trainer's scores by 0.06 a token, under the 0.1 bound, and engine 1
    # (steadily 0.02 off, as other kernels are) stayed where it was: only the move tells.
    before = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]], dtype=torch.float64)
    offset = 0.02 * _canary().mask  # [N, T]
    after = before - 0.06 * _canary().mask  # [N, T]
    first = [EngineScore(f"engine {i}", 1, (before + offset).tolist()) for i in (0, 1)]
    fresh = EngineScore("engine 0", 2, (after + offset).tolist())
    stale = EngineScore("engine 1", 2, (before + offset).tolist())
    canary = _canary()
    check_engines(first, canary, before, 1, 0.1)
    with pytest.raises(CanaryError) as caught:
        check_engines([fresh, stale], canary, after, 2, 0.1)
    assert str(caught.value) == (
        "engine 1 did not follow the push of version 2: its canary logprobs moved 0 since the "
        "last check, the trainer's 0.06; the weights did not arrive"
    )
    canary = _canary()  # the same pushes, both engines following
    check_engines(first, canary, before, 1, 0.1)
    both = [fresh, EngineScore("engine 1", 2, fresh.logprobs)]
    assert check_engines(both, canary, after, 2, 0.1).mean == pytest.approx(0.02)


def test_the_canary_is_the_first_records_with_model_tokens() -> None:
    P, M = Provenance.PROMPT, Provenance.MODEL
    records = [minimal_record(index=0, token_ids=[1, 2], provenance=[P, P]),  # no model token
               minimal_record(index=1, token_ids=[3, 4, 5], provenance=[P, M, M]),
               minimal_record(index=2, token_ids=[6, 7], provenance=[P, M])]  # fmt: skip
    canary = canary_from_records(records, 1)
    assert canary.sequences == [[3, 4, 5]] and canary.targets == [[False, True, True]]
    assert canary_from_records(records, 5).sequences == [[3, 4, 5], [6, 7]]
    with pytest.raises(ValueError, match="no trajectory"):
        canary_from_records(records[:1], 2)


def test_trainer_scores_equal_the_trainers_logprob_model(tokenizer) -> None:
    policy = lively(build_tiny_model(tokenizer, seed=0)[0])
    canary = Canary([[5, 17, 300, 42], [11, 12, 13]], [[False, True, True, True],
                                                       [False, True, True]])  # fmt: skip
    got = trainer_scores(policy, canary)
    want = _trainer_logprobs(policy, [canary.sequences[0]], [canary.targets[0]])
    torch.testing.assert_close(got[0, 1:], want[0, 1:].double(), rtol=0, atol=LOGPROB_ATOL)
    assert got[1, 3] == 0.0  # padding


def test_a_run_checks_the_canary_every_n_pushes(tmp_path, tiny_model_dir) -> None:
    run = tiny_train(tmp_path, tiny_model_dir, "steps=3", "rollout.canary.every=2", EVEN)
    rows = metrics(run)
    assert [r["canary_gap"] is None for r in rows] == [True, False, True]  # pushes 1, 2, 3
    assert rows[1]["canary_gap"] == 0.0  # the hf engine samples from the trainer's weights
    # its cost is logged; no comparison of wall times (a GC pause in an unchecked step's
    # bookkeeping outlasted the tiny model's check once)
    assert rows[1]["canary_time_s"] > 0


def test_a_push_that_never_arrives_stops_the_run_naming_the_engine(
    tmp_path, tiny_model_dir, tokenizer, monkeypatch
) -> None:
    # An engine that kept the initial weights: the trainer's scores moved (lr 1e-4: less than
    # the 0.1 bound after one push), its did not; the second check sees it.
    frozen = HFBackend(load_model(tiny_model_dir), tokenizer)

    def stale_score(self, sequences, targets):
        return [EngineScore("the trainer's engine", None, frozen.score(sequences, targets, 1.0))]

    monkeypatch.setattr(LocalRollouts, "score_canary", stale_score)
    with pytest.raises(CanaryError, match="the trainer's engine did not follow the push of "
                                          "version 2"):  # fmt: skip
        tiny_train(tmp_path, tiny_model_dir, "steps=3", "rollout.canary={}", "algo.lr=1e-4",
                   EVEN)  # fmt: skip
