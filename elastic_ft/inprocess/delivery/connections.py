"""Release the wrapped function's connections, so that peers blocked in a collective fail at once.

Gloo cannot cancel a pending operation, and a process group's connections
close only when the group is freed, which user code, DDP's reducer, a
traceback or ``torch._dynamo`` (imported by the first ``torch.optim`` step)
can prevent indefinitely. This module works one level below: it shuts down
the TCP connections themselves (``shutdown(2)``, which ends every blocked
read and write on both sides; the file descriptors stay owned by gloo).

Which connections: every process group connects each pair of ranks once,
one side connecting to the other side's listener. A rank releases the
connections **accepted on listeners it created after the Wrapper's entry**.
Each live pair has exactly one such acceptor, so when every live rank
releases its own, every connection between live ranks is cut; a dead rank's
connections were closed by its kernel. A peer's release ends this side's
reads but not a write blocked on the peer's full window, so a release also
cuts the connections this rank initiated whose peer has shut them
(``CLOSE_WAIT``). Listeners themselves are never
touched (gloo ends the process when its listener fails), nor is anything
that existed at entry (the Wrapper's store connections), nor connections
the process initiated (an HTTP client, a store client).

That misses one case: peers that are alive but frozen (a SIGSTOPped node,
whose monitors are stopped too) release nothing, and a rank blocked reading
from one of them over a connection *it* initiated stays blocked. So when a
restart has not reached the main thread shortly after the first release,
the Wrapper also releases **the connections it initiated since entry**
(:func:`release_connections` with ``everything=True``): a client the
function opened meanwhile loses its connection too, and reconnects as
clients do. Connections accepted by a store this rank hosts stay.

One wait no release ends: gloo fails every operation of a connection that
fails except a send already being written (its data partly in the
kernel's buffer), whose wait lasts until the group's timeout (30 minutes
by default). A rank whose collective was sending when its peer died or
released stays blocked with no connection left open
(:func:`established_connections` is 0); the monitor thread says so, and
the monitor process replaces the process (its hard timeout). NCCL's
abort has no such gap.

A process forked while the function runs (a ``DataLoader`` worker) inherits
the function's sockets; if the rank then dies, those copies would keep its
connections open, and its peers blocked on them, until the orphaned worker
exits. :func:`close_inherited_in_child`, run after every fork while a
Wrapper is active, closes the child's copies (the child never uses them).

Linux only: sockets are read from ``/proc``.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import sys
from dataclasses import dataclass

from elastic_ft.inprocess.restart.logs import get_logger

log = get_logger("sockets")

_LISTEN = "0A"
_ESTABLISHED = "01"
#: The peer shut its side (its release): a write of ours blocked on the peer's full window stays blocked.
_CLOSE_WAIT = "08"
#: States of a connection a release may still have to cut.
_OPEN = (_ESTABLISHED, _CLOSE_WAIT)


@dataclass(frozen=True)
class TcpSocket:
    inode: int
    fd: int
    local_port: int
    remote_port: int
    state: str
    #: The local address (``127.0.0.1``, ``::``); empty when unknown.
    local_host: str = ""


def _own_socket_inodes() -> dict[int, int]:
    """inode -> one file descriptor of it, for every socket this process holds."""
    found: dict[int, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found.setdefault(int(target[8:-1]), int(name))
    return found


def sockets_of(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds (empty if it is gone)."""
    inodes: set[int] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def network_order(hexadecimal: str) -> bytes:
    """An address of ``/proc/net/tcp{,6}`` (32-bit words in host order, as hex) in network byte order."""
    raw = bytes.fromhex(hexadecimal)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return raw


def tcp_table_rows(pid: int) -> list[tuple[int, list[str]]]:
    """(address family, fields) of every row of the TCP tables of ``pid``'s network namespace.

    The kernel walks its whole connection hash table to write each table, whatever the process holds: a few
    milliseconds of kernel time on a host of tens of GiB (:mod:`elastic_ft.inprocess.hangs.resends`).
    """
    rows: list[tuple[int, list[str]]] = []
    for table, family in (("tcp", int(socket.AF_INET)), ("tcp6", int(socket.AF_INET6))):
        try:
            with open(f"/proc/{pid}/net/{table}") as lines:
                next(lines, None)
                rows += [(family, line.split()) for line in lines]
        except OSError:  # no IPv6 in this namespace, or the process is gone
            continue
    return rows


def _tcp_entries() -> dict[int, tuple[int, int, str, str]]:
    """inode -> (local port, remote port, state, local address) of the TCP sockets of this network namespace."""
    entries: dict[int, tuple[int, int, str, str]] = {}
    for _, fields in tcp_table_rows(os.getpid()):
        local, remote, state, inode = fields[1], fields[2], fields[3], int(fields[9])
        host, port = local.rsplit(":", 1)
        address = str(ipaddress.ip_address(network_order(host)))
        entries[inode] = (int(port, 16), int(remote.rsplit(":", 1)[1], 16), state, address)
    return entries


def tcp_sockets() -> list[TcpSocket]:
    """The TCP sockets this process holds."""
    entries = _tcp_entries()
    return [TcpSocket(inode, fd, *entries[inode]) for inode, fd in _own_socket_inodes().items() if inode in entries]


def gloo_listeners(sockets: list[TcpSocket], baseline: frozenset[int]) -> list[TcpSocket]:
    """Listeners created since ``baseline`` that are bound to one address, as gloo's devices are (pure).

    A TCPStore, and most servers, listen on every address (``0.0.0.0``,
    ``::``): they are left out.
    """
    return [
        s
        for s in sockets
        if s.state == _LISTEN
        and s.inode not in baseline
        and s.local_host
        and not ipaddress.ip_address(s.local_host).is_unspecified
    ]


def unblock_listeners(listeners: list[TcpSocket], ranks: range) -> int:
    """End gloo's wait for peers that will never connect: connect to each listener as each of ``ranks``, and close.

    A gloo pair that waits as the passive side of its connection (the peer
    connects to this rank's listener and writes the pair's sequence
    number: on a group's own device, the peer's rank) waits in C code,
    holding no socket a release could cut, for the group's timeout (30
    minutes by default): a peer that died while the group was being built
    leaves every rank waiting for it blocked there, out of reach of a
    restart. Writing a waiting pair's number and closing at once hands it a
    connection that ends: its set-up fails (or its first collective does)
    and the main thread comes back to Python, where the restart waits for
    it. Numbers of pairs already connected land in gloo's table of early
    connections, unused. Only used once a restart is under way and the
    main thread has ignored every other release. Returns the connections made.
    """
    made = 0
    for listener in listeners:
        for rank in ranks:
            try:
                with socket.create_connection((listener.local_host, listener.local_port), timeout=0.2) as connection:
                    connection.sendall(struct.pack("=Q", rank))
                made += 1
            except OSError:  # gone meanwhile, or refusing: nothing waits there
                break
    return made


def socket_inodes() -> frozenset[int]:
    """The sockets this process holds now: the baseline that :func:`release_connections` spares."""
    return frozenset(_own_socket_inodes())


def accepted_connections(sockets: list[TcpSocket], baseline: frozenset[int]) -> list[TcpSocket]:
    """The open connections accepted on listeners created after ``baseline`` was taken (pure)."""
    listener_ports = {s.local_port for s in sockets if s.state == _LISTEN and s.inode not in baseline}
    return [s for s in sockets if s.state in _OPEN and s.inode not in baseline and s.local_port in listener_ports]


def _initiated_connections(sockets: list[TcpSocket], baseline: frozenset[int]) -> list[TcpSocket]:
    """The open connections this process initiated after ``baseline`` was taken (pure)."""
    listener_ports = {s.local_port for s in sockets if s.state == _LISTEN}
    return [s for s in sockets if s.state in _OPEN and s.inode not in baseline and s.local_port not in listener_ports]


def released_by_peers(sockets: list[TcpSocket], baseline: frozenset[int]) -> list[TcpSocket]:
    """The connections :func:`accepted_connections` lists, plus those this process initiated after ``baseline``
    that their peer has shut (pure).

    A peer's release (``shutdown(2)`` of the connection it accepted) ends
    this side's reads, but not a write blocked on the peer's full receive
    window: that one returns only once this side shuts down too.
    """
    initiated = _initiated_connections(sockets, baseline)
    return accepted_connections(sockets, baseline) + [s for s in initiated if s.state == _CLOSE_WAIT]


_fork_baseline: frozenset[int] | None = None
_fork_handler_registered = False


def close_inherited_in_child(baseline: frozenset[int] | None) -> None:
    """From now on, close in every forked child the sockets created since ``baseline`` (``None``: stop)."""
    global _fork_baseline, _fork_handler_registered
    _fork_baseline = baseline
    if baseline is not None and not _fork_handler_registered:
        os.register_at_fork(after_in_child=_close_inherited)
        _fork_handler_registered = True


def _close_inherited() -> None:
    baseline = _fork_baseline
    if baseline is None:
        return
    for connection in tcp_sockets():
        if connection.inode not in baseline:
            with contextlib.suppress(OSError):
                os.close(connection.fd)


def created_connections(sockets: list[TcpSocket], baseline: frozenset[int]) -> list[TcpSocket]:
    """The connections :func:`accepted_connections` lists, plus those this process initiated after ``baseline`` was
    taken (pure). Connections accepted on a listener that existed at entry (a store this rank hosts, which its
    monitor process and its peers use) stay out."""
    return accepted_connections(sockets, baseline) + _initiated_connections(sockets, baseline)


def established_connections(baseline: frozenset[int]) -> int:
    """How many connections created since ``baseline`` are still established: what a read or write of the
    function blocked on the network can still be waiting for (a connection its peer closed ends both)."""
    return sum(1 for s in created_connections(tcp_sockets(), baseline) if s.state == _ESTABLISHED)


def release_connections(baseline: frozenset[int], *, everything: bool = False) -> int:
    """Shut down the connections accepted on listeners created since ``baseline`` and those its peers shut (with
    ``everything``, every connection created since); returns how many."""
    sockets = tcp_sockets()
    chosen = created_connections(sockets, baseline) if everything else released_by_peers(sockets, baseline)
    return sum(_shut_down(connection) for connection in chosen)


def listeners_among(inodes: frozenset[int]) -> list[TcpSocket]:
    """The listening sockets among the sockets ``inodes`` (a process group's own)."""
    return [s for s in tcp_sockets() if s.inode in inodes and s.state == _LISTEN]


def shut_down_sockets(inodes: frozenset[int]) -> int:
    """Shut down the open connections among the sockets ``inodes`` (a process group's own); returns how many."""
    return sum(_shut_down(s) for s in tcp_sockets() if s.inode in inodes and s.state in _OPEN)


def _shut_down(connection: TcpSocket) -> bool:
    try:
        # A duplicate of the descriptor reaches the same socket; closing the duplicate
        # leaves gloo's descriptor open, so gloo never acts on a reused number.
        with socket.socket(fileno=os.dup(connection.fd)) as duplicate:
            if os.fstat(duplicate.fileno()).st_ino != connection.inode:
                return False  # the descriptor was closed and reused since it was listed
            duplicate.shutdown(socket.SHUT_RDWR)
        return True
    except OSError as error:  # closed or already shut meanwhile
        log.debug("could not shut down socket %d: %s", connection.inode, error)
        return False
