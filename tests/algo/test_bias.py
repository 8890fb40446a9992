"""What theory says of each objective's gradient, checked against the exact gradient.

`agent_grpo.testing.bias_meter` sums over every trajectory of a small two-turn task with a
stochastic tool; each estimate here runs the trainer's own advantage and loss functions on
sampled groups. Every bound is `Z` standard errors computed from the samples themselves, so a
sign error, a misaligned advantage or a wrong normaliser anywhere in the pipeline fails them,
while the seed only fixes which samples are drawn.
"""

from __future__ import annotations

import pytest
import torch

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.testing.bias_meter import (
    WIDTH,
    Failures,
    Objective,
    build_task,
    estimate,
    exact_kl_gradient,
    exact_reward_gradient,
    initial_logits,
    kl_term_gradient,
    measure,
    nominal_scale,
    trajectory_probs,
)

TASK = build_task()
LOGITS = initial_logits(TASK)
SUM_NORM = "seq-mean-token-sum-norm"
pytestmark = pytest.mark.slow  # many sampled batches: out of `make test-fast`
Z = 4.0
"""Standard errors a bound allows: 4 leaves a chance below 1e-4 for one scalar."""


def test_the_exact_gradient_is_a_sum_over_every_trajectory() -> None:
    probs = trajectory_probs(LOGITS, TASK)
    for prompt in (0, 1):
        assert abs(float(probs[TASK.task == prompt].sum()) - 1.0) < 1e-12
    grad = exact_reward_gradient(LOGITS, TASK)
    # a turn's later tokens never change the reward: exactly no gradient on their logits
    assert float(grad[TASK.length_states].abs().max()) < 1e-15
    # central differences on the answer logits agree
    for state in torch.nonzero(TASK.answer_states).squeeze(1)[:3].tolist():
        for token in range(3):
            step = torch.zeros_like(LOGITS)
            step[state, token] = 1e-6
            up = float((trajectory_probs(LOGITS + step, TASK) * TASK.reward).sum() / 2)
            down = float((trajectory_probs(LOGITS - step, TASK) * TASK.reward).sum() / 2)
            assert abs((up - down) / 2e-6 - float(grad[state, token])) < 1e-8


def test_rloo_on_policy_is_unbiased() -> None:
    rloo = measure(Objective("rloo", AlgoConfig(leave_one_out=True, aggregation=SUM_NORM)),
                   TASK, LOGITS, batches=6000)  # fmt: skip
    assert rloo.rel_error <= Z * rloo.standard_error
    assert rloo.standard_error < 0.05  # enough samples to reject a 25% shrinkage


def test_the_group_mean_baseline_shrinks_the_gradient_by_g_minus_one_over_g() -> None:
    # b_i = mean of the group includes r_i: E[A_i grad log p_i] = (G - 1) / G * grad J.
    for g in (4, 16):
        mean = measure(Objective("mean", AlgoConfig(scale="none", aggregation=SUM_NORM)),
                       TASK, LOGITS, batches=3000, group_size=g)  # fmt: skip
        assert abs(mean.coefficient - (g - 1) / g) <= Z * mean.standard_error
        assert mean.cosine > 0.99


def _prompt_weights(algo: AlgoConfig, group_size: int) -> tuple[float, float]:
    """Prompt 1's coefficient minus prompt 0's, and its standard error."""
    got = estimate(LOGITS, TASK, algo, group_size=group_size, batches=1500)
    exact = exact_reward_gradient(LOGITS, TASK)
    blocks = [(TASK.state_task == p)[:, None].to(exact.dtype) * exact for p in (0, 1)]
    contrast = blocks[1] / (blocks[1] ** 2).sum() - blocks[0] / (blocks[0] ** 2).sum()
    scale = nominal_scale(algo, TASK, LOGITS)
    return scale * float((got.mean * contrast).sum()), scale * got.standard_error(contrast)


def test_std_scaling_weights_the_low_variance_prompt_more() -> None:
    # Dr. GRPO's finding: dividing by the group's std up-weights prompts whose rewards vary
    # little. Prompt 1 succeeds 15% of the time, prompt 0 40%; groups of 16.
    diff, se = _prompt_weights(AlgoConfig(aggregation=SUM_NORM), 16)
    assert diff > Z * se
    diff, se = _prompt_weights(AlgoConfig(scale="none", aggregation=SUM_NORM), 16)
    assert abs(diff) <= Z * se


def test_per_sequence_token_means_shorten_right_answers_and_lengthen_wrong_ones() -> None:
    # DeepSeekMath's 1/|o_i| (seq-mean-token-mean): the length bias of the Dr. GRPO paper.
    # The exact gradient never pushes a turn's length; the per-episode sum (Dr. GRPO) does not
    # either, and DAPO's token-mean shows no push measurable at this size.
    for aggregation, biased in (("seq-mean-token-mean", True), (SUM_NORM, False),
                                ("token-mean", False)):  # fmt: skip
        algo = AlgoConfig(scale="none", aggregation=aggregation)
        got = measure(Objective(aggregation, algo), TASK, LOGITS, batches=3000)
        if biased:
            assert got.length_push > Z * got.length_push_se
        else:
            assert abs(got.length_push) <= Z * got.length_push_se


def test_the_decoupled_objective_undoes_the_staleness_bias_of_plain_ppo_clip() -> None:
    # Samples 2 versions old. Plain PPO-clip (pi_old = the sampler) clips the ratio to the
    # sampler and loses most of the gradient; the decoupled objective (pi_old = the trainer,
    # sampler mismatch reweighted) recovers it: per token nearly, with the sequence's whole
    # importance ratio exactly (an unbiased estimator).
    rloo = {"leave_one_out": True, "aggregation": SUM_NORM}
    plain = measure(Objective("plain", AlgoConfig(old_logprobs="sampler", **rloo), staleness=2,
                              old="behaviour"), TASK, LOGITS, batches=3000)  # fmt: skip
    token = measure(Objective("token", AlgoConfig(tis_cap=1e9, **rloo), staleness=2),
                    TASK, LOGITS, batches=3000)  # fmt: skip
    whole = {"low": 1e-9, "high": 1e9, "level": "sequence"}
    sequence = measure(Objective("sequence", AlgoConfig(mask=whole, **rloo), staleness=2),
                       TASK, LOGITS, batches=3000)  # fmt: skip
    assert plain.rel_error > 0.5 > Z * plain.standard_error
    assert token.rel_error + Z * token.standard_error < plain.rel_error
    assert sequence.rel_error <= Z * sequence.standard_error


def test_the_trainers_kl_term_has_the_per_token_gradient_not_the_episodes() -> None:
    # The same samples with and without beta: the difference is the KL term alone, and its mean
    # is beta / L times the per-token KL's expected gradient (exact, by enumeration).
    ref = initial_logits(TASK, seed=1)
    algo = {"leave_one_out": True, "aggregation": SUM_NORM, "kl": "k2"}
    with_kl = estimate(LOGITS, TASK, AlgoConfig(beta=0.5, **algo), group_size=4, batches=2000,
                       ref_logits=ref)  # fmt: skip
    without = estimate(LOGITS, TASK, AlgoConfig(**algo), group_size=4, batches=2000,
                       ref_logits=ref)  # fmt: skip
    kl_part = with_kl.samples - without.samples  # [batches, S, V]
    expected = -0.5 / WIDTH * kl_term_gradient(LOGITS, ref, TASK, "k2")
    spread = ((kl_part - kl_part.mean(0)) ** 2).sum((1, 2)).mean().sqrt() / len(kl_part) ** 0.5
    assert float((kl_part.mean(0) - expected).norm()) <= Z * float(spread)
    # which is not the gradient of the episode's KL: each token's effect on later tokens' KL
    # is missing (cosine 0.97 here); k1 as a loss has no expected gradient at all
    exact = exact_kl_gradient(LOGITS, ref, TASK)
    k2 = kl_term_gradient(LOGITS, ref, TASK, "k2")
    assert float((k2 * exact).sum() / (k2.norm() * exact.norm())) < 0.99
    assert float(kl_term_gradient(LOGITS, ref, TASK, "k1").abs().max()) < 1e-14


def test_independent_failures_excluded_leave_rloo_unbiased() -> None:
    # A failure that has nothing to do with the episode: RLOO over the survivors is still the
    # gradient of the expected reward.
    fails = Failures(torch.full((len(TASK.reward),), 0.2, dtype=torch.float64), "exclude")
    rloo = AlgoConfig(leave_one_out=True, aggregation=SUM_NORM)
    got = measure(Objective("exclude", rloo, failures=fails), TASK, LOGITS, batches=3000)
    assert got.rel_error <= Z * got.standard_error


def test_dropping_groups_on_failure_weights_the_prompts_by_their_survival() -> None:
    # drop_group with failures at rate f: a group survives with s = (1 - f)^G. With one group
    # per prompt and the loss over surviving rows, a batch where one group survives gives its
    # prompt the whole step: E[g] = 2 s (1 - s / 2) * grad J (0.65 at f = 0.2, G = 4).
    fails = Failures(torch.full((len(TASK.reward),), 0.2, dtype=torch.float64), "drop_group")
    rloo = AlgoConfig(leave_one_out=True, aggregation=SUM_NORM)
    got = measure(Objective("drop", rloo, failures=fails), TASK, LOGITS, batches=3000)
    s = 0.8**4
    assert abs(got.coefficient - 2 * s * (1 - s / 2)) <= Z * got.standard_error
    assert got.cosine > 0.98


def test_turn_credit_with_leave_one_out_steps_is_unbiased() -> None:
    # A^E + omega A^S with baselines from other episodes only: (1 + omega) times the gradient
    algo = AlgoConfig(leave_one_out=True, aggregation=SUM_NORM, turn_credit={"weight": 1.0})  # type: ignore[arg-type]
    got = measure(Objective("rloo+steps", algo), TASK, LOGITS, batches=6000)
    assert got.rel_error <= Z * got.standard_error
    assert got.standard_error < 0.05


def test_gigpos_mean_step_baselines_shrink_the_step_as_theory_says() -> None:
    # A group's own member in its mean shrinks each state's term by (n - 1) / n <= 3/4 at groups
    # of 4, and a state seen once gets nothing: at most 3/4 of the gradient, for both parts
    algo = AlgoConfig(scale="none", aggregation=SUM_NORM, turn_credit={"weight": 1.0})  # type: ignore[arg-type]
    got = measure(Objective("gigpo", algo), TASK, LOGITS, batches=6000)
    assert got.coefficient <= 0.75 + Z * got.standard_error
    assert got.coefficient < 1 - Z * got.standard_error
