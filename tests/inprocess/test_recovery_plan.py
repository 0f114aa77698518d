"""The recovery plan: who is behind, who sends to whom; pure, so tested without I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_ft.inprocess.healing.plan import RankProgress, ShardLayout, plan_recovery


def progress(*records: tuple[int, bool]) -> list[RankProgress]:
    return [RankProgress(rank, step, fresh) for rank, (step, fresh) in enumerate(records)]


def test_up_to_date_ranks_do_nothing() -> None:
    plan = plan_recovery(progress((7, False), (7, False), (7, False)))
    assert not plan.heals and plan.max_step == 7
    assert plan.reason == "all 3 active ranks are at step 7"


def test_fresh_ranks_are_spread_round_robin_over_the_up_to_date_ranks() -> None:
    ranks = progress((120, False), (120, False), (0, True), (0, True))
    plan = plan_recovery(ranks, rotation=0)
    assert dict(plan.sources) == {2: 0, 3: 1}
    assert plan.receivers_of(0) == (2,) and plan.receivers_of(1) == (3,) and plan.senders == (0, 1)
    assert plan.source_of(0) is None and plan.source_of(2) == 0
    assert "fresh [2, 3]" in plan.reason and "0->2, 1->3" in plan.reason
    assert dict(plan_recovery(ranks, rotation=1).sources) == {2: 1, 3: 0}  # the next iteration rotates


def test_a_rank_cut_before_its_last_optimizer_step_is_behind() -> None:
    plan = plan_recovery(progress((313, False), (313, False), (312, False), (0, True)), rotation=2)
    assert dict(plan.sources) == {2: 0, 3: 1} and plan.max_step == 313
    assert "behind ['2@312']" in plan.reason


def test_a_fresh_rank_with_a_high_step_is_still_behind() -> None:
    # A fresh rank's step is not the world's: a respawned process may have loaded an old checkpoint.
    plan = plan_recovery(progress((10, False), (500, True)))
    assert plan.max_step == 10 and dict(plan.sources) == {1: 0}


def test_several_receivers_from_one_sender() -> None:
    plan = plan_recovery(progress((5, False), (0, True), (0, True), (0, True)))
    assert plan.receivers_of(0) == (1, 2, 3) and plan.senders == (0,)


def test_nothing_to_heal_from_when_every_rank_is_fresh() -> None:
    plan = plan_recovery(progress((0, True), (0, True)))
    assert not plan.heals and "no rank holds the world's state" in plan.reason


def test_a_sender_that_died_is_left_out_of_the_next_plan() -> None:
    # Iteration 1: ranks 0 and 1 send to 3 and 2; rank 0 dies mid-transfer. Iteration 2 renumbers the
    # three that are left (old 1, 2, 3 -> 0, 1, 2); both receivers are still fresh.
    first = plan_recovery(progress((20, False), (20, False), (0, True), (0, True)), rotation=1)
    assert dict(first.sources) == {2: 1, 3: 0}
    second = plan_recovery(progress((20, False), (0, True), (0, True)), rotation=2)
    assert dict(second.sources) == {1: 0, 2: 0}


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([RankProgress(0, 1, False), RankProgress(0, 1, False)], "one progress record per rank"),
    ],
)
def test_duplicate_ranks_are_rejected(records: list[RankProgress], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_recovery(records)


@pytest.mark.parametrize(
    ("rank", "step", "fresh", "error", "message"),
    [
        (-1, 0, False, ValueError, "a rank is an integer >= 0, got -1"),
        (0, -3, False, ValueError, "a step is an integer >= 0, got -3"),
        (0, True, False, ValueError, "a step is an integer >= 0, got True"),
        (0, 1.5, False, ValueError, "a step is an integer >= 0, got 1.5"),
        (0, 1, "yes", TypeError, "fresh is a boolean, got 'yes'"),
    ],
)
def test_malformed_progress_is_rejected(rank: object, step: object, fresh: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        RankProgress(rank, step, fresh)  # type: ignore[arg-type]


@given(
    st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=40),
    st.integers(0, 100),
)
def test_every_behind_rank_gets_exactly_one_up_to_date_sender(records: list[tuple[int, bool]], rotation: int) -> None:
    ranks = progress(*records)
    plan = plan_recovery(ranks, rotation)
    holders = [p for p in ranks if not p.fresh]
    if not holders:
        assert not plan.heals
        return
    top = max(p.step for p in holders)
    up_to_date = {p.rank for p in holders if p.step == top}
    behind = {p.rank for p in ranks if p.fresh or p.step < top}
    assert plan.max_step == top
    assert set(plan.sources) == behind
    assert set(plan.sources.values()) <= up_to_date
    assert not set(plan.sources) & up_to_date
    # The load is spread: senders' receiver counts differ by at most one.
    loads = [len(plan.receivers_of(rank)) for rank in up_to_date]
    assert max(loads) - min(loads) <= 1
    # Every rank computes the same plan from the same records, in any order.
    assert plan_recovery(list(reversed(ranks)), rotation) == plan


def sharded(*records: tuple[int, bool, tuple[int, int] | None]) -> list[RankProgress]:
    return [RankProgress(rank, step, fresh, shard) for rank, (step, fresh, shard) in enumerate(records)]


def test_a_fresh_rank_of_a_sharded_model_receives_its_own_shard_from_the_other_replica() -> None:
    # HSDP 2 x 2: rank r needs shard r % 2. Rank 3 is new (a respawned process, or a hot spare).
    ranks = sharded((32, False, (0, 2)), (32, False, (1, 2)), (32, False, (0, 2)), (0, True, None))
    plan = plan_recovery(ranks, rotation=5, shards=2)
    assert dict(plan.sources) == {3: 1}  # the only up-to-date holder of shard 1: never rank 0 or 2 (shard 0)
    assert not plan.unhealable and plan.holds_state(3) and plan.max_step == 32
    assert "1->3 (shard 1)" in plan.reason


def test_a_rank_holding_another_shard_is_not_in_place_and_heals_its_own() -> None:
    # A reserve that held shard 0 now stands at active rank 3, which needs shard 1: it must not keep shard 0.
    ranks = sharded((8, False, (0, 2)), (8, False, (1, 2)), (8, False, (0, 2)), (8, False, (0, 2)))
    plan = plan_recovery(ranks, shards=2)
    assert dict(plan.sources) == {3: 1}


def test_a_shard_nobody_holds_sends_every_rank_to_the_checkpoint() -> None:
    # Nobody up to date holds shard 1: rank 1 is behind and rank 3 holds shard 1 of another layout (of 4). Shard
    # 0's holders go back too: a model whose shards are at different steps is no model, and DCP's load is a
    # collective of every rank (ranks 1 and 3 alone in it crashed gloo: "collective mismatch").
    ranks = sharded((40, False, (0, 2)), (39, False, (1, 2)), (40, False, (0, 2)), (40, False, (1, 4)))
    plan = plan_recovery(ranks, shards=2)
    assert dict(plan.sources) == {}  # shard 0's holders are never sent to a rank needing shard 1
    assert set(plan.unhealable) == {1, 3} and not plan.state_held
    assert not any(plan.holds_state(rank) for rank in range(4))
    assert "no rank holds shard 1 of 2 at step 40" in plan.unhealable[3]
    assert "[1, 3] cannot heal" in plan.reason and "every rank loads the checkpoint" in plan.reason


def test_a_shard_lost_with_every_replica_of_it_sends_every_rank_to_the_checkpoint() -> None:
    # HSDP 2 x 2 lost both holders of shard 1 (ranks 1 and 3): the survivors, renumbered 0 and 1 in a 1 x 2 mesh,
    # hold shard 0 twice and shard 1 nowhere.
    plan = plan_recovery(sharded((20, False, (0, 2)), (20, False, (0, 2))), shards=2)
    assert plan.unhealable.keys() == {1} and not plan.heals
    assert not plan.holds_state(0) and not plan.holds_state(1)


def test_a_changed_shard_layout_has_no_holder_so_every_rank_loads_the_checkpoint() -> None:
    # FSDP alone on 2 ranks lost one: the survivor's shard of 2 is no shard of the new layout of 1.
    plan = plan_recovery(sharded((12, False, (0, 2))), shards=1)
    assert not plan.heals and not plan.state_held and not plan.holds_state(0)
    assert "no rank holds its own shard of 1" in plan.reason


def test_several_receivers_of_one_shard_are_spread_over_its_holders() -> None:
    ranks = sharded(
        (9, False, (0, 2)), (9, False, (1, 2)), (9, False, (0, 2)), (9, False, (1, 2)), (0, True, None), (0, True, None)
    )
    plan = plan_recovery(ranks, rotation=0, shards=2)
    assert dict(plan.sources) == {4: 0, 5: 1}
    assert dict(plan_recovery(ranks, rotation=1, shards=2).sources) == {4: 2, 5: 3}


@pytest.mark.parametrize("shard", [(2, 2), (-1, 2), (0, 0), (True, 2), [0, 2]])
def test_a_malformed_shard_is_rejected(shard: object) -> None:
    with pytest.raises(ValueError, match="a shard is"):
        RankProgress(0, 1, False, shard)  # type: ignore[arg-type]


@pytest.mark.parametrize("shard", [[2, 2], [0], "x", [0, True]])
def test_a_malformed_shard_in_the_heal_barriers_result_is_a_transfer_error(shard: object) -> None:
    """The heal barrier's payload comes from the store (untrusted): a bad shard fails the exchange, which restarts
    the iteration, and loads nothing."""
    import json

    from elastic_ft.inprocess.exception import StateTransferError
    from elastic_ft.inprocess.healing.heal import parse_progress

    payload = json.dumps([{"step": 3, "fresh": False, "shard": [0, 2]}, {"step": 3, "fresh": False, "shard": shard}])
    with pytest.raises(StateTransferError, match="malformed progress record of active rank 1"):
        parse_progress(payload, 2)
    good = json.dumps([{"step": 3, "fresh": False, "shard": [0, 2]}, {"step": 3, "fresh": True}])
    assert [p.shard for p in parse_progress(good, 2)] == [(0, 2), None]


# ---- a state of DTensors, keyed by its layout (the default rank assignment) ----

HSDP = ((2, 2), (1,))  # a 2 x 2 mesh, the tensors split on dimension 1 (FSDP's), replicated on 0


def placed(coordinate: tuple[int, ...], mesh: tuple[tuple[int, ...], tuple[int, ...]] = HSDP, digest: str = "d1"):
    return ShardLayout(mesh[0], mesh[1], coordinate, digest)


def layouts(*records: tuple[int, bool, ShardLayout | None]) -> list[RankProgress]:
    return [RankProgress(rank, step, fresh, layout=layout) for rank, (step, fresh, layout) in enumerate(records)]


def test_a_shard_layout_numbers_its_shards_over_the_split_dimensions_in_row_major_order() -> None:
    layout = placed((1, 0))
    assert layout.shard == (0, 2) and [layout.shard_of(rank) for rank in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    three_d = ShardLayout((2, 3, 2), (1, 2), (1, 2, 1), "d")
    assert three_d.shard == (5, 6) and three_d.shard_of(11) == (5, 6) and three_d.shard_of(6) == (0, 6)
    assert ShardLayout((4,), (), (3,), "d").shard_of(2) == (0, 1)  # replicated everywhere: one shard
    assert ShardLayout.from_json(layout.to_json()) == layout


@pytest.mark.parametrize(
    "document, message",
    [
        ({"mesh": [2, 0], "split": [], "coordinate": [0, 0], "digest": "d"}, "sizes > 0"),
        ({"mesh": [2, 2], "split": [2], "coordinate": [0, 0], "digest": "d"}, "ascending dimensions"),
        ({"mesh": [2, 2], "split": [1, 0], "coordinate": [0, 0], "digest": "d"}, "ascending dimensions"),
        ({"mesh": [2, 2], "split": [1], "coordinate": [0, 2], "digest": "d"}, "one index per dimension"),
        ({"mesh": [2, 2], "split": [1], "coordinate": [0], "digest": "d"}, "one index per dimension"),
        ({"mesh": [2, 2], "split": [1], "coordinate": [0, 1], "digest": ""}, "digest"),
        ({"mesh": [2, 2], "split": [1], "coordinate": [0, 1]}, "digest"),
        ({"mesh": "2x2", "split": [1], "coordinate": [0, 1], "digest": "d"}, "lists mesh, split and coordinate"),
        ([2, 2], "a JSON object"),
    ],
)
def test_a_malformed_shard_layout_is_refused_naming_the_field(document: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        ShardLayout.from_json(document)


def test_a_rank_behind_heals_from_a_rank_at_the_same_coordinate_of_the_split_dimension() -> None:
    # Rank 3 (coordinate (1, 1)) lags one step: only rank 1 (0, 1) holds its shard; rank 0's has the same shape.
    plan = plan_recovery(
        layouts(
            (8, False, placed((0, 0))),
            (8, False, placed((0, 1))),
            (8, False, placed((1, 0))),
            (7, False, placed((1, 1))),
        )
    )
    assert dict(plan.sources) == {3: 1} and plan.max_step == 8 and plan.layout == placed((0, 0))
    assert plan.shard_needed(3) == (1, 2) and "of mesh [2, 2]" in plan.reason


def test_a_fresh_rank_receives_the_shard_of_its_coordinate_and_receivers_spread_over_holders() -> None:
    ranks = layouts(
        (20, False, placed((0, 0), ((3, 2), (1,)))),
        (0, True, None),
        (20, False, placed((1, 0), ((3, 2), (1,)))),
        (20, False, placed((1, 1), ((3, 2), (1,)))),
        (0, True, None),
        (20, False, placed((2, 1), ((3, 2), (1,)))),
    )
    plan = plan_recovery(ranks, rotation=1)
    assert dict(plan.sources) == {1: 5, 4: 2}  # shard 1 from 3 or 5, shard 0 from 0 or 2, rotated by one
    assert plan.holds_state(1) and plan.holds_state(4)


def test_a_mesh_that_no_longer_covers_the_active_ranks_sends_every_rank_to_the_checkpoint() -> None:
    plan = plan_recovery(layouts((8, False, placed((0, 0))), (8, False, placed((0, 1))), (8, False, placed((1, 0)))))
    assert not plan.state_held and not plan.sources
    assert "mesh [2, 2] of 4 ranks, this iteration has 3 active ranks" in plan.reason
    assert not plan.holds_state(0)


def test_up_to_date_ranks_that_disagree_on_the_layout_send_every_rank_to_the_checkpoint() -> None:
    plan = plan_recovery(
        layouts(
            (8, False, placed((0, 0))),
            (8, False, placed((0, 1), digest="other")),
            (8, False, placed((1, 0))),
            (0, True, None),
        )
    )
    assert not plan.state_held and "different layouts" in plan.reason


def test_a_rank_holding_a_stale_layout_is_behind_and_a_shard_nobody_holds_is_unhealable() -> None:
    old = ((1, 3), (1,))
    ranks = layouts(
        (9, False, placed((0, 0))),
        (9, False, placed((0, 1))),
        (9, False, placed((1, 0))),
        (5, False, placed((0, 2), old)),
    )
    plan = plan_recovery(ranks)
    assert dict(plan.sources) == {3: 1}  # its older (1, 3) shard is no shard of the 2 x 2 layout
    lost = layouts((9, False, placed((0, 0))), (0, True, None), (9, False, placed((1, 0))), (0, True, None))
    plan = plan_recovery(lost)
    assert (
        not plan.state_held and set(plan.unhealable) == {1, 3} and "no rank holds shard 1 of mesh [2, 2]" in plan.reason
    )


@pytest.mark.parametrize(
    "layout",
    [{"mesh": [2, 2], "split": [1], "coordinate": [0, 5], "digest": "d"}, "2x2", {"mesh": [2, 2]}],
)
def test_a_progress_record_with_a_malformed_layout_fails_the_exchange_naming_the_rank(layout: object) -> None:
    import json

    from elastic_ft.inprocess.exception import StateTransferError
    from elastic_ft.inprocess.healing.heal import parse_progress

    records = [{"step": 3, "fresh": False}, {"step": 3, "fresh": False, "layout": layout}]
    with pytest.raises(StateTransferError, match="malformed progress record of active rank 1"):
        parse_progress(json.dumps(records), 2)
