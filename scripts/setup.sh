#!/usr/bin/env bash
# Install elastic-ft and what it needs into the current Python (a virtual environment, preferably).
# torch is installed only when absent: TORCH_VERSION, by default 2.15.0 (the newest elastic-ft supports;
# CI runs its whole suite on 2.13.0, the oldest: TORCH_VERSION=2.13.0). The install is editable, so
# code changes need no reinstall: it is skipped while the packaging files, the extras and the Python
# are those of the last install with the same extras (a stamp in .setup-stamp.<extras>, ignored by git).
# Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh test
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=${1:-etcd,timeline}
stamp=".setup-stamp.${extras//,/_}"
wanted="$("$PYTHON" -c 'import sys; print(sys.prefix)') ${extras} $(cat setup.cfg pyproject.toml | cksum)"
# Byte-compile the clone's Python (a no-op while the caches are fresh): where PYTHONDONTWRITEBYTECODE is set,
# as on this project's machines, every process the tests, the demo and the benchmarks start would compile the
# package from source again (about 120 modules, 0.2 s of CPU per worker, agent and launcher).
byte_compile() {
  "$PYTHON" -m compileall -q -j 0 elastic_ft examples benchmarks tests >/dev/null
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] \
  && "$PYTHON" -c "import torch, elastic_ft, sys; sys.exit(not elastic_ft.__file__.startswith('$PWD/'))" 2>/dev/null; then
  byte_compile
  exit 0
fi
torch_version=${TORCH_VERSION:-2.15.0}
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  if ! "$PYTHON" -m pip install --quiet "torch==$torch_version"; then
    echo "scripts/setup.sh: pip could not install torch==$torch_version (see above); elastic-ft supports" \
      "torch 2.13 to 2.15: TORCH_VERSION=2.13.0 $0 installs the oldest" >&2
    exit 1
  fi
fi
"$PYTHON" -m pip install --quiet -e ".[${extras}]"
printf '%s\n' "$wanted" > "$stamp"
byte_compile
