"""The run directory: `writer.py` writes it during a run (`RunWriter`: config, metrics,
trajectories per step, checkpoints, rollback on resume); `reader.py` reads it back for analysis
(`Run`, what `agent_grpo.train` returns and `agent_grpo.load_run` opens)."""
