"""Hosts and links fail: ftrun side by side with torchrun's c10d backend on three test hosts.

Three hosts (network namespaces on a bridge, :mod:`elastic_ft.testing.netns`;
etcd on the bridge) run the reference script (``examples/train_ftrun.py``:
DDP, ``torch.optim.AdamW``, a ``DataLoader``, a checkpoint) with 2 workers
each, ``--nnodes=2:3``, default settings otherwise:

* ``ftrun``: ``--rdzv-backend=etcdft``, the default Wrapper (healing from a
  peer);
* ``torchrun-c10d``: plain ``torchrun --rdzv-backend=c10d`` (the store on
  host 0), the script without the Wrapper (``--no-wrapper``).

Every fault hits host 2 (never the c10d store's host), each in a job of its
own, or with ``--one-job`` one job per system for all of them in turn (each
once host 2 trains at the full world size again, ``arrival`` first):

* ``cut``: its link goes down (no FIN, no RST), then up again;
* ``sigkill``: every process of the host SIGKILLed, its launcher started
  again;
* ``sigstop``: every process of the host SIGSTOPped, then continued;
* ``peers_only``: the host reaches etcd but not the other hosts, then all;
* ``etcd_only``: the host reaches the other hosts but not etcd, then all;
* ``lossy``: 30 % of the host's packets dropped both ways (and 200 ms of
  delay where the kernel has ``netem``) for ``--window`` seconds: nothing
  may restart;
* ``cpu``: busy loops on every core inside the host for ``--window``
  seconds: nothing may restart;
* ``arrival``: the job trains on hosts 0 and 1, then host 2 starts;
* ``repeated``: ``peers_only`` three times in one job, each once host 2
  trains again at the full world size (its agent, and so its node, is the
  same each time); ``resume`` and ``rejoin`` are the slowest of the three,
  ``replaced`` their sum (the JSON lists each cut's: ``resumes``,
  ``rejoins``, ``replacements``). A cut whose ranks were replaced rejoins
  as slowly as new processes start beside the training survivors.

``--downtime`` sets how long host 2 stays cut off after the survivors
resumed without it (3 s by default; 20, 60 and 300 s for long partitions,
which end every lease the host held).

Measured (median of ``--repeats``): ``resume`` (fault to the first step of
a survivor in the shrunken world), ``stale`` (steps host 2's ranks complete
in the old membership after the survivors resumed without them, past the
last step the survivors took in it: a step everyone took, logged late by a
rank stopped before its log line, is not one),
``rejoin`` (heal, restart or arrival to the first step of host 2 at the
full world size; for ``arrival``: from the moment host 2's workers are
ready to train), ``restarted`` (worker processes of hosts 0 and 1 that
did not survive), ``restarts`` (for ``lossy`` and ``cpu``: ranks that
started a new in-process iteration during the window: false alarms),
``absorbed`` (the first revocation to the start of the survivors' new
in-process iteration: how soon the agents act on a loss they confirmed;
negative when the survivors restarted before, on a connection error),
``revoked`` (leases the agents revoked: confirmed losses; for ``lossy`` and
``cpu``, false deaths), ``killed`` (for ``lossy`` and ``cpu``: worker
processes of host 2 that did not survive: a restart its rank could not
take in time, ended by the hard timeout), ``replaced`` (for the faults
host 2's processes live through: its worker processes that did not, for
it rejoins in its own processes), ``out_of_reach`` (its ranks a restart
could not reach, gloo holding their main thread in a send: their monitor
processes replace them) and ``exited`` (whether its launcher
exited before the driver stopped the job; it must not). A step that does
not come within ``--cap`` seconds is reported as the cap, marked ``>``.

Needs root and ``ip netns`` (:func:`elastic_ft.testing.netns.unavailable`).
Prints a table, writes ``benchmarks/results/network_faults.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import scratch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_ftrun.py"
RESULTS = Path(__file__).resolve().parent / "results" / "network_faults.json"
SYSTEMS = ("ftrun", "torchrun-c10d")
#: Faults that do not apply to a system: c10d keeps its store on host 0 and never talks to etcd.
NOT_APPLICABLE = {("torchrun-c10d", "etcd_only"), ("torchrun-c10d", "repeated")}
SCENARIOS = ("cut", "sigkill", "sigstop", "peers_only", "etcd_only", "lossy", "cpu", "arrival", "repeated")
REPEATED_FAULTS = 3
HOSTS = 3
FAULTY = 2  # the host every fault hits
#: What an agent logs when it revokes a lease (a confirmed loss), and a worker when gloo holds its main thread
#: out of a restart's reach (elastic_ft/inprocess/delivery/watcher.py).
REVOKED = "revoked the lease of node"
OUT_OF_REACH = "released every connection of the function"
C10D_PORT = 29411


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


class Job:
    """One job on a fresh test bed: its hosts' launchers, and what their workers recorded."""

    def __init__(self, system: str, bed: Any, etcd: Any, workdir: Path, args: argparse.Namespace) -> None:
        self.system, self.bed, self.etcd, self.workdir, self.args = system, bed, etcd, workdir, args
        self.run_id = f"net-{uuid.uuid4().hex[:8]}"
        self.launchers: dict[int, subprocess.Popen[bytes]] = {}
        self.events: list[dict[str, Any]] = []
        self._offsets: dict[Path, int] = {}
        self.stop_file = workdir / "stop"

    # ---- the launchers ----

    def start(self, host: int) -> None:
        from elastic_ft.testing.local_cluster import ftrun_command, torchrun_command

        address = self.bed.address(host)
        script = [
            str(SCRIPT),
            "--workdir",
            str(self.workdir),
            "--steps",
            "100000000",
            "--record-steps",
            "--stop-file",
            str(self.stop_file),
            "--step-wait",
            str(self.args.step_wait),
        ]
        common = ["--nnodes=2:3", "--nproc-per-node=2", f"--local-addr={address}", "--max-restarts=3"]
        if self.system == "ftrun":
            argv = [
                *ftrun_command(),
                *common,
                "--rdzv-backend=etcdft",
                f"--rdzv-endpoint={self.etcd.endpoint}",
                f"--rdzv-id={self.run_id}",
                *script,
            ]
        else:
            argv = [
                *torchrun_command(),
                *common,
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.bed.address(0)}:{C10D_PORT}",
                f"--rdzv-id={self.run_id}",
                f"--rdzv-conf=is_host={int(host == 0)}",
                *script,
                "--no-wrapper",
            ]
        env = {**os.environ, "NODE_TAG": str(host), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(self.workdir / f"host{host}-{len(self.launchers)}-{int(time.time())}.log", "wb") as log:
            self.launchers[host] = self.bed.popen(host, argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def signal_host(self, host: int, sig: int) -> None:
        for pid in self.bed.processes(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self) -> None:
        if self.stop_file.exists() or not self.steps():
            return
        self.stop_file.write_text(str(max(e["step"] for e in self.steps()) + 20))

    # ---- what the workers recorded ----

    def refresh(self) -> None:
        for path in self.workdir.glob("events-*.jsonl"):
            offset = self._offsets.get(path, 0)
            with path.open() as file:
                file.seek(offset)
                chunk = file.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            self._offsets[path] = offset + len(complete.encode())
            for line in complete.splitlines():
                with contextlib.suppress(ValueError):
                    self.events.append(json.loads(line))

    def steps(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "step"]

    def host_of(self) -> dict[int, int]:
        return {e["pid"]: int(e["node"]) for e in self.events if e["event"] == "ready"}

    def first(self, predicate: Any, cap: float) -> float | None:
        """When the first event matching ``predicate`` was recorded, waiting up to ``cap`` s for it."""
        deadline = time.monotonic() + cap
        while True:
            self.refresh()
            times = [e["t"] for e in self.events if predicate(e)]
            if times:
                return min(times)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)

    def full_world(self, since: float, host: int | None, cap: float) -> float | None:
        """The first step at the full world size after ``since`` (by a rank of ``host`` when given)."""
        hosts = self.host_of

        def matches(e: dict[str, Any]) -> bool:
            return (
                e["event"] == "step"
                and e["t"] > since
                and e["world_size"] == 2 * HOSTS
                and (host is None or hosts().get(e["pid"]) == host)
            )

        return self.first(matches, cap)

    def logged(self, mark: str, since: float, until: float = math.inf, host: int | None = None) -> list[float]:
        """When the launchers and workers (of ``host`` when given) logged a line holding ``mark``, in
        [``since``, ``until``) (epoch seconds, from the local time each log line starts with)."""
        year = time.localtime().tm_year
        stamps = []
        for log in self.workdir.glob("host*.log" if host is None else f"host{host}-*.log"):
            for line in log.read_text(errors="replace").splitlines():
                if mark not in line:
                    continue
                with contextlib.suppress(ValueError):  # a line that is not a log record (a traceback's)
                    stamp = datetime.strptime(f"{year}{line[1:18]}", "%Y%m%d %H:%M:%S.%f").timestamp()
                    if since <= stamp < until:
                        stamps.append(stamp)
        return sorted(stamps)

    def iteration_of(self, pids: set[int]) -> int:
        self.refresh()
        return max((e["iteration"] for e in self.steps() if e["pid"] in pids), default=0)


def _survivor_workers(job: Job) -> set[int]:
    job.refresh()
    return {pid for pid, host in job.host_of().items() if host != FAULTY and _alive(pid)}


def run_job(system: str, scenarios: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One job on a fresh test bed; its scenarios hit it one after another, each once host 2 trained at the
    full world size again for ``--settle`` s (``--one-job``; otherwise each job has one scenario).

    A scenario that fails ends the job: the ones after it are reported as not run."""
    from elastic_ft.etcd.server import EtcdServer
    from elastic_ft.testing.netns import TestBed

    workdir = scratch.workdir(f"netfault-{system}-{'-'.join(scenarios)}-")
    rows: list[dict[str, Any]] = []
    with TestBed(HOSTS) as bed, EtcdServer(host=bed.bridge_address) as etcd:
        job = Job(system, bed, etcd, workdir, args)
        try:
            first_hosts = [0, 1] if scenarios[0] == "arrival" else list(range(HOSTS))
            for host in first_hosts:
                job.start(host)
            size = 2 * len(first_hosts)
            started = job.first(lambda e: e["event"] == "step" and e["world_size"] == size, args.start_timeout)
            if started is None:
                raise RuntimeError(f"{system}: the job did not train at world size {size} ({workdir})")
            for scenario in scenarios:
                if rows and (failed := _not_ready_after(job, rows[-1], args)) is not None:
                    rows += [{"system": system, "scenario": s, "error": failed} for s in scenarios[len(rows) :]]
                    break
                time.sleep(args.settle)
                row: dict[str, Any] = {"system": system, "scenario": scenario}
                rows.append(row)
                try:
                    _fault(job, scenario, args, row)
                except Exception as error:  # noqa: BLE001 - reported in its row, the job's later scenarios skipped
                    row["error"] = f"{type(error).__name__}: {error}"
        finally:
            job.stop()
            deadline = time.monotonic() + 20
            while any(p.poll() is None for p in job.launchers.values()) and time.monotonic() < deadline:
                time.sleep(0.2)
            for host in range(HOSTS):
                job.signal_host(host, signal.SIGKILL)
            for launcher in job.launchers.values():
                with contextlib.suppress(Exception):
                    launcher.wait(5)
    # What the logs say, scenario by scenario: from its fault to the next one's.
    faults = [row.get("fault_at", math.inf) for row in rows] + [math.inf]
    for index, row in enumerate(rows):
        if "fault_at" in row:
            until = min(faults[index + 1 :])
            row["revocations"] = len(job.logged(REVOKED, row["fault_at"], until))
            row["out_of_reach"] = len(job.logged(OUT_OF_REACH, row["fault_at"], until, FAULTY))
        row["workdir"] = str(workdir)
    return rows


def _not_ready_after(job: Job, previous: dict[str, Any], args: argparse.Namespace) -> str | None:
    """Why the job's next scenario cannot start after ``previous`` (None when host 2 trains at the full world
    size again, as every scenario starts)."""
    if "error" in previous:
        return f"not run: {previous['scenario']} failed before it in the same job"
    if job.full_world(time.time(), FAULTY, args.cap) is None:
        return f"not run: host {FAULTY} did not train at the full world size within {args.cap:g} s after {previous['scenario']}"
    return None


def _fault(job: Job, scenario: str, args: argparse.Namespace, row: dict[str, Any]) -> None:
    """Hit host 2 of a job that trains at the full world size with ``scenario``'s fault; measure into ``row``."""
    from elastic_ft.testing.netns import TestBedUnavailable

    survivors = _survivor_workers(job)
    faulty = {pid for pid, host in job.host_of().items() if host == FAULTY and _alive(pid)}
    old_iteration = max(job.iteration_of(survivors), job.iteration_of(faulty))
    iteration_count = len({(e["pid"], e["iteration"]) for e in job.events if e["event"] == "start"})

    def resumed(since: float) -> float | None:
        return job.first(
            lambda e: (
                e["event"] == "step"
                and e["t"] > since
                and e["pid"] not in faulty
                and e["world_size"] == 2 * (HOSTS - 1)
                and (e["iteration"] > old_iteration or e["pid"] not in survivors)
            ),
            args.cap,
        )

    at = row["fault_at"] = time.time()
    heal_at: float | None = None
    if scenario == "cut":
        job.bed.cut(FAULTY)
        resume = resumed(at)
        time.sleep(args.downtime)
        heal_at = time.time()
        job.bed.heal(FAULTY)
    elif scenario == "sigkill":
        job.signal_host(FAULTY, signal.SIGKILL)
        job.launchers[FAULTY].wait()
        resume = resumed(at)
        time.sleep(args.downtime)
        heal_at = time.time()
        job.start(FAULTY)
    elif scenario == "sigstop":
        job.signal_host(FAULTY, signal.SIGSTOP)
        resume = resumed(at)
        time.sleep(args.downtime)
        heal_at = time.time()
        job.signal_host(FAULTY, signal.SIGCONT)
    elif scenario in ("peers_only", "etcd_only"):
        (job.bed.isolate_from_peers if scenario == "peers_only" else job.bed.isolate_from_etcd)(FAULTY)
        resume = resumed(at)
        time.sleep(args.downtime)
        heal_at = time.time()
        job.bed.clear(FAULTY)
    elif scenario == "repeated":
        resumes: list[float | None] = []
        rejoins: list[float | None] = []
        replacements: list[int] = []  # per cut: host 2's workers that did not live to rejoin (gloo's gap)
        for _ in range(REPEATED_FAULTS):
            job.refresh()
            faulty = {pid for pid, host in job.host_of().items() if host == FAULTY and _alive(pid)}
            old_iteration = max(job.iteration_of(survivors), job.iteration_of(faulty))
            at = time.time()
            job.bed.isolate_from_peers(FAULTY)
            resume = resumed(at)
            resumes.append(None if resume is None else resume - at)
            time.sleep(args.downtime)
            heal_at = time.time()
            job.bed.clear(FAULTY)
            back = job.full_world(heal_at, FAULTY, args.cap)
            rejoins.append(None if back is None else back - heal_at)
            replacements.append(sum(not _alive(pid) for pid in faulty))
            if resume is None or back is None:
                break
            time.sleep(args.settle)
        row.update(resumes=resumes, rejoins=rejoins, replacements=replacements, replaced=sum(replacements))
        row["resume"] = None if None in resumes else max(r for r in resumes if r is not None)
        row["rejoin"] = None if None in rejoins else max(r for r in rejoins if r is not None)
        row["resume_capped"], row["rejoin_capped"] = row["resume"] is None, row["rejoin"] is None
        resume = None
    elif scenario in ("lossy", "cpu"):
        hogs: list[subprocess.Popen[bytes]] = []
        if scenario == "lossy":
            job.bed.lose(FAULTY, 0.3)
            try:
                job.bed.delay(FAULTY, 200)
                row["delay_ms"] = 200
            except TestBedUnavailable as error:
                row["delay_ms"] = 0
                row["note"] = f"no delay: {error}"
        else:
            hogs = [
                job.bed.popen(FAULTY, [sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)
            ]
        time.sleep(args.window)
        for hog in hogs:
            hog.kill()
            hog.wait()
        if scenario == "lossy":
            job.bed.clear(FAULTY)
            with contextlib.suppress(TestBedUnavailable):
                job.bed.undelay(FAULTY)
        time.sleep(2.0)
        job.refresh()
        after = len({(e["pid"], e["iteration"]) for e in job.events if e["event"] == "start"})
        row.update(
            restarts=after - iteration_count,
            restarted=sum(not _alive(pid) for pid in survivors),
            killed=sum(not _alive(pid) for pid in faulty),
            resume=None,
        )
        resume = None
    else:  # arrival
        job.start(FAULTY)
        ready = job.first(
            lambda e: (
                e["event"] == "ready"
                and e["node"] == str(FAULTY)
                and len([x for x in job.events if x["event"] == "ready" and x["node"] == str(FAULTY)]) >= 2
            ),
            args.start_timeout,
        )
        if ready is not None:  # both of its workers ready: the later one
            ready = max(e["t"] for e in job.events if e["event"] == "ready" and e["node"] == str(FAULTY))
        joined = job.full_world(at, FAULTY, args.cap) if ready is not None else None
        row["rejoin"] = None if joined is None or ready is None else max(0.0, joined - ready)
        row["rejoin_capped"] = joined is None
        resume = None
    if scenario not in ("lossy", "cpu", "arrival", "repeated"):
        row["resume"] = None if resume is None else resume - at
        row["resume_capped"] = resume is None
        job.refresh()
        restarted_at = min(
            (
                e["t"]
                for e in job.events
                if e["event"] == "start" and e["pid"] in survivors and e["t"] > at and e["iteration"] > old_iteration
            ),
            default=None,
        )
        revoked_at = min(job.logged(REVOKED, at), default=None)
        row["absorb"] = None if restarted_at is None or revoked_at is None else restarted_at - revoked_at
        moved_on = resume if resume is not None else time.time()
        # A step the whole old membership took, logged late by a rank stopped between its all-reduce and its
        # log line, is not stale: only one past the survivors' last step in that membership is.
        old_steps = [e for e in job.steps() if e["iteration"] <= old_iteration]
        last_together = max((e["step"] for e in old_steps if e["pid"] in survivors), default=-1)
        row["stale"] = sum(
            1 for e in old_steps if e["pid"] in faulty and e["t"] > moved_on and e["step"] > last_together
        )
        assert heal_at is not None
        back = job.full_world(heal_at, FAULTY, args.cap)
        row["rejoin"] = None if back is None else back - heal_at
        row["rejoin_capped"] = back is None
        if scenario != "sigkill":
            # Its workers lived through the fault: they rejoin in their own processes, and its launcher
            # never exits on its own while the job runs.
            row["replaced"] = sum(not _alive(pid) for pid in faulty)
            row["launcher_exited"] = job.launchers[FAULTY].poll() is not None
    if scenario not in ("lossy", "cpu"):
        row["restarted"] = sum(not _alive(pid) for pid in survivors)


def _median(rows: list[dict[str, Any]], key: str) -> tuple[float | None, bool]:
    values = [r.get(key) for r in rows]
    capped = any(r.get(f"{key}_capped") for r in rows)
    numbers = [v for v in values if isinstance(v, int | float)]
    if not numbers and not capped:
        return None, False
    return (statistics.median(numbers) if numbers else None), capped


def summarize(rows: list[dict[str, Any]], cap: float) -> list[dict[str, Any]]:
    table = []
    for scenario in SCENARIOS:
        for system in SYSTEMS:
            mine = [r for r in rows if r["system"] == system and r["scenario"] == scenario and "error" not in r]
            errors = [r["error"] for r in rows if r["system"] == system and r["scenario"] == scenario and "error" in r]
            if not mine and not errors:
                continue
            entry: dict[str, Any] = {"scenario": scenario, "system": system, "runs": len(mine), "errors": errors}
            if (system, scenario) in NOT_APPLICABLE:
                entry["note"] = "not applicable: this system does not use etcd"
                table.append(entry)
                continue
            for key in ("resume", "rejoin"):
                value, capped = _median(mine, key)
                # A run that never resumed counts as the cap (a lower bound) in the median.
                if capped:
                    filled = [r.get(key) if not r.get(f"{key}_capped") else cap for r in mine]
                    value = statistics.median([v for v in filled if v is not None]) if filled else None
                entry[key] = value
                entry[f"{key}_capped"] = capped
            for key in ("absorb", "stale", "restarted", "restarts", "revocations", "killed", "replaced"):
                values = [r[key] for r in mine if r.get(key) is not None]
                entry[key] = statistics.median(values) if values else None
            entry["exited"] = sum(bool(r.get("launcher_exited")) for r in mine)
            table.append(entry)
    return table


def _cell(entry: dict[str, Any], key: str) -> str:
    value = entry.get(key)
    if value is None:
        return "-"
    if key in ("resume", "rejoin"):
        return (">" if entry.get(f"{key}_capped") else "") + f"{value:.2f} s"
    if key == "absorb":
        return f"{value:.2f} s"
    return f"{value:g}"


def print_table(table: list[dict[str, Any]]) -> None:
    header = (
        f"{'scenario':<12} {'system':<14} {'runs':>4} {'resume':>10} {'absorbed':>9} {'stale':>6} {'rejoin':>10} "
        f"{'restarted':>9} {'restarts':>8} {'revoked':>7} {'killed':>6} {'replaced':>8} {'exited':>6}  ratio"
    )
    print(header)
    print("-" * len(header))
    by = {(e["scenario"], e["system"]): e for e in table}
    for entry in table:
        if entry.get("note"):
            print(f"{entry['scenario']:<12} {entry['system']:<14} {entry['runs']:>4}  {entry['note']}")
            continue
        ratio = ""
        if entry["system"] == "ftrun":
            other = by.get((entry["scenario"], "torchrun-c10d"))
            for key in ("resume", "rejoin"):
                if key == "rejoin" and (other or {}).get("resume_capped"):
                    continue  # it never went on without the host: there was nothing to rejoin
                mine, theirs = entry.get(key), (other or {}).get(key)
                if mine and theirs and not (other or {}).get("note"):
                    ratio += f" {key} {'>' if other.get(f'{key}_capped') else ''}{theirs / mine:.1f}x"
        print(
            f"{entry['scenario']:<12} {entry['system']:<14} {entry['runs']:>4} {_cell(entry, 'resume'):>10} "
            f"{_cell(entry, 'absorb'):>9} {_cell(entry, 'stale'):>6} {_cell(entry, 'rejoin'):>10} {_cell(entry, 'restarted'):>9} "
            f"{_cell(entry, 'restarts'):>8} {_cell(entry, 'revocations'):>7} {_cell(entry, 'killed'):>6} "
            f"{_cell(entry, 'replaced'):>8} {_cell(entry, 'exited'):>6} {ratio}"
        )
        for error in entry["errors"]:
            print(f"{'':<12} error: {error}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline-repeats", type=int, help="repeats of torchrun-c10d (default: --repeats)")
    parser.add_argument("--cap", type=float, default=60.0, help="seconds to wait for a resume or a rejoin")
    parser.add_argument("--downtime", type=float, default=3.0, help="seconds from the resume to the heal")
    parser.add_argument("--window", type=float, default=20.0, help="seconds of loss or CPU load")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of training before the fault")
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument(
        "--step-wait",
        type=float,
        default=0.0,
        help="the script's --step-wait: seconds each step leaves the CPUs idle, as on GPUs",
    )
    parser.add_argument(
        "--one-job",
        action="store_true",
        help="hit one job per system with every scenario in turn (each once host 2 trains at the full world "
        "size again) instead of one fresh job per scenario: fewer start-ups, a job that lives through them all",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--table-from",
        type=Path,
        help="recompute and print the table of an earlier run's JSON (written back to it), run nothing",
    )
    args = parser.parse_args(argv)
    if args.table_from is not None:
        earlier = json.loads(args.table_from.read_text())
        earlier["table"] = summarize(earlier["runs"], float(earlier["args"]["cap"]))
        print_table(earlier["table"])
        args.table_from.write_text(json.dumps(earlier, indent=2))
        return 0
    from elastic_ft.testing.netns import unavailable

    systems, scenarios = args.systems.split(","), args.scenarios.split(",")
    for name, chosen, known in (("system", systems, SYSTEMS), ("scenario", scenarios, SCENARIOS)):
        bad = [c for c in chosen if c not in known]
        if bad:
            parser.error(f"unknown {name} {bad[0]!r}; expected some of {', '.join(known)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.one_job and "arrival" in scenarios[1:]:
        parser.error("with --one-job, arrival must come first: it starts the job without host 2")
    if not args.step_wait >= 0:  # NaN too
        parser.error(f"--step-wait must be a number of seconds >= 0, got {args.step_wait}")
    reason = unavailable()
    if reason is not None:
        print(f"network_faults: cannot run here: {reason}", file=sys.stderr)
        return 2
    if args.baseline_repeats is not None and args.baseline_repeats < 1:
        parser.error(f"--baseline-repeats must be at least 1, got {args.baseline_repeats}")
    baseline_repeats = args.repeats if args.baseline_repeats is None else args.baseline_repeats
    groups = [scenarios] if args.one_job else [[scenario] for scenario in scenarios]
    rows = []
    for repeat in range(max(args.repeats, baseline_repeats)):
        for group in groups:
            for system in systems:
                if repeat >= (args.repeats if system == "ftrun" else baseline_repeats):
                    continue
                started = time.monotonic()
                try:
                    ran = run_job(system, group, args)
                except Exception as error:  # noqa: BLE001 - one failed job is reported, the others go on
                    ran = [
                        {"system": system, "scenario": s, "error": f"{type(error).__name__}: {error}"} for s in group
                    ]
                for row in ran:
                    row["repeat"] = repeat
                    row["job_seconds"] = round(time.monotonic() - started, 1)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    table = summarize(rows, args.cap)
    print()
    print_table(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "args": {k: str(v) for k, v in vars(args).items()},
                "table": table,
                "runs": rows,
            },
            indent=2,
        )
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    scratch.run_main(main)
