"""Ports on this host: free TCP ports to listen on."""

from __future__ import annotations

import contextlib
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (another process may take it before it is used)."""
    (port,) = free_ports(1, host)
    return port


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports free on ``host`` now.

    Every socket stays bound until all are chosen: ports asked for one at a
    time may repeat, as the kernel hands a port released a moment ago out
    again (an etcd cluster given one port twice refuses to start). Another
    process may still take one before it is used. Falls back to any address
    when ``host`` cannot be bound here (an address of another interface,
    say), as the ports are then only proposals.
    """
    if count < 1:
        raise ValueError(f"free_ports: count must be at least 1, got {count}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(count):
            sock = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
            try:
                sock.bind((host, 0))
            except OSError:
                sock = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                sock.bind(("", 0))
            ports.append(int(sock.getsockname()[1]))
        return ports
