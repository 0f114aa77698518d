"""etcd unreachable, frozen or a black hole: a first contact fails within connect_timeout + request_timeout; a
wait of a running job waits etcd out within its own bound (join_timeout, the store's timeout), and fails then,
saying that etcd did not answer."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError

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
    return make_settings(
        run_id=f"r{uuid.uuid4().hex[:8]}", endpoint=endpoint, min_nodes=2, max_nodes=2, local_addr="127.0.0.1", **values
    )


def test_next_rendezvous_waits_out_a_frozen_etcd_until_join_timeout(single: EtcdCluster) -> None:
    handler = EtcdftRendezvousHandler(_settings(single.endpoint, join_timeout=8))
    outcome: dict[str, object] = {}

    def wait() -> None:  # min_nodes=2 and one node: it waits, sending nothing
        try:
            handler.next_rendezvous()
        except RendezvousTimeoutError as error:
            outcome["error"] = error
        outcome["at"] = time.monotonic()

    started = time.monotonic()
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(1.5)
    single.pause_member(0)
    try:
        waiter.join(8 + 20)
    finally:
        single.resume_member(0)
        handler.shutdown()
    assert "error" in outcome, "next_rendezvous did not end at join_timeout while etcd was frozen"
    assert "does not answer" in str(outcome["error"]) or "has not answered" in str(outcome["error"])
    assert 8.0 <= outcome["at"] - started < 8.0 + CONNECT + REQUEST + SLACK  # type: ignore[operator]


def test_a_store_wait_waits_out_a_frozen_etcd_and_ends_at_its_timeout(single: EtcdCluster) -> None:
    client = EtcdClient(single.endpoints, connect_timeout=CONNECT, request_timeout=REQUEST)
    store = EtcdStore(client, f"/test/{uuid.uuid4().hex}/store/", timedelta(seconds=300))
    store.set("present", "1")
    single.pause_member(0)
    started = time.monotonic()
    try:
        with pytest.raises(ConnectionError, match="unreachable"):
            store.wait(["missing"], timedelta(seconds=6))  # not sooner: etcd away is waited for
        assert 6.0 <= time.monotonic() - started < 6.0 + REQUEST + SLACK
    finally:
        single.resume_member(0)
    # A wait that spans a freeze sees the key put once etcd is back.
    setter = EtcdStore(EtcdClient(single.endpoints), store.prefix)
    single.pause_member(0)
    threading.Timer(3.0, single.resume_member, (0,)).start()
    threading.Timer(3.5, setter.set, ("later", "1")).start()
    started = time.monotonic()
    store.wait(["later"], timedelta(seconds=30))
    assert 3.5 <= time.monotonic() - started < 3.5 + 3.0
    client.close()
    setter.client.close()


def test_a_black_hole_fails_the_handler_within_the_bound(black_hole: FaultProxy) -> None:
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="no answer from etcd"):
        EtcdftRendezvousHandler(_settings(black_hole.endpoint))
    assert time.monotonic() - started < CONNECT + REQUEST + SLACK


def test_a_black_hole_fails_a_store_at_its_timeout(black_hole: FaultProxy) -> None:
    client = EtcdClient(parse_endpoints(black_hole.endpoint), connect_timeout=CONNECT, request_timeout=REQUEST)
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="store's timeout"):
        EtcdStore(client, "/test/store/", timedelta(seconds=5)).get("k")
    client.close()
    assert 5.0 <= time.monotonic() - started < 5.0 + REQUEST + SLACK


def test_status_fails_within_its_connect_timeout(black_hole: FaultProxy) -> None:
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_ft.launcher.cli",
            "status",
            f"--rdzv-endpoint={black_hole.endpoint}",
            "--rdzv-id=job",
            "--connect-timeout=2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert done.returncode != 0 and "no answer from etcd" in done.stderr and "Traceback" not in done.stderr
    assert elapsed < 2 + 3.0  # the bound, plus the interpreter's start
