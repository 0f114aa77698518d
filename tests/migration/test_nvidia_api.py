"""The names added for NVIDIA inprocess 0.4.1 parity, each doing what NVIDIA's does (see docs/migration.md)."""

from __future__ import annotations

import datetime
import gc
import importlib.util
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from elastic_ft import inprocess
from elastic_ft.inprocess import exception, rank_filter
from elastic_ft.inprocess.abort import AbortTorchDistributed, AbortTransformerEngine
from elastic_ft.inprocess.compose import Compose, find_common_ancestor
from elastic_ft.inprocess.finalize import Finalize, ThreadedFinalize
from elastic_ft.inprocess.health_check import FaultCounter, FaultCounterExceeded, HealthCheck
from elastic_ft.inprocess.monitor_thread import (
    async_abort_main_thread,
    async_raise,
    delayed_async_raise,
    reraise_if_unraisable,
)
from elastic_ft.inprocess.nested_restarter import (
    NestedRestarterAborted,
    NestedRestarterFinalized,
    NestedRestarterHandlingCompleted,
    NestedRestarterHandlingStarting,
)
from elastic_ft.inprocess.state import FrozenState, Mode, State
from elastic_ft.inprocess.store import FileStore, TCPStore
from elastic_ft.runtime.net import free_port

FAILED = State(0, 2, fn_exception=RuntimeError("boom"))


def test_state_from_env_advance_freeze_and_distributed_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    state = State.from_env()
    assert (state.rank, state.world_size, state.initial_rank, state.initial_world_size) == (3, 8, 3, 8)
    assert FrozenState is State and state.freeze() is state
    nxt = FAILED.advance()
    assert (nxt.iteration, nxt.fn_exception, FAILED.iteration) == (1, None, 0)
    assert State(0, 2) == FAILED  # the exception is not part of a state's identity
    active = State(5, 8, active_rank=1, active_world_size=4, mode=Mode.ACTIVE)
    active.set_distributed_vars()
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "4")
    State(5, 8, mode=Mode.INACTIVE).set_distributed_vars()
    assert os.environ["RANK"] == "1"  # an inactive rank leaves the environment alone
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK must be an integer, got 'x'"):
        State.from_env()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="needs the WORLD_SIZE environment variable"):
        State.from_env()
    with pytest.raises(TypeError, match="fn_exception must be an exception or None"):
        State(0, 1, fn_exception="boom")  # type: ignore[arg-type]


def test_find_common_ancestor() -> None:
    assert find_common_ancestor(FaultCounter(), FaultCounter()) is FaultCounter
    assert find_common_ancestor(FaultCounter(), inprocess.health_check.CudaHealthCheck()) is HealthCheck
    assert find_common_ancestor(FaultCounter(), 1) is object
    with pytest.raises(ValueError, match="at least one instance"):
        find_common_ancestor()


def test_threaded_finalize_runs_fn_and_bounds_it() -> None:
    calls: list[tuple[object, ...]] = []
    finalize = ThreadedFinalize(datetime.timedelta(seconds=5), lambda *a, **k: calls.append((a, k)), (1,), {"x": 2})
    assert isinstance(finalize, Finalize)
    assert finalize(FAILED) is FAILED and calls == [((1,), {"x": 2})]

    def fail() -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        ThreadedFinalize(datetime.timedelta(seconds=5), fail)(FAILED)
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(exception.TimeoutError, match="did not return within 0.2 s"):
        ThreadedFinalize(datetime.timedelta(seconds=0.2), release.wait)(FAILED)
    assert time.monotonic() - start < 2
    release.set()
    assert issubclass(exception.TimeoutError, TimeoutError) and issubclass(
        exception.TimeoutError, exception.RestartError
    )
    with pytest.raises(ValueError, match="timeout must be a positive datetime.timedelta, got 5"):
        ThreadedFinalize(5, print)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fn must be callable"):
        ThreadedFinalize(datetime.timedelta(seconds=1), "print")  # type: ignore[arg-type]


def test_fault_counter_counts_this_ranks_own_faults() -> None:
    counter = FaultCounter(max_rank_faults=1)
    assert counter(State(0, 2)) is not None and counter.faults_count == 0  # no fault of its own
    counter(FAILED)
    with pytest.raises(FaultCounterExceeded, match="caused 2 faults, more than max_rank_faults=1; last: Runtime"):
        counter(FAILED)
    unlimited = FaultCounter()
    for _ in range(5):
        unlimited(FAILED)
    assert unlimited.faults_count == 5
    with pytest.raises(ValueError, match="max_rank_faults must be an int >= 0 or None, got -1"):
        FaultCounter(-1)


def test_abort_hooks_without_a_process_group_or_transformer_engine() -> None:
    assert importlib.util.find_spec("transformer_engine") is None
    assert AbortTransformerEngine()(FAILED) is FAILED
    AbortTorchDistributed.shutdown_all_process_group_backends()  # nothing initialised: nothing to do
    assert AbortTorchDistributed()(FAILED) is FAILED


def test_nested_restarter_hooks_log_nvidias_lines_on_the_special_rank(caplog: pytest.LogCaptureFixture) -> None:
    other = State(1, 2)
    with caplog.at_level(logging.INFO, logger="elastic_ft.nested_restarter"):
        completed = NestedRestarterHandlingCompleted()
        completed(FAILED)
        completed(FAILED)
        completed(other)
        NestedRestarterHandlingStarting()(FAILED)
        NestedRestarterFinalized()(FAILED)
        NestedRestarterAborted(special_rank=1)(other)
    assert [r.getMessage() for r in caplog.records] == [
        "[NestedRestarter] name=[InProcess] state=initialize",
        "[NestedRestarter] name=[InProcess] state=handling stage=completed",
        "[NestedRestarter] name=[InProcess] state=handling stage=starting",
        "[NestedRestarter] name=[InProcess] state=finalized",
        "[NestedRestarter] name=[InProcess] state=aborted",
    ]
    assert isinstance(NestedRestarterHandlingStarting(), inprocess.abort.Abort)
    assert isinstance(Compose(NestedRestarterFinalized(), NestedRestarterFinalized()), inprocess.completion.Completion)
    with pytest.raises(ValueError, match="special_rank must be an int >= 0"):
        NestedRestarterAborted(special_rank=-1)


def test_async_raise_and_friends() -> None:
    started, caught = threading.Event(), []

    def loop() -> None:
        started.set()
        try:
            while True:
                time.sleep(0.001)
        except KeyError as error:
            caught.append(error)

    worker = threading.Thread(target=loop)
    worker.start()
    started.wait()
    async_raise(worker.ident, KeyError)  # type: ignore[arg-type]
    worker.join(5)
    assert len(caught) == 1
    with pytest.raises(RuntimeError, match="no thread with identifier"):
        async_raise(123456789, KeyError)

    threading.Timer(0.05, async_abort_main_thread, args=("stop here",)).start()
    with pytest.raises(exception.RankShouldRestart, match="stop here"):
        for _ in range(10_000):
            time.sleep(0.001)

    threading.Timer(0.05, delayed_async_raise, args=(threading.main_thread().ident, KeyError)).start()
    with pytest.raises(KeyError):
        for _ in range(10_000):
            time.sleep(0.001)


def test_reraise_if_unraisable_raises_a_dropped_exception_again_in_the_main_thread() -> None:
    class RaisesInDel:
        def __del__(self) -> None:
            raise exception.RankShouldRestart("from a finalizer")

    with pytest.raises(exception.RankShouldRestart), reraise_if_unraisable(exception.RankShouldRestart):
        RaisesInDel()
        gc.collect()
        for _ in range(10_000):
            time.sleep(0.001)


def test_rank_filters_are_deprecated_and_filter_a_state() -> None:
    with pytest.warns(DeprecationWarning, match="rank_filter.MaxActiveWorldSize is deprecated"):
        limit = rank_filter.MaxActiveWorldSize(2)
    with pytest.warns(DeprecationWarning, match="rank_filter.WorldSizeDivisibleBy is deprecated"):
        divisible = rank_filter.WorldSizeDivisibleBy(3)
    states = [State(r, 7) for r in range(7)]
    assert [s.mode for s in map(limit, states)] == [Mode.ACTIVE] * 2 + [Mode.INACTIVE] * 5
    assert [s.active_world_size for s in map(divisible, states)] == [6] * 7
    assert isinstance(divisible, rank_filter.ActiveWorldSizeDivisibleBy)


def test_file_store_and_tcp_store_take_nvidias_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = [FileStore(str(tmp_path / "store"), 2), FileStore(str(tmp_path / "store"), 2)]
    files[0].set("k", "v")
    assert files[1].get("k") == b"v"
    results: list[object] = []
    thread = threading.Thread(
        target=lambda: results.append(files[1].arrive_and_wait("b", [1], 2, datetime.timedelta(seconds=10)))
    )
    thread.start()
    results.append(files[0].arrive_and_wait("b", [0], 2, datetime.timedelta(seconds=10)))
    thread.join(10)
    assert len(results) == 2  # both passed the Wrapper's barrier over the file

    port = free_port()
    monkeypatch.setenv("RANK", "0")
    host = TCPStore("127.0.0.1", port, world_size=1, wait_for_workers=True, multi_tenant=False)
    assert TCPStore.TCP_STORE_HOST_RANK == 0 and host.critical_ranks == (0,)
    host.set("x", "1")
    assert host.get("x") == b"1"
    assert isinstance(host, dist.TCPStore)


def test_wrapper_checks_the_new_hooks() -> None:
    for name in ("completion", "terminate", "rank_filter"):
        with pytest.raises(TypeError, match=f"Wrapper {name} must be callable or None, got a str: 'nope'"):
            inprocess.Wrapper(**{name: "nope"})


def test_compose_chains_arguments_as_nvidias_does() -> None:
    calls: list[str] = []

    class Count:
        def __call__(self) -> None:
            calls.append("x")

    Compose(Count(), Count(), Count())()
    assert calls == ["x"] * 3  # parts without arguments pass nothing on

    class Shift:
        def __call__(self, a: int, b: int) -> tuple[int, int]:
            return a + 1, b + 2

    assert Compose(Shift(), Shift())(0, 0) == (2, 4)  # a tuple is the next part's arguments

    class Forgets:
        def __call__(self, state: object) -> None:
            return None

    with pytest.warns(UserWarning, match="returned None"):
        assert Compose(Forgets(), Forgets())(1) is None
    with pytest.raises(ValueError, match="at least one callable"):
        Compose()


def test_a_composition_is_an_instance_of_the_nearest_class_its_parts_share() -> None:
    class Base:
        pass

    class Foo(Base):
        def __call__(self) -> None: ...

    class Bar(Foo):
        def __call__(self) -> None: ...

    both = Compose(Foo(), Bar())
    assert isinstance(both, Foo) and isinstance(both, Base) and not isinstance(both, Bar)
    assert type(Compose(print, len)) is Compose  # builtins share only object
    nested = Compose(Compose(Foo(), Foo()), Compose(Foo(), Foo()))
    assert isinstance(nested, Foo) and nested() is None


def test_layer_fields_may_be_set_and_are_checked_again() -> None:
    layer = inprocess.rank_assignment.Layer(min_ranks=2)
    layer.flag = inprocess.rank_assignment.LayerFlag.RESERVE
    layer.flag |= inprocess.rank_assignment.LayerFlag.BACKFILL
    assert layer.has(inprocess.rank_assignment.LayerFlag.BACKFILL)
    with pytest.raises(ValueError, match="min_ranks=2 must not exceed max_ranks=1"):
        layer.max_ranks = 1
    assert layer.max_ranks is None  # a failed assignment changes nothing


class KeyStore:
    """NVIDIA's ``StoreMixin`` key protocol, as its unit tests fake it: every rank's keys known up front."""

    def __init__(self, keys: dict[int, list[object]]) -> None:
        self.keys = keys
        self.sent: list[tuple[object, int]] = []

    def send_key(self, key: object, rank: int) -> None:
        self.sent.append((key, rank))

    def get_keys(self, ranks: list[int]) -> list[list[object]]:
        return [self.keys[rank] for rank in ranks]


def test_tree_over_nvidias_store_protocol_computes_every_ranks_state() -> None:
    layers = [
        inprocess.rank_assignment.Layer(flag=inprocess.rank_assignment.LayerFlag.BACKFILL),
        inprocess.rank_assignment.Layer(
            key_or_fn=lambda state: state.rank // 4, flag=inprocess.rank_assignment.LayerFlag.BACKFILL
        ),
    ]
    store = KeyStore({rank: ["", rank // 4] for rank in range(8)})
    tree = inprocess.rank_assignment.Tree(layers)
    assert tree.init_rank_map == {}
    ctx = tree(inprocess.rank_assignment.RankAssignmentCtx(State(0, 8), store, {1}))  # type: ignore[arg-type]
    assert store.sent == [(["", "\x1f0"], 0)]
    active = [tree.init_rank_map[r].state.active_rank for r in range(8)]
    assert active == [0, None, 2, 3, 4, 5, 6, 1]  # rank 1 failed; the highest active rank backfills its place
    assert ctx.state.active_rank == 0 and ctx.state.active_world_size == 7
    assert tree.init_rank_map[1].state.mode is Mode.TERMINATED
    bad = KeyStore({rank: [""] for rank in range(8)})
    with pytest.raises(ValueError, match="rank 0 published"):
        inprocess.rank_assignment.Tree(layers)(inprocess.rank_assignment.RankAssignmentCtx(State(0, 8), bad, set()))  # type: ignore[arg-type]


def test_tree_errors_and_warnings_as_nvidias() -> None:
    from elastic_ft.inprocess.rank_assignment.tree import TreeTopologyError

    two_roots = KeyStore({rank: [rank % 2] for rank in range(4)})
    with pytest.raises(TreeTopologyError, match="multiple roots") as caught:
        inprocess.rank_assignment.Tree([inprocess.rank_assignment.Layer()])(
            inprocess.rank_assignment.RankAssignmentCtx(State(0, 4), two_roots, set())  # type: ignore[arg-type]
        )
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, ValueError)
    interleaved = KeyStore({rank: ["", rank % 2] for rank in range(4)})
    layers = [inprocess.rank_assignment.Layer(), inprocess.rank_assignment.Layer(key_or_fn=lambda s: s.rank % 2)]
    with pytest.warns(UserWarning, match="rank 2 is at position 1 of the tree"):
        inprocess.rank_assignment.Tree(layers)(
            inprocess.rank_assignment.RankAssignmentCtx(State(0, 4), interleaved, set())  # type: ignore[arg-type]
        )
