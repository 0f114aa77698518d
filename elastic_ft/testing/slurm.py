"""A real Slurm on this host, for tests: munged, one slurmctld and a slurmd per simulated node.

Debian's ``slurm-wlm`` runs several ``slurmd -N nodeN`` on one host, each
on a port of its own; the controller and the daemons run in the
foreground as this process's children, with a private munge socket and
key, so nothing of the host's Slurm (if any) is used or touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elastic_ft.runtime.net import free_ports
from elastic_ft.runtime.waits import pause

#: What a test needs installed: ``apt-get install slurmd slurmctld slurm-client munge``.
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scancel")


def missing_binaries() -> list[str]:
    return [name for name in BINARIES if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass
class SlurmCluster:
    """``nodes`` Slurm nodes named node1..nodeN on 127.0.0.1; ``env`` is what a Slurm command needs."""

    nodes: int = 4
    cpus: int = 2
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="elastic-ft-slurm-")))
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.workdir / "slurm.conf")}

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        work = self.workdir
        for sub in ("state", "spool", "munge"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        key = work / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket = work / "munge" / "munge.sock"
        self._spawn(
            [
                _binary("munged"),
                "--foreground",
                "--force",
                f"--socket={socket}",
                f"--key-file={key}",
                f"--pid-file={work / 'munge' / 'munged.pid'}",
                f"--seed-file={work / 'munge' / 'munged.seed'}",
                f"--log-file={work / 'munge' / 'munged.log'}",
            ],
            "munged",
        )
        _wait(socket.exists, timeout, lambda: "munged did not create its socket")
        ports = free_ports(self.nodes + 1)
        (work / "slurm.conf").write_text(self._config(socket, ports[0], ports[1:]))
        self._spawn([_binary("slurmctld"), "-D", "-c"], "slurmctld")
        for n in range(1, self.nodes + 1):
            self._spawn([_binary("slurmd"), "-D", "-N", f"node{n}"], f"slurmd-node{n}")
        _wait(self._all_idle, timeout, lambda: f"the Slurm nodes did not come up: {self._logs()}")
        return self

    def _config(self, munge_socket: Path, controller_port: int, node_ports: list[int]) -> str:
        work = self.workdir
        lines = [
            "ClusterName=eft",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={controller_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={munge_socket}",
            f"StateSaveLocation={work / 'state'}",
            f"SlurmdSpoolDir={work / 'spool'}/%n",
            f"SlurmctldPidFile={work / 'slurmctld.pid'}",
            f"SlurmdPidFile={work}/slurmd-%n.pid",
            f"SlurmctldLogFile={work / 'slurmctld.log'}",
            f"SlurmdLogFile={work}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/builtin",
            "SelectType=select/linear",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "KillWait=5",
        ]
        lines += [
            f"NodeName=node{n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
            "RealMemory=1000 State=UNKNOWN"
            for n, port in enumerate(node_ports, start=1)
        ]
        lines.append(f"PartitionName=test Nodes=node[1-{self.nodes}] Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _spawn(self, argv: list[str], name: str) -> None:
        log = open(self.workdir / f"{name}.out", "ab")  # noqa: SIM115 - kept open for the daemon's life
        self.processes.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )
        log.close()

    def run(self, *argv: str, check: bool = True) -> str:
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=60, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit status {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def _all_idle(self) -> bool:
        try:
            states = self.run("sinfo", "-h", "-N", "-o", "%T").split()
        except (RuntimeError, subprocess.TimeoutExpired):
            return False
        return len(states) == self.nodes and all(state == "idle" for state in states)

    def job_state(self, job: str) -> str | None:
        """The job's state as ``squeue`` shows it; None once it left the queue."""
        out = self.run("squeue", "-h", "-j", job, "-o", "%T", check=False).strip()
        return out or None

    def _logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-1500:]}"
            for path in sorted(self.workdir.glob("*.out")) + sorted(self.workdir.glob("*.log"))
        )

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in reversed(self.processes):
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes.clear()
        self._kill_steps()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill_steps(self) -> None:
        """End what the stopped daemons left of their jobs: step daemons and the tasks they started.

        A job's step daemons (slurmstepd) detach from their slurmd; stopped before a cancelled job's steps ended (a
        test that failed mid-job), they wait for the dead daemons for ever, and their tasks with them; a task whose
        step daemon died first lives on as an orphan. Every process that carries this cluster's ``SLURM_CONF`` in its
        environment (the daemons pass theirs on to the steps and the steps to their tasks) is stopped, so that none
        starts another while they are killed, then killed, until none is left.
        """

        def none_left() -> bool:
            left = self.leftovers()
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            return not left

        _wait(none_left, 10, lambda: f"processes {self.leftovers()} of the cluster outlived SIGKILL")

    def leftovers(self) -> list[int]:
        """Live processes, other than this one, whose environment names this cluster's ``SLURM_CONF``."""
        conf = f"SLURM_CONF={self.env['SLURM_CONF']}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
                state = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[0]
            except OSError:  # gone meanwhile
                continue
            if conf in environ and state not in ("Z", "X"):
                found.append(int(entry))
        return found

    def step_daemons(self) -> list[int]:
        """The ``slurmstepd`` processes of this cluster: those holding a file under its work directory open (their
        slurmd's log)."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() != "slurmstepd":
                    continue
                targets = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")]
            except OSError:  # gone meanwhile
                continue
            if any(target.startswith(f"{self.workdir}/") for target in targets):
                found.append(int(entry))
        return found


def _wait(ready: Callable[[], bool], timeout: float, message: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(message())
        pause(0.2)
