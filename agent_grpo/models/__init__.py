"""Models: the embedded models (`embedded.py`, `chat_templates.py`), loading any model
(`loading.py`), the attention kernel every model we load uses (`attention.py`), and per-token
logprobs of a causal LM (`logprobs.py`)."""
