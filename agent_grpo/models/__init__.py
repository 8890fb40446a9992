"""Models: the embedded default model and loading any other (`loading.py`), the attention kernel
every model we load uses (`attention.py`), and per-token logprobs of a causal LM (`logprobs.py`)."""
