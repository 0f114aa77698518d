"""The fencing decisions through an etcd outage (pure): ``elastic_ft.rendezvous.fencing``."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_ft.rendezvous import fencing
from elastic_ft.rendezvous.fencing import Vouch

PERIOD = 10.0
NOW = 1000.0
MEMBERS = frozenset({"b", "c"})


def test_a_proven_lease_is_the_fence() -> None:
    decision = fencing.fence(NOW + 7, {}, frozenset(), MEMBERS, NOW)
    assert (decision.valid_until, decision.vouched) == (NOW + 7, False)
    assert decision.reason == "its lease is proven alive"


def test_every_member_promising_extends_the_fence_to_the_earliest_promise() -> None:
    decision = fencing.fence(NOW + 2, {"b": NOW + 9, "c": NOW + 8}, frozenset(), MEMBERS, NOW)
    assert (decision.valid_until, decision.vouched) == (NOW + 8, True)
    assert "etcd is away for everybody" in decision.reason
    # Written while the lease's own proof still holds: the ranks never see the fence down in between.
    assert fencing.fence(NOW - 1, {"b": NOW + 9, "c": NOW + 8}, frozenset(), MEMBERS, NOW).valid_until == NOW + 8


@pytest.mark.parametrize(
    ("promised", "reaching", "why"),
    [
        ({"b": NOW + 9}, frozenset({"c"}), "member c reaches etcd: this node may be cut off from it"),
        ({"b": NOW + 9}, frozenset(), "member c has not promised (no answer)"),
        ({"b": NOW + 9, "c": NOW - 0.1}, frozenset(), "member c has not promised"),
    ],
)
def test_one_member_without_a_promise_leaves_the_fence_to_the_lease(
    promised: dict[str, float], reaching: frozenset[str], why: str
) -> None:
    decision = fencing.fence(NOW - 0.5, promised, reaching, MEMBERS, NOW)
    assert decision.valid_until == NOW - 0.5 and not decision.vouched
    assert why in decision.reason


def test_a_promise_binds_its_giver_whatever_it_answers_later() -> None:
    """b promised, then reached etcd again: its promise still holds until its end."""
    decision = fencing.fence(NOW - 1, {"b": NOW + 3, "c": NOW + 4}, frozenset({"b"}), MEMBERS, NOW)
    assert decision.valid_until == NOW + 3 and decision.vouched


def test_a_node_alone_has_only_its_lease() -> None:
    assert fencing.fence(NOW - 1, {}, frozenset(), frozenset(), NOW).valid_until == NOW - 1


def test_a_stale_node_asks_at_its_own_pace_and_renews_less_often() -> None:
    fresh, stale = NOW + 0.7 * PERIOD, NOW + 0.4 * PERIOD
    assert not fencing.should_ask(fresh, None, False, PERIOD, NOW)
    assert fencing.should_ask(stale, None, False, PERIOD, NOW)
    assert not fencing.should_ask(stale, NOW - 1.0, False, PERIOD, NOW)  # asked 1 s ago: every 1.25 s
    assert fencing.should_ask(stale, NOW - 1.3, False, PERIOD, NOW)
    assert not fencing.should_ask(stale, NOW - 1.3, True, PERIOD, NOW)  # every promise holds: renew every 2.5 s
    assert fencing.should_ask(stale, NOW - 2.6, True, PERIOD, NOW)


def test_a_node_promises_only_while_its_own_proof_is_stale() -> None:
    vouch, bound = fencing.answer("a", NOW + 0.6 * PERIOD, PERIOD, NOW)
    assert vouch == Vouch("a", True, 0.0) and bound == NOW
    vouch, bound = fencing.answer("a", NOW + 0.4 * PERIOD, PERIOD, NOW)
    assert vouch == Vouch("a", False, PERIOD) and bound == NOW + PERIOD


def test_every_node_of_an_outage_is_promised_for_before_its_proof_runs_out() -> None:
    """Leases refreshed up to a third of their TTL apart go stale in time for each other's asks."""
    for phase in (0.0, 0.1, 0.2, 1 / 3):
        asker_proof, answerer_proof = NOW + PERIOD, NOW + PERIOD + phase * PERIOD
        asked, t = None, NOW
        promised_at = None
        while t < asker_proof:
            if fencing.should_ask(asker_proof, asked, False, PERIOD, t):
                asked = t
                vouch, _ = fencing.answer("b", answerer_proof, PERIOD, t)
                if not vouch.proven:
                    promised_at = t
                    break
            t += 0.05
        assert promised_at is not None and promised_at < asker_proof - 0.5, (phase, promised_at)


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"node": "a", "proven": False, "promise": 10}, Vouch("a", False, 10.0)),
        ({"node": "a", "proven": True, "promise": 0}, Vouch("a", True, 0.0)),
        ({"node": "a", "proven": True, "promise": 5}, None),  # a proven node promises nothing
        ({"node": "a", "proven": False, "promise": -1}, None),
        ({"node": "a", "proven": False, "promise": float("inf")}, None),
        ({"node": "a", "proven": False, "promise": 1e9}, None),
        ({"node": "a", "proven": 1, "promise": 1}, None),
        ({"node": "", "proven": False, "promise": 1}, None),
        ({"node": "a" * 301, "proven": False, "promise": 1}, None),
        ({"node": "a", "proven": False, "promise": True}, None),
        (["a", False, 1], None),
        ("text", None),
    ],
)
def test_a_vouch_read_from_the_network_is_checked(document: object, expected: Vouch | None) -> None:
    assert Vouch.from_json(document) == expected


@pytest.mark.parametrize(
    ("confirmed", "own", "hold", "verdict"),
    [
        (True, None, NOW + 5, "absorb"),  # a probe's confirmation: the process trains no more
        (False, True, NOW + 5, "wait"),  # a promise (or the quiet window) holds
        (False, None, 0.0, "wait"),  # its own lease not proven since: etcd may be away for everybody
        (False, False, 0.0, "drop"),  # its own lease ended too: an outage, not a death
        (False, True, 0.0, "absorb"),  # a partition: this node reached etcd, the other did not
    ],
)
def test_a_lost_lease_is_a_death_only_when_this_nodes_own_lease_outlived_it(
    confirmed: bool, own: bool | None, hold: float, verdict: str
) -> None:
    decided, reason = fencing.death_verdict(confirmed_here=confirmed, own_lease=own, hold_until=hold, now=NOW)
    assert decided == verdict and reason


def test_a_new_lease_keeps_the_generation_only_when_the_fence_never_lapsed() -> None:
    assert fencing.next_generation(0, True, True)[0] == 1  # the node's first lease
    assert fencing.next_generation(3, False, True)[0] == 3  # the same lease
    assert fencing.next_generation(3, True, False)[0] == 3  # an outage: nobody can have counted it out
    assert fencing.next_generation(3, True, True)[0] == 4  # a lapse: its workers restart
    # The old lease ended before its proof: revoked by a member that counted the node out, lapse seen or not.
    assert fencing.next_generation(3, True, False, revoked=True)[0] == 4
    assert fencing.next_generation(3, False, False, revoked=True)[0] == 3  # the same lease: nothing ended


@given(
    st.floats(NOW - 20, NOW + 20),
    st.dictionaries(st.sampled_from(["b", "c", "d"]), st.floats(NOW - 20, NOW + 20)),
    st.sets(st.sampled_from(["b", "c", "d"])),
)
def test_the_fence_never_outlives_both_the_lease_and_every_promise(
    own: float, promised: dict[str, float], members: set[str]
) -> None:
    """Safety: the ranks may step only while the node's lease is proven, or while every other member is bound."""
    decision = fencing.fence(own, promised, frozenset(), frozenset(members), NOW)
    if decision.valid_until > own:
        assert members and all(promised.get(node, 0.0) >= decision.valid_until for node in members)
    assert decision.valid_until >= own


def test_an_outage_and_a_partition_are_told_apart_from_what_every_node_answers() -> None:
    """Three nodes; each answers from its own proof. Whoever still reaches etcd keeps the cut-off node fenced."""
    for stale_nodes in itertools.chain.from_iterable(itertools.combinations("abc", k) for k in (1, 2, 3)):
        proofs = {node: NOW + (0.2 if node in stale_nodes else 0.9) * PERIOD for node in "abc"}
        for node in stale_nodes:
            promised, reaching = {}, set()
            for other in set("abc") - {node}:
                vouch, _ = fencing.answer(other, proofs[other], PERIOD, NOW)
                if vouch.proven:
                    reaching.add(other)
                else:
                    promised[other] = NOW + vouch.promise
            later = NOW + 0.5 * PERIOD  # its own proof has run out by then
            decision = fencing.fence(proofs[node], promised, frozenset(reaching), frozenset(set("abc") - {node}), later)
            everybody_away = len(stale_nodes) == 3
            assert decision.vouched == everybody_away, (stale_nodes, node, decision)
