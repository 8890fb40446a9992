"""Built-in environments: the base classes (`text_env.py`), the registry and the built-ins.

Importing this package registers them with gymnasium as `agent_grpo/<Name>-v0`. Entry points are
lazy `"module:Class"` strings, so registering imports no environment module.
"""

from __future__ import annotations

import gymnasium as gym

__all__ = ["BUILTIN_ENVS", "NAMESPACE", "register_builtin_envs"]

NAMESPACE = "agent_grpo"
"""Gymnasium namespace of every built-in environment."""
BUILTIN_ENVS = {
    "BFCL-v0": "agent_grpo.envs.bfcl:BfclEnv",
    "Calculator-v0": "agent_grpo.envs.calculator:CalculatorEnv",
    "Dataset-v0": "agent_grpo.envs.dataset:DatasetEnv",
    "Logs-v0": "agent_grpo.envs.logs:LogsEnv",
    "Notes-v0": "agent_grpo.envs.notes:NotesEnv",
    "OpenEnv-v0": "agent_grpo.envs.openenv_env:OpenEnvEnv",
    "PythonSandbox-v0": "agent_grpo.envs.python_sandbox:PythonSandboxEnv",
    "ReasoningGym-v0": "agent_grpo.envs.reasoning_gym_tasks:ReasoningGymEnv",
    "Search-v0": "agent_grpo.envs.search:SearchEnv",
    "Verifiers-v0": "agent_grpo.envs.verifiers_env:VerifiersEnv",
    "WebApi-v0": "agent_grpo.envs.webapi:WebApiEnv",
}
"""Built-in environment names (without the namespace) and their entry points."""


def register_builtin_envs() -> None:
    """Register every built-in environment with gymnasium (idempotent)."""
    for name, entry_point in BUILTIN_ENVS.items():
        env_id = f"{NAMESPACE}/{name}"
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point)


register_builtin_envs()
