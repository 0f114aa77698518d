"""``python -m elastic_ft.runtime.wait_daemon PIDFILE``: wait until every process whose PID the file lists has
exited.

Slurm ends a job step's processes as soon as its main process exits, and
with them a Wrapper's monitor processes, before they record their ranks'
ends in the store. Run the training with
``Wrapper(monitor_process_pidfile=PIDFILE)`` and ``srun
--kill-on-bad-exit=0``, then this in the same batch script: it returns
once the monitors are gone (NVIDIA's ``shared_utils.wait_daemon``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from elastic_ft.runtime.waits import poll

#: How often the listed processes are looked at.
_PERIOD = 0.5


def listed_pids(path: Path) -> list[int]:
    """The PIDs ``path`` lists, one per line; lines that are not a PID are skipped."""
    return [int(line) for line in path.read_text().split() if line.isdigit() and int(line) > 0]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is no zombie waiting for its parent."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc to ask: it exists
    return stat.rpartition(")")[2].split()[:1] not in (["Z"], ["X"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pidfile", type=Path, help="a file of PIDs, one per line (monitor_process_pidfile)")
    parser.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (exit 1)")
    args = parser.parse_args(argv)
    if not args.pidfile.exists():
        print(f"wait_daemon: {args.pidfile} does not exist", file=sys.stderr)
        return 1
    pids = listed_pids(args.pidfile)
    if not poll(lambda: not any(alive(pid) for pid in pids), args.timeout, interval_max=_PERIOD):
        print(f"wait_daemon: {[p for p in pids if alive(p)]} still running after {args.timeout:g} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
