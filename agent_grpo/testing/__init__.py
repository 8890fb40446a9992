"""Test doubles shared by the test suite, shipped so tests, benchmarks and downstream projects can
use the same ones (none of them imports pytest).

- `tiny_model`: SmolLM2's architecture with the real tokenizer at 2 layers of width 64, so engine
  and trainer tests exercise real token ids and chat templates in well under a second; a
  vLLM-shaped variant; `lively`, which makes its greedy output depend on the whole prompt.
- `backends`: `ScriptedBackend`, a generation backend that answers from a fixed script.
- `records`: trajectory records built by hand (a two-turn calculator episode, a minimal record,
  a record of what a `TokenBuilder` built, a record of an environment's expert).
- `reference_tokens`: the token builder's reference, rendered from scratch in one go.
- `reward_rules`: deterministic reward rules for a model that never solves a task, importable by
  configs as `agent_grpo.testing.reward_rules:NAME`.
- `cli_runs`: running the CLI (as a subprocess or its replay/inspect parsers in-process) and
  reading what a run wrote.
- `prompts`: chat prompts as token ids.
- `tool_formats`: a tool table, hostile JSON and hypothesis strategies for the tool-call format
  tests.
"""
