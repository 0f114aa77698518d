"""The examples of NVIDIA's inprocess usage guide and rank-assignment reference, with only the import changed.

Each snippet below is the documentation's text (seeds 000 and 001), run with
``from elastic_ft import inprocess`` in place of ``import
nvidia_resiliency_ext.inprocess as inprocess``, each rank building its own
policy as a process would, on a simulated world of threads sharing one
store. The assertions check what the text says the example does.
"""

from __future__ import annotations

import socket
import threading
import warnings
from collections import Counter
from typing import Any

import pytest

from elastic_ft.inprocess import Wrapper
from elastic_ft.inprocess.state import Mode, State
from tests.inprocess.rank_world import World, assert_consistent, discarded, states_of

IMPORT = "from elastic_ft import inprocess\n"

# Seed 000, "Rank assignment" (note the documentation's trailing comma: the example is a 1-tuple).
SHIFT_AND_FILTER_GROUPS_OF_8 = """
rank_assignment = (
    inprocess.Compose(
        inprocess.rank_assignment.ShiftRanks(),
        inprocess.rank_assignment.FilterGroupedByKey(
            key_or_fn=lambda rank, _: rank // 8,
            condition=lambda count: count == 8,
        ),
    ),
),
"""

# Seed 000, "Rank filter": the keyword argument of the Wrapper.
RANK_FILTER = """
rank_filter=inprocess.Compose(
    inprocess.rank_filter.WorldSizeDivisibleBy(M),
    inprocess.rank_filter.MaxActiveWorldSize(N),
),
"""

# Seed 001, "Tree", Example.
TREE = """
inprocess.rank_assignment.Tree(
    [
        inprocess.rank_assignment.Layer(
            min_ranks=128,
            max_ranks=256,
            key_or_fn='root',
            flag=inprocess.rank_assignment.LayerFlag.RESERVE,
        ),
        inprocess.rank_assignment.Layer(
            min_ranks=8,
            max_ranks=8,
            key_or_fn=lambda _: socket.gethostname(),
            flag=inprocess.rank_assignment.LayerFlag.RESERVE,
        ),
    ]
)
"""

# Seed 001, "FilterCountGroupedByKey", Example.
FILTER_BY_HOSTNAME = """
# hostname is the group key, and condition checks if exactly 8 ranks
# corresponding to a given hostname are in a healthy state, if the
# count is different than 8, all ranks from corresponding hostname are
# considered unhealthy, and terminated; remaining healthy ranks are
# shifted to the left to fill all gaps created by unhealthy ranks.
rank_assignment = (
    inprocess.Compose(
        inprocess.rank_assignment.ShiftRanks(),
        inprocess.rank_assignment.FilterCountGroupedByKey(
            key_or_fn=lambda _: socket.gethostname(),
            condition=lambda count: count == 8,
        ),
    ),
),
"""

_host = threading.local()


@pytest.fixture
def hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """``socket.gethostname()`` answers, in each rank's thread, the host that rank was placed on."""
    monkeypatch.setattr(socket, "gethostname", lambda: _host.name)


def run_snippet(snippet: str, **names: Any) -> dict[str, Any]:
    scope: dict[str, Any] = {"socket": socket, **names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the rank_filter example is deprecated upstream
        exec(compile(IMPORT + snippet, "<seed example>", "exec"), scope)  # noqa: S102 - the documented text itself
    return scope


def policy_of(snippet: str, rank: int, ranks_per_host: int | None = None) -> Any:
    if ranks_per_host is not None:
        _host.name = f"host{rank // ranks_per_host}"
    if snippet == TREE:
        return run_snippet("policy = " + TREE.strip())["policy"]
    policy = run_snippet(snippet)["rank_assignment"]
    while isinstance(policy, tuple) and len(policy) == 1:  # the text's trailing commas nest it in tuples
        (policy,) = policy
    return policy


def test_shift_ranks_with_groups_of_8_drops_a_group_with_a_failed_rank() -> None:
    with World(24, lambda rank: policy_of(SHIFT_AND_FILTER_GROUPS_OF_8, rank)) as world:
        assert_consistent(states_of(world.step(set())))
        outcomes = world.step({3})
    # "If any rank within a group of 8 is unhealthy or terminated, the entire group is terminated.
    # The remaining healthy ranks are then reassigned by shifting left."
    assert discarded(outcomes) == set(range(8))
    states = states_of(outcomes)
    assert_consistent(states)
    assert {initial: state.rank for initial, state in states.items()} == {r: r - 8 for r in range(8, 24)}


def test_filter_by_hostname_keeps_only_hosts_with_8_healthy_ranks(hosts: None) -> None:
    with World(24, lambda rank: policy_of(FILTER_BY_HOSTNAME, rank, ranks_per_host=8)) as world:
        world.step(set())
        outcomes = world.step({9})  # a rank of host1
    assert discarded(outcomes) == set(range(8, 16))
    states = states_of(outcomes)
    assert_consistent(states)
    assert sorted(states) == [*range(8), *range(16, 24)]
    assert [states[r].rank for r in sorted(states)] == list(range(16))


def test_rank_filter_keeps_the_largest_multiple_of_m_not_above_n() -> None:
    # "ensures that the active world size visible to the wrapped function is the largest multiple
    # of M that is not greater than N. The remaining ranks would be inactive and serve as spares."
    for world_size, m, n, expected in [(13, 4, 10, 8), (16, 4, 16, 16), (7, 3, 100, 6), (5, 2, 4, 4)]:
        rank_filter = run_snippet(f"kwargs = dict({RANK_FILTER})", M=m, N=n)["kwargs"]["rank_filter"]
        states = [
            rank_filter(State(rank, world_size, active_world_size=world_size, mode=Mode.ACTIVE, active_rank=rank))
            for rank in range(world_size)
        ]
        active = [s.active_rank for s in states if s.mode is Mode.ACTIVE]
        assert active == list(range(expected)), (world_size, m, n)
        assert all(s.active_world_size == expected for s in states)
        assert all(s.mode is Mode.INACTIVE for s in states[expected:])
    # The Wrapper takes the same keyword, as NVIDIA's does (deprecated there and here).
    kwargs = run_snippet(f"kwargs = dict({RANK_FILTER})", M=2, N=4)["kwargs"]
    with pytest.warns(DeprecationWarning, match="rank_filter is deprecated"):
        wrapper = Wrapper(**kwargs)
    assert wrapper.rank_filter is kwargs["rank_filter"]


def test_tree_two_layers_hosts_of_8_under_a_root_of_at_most_256(hosts: None) -> None:
    # 33 hosts of 9 ranks: "up to 8 active ranks per host", "up to 256 active ranks" in all.
    per_host, host_count = 9, 33
    host_of = {rank: rank // per_host for rank in range(per_host * host_count)}
    with World(per_host * host_count, lambda rank: policy_of(TREE, rank, ranks_per_host=per_host)) as world:
        first = states_of(world.step(set()))
        assert_consistent(first)
        active_per_host = Counter(host_of[r] for r, s in first.items() if s.mode is Mode.ACTIVE)
        assert sum(active_per_host.values()) == 256 and max(active_per_host.values()) == 8

        # One active rank of host 0 fails: host 0 keeps 8 healthy ranks, and its own spare replaces it
        # ("The algorithm can look for inactive reserve ranks within the same hostname").
        failed = next(r for r in range(per_host) if first[r].mode is Mode.ACTIVE)
        spare = next(r for r in range(per_host) if first[r].mode is Mode.INACTIVE)
        second = states_of(world.step({first[failed].rank}))
        assert_consistent(second)
        assert second[spare].mode is Mode.ACTIVE
        assert sum(s.mode is Mode.ACTIVE for s in second.values()) == 256

        # Two ranks of host 1 fail: fewer than 8 healthy, so the whole host goes
        # ("If the number of healthy ranks in any host drops below 8 ... that entire host's subtree
        # is terminated"), and root's RESERVE finds replacements on other hosts, 256 active again.
        host1 = [r for r in range(per_host, 2 * per_host)]
        outcomes = world.step({second[host1[0]].rank, second[host1[1]].rank})
        assert discarded(outcomes) == set(host1)
        third = states_of(outcomes)
        assert_consistent(third)
        active = [r for r, s in third.items() if s.mode is Mode.ACTIVE]
        assert len(active) == 256
        assert max(Counter(host_of[r] for r in active).values()) == 8
