"""The node relay on a real etcd: a host's barrier is one transaction and one watch, and a relay that dies,
stalls or is fed garbage costs its ranks their batching, never an arrival."""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from elastic_ft.coordination.iteration import iteration_store
from elastic_ft.etcd import node_relay
from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.node_relay import NodeRelay, RelayClient, relay_from_env
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.keys import barrier_count_slots

RANKS = 8
BARRIER = "b"  # a barrier that publishes nothing: its cost alone
TIMEOUT = timedelta(seconds=20)


class Host:
    """One host: a relay on its own etcd client, and ``RANKS`` ranks, each with its own client and relay client."""

    def __init__(self, etcd: EtcdServer, run_id: str, path: Path, *, linger: float = 0.05) -> None:
        self.root = f"/elastic_ft/{run_id}/"
        self.prefix = f"{self.root}round/0/store/"
        self.relay_client = EtcdClient(etcd.endpoints)
        self.relay = NodeRelay(self.relay_client, self.root, RANKS, str(path), linger=linger).start()
        self.clients = [EtcdClient(etcd.endpoints) for _ in range(RANKS)]
        self.relays = [RelayClient(str(path)) for _ in range(RANKS)]
        self.stores = [
            EtcdStore(client, self.prefix, TIMEOUT, relay=relay)
            for client, relay in zip(self.clients, self.relays, strict=True)
        ]
        self.views = [iteration_store(store, 1) for store in self.stores]

    def rank_txns(self) -> int:
        return sum(client.requests_by_kind["txn"] for client in self.clients)

    def barrier(self, ranks: list[int], world_size: int) -> dict[int, object]:
        """``ranks`` arrive at a barrier together, each from its own thread, and wait."""
        results: dict[int, object] = {}

        def rank(r: int) -> None:
            try:
                results[r] = self.views[r].arrive_and_wait(BARRIER, [r], world_size, TIMEOUT)
            except Exception as error:  # noqa: BLE001 - the test reads it
                results[r] = error

        threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        return results

    def close(self) -> None:
        self.relay.close()
        for relay in self.relays:
            relay.close()
        for client in [*self.clients, self.relay_client]:
            client.close()


@pytest.fixture
def host(etcd: EtcdServer, run_id: str, tmp_path: Path) -> Iterator[Host]:
    made = Host(etcd, run_id, tmp_path / "relay.sock")
    yield made
    made.close()


def test_a_barrier_of_eight_local_ranks_is_one_transaction_and_one_watch(host: Host) -> None:
    relay_before = host.relay_client.requests_by_kind.copy()
    results = host.barrier(list(range(RANKS)), RANKS)
    assert set(results.values()) == {""}, results
    relayed = host.relay_client.requests_by_kind - relay_before
    assert host.relay.batches == 1 and host.relay.arrivals == RANKS  # every local arrival in one transaction
    assert relayed["txn"] == 3  # with the publishing rank's two writes (the last arriver, the result)
    assert relayed["watch"] <= 1  # one watch for the barrier's result (none if it came before the first wait)
    ranks = sum((client.requests_by_kind for client in host.clients), collections.Counter())
    assert ranks["txn"] == ranks["watch"] == 0, ranks  # no arrival, write or watch of their own
    assert sum(ranks.values()) <= 2, ranks  # the publisher's write lease, and its compare_set's read
    assert all(relay.bypassed == 0 for relay in host.relays)
    assert host.stores[0].arrivals(barrier_count_slots(f"iteration/1/{BARRIER}")) in (0, RANKS)


def test_a_dead_local_rank_is_still_counted_out_and_holds_the_batch_only_its_linger(host: Host) -> None:
    """Rank 7 died: its agent arrives for it straight at etcd (a report). The other seven's batch leaves after
    the relay's linger, not at the barrier's timeout, and the barrier completes with all eight counted once."""
    started = time.monotonic()
    waiting = threading.Thread(target=lambda: results.update(host.barrier(list(range(7)), RANKS)))
    results: dict[int, object] = {}
    waiting.start()
    time.sleep(0.3)
    agents_store = EtcdStore(host.clients[7], host.prefix, TIMEOUT)  # no relay; held: a PrefixStore keeps only C++
    reporter = iteration_store(agents_store, 1)
    reporter.arrive_and_wait(BARRIER, [7], RANKS, timedelta(0))
    waiting.join(30)
    assert set(results.values()) == {""} and len(results) == 7, results
    assert time.monotonic() - started < 5
    assert host.relay.arrivals == 7


def test_the_relay_dying_mid_barrier_loses_no_arrival_and_counts_none_twice(host: Host) -> None:
    """Four ranks' batch is in etcd when the relay goes; the other four (and the first four, waiting on the
    relay's watch) go to etcd themselves. Every rank gets the one result; the barrier counted eight arrivals."""
    early: dict[int, object] = {}
    waiting = threading.Thread(target=lambda: early.update(host.barrier([0, 1, 2, 3], RANKS)))
    waiting.start()
    deadline = time.monotonic() + 10
    while host.relay.arrivals < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host.relay.arrivals == 4
    host.relay.close()  # the relay dies with four arrivals committed and four ranks waiting on its watch
    late = host.barrier([4, 5, 6, 7], RANKS)
    waiting.join(30)
    assert {**early, **late} == dict.fromkeys(range(RANKS), ""), (early, late)
    assert host.views[0].barriers._arrivals(BARRIER) == RANKS
    assert all(relay.bypassed >= 1 for relay in host.relays[4:])


def test_an_arrival_the_relay_committed_but_never_answered_counts_once(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The relay commits an arrival and its answer is lost (it stops right after): the rank waits its patience,
    then sends the same arrival to etcd, where its token makes it count once."""
    base = host.stores[0]
    committed: list[int | None] = []

    def commit_without_answer(slots: str, taken: list) -> None:
        pairs = [pair for item in taken for pair in item.body]
        committed.extend(host.relay._store.arrive_batch(pairs, slots))

    monkeypatch.setattr(host.relay, "_send_arrivals", commit_without_answer)
    monkeypatch.setattr(node_relay, "RELAY_PATIENCE", 0.5)
    assert base.arrive_batch([("x/arrived/0", "tok")], "x/slots/") == [1]
    assert committed == [1] and host.relays[0].bypassed == 1
    assert base.arrivals("x/slots/") == 1


def test_what_a_client_sends_is_checked(host: Host, tmp_path: Path) -> None:
    """A key outside the run, a malformed batch or line: answered with an error (or the connection ends); the
    rank's store then goes to etcd itself, and the relay goes on serving the others."""
    outside = RelayClient(host.relay.path)
    with pytest.raises(ConnectionError, match="expected a key under"):
        outside.arrive_batch([("/elsewhere/x", "t")], f"{host.prefix}slots/", 5)
    with pytest.raises(ConnectionError, match="1 to 32"):
        outside.arrive_batch([(f"{host.prefix}k{i}", "t") for i in range(33)], f"{host.prefix}slots/", 5)
    with pytest.raises(ConnectionError, match="expected a key under"):  # a heartbeat reading outside the run
        outside.put_latest(f"{host.prefix}beat", b"1", 5, read=["/elsewhere/x"])
    outside.close()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect(host.relay.path)
    raw.sendall(b"[1, 2]\n")  # not an object: the relay ends this connection only
    raw.settimeout(5)
    assert raw.recv(100) == b""
    raw.close()
    results = host.barrier(list(range(RANKS)), RANKS)
    assert set(results.values()) == {""}
    assert all(relay.bypassed == 0 for relay in host.relays)
    with pytest.raises(ValueError, match="absolute path"):
        relay_from_env({node_relay.RELAY_ENV: "relay.sock"})
    with pytest.raises(ValueError, match="linger"):
        NodeRelay(host.relay_client, host.root, RANKS, str(tmp_path / "x"), linger=5)
    assert relay_from_env({}) is None


def test_no_relay_at_the_path_means_etcd_directly(etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    client = EtcdClient(etcd.endpoints)
    relay = RelayClient(str(tmp_path / "nobody.sock"))
    store = EtcdStore(client, f"/elastic_ft/{run_id}/round/0/store/", TIMEOUT, relay=relay)  # held, as above
    view = iteration_store(store, 1)
    assert view.arrive_and_wait("b", [0, 1], 2, TIMEOUT) == ""
    assert relay.relayed == 0 and relay.bypassed >= 1
    client.close()


def test_a_forked_child_does_not_use_its_parents_connection(host: Host) -> None:
    """The Wrapper forks its monitor process; a child must open its own connection, never answer or read the
    parent's."""
    relay, slots = host.relays[0], f"{host.prefix}forked/slots/"
    assert relay.arrive_batch([(f"{host.prefix}forked/parent", "p")], slots, 10) == [1]
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child: the relay client only (no gRPC after a fork)
        code = 1
        try:
            code = 0 if relay.arrive_batch([(f"{host.prefix}forked/child", "c")], slots, 10) == [2] else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert relay.arrive_batch([(f"{host.prefix}forked/after", "a")], slots, 10) == [3]
    assert relay.bypassed == 0


def test_a_hosts_heartbeats_and_their_ring_checks_are_one_request(host: Host) -> None:
    """Eight monitors heartbeat at the same instant, each reading its ring successor's records: the relay takes
    each heartbeat at once and writes them, with the reads, in one transaction."""
    from elastic_ft.coordination.job import job_store

    jobs = [job_store(store) for store in host.stores]
    before = host.relay_client.requests_by_kind.copy()
    for heartbeat in range(2):
        looks: dict[int, object] = {}
        threads = [
            threading.Thread(
                target=lambda r=rank, job=job, seen=looks: seen.update(
                    {r: job.liveness.send_heartbeat(r, ring=(r + 1) % RANKS)}
                )
            )
            for rank, job in enumerate(jobs)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        deadline = time.monotonic() + 5
        while host.relay.sent["put"] < heartbeat + 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # nothing more leaves: one batch took all eight
        assert host.relay.sent["put"] == heartbeat + 1 and host.relay.carried["put"] == RANKS * (heartbeat + 1)
        assert host.relay.sent["look"] == 0
        assert all(left is False for left, _ in looks.values()), looks  # type: ignore[misc]
        # The reads follow the writes in the transaction: each sees its successor's beat of this round.
        assert all(beat is not None for _, beat in looks.values()), looks  # type: ignore[misc]
    relayed = host.relay_client.requests_by_kind - before
    assert relayed["txn"] == 2  # one request a round, for the whole host's heartbeats and ring checks
    assert sum(client.requests for client in host.clients) == 0  # the ranks asked etcd nothing themselves


def test_a_stopped_relay_costs_a_heartbeat_a_quarter_second_not_the_heartbeat(host: Host) -> None:
    """A relay that takes nothing (its agent stopped): the monitor writes its heartbeat itself after 0.25 s,
    and goes to etcd directly for a while after that."""
    from elastic_ft.coordination.job import job_store

    asked: list[dict] = []
    host.relay._dispatch = lambda peer, message: asked.append(message)  # type: ignore[method-assign]
    job = job_store(host.stores[0])
    started = time.monotonic()
    job.liveness.send_heartbeat(0)
    assert 0.2 <= time.monotonic() - started < 2 and host.relays[0].bypassed == 1
    assert job.liveness.heartbeat(0) is not None  # straight to etcd: the relay is not asked again for a while
    job.liveness.send_heartbeat(0)
    time.sleep(0.5)  # time for a request sent to the relay to reach it
    assert len(asked) == 1, asked  # only the first heartbeat asked the relay, and waited for it
    assert host.relays[0].bypassed == 3 and host.clients[0].requests_by_kind["txn"] >= 2


def test_a_stopped_relay_costs_a_heartbeat_with_its_ring_check_a_quarter_second_too(host: Host) -> None:
    """A heartbeat that reads waits for the relay's read, but must hear within 0.25 s that the relay took it."""
    from elastic_ft.coordination.job import job_store

    host.relay._dispatch = lambda peer, message: None  # type: ignore[method-assign]
    jobs = [job_store(store) for store in host.stores[:2]]
    jobs[1].liveness.send_heartbeat(1)
    started = time.monotonic()
    left, beat = jobs[0].liveness.send_heartbeat(0, ring=1)
    assert 0.2 <= time.monotonic() - started < 2
    assert left is False and beat is not None  # read by the monitor itself, in its own heartbeat's request
    assert jobs[0].liveness.heartbeat(0) is not None


def test_a_hangs_verdict_among_64_ranks_on_8_nodes_reads_the_judges_look_once_per_node(
    etcd: EtcdServer, run_id: str, tmp_path: Path
) -> None:
    """The monitors' own verdict path: the iteration's rank 0 judges (its monitor reads every peer once and
    publishes the few heartbeats that decide); the other 63 read that look, one small read per host through
    the relays, not every peer. Initial rank 37 stopped first, outside any collective: every rank blames it."""
    from elastic_ft.coordination.job import job_store
    from elastic_ft.inprocess.hangs.heartbeats import ProgressTimestamps
    from elastic_ft.inprocess.hangs.monitor import MonitorConfig, _Iteration, _Monitor
    from elastic_ft.inprocess.hangs.verdicts import EVIDENCE_KEPT, RankActivity

    hosts = [Host(etcd, run_id, tmp_path / f"relay-{node}.sock", linger=0.05) for node in range(8)]
    stores = {8 * node + local: host.stores[local] for node, host in enumerate(hosts) for local in range(8)}
    jobs = {rank: job_store(store) for rank, store in stores.items()}
    read_end, write_end = os.pipe()
    monitors: dict[int, _Monitor] = {}
    try:
        now = time.time()
        stopped_at = {rank: now - 30 if rank == 37 else now - 20 + rank / 100 for rank in jobs}
        for rank, job in jobs.items():
            job.liveness.send_heartbeat(rank, active_at=stopped_at[rank], waiting=rank != 37, next_in=1.0)
            job.record_position(rank, iteration=0, rank=rank, world_size=64, active=True)
        deadline = time.monotonic() + 5
        while sum(host.relay.carried["put"] for host in hosts) < 64 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # the last batches are in etcd
        for rank in jobs:
            config = MonitorConfig(rank, 64, 0.05, 0.5, 20.0, 60.0, 90.0, 1.0, 5.0, None, None, 20)
            timestamps = ProgressTimestamps(1.5, 3.0)
            timestamps.set_waiting(rank != 37)
            monitors[rank] = _Monitor(config, timestamps, dict, {}, os.getpid(), read_end, 2)
            monitors[rank].iteration = _Iteration(0, rank, 64, iteration_store(stores[rank], 0))

        def activity(rank: int) -> RankActivity:
            idle = time.time() - stopped_at[rank]
            return RankActivity(progress_age=idle, cpu_idle_for=idle, stopped=False, threads_silent_for=0.1)

        relay_requests = sum(host.relay_client.requests for host in hosts)
        rank_requests = sum(client.requests for host in hosts for client in host.clients)
        assert monitors[0].culprit(jobs[0], activity(0))[0].rank == 37  # the judge reads every peer
        judged = sum(host.relay_client.requests for host in hosts) - relay_requests
        assert judged <= 3, judged  # 3 x 63 keys (two reads of 128) and its look's write
        # The relay took the look at once and writes it within its gather window: the others look later (the
        # judge looks from half its soft timeout on, they at theirs).
        direct = job_store(EtcdStore(hosts[0].relay_client, hosts[0].prefix, TIMEOUT))
        deadline = time.monotonic() + 5
        while direct.liveness.peer_look(None)[0] is None and time.monotonic() < deadline:
            time.sleep(0.01)
        relay_requests = sum(host.relay_client.requests for host in hosts)
        culprits: dict[int, int] = {}

        def blame(rank: int) -> None:
            culprits[rank] = monitors[rank].culprit(jobs[rank], activity(rank))[0].rank

        threads = [threading.Thread(target=blame, args=(rank,)) for rank in range(1, 64)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert culprits == dict.fromkeys(range(1, 64), 37)
        reads = sum(host.relay_client.requests for host in hosts) - relay_requests
        assert reads <= 2 * 8, reads  # the look, gathered per host (a host's looks may leave in two windows)
        assert sum(client.requests for host in hosts for client in host.clients) == rank_requests
        assert all(len(monitors[rank]._stalled_peers) <= 4 * EVIDENCE_KEPT for rank in range(1, 64))
    finally:
        for monitor in monitors.values():
            if monitor.pidfd is not None:
                os.close(monitor.pidfd)
        for fd in (read_end, write_end):
            os.close(fd)
        for host in hosts:
            host.close()


def test_a_hosts_store_writes_of_the_moment_are_one_request_each_applied_once(host: Host) -> None:
    """Eight ranks write at once (their records, an ``add`` each on one counter, a ``compare_set`` race): the
    relay nests the writes that touch different keys in one request, and leaves a key's second write to the next;
    every write applies once, with the semantics of a store of its own."""
    go = threading.Barrier(RANKS)
    won: list[bytes] = []

    def rank(r: int) -> None:
        store = host.stores[r]
        go.wait()
        store.set(f"record/{r}", f"rank {r}")
        store.add("counter", 1)
        won.append(store.compare_set("winner", "", f"rank {r}"))

    before = host.relay_client.requests_by_kind["txn"]
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    store = host.stores[0]
    assert [store.get(f"record/{r}") for r in range(RANKS)] == [f"rank {r}".encode() for r in range(RANKS)]
    assert store.get("counter") == str(RANKS).encode()  # each add once, whatever the batches
    assert len(set(won)) == 1 and won[0].startswith(b"rank ")  # one winner, seen by all
    writes = host.relay.carried["txn"]
    assert writes >= 3 * RANKS  # every write went through the relay
    assert host.relay.sent["txn"] < writes  # several per request
    assert host.relay_client.requests_by_kind["txn"] - before < writes
    assert all(relay.bypassed == 0 for relay in host.relays)


def test_a_write_whose_answer_the_relay_lost_applies_once(host: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay commits a write and never answers (stopped right after): the rank resends it to etcd after its
    patience, and its token makes the resend find the first commit instead of applying it again."""
    monkeypatch.setattr(node_relay, "RELAY_PATIENCE", 0.5)
    original = host.relay._send_txns

    def commit_without_answer(name: str, taken: list) -> None:
        host.relay._store.client.txns([item.body[0] for item in taken])

    monkeypatch.setattr(host.relay, "_send_txns", commit_without_answer)
    store = host.stores[0]
    assert store.add("once", 5) == 5
    assert store.get("once") == b"5" and host.relays[0].bypassed == 1
    assert store.writes_recovered == 1  # learnt from its token: applied by the relay, not again
    monkeypatch.setattr(host.relay, "_send_txns", original)


def test_a_write_outside_the_run_is_refused(host: Host) -> None:
    from elastic_ft.etcd.client import put_op, txn_request

    relay = RelayClient(host.relay.path)
    with pytest.raises(ConnectionError, match="expected a key under"):
        relay.txn(txn_request([], [put_op("/elsewhere/key", b"x")]), 5)
    relay.close()


def test_a_hosts_events_are_numbered_together_and_stored_once(host: Host, run_id: str) -> None:
    """Eight ranks' events of the moment: one transaction through the relay, consecutive numbers, and the log
    reads each once, also when a writer stored one itself again after the relay had (a stalled relay)."""
    from elastic_ft.etcd.event_log import EventLog
    from elastic_ft.keys import RunKeys
    from elastic_ft.observability.events import JobEvent

    log = EventLog(host.relay_client, RunKeys("/elastic_ft", run_id), 100)
    host.relay._events = log
    events = [
        JobEvent(name="recovery_phases", source="worker", time=time.time(), run_id=run_id, rank=r) for r in range(RANKS)
    ]
    numbers: dict[int, int] = {}
    threads = [
        threading.Thread(target=lambda r=r: numbers.update({r: host.relays[r].append_event(events[r], f"id{r}")}))
        for r in range(RANKS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert sorted(numbers.values()) == list(range(RANKS)) and host.relay.sent["event"] == 1
    log.append(events[3], "id3")  # the writer of event 3 stored it again (its relay seemed stalled)
    read = log.read()
    assert [event.rank for event in read.events] == [events[r].rank for r in sorted(numbers, key=numbers.get)]


def test_writes_that_go_together_never_write_a_key_twice_and_always_include_the_first() -> None:
    from elastic_ft.etcd.node_relay import _Request, _writable

    def write(name: str, keys: set[bytes], size: int = 100) -> _Request:
        return _Request(None, 0, (name, keys, size))  # type: ignore[arg-type]

    a, b, c, d = write("a", {b"k1"}), write("b", {b"k2"}), write("c", {b"k1", b"k3"}), write("d", {b"k4"})
    taken, left = _writable([a, b, c, d])
    assert taken == [a, b] and left == [c, d]  # c writes k1 again: it and what follows wait, in order
    huge = write("huge", {b"k9"}, size=2 << 20)
    assert _writable([huge, a]) == ([huge], [a])  # an oversized write still leaves, alone


def test_a_read_nobody_else_makes_leaves_at_once(host: Host) -> None:
    """Only the monitors' periodic reads wait for the host's others; a restart's read (the termination
    result's look at the joiners, say) leaves at once, whatever the relay's gather time."""
    from elastic_ft.coordination.barriers import read_existing
    from elastic_ft.coordination.job import job_store

    host.relay.gather = 0.5
    job = job_store(host.stores[0])
    job.liveness.send_heartbeat(0)
    started = time.monotonic()
    assert read_existing(job.store, ["nothing/here"]) == {}
    assert time.monotonic() - started < 0.4
    assert host.relay.sent["read"] == 1 and host.relays[0].bypassed == 0
