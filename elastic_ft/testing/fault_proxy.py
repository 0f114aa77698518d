"""A TCP proxy between etcd clients and one etcd member that injects transport faults.

Tests point a client at :attr:`FaultProxy.endpoint` instead of the member
and, while requests flow, make the proxy:

* :meth:`~FaultProxy.lose_next_reply`: forward the next request, let the
  server apply it, then drop its answer and reset the connection -- the case
  where a client cannot tell whether its write committed;
* :meth:`~FaultProxy.reset_all`: reset every open connection now;
* :meth:`~FaultProxy.freeze` / :meth:`~FaultProxy.thaw`: stop moving bytes in
  either direction (a frozen server, or a black hole when new connections are
  frozen too), then resume;
* :meth:`~FaultProxy.set_delay`: add latency to every chunk.

A "request" is a chunk from the client, once the connection is established
(the server has sent its first chunk, the end of HTTP/2's handshake), that is
larger than HTTP/2's control frames (pings, acknowledgements and window
updates are 9 to 17 bytes); an "answer" is the first such chunk from the
server after a request. A gRPC response read in several chunks (headers, data,
trailers) counts once, so a gRPC response, not a handshake, an
acknowledgement or the tail of an earlier answer, is what gets lost.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from typing import cast

from elastic_ft.runtime.waits import pause

_CHUNK = 65536
_CONTROL_FRAME_MAX = 32  # bytes: HTTP/2 SETTINGS, PING and WINDOW_UPDATE frames are smaller


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (linger 0), as a crashed peer or a broken network would."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class _Connection:
    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.server = socket.create_connection(proxy.target, timeout=5)
        self.server.settimeout(None)
        self.established = False
        self.request_seen = False
        self.closed = False
        self.thread = threading.Thread(target=self._pump, name="fault-proxy-conn", daemon=True)

    def _pump(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.client, selectors.EVENT_READ, self.server)
        selector.register(self.server, selectors.EVENT_READ, self.client)
        try:
            while not self.closed:
                if self.proxy.frozen.is_set():
                    pause(0.01)
                    continue
                for key, _ in selector.select(timeout=0.05):
                    source = cast(socket.socket, key.fileobj)
                    try:
                        data = source.recv(_CHUNK)
                    except OSError:
                        data = b""
                    if not data:
                        self.close(reset=False)
                        return
                    if self.proxy.delay:
                        pause(self.proxy.delay)
                    if source is self.client:
                        if self.established and len(data) > _CONTROL_FRAME_MAX:
                            self.request_seen = True
                    elif not self.established:
                        self.established = True
                    elif self.request_seen and len(data) > _CONTROL_FRAME_MAX:
                        # The answer's first chunk; its rest (a DATA frame or trailers read
                        # separately) is not another answer.
                        self.request_seen = False
                        if self.proxy.take_reply_to_lose():
                            self.close(reset=True)  # the server has answered: it applied the request
                            return
                    try:
                        key.data.sendall(data)
                    except OSError:
                        self.close(reset=False)
                        return
        finally:
            selector.close()

    def close(self, *, reset: bool) -> None:
        self.closed = True
        for sock in (self.client, self.server):
            if reset:
                _reset(sock)
            else:
                with contextlib.suppress(OSError):
                    sock.close()


class FaultProxy:
    """Listens on a free loopback port and forwards every connection to ``target`` (host, port)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.delay = 0.0
        self.frozen = threading.Event()
        self.replies_lost = 0  # answers dropped so far
        self._replies_to_lose = 0
        self._replies_to_pass = 0
        self._lock = threading.Lock()
        self._connections: list[_Connection] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self._stopped = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._acceptor.start()

    @property
    def endpoint(self) -> str:
        host, port = self._listener.getsockname()[:2]
        return f"{host}:{port}"

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                connection = _Connection(self, client)
            except OSError:
                _reset(client)  # the member is down: so is the proxy's path to it
                continue
            with self._lock:
                self._connections = [c for c in self._connections if not c.closed]
                self._connections.append(connection)
            connection.thread.start()

    def take_reply_to_lose(self) -> bool:
        with self._lock:
            if self._replies_to_lose <= 0:
                return False
            if self._replies_to_pass > 0:
                self._replies_to_pass -= 1
                return False
            self._replies_to_lose -= 1
            self.replies_lost += 1
            return True

    @property
    def replies_to_lose(self) -> int:
        """Answers still to drop, of those asked for by :meth:`lose_next_reply`."""
        with self._lock:
            return self._replies_to_lose

    def lose_next_reply(self, count: int = 1, *, after: int = 0) -> None:
        """Let ``after`` answers through, then drop ``count`` (each after its request reached the server).

        Each dropped answer's connection is reset.
        """
        with self._lock:
            self._replies_to_lose += count
            self._replies_to_pass += after

    def reset_all(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for connection in connections:
            connection.close(reset=True)

    def freeze(self) -> None:
        self.frozen.set()

    def thaw(self) -> None:
        self.frozen.clear()

    def set_delay(self, seconds: float) -> None:
        self.delay = seconds

    def close(self) -> None:
        self._stopped.set()
        self._listener.close()
        self._acceptor.join(timeout=2)
        self.reset_all()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
