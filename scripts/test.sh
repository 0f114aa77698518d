#!/usr/bin/env bash
# Run the whole test suite (real etcd servers, real torchrun processes) and lint.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check .
exec "$PYTHON" -m pytest -q -p no:cacheprovider --durations=15 "$@"
