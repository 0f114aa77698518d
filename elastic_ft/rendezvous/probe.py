"""The agent's probe port, and the probe of another member's (see :mod:`elastic_ft.rendezvous.liveness`).

Every node listens on a TCP port of its own address and publishes it with
its ``alive`` record; the agent greets each connection with one byte. The
kernel completes the handshake from the listen backlog whatever the agent
does, so a handshake proves the host is there, the greeting that the agent
runs, a refusal that its process is gone, and silence for the whole bound
that nothing comes back from the host. A probe closes the connection after
the greeting.

The same port answers a member that asks for a vouch while etcd does not
answer it (:mod:`elastic_ft.rendezvous.fencing`): it sends :data:`ASK_VOUCH`
after the greeting, and gets one line of JSON back (:class:`~elastic_ft.
rendezvous.fencing.Vouch`): whether this node reaches etcd, and for how
long it promises to count nobody out.
"""

from __future__ import annotations

import contextlib
import errno
import json
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from elastic_ft.rendezvous.fencing import Vouch
from elastic_ft.rendezvous.liveness import Answer, Detection

#: What the agent sends on every probe connection.
GREETING = b"\x01"
#: What a member sends after the greeting to ask for a vouch.
ASK_VOUCH = b"V"
#: How long a connection may stay open for its request after the greeting.
_REQUEST_BOUND = 1.0
_MAX_ANSWER = 4096


class ProbeServer:
    """Greets connections on ``(host, port 0)`` and answers vouch requests, from a daemon thread until :meth:`stop`.

    ``vouch()``: this node's answer to a member that asks (None: the port
    answers none; the asker then counts it as no vouch).
    """

    def __init__(self, host: str, vouch: Callable[[], Vouch] | None = None) -> None:
        self.host = host
        self.vouch = vouch
        self._socket: socket.socket | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        """``host:port`` as peers dial it."""
        if self._socket is None:
            raise RuntimeError("the probe server has not started")
        host, port = self._socket.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> ProbeServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((self.host, 0))
        listener.listen(128)
        listener.setblocking(False)
        self._socket = listener
        self._thread = threading.Thread(target=self._serve, name="elastic_ft-probe-server", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        """Greet every connection at once; keep it open (up to :data:`_REQUEST_BOUND`) for a vouch request."""
        listener = self._socket
        if listener is None:
            return
        selector = selectors.DefaultSelector()
        try:
            selector.register(listener, selectors.EVENT_READ)
        except (OSError, ValueError):  # stopped before it began
            selector.close()
            return
        open_until: dict[socket.socket, float] = {}
        try:
            while not self._stopped.is_set():
                try:
                    ready = selector.select(0.2)
                except (OSError, ValueError):  # the listener closed under the selector: stopping
                    return
                for key, _ in ready:
                    if key.fileobj is listener:
                        self._accept(listener, selector, open_until)
                    else:
                        connection = cast(socket.socket, key.fileobj)
                        self._read_request(connection)
                        selector.unregister(connection)
                        open_until.pop(connection, None)
                        connection.close()
                now = time.monotonic()
                for connection in [c for c, until in open_until.items() if until <= now]:
                    selector.unregister(connection)
                    del open_until[connection]
                    connection.close()
        finally:
            for connection in open_until:
                connection.close()
            selector.close()

    def _accept(
        self, listener: socket.socket, selector: selectors.BaseSelector, open_until: dict[socket.socket, float]
    ) -> None:
        try:
            connection, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._stopped.set()  # the listener was closed
            return
        try:
            connection.setblocking(False)
            connection.send(GREETING)
        except OSError:
            connection.close()
            return
        selector.register(connection, selectors.EVENT_READ)
        open_until[connection] = time.monotonic() + _REQUEST_BOUND

    def _read_request(self, connection: socket.socket) -> None:
        """Answer a vouch request; anything else (a probe closing its end) ends the connection."""
        with contextlib.suppress(OSError):
            if connection.recv(1) != ASK_VOUCH or self.vouch is None:
                return
            connection.setblocking(True)
            connection.settimeout(_REQUEST_BOUND)
            connection.sendall(json.dumps(self.vouch().to_json()).encode() + b"\n")

    def stop(self) -> None:
        self._stopped.set()
        if self._socket is not None:
            self._socket.close()
        if self._thread is not None:
            self._thread.join(1.0)


def parse_address(text: object) -> tuple[str, int] | None:
    """``host:port`` or ``[v6]:port`` from an ``alive`` record (untrusted): None unless it is one."""
    if not isinstance(text, str) or len(text) > 300:
        return None
    host, _, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def probe(address: tuple[str, int], detection: Detection) -> tuple[Answer, float]:
    """Probe the agent at ``address``: its answer, and the seconds it took.

    Opens a new connection every ``retry_every`` until the agent greets on
    any of them, one is refused, or a bound passes: ``probe_bound`` with no
    handshake at all (silent), ``greeting_bound`` after the first handshake
    with no greeting (mute). Every attempt stays in flight until then (a
    lossy link loses some packets, not all).
    """
    start = time.monotonic()
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    selector = selectors.DefaultSelector()
    attempts: list[socket.socket] = []
    shaken: float | None = None  # when the first handshake completed
    try:
        next_attempt = start
        while True:
            now = time.monotonic()
            if shaken is None and now >= start + detection.probe_bound:
                return Answer.SILENT, now - start
            if shaken is not None and now >= shaken + detection.greeting_bound:
                return Answer.MUTE, now - shaken
            if now >= next_attempt:
                attempt = socket.socket(family, socket.SOCK_STREAM)
                attempt.setblocking(False)
                attempts.append(attempt)
                code = attempt.connect_ex(address)
                if code == errno.ECONNREFUSED:
                    return Answer.REFUSED, time.monotonic() - start
                if code in (0, errno.EINPROGRESS, errno.EAGAIN):
                    selector.register(attempt, selectors.EVENT_WRITE)
                next_attempt = now + detection.retry_every
            deadline = start + detection.probe_bound if shaken is None else shaken + detection.greeting_bound
            for key, events in selector.select(max(0.0, min(next_attempt, deadline) - time.monotonic())):
                attempt = cast(socket.socket, key.fileobj)
                if events & selectors.EVENT_WRITE:
                    error = attempt.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if error == errno.ECONNREFUSED:
                        return Answer.REFUSED, time.monotonic() - start
                    if error:  # unreachable, or reset on the way: the next attempt may get through
                        selector.unregister(attempt)
                        continue
                    shaken = time.monotonic() if shaken is None else shaken
                    selector.modify(attempt, selectors.EVENT_READ)
                    continue
                try:
                    attempt.recv(1)
                except OSError:
                    selector.unregister(attempt)  # reset: this attempt is over, not the probe
                    continue
                # A greeting, or the agent closing the connection: either way its process ran.
                return Answer.ANSWERED, time.monotonic() - start
    finally:
        selector.close()
        for attempt in attempts:
            with contextlib.suppress(OSError):
                attempt.close()


def ask_vouch(address: tuple[str, int], timeout: float) -> Vouch | None:
    """Ask the agent at ``address`` whether it reaches etcd (:class:`Vouch`); None without a valid answer in
    ``timeout`` (no agent, a silent host, an agent that answers no vouch, a malformed answer)."""
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(family, socket.SOCK_STREAM) as connection:
            connection.settimeout(timeout)
            connection.connect(address)
            if connection.recv(1) != GREETING:
                return None
            connection.sendall(ASK_VOUCH)
            received = b""
            while not received.endswith(b"\n") and len(received) < _MAX_ANSWER:
                connection.settimeout(max(0.001, deadline - time.monotonic()))
                chunk = connection.recv(_MAX_ANSWER)
                if not chunk:
                    break
                received += chunk
    except OSError:
        return None
    try:
        return Vouch.from_json(json.loads(received))
    except (ValueError, RecursionError):
        return None


def ask_all(addresses: Mapping[str, tuple[str, int] | None], timeout: float) -> dict[str, Vouch | None]:
    """Ask every node at once (one thread each); a node without an address gives no vouch."""
    answers: dict[str, Vouch | None] = {node: None for node, address in addresses.items() if address is None}
    targets = {node: address for node, address in addresses.items() if address is not None}
    if not targets:
        return answers
    with ThreadPoolExecutor(max_workers=min(64, len(targets)), thread_name_prefix="elastic_ft-vouch") as pool:
        futures = {node: pool.submit(ask_vouch, address, timeout) for node, address in targets.items()}
        answers.update({node: future.result() for node, future in futures.items()})
    return answers


def probe_all(
    addresses: Mapping[str, tuple[str, int] | None], detections: Mapping[str, Detection]
) -> dict[str, tuple[Answer, float]]:
    """Probe every node at once (one thread each, each with its own bounds from ``detections``); a node without
    an address is :attr:`Answer.UNKNOWN`."""
    answers: dict[str, tuple[Answer, float]] = {n: (Answer.UNKNOWN, 0.0) for n, a in addresses.items() if a is None}
    targets = {node: address for node, address in addresses.items() if address is not None}
    if not targets:
        return answers
    with ThreadPoolExecutor(max_workers=min(64, len(targets)), thread_name_prefix="elastic_ft-probe") as pool:
        futures = {node: pool.submit(probe, address, detections[node]) for node, address in targets.items()}
        answers.update({node: future.result() for node, future in futures.items()})
    return answers
