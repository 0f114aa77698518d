"""Segments (ft_launcher's --ft-segment): whole segments of one label train, the rest wait as hot spares."""

from __future__ import annotations

import pytest

from elastic_ft.rendezvous import rules
from elastic_ft.rendezvous.config import RendezvousConfigError, make_settings
from elastic_ft.rendezvous.handler import node_segment
from elastic_ft.rendezvous.model import Join, Member, RoundRecord, RoundResult, join_value, parse_key
from elastic_ft.rendezvous.rules import CloseRound, CloseVerdict, Limits, segment_layout, whole_segment_nodes
from tests.rendezvous.test_hostile_values import RawKey
from tests.rendezvous.test_rules import joins, make_state


def _join(node: str, revision: int, segment: str | None, order: int | None = None) -> Join:
    return Join(node, 7, revision, f"{node}.host", 1000, False, order, segment)


def test_whole_segments_train_each_labels_together_and_the_rest_are_spares() -> None:
    # Two nodes of domain x, three of y, one of z, in rank order; segments of 2, at most 4 training.
    members = [_join("x1", 1, "x"), _join("y1", 2, "y"), _join("z1", 3, "z"), _join("y2", 4, "y"), _join("x2", 5, "x")]
    members.append(_join("y3", 6, "y"))
    ordered, active = segment_layout(members, segment=2, max_nodes=4)
    assert active == 4
    assert [j.node for j in ordered] == ["x1", "x2", "y1", "y2", "z1", "y3"]
    # max_nodes leaves room for one segment only: the first label's.
    ordered, active = segment_layout(members, segment=2, max_nodes=3)
    assert active == 2 and [j.node for j in ordered][:2] == ["x1", "x2"]
    assert whole_segment_nodes(members, 2) == 4 and whole_segment_nodes(members, 3) == 3
    assert whole_segment_nodes([_join("n", 1, None)], 1) == 0  # no label: in no segment


def test_min_nodes_counts_whole_segments_only() -> None:
    limits = Limits(min_nodes=4, max_nodes=4, last_call_timeout=5.0, spare_nodes=2, segment=2)
    # Five nodes, but x has one: only y's two segments... y has three, so one segment: 2 of 4.
    five = [_join("x1", 1, "x"), _join("y1", 2, "y"), _join("y2", 3, "y"), _join("y3", 4, "y"), _join("z1", 5, "z")]
    state = make_state(alive=[j.node for j in five], rounds=[RoundRecord(0, joins(*five))])
    decision = rules.close_verdict(state, 0, limits, 0.0, None)
    assert decision.verdict is CloseVerdict.WAIT_FOR_MIN
    assert "2 of min_nodes=4 node(s) joined in whole segments of 2 (5 joined)" in decision.reason
    # x's second node completes a segment: the round closes (capacity 6 reached), x's and y's segments training.
    six = [*five, _join("x2", 6, "x")]
    state = make_state(alive=[j.node for j in six], rounds=[RoundRecord(0, joins(*six))])
    action = rules.next_action(state, "x1", 7, 0, limits, 0.0, None)
    assert isinstance(action, CloseRound) and action.active == 4
    assert [j.node for j in action.members] == ["x1", "x2", "y1", "y2", "y3", "z1"]


def test_without_segments_the_close_names_no_active_count() -> None:
    limits = Limits(min_nodes=2, max_nodes=2, last_call_timeout=0.0)
    two = [_join("a", 1, "x"), _join("b", 2, "y")]
    state = make_state(alive=["a", "b"], rounds=[RoundRecord(0, joins(*two))])
    action = rules.next_action(state, "a", 7, 0, limits, 0.0, None)
    assert isinstance(action, CloseRound) and action.active is None


def test_the_label_and_the_active_count_travel_in_their_records_and_are_checked() -> None:
    fact = parse_key("round/0/join/n1", RawKey(join_value("h", 29500, segment="nvl-7"), 3, 9))
    assert fact is not None and fact.join is not None and fact.join.segment == "nvl-7"
    forged = parse_key("round/0/join/n1", RawKey(b'{"addr": "h", "port": 1, "segment": 5}', 3, 9))
    assert forged is not None and forged.kind == "malformed" and "segment" in forged.reason
    result = RoundResult(0, (Member("a", 1), Member("b", 1), Member("c", 1)), "a.host", 1, active=2)
    assert RoundResult.from_json(result.to_json()) == result
    assert RoundResult.from_json(RoundResult(0, (Member("a", 1),), "a.host", 1).to_json()).active is None
    too_many = result.to_json().replace(b'"active": 2', b'"active": 4')
    with pytest.raises(ValueError, match="round result has active=4; expected a whole number from 0 to 3"):
        RoundResult.from_json(too_many)


def test_a_nodes_label_comes_from_its_environment_or_slurms_topology() -> None:
    assert node_segment({}) is None
    assert node_segment({"ELASTIC_FT_NODE_SEGMENT": "rack-3"}) == "rack-3"
    assert node_segment({"SLURM_TOPOLOGY_ADDR": "core.leaf2.node7"}) == "core.leaf2"
    assert node_segment({"SLURM_TOPOLOGY_ADDR": "node7"}) is None  # no switch above it
    assert node_segment({"ELASTIC_FT_NODE_SEGMENT": "x", "SLURM_TOPOLOGY_ADDR": "s.n"}) == "x"
    with pytest.raises(RendezvousConfigError, match="ELASTIC_FT_NODE_SEGMENT='a b' is not a segment label"):
        node_segment({"ELASTIC_FT_NODE_SEGMENT": "a b"})


@pytest.mark.parametrize(
    ("nodes", "segment", "message"),
    [
        ((2, 4), "2", None),
        ((3, 4), "2", "segment=2 needs min_nodes and max_nodes that are multiples of it, got min_nodes=3"),
        ((2, 4), "0", "segment"),
    ],
)
def test_the_segment_size_divides_min_and_max_nodes(nodes: tuple[int, int], segment: str, message: str | None) -> None:
    def make() -> object:
        return make_settings(
            endpoint="127.0.0.1:2379", run_id="run", min_nodes=nodes[0], max_nodes=nodes[1], segment=segment
        )

    if message is None:
        assert make().segment == 2  # type: ignore[attr-defined]
        return
    with pytest.raises(RendezvousConfigError, match=message):
        make()
