"""Who asks etcd: every request an ``EtcdClient`` sends, counted under the source that asked for it.

A source is what its caller names with :func:`on_behalf_of` (``heartbeat``,
``peer look``), or else the asking thread's name (a lease's keep-alives
come from ``etcd-session``, a rank's outcome watch from its monitor thread).
Each process also has a role (:func:`set_role`: the agent, a rank, a rank's
monitor process), so that a job's requests add up by role and source.

Counting is always on and costs a dictionary update. With
``ELASTIC_FT_ETCD_ACCOUNTS`` set to a directory, a daemon thread of each
process that made a client also appends the process's running totals to
``<dir>/<role>-<pid>.jsonl`` every :data:`WRITE_PERIOD` seconds (one JSON
object per line: wall time, role, pid, ``{"source/kind": count}``), which
``benchmarks/worker_requests.py`` subtracts over a window of training.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Protocol

from elastic_ft.runtime.waits import pause

#: A directory: each process writes its running request counts there (see the module docstring).
ACCOUNTS_DIR_ENV = "ELASTIC_FT_ETCD_ACCOUNTS"
#: Seconds between two records of a process's counts.
WRITE_PERIOD = 0.25

log = logging.getLogger(__name__)
_asking = threading.local()
_role = "process"


def set_role(role: str) -> None:
    """Name this process's part in the job (``agent``, ``rank``, ``monitor process``) in its records."""
    global _role
    _role = role


@contextlib.contextmanager
def on_behalf_of(source: str) -> Iterator[None]:
    """Count the requests this thread sends inside the block under ``source``."""
    outer = getattr(_asking, "source", None)
    _asking.source = source
    try:
        yield
    finally:
        _asking.source = outer


def current_source() -> str:
    """The source a request sent now is counted under."""
    return getattr(_asking, "source", None) or threading.current_thread().name


class CountingClient(Protocol):
    requests_by_source: collections.Counter[tuple[str, str]]


_clients: weakref.WeakSet[CountingClient] = weakref.WeakSet()
_lock = threading.Lock()
#: The thread writing this process's records, by directory (one, unless the environment changed).
_writers: dict[str, threading.Thread] = {}


def track(client: CountingClient) -> None:
    """Have ``client``'s counts written with the process's (only with ``ELASTIC_FT_ETCD_ACCOUNTS`` set)."""
    directory = os.environ.get(ACCOUNTS_DIR_ENV)
    if not directory:
        return
    with _lock:
        _clients.add(client)
        writer = _writers.get(directory)
        if writer is None or not writer.is_alive():  # none yet, or one inherited by a forked child
            writer = threading.Thread(target=_write_forever, args=(directory,), name="elastic_ft-accounts", daemon=True)
            _writers[directory] = writer
            writer.start()


def totals() -> dict[str, int]:
    """The requests of this process's live clients so far, by ``source/kind``."""
    summed: collections.Counter[str] = collections.Counter()
    with _lock:
        clients = list(_clients)
    for client in clients:
        for (source, kind), count in list(client.requests_by_source.items()):
            summed[f"{source}/{kind}"] += count
    return dict(summed)


def _write_forever(directory: str) -> None:
    """Append the process's totals every period (to a file named by the process's role at that moment); a
    directory that cannot be written ends the records."""
    pid = os.getpid()
    while True:
        path = os.path.join(directory, f"{_role.replace(' ', '_')}-{pid}.jsonl")
        record = {"t": time.time(), "role": _role, "pid": pid, "counts": totals()}
        try:
            with open(path, "a") as records:
                records.write(json.dumps(record) + "\n")
        except OSError as error:
            log.warning(
                "%s=%s: cannot write %s (%s); this process's request counts are not recorded",
                ACCOUNTS_DIR_ENV,
                directory,
                path,
                error,
            )
            return
        pause(WRITE_PERIOD)
