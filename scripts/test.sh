#!/usr/bin/env bash
# Run the whole test suite (real etcd servers, real torchrun processes), lint and the type checker.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check .
"$PYTHON" -m mypy
exec "$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 "$@"
