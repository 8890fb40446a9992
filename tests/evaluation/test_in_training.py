"""The evaluations of a run: one frees the engine's caches before training goes on."""

from __future__ import annotations

from types import SimpleNamespace

from agent_grpo.config.jobs import TrainConfig
from agent_grpo.evaluation import in_training as evaluation


def test_an_evaluation_frees_the_engine_caches_before_training_goes_on(monkeypatch) -> None:
    events: list[str] = []
    summary = SimpleNamespace(success_rate=0.5, tool_call_rate=1.0)
    result = SimpleNamespace(summary=summary, samples_per_task=2, pass_at_k=0.5)

    def fake_evaluate_heldout(*args, **kwargs):  # type: ignore[no-untyped-def]
        events.append("eval")
        return result, []

    class Engine:
        def free_caches(self) -> None:
            events.append("free")

    monkeypatch.setattr(evaluation, "evaluate_heldout", fake_evaluate_heldout)
    config = TrainConfig.model_validate({"eval": {"tasks": 2, "samples": 2}})
    assert evaluation.run_eval(config, Engine(), None, [], "base") is result  # type: ignore[arg-type]
    assert events == ["eval", "free"]
