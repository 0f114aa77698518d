"""Where a benchmark's jobs write: one directory per benchmark run, removed when the benchmark passes.

Each job gets its own directory (:func:`workdir`) under one root per run.
:func:`run_main` runs the benchmark: when it exits 0, the root goes (a run
leaves a few megabytes of logs and event files per job, and the benchmarks
run often), unless ``EFT_KEEP_WORKDIRS=1``. When it fails, the root stays
and its path is printed, so the failed jobs' logs can be read. The JSON a
benchmark writes names each job's directory either way.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

KEEP_ENV = "EFT_KEEP_WORKDIRS"
_root: Path | None = None


def workdir(prefix: str) -> Path:
    """A new, empty directory for one job of this run."""
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix=f"eft-bench-{Path(sys.argv[0]).stem}-"))
    return Path(tempfile.mkdtemp(prefix=prefix, dir=_root))


def run_main(main: Callable[[], int | None]) -> None:
    """Run a benchmark's ``main`` and exit with its status; remove this run's directories if it passed.

    First starts the benchmark's reaper (:mod:`elastic_ft.runtime.reaper`): the etcd servers, launchers and test
    beds it starts go with it even when it is SIGKILLed (a test's timeout, say).
    """
    from elastic_ft.runtime.reaper import ensure_reaper

    ensure_reaper()
    code: int | str | None = 1
    try:
        code = main()
    except SystemExit as exit_:
        code = exit_.code
    finally:
        _finish(passed=code in (0, None))
    sys.exit(code)


def _finish(passed: bool) -> None:
    if _root is None:
        return
    if passed and os.environ.get(KEEP_ENV) != "1":
        shutil.rmtree(_root, ignore_errors=True)  # a killed job's process may still be writing: best effort
    else:
        print(f"work directories kept in {_root}", file=sys.stderr)
