"""The test etcd server starts even when another process takes the port it chose first."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

from elastic_ft.etcd import server as etcd_server
from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import PORT_ATTEMPTS, EtcdPortTaken, EtcdServer
from elastic_ft.runtime import net
from elastic_ft.testing.etcd_cluster import EtcdCluster

pytestmark = pytest.mark.integration  # starts etcd


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process holds (here, a listening socket of this one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _choose_ports(monkeypatch: pytest.MonkeyPatch, port: int, taken: Callable[[int], bool]) -> list[int]:
    """Make the server's port choice ``i`` return ``port`` (taken) where ``taken(i)``; returns every choice."""
    chosen: list[int] = []

    def choose(count: int, host: str = "127.0.0.1") -> list[int]:
        free = iter(net.free_ports(count, host))
        start = len(chosen)
        chosen.extend(port if taken(start + i) else next(free) for i in range(count))
        return chosen[start:]

    monkeypatch.setattr(etcd_server, "free_ports", choose)
    return chosen


def test_a_member_whose_port_was_taken_starts_again_on_new_ports(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    chosen = _choose_ports(monkeypatch, taken_port, lambda i: i == 0)  # the first member's client port
    with EtcdCluster(members=3) as cluster:
        assert chosen[0] == taken_port and len(chosen) == 2 * 3 * 2  # two starts of three members
        assert taken_port not in {e.port for e in cluster.endpoints}
        client = EtcdClient(cluster.endpoints)
        try:
            client.put("/k", b"v")
            assert client.get("/k")[0].value == b"v"
        finally:
            client.close()
    assert cluster.workdir is None  # the failed start's directory went too


def test_a_port_taken_at_every_attempt_fails_with_etcds_reason(
    monkeypatch: pytest.MonkeyPatch, taken_port: int
) -> None:
    # Each member takes a client port, then a peer port: every client port is taken.
    chosen = _choose_ports(monkeypatch, taken_port, lambda i: i % 2 == 0)
    server = EtcdServer()
    with pytest.raises(EtcdPortTaken, match="address already in use"):
        server.start()
    assert len(chosen) == 2 * PORT_ATTEMPTS
    assert server.workdir is None


def test_ports_chosen_together_are_distinct() -> None:
    # Chosen one at a time, a port just released can come back at once; a cluster given one port twice
    # refuses to start ("has duplicate url"). Chosen together, they never repeat.
    for _ in range(200):
        ports = net.free_ports(6)
        assert len(set(ports)) == 6, ports


def test_a_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="count must be at least 1, got 0"):
        net.free_ports(0)
