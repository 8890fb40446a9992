"""Sharded GRPO updates: N processes must take exactly the step one process takes.

`plain_update` below is the reference: one full-batch forward with `token_logprobs` (no
micro-batches, no shared prefix, no skipped rows), `policy_loss` over the whole batch, backward,
clip, SGD. `update.minibatch_update` must equal it in one process and, launched through
`tests/trainer/dist_worker.py` with torchrun (gloo, CPU, loopback only), on 2 processes. The
batch is built so the per-rank model-token counts are far apart (53 vs 16), which is what makes
a per-rank denominator visibly wrong. SGD, not AdamW: its update is linear in the gradient, so a
tolerance on parameters is a tolerance on gradients (Adam's first step is lr * sign(g)).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from agent_grpo import cli
from agent_grpo.algo.grpo import policy_loss, truncated_is_weights
from agent_grpo.algo.masking import masked_is_weights
from agent_grpo.algo.objective import loss_denominator
from agent_grpo.config.jobs import AlgoConfig
from agent_grpo.models.loading import load_model
from agent_grpo.models.logprobs import token_logprobs
from agent_grpo.testing.torchrun import run_torchrun
from agent_grpo.trainer import launch
from agent_grpo.trainer.batch import PackedBatch
from agent_grpo.trainer.parallel import (
    DistContext,
    global_max,
    global_sum,
    shard_rows,
    unwrap_policy,
    wrap_policy,
)
from agent_grpo.trainer.update import batch_logprobs, minibatch_update

WORKER = Path(__file__).with_name("dist_worker.py")
LENGTHS = [23, 9, 31, 14, 27, 6]
GROUPS = [0, 1, 0, 1, 2, 2]
"""Groups 0 and 2 (rows 0, 2, 4, 5) go to rank 0 of 2, group 1 (rows 1, 3: short) to rank 1."""
PROMPT = 5
"""Tokens of the prompt every member of a group shares (never trained on)."""


def make_case(model_dir: Path, **algo: Any) -> dict[str, Any]:
    """A global batch with junk (NaN) off the model tokens, and pi_old / pi_ref near the policy."""
    g = torch.Generator().manual_seed(0)
    rows, width = len(LENGTHS), max(LENGTHS)
    positions = torch.arange(width)[None]  # [1, T]
    attention = positions < torch.tensor(LENGTHS)[:, None]  # [B, T]
    ids = torch.randint(3, 49152, (rows, width), generator=g)  # [B, T]
    prompts = torch.randint(3, 49152, (max(GROUPS) + 1, PROMPT), generator=g)  # [G, P]
    ids[:, :PROMPT] = prompts[GROUPS]
    ids = torch.where(attention, ids, 2)  # [B, T]
    loss_mask = attention & (positions >= PROMPT) & (torch.rand(rows, width, generator=g) < 0.7)
    advantages = torch.randn(rows, generator=g)[:, None].repeat(1, width)  # [B, T]
    with torch.no_grad():
        logprobs = token_logprobs(load_model(model_dir), ids, attention.long())  # [B, T]

    def near(scale: float) -> torch.Tensor:
        noisy = logprobs + scale * torch.randn(rows, width, generator=g)  # [B, T]
        return torch.where(loss_mask, noisy, float("nan"))  # [B, T]

    batch = PackedBatch(
        input_ids=ids,
        attention_mask=attention.long(),
        loss_mask=loss_mask,
        sampler_logprobs=near(0.3),
        advantages=advantages,
        group_index=torch.tensor(GROUPS),
        episode_index=torch.arange(len(GROUPS)),
    )
    # micro_batch_tokens=48 gives rank 0 four micro-batches and rank 1 one; the first step's
    # grad norm is ~2, so clipping at 1 is active. TIS weights are exp(old - sampler) capped.
    settings = {"beta": 0.04, "max_grad_norm": 1.0, "tis_cap": 1.2,
                "speed": {"micro_batch_tokens": 48}}  # fmt: skip
    return {
        "batch": batch,
        "old": near(0.3),  # ratios exp(+-0.3): some tokens clipped, some not
        "ref": near(0.3),
        "algo": AlgoConfig(**(settings | algo)),
        "temperature": 1.0,
        "lr": 1.0,
        "steps": 2,
        "max_tokens": 40,
    }


COMPARED = ["loss", "grad_norm", "clip_frac_low", "clip_frac_high", "approx_kl_old", "kl_ref",
            "ratio_mean", "ratio_min", "ratio_max"]  # fmt: skip
"""The metrics `plain_update` computes too."""


def plain_update(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, case: dict[str, Any]
) -> tuple[dict[str, float], torch.Tensor]:
    """The reference step: the whole batch in one forward, loss and backward."""
    batch, algo = case["batch"], case["algo"]
    logprobs = token_logprobs(model, batch.input_ids, batch.attention_mask,
                              temperature=case["temperature"])  # fmt: skip  # [B, T]
    old = logprobs.detach() if case["old"] is None else case["old"]  # [B, T]
    weights = None
    if algo.tis_cap is not None:
        weights = truncated_is_weights(old, batch.sampler_logprobs, batch.loss_mask, algo.tis_cap)
    if algo.mask is not None:
        band = algo.mask
        weights = masked_is_weights(old, batch.sampler_logprobs, batch.loss_mask, band.low,
                                    band.high, band.level)  # fmt: skip
    loss, m = policy_loss(
        logprobs, old, batch.advantages, batch.loss_mask, ref_logprobs=case["ref"],
        clip_low=algo.clip_low, clip_high=algo.clip_high, beta=algo.beta, kl=algo.kl,
        aggregation=algo.aggregation, max_tokens=case["max_tokens"], is_weights=weights,
        ratio_level=algo.ratio, dual_clip_c=algo.dual_clip,
    )  # fmt: skip
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), algo.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = {"loss": float(loss.detach()), "grad_norm": float(norm), **m.as_dict()}
    seen = torch.where(batch.loss_mask, logprobs.detach(), float("nan"))  # [B, T]
    return {k: metrics.get(k) for k in COMPARED}, seen


def reference(case: dict[str, Any], model_dir: Path) -> dict[str, Any]:
    """`plain_update` for every step of the case, from the saved model."""
    policy = load_model(model_dir)
    optimizer = torch.optim.SGD(policy.parameters(), lr=case["lr"])
    history = []
    for _ in range(case["steps"]):
        metrics, seen = plain_update(policy, optimizer, case)
        history.append({**metrics, "seen": seen})
    return {"params": policy.state_dict(), "history": history}


FP32_EPS = torch.finfo(torch.float32).eps
METRIC_ATOL = 64 * FP32_EPS
"""Loss and metrics: sums of ~70 O(1) terms in another order (micro-batches, ranks) differ by
about sqrt(70) * eps; 64 eps leaves a margin of 8x."""
PARAM_ATOL = 1e-6
"""Parameters after 2 SGD steps of lr 1: the gradient of each weight is a sum over ~70 tokens
whose order changes; measured differences are below 2e-7 on AMD EPYC and Intel Xeon."""


def assert_same_history(
    got: list[dict[str, Any]], want: list[dict[str, Any]], batch: PackedBatch, atol: float
) -> None:
    """Every step's metrics (all keys) and trainer logprobs `seen` agree on model tokens.

    Elsewhere `seen` is 0 or NaN depending on which micro-batch a row was in: not compared.
    """
    # rows skipped for a zero advantage (beta = 0) are not scored: NaN there, and only there
    zero = ~((batch.advantages != 0) & batch.loss_mask).any(-1, keepdim=True)  # [B, 1]
    skipped = zero & (want[0]["kl_ref"] is None)  # [B, 1]
    trained = batch.loss_mask & ~skipped  # [B, T]
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.isnan(g["seen"][batch.loss_mask & skipped]).all()
        torch.testing.assert_close(
            g["seen"][trained], w["seen"][trained], rtol=1e-6, atol=atol, equal_nan=True
        )
        metrics = {k: g[k] for k in COMPARED if w[k] is not None}
        expected = {k: w[k] for k in COMPARED if w[k] is not None}
        assert (g["kl_ref"] is None) == (w["kl_ref"] is None)
        assert metrics == pytest.approx(expected, rel=1e-5, abs=atol), step


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over every parameter (same keys required)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# ---- single process ----------------------------------------------------------------------------


def test_shard_rows_deal_round_robin_and_cover_every_row_once():
    shards = [shard_rows(7, DistContext(rank=r, world_size=3)) for r in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]
    assert shard_rows(2, DistContext(rank=2, world_size=3)) == []
    assert shard_rows(5, DistContext()) == [0, 1, 2, 3, 4]


def test_shard_rows_keep_groups_whole_in_order_of_appearance():
    groups = torch.tensor([7, 3, 7, 9, 3, 1, 9])  # groups in order: 7, 3, 9, 1
    shards = [shard_rows(7, DistContext(rank=r, world_size=2), groups) for r in range(2)]
    assert shards == [[0, 2, 3, 6], [1, 4, 5]]  # rank 0: groups 7, 9; rank 1: groups 3, 1


def test_collectives_are_identity_in_one_process():
    x = torch.tensor([1.5, -2.0])
    assert torch.equal(global_sum(x, DistContext()), x)
    assert torch.equal(global_max(x, DistContext()), x)


END_RANK_SCRIPT = """
import atexit, pathlib, sys, threading, time
from agent_grpo.trainer.parallel import end_rank

out = pathlib.Path(sys.argv[1])


class TornDown:
    # `__del__` of a module global runs in the interpreter's teardown, which end_rank skips;
    # it holds what it needs itself, as the teardown clears the module's globals first
    def __init__(self, path: str) -> None:
        self.path = path

    def __del__(self, _open=open) -> None:
        with _open(self.path, "w") as f:
            f.write("ran")


def late_write() -> None:  # a non-daemon thread still working: a normal exit waits for it
    time.sleep(0.3)
    (out / "thread").write_text("ran")


kept = TornDown(str(out / "teardown"))
atexit.register(lambda: (out / "atexit").write_text("ran"))
threading.Thread(target=late_write).start()
sys.stdout.write("unflushed, no newline")
end_rank(3)
"""


@pytest.mark.slow
def test_end_rank_joins_threads_runs_atexit_and_flushes_then_skips_the_teardown(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout buffered
    done = subprocess.run(
        [sys.executable, "-c", END_RANK_SCRIPT, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed, no newline"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()
    plain = END_RANK_SCRIPT.replace("end_rank(3)", "sys.exit(3)")  # the same script, plain exit
    subprocess.run([sys.executable, "-c", plain, str(tmp_path)], timeout=120, check=False)
    assert (tmp_path / "teardown").read_text() == "ran"  # so the check above can fail


class Ended(Exception):
    """Raised by the stand-in for `end_rank`, which must not return."""


@pytest.fixture
def ended(monkeypatch: pytest.MonkeyPatch, cli_logging: None) -> list[int]:
    """The codes `end_rank` was called with, in place of ending the test process."""
    codes: list[int] = []

    def fake_end_rank(code: int) -> None:
        codes.append(code)
        raise Ended

    monkeypatch.setattr(launch, "end_rank", fake_end_rank)
    return codes


def test_the_cli_ends_a_torchrun_rank_with_the_train_status(ended, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(Ended):
        cli.main(["train", str(tmp_path / "missing.yaml")])  # a one-line config error: 2
    assert ended == [2]
    assert "does not exist" in capsys.readouterr().err

    def crash(args: object) -> int:
        raise RuntimeError("the rank failed")

    monkeypatch.setattr(cli, "_cmd_train", crash)
    with pytest.raises(Ended):
        cli.main(["train", "any.yaml"])
    assert ended == [2, 1]
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: the rank failed" in err


def test_the_cli_returns_outside_torchrun_and_for_other_commands(ended, monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.main(["train", str(tmp_path / "missing.yaml")]) == 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["envs"]) == 0
    assert ended == []


def test_loss_denominator_by_aggregation():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    batch = PackedBatch(
        input_ids=torch.zeros(3, 4, dtype=torch.long),
        attention_mask=torch.ones(3, 4, dtype=torch.long),
        loss_mask=mask,
        sampler_logprobs=torch.zeros(3, 4),
        advantages=torch.zeros(3, 4),
        group_index=torch.arange(3),
        episode_index=torch.arange(3),
    )
    mask = batch.loss_mask
    assert loss_denominator(mask, AlgoConfig(), 9) == 6
    assert loss_denominator(mask, AlgoConfig(aggregation="seq-mean-token-mean"), 9) == 2
    sum_norm = AlgoConfig(aggregation="seq-mean-token-sum-norm")
    assert loss_denominator(mask, sum_norm, 9) == 18  # 2 rows with a trained token x L = 9


def test_wrap_policy_refuses_modes_that_do_not_fit_the_world(tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match="ddp"):
        wrap_policy(model, "ddp", DistContext())
    with pytest.raises(ValueError, match="none"):
        wrap_policy(model, "none", DistContext(world_size=2))
    assert unwrap_policy(wrap_policy(model, "none", DistContext())) is model


def on_policy_case(model_dir: Path) -> dict[str, Any]:
    """beta = 0, no reference, pi_old = this forward pass, and one zero-advantage row."""
    case = make_case(model_dir, beta=0.0)
    case["batch"].advantages[1] = 0.0  # skipped: its loss is exactly 0 (skip_zero_advantage)
    return {**case, "old": None, "ref": None}


VARIANTS = {
    "token-mean": lambda d: make_case(d),
    "seq-mean-token-mean": lambda d: make_case(d, aggregation="seq-mean-token-mean"),
    "seq-mean-token-sum-norm": lambda d: make_case(d, aggregation="seq-mean-token-sum-norm"),
    "no-shared-prefix": lambda d: make_case(
        d, speed={"micro_batch_tokens": 48, "shared_prefix": False}
    ),
    "on-policy": on_policy_case,
    # ratios exp(+-0.3) around pi_old: c = 1.1 caps some negative-advantage tokens
    "dual-clip": lambda d: make_case(d, dual_clip=1.1),
    # GSPO: sequence ratios near 1, so its tight clip range is what makes some clip
    "gspo": lambda d: make_case(d, ratio="sequence", clip_low=0.02, clip_high=0.02),
    # pi_old - sampler ~ N(0, 0.42^2): IcePop's band keeps most tokens, [0.8, 1.25] drops many
    "mis-token": lambda d: make_case(d, tis_cap=None, mask={"low": 0.8, "high": 1.25}),
    "mis-sequence": lambda d: make_case(d, tis_cap=None, mask={"level": "sequence"}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_one_process_update_is_the_plain_update(tiny_model_dir, variant):
    case = VARIANTS[variant](tiny_model_dir)
    expected = reference(case, tiny_model_dir)
    model = load_model(tiny_model_dir)
    policy = wrap_policy(model, "none", DistContext())
    optimizer = torch.optim.SGD(policy.parameters(), lr=case["lr"])
    history = []
    for _ in range(case["steps"]):
        metrics, seen = minibatch_update(
            policy, optimizer, case["batch"], case["old"], case["ref"], case["algo"],
            case["temperature"], case["max_tokens"], DistContext(),
        )  # fmt: skip
        history.append({**metrics.model_dump(), "seen": seen})
    assert_same_history(history, expected["history"], case["batch"], atol=METRIC_ATOL)
    assert max_param_diff(model.state_dict(), expected["params"]) < PARAM_ATOL
    assert max_param_diff(model.state_dict(), load_model(tiny_model_dir).state_dict()) > 1e-2


# ---- two processes ------------------------------------------------------------------------------


def run_worker(case: dict[str, Any], model_dir: Path, tmp: Path, modes: list[str]) -> None:
    """Launch the worker on 2 CPU processes; both talk over 127.0.0.1 only."""
    torch.save(case, tmp / "case.pt")
    args = [str(WORKER), str(tmp / "case.pt"), str(model_dir), str(tmp), *modes]
    done = run_torchrun(args, dict(os.environ), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


MODES = ["ddp", "fsdp", "fsdp_one_row", "ddp_dead", "fsdp_dead", "ddp_seqmean", "fsdp_sumnorm",
         "naive", "score_ddp", "score_fsdp"]  # fmt: skip


def rank_tokens(batch: PackedBatch) -> list[float]:
    """Model tokens of each of 2 ranks' shares of `batch`."""
    rows = batch.input_ids.shape[0]
    shares = [shard_rows(rows, DistContext(r, 2), batch.group_index) for r in range(2)]
    return [float(batch.loss_mask[share].sum()) for share in shares]


@pytest.fixture(scope="module")
def two_process_results(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """One torchrun launch for every mode (start-up dominates the cost)."""
    tmp = tmp_path_factory.mktemp("dist")
    run_worker(make_case(tiny_model_dir), tiny_model_dir, tmp, MODES)
    return {m: torch.load(tmp / f"{m}.pt", weights_only=False) for m in MODES}


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> dict[str, Any]:
    """The one-process result on the whole case."""
    return reference(make_case(tiny_model_dir), tiny_model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_take_the_one_process_step(
    two_process_results, expected, tiny_model_dir, mode
):
    case = make_case(tiny_model_dir)
    got = two_process_results[mode]
    assert got["rank_tokens"] == rank_tokens(case["batch"])
    assert max(got["rank_tokens"]) > 2 * min(got["rank_tokens"])  # uneven on purpose
    assert got["sharded"] == (mode == "fsdp")
    assert expected["history"][0]["grad_norm"] > case["algo"].max_grad_norm  # clipping is active
    assert_same_history(got["history"], expected["history"], case["batch"], atol=METRIC_ATOL)
    assert max_param_diff(got["params"], expected["params"]) < PARAM_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_score_the_batch_like_one(two_process_results, tiny_model_dir, mode):
    """pi_old / pi_ref passes split over ranks equal `update.batch_logprobs` on model tokens."""
    case = make_case(tiny_model_dir)
    batch = case["batch"]
    model = wrap_policy(load_model(tiny_model_dir), "none", DistContext())
    want = batch_logprobs(model, batch, case["temperature"], case["algo"])
    assert want[batch.loss_mask].abs().min() > 0  # every model token really was scored
    for name, got in two_process_results[f"score_{mode}"].items():
        assert got.shape == want.shape, name
        torch.testing.assert_close(got[batch.loss_mask], want[batch.loss_mask], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_rank_without_rows_still_takes_the_step(two_process_results, tiny_model_dir):
    case = make_case(tiny_model_dir)
    batch = case["batch"].select([0])
    width = batch.input_ids.shape[1]
    single = {**case, "batch": batch, **{k: case[k][:1, :width] for k in ("old", "ref")}}
    want = reference(single, tiny_model_dir)
    got = two_process_results["fsdp_one_row"]
    assert got["rank_tokens"][1] == 0.0
    assert_same_history(got["history"], want["history"], single["batch"], atol=METRIC_ATOL)
    assert max_param_diff(got["params"], want["params"]) < PARAM_ATOL


@pytest.mark.slow
def test_per_rank_token_mean_takes_a_different_step(two_process_results, expected, tiny_model_dir):
    """The naive rule (each rank divides by its own tokens, DDP averages) is measurably off."""
    got = two_process_results["naive"]
    assert got["rank_tokens"] == rank_tokens(make_case(tiny_model_dir)["batch"])
    assert max_param_diff(got["params"], expected["params"]) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp_dead", "fsdp_dead"])
def test_a_step_without_any_trainable_row_keeps_the_weights(
    two_process_results, tiny_model_dir, mode
):
    """Every group dead and beta 0: no rank runs a micro-batch, loss and gradient are zeros
    (`trained_tokens` counts the denominator's tokens whether or not their forward pass was
    skipped), and the weights stay the base model's (SGD of a zero gradient)."""
    got = two_process_results[mode]
    for step in got["history"]:
        assert step["trained_tokens"] > 0 and step["loss"] == 0 and step["grad_norm"] == 0
        assert step["ratio_min"] == step["ratio_max"] == 1.0
        assert torch.isnan(step["seen"]).all()
    assert max_param_diff(got["params"], load_model(tiny_model_dir).state_dict()) == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "aggregation"),
    [("ddp_seqmean", "seq-mean-token-mean"), ("fsdp_sumnorm", "seq-mean-token-sum-norm")],
)
def test_two_processes_take_the_plain_step_with_the_other_aggregations(
    two_process_results, tiny_model_dir, mode, aggregation
):
    case = make_case(tiny_model_dir, aggregation=aggregation)
    want = reference(case, tiny_model_dir)
    got = two_process_results[mode]
    assert_same_history(got["history"], want["history"], case["batch"], atol=METRIC_ATOL)
    assert max_param_diff(got["params"], want["params"]) < PARAM_ATOL
