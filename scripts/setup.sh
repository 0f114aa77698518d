#!/usr/bin/env bash
# Install elastic-ft and what it needs into the current Python (a virtual environment, preferably).
# torch is pinned to 2.13.0 (the CPU wheel) and installed only when absent. The install is editable, so
# code changes need no reinstall: it is skipped while the packaging files, the extras and the Python
# are those of the last install with the same extras (a stamp in .setup-stamp.<extras>, ignored by git).
# Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=${1:-etcd}
stamp=".setup-stamp.${extras//,/_}"
wanted="$("$PYTHON" -c 'import sys; print(sys.prefix)') ${extras} $(cat setup.cfg pyproject.toml | cksum)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] \
  && "$PYTHON" -c "import torch, elastic_ft, sys; sys.exit(not elastic_ft.__file__.startswith('$PWD/'))" 2>/dev/null; then
  exit 0
fi
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  "$PYTHON" -m pip install --quiet torch==2.13.0
fi
"$PYTHON" -m pip install --quiet -e ".[${extras}]"
printf '%s\n' "$wanted" > "$stamp"
