"""An unreachable, frozen or black-hole etcd fails every blocking call within connect_timeout + request_timeout."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.endpoints import parse_endpoints
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings
from elastic_ft.rendezvous.config import EtcdftSettings
from elastic_ft.testing.etcd_cluster import EtcdCluster
from elastic_ft.testing.fault_proxy import FaultProxy

pytestmark = pytest.mark.integration  # every test here starts processes

CONNECT, REQUEST = 2.0, 1.0
SLACK = 1.5  # scheduling on a loaded 2-core machine


@pytest.fixture
def single() -> Iterator[EtcdCluster]:
    with EtcdCluster(members=1) as cluster:
        yield cluster


@pytest.fixture
def black_hole(single: EtcdCluster) -> Iterator[FaultProxy]:
    """A server that accepts connections and never answers."""
    endpoint = single.endpoints[0]
    with FaultProxy((endpoint.host, endpoint.port)) as proxy:
        proxy.freeze()
        yield proxy


def _settings(endpoint: str, **conf: object) -> EtcdftSettings:
    values = {"connect_timeout": CONNECT, "request_timeout": REQUEST, "lease_ttl": 10, "join_timeout": 120, **conf}
    return make_settings(run_id=f"r{uuid.uuid4().hex[:8]}", endpoint=endpoint, min_nodes=2, max_nodes=2,
                         local_addr="127.0.0.1", **values)  # fmt: skip


def test_next_rendezvous_fails_soon_after_etcd_freezes(single: EtcdCluster) -> None:
    handler = EtcdftRendezvousHandler(_settings(single.endpoint))
    outcome: dict[str, object] = {}

    def wait() -> None:  # min_nodes=2 and one node: it waits, sending nothing
        try:
            handler.next_rendezvous()
        except RendezvousConnectionError as error:
            outcome["error"] = error
        outcome["at"] = time.monotonic()

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(1.5)
    frozen_at = time.monotonic()
    single.pause_member(0)
    try:
        waiter.join(CONNECT + REQUEST + 20)
    finally:
        single.resume_member(0)
        handler.shutdown()
    assert "error" in outcome, "next_rendezvous did not fail while etcd was frozen"
    assert "no answer from etcd" in str(outcome["error"])
    assert outcome["at"] - frozen_at < CONNECT + REQUEST + SLACK  # type: ignore[operator]


def test_a_store_wait_fails_soon_after_etcd_freezes(single: EtcdCluster) -> None:
    client = EtcdClient(single.endpoints, connect_timeout=CONNECT, request_timeout=REQUEST)
    store = EtcdStore(client, f"/test/{uuid.uuid4().hex}/store/", timedelta(seconds=300))
    store.set("present", "1")
    single.pause_member(0)
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionError, match="no answer from etcd"):
            store.get("missing")  # would wait the store's 300 s for the key
    finally:
        single.resume_member(0)
        client.close()
    assert time.monotonic() - started < REQUEST + CONNECT + REQUEST + SLACK  # one quiet period, then the probe


def test_a_black_hole_fails_the_handler_within_the_bound(black_hole: FaultProxy) -> None:
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="no answer from etcd"):
        EtcdftRendezvousHandler(_settings(black_hole.endpoint))
    assert time.monotonic() - started < CONNECT + REQUEST + SLACK


def test_a_black_hole_fails_a_store_within_the_bound(black_hole: FaultProxy) -> None:
    client = EtcdClient(parse_endpoints(black_hole.endpoint), connect_timeout=CONNECT, request_timeout=REQUEST)
    started = time.monotonic()
    with pytest.raises(ConnectionError):
        EtcdStore(client, "/test/store/").get("k")
    client.close()
    assert time.monotonic() - started < CONNECT + REQUEST + SLACK


def test_status_fails_within_its_connect_timeout(black_hole: FaultProxy) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "elastic_ft.launcher.cli", "status", f"--rdzv-endpoint={black_hole.endpoint}",
         "--rdzv-id=job", "--connect-timeout=2"], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode != 0 and "no answer from etcd" in done.stderr and "Traceback" not in done.stderr
    assert elapsed < 2 + 3.0  # the bound, plus the interpreter's start
