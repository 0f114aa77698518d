"""Real etcd servers for the tests: no mocks.

``etcd`` is one server shared by the session (tests keep apart by run id);
``etcd_cluster`` is a fresh 3-member cluster for tests that kill members.

Test tiers: a test that uses no etcd fixture, no process fixture and is not
marked ``slow`` or ``integration`` is marked ``unit`` (``pytest -m unit``,
the edit-test loop); a unit test that starts a process (``subprocess``,
``os.fork``) fails, so the tier stays pure. Mark such a test
``integration``.
``ETCD_BINARY`` picks the binary; ``ETCD_EXTRA_BINARIES`` (comma-separated
paths, e.g. Debian's etcd 3.4) adds versions for ``tests/etcd/test_versions.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Callable, Iterator

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.runtime.reaper import ensure_reaper
from elastic_ft.testing.etcd_cluster import EtcdCluster
from elastic_ft.testing.local_cluster import TorchrunNode

# Every process a test starts writes its threads' Python stacks to its stderr when a fatal signal (SIGSEGV,
# SIGABRT, ...) ends it, so that a crash a test meets says where it happened; the exit status stays the signal's.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")

#: Fixtures that start real servers or processes: a test that uses one is no unit test.
_INTEGRATION_FIXTURES = frozenset(
    {"etcd", "etcd_cluster", "etcd_client", "reap_pids", "nodes", "tls_etcd", "pki", "auth_etcd"}
)


#: The files that take longest (seconds beside the other pytest process, measured in a full run, listed in
#: the order that run used), run first: ``--dist loadfile --no-loadscope-reorder`` (scripts/test.sh) hands
#: out files in collection order, the first few alternately to the two processes, the rest to whichever is
#: free. In xdist's order (most tests first) one process ran a long file alone at the end of the run for
#: minutes while the other idled.
_LONGEST_FIRST = (
    "tests/launcher/test_network_faults.py",  # 443 s
    "tests/launcher/test_spares.py",  # 321 s
    "tests/launcher/test_etcd_outages.py",  # 367 s
    "tests/launcher/test_fault_matrix.py",  # 263 s
    "tests/launcher/test_agent.py",  # 203 s
    "tests/inprocess/test_sharded.py",  # 163 s
    "tests/replicas/test_replica_groups.py",  # 197 s
    "tests/launcher/test_soak.py",  # 155 s
    "tests/launcher/test_healing.py",  # 136 s
    "tests/launcher/test_standby.py",  # 222 s
    "tests/inprocess/test_wrapper.py",  # 198 s
    "tests/launcher/test_recovery.py",  # 124 s
    "tests/rendezvous/test_torchrun_e2e.py",  # 63 s
)


def _file_order(item: pytest.Item) -> int:
    path = item.nodeid.split("::")[0]
    return _LONGEST_FIRST.index(path) if path in _LONGEST_FIRST else len(_LONGEST_FIRST)


def pytest_configure(config: pytest.Config) -> None:
    """Every pytest process (xdist's workers too) gets a reaper (:mod:`elastic_ft.runtime.reaper`) first: the etcd
    servers, launchers and test beds its tests start go with it, even when it is SIGKILLed."""
    if config.option.markexpr != "unit":  # the unit tier starts no process
        ensure_reaper()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_file_order)  # stable: each file's tests keep their order
    for item in items:
        outside = item.get_closest_marker("slow") or item.get_closest_marker("integration")
        if not outside and not _INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.unit)


def _refuse_processes(patch: Callable[[object, str, object], None], who: str) -> None:
    def refuse(*_: object, **__: object) -> None:
        raise AssertionError(f"{who} starts a process: mark the test integration (tests/conftest.py)")

    patch(subprocess.Popen, "__init__", refuse)
    patch(os, "fork", refuse)
    patch(os, "posix_spawn", refuse)


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session) -> Iterator[None]:
    """``pytest -m unit``: no process starts while the tests run, module-scoped fixtures included."""
    if session.config.option.markexpr != "unit":
        return (yield)
    with pytest.MonkeyPatch.context() as patcher:
        _refuse_processes(patcher.setattr, "a unit test's fixture")
        return (yield)


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit test that starts a process fails at once, in every run."""
    if request.node.get_closest_marker("unit") is not None:
        _refuse_processes(monkeypatch.setattr, request.node.nodeid)


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
