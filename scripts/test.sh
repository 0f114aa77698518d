#!/usr/bin/env bash
# Run the whole test suite (real etcd servers, real torchrun processes), lint and the type checker.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check .
"$PYTHON" -m mypy
# Two pytest workers, each taking whole test files: a test spends about a third of its time waiting (timeouts,
# faults, rendezvous), which the other worker fills; PYTEST_WORKERS=0 runs the suite in this process.
exec "$PYTHON" -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-2}" --dist loadfile --durations=15 "$@"
