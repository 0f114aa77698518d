"""A session's lease on one long-lived keep-alive stream, against real etcd members."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from elastic_ft.etcd.client import EtcdClient, EtcdUnavailableError
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.etcd.session import LEASES_PER_STREAM, Session
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


@pytest.mark.integration
def test_a_restarted_etcd_keeps_the_session_on_its_lease(one_member: EtcdCluster, run_id: str) -> None:
    client = EtcdClient(one_member.endpoints, request_timeout=0.5, connect_timeout=30)
    session = Session(client, ttl=1)
    key_on_lease(client, session, f"/elastic_ft/{run_id}/alive")
    one_member.commit_to_disk()  # the key outlives a crash of etcd 3.5.1 too
    one_member.kill_member(0)
    time.sleep(3 * session.ttl)  # refreshes fail meanwhile: the lease is unproven, not lost
    assert not session.expired.is_set() and session.valid_until() < time.monotonic()
    one_member.restart_member(0)
    assert session.prove(time.monotonic(), timeout=10) is True
    assert session.valid_until() > time.monotonic()
    assert client.get(f"/elastic_ft/{run_id}/alive")[0] is not None
    session.close(revoke=True)
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
    session = Session(client, ttl=1)
    watch = client.watch_prefix(f"/elastic_ft/{run_id}/", 1, lambda *_: None, lambda _: None)
    time.sleep(0.5)  # the session's first refresh has opened the keep-alive stream
    assert client.requests_by_kind["keep_alive"] == 1
    client.close()
    names = {thread.name for thread in threading.enumerate()}
    assert not names & {"etcd-watch", "etcd-keepalive"}, names
    assert watch.cancelled
    session.close(revoke=False)


def stream_threads(name: str) -> int:
    return sum(thread.name == name for thread in threading.enumerate())


def test_the_sessions_of_a_client_share_a_keep_alive_stream_per_64(etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(etcd.endpoints)
    keepalive_threads = stream_threads("etcd-keepalive")
    count = 2 * LEASES_PER_STREAM + 2  # three streams' worth
    sessions = [Session(client, ttl=1) for _ in range(count)]
    for i, session in enumerate(sessions):
        key_on_lease(client, session, f"/elastic_ft/{run_id}/alive/{i:03d}")
    time.sleep(3.0)  # three TTLs: each lease needed about nine refreshes
    assert not any(s.expired.is_set() for s in sessions)
    assert len(client.get_prefix(f"/elastic_ft/{run_id}/alive/")[0]) == count
    assert client.requests_by_kind["keep_alive"] == 3
    assert stream_threads("etcd-keepalive") - keepalive_threads == 3
    sessions[0].close(revoke=True)  # one session's end leaves the others alive
    time.sleep(1.5)
    assert [kv.key for kv in client.get_prefix(f"/elastic_ft/{run_id}/alive/")[0]] == [
        f"/elastic_ft/{run_id}/alive/{i:03d}" for i in range(1, count)
    ]
    for session in sessions[1:]:
        session.close(revoke=True)
    assert client.get_prefix(f"/elastic_ft/{run_id}/alive/")[0] == []
    client.close()


def test_a_lease_revoked_elsewhere_loses_only_its_session(etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(etcd.endpoints)
    kept, revoked = Session(client, ttl=1), Session(client, ttl=1)
    client.revoke_lease(revoked.id)
    assert revoked.expired.wait(3), "etcd's answer that the lease is gone was not heard"
    time.sleep(1.5)
    assert not kept.expired.is_set()
    kept.close(revoke=True)
    client.close()


def test_every_watch_of_a_client_shares_one_stream(etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(etcd.endpoints)
    watch_threads = stream_threads("etcd-watch")
    seen: dict[int, list[str]] = {i: [] for i in range(10)}
    _, revision = client.get(f"/elastic_ft/{run_id}/none")
    watches = [
        client.watch_key(
            f"/elastic_ft/{run_id}/k{i}",
            revision + 1,
            lambda events, _rev, i=i: seen[i].extend(e.kv.value.decode() for e in events),
            lambda _error: None,
        )
        for i in range(10)
    ]
    for i in range(10):
        client.put(f"/elastic_ft/{run_id}/k{i}", f"first {i}".encode())
    deadline = time.monotonic() + 5
    while any(len(v) < 1 for v in seen.values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == {i: [f"first {i}"] for i in range(10)}  # each watch got its own key's event, once
    watches[3].close()
    for i in range(10):
        client.put(f"/elastic_ft/{run_id}/k{i}", f"second {i}".encode())
    deadline = time.monotonic() + 5
    while any(len(v) < 2 for i, v in seen.items() if i != 3) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert seen[3] == ["first 3"]  # closed: nothing more
    assert all(seen[i] == [f"first {i}", f"second {i}"] for i in seen if i != 3)
    assert client.requests_by_kind["watch"] == 10
    assert stream_threads("etcd-watch") - watch_threads == 1
    client.close()


def test_a_broken_watch_stream_ends_every_watch_on_it(etcd_cluster: EtcdCluster, run_id: str) -> None:
    client = EtcdClient(etcd_cluster.endpoints, request_timeout=1, connect_timeout=5)
    ended: list[Exception] = []
    _, revision = client.get(f"/elastic_ft/{run_id}/none")
    for i in range(3):
        client.watch_key(f"/elastic_ft/{run_id}/k{i}", revision + 1, lambda *_: None, ended.append)
    etcd_cluster.kill_member(0)  # the first endpoint: the one the stream uses
    deadline = time.monotonic() + 10
    while len(ended) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(ended) == 3 and all(isinstance(e, EtcdUnavailableError) for e in ended), ended
    client.get(f"/elastic_ft/{run_id}/none")  # moves the client to a member that answers
    events: list[str] = []
    _, revision = client.get(f"/elastic_ft/{run_id}/none")
    client.watch_key(
        f"/elastic_ft/{run_id}/k0", revision + 1, lambda b, _r: events.extend(e.kv.key for e in b), ended.append
    )
    client.put(f"/elastic_ft/{run_id}/k0", b"again")
    deadline = time.monotonic() + 5
    while not events and time.monotonic() < deadline:
        time.sleep(0.05)
    assert events == [f"/elastic_ft/{run_id}/k0"]  # a new stream, on another member
    client.close()


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


def test_a_watch_whose_callback_raises_ends_alone(etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(etcd.endpoints)
    _, revision = client.get(f"/elastic_ft/{run_id}/none")
    ended: list[Exception] = []
    seen: list[str] = []

    def explode(_events: list, _revision: int) -> None:
        raise RuntimeError("a callback bug")

    client.watch_key(f"/elastic_ft/{run_id}/bad", revision + 1, explode, ended.append)
    client.watch_key(
        f"/elastic_ft/{run_id}/good", revision + 1, lambda b, _r: seen.extend(e.kv.key for e in b), ended.append
    )
    client.put(f"/elastic_ft/{run_id}/bad", b"x")
    client.put(f"/elastic_ft/{run_id}/good", b"1")
    client.put(f"/elastic_ft/{run_id}/good", b"2")
    deadline = time.monotonic() + 5
    while (len(seen) < 2 or not ended) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [str(e) for e in ended] == ["a callback bug"]  # the faulty watch ended, with its own error
    assert seen == [f"/elastic_ft/{run_id}/good"] * 2  # the other watch on the stream went on
    client.close()
