"""A member node's deaths as an agent absorbs them (``DeadMembers``), against a real etcd and a round's store."""

from __future__ import annotations

import os
import time

import pytest

from elastic_ft.coordination.iteration import iteration_store
from elastic_ft.coordination.job import WITHDRAWN, JobView, job_store
from elastic_ft.keys import FTRUN_NODES
from elastic_ft.launcher.dead_members import DeadMembers
from elastic_ft.launcher.records import NodeRecord
from elastic_ft.rendezvous import EtcdftRendezvousHandler
from tests.rendezvous.test_handler import rendezvous_all

pytestmark = pytest.mark.integration

WORLD = 4


def _publish(store: object, node: EtcdftRendezvousHandler, ranks: tuple[int, ...]) -> None:
    """The node's agent publishes the initial ranks its workers run now (as it does after a rejoin)."""
    record = NodeRecord("127.0.0.1", 1, 0, ranks, tuple(os.getpid() for _ in ranks), WORLD)
    store.set(FTRUN_NODES + node.node, record.to_json())  # type: ignore[attr-defined]


def _count_out(
    node: EtcdftRendezvousHandler, member: EtcdftRendezvousHandler, deaths: DeadMembers, store: object
) -> None:
    """The member's probes confirm the node lost: it revokes the node's lease and absorbs the death."""
    lease, _ = node.presence.lease_proof()
    member.revoke(node.node, lease, "its probes confirmed it lost (the test)")
    deaths.revoked(node.node)
    assert deaths.absorb(store, member.membership_change()) == ()  # absorbed: none of its ranks unknown


def _announce_again(node: EtcdftRendezvousHandler, revoked: int) -> None:
    """The node still reaches etcd (cut off from its peers only): it announces itself on a new lease."""
    deadline = time.monotonic() + 15
    while node.presence.lease_proof()[0] in (0, revoked):
        assert time.monotonic() < deadline, "the node did not announce itself on a new lease"
        node.membership_change()
        time.sleep(0.05)


def _rejoin(job: JobView, old: int, new: int) -> None:
    """A rank counted out while it lived joins again in its process, under a new initial rank, and waits."""
    job.record_left(old, "rejoined", False, f"joins again as initial rank {new}")
    job.record_wrapped(new, os.getpid())
    job.register_joiner(new)


def test_a_node_counted_out_again_reports_its_admitted_ranks_and_withdraws_its_waiting_joiners(
    handler_pair: list[EtcdftRendezvousHandler],
) -> None:
    """A node cut off from its peers but not from etcd is counted out again and again while it announces itself
    again. Its ranks rejoin in their own processes one at a time: counted out with one rank admitted back and
    the other still waiting as a joiner, the admitted one is reported gone and the waiting one withdrawn (no
    restart may admit a process that died with its node; one that lives joins again: tests/inprocess/
    test_joining.py). With no rank admitted since, nothing is reported: its waiting joiners are left alone."""
    node, member = handler_pair
    infos = rendezvous_all(handler_pair)
    store = infos[1].store
    job = job_store(store)
    job.set_accepts_joiners()
    for rank in range(WORLD):
        job.record_wrapped(rank, os.getpid())
        job.record_position(rank, 0, rank, WORLD, True)
    _publish(store, node, (2, 3))
    deaths = DeadMembers(member)

    first_lease, _ = node.presence.lease_proof()
    _count_out(node, member, deaths, store)
    assert sorted(iteration_store(store, 0).terminated_ranks()) == [2, 3]

    # Both ranks rejoin and a restart admits them into iteration 1; the node holds a new lease.
    _announce_again(node, first_lease)
    for old, new, rank in ((2, 4, 2), (3, 5, 3)):
        _rejoin(job, old, new)
        assert job.claim_admission(new, "1") == "1"
        job.record_position(new, 1, rank, WORLD, True)
    _publish(store, node, (4, 5))

    # Counted out again: rank 4 rejoins as 6 (it waits for a restart) before rank 5 notices.
    second_lease, _ = node.presence.lease_proof()
    assert second_lease != first_lease
    _rejoin(job, 4, 6)
    _publish(store, node, (6, 5))
    _count_out(node, member, deaths, store)
    # Initial rank 5 (rank 3 of iteration 1), admitted since the first death, is reported gone, and initial
    # rank 6, waiting for a restart to admit it, is withdrawn.
    assert iteration_store(store, 1).terminated_ranks() == [3]
    assert job.admission(6) == WITHDRAWN

    # Counted out a third time before any of its ranks is admitted again: nothing to report.
    _announce_again(node, second_lease)
    _rejoin(job, 5, 7)
    _rejoin(job, 6, 8)
    _publish(store, node, (8, 7))
    _count_out(node, member, deaths, store)
    assert job.admission(7) is None and job.admission(8) is None
    assert iteration_store(store, 1).terminated_ranks() == [3]
