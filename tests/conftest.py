"""Real etcd servers for the tests: no mocks.

``etcd`` is one server shared by the session (tests keep apart by run id);
``etcd_cluster`` is a fresh 3-member cluster for tests that kill members.
``ETCD_BINARY`` picks the binary; ``ETCD_EXTRA_BINARIES`` (comma-separated
paths, e.g. Debian's etcd 3.4) adds versions for ``tests/etcd/test_versions.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.testing.etcd_cluster import EtcdCluster
from elastic_ft.testing.local_cluster import TorchrunNode


@pytest.fixture(scope="session")
def etcd() -> Iterator[EtcdServer]:
    with EtcdServer() as server:
        yield server


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    with EtcdCluster(members=3) as cluster:
        yield cluster


@pytest.fixture
def run_id() -> str:
    return f"test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def etcd_client(etcd: EtcdServer) -> Iterator[EtcdClient]:
    client = EtcdClient(etcd.endpoints)
    yield client
    client.close()


@pytest.fixture
def reap_pids() -> Iterator[list[int]]:
    """PIDs (of process groups) a test started; killed at the end whatever happens.

    A SIGKILLed torchrun leaves its workers running in their own sessions,
    so tests record every PID they learn of here.
    """
    pids: list[int] = []
    yield pids
    for pid in pids:
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                kill(pid, signal.SIGKILL)


@pytest.fixture
def nodes() -> Iterator[list[TorchrunNode]]:
    """Simulated torchrun/ftrun nodes a test started; terminated (with their workers) at the end."""
    started: list[TorchrunNode] = []
    yield started
    for node in started:
        node.terminate()
