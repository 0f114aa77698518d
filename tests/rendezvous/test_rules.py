"""The rendezvous decisions as pure functions of explicit state: no etcd, no clock."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from elastic_ft.rendezvous import model, rules
from elastic_ft.rendezvous.model import Join, Member, RendezvousState, RoundRecord, RoundResult
from elastic_ft.rendezvous.rules import CloseRound, CloseVerdict, Done, JoinRound, Limits, Wait

LIMITS = Limits(min_nodes=2, max_nodes=4, last_call_timeout=5.0)


def verdict_of(*args: object, **kwargs: object) -> tuple[CloseVerdict, float | None]:
    """``close_verdict`` without its reason, for comparisons."""
    decision = rules.close_verdict(*args, **kwargs)  # type: ignore[arg-type]
    assert decision.reason, "every close decision says why"
    return decision.verdict, decision.until


def join(node: str, rev: int, lease: int | None = None) -> Join:
    return Join(node, lease if lease is not None else hash(node) & 0xFFFF, rev, f"{node}.host", 1000 + rev)


def result(number: int, nodes: Iterable[str]) -> RoundResult:
    return RoundResult(number, tuple(Member(n, hash(n) & 0xFFFF) for n in nodes), "a.host", 1)


def make_state(
    *,
    alive: Iterable[str] = (),
    rounds: Iterable[RoundRecord] = (),
    closed: bool = False,
) -> RendezvousState:
    return RendezvousState(closed, {n: hash(n) & 0xFFFF for n in alive}, {r.number: r for r in rounds})


def joins(*items: Join) -> dict[str, Join]:
    return {j.node: j for j in items}


def test_first_round_waits_for_min_then_last_call_then_closes() -> None:
    one = make_state(alive=["a"], rounds=[RoundRecord(0, joins(join("a", 1)))])
    assert verdict_of(one, 0, LIMITS, now=0.0, last_call_since=None) == (CloseVerdict.WAIT_FOR_MIN, None)
    two = make_state(alive=["a", "b"], rounds=[RoundRecord(0, joins(join("a", 1), join("b", 2)))])
    assert verdict_of(two, 0, LIMITS, now=10.0, last_call_since=None) == (
        CloseVerdict.WAIT_FOR_LAST_CALL,
        15.0,
    )
    assert verdict_of(two, 0, LIMITS, now=14.9, last_call_since=10.0) == (
        CloseVerdict.WAIT_FOR_LAST_CALL,
        15.0,
    )
    assert verdict_of(two, 0, LIMITS, now=15.0, last_call_since=10.0) == (CloseVerdict.CLOSE, None)


def test_max_nodes_close_at_once() -> None:
    four = make_state(rounds=[RoundRecord(0, joins(*(join(n, i) for i, n in enumerate("abcd"))))])
    assert verdict_of(four, 0, LIMITS, now=0.0, last_call_since=None)[0] is CloseVerdict.CLOSE


def test_hot_spares_are_admitted_beyond_max_and_a_round_is_full_with_them() -> None:
    limits = Limits(min_nodes=2, max_nodes=2, last_call_timeout=5.0, spare_nodes=1)
    two = make_state(alive=["a", "b"], rounds=[RoundRecord(0, joins(join("a", 1), join("b", 2)))])
    # At max_nodes the round waits for its spare through last call ...
    assert verdict_of(two, 0, limits, now=0.0, last_call_since=None) == (CloseVerdict.WAIT_FOR_LAST_CALL, 5.0)
    assert verdict_of(two, 0, limits, now=5.0, last_call_since=0.0) == (CloseVerdict.CLOSE, None)
    # ... and closes at once when the spare is there.
    three = make_state(rounds=[RoundRecord(0, joins(join("a", 1), join("b", 2), join("s", 3)))])
    decision = rules.close_verdict(three, 0, limits, 0.0, None)
    assert decision.verdict is CloseVerdict.CLOSE and "spare_nodes=1" in decision.reason
    members = rules.assign_ranks(None, [join("s", 3), join("b", 2), join("a", 1), join("t", 4)], limits.capacity)
    assert [m.node for m in members] == ["a", "b", "s"]  # the latest joiner ranks last: a spare


def test_a_node_beyond_max_plus_spares_is_a_standby_not_waiting() -> None:
    limits = Limits(min_nodes=1, max_nodes=2, last_call_timeout=1.0, spare_nodes=1)
    full = result(0, "abs")
    state = make_state(
        alive=["a", "b", "s", "x"], rounds=[RoundRecord(0, result=full), RoundRecord(1, joins(join("x", 9)))]
    )
    assert rules.is_spare(state, 1, "x", limits)
    assert rules.waiting_count(rules.membership_change(state, full, limits)) == 0
    # A member dies: max_nodes members are still there, so nobody restarts for the waiting node ...
    dead = make_state(alive=["a", "s", "x"], rounds=[RoundRecord(0, result=full), RoundRecord(1, joins(join("x", 9)))])
    change = rules.membership_change(dead, full, limits)
    assert change.dead == ("b",) and change.admissible == ()
    # ... it joins the running round as a hot spare instead, above the members' group ranks.
    late = Limits(min_nodes=1, max_nodes=2, last_call_timeout=1.0, spare_nodes=1, late_joins=True)
    assert rules.late_place(dead, "x", late) == (0, 3)
    assert rules.next_action(dead, "x", hash("x") & 0xFFFF, None, late, 0.0, None) == rules.JoinLate(0, 3)
    assert rules.late_place(dead, "x", limits) is None  # only where ftrun's agent allows it
    # Below max_nodes members a node that only joins whole rounds (plain torchrun) is admissible: the world
    # grows through a restart ...
    two_dead = make_state(alive=["a", "x"], rounds=[RoundRecord(0, result=full), RoundRecord(1, joins(join("x", 9)))])
    assert rules.membership_change(two_dead, full, limits).admissible == ("x",)
    # ... while ftrun's node takes a place in the running round, and the world grows in-process.
    assert rules.late_place(two_dead, "x", late) == (0, 3)
    late_x = dataclasses.replace(join("x", 9), late_joins=True)
    growing = make_state(alive=["a", "x"], rounds=[RoundRecord(0, result=full), RoundRecord(1, joins(late_x))])
    assert rules.membership_change(growing, full, limits).admissible == ()


def test_late_members_hold_places_and_count_dead_when_their_lease_goes() -> None:
    late = Limits(min_nodes=1, max_nodes=2, last_call_timeout=1.0, spare_nodes=2, late_joins=True)
    running = result(0, "ab")
    x = model.LateMember("x", 7, 2)
    state = make_state(
        alive=["a", "b", "x", "y"], rounds=[RoundRecord(0, result=running, late={"x": x}, slots={2: "x"})]
    )
    assert rules.late_place(state, "y", late) == (0, 3)  # x holds place 2
    assert rules.late_place(state, "x", late) is None  # already in
    full = make_state(
        alive=["a", "b", "x", "y", "z"],
        rounds=[
            RoundRecord(0, result=running, late={"x": x, "y": model.LateMember("y", 8, 3)}, slots={2: "x", 3: "y"})
        ],
    )
    assert rules.late_place(full, "z", late) is None  # max_nodes + spare_nodes reached
    # x dies: its place is free again, and the members see it dead (its ranks are reported).
    y = model.LateMember("y", 8, 3)
    gone = make_state(
        alive=["a", "b", "y"], rounds=[RoundRecord(0, result=running, late={"x": x, "y": y}, slots={3: "y"})]
    )
    assert rules.membership_change(gone, running, late).dead == ("x",)
    assert rules.late_place(gone, "y", late) is None and rules.late_place(gone, "z", late) == (0, 2)
    # A late member whose node restarts its workers (an escalation) joins the next round: the members follow it,
    # as they follow a member that re-joined, rather than train on while it waits for them.
    escalated = make_state(
        alive=["a", "b", "x"],
        rounds=[RoundRecord(0, result=running, late={"x": x}, slots={2: "x"}), RoundRecord(1, joins(join("x", 5)))],
    )
    change = rules.membership_change(escalated, running, late)
    assert (change.rejoined, change.admissible, rules.waiting_count(change)) == (("x",), (), 1)
    # One whose place went with its lease (cut off, back on a new one) is a node like any other.
    returned = make_state(
        alive=["a", "x"],
        rounds=[RoundRecord(0, result=running, late={"x": x}), RoundRecord(1, joins(join("x", 5)))],
    )
    assert rules.membership_change(returned, running, late).rejoined == ()
    # A restart under way (a member re-joined the next round) or a member leaving: no late joins.
    restarting = make_state(
        alive=["a", "b", "y"], rounds=[RoundRecord(0, result=running), RoundRecord(1, joins(join("a", 5)))]
    )
    assert rules.late_place(restarting, "y", late) is None
    finishing = make_state(alive=["a", "y"], rounds=[RoundRecord(0, result=running, left=frozenset({"b"}))])
    assert rules.late_place(finishing, "y", late) is None


def test_late_member_keys_parse_and_malformed_ones_are_left_out() -> None:
    raw = {
        "round/0/late/x": model.RawKey(b'{"lease": 7, "place": 2}', 0, 5),
        "round/0/slot/2": model.RawKey(b'{"node": "x"}', 7, 5),
        "round/0/late/y": model.RawKey(b'{"lease": "seven"}', 0, 6),
        "round/0/slot/zz": model.RawKey(b'{"node": "y"}', 8, 6),
    }
    state = model.parse_state(raw)
    assert state.round(0).late == {"x": model.LateMember("x", 7, 2)} and state.round(0).slots == {2: "x"}
    assert list(state.malformed) == ["round/0/late/y"]


def test_close_decisions_say_why() -> None:
    one = make_state(rounds=[RoundRecord(0, joins(join("a", 1)))])
    assert (
        rules.close_verdict(one, 0, LIMITS, now=0.0, last_call_since=None).reason == "1 of min_nodes=2 node(s) joined"
    )
    two = make_state(rounds=[RoundRecord(0, joins(join("a", 1), join("b", 2)))])
    waiting = rules.close_verdict(two, 0, LIMITS, now=12.0, last_call_since=10.0)
    assert "2 node(s) joined" in waiting.reason and "last call for 3.0 s more" in waiting.reason
    running = make_state(
        alive=["a", "b", "c"],
        rounds=[RoundRecord(0, result=result(0, "ab")), RoundRecord(1, joins(join("c", 9)))],
    )
    assert rules.close_verdict(running, 1, LIMITS, now=0.0, last_call_since=None).reason == (
        "2 member(s) of round 0 still run and have not re-joined: a, b"
    )


def test_last_call_timer_starts_at_min_and_resets_below_it() -> None:
    two = make_state(rounds=[RoundRecord(0, joins(join("a", 1), join("b", 2)))])
    assert rules.last_call_started(two, 0, LIMITS, now=3.0, since=None) == 3.0
    assert rules.last_call_started(two, 0, LIMITS, now=4.0, since=3.0) == 3.0
    one = make_state(rounds=[RoundRecord(0, joins(join("a", 1)))])
    assert rules.last_call_started(one, 0, LIMITS, now=5.0, since=3.0) is None


def test_exclusivity_next_round_waits_for_running_members() -> None:
    # Round 0 = {a, b} is running; c arrives late and joins round 1.
    state = make_state(
        alive=["a", "b", "c"],
        rounds=[RoundRecord(0, result=result(0, "ab")), RoundRecord(1, joins(join("c", 9), join("x", 10)))],
    )
    assert rules.pending_members(state, 1) == [Member("a", hash("a") & 0xFFFF), Member("b", hash("b") & 0xFFFF)]
    verdict, _ = verdict_of(state, 1, LIMITS, now=100.0, last_call_since=0.0)
    assert verdict is CloseVerdict.WAIT_FOR_PREVIOUS
    action = rules.next_action(state, "c", hash("c") & 0xFFFF, 1, LIMITS, now=100.0, last_call_since=0.0)
    assert isinstance(action, Wait) and action.verdict is CloseVerdict.WAIT_FOR_PREVIOUS


def test_fast_rerendezvous_when_all_previous_members_rejoin() -> None:
    state = make_state(
        alive=["a", "b", "c"],
        rounds=[
            RoundRecord(0, result=result(0, "ab")),
            RoundRecord(1, joins(join("c", 5), join("a", 6), join("b", 7))),
        ],
    )
    assert verdict_of(state, 1, LIMITS, now=0.0, last_call_since=None) == (CloseVerdict.CLOSE, None)


def test_fast_rerendezvous_when_missing_member_is_dead() -> None:
    # b died (not alive): a rejoined, so the previous group is accounted for.
    state = make_state(
        alive=["a", "c"],
        rounds=[RoundRecord(0, result=result(0, "ab")), RoundRecord(1, joins(join("a", 6), join("c", 7)))],
    )
    assert verdict_of(state, 1, LIMITS, now=0.0, last_call_since=None)[0] is CloseVerdict.CLOSE


def test_no_fast_close_when_no_previous_member_came_back() -> None:
    # A whole new job under an old run id: nobody from round 0 is back, so
    # this is a fresh gathering and last call applies.
    state = make_state(
        alive=["x", "y"],
        rounds=[RoundRecord(0, result=result(0, "ab")), RoundRecord(1, joins(join("x", 6), join("y", 7)))],
    )
    assert verdict_of(state, 1, LIMITS, now=0.0, last_call_since=None)[0] is CloseVerdict.WAIT_FOR_LAST_CALL


def test_member_that_left_cleanly_is_not_pending() -> None:
    state = make_state(
        alive=["a", "b", "c"],
        rounds=[
            RoundRecord(0, result=result(0, "ab"), left=frozenset({"b"})),
            RoundRecord(1, joins(join("a", 6), join("c", 7))),
        ],
    )
    assert rules.pending_members(state, 1) == []


def test_rank_assignment_keeps_survivor_ranks_and_fills_gaps() -> None:
    previous = result(0, ["a", "b", "c", "d"])
    # b died; e and f are new; c and d keep ranks 2 and 3 if they still exist.
    members = rules.assign_ranks(previous, [join("f", 20), join("d", 3), join("a", 1), join("e", 10), join("c", 2)], 4)
    assert [m.node for m in members] == ["a", "e", "c", "d"]
    # A survivor whose rank no longer exists takes the lowest free rank.
    members = rules.assign_ranks(previous, [join("d", 3), join("a", 1)], 4)
    assert [m.node for m in members] == ["a", "d"]


def test_rank_assignment_first_round_by_join_order_and_caps_at_max() -> None:
    members = rules.assign_ranks(None, [join("c", 3), join("a", 1), join("e", 5), join("b", 2), join("d", 4)], 4)
    assert [m.node for m in members] == ["a", "b", "c", "d"]


def test_closer_is_earliest_joiner() -> None:
    assert rules.closer_of(joins(join("b", 7), join("a", 9))) == "b"
    assert rules.closer_of({}) is None


def test_next_action_sequence_for_one_node() -> None:
    lease = hash("a") & 0xFFFF
    empty = make_state(alive=["a"])
    assert rules.next_action(empty, "a", lease, None, LIMITS, 0.0, None) == JoinRound(0)
    ready = make_state(alive=["a", "b"], rounds=[RoundRecord(0, joins(join("a", 1), join("b", 2)))])
    action = rules.next_action(ready, "a", lease, 0, LIMITS, now=20.0, last_call_since=10.0)
    assert isinstance(action, CloseRound) and [j.node for j in action.members] == ["a", "b"]
    # b is not the closer: it waits for a's result.
    other = rules.next_action(ready, "b", hash("b") & 0xFFFF, 0, LIMITS, now=20.0, last_call_since=10.0)
    assert isinstance(other, Wait) and other.verdict is CloseVerdict.CLOSE
    done = make_state(alive=["a", "b"], rounds=[RoundRecord(0, result=result(0, "ba"))])
    assert rules.next_action(done, "a", lease, 0, LIMITS, 0.0, None) == Done(result(0, "ba"), 1)


def test_excluded_node_joins_next_round() -> None:
    state = make_state(alive=["a", "b", "z"], rounds=[RoundRecord(0, result=result(0, "ab"))])
    assert rules.next_action(state, "z", hash("z") & 0xFFFF, 0, LIMITS, 0.0, None) == JoinRound(1)


def test_member_with_new_lease_is_not_done() -> None:
    # a's lease expired and it has a new one: its membership is void.
    state = make_state(alive=["a", "b"], rounds=[RoundRecord(0, result=result(0, "ab"))])
    assert rules.next_action(state, "a", 424242, 0, LIMITS, 0.0, None) == JoinRound(1)


def test_closed_wins() -> None:
    state = make_state(closed=True, rounds=[RoundRecord(0, joins(join("a", 1)))])
    assert isinstance(rules.next_action(state, "a", 1, 0, LIMITS, 0.0, None), rules.Closed)


def test_spare_behind_full_healthy_round() -> None:
    limits = Limits(1, 2, 1.0)
    state = make_state(
        alive=["a", "b", "s"], rounds=[RoundRecord(0, result=result(0, "ab")), RoundRecord(1, joins(join("s", 9)))]
    )
    assert rules.is_spare(state, 1, "s", limits)
    assert rules.waiting_count(rules.membership_change(state, result(0, "ab"), Limits(1, 2, 1.0))) == 0
    # With room in the round the same node is counted as waiting.
    assert rules.waiting_count(rules.membership_change(state, result(0, "ab"), Limits(1, 3, 1.0))) == 1


def test_num_nodes_waiting_counts_rejoined_and_dead_members() -> None:
    member_of = result(0, "abc")
    rejoined = make_state(
        alive=["a", "b", "c"], rounds=[RoundRecord(0, result=member_of), RoundRecord(1, joins(join("b", 9)))]
    )
    assert rules.waiting_count(rules.membership_change(rejoined, member_of, Limits(1, 3, 1.0))) == 1
    dead = make_state(alive=["a", "b"], rounds=[RoundRecord(0, result=member_of)])
    assert rules.waiting_count(rules.membership_change(dead, member_of, Limits(1, 3, 1.0))) == 1
    left = make_state(alive=["a", "b"], rounds=[RoundRecord(0, result=member_of, left=frozenset({"c"}))])
    assert rules.waiting_count(rules.membership_change(left, member_of, Limits(1, 3, 1.0))) == 0
    assert rules.waiting_count(rules.membership_change(left, None, Limits(1, 3, 1.0))) == 0


def test_parse_state_round_trip() -> None:
    member_of = result(3, "ab")
    keys = {
        "closed": model.RawKey(b"{}", 0, 1),
        "alive/a": model.RawKey(b"{}", 7, 2),
        "round/3/result": model.RawKey(member_of.to_json(), 0, 3),
        "round/4/join/a": model.RawKey(model.join_value("h", 5), 7, 4),
        "round/3/left/b": model.RawKey(b"{}", 0, 5),
        "something/else": model.RawKey(b"ignored", 0, 6),
    }
    state = model.parse_state(keys)
    assert state.closed
    assert state.alive == {"a": 7}
    assert state.round(3).result == member_of
    assert state.round(4).joins["a"] == Join("a", 7, 4, "h", 5)
    assert state.round(3).left == {"b"}
    assert state.open_round == 4


def test_membership_change_tells_ftrun_what_moved() -> None:
    member_of = result(0, "ab")
    limits_max = Limits(1, 2, 1.0)
    # b died while spare s waits behind the full round: b is dead, and s now fits.
    state = make_state(alive=["a", "s"], rounds=[RoundRecord(0, result=member_of), RoundRecord(1, joins(join("s", 9)))])
    change = rules.membership_change(state, member_of, limits_max)
    assert change == rules.MembershipChange(dead=("b",), admissible=("s",))
    # b left cleanly (its job finished): no room is freed for the spare, and the
    # agents' exit barrier counts b as gone (it will never arrive).
    state = make_state(
        alive=["a", "s"],
        rounds=[RoundRecord(0, result=member_of, left=frozenset({"b"})), RoundRecord(1, joins(join("s", 9)))],
    )
    assert rules.membership_change(state, member_of, limits_max) == rules.MembershipChange(left=("b",))
    # a later round closed without this node.
    state = make_state(
        alive=["a", "b"], rounds=[RoundRecord(0, result=member_of), RoundRecord(1, result=result(1, "b"))]
    )
    assert rules.membership_change(state, member_of, limits_max).moved_on
    assert rules.membership_change(state, None, limits_max) == rules.MembershipChange()


def test_job_finished_once_every_member_of_the_last_round_left_cleanly() -> None:
    running = make_state(alive=["a", "b", "c"], rounds=[RoundRecord(0, result=result(0, "ab"), left=frozenset({"a"}))])
    assert not rules.job_finished(running)
    assert isinstance(rules.next_action(running, "c", hash("c") & 0xFFFF, None, LIMITS, 0.0, None), JoinRound)
    done = make_state(alive=["c"], rounds=[RoundRecord(0, result=result(0, "ab"), left=frozenset({"a", "b"}))])
    assert rules.job_finished(done)
    assert isinstance(rules.next_action(done, "c", hash("c") & 0xFFFF, None, LIMITS, 0.0, None), rules.Closed)
    # Members that died (no left key) do not end the job: survivors or a new job may follow.
    died = make_state(alive=["c"], rounds=[RoundRecord(0, result=result(0, "ab"))])
    assert not rules.job_finished(died)
    # A hot spare alive in the round that has not left yet still runs the job.
    late = {"s": model.LateMember("s", hash("s") & 0xFFFF, 2)}
    spare_runs = make_state(
        alive=["s"], rounds=[RoundRecord(0, result=result(0, "ab"), left=frozenset({"a", "b"}), late=late)]
    )
    assert not rules.job_finished(spare_runs)
    assert rules.job_finished(make_state(closed=True))
