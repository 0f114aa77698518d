"""``python -m elastic_ft.shared_utils.wait_daemon PIDFILE``, under NVIDIA 0.6's module path.

Wait until every process whose PID the file lists has exited; see
:mod:`elastic_ft.runtime.wait_daemon`.
"""

import sys

from elastic_ft.runtime.wait_daemon import alive, listed_pids, main

__all__ = ["alive", "listed_pids", "main"]

if __name__ == "__main__":
    sys.exit(main())
