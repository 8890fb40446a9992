"""The exact-gradient meter: a multi-turn task small enough to sum over every trajectory.

Each objective the project offers is a gradient estimator: sample groups, compute the loss with
the trainer's own functions (`group_advantages`, `loss_denominator`, `grpo_micro_batch_loss`),
take minus its gradient. Here the expected reward J(theta) and the KL to a reference are sums
over all 900 trajectories, so their exact gradients are known, and each estimator's bias is
measured against them instead of argued about (bench/bias.py writes the table,
tests/algo/test_bias.py asserts what theory says).

The task. Two prompts, each an episode of two turns. A turn is `STOP` alone, or an answer
token 0/1 followed by `STOP` (2 tokens) or by two more tokens of any kind (3 tokens). After turn
one the tool returns an observation o in {0, 1}, drawn with a probability that depends on turn
one's answer (a stochastic tool). Reward 1 when turn two's answer is o (prompt 0) or 1 - o
(prompt 1), else 0. A turn's later tokens change only its length, never the reward or what
comes after, so the exact gradient on their logits is 0 and any push an estimator gives them
is pure length bias.

The policy is tabular softmax logits over states: a state is what the policy conditions on when
it writes a token (the prompt, turn one's answer, o, the current turn's answer, the position),
never a turn's later tokens, which is what keeps length out of the reward. Prompt 1 starts
biased towards answering `STOP`, so its reward variance is lower than prompt 0's: the case std
scaling reweights.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from agent_grpo.algo.config import AlgoConfig
from agent_grpo.algo.grpo import KLKind, group_advantages, kl_penalty
from agent_grpo.algo.objective import grpo_micro_batch_loss, loss_denominator
from agent_grpo.algo.turn_credit import turn_advantages

__all__ = [
    "STOP",
    "WIDTH",
    "Bias",
    "Estimate",
    "Failures",
    "Objective",
    "Task",
    "build_task",
    "estimate",
    "exact_kl_gradient",
    "exact_reward_gradient",
    "initial_logits",
    "kl_term_gradient",
    "measure",
    "nominal_scale",
    "stale_policy",
    "token_logprobs",
    "trajectory_probs",
]

STOP = 2
VOCAB = 3
TURNS = ((STOP,), *((x, STOP) for x in (0, 1)),
         *((x, y, z) for x in (0, 1) for y in (0, 1) for z in (0, 1, STOP)))  # fmt: skip
"""Every string one turn can be: `STOP` alone, or an answer 0/1 then `STOP` (2 tokens) or two
more tokens of any kind (3)."""
P_OBS_ONE = {0: 0.8, 1: 0.3, STOP: 0.5}
"""P(o = 1 | turn one's first token): the tool's randomness."""
WIDTH = 6
"""Most model tokens in an episode (two turns of three)."""


@dataclass(frozen=True)
class Task:
    """Every trajectory of both prompts, as padded tensors (`N` trajectories, `WIDTH` tokens)."""

    states: Tensor
    """`[N, WIDTH]` state index of each model token (0 on padding)."""
    tokens: Tensor
    """`[N, WIDTH]` token ids (0 on padding)."""
    mask: Tensor
    """`[N, WIDTH]` True on model tokens."""
    obs_prob: Tensor
    """`[N]` probability of the trajectory's observation given its first turn."""
    reward: Tensor
    """`[N]` terminal reward, 0 or 1."""
    task: Tensor
    """`[N]` which prompt (0 or 1)."""
    length_states: Tensor
    """`[S]` True on the second-token states, where `STOP` ends a turn at 2 tokens and 0/1
    makes it 3: they set a turn's length and nothing else."""
    answer_correct: Tensor
    """`[S]` on turn two's second-token states: 1 where turn two's answer was right, -1 where
    wrong; 0 on every other state."""
    answer_states: Tensor
    """`[S]` True on turn two's first-token states (the answer)."""
    state_task: Tensor
    """`[S]` the prompt each state belongs to."""
    turn_one_tokens: Tensor
    """`[N]` how many tokens turn one has (turn two's start)."""
    turn_two_state: Tensor
    """`[N]` the state turn two starts from (prompt, turn one's answer, o): turn-level
    credit's anchor state, as the state index of turn two's first token."""
    num_states: int
    """S, the rows of the logit table."""


def build_task() -> Task:
    """Enumerate both prompts' trajectories and the state table."""
    index: dict[tuple[int, ...], int] = {}
    signs: list[int] = []  # per state: +1 / -1 after a right / wrong answer (length states)

    def state(key: tuple[int, ...], sign: int = 0) -> int:
        if key not in index:
            index[key] = len(index)
            signs.append(sign)
        return index[key]

    rows = []
    for task, first, obs, second in itertools.product((0, 1), TURNS, (0, 1), TURNS):
        correct = second[0] == (obs if task == 0 else 1 - obs)
        # what the policy sees at each token: never an earlier second or third token
        contexts = [(task,), (task, first[0], obs)]
        keys = [
            state((3 * turn + pos, *contexts[turn], *words[:1] * (pos > 0)),
                  sign=(1 if correct else -1) if (turn, pos) == (1, 1) else 0)
            for turn, words in enumerate((first, second))
            for pos in range(len(words))
        ]  # fmt: skip
        p_one = P_OBS_ONE[first[0]]
        rows.append((keys, [*first, *second], p_one if obs == 1 else 1 - p_one, float(correct),
                     task, len(first)))  # fmt: skip
    n = len(rows)
    states = torch.zeros(n, WIDTH, dtype=torch.long)
    tokens = torch.zeros(n, WIDTH, dtype=torch.long)
    mask = torch.zeros(n, WIDTH, dtype=torch.bool)
    for i, (keys, ids, *_) in enumerate(rows):
        states[i, : len(keys)] = torch.tensor(keys)
        tokens[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = True
    return Task(
        states=states,
        tokens=tokens,
        mask=mask,
        obs_prob=torch.tensor([r[2] for r in rows], dtype=torch.float64),
        reward=torch.tensor([r[3] for r in rows], dtype=torch.float64),
        task=torch.tensor([r[4] for r in rows]),
        length_states=torch.tensor([key[0] % 3 == 1 for key in index]),
        answer_correct=torch.tensor(signs, dtype=torch.float64),
        answer_states=torch.tensor([key[0] == 3 for key in index]),
        state_task=torch.tensor([key[1] for key in index]),
        turn_one_tokens=torch.tensor([r[5] for r in rows]),
        turn_two_state=torch.stack([states[i, r[5]] for i, r in enumerate(rows)]),
        num_states=len(index),
    )


def initial_logits(task: Task, seed: int = 0) -> Tensor:
    """`[S, VOCAB]` float64 logits: small random ones, task 1's answers biased towards `STOP`."""
    g = torch.Generator().manual_seed(seed)
    logits = 0.5 * torch.randn(task.num_states, VOCAB, generator=g, dtype=torch.float64)
    logits[task.answer_states & (task.state_task == 1), STOP] += 2.0
    return logits


def token_logprobs(logits: Tensor, task: Task) -> Tensor:
    """`[N, WIDTH]` log pi of every trajectory's tokens (0 on padding)."""
    table = torch.log_softmax(logits, dim=-1)  # [S, V]
    return torch.where(task.mask, table[task.states, task.tokens], 0.0)  # [N, WIDTH]


def trajectory_probs(logits: Tensor, task: Task) -> Tensor:
    """`[N]` probability of each trajectory given its prompt (policy times tool)."""
    return torch.exp(token_logprobs(logits, task).sum(-1)) * task.obs_prob


def exact_reward_gradient(logits: Tensor, task: Task) -> Tensor:
    """`[S, VOCAB]` gradient of J = mean over prompts of E[reward]."""
    theta = logits.detach().clone().requires_grad_()
    j = (trajectory_probs(theta, task) * task.reward).sum() / 2  # two prompts, equally likely
    (grad,) = torch.autograd.grad(j, theta)
    return grad


def exact_kl_gradient(logits: Tensor, ref_logits: Tensor, task: Task) -> Tensor:
    """`[S, VOCAB]` gradient of KL(pi || pi_ref) over whole trajectories, mean over prompts."""
    theta = logits.detach().clone().requires_grad_()
    log_ratio = (token_logprobs(theta, task) - token_logprobs(ref_logits, task)).sum(-1)  # [N]
    kl = (trajectory_probs(theta, task) * log_ratio).sum() / 2  # the tool's probabilities cancel
    (grad,) = torch.autograd.grad(kl, theta)
    return grad


@dataclass(frozen=True)
class Failures:
    """Infrastructure failures: each episode fails with its own probability, and what then
    leaves the loss (`rollout.on_failure`)."""

    probability: Tensor
    """`[N]` the chance each trajectory fails."""
    on_failure: Literal["exclude", "drop_group"]
    """`exclude`: the failed episode alone; `drop_group`: its whole group."""

    def sample(self, rows: Tensor, group_size: int, g: torch.Generator) -> Tensor:
        """`[B]` True on the members that leave: failed ones, or their whole group."""
        failed = torch.rand(len(rows), generator=g, dtype=torch.float64) < self.probability[rows]
        if self.on_failure == "drop_group":
            failed = failed.view(-1, group_size).any(1).repeat_interleave(group_size)
        return failed


@dataclass(frozen=True)
class Estimate:
    """Many sampled batches' gradient estimates."""

    samples: Tensor
    """`[batches, S, VOCAB]` minus the gradient of the loss, one per batch."""

    @property
    def mean(self) -> Tensor:
        """`[S, VOCAB]` the mean estimate."""
        return self.samples.mean(0)

    def standard_error(self, weights: Tensor) -> float:
        """Standard error of `<mean, weights>`: how far it may sit from its expectation."""
        values = (self.samples * weights).sum((1, 2))  # [batches]
        return float(values.std() / math.sqrt(len(values)))

    def error_norm(self) -> float:
        """Root expected squared distance of `mean` from the estimator's expectation:
        sqrt(trace of the covariance / batches)."""
        spread = ((self.samples - self.mean) ** 2).sum((1, 2)).mean()
        return float(torch.sqrt(spread / (len(self.samples) - 1)))


def estimate(
    logits: Tensor,
    task: Task,
    algo: AlgoConfig,
    *,
    group_size: int,
    batches: int,
    seed: int = 0,
    behaviour: Tensor | None = None,
    ref_logits: Tensor | None = None,
    old: Literal["current", "behaviour"] = "current",
    failures: Failures | None = None,
) -> Estimate:
    """Sample `batches` batches of one group per prompt from `behaviour` (default: the policy)
    and take minus the gradient of the trainer's loss (`algo` as configured) for each.

    `old` is pi_old: `current` (this pass, ratio 1: what a single-pass trainer uses) or
    `behaviour` (the sampler's logprobs, `old_logprobs: sampler`). The loss's
    `sampler_logprobs` are always the behaviour policy's. `failures` fails episodes as an
    infrastructure failure would (`rollout.on_failure`). One thread: on tensors this small,
    OpenMP's start-up costs more than the work (docs/benchmarks.md, "The exact-gradient meter")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _estimate(logits, task, algo, group_size, batches, seed,
                         logits if behaviour is None else behaviour, ref_logits, old,
                         failures)  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _estimate(
    logits: Tensor,
    task: Task,
    algo: AlgoConfig,
    group_size: int,
    batches: int,
    seed: int,
    behaviour: Tensor,
    ref_logits: Tensor | None,
    old: str,
    failures: Failures | None,
) -> Estimate:
    g = torch.Generator().manual_seed(seed)
    probs = trajectory_probs(behaviour, task)  # [N]
    per_prompt = [torch.nonzero(task.task == t).squeeze(1) for t in (0, 1)]
    behaviour_lp = token_logprobs(behaviour, task)  # [N, WIDTH]
    ref_lp = None if ref_logits is None else token_logprobs(ref_logits, task)
    groups = torch.arange(2).repeat_interleave(group_size)  # [B]
    theta = logits.detach().clone().requires_grad_()
    samples = torch.empty(batches, *logits.shape, dtype=logits.dtype)
    for n in range(batches):
        rows = torch.cat([ids[torch.multinomial(probs[ids], group_size, True, generator=g)]
                          for ids in per_prompt])  # fmt: skip  # [B]
        counted = torch.ones(len(rows), dtype=torch.bool)  # [B]
        if failures is not None:
            counted = ~failures.sample(rows, group_size, g)  # [B]
        # the trainer's rules (algo/groups.py): a failed member leaves its group's statistics
        # (advantage 0) and the loss
        adv = group_advantages(task.reward[rows], groups, valid=counted,
                               scale=algo.advantage_scale,
                               leave_one_out=algo.leave_one_out)  # fmt: skip  # [B]
        if algo.turn_credit is not None:
            adv = _turn_credit(adv, rows, groups, counted, task, algo)  # [B, T]
        mask = task.mask[rows] & counted[:, None]  # [B, T]
        out = grpo_micro_batch_loss(
            token_logprobs(theta, task)[rows],
            None if old == "current" else behaviour_lp[rows],
            None if ref_lp is None else ref_lp[rows],
            behaviour_lp[rows],
            adv,
            mask,
            algo,
            max_tokens=WIDTH,
            denominator=float(max(loss_denominator(mask, algo, WIDTH), 1)),
        )
        (samples[n],) = torch.autograd.grad(-out.loss, theta)
    return Estimate(samples=samples)


def _turn_credit(
    episode: Tensor, rows: Tensor, groups: Tensor, counted: Tensor, task: Task, algo: AlgoConfig
) -> Tensor:
    """`[B, WIDTH]` per-token advantages under `algo.turn_credit` (the trainer's
    `turn_advantages`): turn one's step group is its prompt's, turn two's its anchor state."""
    credit = algo.turn_credit
    assert credit is not None
    b = len(rows)
    step_groups = torch.stack([-1 - groups, task.turn_two_state[rows]], dim=1)  # [B, 2]
    per_turn = turn_advantages(
        episode, task.reward[rows], torch.zeros(b, 2, dtype=torch.float64),
        torch.full((b,), 2), step_groups, groups, valid=counted, weight=credit.weight,
        discount=credit.discount, scale=algo.advantage_scale, leave_one_out=algo.leave_one_out,
    )  # fmt: skip  # [B, 2]
    second = torch.arange(WIDTH)[None, :] >= task.turn_one_tokens[rows][:, None]  # [B, WIDTH]
    return torch.where(second, per_turn[:, 1:], per_turn[:, :1]).to(torch.float32)  # [B, WIDTH]


def kl_term_gradient(logits: Tensor, ref_logits: Tensor, task: Task, kind: KLKind) -> Tensor:
    """`[S, VOCAB]` expected gradient of the per-token KL term `sum_t kl_t` as a loss (the
    trainer's, `kl_penalty`), summed exactly over trajectories: E_pi[sum_t grad k(t)] / 2."""
    theta = logits.detach().clone().requires_grad_()
    lp = token_logprobs(theta, task)
    per_token = torch.where(task.mask, kl_penalty(lp, token_logprobs(ref_logits, task), kind),
                            0.0)  # fmt: skip
    weights = trajectory_probs(logits, task).detach()  # sampled from pi: detached weights
    (grad,) = torch.autograd.grad((weights * per_token.sum(-1)).sum() / 2, theta)
    return grad


@dataclass(frozen=True)
class Objective:
    """One row of the meter: a trainer config and the samples it trains on."""

    name: str
    """Row label."""
    algo: AlgoConfig
    """The trainer's algorithm config, as a user would write it."""
    staleness: int = 0
    """Policy versions between the sampler and the trainer (`STALE_STEP` each)."""
    old: Literal["current", "behaviour"] = "current"
    """pi_old: the trainer's current policy or the sampler's (`old_logprobs: sampler`)."""
    failures: Failures | None = None
    """Episodes failing as infrastructure failures do; None: none fail."""


STALE_STEP = 0.5
"""How far one policy version moves: this length in logit space along the exact ascent."""


@dataclass(frozen=True)
class Bias:
    """What the meter reports for one objective (all relative to `|grad J|`)."""

    cosine: float
    """cos(mean estimate, grad J): 1 is an unbiased direction."""
    coefficient: float
    """<scale * mean, grad J> / |grad J|^2: 1 is the right size (`scale` the nominal normaliser,
    `nominal_scale`)."""
    rel_error: float
    """|scale * mean - grad J| / |grad J|: bias plus the remaining sampling error."""
    standard_error: float
    """The sampling error `rel_error` carries: scale * sqrt(trace Cov / batches) / |grad J|."""
    rel_std: float
    """One batch's spread: scale * sqrt(trace Cov) / |grad J| (the estimator's variance)."""
    length_push: float
    """Push on `STOP` after a right answer minus after a wrong one, scaled as `coefficient`:
    positive is the length bias the Dr. GRPO paper describes (short when right, long when
    wrong); grad J has 0 there."""
    length_push_se: float
    """Standard error of `length_push`."""
    prompt_coefficients: tuple[float, float]
    """`coefficient` of each prompt's block alone (prompt 1 has the lower reward variance)."""


def nominal_scale(algo: AlgoConfig, task: Task, behaviour: Tensor) -> float:
    """The constant that turns the loss's normaliser into a per-episode one: `max_tokens` for
    `seq-mean-token-sum-norm`, the expected episode length for `token-mean`, and its harmonic
    counterpart 1 / E[1 / length] for `seq-mean-token-mean` (expectations under the sampler);
    divided by 1 + omega under turn-level credit, whose advantage sums two estimates."""
    share = 1.0 if algo.turn_credit is None else 1.0 / (1.0 + algo.turn_credit.weight)
    if algo.aggregation == "seq-mean-token-sum-norm":
        return share * WIDTH
    probs = trajectory_probs(behaviour, task) / 2  # [N], both prompts
    length = task.mask.sum(-1).to(probs.dtype)  # [N]
    if algo.aggregation == "token-mean":
        return share * float((probs * length).sum())
    return share * float(1 / (probs / length).sum())


def stale_policy(logits: Tensor, task: Task, staleness: int) -> Tensor:
    """The policy `staleness` versions back: `STALE_STEP` per version against the exact ascent."""
    if staleness == 0:
        return logits
    grad = exact_reward_gradient(logits, task)
    return logits - staleness * STALE_STEP * grad / grad.norm()


def measure(
    objective: Objective,
    task: Task,
    logits: Tensor,
    *,
    batches: int,
    group_size: int = 4,
    seed: int = 0,
) -> Bias:
    """Sample `objective`'s estimator `batches` times and compare it with grad J."""
    behaviour = stale_policy(logits, task, objective.staleness)
    got = estimate(logits, task, objective.algo, group_size=group_size, batches=batches,
                   seed=seed, behaviour=behaviour, old=objective.old,
                   failures=objective.failures)  # fmt: skip
    exact = exact_reward_gradient(logits, task)  # [S, V]
    scale = nominal_scale(objective.algo, task, behaviour)
    mean = scale * got.mean  # [S, V]
    norm = float(exact.norm())
    spread = got.error_norm() * math.sqrt(len(got.samples))
    push = torch.zeros_like(exact)
    push[:, STOP] = task.answer_correct  # +1 after a right answer, -1 after a wrong one
    blocks = [(task.state_task == p)[:, None].to(exact.dtype) for p in (0, 1)]
    return Bias(
        cosine=float((mean * exact).sum() / (mean.norm() * norm)),
        coefficient=float((mean * exact).sum()) / norm**2,
        rel_error=float((mean - exact).norm()) / norm,
        standard_error=scale * got.error_norm() / norm,
        rel_std=scale * spread / norm,
        length_push=float((mean * push).sum()) / norm,
        length_push_se=scale * got.standard_error(push) / norm,
        prompt_coefficients=(
            float((mean * exact * blocks[0]).sum() / ((exact * blocks[0]) ** 2).sum()),
            float((mean * exact * blocks[1]).sum() / ((exact * blocks[1]) ** 2).sum()),
        ),
    )
