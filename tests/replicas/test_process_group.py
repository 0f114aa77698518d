"""Building the cross-replica gloo group can be given up: a peer that stops mid-build holds nobody (real processes)."""

from __future__ import annotations

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

from elastic_ft.replicas.process_group import GroupBuildCancelled, ProcessGroupGloo
from elastic_ft.runtime.waits import poll

pytestmark = pytest.mark.integration

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


def wait_for_a_stopped_peer(group: ProcessGroupGloo, path: Path) -> tuple[float, float] | None:
    """Build ``group`` as rank 1 beside a peer that stops after the address exchange, giving up once it stopped:
    (when the stop was seen, when configure_in returned), or None if gloo connected to the stopped peer first.

    Which side of a gloo pair connects and which waits depends on the two ports, which the kernel picks. The
    connecting side completes its build (the stopped peer's kernel accepts the connection); only the waiting
    side waits, several times its timeout.
    """
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(path), "stop"])
    try:
        noticed: list[float] = []

        def cancelled() -> str | None:
            if noticed or stopped(peer.pid):
                noticed.append(time.monotonic())
                return "the peer stopped"
            return None

        try:
            group.configure_in(dist.FileStore(str(path), 2), 1, 2, cancelled)
        except GroupBuildCancelled as error:
            assert "given up (the peer stopped)" in str(error)
            return noticed[0], time.monotonic()
        group.abort()
        return None
    finally:
        peer.send_signal(signal.SIGKILL)
        peer.wait()


def test_a_build_waiting_on_a_peer_that_stopped_is_given_up_at_once_and_the_next_one_works(tmp_path: Path) -> None:
    """gloo waits for a peer stopped after the address exchange several times its timeout (5 x 3 s here), and
    nothing wakes it; configure_in returns as soon as ``cancelled()`` says why, and its thread ends when gloo
    gives up. A group built afterwards with a live peer works."""
    timeout = datetime.timedelta(seconds=3)
    group = ProcessGroupGloo(timeout)
    for attempt in range(20):  # each attempt is the waiting side with probability 1/2
        waited = wait_for_a_stopped_peer(group, tmp_path / f"stopping-{attempt}")
        if waited is not None:
            break
    assert waited is not None, "gloo connected to the stopped peer 20 times in a row"
    noticed, given_up = waited
    assert given_up - noticed < 1.0, given_up - noticed  # gloo alone: 15 s
    with pytest.raises(RuntimeError, match="aborted or not configured"):
        group.allreduce_sum([torch.ones(1)])  # nothing half-built is left to use
    # The thread lives until gloo gives up on its own (its timeout, five times over), then ends.
    assert poll(lambda: not build_threads(), 8 * timeout.total_seconds()), build_threads()

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
