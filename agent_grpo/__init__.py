"""agent-grpo: train LLM agents with GRPO on multi-turn, tool-using tasks, correct to the token."""

__version__ = "0.1.0"
