"""Built-in environments, installed as `agent_grpo.envs`."""


def register_builtin_envs() -> None:
    """Register every built-in environment with gymnasium (idempotent)."""
