#!/usr/bin/env bash
# mypy cannot follow setuptools' editable import hook, and envs/ and tools/ install as
# agent_grpo.envs and agent_grpo.tools. So type-check a tree of symlinks laid out as installed
# (a private temp dir per run, so concurrent runs do not race).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mypy=${MYPY:-$root/.venv/bin/mypy}
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir -p "$tree/agent_grpo"
for f in "$root"/agent_grpo/*; do ln -s "$f" "$tree/agent_grpo/"; done
ln -s "$root/envs" "$tree/agent_grpo/envs"
ln -s "$root/tools" "$tree/agent_grpo/tools"
cd "$tree"
"$mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" -p agent_grpo
