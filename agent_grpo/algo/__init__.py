"""The algorithm: pure GRPO math (`grpo.py`), its config (`config.py`) and the objective of a
micro-batch as the config binds it (`objective.py`)."""
