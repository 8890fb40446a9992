#!/usr/bin/env bash
# GPU check of the trainer (issue 12, part 4): 3 GRPO steps of a random-initialised model of
# SmolLM2-135M's shape, with the real tokenizer, on Calculator-v0 with the hf backend, in bf16
# and in fp32; asserts every parameter and every tensor reaching the loss is on the GPU and that
# the weights moved; prints step time and tokens/s. Under 8 minutes on one GPU. Then the rollout
# worker checks of scripts/device_check_ray.py (weight pushes, a vLLM actor; issue 26).
#
# The device machine has Python with torch and transformers only and no network, so:
#   here:  scripts/device-check.sh --prepare   # wheels + tokenizer + model config -> .device/
#   there: scripts/device-check.sh             # (run tool, carry: [".device"])
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.device
if [ "${1:-}" = "--prepare" ]; then
    mkdir -p "$DIR/wheels" "$DIR/model"
    grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >>.git/info/exclude
    # the dependencies torch and transformers do not bring, as wheels for the device's Python
    .venv/bin/pip download -q --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$DIR/wheels" \
        "gymnasium>=1.0" "pydantic>=2.9" "httpx>=0.27" "pyyaml>=6.0" "rich>=13.0" "gguf>=0.10"
    .venv/bin/python - "$DIR/model" <<'PY'
import sys
from agent_grpo.models.loading import DEFAULT_MODEL, load_tokenizer, resolve_model_path
from transformers import AutoConfig
path = resolve_model_path(DEFAULT_MODEL)
load_tokenizer(path).save_pretrained(sys.argv[1])
AutoConfig.from_pretrained(path).save_pretrained(sys.argv[1])
PY
    du -sh "$DIR"
    exit 0
fi
python3 -m venv --system-site-packages /tmp/device-venv
/tmp/device-venv/bin/pip install -q --no-index --find-links "$DIR/wheels" \
    gymnasium pydantic httpx pyyaml rich gguf
PYTHONPATH=. /tmp/device-venv/bin/python scripts/device_check.py "$DIR/model"

# Rollout workers (issue 26): weight pushes from GPU weights (gloo to a CPU process; NCCL to a
# second GPU, skipped with one) and a vLLM engine as a Ray actor (skipped, with the reason,
# where vllm or ray is not importable). Separate from the trainer checks above.
PYTHONPATH=. /tmp/device-venv/bin/python scripts/device_check_ray.py "$DIR/model"
