"""A child process that holds a rank's etcd lease and revokes it the moment the rank dies.

A replica group's members are records on their rank's lease; the other
groups leave a group out of the quorum once its records are gone. Left to
expire, a lease outlives a killed rank by its TTL (TorchFT's Lighthouse
waits out a heartbeat timeout the same way: 5 s by default). The sentinel
keeps the lease alive from a process of its own (so a rank busy in C code
with the GIL held keeps it too), and watches its rank through a pipe: when
the rank dies, however it dies, the kernel closes the pipe's write end,
the sentinel reads end-of-file, revokes the lease (the records go with it,
and every watcher sees it within milliseconds), and exits. A host lost as a
whole loses its sentinels too: its leases expire after their TTL.

Run as ``python -m elastic_ft.replicas.sentinel TTL`` with the replica
hand-off in its environment (:class:`~elastic_ft.handoff.ReplicaHandoff`);
it writes ``lease <id>`` once granted (or ``error <why>``) on standard
output.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
import time
import typing

from elastic_ft.etcd.client import EtcdClient, client_for
from elastic_ft.etcd.kv import EtcdRequestError, EtcdUnavailableError
from elastic_ft.etcd.session import Session
from elastic_ft.handoff import ReplicaHandoff
from elastic_ft.runtime.waits import Backoff

_PR_SET_PDEATHSIG = 1


class SentinelError(RuntimeError):
    """The sentinel could not hold a lease: etcd unreachable, or it died."""


class LeaseSentinel:
    """This process's lease, held by a sentinel child (see the module docstring)."""

    def __init__(self, ttl: int) -> None:
        if not isinstance(ttl, int) or ttl < 2:
            raise ValueError(f"lease TTL {ttl!r}: expected whole seconds, at least 2")
        self.ttl = ttl
        self.lease_id: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._write_fd: int | None = None

    def start(self, timeout: float) -> int:
        """Start the sentinel and return its lease's id; :class:`SentinelError` if none came within ``timeout``."""
        read_fd, write_fd = os.pipe()  # both ends close on exec: only the sentinel gets the read end, as stdin
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(self.ttl)],
                stdin=read_fd,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
        finally:
            os.close(read_fd)
        self._process, self._write_fd = process, write_fd
        _close_in_forked_children(self)
        line = _read_line(typing.cast(typing.IO[bytes], process.stdout).fileno(), time.monotonic() + timeout)
        kind, _, value = line.partition(" ")
        if kind == "lease" and value.isdigit():
            self.lease_id = int(value)
            return self.lease_id
        self.close()
        raise SentinelError(value or f"the lease sentinel gave no lease within {timeout:.0f} s")

    def next_lease(self) -> int | None:
        """Block until the sentinel holds a new lease (the last one was lost) and return it; None once the
        sentinel is gone."""
        process = self._process
        if process is None or process.stdout is None:
            return None
        line = process.stdout.readline().decode(errors="replace").strip()
        kind, _, value = line.partition(" ")
        if kind != "lease" or not value.isdigit():
            return None
        self.lease_id = int(value)
        return self.lease_id

    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def close(self) -> None:
        """Revoke the lease (the sentinel does, on end-of-file) and wait for the sentinel to exit."""
        write_fd, self._write_fd = self._write_fd, None
        if write_fd is not None:
            os.close(write_fd)
        process, self._process = self._process, None
        if process is not None:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()

    def _forget_in_child(self) -> None:
        """In a forked child (a data loader's worker): the pipe's write end is the parent's, not the child's."""
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        self._process = None


_sentinels: list[LeaseSentinel] = []


def _close_in_forked_children(sentinel: LeaseSentinel) -> None:
    """A forked child that kept the write end would keep its parent's lease alive after the parent died."""
    if not _sentinels:
        os.register_at_fork(after_in_child=_forget_all_in_child)
    _sentinels.append(sentinel)


def _forget_all_in_child() -> None:
    for sentinel in _sentinels:
        sentinel._forget_in_child()


def _read_line(fd: int, deadline: float) -> str:
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            return data.decode(errors="replace").strip()
        data += chunk
    return data.decode(errors="replace").strip()


class _DeathSignal:
    """The rank's death signal (SIGTERM), recorded rather than raised.

    A handler that raised could end the sentinel anywhere, before the revoke
    included: the rank's death closes the pipe and, a moment later, sends the
    death signal, so a ``SIGTERM`` often arrives as the sentinel leaves its
    wait for the end-of-file, and the lease would outlive the rank by its
    TTL. The handler only notes the signal; the byte it leaves on the
    wake-up pipe ends the wait at once (and stays there, unread).
    """

    def __init__(self) -> None:
        self.received = False
        self.wake_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)
        signal.signal(signal.SIGTERM, self._note)
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    def _note(self, signum: int, frame: object) -> None:
        self.received = True


def main(argv: list[str]) -> int:
    # The rank's death closes the pipe; the death signal covers a pipe a stray process inherited. Either way the
    # lease is revoked once, and no signal interrupts the revoke.
    death = _DeathSignal()
    if os.getppid() == 1:
        return 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C reaches the rank; this goes when the rank does
    try:
        handoff = ReplicaHandoff.from_env(os.environ)
        if handoff is None:
            raise ValueError("no replica hand-off in the environment")
        client = client_for(handoff)
        session = Session(client, int(argv[0]))
    except (ValueError, EtcdRequestError, EtcdUnavailableError) as error:
        print(f"error {error}", flush=True)
        return 1
    print(f"lease {session.id}", flush=True)
    try:
        while _rank_alive(session, death):
            # The lease was lost (etcd away longer than its TTL, say): the rank's records went with it. A new
            # lease, once etcd answers, and the rank publishes them again on it.
            renewed = _new_session(client, int(argv[0]), death)
            if renewed is None:
                return 0  # the rank died while etcd was away: its lease went with etcd's TTL
            session = renewed
            print(f"lease {session.id}", flush=True)
        try:
            session.close(revoke=True)
        except (EtcdRequestError, EtcdUnavailableError) as error:  # etcd away: the lease expires after its TTL instead
            print(f"could not revoke lease {session.id:x}: {error}", file=sys.stderr)
    finally:
        client.close()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # kept through the exit: a late death signal is no kill
    return 0


def _rank_alive(session: Session, death: _DeathSignal) -> bool:
    """Wait until the rank's end of the pipe closes or its death signal comes (False), or the lease is lost
    (True)."""
    while not session.expired.is_set():
        ready = select.select([0, death.wake_fd], [], [], 0.5)[0]
        if death.wake_fd in ready or (0 in ready and not os.read(0, 4096)):
            return False
    return True


def _new_session(client: EtcdClient, ttl: int, death: _DeathSignal) -> Session | None:
    """A new lease once etcd answers; None if the rank died first."""
    backoff = Backoff()
    while not death.received:
        try:
            return Session(client, ttl)
        except (EtcdRequestError, EtcdUnavailableError):
            backoff.pause()
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
