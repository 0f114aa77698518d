#!/usr/bin/env bash
# Run NVIDIA inprocess 0.4.1's own unit tests against elastic_ft.inprocess: the files of tag v0.4.1,
# unchanged but for the import (nvidia_resiliency_ext.inprocess -> elastic_ft.inprocess).
# Usage: scripts/nvidia_tests.sh NVIDIA_REPO [pytest arguments]
#   NVIDIA_REPO: a clone of github.com/NVIDIA/nvidia-resiliency-ext (bare or not) that has the tag.
# The results table in docs/migration.md comes from this script.
set -euo pipefail
repo=${1:?usage: scripts/nvidia_tests.sh NVIDIA_REPO [pytest arguments]}
shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git --git-dir="$(git -C "$repo" rev-parse --git-dir)" archive v0.4.1 tests/inprocess | tar -x -C "$work"
find "$work/tests" -name '*.py' -exec sed -i 's/nvidia_resiliency_ext\.inprocess/elastic_ft.inprocess/g' {} +
cd "$work"
exec "${PYTHON:-python3}" -m pytest -p no:cacheprovider -o addopts= --timeout 120 -q tests/inprocess "$@"
