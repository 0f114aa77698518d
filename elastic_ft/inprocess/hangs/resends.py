"""Whether a rank's TCP connections are resending data the network lost, read from another process.

The monitor process asks this whenever its rank neither makes progress nor
uses CPU: a rank blocked in a send over a lossy link is slow, not hung.
The kernel says so per connection: its retransmit timer runs and has
already expired at least once (``tr`` 1 and ``retrnsmt`` > 0 in
``/proc/<pid>/net/tcp``). Data merely in flight is not enough: a request
its server answers later (a store's blocking wait) holds the timer until
the delayed ACK. A hung peer's kernel still acknowledges what it receives
(and a full window runs the probe timer, not this one), so this is never
true of a rank that only waits for a hung peer.

Reading ``/proc/<pid>/net/tcp`` makes the kernel walk its whole connection
hash table, whose size follows the host's memory, however few sockets the
rank holds: about 4 ms of kernel time per table on a 24 GiB host, 8 % of a
core per monitor at ten samples a second, and more on larger hosts. So
:class:`ResendProbe` reads the tables only to learn the addresses of
sockets it has not seen before, and otherwise asks the kernel about each of
the rank's connections by address (``sock_diag`` netlink, an exact lookup:
a few microseconds). Where the kernel offers no ``sock_diag`` for TCP, it
reads the tables every time.
"""

from __future__ import annotations

import math
import os
import socket
import struct
from dataclasses import dataclass

from elastic_ft.inprocess.delivery.connections import network_order, sockets_of, tcp_table_rows

#: ``tr`` of /proc/net/tcp and ``idiag_timer`` of sock_diag: the retransmit timer runs (data sent, not acknowledged).
_RETRANSMIT_TIMER = 1
_LISTEN = 0x0A
#: linux/netlink.h, linux/sock_diag.h
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
#: linux/inet_diag.h: match any socket cookie.
_NO_COOKIE = 0xFFFFFFFF
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, sequence, port id
_REQUEST = struct.Struct("=BBBBI")  # inet_diag_req_v2 up to its socket id: family, protocol, ext, pad, states
_SOCKET_ID = struct.Struct("!HH16s16s")  # inet_diag_sockid up to its interface: ports and addresses, network order
_SOCKET_ID_TAIL = struct.Struct("=III")  # interface, cookie
_REPLY = struct.Struct("=BBBB")  # inet_diag_msg's start: family, state, timer, retransmits
_INODE = struct.Struct("=I")
#: Where inet_diag_msg's inode is: after its start, the socket id, and expires, rqueue, wqueue and uid.
_INODE_OFFSET = _HEADER.size + _REPLY.size + _SOCKET_ID.size + _SOCKET_ID_TAIL.size + 16
#: Seconds before the tables are read again for sockets they did not show: a TCP socket appears there once it
#: connects or listens, so one created just before a sample is seen this much later at most.
_LOOK_AGAIN_AFTER = 2.0
#: Seconds a lookup's answer may take (the kernel answers at once); past it, the tables answer instead.
_ANSWER_WITHIN = 1.0


@dataclass(frozen=True)
class _Connection:
    """A TCP connection's address as ``sock_diag`` looks it up (addresses in network byte order)."""

    family: int
    local: bytes
    local_port: int
    remote: bytes
    remote_port: int


def resending_by_tables(pid: int) -> bool:
    """Whether a TCP connection of ``pid`` is resending lost data, from its namespace's TCP tables (costly: see
    the module's docstring)."""
    inodes = sockets_of(pid)
    if not inodes:
        return False
    for _, fields in tcp_table_rows(pid):
        try:
            timer, timeouts = int(fields[5].split(":", 1)[0], 16), int(fields[6], 16)
            if timer == _RETRANSMIT_TIMER and timeouts > 0 and int(fields[9]) in inodes:
                return True
        except (IndexError, ValueError):
            continue
    return False


def _connections(pid: int, inodes: set[int]) -> dict[int, _Connection | None]:
    """inode -> address, for each of ``inodes`` found in the TCP tables (None: a listener, which resends nothing)."""
    found: dict[int, _Connection | None] = {}
    for family, fields in tcp_table_rows(pid):
        try:
            inode = int(fields[9])
            if inode not in inodes:
                continue
            (local, local_port), (remote, remote_port) = (part.rsplit(":", 1) for part in fields[1:3])
            connection = _Connection(
                family, network_order(local), int(local_port, 16), network_order(remote), int(remote_port, 16)
            )
            found[inode] = None if int(fields[3], 16) == _LISTEN else connection
        except (IndexError, ValueError):
            continue
    return found


class _SockDiag:
    """Exact lookups of TCP connections over a ``NETLINK_SOCK_DIAG`` socket (opened on first use)."""

    def __init__(self) -> None:
        self._socket: socket.socket | None = None
        self._sequence = 0

    def timer(self, connection: _Connection) -> tuple[int, int, int] | None:
        """(timer, retransmits, inode) of the connection; None if the kernel has no such connection.

        Raises:
            OSError: the kernel offers no ``sock_diag`` for TCP (its answer to a lookup of a known socket).
        """
        if self._socket is None:
            self._socket = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG)
            self._socket.settimeout(_ANSWER_WITHIN)
        self._sequence += 1
        request = (
            _REQUEST.pack(connection.family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
            + _SOCKET_ID.pack(
                connection.local_port,
                connection.remote_port,
                connection.local.ljust(16, b"\0"),
                connection.remote.ljust(16, b"\0"),
            )
            + _SOCKET_ID_TAIL.pack(0, _NO_COOKIE, _NO_COOKIE)
        )
        self._socket.send(
            _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, self._sequence, 0) + request
        )
        try:
            while True:  # an answer to an earlier lookup that timed out is skipped
                reply = self._socket.recv(8192)
                _, kind, _, sequence, _ = _HEADER.unpack_from(reply)
                if sequence == self._sequence:
                    break
            if kind == _NLMSG_ERROR:
                return None
            _, _, timer, retransmits = _REPLY.unpack_from(reply, _HEADER.size)
            (inode,) = _INODE.unpack_from(reply, _INODE_OFFSET)
        except struct.error as error:  # an answer shorter than its kind: not what this module asked for
            raise OSError(f"a sock_diag answer of {len(reply)} bytes could not be read: {error}") from error
        return timer, retransmits, inode

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def open_sock_diag() -> _SockDiag | None:
    """Lookups over a new netlink socket, if this kernel answers ``sock_diag`` lookups of TCP connections (it
    must find a listener made for the question, in the caller's network namespace: the monitor process is
    forked from its rank, so it shares the rank's); None where it does not."""
    lookup = _SockDiag()
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            port = listener.getsockname()[1]
            found = lookup.timer(_Connection(socket.AF_INET, socket.inet_aton("127.0.0.1"), port, bytes(4), 0))
            if found is not None and found[2] == os.fstat(listener.fileno()).st_ino:
                return lookup
    except OSError:
        pass
    lookup.close()
    return None


class ResendProbe:
    """Whether process ``pid`` is resending lost data, asked again and again (the monitor's samples).

    Each answer lists the process's sockets (``/proc/<pid>/fd``), reads the
    TCP tables only when a socket is new to it (and every
    ``_LOOK_AGAIN_AFTER`` seconds while some socket is missing from them: not
    TCP, or not connected yet), and looks each connection up by address. The
    constructor does no I/O; the netlink socket opens on the first answer
    (:meth:`close` closes it). A lookup that fails (no ``sock_diag``, no
    answer) is answered from the tables.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        #: Set by the first answer: lookups, or None where the kernel answers none.
        self._lookup: _SockDiag | None = None
        self._opened = False
        #: inode -> its connection's address (None: a listener), for every TCP socket seen in the tables.
        self._known: dict[int, _Connection | None] = {}
        self._unmatched: frozenset[int] = frozenset()
        self._unmatched_at = -math.inf

    def resending(self, now: float) -> bool:
        """``now``: ``time.monotonic()``, which spaces the tables' reads for sockets they did not show."""
        if not self._opened:
            self._lookup, self._opened = open_sock_diag(), True
        if self._lookup is None:
            return resending_by_tables(self.pid)
        inodes = sockets_of(self.pid)
        unread = inodes - self._known.keys()
        if not unread <= self._unmatched or (unread and now - self._unmatched_at >= _LOOK_AGAIN_AFTER):
            self._known = {inode: self._known[inode] for inode in inodes if inode in self._known}
            self._known.update(_connections(self.pid, unread))
            self._unmatched, self._unmatched_at = frozenset(unread - self._known.keys()), now
        try:
            for inode in inodes:
                connection = self._known.get(inode)
                found = None if connection is None else self._lookup.timer(connection)
                if found is not None and found[2] == inode and found[0] == _RETRANSMIT_TIMER and found[1] > 0:
                    return True
        except OSError:
            self._lookup.close()
            return resending_by_tables(self.pid)
        return False

    def close(self) -> None:
        if self._lookup is not None:
            self._lookup.close()
