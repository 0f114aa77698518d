"""Fast tests of the Wrapper's pieces that need no job: arguments, pure decisions, store protocol."""

from __future__ import annotations

import datetime
import math
import os
import signal
import threading
import time

import pytest
import torch.distributed as dist

from elastic_ft import keys
from elastic_ft.coordination.iteration import COMPLETED, INTERRUPTED, PLANNED, iteration_store
from elastic_ft.coordination.job import job_store
from elastic_ft.coordination.termination import TerminationResult
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.inprocess.exception import BarrierOverflow, BarrierTimeout, RestartAbort
from elastic_ft.inprocess.hangs.heartbeats import HeartbeatWatchdog, ProgressTimestamps, progress_age
from elastic_ft.inprocess.initialize import RetryController
from elastic_ft.inprocess.restart import joining
from elastic_ft.inprocess.restart.joining import RunningWorld
from elastic_ft.inprocess.sibling_monitor import nobody_left, ring_successor, silent_ranks
from elastic_ft.inprocess.state import Mode, State
from elastic_ft.inprocess.wrapper import Wrapper
from elastic_ft.keys import COMPLETION_BARRIER, TERMINATION_BARRIER


def seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=value)


def test_disabled_wrapper_returns_the_function_itself() -> None:
    def train() -> int:
        return 1

    assert Wrapper(enabled=False)(train) is train


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"soft_timeout": seconds(10), "hard_timeout": seconds(10)}, "soft_timeout < hard_timeout"),
        ({"hard_timeout": seconds(200)}, "hard_timeout < barrier_timeout"),
        ({"heartbeat_interval": seconds(40)}, "heartbeat_interval < heartbeat_timeout"),
        ({"monitor_thread_interval": seconds(61)}, "monitor_thread_interval < soft_timeout"),
        ({"progress_watchdog_interval": seconds(60)}, "progress_watchdog_interval < soft_timeout"),
        ({"monitor_process_interval": seconds(31)}, "monitor_process_interval < heartbeat_timeout"),
        ({"heartbeat_timeout": seconds(130)}, "heartbeat_timeout < barrier_timeout"),
        ({"completion_timeout": seconds(0)}, "completion_timeout must be positive"),
        ({"last_call_wait": seconds(-1)}, "last_call_wait must be >= 0"),
        ({"barrier_timeout": datetime.timedelta.max}, "barrier_timeout must be at most 30 days"),
        ({"monitor_process_logfile": "relative/{rank}.log"}, "absolute path"),
        ({"monitor_process_logfile": "/tmp/{node}.log"}, "only contain the {rank} placeholder"),
        ({"monitor_process_pidfile": "monitor.pid"}, "monitor_process_pidfile must be an absolute path"),
        ({"monitor_process_pidfile": "/tmp/{0}.pid"}, "only contain the {rank} placeholder"),
        ({"interrupt_signal": 9999}, "interrupt_signal must be a signal"),
        ({"interrupt_signal": "SIGUSR2"}, "interrupt_signal must be a signal"),
        ({"interrupt_signal": True}, "interrupt_signal must be a signal"),
        ({"interrupt_signal": signal.SIGKILL}, "cannot be handled"),
        ({"state_dict": dict}, "state_dict was given alone: peer state healing needs both"),
        ({"load_state_dict": print}, "load_state_dict was given alone: peer state healing needs both"),
    ],
)
def test_bad_argument_combinations_are_rejected(arguments: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("{", r"\{").replace("}", r"\}")):
        Wrapper(**arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "arguments",
    [
        {"soft_timeout": 60},
        {"initialize": 3},
        {"state_dict": {}, "load_state_dict": print},
        {"store_kwargs": [1]},
        {"enabled": 1},
        {"store_factory": None},
        {"adaptive_timeouts": "fast"},
    ],
)
def test_bad_argument_types_are_rejected(arguments: dict[str, object]) -> None:
    with pytest.raises(TypeError):
        Wrapper(**arguments)  # type: ignore[arg-type]


def test_zero_last_call_wait_and_grace_time_are_allowed() -> None:
    Wrapper(last_call_wait=seconds(0), termination_grace_time=seconds(0))


def state(iteration: int = 0, world_size: int = 4, active_world_size: int = 4) -> State:
    return State(
        0, world_size, active_rank=0, active_world_size=active_world_size, iteration=iteration, mode=Mode.ACTIVE
    )


def test_retry_controller() -> None:
    controller = RetryController(max_iterations=3, min_world_size=2, min_active_world_size=2)
    assert controller(state(iteration=2)) == state(iteration=2)
    with pytest.raises(RestartAbort, match="max_iterations"):
        controller(state(iteration=3))
    with pytest.raises(RestartAbort, match="min_world_size"):
        controller(state(world_size=1, active_world_size=1))
    with pytest.raises(RestartAbort, match="min_active_world_size"):
        controller(state(world_size=4, active_world_size=1))
    assert issubclass(RestartAbort, BaseException) and not issubclass(RestartAbort, Exception)


def test_progress_age_uses_the_manual_heartbeat_only_once_used() -> None:
    assert progress_age(automatic=10.0, manual=math.nan, now=12.0) == 2.0
    assert progress_age(automatic=11.5, manual=9.0, now=12.0) == 3.0
    assert progress_age(automatic=9.0, manual=11.0, now=12.0) == 3.0


def test_ping_counts_for_both_heartbeats() -> None:
    timestamps = ProgressTimestamps()
    time.sleep(0.05)
    assert timestamps.age() >= 0.05
    timestamps.beat_manual()
    assert timestamps.age() < 0.05


def test_watchdog_heartbeat_stops_while_the_main_thread_is_in_c_code() -> None:
    timestamps = ProgressTimestamps()
    watchdog = HeartbeatWatchdog(timestamps, 0.01)
    watchdog.start()
    try:
        for _ in range(30):  # executing bytecode: the heartbeat keeps up
            time.sleep(0.01)
        assert timestamps.age() < 0.1
        threading.Event().wait(0.3)  # blocked in C: no bytecode, no heartbeat
        assert timestamps.age() >= 0.2
    finally:
        watchdog.shutdown()


def test_while_a_restart_waits_to_be_taken_only_a_shielded_section_counts_as_progress() -> None:
    """The restart signal's handler runs pending calls (the probe) while the main thread waits on a lock, even
    where it declines to raise (a finalizer): a rank no restart reaches must not look alive by it. The etcd
    client's shielded sections, bounded by its timeouts, still count."""
    from elastic_ft.etcd import shield

    timestamps = ProgressTimestamps()
    watchdog = HeartbeatWatchdog(timestamps, 0.01)
    watchdog.start()
    try:
        timestamps.set_restart_pending(True)
        for _ in range(30):  # bytecode runs, probes are answered: not progress while the restart waits
            time.sleep(0.01)
        assert timestamps.age() >= 0.2
        with shield.shield():
            for _ in range(30):
                time.sleep(0.01)
            assert timestamps.age() < 0.1
        timestamps.set_restart_pending(False)
        for _ in range(30):
            time.sleep(0.01)
        assert timestamps.age() < 0.1
    finally:
        watchdog.shutdown()


def test_ring_successor_skips_gone_ranks() -> None:
    assert ring_successor(1, 4, skip=set()) == 2
    assert ring_successor(3, 4, skip=set()) == 0
    assert ring_successor(1, 4, skip={2, 3}) == 0
    assert ring_successor(0, 2, skip={1}) is None


def test_silent_ranks() -> None:
    heartbeats = {0: 100.0, 1: 95.0, 2: None}
    assert silent_ranks(heartbeats, now=101.0, watching_since=99.0, timeout=3.0) == [1]
    assert silent_ranks(heartbeats, now=103.0, watching_since=99.0, timeout=3.0) == [1, 2]


def test_no_rank_is_silent_for_an_etcd_outage_it_could_not_beat_through() -> None:
    heartbeats = {0: 100.0, 1: 95.0, 2: None}
    # etcd answered this process again at 102: every rank gets a whole timeout from then.
    assert silent_ranks(heartbeats, now=104.0, watching_since=99.0, timeout=3.0, reachable_since=102.0) == []
    assert silent_ranks(heartbeats, now=105.5, watching_since=99.0, timeout=3.0, reachable_since=102.0) == [0, 1, 2]
    # An outage that ended before the heartbeats changes nothing.
    assert silent_ranks(heartbeats, now=101.0, watching_since=99.0, timeout=3.0, reachable_since=90.0) == [1]


def test_nobody_is_left_only_when_every_member_is_gone_or_silent() -> None:
    beats = {0: 100.0, 1: 95.0}
    # Rank 0's heartbeat is fresh: it may still restart the world.
    assert nobody_left([0, 1, 2], {2}, beats, now=101.0, watching_since=90.0, timeout=3.0) is None
    assert (
        nobody_left([0, 1, 2], {2}, beats, now=104.0, watching_since=90.0, timeout=3.0)
        == "initial ranks [2] are gone and initial ranks [0, 1] sent no heartbeat for 3 s"
    )
    assert nobody_left([0, 1], {0, 1}, {}, now=0.0, watching_since=0.0, timeout=3.0) == "initial ranks [0, 1] are gone"
    # A member without a heartbeat counts from when the joiner began to watch; etcd away restarts the count.
    assert nobody_left([0], set(), {}, now=102.0, watching_since=100.0, timeout=3.0) is None
    assert nobody_left([0], set(), {}, now=104.0, watching_since=100.0, timeout=3.0, reachable_since=103.0) is None
    assert nobody_left([], set(), {}, now=104.0, watching_since=0.0, timeout=3.0) is None


@pytest.fixture
def tcp_store() -> dist.Store:
    return dist.TCPStore("127.0.0.1", 0, None, True, seconds(10), wait_for_workers=False)


def test_a_joiner_sees_a_restart_that_terminated_its_whole_world(
    tcp_store: dist.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank of iteration 0 died; their monitor processes arrived at its barriers in their place, so the
    restart ended with nobody: nothing will admit a joiner into iteration 1."""
    monkeypatch.setattr(joining, "WORLD_LOOK_INTERVAL", 0.0)
    job = job_store(tcp_store)
    world = RunningWorld(job, tcp_store, 3, heartbeat_timeout=30.0)
    first = iteration_store(tcp_store, 0)
    for rank in range(3):
        first.record_interruption(rank, "terminated", f"process {rank} died")
        first.record_terminated([rank])
        assert world.gone() is None  # the others may still restart it
        first.arrive_and_wait(TERMINATION_BARRIER, [rank], 3, seconds(0) if rank < 2 else seconds(1))
    job.record_latest_iteration(1)
    assert world.gone() == (
        "iteration 0 ended with every rank of its world of 3 terminated, and nobody was admitted into iteration 1"
    )


@pytest.mark.parametrize("published", ["not json", '{"world_size": -1}', '{"world_size": 3, "terminated": "all"}'])
def test_a_malformed_restart_result_never_makes_a_joiner_give_up(
    tcp_store: dist.Store, monkeypatch: pytest.MonkeyPatch, published: str
) -> None:
    """What etcd returns is untrusted: a result that does not decode reads as a world that still has ranks."""
    monkeypatch.setattr(joining, "WORLD_LOOK_INTERVAL", 0.0)
    job = job_store(tcp_store)
    iteration_store(tcp_store, 0).store.set(keys.barrier_done(TERMINATION_BARRIER), published)
    job.record_latest_iteration(1)
    assert RunningWorld(job, tcp_store, 3, heartbeat_timeout=30.0).gone() is None


def test_a_joiner_waits_while_a_member_beats_and_gives_up_once_none_does(
    tcp_store: dist.Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 2 died and interrupted iteration 0; ranks 0 and 1 (a stopped node) never restart it. While one
    of them sends heartbeats the joiner waits; once both are silent for the heartbeat timeout, it gives up."""
    monkeypatch.setattr(joining, "WORLD_LOOK_INTERVAL", 0.0)
    job = job_store(tcp_store)
    for rank in range(3):
        job.record_position(rank, 0, rank, 3, True)
        job.liveness.send_heartbeat(rank)
    world = RunningWorld(job, tcp_store, 3, heartbeat_timeout=0.5)
    assert world.gone() is None  # training: no interruption
    running = iteration_store(tcp_store, 0)
    running.record_interruption(2, "terminated", "process 2 died")
    running.record_terminated([2])
    assert world.gone() is None  # ranks 0 and 1 beat lately: they will restart it
    time.sleep(0.6)
    job.liveness.send_heartbeat(0)
    assert world.gone() is None  # rank 0 still beats
    time.sleep(0.6)
    assert world.gone() == (
        "iteration 0 was interrupted (terminated on rank 2) and no member of its world is left: initial ranks [2] "
        "are gone and initial ranks [0, 1] sent no heartbeat for 0.5 s"
    )
    # An admission request is no fault: a running world asked for it.
    job.record_latest_iteration(1)
    iteration_store(tcp_store, 1).request_restart(0, "admit_joiners", "initial rank(s) [3] ready")
    assert world.gone() is None


def test_barrier_arrival_is_idempotent_and_on_behalf(tcp_store: dist.Store) -> None:
    store = iteration_store(tcp_store, 0)
    store.record_terminated([2])
    # A monitor arrives for the dead rank 2, twice; rank 1 arrives twice too.
    store.arrive_and_wait(TERMINATION_BARRIER, [2], 3, seconds(0))
    store.arrive_and_wait(TERMINATION_BARRIER, [2, 1], 3, seconds(0))
    with pytest.raises(BarrierTimeout, match="2 of 3"):
        store.arrive_and_wait(TERMINATION_BARRIER, [1], 3, seconds(0.05))
    # The last arrival publishes the terminated ranks for everyone.
    published = TerminationResult(world_size=3, terminated=(2,)).to_json()
    assert store.arrive_and_wait(TERMINATION_BARRIER, [0], 3, seconds(1)) == published
    assert store.arrive_and_wait(TERMINATION_BARRIER, [1], 3, seconds(1)) == published
    assert TerminationResult.from_json(published, 3) == TerminationResult(3, (2,), ())


def test_barrier_overflow(tcp_store: dist.Store) -> None:
    store = iteration_store(tcp_store, 0)
    store.arrive_and_wait("some_barrier", [0, 1], 2, seconds(0))
    with pytest.raises(BarrierOverflow):
        store.arrive_and_wait("some_barrier", [5], 2, seconds(0))


def test_one_outcome_per_iteration(tcp_store: dist.Store) -> None:
    interrupted = iteration_store(tcp_store, 0)
    assert interrupted.record_interruption(1, "RuntimeError", "boom") == INTERRUPTED
    # A completion barrier finishing afterwards cannot overturn it.
    assert interrupted.arrive_and_wait(COMPLETION_BARRIER, [0], 1, seconds(1)) == INTERRUPTED
    (record,) = interrupted.interruptions()
    assert abs(record.time - time.time()) < 60  # when it was recorded: what elastic-ft status shows
    assert (record.rank, record.kind, record.message, record.step, record.origin) == (
        1,
        "RuntimeError",
        "boom",
        None,
        None,
    )

    # A corrupt line (another writer, a forged value) is skipped: the monitor thread reads
    # these records on its way to a restart, so one bad line must not stop it.
    interrupted.store.append("interruptions", '{"rank": -1, "kind": "x"}\n{"rank": 2\n')
    assert [r.rank for r in interrupted.interruptions()] == [1]

    completed = iteration_store(tcp_store, 1)
    assert completed.arrive_and_wait(COMPLETION_BARRIER, [0], 1, seconds(1)) == COMPLETED
    assert completed.record_interruption(0, "late", "") == COMPLETED
    assert completed.outcome() == COMPLETED


def test_a_planned_restart_waits_for_a_step_and_gives_way_to_a_final_outcome(tcp_store: dist.Store) -> None:
    planned = iteration_store(tcp_store, 0)
    assert planned.request_restart(0, "admission", "2 joiners") == PLANNED
    assert planned.request_restart(1, "admission", "again") == PLANNED  # idempotent: still planned
    assert [r.rank for r in planned.interruptions()] == [0, 1]
    # The first proposed step boundary holds for every rank.
    assert planned.restart_step(17) == 17
    assert planned.restart_step(12) == 17
    # At the boundary (or on a real fault before it) the restart becomes final, once.
    assert planned.decide_outcome(INTERRUPTED) == INTERRUPTED
    assert planned.decide_outcome(COMPLETED) == INTERRUPTED
    assert planned.outcome() == INTERRUPTED

    # A completion that comes first overrules a planned restart: the joiners wait for the next iteration.
    finished = iteration_store(tcp_store, 1)
    assert finished.request_restart(0, "admission") == PLANNED
    assert finished.arrive_and_wait(COMPLETION_BARRIER, [0], 1, seconds(1)) == COMPLETED
    assert finished.request_restart(0, "admission") == COMPLETED


def test_the_latest_iteration_and_whether_joiners_are_accepted_are_job_wide(tcp_store: dist.Store) -> None:
    job = job_store(tcp_store)
    assert job.latest_iteration() == 0
    assert job.joiners_accepted() is None and not job.accepts_joiners()
    store = iteration_store(tcp_store, 0)
    store.record_terminated([])
    store.arrive_and_wait(TERMINATION_BARRIER, [0], 1, seconds(1))
    assert job.latest_iteration() == 1
    job.set_accepts_joiners(False)
    assert job.joiners_accepted() is False
    job.set_accepts_joiners(True)
    assert job.joiners_accepted() is True and job.accepts_joiners()
    job.store.set(keys.LATEST_ITERATION, "-3")  # forged: read as no restart yet, never as a crash
    assert job.latest_iteration() == 0


def test_iterations_do_not_share_keys(tcp_store: dist.Store) -> None:
    iteration_store(tcp_store, 0).record_terminated([3])
    assert iteration_store(tcp_store, 0).terminated_ranks() == [3]
    assert iteration_store(tcp_store, 1).terminated_ranks() == []


def test_call_wrapper_parameters_found_by_annotation_even_as_strings() -> None:
    from elastic_ft.inprocess.restart.call import CallWrapper, _call_wrapper_parameters

    def train(
        data: int,
        plain: CallWrapper,
        optional: CallWrapper | None = None,
        postponed: "Optional[CallWrapper]" = None,  # noqa: F821, UP037 - deliberately unresolvable
        other: "int | None" = None,  # noqa: UP037 - a string on purpose
    ) -> None:
        pass

    assert _call_wrapper_parameters(train) == ["plain", "optional", "postponed"]


@pytest.mark.integration
def test_progress_timestamps_are_never_read_half_written() -> None:
    """The monitor process reads while the main process writes: a torn read
    (struct.pack_into zero-fills before packing) looked like no progress for
    the machine's whole uptime and hard-killed a healthy rank."""
    import math
    import os
    import time

    from elastic_ft.inprocess.hangs.heartbeats import ProgressTimestamps

    timestamps = ProgressTimestamps()
    writer = os.fork()
    if writer == 0:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            timestamps.reset()
            timestamps.beat_automatic()
            timestamps.beat_manual()
        os._exit(0)
    worst = 0.0
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        automatic, _ = timestamps.read()
        assert not math.isnan(automatic)
        worst = max(worst, timestamps.age())
    os.waitpid(writer, 0)
    assert worst < 5.0, f"read an age of {worst:.1f} s from timestamps written moments ago"


# ---- defaults that ftrun passes down -------------------------------------------


def test_job_config_supplies_wrapper_defaults_but_code_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_ft.handoff import JOB_CONFIG_ENV
    from elastic_ft.inprocess.rank_assignment import Tree
    from elastic_ft.job_config import load_job_config

    config = load_job_config(
        "wrapper: {soft_timeout: 7, hard_timeout: 9}\n"
        "rank_assignment: {tree: [{min_ranks: 1, key: job}, {min_ranks: 1, max_ranks: 2, key: host}]}\n"
    )
    monkeypatch.setenv(JOB_CONFIG_ENV, config.to_json().decode())
    wrapper = Wrapper()
    assert (wrapper.soft_timeout, wrapper.hard_timeout) == (
        datetime.timedelta(seconds=7),
        datetime.timedelta(seconds=9),
    )
    assert isinstance(wrapper.rank_assignment, Tree)
    explicit = Wrapper(soft_timeout=datetime.timedelta(seconds=60), hard_timeout=datetime.timedelta(seconds=61))
    assert explicit.soft_timeout == datetime.timedelta(seconds=60)  # given in code: the config does not override
    monkeypatch.setenv(JOB_CONFIG_ENV, '{"wrapper": {"soft_timeout": -1}}')
    with pytest.raises(ValueError, match="ELASTIC_FT_JOB_CONFIG holds an invalid job config: .*wrapper.soft_timeout"):
        Wrapper()


def test_default_store_is_the_etcd_round_store_under_ftrun(monkeypatch: pytest.MonkeyPatch, etcd: EtcdServer) -> None:
    import json

    from elastic_ft.etcd.store import EtcdStore
    from elastic_ft.handoff import STORE_ENV
    from elastic_ft.inprocess.store import default_store

    described = {
        "endpoints": [str(e) for e in etcd.endpoints],
        "prefix": "/elastic_ft/unit/round/0/store/",
        "connect_timeout": 5,
        "request_timeout": 5,
        "timeout": 30,
    }
    monkeypatch.setenv(STORE_ENV, json.dumps(described))
    store = default_store()
    assert isinstance(store, EtcdStore) and store.prefix == described["prefix"]
    # NVIDIA's examples place a TCPStore (store_kwargs={'port': MASTER_PORT + 1}): under ftrun the agent must
    # still find the Wrapper's records, so the round's store is used all the same.
    placed = default_store(port=29501, host_name="127.0.0.1", use_libuv=True)
    assert isinstance(placed, EtcdStore) and placed.prefix == described["prefix"]
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['colour'\]; expected timeout or TCPStore's"):
        default_store(colour="blue")
    monkeypatch.setenv(STORE_ENV, '{"endpoints": ["127.0.0.1:1"]}')
    with pytest.raises(ValueError, match="ELASTIC_FT_STORE=.* is not a valid etcd store description"):
        default_store()


def test_report_process_gone_uses_the_last_position(etcd: EtcdServer) -> None:
    from elastic_ft.coordination.iteration import iteration_store
    from elastic_ft.coordination.job import job_store
    from elastic_ft.coordination.reports import report_process_gone
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.etcd.store import EtcdStore
    from elastic_ft.keys import ITERATION_BARRIER, TERMINATION_BARRIER

    client = EtcdClient(etcd.endpoints)
    base = EtcdStore(client, f"/elastic_ft/unit-{time.monotonic_ns()}/store/")
    job = job_store(base)
    assert not report_process_gone(base, 5, 8, "terminated", "never wrapped")
    job.record_wrapped(5, 1234)
    job.record_position(5, iteration=2, rank=3, world_size=7, active=True)
    assert report_process_gone(base, 5, 8, "terminated", "pid 1234: signal SIGKILL")
    iteration = iteration_store(base, 2)
    assert iteration.terminated_ranks() == [3]
    assert iteration.barriers.has_arrived(ITERATION_BARRIER, 3) and iteration.barriers.has_arrived(
        TERMINATION_BARRIER, 3
    )
    assert iteration.interruptions()[0].kind == "terminated"
    job.record_left(6, "completed", gave_up=False)
    job.record_wrapped(6, 99)
    assert not report_process_gone(base, 6, 8, "terminated", "left already")
    client.close()


@pytest.mark.integration
def test_a_failed_set_up_undoes_what_it_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that cannot be reached: the call raises, and its monitor process and log handler are gone."""
    import logging

    from elastic_ft.inprocess.hangs.monitor import MONITOR_PROCESS_NAME

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    logger = logging.getLogger("elastic_ft.inprocess")
    handlers, level = list(logger.handlers), logger.level
    forked: list[int] = []
    fork = os.fork

    def recording_fork() -> int:
        pid = fork()
        if pid:
            forked.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", recording_fork)

    def unreachable_store() -> dist.Store:
        raise ConnectionError("store at 10.0.0.1:1 unreachable")

    with pytest.raises(ConnectionError, match="unreachable"):
        Wrapper(store_factory=unreachable_store)(lambda: None)()
    assert (logger.handlers, logger.level) == (handlers, level)
    assert len(forked) == 1  # the monitor process was started, and is reaped:
    with pytest.raises(ChildProcessError):
        os.waitpid(forked[0], os.WNOHANG)
    assert MONITOR_PROCESS_NAME not in _children_names()


def _children_names() -> list[str]:
    """The names of this process's children, whichever of its threads started them. A thread may end between the
    listing and the read (another test's leftover thread); its children then belong to a thread still listed."""
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as children:
                pids = children.read().split()
        except FileNotFoundError:
            continue
        for pid in pids:
            try:
                with open(f"/proc/{pid}/comm") as comm:
                    names.append(comm.read().strip())
            except OSError:
                continue
    return names


def test_a_state_dict_passed_instead_of_its_method_is_named_short_with_what_to_pass() -> None:
    state = {f"layer{i}.weight": list(range(1000)) for i in range(50)}  # a large state: its repr is long
    with pytest.raises(TypeError) as raised:
        Wrapper(state_dict=state, load_state_dict=print)  # type: ignore[arg-type]
    message = str(raised.value)
    assert message.startswith("Wrapper state_dict must be callable or None (the method itself, e.g. ")
    assert "state_dict=model.state_dict" in message and "got a dict: {'layer0.weight'" in message
    assert len(message) < 250, len(message)


def test_a_wrapped_function_called_outside_a_launcher_says_how_to_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import logging

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match=r"RANK and WORLD_SIZE are not set\. Run it with `ftrun --nproc-per-node=N"):
        Wrapper()(lambda: None)()
    assert logging.getLogger("elastic_ft.inprocess").handlers == []  # the failed set-up left nothing behind
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE is not set"):
        Wrapper()(lambda: None)()
