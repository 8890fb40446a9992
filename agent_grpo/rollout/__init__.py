"""Group rollouts: sample G multi-turn trajectories per task, batched across all groups."""
