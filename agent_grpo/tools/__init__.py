"""Built-in tools, installed as `agent_grpo.tools`."""
