#!/usr/bin/env bash
# Install elastic-ft and what it needs into the current Python.
# torch is pinned to 2.13.0 (the CPU wheel) and installed only when absent.
# Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=${1:-etcd}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  "$PYTHON" -m pip install --quiet torch==2.13.0
fi
"$PYTHON" -m pip install --quiet -e ".[${extras}]"
