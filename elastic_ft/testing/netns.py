"""Test hosts on one machine: Linux network namespaces on a bridge, each with its own address.

A :class:`TestBed` builds, in the root namespace, a bridge with the
address ``10.A.B.1/24`` (where etcd listens) and one namespace per host,
joined to the bridge by a veth pair whose inner end is ``eth0`` with the
address ``10.A.B.(10 + i)``. Every process started in a host
(:meth:`TestBed.popen`) sees only that host's interfaces, so gloo binds to
its host's address (``GLOO_SOCKET_IFNAME=eth0``) and ``ftrun`` announces it
(``--local-addr``).

Faults on a host's link, none of which sends a FIN or an RST:

* :meth:`cut` / :meth:`heal`: the bridge's end of the host's veth goes down
  (every packet to or from the host is dropped), then up;
* :meth:`lose`: drop a fraction of the host's packets, both ways
  (``iptables`` ``statistic`` match);
* :meth:`isolate_from_peers`: the host reaches etcd but not the other
  hosts; :meth:`isolate_from_etcd`: the other hosts but not etcd;
  :meth:`clear` lifts both and the losses.

Packet delay needs the kernel's ``netem`` queueing discipline, which some
kernels lack (this project's CI machine among them): :meth:`delay` raises
:class:`TestBedUnavailable` there, with the reason.

Needs root, ``ip`` (iproute2) and ``iptables-legacy``; :func:`unavailable`
says why a machine cannot run it, for tests to skip with that reason. Every
name carries a random tag and :meth:`TestBed.stop` removes everything, so
beds of concurrent tests do not meet. A driver SIGKILLed before it could
stop its bed leaves it to its reaper (:mod:`elastic_ft.runtime.reaper`), if it has
one: the reaper kills what ran in the hosts and removes the rest.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from elastic_ft.runtime.reaper import current_reaper

#: The interface name of a host's link, inside its namespace (the same in every host).
HOST_INTERFACE = "eth0"


#: The chains and address matches that drop a host's traffic with one address, both ways.
_DROP_SIDES = (("OUTPUT", "-d"), ("INPUT", "-s"))


class TestBedUnavailable(RuntimeError):
    """This machine cannot build the test bed (or this fault); the message says why."""


def _run(*argv: str, stdin: str | None = None) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise TestBedUnavailable(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout.strip()}")


def unavailable() -> str | None:
    """Why this machine cannot build a test bed (None if it can)."""
    if os.geteuid() != 0:
        return "the network-namespace test bed needs root (ip netns, veth, iptables)"
    for tool in ("ip", "iptables-legacy", "iptables-legacy-restore"):
        if shutil.which(tool) is None:
            return f"the network-namespace test bed needs {tool} (apt install iproute2 iptables)"
    probe = f"eftprobe{random.randrange(16**4):04x}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"ip netns does not work here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


class TestBed:
    """``hosts`` test hosts on a bridge (see the module docstring); a context manager."""

    __test__ = False  # not a pytest class

    def __init__(self, hosts: int) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"a test bed holds 1 to 200 hosts, got {hosts}")
        self.hosts = hosts
        self.tag = f"{random.randrange(16**4):04x}"
        self._subnet = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
        self._started = False

    # ---- names and addresses ----

    @property
    def bridge(self) -> str:
        return f"eft{self.tag}br"

    @property
    def bridge_address(self) -> str:
        """Where etcd (in the root namespace) listens, as the hosts reach it."""
        return f"{self._subnet}.1"

    def namespace(self, host: int) -> str:
        return f"eft{self.tag}h{host}"

    def address(self, host: int) -> str:
        return f"{self._subnet}.{10 + host}"

    def _outer(self, host: int) -> str:
        """The bridge's end of the host's link."""
        return f"eft{self.tag}v{host}"

    # ---- life ----

    def start(self) -> TestBed:
        reason = unavailable()
        if reason is not None:
            raise TestBedUnavailable(reason)
        self._started = True
        reaper = current_reaper()
        if reaper is not None:
            for command in self._removals():
                reaper.run_on_exit(command)
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for host in range(self.hosts):
                ns, outer, inner = self.namespace(host), self._outer(host), f"eft{self.tag}i{host}"
                _run("ip", "netns", "add", ns)
                _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
                _run("ip", "link", "set", inner, "netns", ns)
                _run("ip", "-n", ns, "link", "set", inner, "name", HOST_INTERFACE)
                _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", HOST_INTERFACE)
                _run("ip", "-n", ns, "link", "set", HOST_INTERFACE, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "link", "set", outer, "master", self.bridge)
                _run("ip", "link", "set", outer, "up")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Remove the namespaces (killing what still runs in them), the links and the bridge."""
        if not self._started:
            return
        for host in range(self.hosts):
            for pid in self.processes(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
        reaper = current_reaper()
        for command in self._removals():
            subprocess.run(command, capture_output=True, check=False)
            if reaper is not None:
                reaper.forget(argv=command)
        self._started = False

    def _removals(self) -> list[list[str]]:
        """The commands that remove the bed, in order; each may fail on what was never made."""
        commands = []
        for host in range(self.hosts):
            commands += [["ip", "netns", "del", self.namespace(host)], ["ip", "link", "del", self._outer(host)]]
        return [*commands, ["ip", "link", "del", self.bridge]]

    def __enter__(self) -> TestBed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- processes ----

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host``."""
        return ["ip", "netns", "exec", self.namespace(host), *argv]

    def processes(self, host: int) -> list[int]:
        """The PIDs of every process running in host ``host``."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self.namespace(host)], capture_output=True, text=True, check=False
        )
        return [int(pid) for pid in listed.stdout.split() if pid.isdigit()]

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in host ``host``, with gloo bound to the host's link, in a session of its own.

        A host's processes share nothing with the test's, as on a real
        cluster. The scenarios SIGSTOP them: in the caller's process group, a
        stopped one would be woken by the SIGHUP and SIGCONT the kernel sends
        a group that becomes orphaned while a member is stopped (the shell
        that started the test exits, say), and a "frozen" launcher would shut
        its workers down. A session leader's group is orphaned from the
        start, so no such signal comes.
        """
        env = dict(kwargs.pop("env", None) or os.environ)
        env.setdefault("GLOO_SOCKET_IFNAME", HOST_INTERFACE)
        return subprocess.Popen(self.command(host, argv), env=env, start_new_session=True, **kwargs)

    # ---- faults ----

    def cut(self, host: int) -> None:
        """Drop every packet to and from ``host``, silently (the bridge's end of its link goes down)."""
        _run("ip", "link", "set", self._outer(host), "down")

    def heal(self, host: int) -> None:
        _run("ip", "link", "set", self._outer(host), "up")

    def _iptables(self, host: int, *rule: str) -> None:
        _run("ip", "netns", "exec", self.namespace(host), "iptables-legacy", *rule)

    def lose(self, host: int, fraction: float) -> None:
        """Drop ``fraction`` of the packets ``host`` sends and receives."""
        if not 0 < fraction < 1:
            raise ValueError(f"a loss fraction is in (0, 1), got {fraction}")
        for chain in ("INPUT", "OUTPUT"):
            self._iptables(
                host,
                "-A",
                chain,
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                f"{fraction:.4f}",
                "-j",
                "DROP",
            )

    def _isolate(self, host: int, addresses: list[str]) -> None:
        """Drop ``host``'s traffic to and from ``addresses``, every link at the same instant: one
        ``iptables-restore`` commits all the rules at once. Rule by rule, the host would reach some peers
        but not others for a moment (a partial partition, a different fault), and its probes would be right
        to count the unreachable ones out."""
        rules = [f"-A {chain} {side} {address} -j DROP" for address in addresses for chain, side in _DROP_SIDES]
        batch = "\n".join(["*filter", *rules, "COMMIT", ""])
        _run("ip", "netns", "exec", self.namespace(host), "iptables-legacy-restore", "--noflush", stdin=batch)

    def isolate_from_peers(self, host: int) -> None:
        """``host`` keeps reaching etcd, but no other host."""
        self._isolate(host, [self.address(other) for other in range(self.hosts) if other != host])

    def isolate_from_etcd(self, host: int) -> None:
        """``host`` keeps reaching the other hosts, but not etcd."""
        self._isolate(host, [self.bridge_address])

    def clear(self, host: int) -> None:
        """Lift the losses and isolations of ``host``."""
        for chain in ("INPUT", "OUTPUT"):
            self._iptables(host, "-F", chain)

    def delay(self, host: int, milliseconds: float) -> None:
        """Delay every packet ``host`` sends (``tc netem``)."""
        _run(
            "ip",
            "netns",
            "exec",
            self.namespace(host),
            "tc",
            "qdisc",
            "add",
            "dev",
            HOST_INTERFACE,
            "root",
            "netem",
            "delay",
            f"{milliseconds:g}ms",
        )

    def undelay(self, host: int) -> None:
        """Lift :meth:`delay`."""
        _run("ip", "netns", "exec", self.namespace(host), "tc", "qdisc", "del", "dev", HOST_INTERFACE, "root")
