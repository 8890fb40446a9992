"""Evaluation on held-out seeds: the measurement (`heldout.py`), the `agent-grpo eval` job
(`job.py`) and the evaluations a training run makes before, after the warm start and at the end
(`in_training.py`)."""
