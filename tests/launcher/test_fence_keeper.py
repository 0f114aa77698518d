"""The fence keeper against a real etcd: a node counted out gets a new fence generation, however fast it re-announces."""

from __future__ import annotations

import time

import pytest

from elastic_ft.launcher.fence_keeper import FenceKeeper
from elastic_ft.rendezvous import EtcdftRendezvousHandler
from elastic_ft.runtime.local_board import LocalBoard
from tests.rendezvous.test_handler import rendezvous_all

pytestmark = pytest.mark.integration


def test_a_lease_revoked_by_a_member_starts_a_new_generation_even_before_the_fence_lapsed(
    handler_pair: list[EtcdftRendezvousHandler],
) -> None:
    """A member that confirms a node lost revokes its lease and absorbs its ranks. On a loaded host the node can
    hold a new lease before its fence keeper looks again, while the old lease's proof still runs: the fence
    never lapsed, yet the node was counted out, and its workers must restart into the job's membership (a
    kept generation let them ask to rejoin while it still could not reach its peers, again and again)."""
    node, member = handler_pair
    rendezvous_all(handler_pair)
    board = LocalBoard.create(2, f"fence-test {node.node}")
    generations: list[int] = []
    keeper = FenceKeeper(node, board, lambda: generations.append(keeper.generation))
    try:
        now = time.monotonic()
        keeper.tick(now)
        first_lease, proof = node.presence.lease_proof()
        assert keeper.generation == 1 and proof > now + 5, (keeper.generation, proof - now)
        member.revoke(node.node, first_lease, "its probes confirmed it lost (the test)")
        deadline = time.monotonic() + 15
        while node.presence.lease_proof()[0] in (0, first_lease):  # the agent's loop notices and re-announces
            assert time.monotonic() < deadline, "the node did not announce itself on a new lease"
            node.membership_change()
            time.sleep(0.05)
        keeper.tick(time.monotonic())  # the first look since the revoke: the old proof has seconds left
        assert keeper.generation == 2 and generations == [2]
        assert not board.may_join()  # its new workers wait until the probes reach every other member
        keeper.tick(time.monotonic())
        assert keeper.generation == 2 and generations == [2]  # one new lease, one new generation
    finally:
        board.close(remove=True)
