#!/usr/bin/env bash
# Run the whole test suite (real etcd servers, real torchrun processes), lint and the type checker.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
PYTHON=${PYTHON:-python3}
"$PYTHON" -m ruff check .
"$PYTHON" -m ruff format --check .
"$PYTHON" -m mypy
pytest=("$PYTHON" -m pytest -q -p no:cacheprovider)
if [ $# -gt 0 ]; then  # the tests named, in one process
  exec "${pytest[@]}" "$@"
fi
# Two pytest processes, a whole file to each at a time: one fills the other's waits (hang timeouts, lease
# expiries, faults held for seconds), the longest files first (tests/conftest.py). The tests marked solo
# run alone afterwards (setup.cfg says why).
parallel=0 solo=0
"${pytest[@]}" --durations=15 -n 2 --dist loadfile --no-loadscope-reorder -m "not solo" || parallel=$?
"${pytest[@]}" -m solo || solo=$?
exit $((parallel || solo))
