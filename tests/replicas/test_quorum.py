"""The quorum rule, the records it reads, and the healing plan (pure)."""

from __future__ import annotations

import pytest

from elastic_ft.keys import RunKeys, parse_quorum_key, parse_replica_member_key, run_root_of_round_store
from elastic_ft.replicas.quorum import (
    NO_QUORUM,
    MemberRecord,
    Quorum,
    check_replica_id,
    complete_groups,
    next_quorum,
    plan_healing,
)
from elastic_ft.untrusted import MalformedRecord


def members(*replicas: str, size: int = 1, step: int = 0, failed: int = NO_QUORUM) -> list[MemberRecord]:
    return [MemberRecord(replica, rank, size, step, failed=failed) for replica in replicas for rank in range(size)]


def test_the_first_quorum_waits_for_min_replicas_then_takes_every_complete_group() -> None:
    waiting = next_quorum(None, members("a"), min_replicas=2)
    assert waiting.quorum is None and "waiting for 2" in waiting.reason
    formed = next_quorum(None, members("b", "a"), min_replicas=2)
    assert formed.changed and formed.quorum == Quorum(0, ("a", "b"), 1)


def test_an_unchanged_membership_keeps_the_quorum() -> None:
    current = Quorum(3, ("a", "b"), 2)
    decision = next_quorum(current, members("a", "b", size=2), min_replicas=1)
    assert (decision.quorum, decision.changed, decision.reason) == (current, False, "unchanged")


def test_a_complete_newcomer_joins_at_once() -> None:
    decision = next_quorum(Quorum(3, ("a",), 1), members("a", "c"), min_replicas=1)
    assert decision.changed and decision.quorum == Quorum(4, ("a", "c"), 1) and decision.reason == "joined ['c']"


def test_a_group_lost_without_a_failure_is_left_out_once_the_grace_ends() -> None:
    """Its records may have gone with a lease etcd let expire (they come back); a group that died makes a
    collective fail, and the failure path leaves it out at once."""
    current = Quorum(3, ("a", "b"), 2)
    records = members("a", "c", size=2) + [MemberRecord("b", 0, 2, 7)]  # b's rank 1 is gone
    holding = next_quorum(current, records, min_replicas=1)
    assert holding.quorum == current and holding.holding and not holding.changed
    decision = next_quorum(current, records, min_replicas=1, grace_over=True)
    assert decision.quorum == Quorum(4, ("a", "c"), 2)
    assert decision.reason == "lost ['b']; joined ['c']"
    failed = next_quorum(current, members("a", failed=3, size=2) + records[2:], min_replicas=1)
    assert failed.quorum == Quorum(4, ("a", "c"), 2) and not failed.holding


def test_a_group_of_another_size_never_joins() -> None:
    current = Quorum(0, ("a",), 2)
    decision = next_quorum(current, members("a", size=2) + members("b", size=1), min_replicas=1)
    assert decision.quorum == current and not decision.changed


def test_a_failure_waits_for_every_group_to_see_it_until_the_grace_ends() -> None:
    current = Quorum(5, ("a", "b", "c"), 1)
    records = members("a", "b", failed=5) + members("c")
    waiting = next_quorum(current, records, min_replicas=1)
    assert waiting.quorum == current and not waiting.changed and "waiting for ['c']" in waiting.reason
    all_saw = next_quorum(current, records[:2] + members("c", failed=5), min_replicas=1)
    assert all_saw.quorum == Quorum(6, ("a", "b", "c"), 1) and all_saw.reason == "quorum 5 failed"
    over = next_quorum(current, records, min_replicas=1, grace_over=True)
    assert over.quorum == Quorum(6, ("a", "b"), 1) and "left out ['c']" in over.reason


def test_a_failure_seen_in_an_older_quorum_is_no_failure() -> None:
    current = Quorum(6, ("a", "b"), 1)
    assert next_quorum(current, members("a", "b", failed=5), min_replicas=1).quorum == current


def test_fewer_groups_than_min_replicas_means_no_quorum() -> None:
    decision = next_quorum(Quorum(1, ("a", "b"), 1), members("a"), min_replicas=2, grace_over=True)
    assert decision.quorum is None and "fewer than 2" in decision.reason


def test_complete_groups_need_every_rank_and_one_size() -> None:
    records = members("a", size=2) + [MemberRecord("b", 0, 2, 0), MemberRecord("b", 1, 3, 0)]
    assert sorted(complete_groups(records)) == ["a"]


def test_healing_spreads_the_members_behind_over_those_at_the_highest_step() -> None:
    plan = plan_healing([3, 5, 5, 2, 4])
    assert plan.step == 5 and plan.senders == {0: 1, 3: 2, 4: 1}
    assert plan_healing([7, 7]).senders == {}


def test_init_sync_gives_every_untrained_member_the_first_ones_weights() -> None:
    assert plan_healing([0, 0, 0], sync_all=True).senders == {1: 0, 2: 0}
    assert plan_healing([4, 4], sync_all=True).senders == {}  # trained replicas hold the same weights already


def test_records_round_trip_and_forged_ones_are_refused() -> None:
    record = MemberRecord("a", 1, 2, 9, quorum=3, failed=2)
    assert MemberRecord.decode("a", 1, record.encode()) == record
    quorum = Quorum(4, ("a", "b"), 2)
    assert Quorum.decode(quorum.encode()) == quorum
    with pytest.raises(MalformedRecord, match="step"):
        MemberRecord.decode("a", 0, b'{"group_world_size": 1, "step": -1, "quorum": -1, "failed": -1}')
    with pytest.raises(MalformedRecord, match="sorted list of distinct"):
        Quorum.decode(b'{"id": 1, "replicas": ["b", "a"], "group_world_size": 1}')
    with pytest.raises(MalformedRecord, match="replicas"):
        Quorum.decode(b'{"id": 1, "replicas": "a", "group_world_size": 1}')


def test_replica_ids_that_cannot_name_a_key_are_refused() -> None:
    assert check_replica_id("train_ddp_0") == "train_ddp_0"
    for bad in ("", "a/b", 3):
        with pytest.raises(ValueError, match="cannot name a replica group"):
            check_replica_id(bad)  # type: ignore[arg-type]


def test_the_replica_keys_parse_back() -> None:
    run = RunKeys("/elastic_ft", "job")
    keys = run.replicas
    member = keys.member("g0", 3)
    assert parse_replica_member_key(member[len(keys.members) :]) == ("g0", 3)
    assert parse_quorum_key(keys.quorum(12)[len(keys.quorums) :]) == 12
    assert parse_replica_member_key("g0/x") is None and parse_quorum_key("12") is None
    assert run_root_of_round_store(run.round_store(4)) == run.root
    assert run_root_of_round_store("/elastic_ft/job/other/") is None
    assert not keys.group_store(1, 0).startswith(keys.prefix)  # its writes stay out of the view
