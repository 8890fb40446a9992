"""Configuration: the typed base every config builds on (`base.py`), the configs of the two jobs
(`jobs.py`: `TrainConfig`, `EvalRunConfig`) and the schema of every key (`schema.py`).

The configs of each part live with the part (`algo/config.py`, `rollout/config.py`); `jobs.py`
assembles them, so any layer may import a config without importing the code that runs it.
"""

from agent_grpo.config.base import (
    ConfigError,
    ConfigModel,
    apply_overrides,
    close_match,
    dump_config,
    load_config,
    validate_config,
)

__all__ = [
    "ConfigError",
    "ConfigModel",
    "apply_overrides",
    "close_match",
    "dump_config",
    "load_config",
    "validate_config",
]
