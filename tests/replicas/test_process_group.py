"""Building the cross-replica gloo group can be given up: a peer that stops mid-build holds nobody (real processes)."""

from __future__ import annotations

import dataclasses
import datetime
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_ft.inprocess.delivery.connections import socket_inodes, tcp_sockets
from elastic_ft.replicas.process_group import GroupBuildCancelled, ProcessGroupGloo
from elastic_ft.runtime.waits import poll

pytestmark = pytest.mark.integration

#: The kernel's state of an established TCP connection, as /proc/net/tcp writes it.
TCP_ESTABLISHED = "01"

#: Rank 0 of a two-member group, meeting rank 1 (the test) in a file store. With ``stop``, it stops itself
#: (SIGSTOP) as soon as it has read rank 1's address: gloo's exchange is done and no connection is made yet, so
#: rank 1 waits for a peer that will never answer. Without, it builds the group and all-reduces a one.
PEER = textwrap.dedent(
    """
    import datetime, os, signal, sys
    import torch, torch.distributed as dist

    class StopsAfterTheExchange(dist.Store):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
        def set(self, key, value):
            self.inner.set(key, value)
        def get(self, key):
            value = self.inner.get(key)
            if sys.argv[2] == "stop" and key.endswith("/1"):
                os.kill(os.getpid(), signal.SIGSTOP)
            return value
        def wait(self, keys, timeout=None):
            self.inner.wait(keys)
        def check(self, keys):
            return self.inner.check(keys)
        def add(self, key, amount):
            return self.inner.add(key, amount)
        def compare_set(self, key, expected, desired):
            return self.inner.compare_set(key, expected, desired)
        def delete_key(self, key):
            return self.inner.delete_key(key)
        def num_keys(self):
            return self.inner.num_keys()

    group = dist.ProcessGroupGloo(StopsAfterTheExchange(dist.FileStore(sys.argv[1], 2)), 0, 2, datetime.timedelta(seconds=30))
    tensor = torch.ones(1)
    group.allreduce([tensor]).wait()
    print(float(tensor), flush=True)
    """
)


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0] == "T"


def build_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "elastic_ft-gloo-build"]


@dataclasses.dataclass
class GivenUp:
    """One build given up beside a stopped peer."""

    latency: float  # from the stop seen to configure_in's return
    thread_ended: bool  # the build's thread ended within 2 s, the peer still stopped
    connected: bool  # gloo had connected to the peer: it waited for its answer, not for its connection


def build_beside_a_stopped_peer(group: ProcessGroupGloo, path: Path) -> GivenUp | None:
    """Build ``group`` as rank 1 beside a peer that stops after the address exchange, giving up once it stopped;
    None if gloo built the group anyway.

    Which side of a gloo pair connects and which waits for the connection depends on the two ports, which the
    kernel picks. Connecting, gloo builds the group (the stopped peer's kernel accepts), or waits for the peer's
    answer; waiting for the connection, it waits five times its timeout. Giving up must end every wait.
    """
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(path), "stop"])
    try:
        before = socket_inodes()
        seen: list[tuple[float, bool]] = []

        def cancelled() -> str | None:
            if not seen and stopped(peer.pid):
                established = [s for s in tcp_sockets() if s.inode not in before and s.state == TCP_ESTABLISHED]
                seen.append((time.monotonic(), bool(established)))
            return "the peer stopped" if seen else None

        try:
            group.configure_in(dist.FileStore(str(path), 2), 1, 2, cancelled)
        except GroupBuildCancelled as error:
            latency = time.monotonic() - seen[0][0]
            assert "given up (the peer stopped)" in str(error)
            return GivenUp(latency, poll(lambda: not build_threads(), 2.0), seen[0][1])
        group.abort()
        return None
    finally:
        peer.send_signal(signal.SIGKILL)
        peer.wait()


def test_a_build_waiting_on_a_peer_that_stopped_is_given_up_at_once_and_the_next_one_works(tmp_path: Path) -> None:
    """gloo waits for a peer stopped after the address exchange several times its timeout (5 x 3 s here);
    configure_in returns as soon as ``cancelled()`` says why, and ends gloo's wait, so that its thread ends too
    (a process that exits while one waits in gloo can abort). A group built afterwards with a live peer works."""
    group = ProcessGroupGloo(datetime.timedelta(seconds=3))
    given_up: list[GivenUp] = []
    for attempt in range(30):  # until a build waited for the peer's connection: each one does with p >= 1/3
        outcome = build_beside_a_stopped_peer(group, tmp_path / f"stopping-{attempt}")
        if outcome is not None:
            given_up.append(outcome)
            if not outcome.connected:
                break
    assert given_up and not given_up[-1].connected, f"no build waited for the peer's connection: {given_up}"
    for outcome in given_up:
        assert outcome.latency < 1.0, given_up  # gloo alone: 15 s
        assert outcome.thread_ended, given_up  # gloo alone: 15 s, then the thread ends
    with pytest.raises(RuntimeError, match="aborted or not configured"):
        group.allreduce_sum([torch.ones(1)])  # nothing half-built is left to use

    healthy = subprocess.Popen(
        [sys.executable, "-c", PEER, str(tmp_path / "healthy"), "run"], stdout=subprocess.PIPE, text=True
    )
    try:
        group.configure_in(dist.FileStore(str(tmp_path / "healthy"), 2), 1, 2)
        tensor = torch.ones(1)
        group.allreduce_sum([tensor])
        assert float(tensor) == 2.0
        assert healthy.communicate(timeout=30)[0].strip() == "2.0"
    finally:
        healthy.kill()
        healthy.wait()
    group.abort()
    assert not build_threads()


def test_a_build_that_fails_raises_what_gloo_raised() -> None:
    """A store that fails under the build: configure_in raises gloo's error, from the caller's thread."""

    class Broken(dist.Store):
        def set(self, key: str, value: str | bytes) -> None:
            raise RuntimeError("the store is broken")

    group = ProcessGroupGloo(datetime.timedelta(seconds=3))
    with pytest.raises(RuntimeError, match="the store is broken"):
        group.configure_in(Broken(), 0, 2)
    assert poll(lambda: not build_threads(), 5)
