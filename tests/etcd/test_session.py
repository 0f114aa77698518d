"""A session's lease on one long-lived keep-alive stream, against real etcd members."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.etcd.session import Session
from elastic_ft.testing.etcd_cluster import EtcdCluster


@pytest.fixture
def one_member() -> Iterator[EtcdCluster]:
    with EtcdCluster(members=1) as cluster:
        yield cluster


def key_on_lease(client: EtcdClient, session: Session, key: str) -> None:
    client.put(key, b"x", lease=session.id)


def test_one_keep_alive_stream_serves_every_refresh(etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(etcd.endpoints)
    session = Session(client, ttl=1)
    key_on_lease(client, session, f"/elastic_ft/{run_id}/alive")
    time.sleep(3.0)  # three TTLs: about nine refreshes
    assert client.get(f"/elastic_ft/{run_id}/alive")[0] is not None
    assert not session.expired.is_set()
    assert client.requests_by_kind["keep_alive"] == 1
    session.close(revoke=True)
    assert client.get(f"/elastic_ft/{run_id}/alive")[0] is None  # revoked with its keys
    client.close()


def test_a_frozen_etcd_loses_the_session_within_its_ttl(one_member: EtcdCluster, run_id: str) -> None:
    client = EtcdClient(one_member.endpoints, request_timeout=1, connect_timeout=2)
    session = Session(client, ttl=2)
    one_member.pause_member(0)
    try:
        start = time.monotonic()
        assert session.expired.wait(10), "the session never noticed etcd had stopped answering"
        # Lost no later than one TTL after the last refresh (at most TTL/3 before the freeze), plus slack.
        assert time.monotonic() - start < session.ttl + 1.5
    finally:
        one_member.resume_member(0)
    session.close(revoke=False)
    client.close()


def test_the_stream_moves_to_another_member_when_its_member_dies(etcd_cluster: EtcdCluster, run_id: str) -> None:
    client = EtcdClient(etcd_cluster.endpoints, request_timeout=1, connect_timeout=5)
    session = Session(client, ttl=2)
    key_on_lease(client, session, f"/elastic_ft/{run_id}/alive")
    time.sleep(0.5)
    etcd_cluster.kill_member(0)  # the first endpoint: the one the stream uses
    time.sleep(2 * session.ttl)
    assert not session.expired.is_set()
    assert client.get(f"/elastic_ft/{run_id}/alive")[0] is not None
    assert client.requests_by_kind["keep_alive"] >= 2  # reopened on another member
    session.close(revoke=True)
    client.close()


def test_closing_the_client_joins_its_stream_threads(etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(etcd.endpoints)
    session = Session(client, ttl=5)
    watch = client.watch_prefix(f"/elastic_ft/{run_id}/", 1, lambda *_: None, lambda _: None)
    stream = client.keep_alive_stream(session.id)
    assert stream.refresh(timeout=5) > 0
    client.close()
    names = {thread.name for thread in threading.enumerate()}
    assert not names & {"etcd-watch", "etcd-keepalive"}, names
    assert watch.cancelled and stream.cancelled
    session.close(revoke=False)


def test_closing_a_stream_whose_cancel_blocks_returns_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # gRPC's cancel() was once seen blocked on the call's lock for good; close() must still return.
    from elastic_ft.etcd import watch
    from elastic_ft.etcd.endpoints import EtcdEndpoint

    release = threading.Event()

    class StuckCall:
        def cancel(self) -> None:
            release.wait(30)

    class Idle(watch.Stream):
        def _run(self) -> None:
            self._cancelled.wait(30)

    monkeypatch.setattr(watch, "_JOIN_TIMEOUT", 0.3)
    stream = Idle(lambda *_a, **_k: StuckCall(), EtcdEndpoint("127.0.0.1", 1), "stuck-stream")
    stream._start()
    start = time.monotonic()
    stream.close()
    assert time.monotonic() - start < 2
    assert stream.cancelled
    release.set()
