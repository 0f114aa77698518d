"""The Manager's arguments, its lease sentinel, and its records in etcd (real etcd, real processes)."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.keys import RunKeys
from elastic_ft.replicas.manager import Manager
from elastic_ft.replicas.process_group import ProcessGroupGloo
from elastic_ft.runtime.waits import poll


def state() -> dict[str, int]:
    return {}


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"pg": object()}, TypeError, "expected elastic_ft.torchft.ProcessGroupGloo"),
        ({"load_state_dict": None}, ValueError, "load_state_dict and state_dict together"),
        ({"min_replica_size": 0}, ValueError, "min_replica_size=0"),
        ({"timeout": 5}, ValueError, "timeout=5"),
        ({"lighthouse": "x"}, TypeError, "unexpected keyword argument"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(
    arguments: dict[str, object], error: type[Exception], message: str
) -> None:
    given = {
        "pg": ProcessGroupGloo(),
        "load_state_dict": lambda _: None,
        "state_dict": state,
        "min_replica_size": 1,
    } | arguments
    with pytest.raises(error, match=message):
        Manager(**given)  # type: ignore[arg-type]


def test_without_etcd_the_manager_says_where_to_give_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("ELASTIC_FT_STORE", "ELASTIC_FT_ETCD_ENDPOINTS", "ELASTIC_FT_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="ELASTIC_FT_ETCD_ENDPOINTS and ELASTIC_FT_RUN_ID"):
        Manager(ProcessGroupGloo(), None, None, min_replica_size=1)
    monkeypatch.setenv("ELASTIC_FT_ETCD_ENDPOINTS", "127.0.0.1:1")
    with pytest.raises(ValueError, match="needs both"):
        Manager(ProcessGroupGloo(), None, None, min_replica_size=1)


@pytest.fixture
def replica_env(etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunKeys]:
    run = f"manager-{time.monotonic_ns()}"
    monkeypatch.setenv("ELASTIC_FT_ETCD_ENDPOINTS", etcd.endpoint)
    monkeypatch.setenv("ELASTIC_FT_RUN_ID", run)
    yield RunKeys("/elastic_ft", run)


@pytest.mark.integration
def test_a_killed_rank_leaves_the_quorum_within_a_second(replica_env: RunKeys, etcd: EtcdServer) -> None:
    code = """
        from elastic_ft.torchft import Manager, ProcessGroupGloo
        manager = Manager(ProcessGroupGloo(), None, None, min_replica_size=1, replica_id="g0", rank=0, world_size=1)
        print("up", flush=True)
        import time; time.sleep(120)
    """
    rank = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    client = EtcdClient(etcd.endpoints)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "up"
        member = replica_env.replicas.member("g0", 0)
        assert client.get(member)[0] is not None
        assert poll(lambda: client.get_prefix(replica_env.replicas.quorums)[0] != [], 10.0)  # g0 formed quorum 0
        rank.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        rank.wait()
        assert poll(lambda: client.get(member)[0] is None, 5.0)
        assert time.monotonic() - killed < 1.0  # its sentinel revoked the lease; its TTL is 5 s
    finally:
        rank.kill()
        rank.wait()
        client.close()


def _sentinel_ending(stdin_first: bool, gap: float, signals: int) -> tuple[int, int, str]:
    """A sentinel (``python -m elastic_ft.replicas.sentinel``) ended as a rank's death ends it: its pipe's
    end-of-file and ``signals`` death signals, ``gap`` s apart, the pipe first or last. Its lease, exit code
    and standard error."""
    sentinel = subprocess.Popen(
        [sys.executable, "-m", "elastic_ft.replicas.sentinel", "30"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert sentinel.stdin is not None and sentinel.stdout is not None and sentinel.stderr is not None
    kind, _, lease = sentinel.stdout.readline().strip().partition(" ")
    assert kind == "lease", (kind, lease, sentinel.stderr.read() if sentinel.poll() is not None else "")
    steps = [sentinel.stdin.close, *[lambda: sentinel.send_signal(signal.SIGTERM)] * signals]
    for step in steps if stdin_first else steps[::-1]:
        step()
        time.sleep(gap)
    code = sentinel.wait(10)
    return int(lease), code, sentinel.stderr.read()


@pytest.mark.integration
def test_the_sentinel_revokes_its_lease_however_the_end_of_file_and_the_death_signal_interleave(
    replica_env: RunKeys, etcd: EtcdServer
) -> None:
    # A rank's death closes the pipe and sends the death signal a moment later; a signal that came while the
    # sentinel left its wait once ended it before the revoke, and the lease outlived the rank by its TTL.
    client = EtcdClient(etcd.endpoints)
    try:
        for stdin_first in (True, False):
            for gap in (0.0, 0.0005, 0.002, 0.02):
                lease, code, errors = _sentinel_ending(stdin_first, gap, signals=3)
                key = replica_env.replicas.member(f"sentinel-{lease:x}", 0)
                with pytest.raises(Exception, match="lease not found|requested lease not found"):
                    client.put(key, b"a record on the rank's lease", lease=lease)
                assert (code, errors) == (0, ""), (stdin_first, gap)
    finally:
        client.close()


@pytest.mark.integration
def test_a_lost_lease_is_taken_again_and_the_record_published_again(replica_env: RunKeys, etcd: EtcdServer) -> None:
    previous_hook = sys.excepthook
    manager = Manager(
        ProcessGroupGloo(),
        None,
        None,
        min_replica_size=1,
        replica_id="g1",
        rank=0,
        world_size=1,
        connect_timeout=datetime.timedelta(seconds=20),
    )
    client = EtcdClient(etcd.endpoints)
    try:
        member = replica_env.replicas.member("g1", 0)
        kv, _ = client.get(member)
        assert kv is not None
        client.revoke_lease(kv.lease)  # as etcd does to a lease it could not hear from within its TTL
        assert poll(lambda: (found := client.get(member)[0]) is not None and found.lease != kv.lease, 15.0)
        manager.start_quorum()  # it trains in a quorum as before
        assert manager.is_participating() and manager.num_participants() == 1
    finally:
        manager.shutdown()
        sys.excepthook = previous_hook
        client.close()
    assert client_free_of(etcd, member)


def client_free_of(etcd: EtcdServer, key: str) -> bool:
    client = EtcdClient(etcd.endpoints)
    try:
        return client.get(key)[0] is None  # shutdown revoked the lease: the record is gone at once
    finally:
        client.close()


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"ELASTIC_FT_ETCD_ENDPOINTS": "host:notaport", "ELASTIC_FT_RUN_ID": "job"}, "ELASTIC_FT_ETCD_ENDPOINTS"),
        ({"ELASTIC_FT_ETCD_ENDPOINTS": "127.0.0.1:2379", "ELASTIC_FT_RUN_ID": "a/b"}, "without '/'"),
        (
            {"ELASTIC_FT_ETCD_ENDPOINTS": "127.0.0.1:2379", "ELASTIC_FT_RUN_ID": "j", "ELASTIC_FT_ETCD_PREFIX": "x"},
            "absolute key prefix",
        ),
        ({"ELASTIC_FT_STORE": '{"endpoints": []}'}, "ELASTIC_FT_STORE"),
    ],
)
def test_a_malformed_replica_hand_off_names_the_variable(environ: dict[str, str], message: str) -> None:
    from elastic_ft.handoff import ReplicaHandoff

    with pytest.raises(ValueError, match=message):
        ReplicaHandoff.from_env(environ)


def test_the_sentinel_refuses_a_lease_it_could_not_keep() -> None:
    from elastic_ft.replicas.sentinel import LeaseSentinel

    with pytest.raises(ValueError, match="at least 2"):
        LeaseSentinel(1)


def test_a_collective_on_an_aborted_group_fails_instead_of_passing_for_a_one_member_groups() -> None:
    """An aborted group must fail its collectives: one that passed would let a step commit alone, unaveraged."""
    import torch
    import torch.distributed as dist

    group = ProcessGroupGloo()
    with pytest.raises(RuntimeError, match="aborted or not configured"):
        group.allreduce_sum([torch.ones(2)])
    group.configure_in(dist.HashStore(), 0, 1)
    tensor = torch.ones(2)
    group.allreduce_sum([tensor])
    group.allreduce_max(tensor)
    assert tensor.tolist() == [1.0, 1.0] and len(group.allgather(tensor)) == 1  # one member: nothing to do
    group.abort()
    for collective in (lambda: group.allreduce_sum([tensor]), lambda: group.allreduce_max(tensor)):
        with pytest.raises(RuntimeError, match="aborted or not configured"):
            collective()
    with pytest.raises(RuntimeError, match="aborted or not configured"):
        group.allgather(tensor)


_HEALING_MEMBER = """
    import datetime, os, signal, sys, time
    import torch
    from elastic_ft.torchft import Manager, ProcessGroupGloo

    me, stop_at = sys.argv[1], int(sys.argv[2])
    weights = torch.zeros(4)

    def state_dict():  # called to send this member's state: g0 dies as it sends
        if me == "g0":
            print("dying in the send", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return {"w": weights}

    def load_state_dict(state):
        weights.copy_(state["w"])

    manager = Manager(
        ProcessGroupGloo(datetime.timedelta(seconds=10)), load_state_dict, state_dict,
        min_replica_size=1, replica_id=me, rank=0, world_size=1,
    )
    failed = 0
    while manager.current_step() < stop_at:
        manager.start_quorum()
        gradient = torch.ones(4)
        manager.allreduce(gradient)
        if manager.should_commit():
            weights.add_(gradient)
        else:
            failed += 1
        print("step", manager.current_step(), flush=True)
        time.sleep(0.05)
    print("done", manager.current_step(), failed, float(weights[0]), flush=True)
    manager.shutdown()
"""


@pytest.mark.integration
def test_a_member_lost_while_it_heals_another_fails_the_step_not_the_receiver(replica_env: RunKeys) -> None:
    """g0 trains alone; g1 joins behind it, and g0 dies while it sends its state. g1's receive fails: that step
    fails (it does not commit), g1 trains on in the next quorum, alone, and ends normally."""
    env = os.environ.copy()
    sender = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HEALING_MEMBER), "g0", str(10**6)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    receiver = None
    try:
        assert sender.stdout is not None
        for line in sender.stdout:
            if line.startswith("step") and int(line.split()[1]) >= 20:
                break
        receiver = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_HEALING_MEMBER), "g1", "30"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        out, err = receiver.communicate(timeout=120)
        assert sender.wait(10) == -signal.SIGKILL and "dying in the send" in sender.stdout.read()
        assert receiver.returncode == 0 and "Traceback" not in err, err[-3000:]
        done = out.splitlines()[-1].split()
        assert done[:2] == ["done", "30"] and int(done[2]) >= 1, out[-2000:]  # the step of the failed heal
        assert float(done[3]) == 30.0, out[-2000:]  # 30 steps of its own: it was never healed
        assert "step 0 failed" in err, err[-3000:]
    finally:
        for process in (sender, receiver):
            if process is not None:
                process.kill()
                process.wait()
