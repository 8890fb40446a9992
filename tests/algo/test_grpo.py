"""Golden tests for agent_grpo.algo.grpo: every expected number is derived by hand in a comment."""

from __future__ import annotations

import math

import pytest
import torch

from agent_grpo.algo.grpo import (
    group_advantages,
    kl_penalty,
    masked_mean,
    masked_sum,
    policy_loss,
    truncated_is_weights,
)

E = math.e
NAN, INF = float("nan"), float("inf")

# --- group_advantages -------------------------------------------------------------------------

# Two groups interleaved: id 7 holds rewards [1, 0, 0, 1], id 3 holds [0.5, 0.5, 0.5, 0.5].
REWARDS = torch.tensor([1.0, 0.5, 0.0, 0.5, 0.0, 0.5, 1.0, 0.5])
IDS = torch.tensor([7, 3, 7, 3, 7, 3, 7, 3])
# Group 7: mean 0.5, centered [+.5, -.5, -.5, +.5], unbiased var = 4 * 0.25 / 3 = 1/3.
STD7 = math.sqrt(1 / 3)
SIGN7 = torch.tensor([1.0, 0.0, -1.0, 0.0, -1.0, 0.0, 1.0, 0.0])  # group 3 is all-equal -> 0


def test_group_advantages_grpo_default() -> None:
    # A = +-0.5 / (sqrt(1/3) + 1e-6) = +-0.866025 (sqrt(3)/2, less a hair for eps).
    got = group_advantages(REWARDS, IDS)
    torch.testing.assert_close(got, SIGN7 * 0.5 / (STD7 + 1e-6))
    assert got[1::2].eq(0).all()  # exactly 0, not 0 / eps noise


def test_group_advantages_scale_none_is_centered_reward() -> None:
    # Dr. GRPO: no std division, A = r - mean = +-0.5.
    got = group_advantages(REWARDS, IDS, scale="none")
    torch.testing.assert_close(got, SIGN7 * 0.5)


def test_group_advantages_leave_one_out() -> None:
    # RLOO: r=1 -> 1 - mean(0, 0, 1) = 2/3; r=0 -> 0 - mean(1, 0, 1) = -2/3.
    got = group_advantages(REWARDS, IDS, scale="none", leave_one_out=True)
    torch.testing.assert_close(got, SIGN7 * 2 / 3)
    # Scaled by the whole group's std, when asked: (2/3) / sqrt(1/3) = 1.154701.
    got = group_advantages(REWARDS, IDS, leave_one_out=True, scale="group", eps=0.0)
    torch.testing.assert_close(got, SIGN7 * (2 / 3) / STD7)


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("scale", ["group", "none"])
def test_group_of_one_and_all_equal_are_exactly_zero(scale: str, leave_one_out: bool) -> None:
    # id 9 has one member; id 4 holds 0.1 three times (0.1 is inexact in binary, so a naive
    # mean leaves ~1e-17 residue that a std division would blow up to O(1)).
    rewards = torch.tensor([5.0, 0.1, 0.1, 0.1, 1.0, 0.0])
    ids = torch.tensor([9, 4, 4, 4, 2, 2])
    got = group_advantages(rewards, ids, scale=scale, leave_one_out=leave_one_out)  # type: ignore[arg-type]
    assert got[:4].eq(0).all()
    assert got[4] > 0 > got[5]


def test_group_ids_as_hashables_match_tensor_ids() -> None:
    names = ["b", "a", "b", "a", "b", "a", "b", "a"]
    torch.testing.assert_close(group_advantages(REWARDS, names), group_advantages(REWARDS, IDS))


def test_group_advantages_do_not_depend_on_batch_order() -> None:
    perm = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    got = group_advantages(REWARDS[perm], IDS[perm])
    torch.testing.assert_close(got, group_advantages(REWARDS, IDS)[perm])


# --- kl_penalty and masked reductions --------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # logp = log 0.5, logp_ref = log 0.25: d = logp_ref - logp = -log 2.
        # k1 = log 2 = 0.693147; k2 = (log 2)^2 / 2 = 0.240227; k3 = 0.5 + log 2 - 1 = 0.193147.
        # logp = 0, logp_ref = 1: d = 1. k1 = -1; k2 = 0.5; k3 = e - 1 - 1 = 0.718282.
        ("k1", [math.log(2), -1.0]),
        ("k2", [math.log(2) ** 2 / 2, 0.5]),
        ("k3", [0.5 + math.log(2) - 1, E - 2]),
    ],
)
def test_kl_estimators(kind: str, expected: list[float]) -> None:
    logp = torch.tensor([math.log(0.5), 0.0])
    ref = torch.tensor([math.log(0.25), 1.0])
    torch.testing.assert_close(kl_penalty(logp, ref, kind), torch.tensor(expected))  # type: ignore[arg-type]


def test_masked_reductions_ignore_nan_and_inf() -> None:
    values = torch.tensor([[1.0, NAN, 3.0], [INF, 2.0, -INF]])
    mask = torch.tensor([[True, False, True], [False, True, False]])
    assert masked_sum(values, mask).item() == 6.0
    assert masked_mean(values, mask).item() == 2.0
    torch.testing.assert_close(masked_mean(values, mask, dim=-1), torch.tensor([2.0, 2.0]))
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0  # empty -> 0, not NaN


# --- policy_loss -----------------------------------------------------------------------------

# Three sequences, T = 4. Row 0: prompt, 2 model tokens, observation; A = +1.
# Row 1: prompt, 3 model tokens; A = -1. Row 2: no model token at all (excluded by seq-mean).
MASK = torch.tensor(
    [[False, True, True, False], [False, True, True, True], [False, False, False, False]]
)
ADV = torch.tensor([1.0, -1.0, 0.0])
# log rho on the model tokens: row 0 [1, log .5], row 1 [1, log .5, 0] -> rho [e, .5], [e, .5, 1].
LOG_RATIO = torch.tensor(
    [[0.0, 1.0, math.log(0.5), 0.0], [0.0, 1.0, math.log(0.5), 0.0], [0.0] * 4]
)
OLD = torch.full((3, 4), math.log(0.25))
# Per-token loss -min(rho*A, clip(rho, .8, 1.2)*A):
#   row 0 (A=+1): rho=e -> -min(e, 1.2) = -1.2 (clipped high); rho=.5 -> -min(.5, .8) = -0.5
#   row 1 (A=-1): rho=e -> -min(-e, -1.2) = e; rho=.5 -> -min(-.5, -.8) = 0.8 (clipped low);
#                 rho=1 -> 1
# Sum = -1.7 + e + 1.8 = e + 0.1 over 5 tokens.
TOKEN_SUM = E + 0.1


def _junk(clean: torch.Tensor) -> torch.Tensor:
    """Fill every masked-out position with NaN/inf/huge values."""
    junk = torch.tensor([NAN, INF, -INF, 1e30]).repeat(3)[: clean.numel()].view_as(clean)
    return torch.where(MASK, clean, junk)


def _inputs(requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    logprobs = _junk(OLD + LOG_RATIO).requires_grad_(requires_grad)
    return logprobs, _junk(OLD)


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token-mean", TOKEN_SUM / 5),  # (e + 0.1) / 5 = 0.563656
        # row means: -1.7/2 = -0.85 and (e + 1.8)/3 = 1.506094; mean 0.328047 (row 2 excluded)
        ("seq-mean-token-mean", (-0.85 + (E + 1.8) / 3) / 2),
        ("seq-mean-token-sum-norm", TOKEN_SUM / (2 * 4)),  # sum / (rows trained * L) = 0.352285
    ],
)
def test_policy_loss_aggregations(aggregation: str, expected: float) -> None:
    logprobs, old = _inputs()
    loss, _ = policy_loss(logprobs, old, ADV, MASK, aggregation=aggregation, max_tokens=4)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_policy_loss_per_token_advantages_with_junk() -> None:
    logprobs, old = _inputs()
    advantages = _junk(ADV[:, None].expand(3, 4))  # [B, T], junk outside the mask
    loss, _ = policy_loss(logprobs, old, advantages, MASK)
    assert loss.item() == pytest.approx(TOKEN_SUM / 5, rel=1e-6)


def test_policy_loss_clip_higher() -> None:
    # DAPO clip_high = 0.28: row 0's rho=e token now gives -1.28 instead of -1.2.
    logprobs, old = _inputs()
    loss, _ = policy_loss(logprobs, old, ADV, MASK, clip_high=0.28)
    assert loss.item() == pytest.approx((TOKEN_SUM - 0.08) / 5, rel=1e-6)


@pytest.mark.parametrize(("kind", "kl_per_token"), [("k1", -1.0), ("k2", 0.5), ("k3", E - 2)])
def test_policy_loss_kl_term(kind: str, kl_per_token: float) -> None:
    # ref = logprobs + 1 on model tokens, so d = ref - logp = 1 on each: k1=-1, k2=.5, k3=e-2.
    logprobs, old = _inputs()
    ref = _junk(OLD + LOG_RATIO + 1)
    loss, metrics = policy_loss(logprobs, old, ADV, MASK, ref_logprobs=ref, beta=0.1, kl=kind)  # type: ignore[arg-type]
    assert loss.item() == pytest.approx(TOKEN_SUM / 5 + 0.1 * kl_per_token, rel=1e-6)
    assert metrics.kl_ref == pytest.approx(E - 2, rel=1e-6)  # the logged value is always k3


def test_policy_loss_metrics() -> None:
    logprobs, old = _inputs()
    _, m = policy_loss(logprobs, old, ADV, MASK)
    # Clipped low (rho < .8, A < 0): row 1's rho=.5 token. Clipped high (rho > 1.2, A > 0): row
    # 0's rho=e token. Row 0's rho=.5 (A > 0) and row 1's rho=e (A < 0) still get a gradient.
    assert (m.clip_frac_low, m.clip_frac_high) == pytest.approx((0.2, 0.2))
    assert m.clip_frac == pytest.approx(0.4)
    # rho over the 5 tokens: [e, .5, e, .5, 1] -> mean (2e + 2) / 5 = 1.487313.
    assert m.ratio_mean == pytest.approx((2 * E + 2) / 5, rel=1e-6)
    assert (m.ratio_min, m.ratio_max) == pytest.approx((0.5, E))
    # k3(old vs new) = rho - log rho - 1: e - 2 twice, 0.5 + log 2 - 1 twice, 0 once.
    approx_kl = (2 * (E - 2) + 2 * (math.log(2) - 0.5)) / 5
    assert m.approx_kl_old == pytest.approx(approx_kl, rel=1e-6)
    assert m.num_tokens == 5 and m.kl_ref is None
    logged = m.as_dict()
    assert "kl_ref" not in logged and logged["num_tokens"] == 5.0
    assert all(math.isfinite(v) for v in logged.values())


def test_policy_loss_gradient_is_zero_on_masked_positions() -> None:
    logprobs, old = _inputs(requires_grad=True)
    loss, _ = policy_loss(logprobs, old, ADV, MASK, ref_logprobs=_junk(OLD), beta=0.0)
    loss.backward()
    grad = logprobs.grad
    assert grad is not None and torch.isfinite(grad).all()
    assert grad[~MASK].eq(0).all()
    # d/dlogp of -rho*A / 5 is -A*rho/5 where unclipped, 0 where the clipped term is taken:
    #   row 0: [0 (clipped), -0.5/5 = -0.1]; row 1: [e/5, 0 (clipped), 1/5].
    torch.testing.assert_close(grad[MASK], torch.tensor([0.0, -0.1, E / 5, 0.0, 0.2]))


def test_is_weights_scale_policy_term_only() -> None:
    # Weights on model tokens: row 0 [0.5, 2], row 1 [1, 1, 1]; junk elsewhere.
    # Row 0 becomes -1.2*0.5 - 0.5*2 = -1.6, so the sum is e + 1.8 - 1.6 = e + 0.2.
    logprobs, old = _inputs(requires_grad=True)
    weights = _junk(torch.tensor([[0, 0.5, 2, 0], [0, 1, 1, 1], [0, 0, 0, 0]]))
    loss, _ = policy_loss(logprobs, old, ADV, MASK, is_weights=weights)
    assert loss.item() == pytest.approx((E + 0.2) / 5, rel=1e-6)
    # With a KL term the weight does not touch it: + beta * (e - 2) per token, unweighted.
    ref = _junk(OLD + LOG_RATIO + 1)
    loss, _ = policy_loss(
        logprobs, old, ADV, MASK, is_weights=weights, ref_logprobs=ref, beta=0.1, kl="k3"
    )
    assert loss.item() == pytest.approx((E + 0.2) / 5 + 0.1 * (E - 2), rel=1e-6)


def test_denominator_makes_micro_batches_sum_to_the_batch_loss() -> None:
    logprobs, old = _inputs(requires_grad=True)
    full, _ = policy_loss(logprobs, old, ADV, MASK)
    (full_grad,) = torch.autograd.grad(full, logprobs)
    parts = [
        policy_loss(
            logprobs[i : i + 1], old[i : i + 1], ADV[i : i + 1], MASK[i : i + 1], denominator=5
        )[0]
        for i in range(3)
    ]
    total = torch.stack(parts).sum()
    (part_grad,) = torch.autograd.grad(total, logprobs)
    assert total.item() == pytest.approx(full.item(), rel=1e-6)
    torch.testing.assert_close(part_grad, full_grad)


def test_empty_batch_loss_is_zero_not_nan() -> None:
    logprobs, old = _inputs()
    none = torch.zeros_like(MASK)
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        loss, m = policy_loss(logprobs, old, ADV, none, aggregation=aggregation)
        assert loss.item() == 0.0 and m.num_tokens == 0 and m.ratio_mean == 1.0


def test_policy_loss_rejects_missing_arguments() -> None:
    logprobs, old = _inputs()
    with pytest.raises(ValueError, match="max_tokens"):
        policy_loss(logprobs, old, ADV, MASK, aggregation="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, ADV, MASK, beta=0.1)


# --- truncated_is_weights --------------------------------------------------------------------


def test_truncated_is_weights() -> None:
    # trainer - sampler = [log 2, log 0.5, log 10] -> [2, 0.5, min(10, 3) = 3]; masked -> 1.
    sampler = torch.tensor([[0.0, 0.0, 0.0, NAN]])
    trainer = torch.tensor([[math.log(2), math.log(0.5), math.log(10), 5.0]], requires_grad=True)
    mask = torch.tensor([[True, True, True, False]])
    got = truncated_is_weights(trainer, sampler, mask, cap=3.0)
    torch.testing.assert_close(got, torch.tensor([[2.0, 0.5, 3.0, 1.0]]))
    assert not got.requires_grad


# --- invalid members and precision -----------------------------------------------------------


def test_invalid_members_leave_the_group_statistics() -> None:
    # Group a: rewards [1, 0, NaN (invalid), 1 (invalid: an env error)]. Only [1, 0] count:
    # mean .5, centered [+.5, -.5], unbiased std sqrt(.5); A = +-.5 / sqrt(.5) = +-0.7071.
    # Group b: [1, inf, 0] with inf invalid -> [1, 0] as well. Group c: one valid member -> 0.
    rewards = torch.tensor([1.0, 0.0, NAN, 1.0, 1.0, INF, 0.0, 5.0, 3.0])
    ids = ["a", "a", "a", "a", "b", "b", "b", "c", "c"]
    valid = torch.tensor([True, True, True, False, True, True, True, True, False])
    got = group_advantages(rewards, ids, valid=valid, eps=0.0)
    a = 0.5 / math.sqrt(0.5)
    want = torch.tensor([a, -a, 0.0, 0.0, a, 0.0, -a, 0.0, 0.0])
    torch.testing.assert_close(got, want)
    assert torch.isfinite(got).all()


def test_large_close_rewards_keep_their_order() -> None:
    # float32 rounds 1000.0001, 1000.0002, 1000.0003 to 1000.00006, 1000.00018, 1000.0003
    # (steps of 6.1e-5): built in float64 they are [-1, 0, 1] after the std division.
    rewards = torch.tensor([1000.0001, 1000.0002, 1000.0003], dtype=torch.float64)
    got = group_advantages(rewards, [0, 0, 0], eps=0.0)
    torch.testing.assert_close(got, torch.tensor([-1.0, 0.0, 1.0]), atol=1e-5, rtol=0)


def test_rloo_as_published_is_unscaled() -> None:
    # r = [1, 0, 0, 1]: r_i - mean(others) = [1 - 1/3, 0 - 2/3, 0 - 2/3, 1 - 1/3].
    got = group_advantages(
        torch.tensor([1.0, 0.0, 0.0, 1.0]), [0] * 4, scale="none", leave_one_out=True
    )
    torch.testing.assert_close(got, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


# --- the KL term's gradient -------------------------------------------------------------------


def _categorical() -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a 5-way policy (with grad) and the log-probabilities of a fixed reference."""
    theta = torch.tensor([0.3, -1.2, 0.8, 0.0, 2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([1.0, 0.2, -0.5, 0.4, 0.9], dtype=torch.float64), -1)
    return theta, ref


def _expected_loss_gradient(kind: str) -> torch.Tensor:
    """E_{y ~ pi}[grad_theta k(y)] with y held fixed (how the loss uses the estimator),
    computed exactly by summing over the 5 outcomes weighted by pi(y) (detached)."""
    theta, ref = _categorical()
    logp = torch.log_softmax(theta, -1)
    per_outcome = kl_penalty(logp, ref, kind)  # type: ignore[arg-type]
    (torch.softmax(theta, -1).detach() * per_outcome).sum().backward()
    assert theta.grad is not None
    return theta.grad


def _exact_gradient(forward: bool) -> torch.Tensor:
    """grad_theta of KL(pi || ref) (`forward`) or KL(ref || pi), in closed form via autograd."""
    theta, ref = _categorical()
    logp = torch.log_softmax(theta, -1)
    kl = (logp.exp() * (logp - ref)).sum() if forward else (ref.exp() * (ref - logp)).sum()
    kl.backward()
    assert theta.grad is not None
    return theta.grad


def test_k2_as_a_loss_has_the_gradient_of_kl_pi_to_ref() -> None:
    torch.testing.assert_close(_expected_loss_gradient("k2"), _exact_gradient(forward=True))


def test_k3_as_a_loss_has_the_gradient_of_the_reverse_kl() -> None:
    got = _expected_loss_gradient("k3")
    torch.testing.assert_close(got, _exact_gradient(forward=False))
    assert not torch.allclose(got, _exact_gradient(forward=True), atol=1e-3)


def test_k1_as_a_loss_has_zero_expected_gradient() -> None:
    torch.testing.assert_close(_expected_loss_gradient("k1"), torch.zeros(5, dtype=torch.float64))


def test_decoupled_ppo_loss_by_hand() -> None:
    # Two model tokens, A = 1. Sampler mu, proximal pi_prox (trainer before the update), current
    # pi_theta, as logprobs:
    #   token 0: mu -1.0, prox -0.5, theta -0.5 + ln 1.5 -> w = min(e^0.5, 1.2) = 1.2 (capped),
    #            rho = 1.5 -> clipped at 1.2 (A > 0): min(1.5, 1.2) * 1 = 1.2, l = -1.2 * 1.2
    #   token 1: mu -0.6, prox -0.7, theta -0.7 + ln 0.9 -> w = e^-0.1, rho = 0.9 (inside the
    #            clip): l = -e^-0.1 * 0.9
    # token-mean over the 2 tokens.
    mu = torch.tensor([[-1.0, -0.6]])
    prox = torch.tensor([[-0.5, -0.7]])
    theta = prox + torch.log(torch.tensor([[1.5, 0.9]]))
    mask = torch.tensor([[True, True]])
    weights = truncated_is_weights(prox, mu, mask, cap=1.2)
    torch.testing.assert_close(weights, torch.tensor([[1.2, math.exp(-0.1)]]))
    loss, metrics = policy_loss(theta, prox, torch.tensor([1.0]), mask, is_weights=weights)
    want = (-1.2 * 1.2 - math.exp(-0.1) * 0.9) / 2
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert metrics.clip_frac_high == 0.5  # token 0's ratio is past 1 + clip_high


def test_seq_mean_counts_an_episode_split_over_rows_once() -> None:
    # Rows 0 and 1 are two branches of one episode (3 trained tokens: 1, 2 and 3), row 2 another
    # episode (one token, 4). With ratio 1 the per-token loss is -A: sequence means 2 and 4.
    per_token = torch.tensor([[1.0, 2.0], [3.0, 0.0], [4.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False], [True, False]])
    zeros = torch.zeros(3, 2)
    loss, _ = policy_loss(
        zeros,
        zeros,
        -per_token,
        mask,
        aggregation="seq-mean-token-mean",
        sequence_tokens=torch.tensor([3, 3, 1]),
        denominator=2.0,
    )
    assert loss.item() == pytest.approx((2.0 + 4.0) / 2)
    # without `sequence_tokens` each row is a sequence: (1.5 + 3 + 4) / 3
    alone, _ = policy_loss(zeros, zeros, -per_token, mask, aggregation="seq-mean-token-mean")
    assert alone.item() == pytest.approx((1.5 + 3.0 + 4.0) / 3)
