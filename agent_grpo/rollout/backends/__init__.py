"""Generation backends: the one interface (`base.py`) and its engines: `hf` (our own decode loop
over transformers, with `kv_cache.py` and `packed_linear.py`), `vllm` (in-process `vllm.LLM`) and
`openai` (an OpenAI-compatible server). `factory.py` builds the configured one."""
