#!/usr/bin/env bash
# Install Debian's headless-capable chromium for the HTML replay test. Idempotent: does nothing
# when a chromium binary is already on PATH. Exits non-zero only when it cannot install one.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO=sudo
    else
        echo "install-chromium: not root and no sudo; cannot apt-get install chromium" >&2
        exit 1
    fi
else
    SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null 2>&1
