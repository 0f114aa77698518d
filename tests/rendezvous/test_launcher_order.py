"""New node ranks follow the launcher's order (Slurm's ``SLURM_PROCID``), which follows the network topology."""

from __future__ import annotations

import pytest

from elastic_ft.rendezvous.config import RendezvousConfigError
from elastic_ft.rendezvous.handler import launcher_order
from elastic_ft.rendezvous.model import Join, Member, RoundResult, join_value, parse_key
from elastic_ft.rendezvous.rules import assign_ranks
from tests.rendezvous.test_hostile_values import RawKey


def _join(node: str, revision: int, order: int | None) -> Join:
    return Join(node, 7, revision, f"{node}.host", 1000, False, order)


def test_a_first_round_ranks_its_nodes_in_slurm_order_not_join_order() -> None:
    joins = [_join("c", 1, 2), _join("a", 2, 0), _join("b", 3, 1)]
    assert [j.node for j in assign_ranks(None, joins, 8)] == ["a", "b", "c"]


def test_members_keep_their_ranks_and_newcomers_fill_in_slurm_order() -> None:
    previous = RoundResult(0, (Member("a", 1), Member("b", 1), Member("c", 1)), "a.host", 1)
    # b left; d and e arrive, e first, but d comes before e in Slurm's order.
    joins = [_join("a", 1, 0), _join("c", 2, 2), _join("e", 3, 4), _join("d", 4, 3)]
    assert [j.node for j in assign_ranks(previous, joins, 8)] == ["a", "d", "c", "e"]


def test_nodes_without_an_order_come_after_in_join_order() -> None:
    joins = [_join("x", 1, None), _join("y", 2, 5), _join("w", 3, None), _join("z", 4, 1)]
    assert [j.node for j in assign_ranks(None, joins, 8)] == ["z", "y", "x", "w"]


def test_the_order_travels_in_the_join_record_and_is_checked() -> None:
    fact = parse_key("round/0/join/n1", RawKey(join_value("h", 29500, order=12), 3, 9))
    assert fact is not None and fact.join is not None and fact.join.order == 12
    plain = parse_key("round/0/join/n1", RawKey(join_value("h", 29500), 3, 9))
    assert plain is not None and plain.join is not None and plain.join.order is None
    forged = parse_key("round/0/join/n1", RawKey(b'{"addr": "h", "port": 1, "order": -3}', 3, 9))
    assert forged is not None and forged.kind == "malformed" and "order" in forged.reason


def test_slurm_procid_is_the_order() -> None:
    assert launcher_order({}) is None
    assert launcher_order({"SLURM_PROCID": "3", "SLURM_NODEID": "1"}) == 3
    with pytest.raises(RendezvousConfigError, match="SLURM_PROCID must be an integer >= 0, got 'x1'"):
        launcher_order({"SLURM_PROCID": "x1"})
