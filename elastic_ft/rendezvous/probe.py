"""The agent's probe port, and the probe of another member's (see :mod:`elastic_ft.rendezvous.liveness`).

Every node listens on a TCP port of its own address and publishes it with
its ``alive`` record; the agent greets each connection with one byte and
closes it. The kernel completes the handshake from the listen backlog
whatever the agent does, so a handshake proves the host is there, the
greeting that the agent runs, a refusal that its process is gone, and
silence for the whole bound that nothing comes back from the host.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import cast

from elastic_ft.rendezvous.liveness import Answer, Detection

#: What the agent sends on every probe connection.
GREETING = b"\x01"


class ProbeServer:
    """Greets and closes connections on ``(host, port 0)`` from a daemon thread until :meth:`stop`."""

    def __init__(self, host: str) -> None:
        self.host = host
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
        listener.settimeout(0.2)
        self._socket = listener
        self._thread = threading.Thread(target=self._serve, name="elastic_ft-probe-server", daemon=True)
        self._thread.start()
        return self

    def _serve(self) -> None:
        listener = self._socket
        while listener is not None and not self._stopped.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with contextlib.suppress(OSError):
                connection.setblocking(False)
                connection.send(GREETING)
            connection.close()

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
