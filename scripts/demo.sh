#!/usr/bin/env bash
# Run the demo: an embedded etcd and simulated torchrun nodes on this host.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh etcd,timeline
exec "${PYTHON:-python3}" examples/demo.py "$@"
