#!/usr/bin/env bash
# GPU check of the trainer: 3 GRPO steps of a random-initialised model of SmolLM2-135M's
# shape, with the real tokenizer, on Calculator-v0 with the hf backend, in bf16 and in fp32,
# then 3 with partial rollouts on a long-tailed env; asserts every parameter and every tensor
# reaching the loss is on the GPU and that the weights moved; prints step time and tokens/s.
# Then the rollout worker checks of scripts/device_check_ray.py (weight pushes, a vLLM actor).
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
# The device's python3 is itself a virtualenv, so a `venv --system-site-packages` made from it
# would not see its torch: the missing packages go to a folder on PYTHONPATH instead, and only
# those (the image's own numpy, httpx, rich, yaml stay as they are).
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/device-site \
    "$DIR"/wheels/{gymnasium,farama_notifications,pydantic,pydantic_core,annotated_types}-*.whl \
    "$DIR"/wheels/{typing_inspection,typing_extensions,gguf}-*.whl
PYTHONPATH=/tmp/device-site:. python3 scripts/device_check.py "$DIR/model"

# Rollout workers (issue 26): weight pushes from GPU weights (gloo to a CPU process; NCCL to a
# second GPU, skipped with one) and a vLLM engine as a Ray actor (skipped, with the reason,
# where vllm or ray is not importable). Separate from the trainer checks above.
PYTHONPATH=/tmp/device-site:. python3 scripts/device_check_ray.py "$DIR/model"
