"""The trainer: the loop (`loop.py`), the update (`update.py`), batches (`batch.py`), metrics,
checkpoints, parallelism and the warm start. `agent_grpo.trainer.loop.train(config)` runs a whole
job from a `TrainConfig`; the Python API's `agent_grpo.train` takes any config form and returns
the `Run`."""
