"""The soak: a random fault every few seconds, for many minutes, in one job that must absorb them all.

Three active nodes of two workers and one hot spare node (``ftrun
--spare-nodes=1``), simulated on this host, run the reference script
(``examples/train_ftrun.py``: DDP, ``torch.optim.AdamW``, a ``DataLoader``,
a checkpoint, peer state healing, default Wrapper settings) against a
3-member etcd cluster. A driver injects, one after the other, a random
fault once the job trains again after the last one (a gap of a few seconds
in between, and past the warm-up steps of the newest iteration: the job
also restarts by itself to admit a respawned worker):

* ``exception``, ``hang_gil_held``, ``hang_gil_released``: asked of a random
  active rank through ``--fault-dir`` (the rank raises, or hangs in C with
  or without the GIL);
* ``sigkill``, ``sigstop``: a random active worker process, from outside;
* ``node_kill``: a whole node (agent, workers, monitors) SIGKILLed, and
  started again a few seconds later: it comes back as the hot spare;
* ``etcd_member``: an etcd member SIGKILLed and restarted.

Recorded for each fault: when it was injected, and the first step after it
in a later in-process iteration (fault -> resume). At the end the driver
stops training at a common step (``--stop-file``), and reports: faults by
kind, escalations to a process restart, fault -> resume p50/p90/p99/max by
kind, steps lost or done twice (each restart must resume at the highest
step any rank that went on into it had completed), the final model state of
every rank (a digest, bit for bit), threads, file descriptors and resident
memory of every worker process over time (the first sample after its first
iteration against its last, both taken while it trained: between two of its
steps of one iteration; a sample taken during a restart, its process groups
and data loader workers torn down, would compare another state),
and the processes of the job still alive two seconds after the launchers
exited. An etcd member that crashes on its own (etcd 3.5.1's "unexpected
error during txn" panic, docs/deployment.md) is restarted with the next
fault, its log kept and its panic listed; the job goes on without it, so it
is etcd's failure, not a failed check.

``python benchmarks/soak.py`` runs 15 minutes; ``--minutes 2`` is the version
CI runs (``tests/launcher/test_soak.py``). Prints a table and writes
``benchmarks/results/soak.json``; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import scratch

from elastic_ft.observability.goodput import goodput, report_lines

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_ftrun.py"
RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
KINDS = ("exception", "sigkill", "hang_gil_held", "hang_gil_released", "sigstop", "node_kill", "etcd_member")
#: Faults asked of a rank through --fault-dir, with the name the script knows them by.
REQUESTED = {"exception": "raise", "hang_gil_held": "hang_gil_held", "hang_gil_released": "hang_gil_released"}
NODES = "ABCD"
#: Steps of an iteration the Wrapper takes before its timeouts adapt (AdaptiveTimeouts.warmup_steps), plus one.
WARM_UP_STEPS = 4
#: How long a fault may take to be absorbed before the driver reports it unresolved and goes on.
RESUME_CAP = 60.0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclass
class Fault:
    kind: str
    at: float
    target: str
    iteration: int  # the newest iteration any rank was in when it was injected
    #: The fault takes an active rank away, so the job resumes in a later iteration (else: it goes on).
    restarts: bool = True
    resumed: float | None = None


@dataclass
class Job:
    """What the driver reads back from the workers' event files, incrementally."""

    workdir: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    _offsets: dict[Path, int] = field(default_factory=dict)

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

    def latest_iteration(self) -> int:
        return max((e["iteration"] for e in self.events if e["event"] in ("step", "start")), default=0)

    def active_ranks(self) -> dict[int, int]:
        """Initial rank -> pid of the ranks that stepped in the newest iteration."""
        newest = self.latest_iteration()
        return {e["rank"]: e["pid"] for e in self.steps() if e["iteration"] == newest}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


#: Two steps of one iteration at most this far apart: the process trained between them (no restart did).
TRAINING_GAP = 2.0


def _while_training(samples: list[dict[str, Any]], steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``samples`` taken between two of the process's ``steps`` (in time order) of the same iteration, at
    most :data:`TRAINING_GAP` apart: its groups, data loader workers and connections all up. A restart tears
    them down and builds them again, and a sample in the middle of one counts fewer threads and fds."""
    times = [e["t"] for e in steps]
    kept = []
    for sample in samples:
        after = bisect.bisect_right(times, sample["t"])
        if 0 < after < len(steps):
            before, next_step = steps[after - 1], steps[after]
            if before["iteration"] == next_step["iteration"] and next_step["t"] - before["t"] <= TRAINING_GAP:
                kept.append(sample)
    return kept


def _resources(pid: int) -> dict[str, int] | None:
    try:
        threads = len(os.listdir(f"/proc/{pid}/task"))
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        with open(f"/proc/{pid}/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, ValueError):
        return None
    return {"threads": threads, "fds": fds, "rss_kib": rss}


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.workdir = scratch.workdir("soak-")
        self.faults_dir = self.workdir / "faults"
        self.faults_dir.mkdir()
        self.stop_file = self.workdir / "stop"
        self.job = Job(self.workdir)
        self.run_id = f"soak-{uuid.uuid4().hex[:8]}"
        self.nodes: dict[str, Any] = {}
        self.faults: list[Fault] = []
        self.etcd_exits: list[dict[str, Any]] = []
        self.samples: dict[int, list[dict[str, Any]]] = {}  # by worker pid
        self.rank_of_pid: dict[int, int] = {}
        self.seen_pids: set[int] = set()
        self.down: dict[str, float] = {}  # killed nodes, and when to start them again

    # ---- the job ----

    def _start_node(self, tag: str) -> None:
        from elastic_ft.testing.local_cluster import TorchrunNode, ftrun_command

        script = [
            str(SCRIPT),
            "--workdir",
            str(self.workdir),
            "--steps",
            "100000000",
            "--record-steps",
            "--record-digests",
            "--fault-dir",
            str(self.faults_dir),
            "--stop-file",
            str(self.stop_file),
            "--monitor-logs",
            "--step-wait",
            str(self.args.step_wait),
        ]
        conf = ["join_timeout=600"] + ([f"lease_ttl={self.args.lease_ttl}"] if self.args.lease_ttl else [])
        self.nodes[tag] = TorchrunNode(
            tag,
            endpoint=self.endpoint,
            run_id=self.run_id,
            script=script,
            nnodes="3:3",
            nproc_per_node=2,
            rdzv_conf=",".join(conf),
            max_restarts=3,
            log_path=self.workdir / f"node-{tag}-{int(time.time())}.log",
            extra_env={"OMP_NUM_THREADS": "1"},
            launcher=ftrun_command(),
            extra_args=("--spare-nodes=1",),
        )

    def _node_processes(self) -> dict[str, list[int]]:
        from elastic_ft.testing.local_cluster import descendants

        return {tag: [node.pid, *descendants(node.pid)] for tag, node in self.nodes.items() if tag not in self.down}

    def _workers(self) -> list[int]:
        """The worker processes now (not their monitor or data loader processes, not the agents)."""
        workers = []
        for pids in self._node_processes().values():
            for pid in pids[1:]:
                try:
                    with open(f"/proc/{pid}/comm") as comm, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                        name, argv = comm.read().strip(), cmdline.read()
                except OSError:
                    continue
                if name.startswith("python") and SCRIPT.name.encode() in argv:
                    workers.append(pid)
        return workers

    def _sample(self) -> None:
        now = time.time()
        for pid in self._workers():
            self.seen_pids.add(pid)
            usage = _resources(pid)
            if usage is not None:
                self.samples.setdefault(pid, []).append({"t": now, **usage})
        for pids in self._node_processes().values():
            self.seen_pids.update(pids)

    def _trains(self, since: float, iteration: int | None) -> float | None:
        """The time of the first step after ``since``: in an iteration after ``iteration`` when given, or by a
        process that started after ``since`` (a process restart begins at iteration 0 again)."""
        self.job.refresh()
        started_before = {e["pid"] for e in self.job.events if e["t"] <= since}
        times = [
            e["t"]
            for e in self.job.steps()
            if e["t"] > since and (iteration is None or e["iteration"] > iteration or e["pid"] not in started_before)
        ]
        return min(times) if times else None

    # ---- faults ----

    def _inject(self, kind: str) -> Fault | None:
        self.job.refresh()
        active = self.job.active_ranks()
        iteration = self.job.latest_iteration()
        if kind in REQUESTED or kind in ("sigkill", "sigstop"):
            if not active:
                return None
            rank = self.rng.choice(sorted(active))
            if kind in REQUESTED:
                target = self.faults_dir / f"fault-{rank}"
                target.with_suffix(".tmp").write_text(REQUESTED[kind])
                os.replace(target.with_suffix(".tmp"), target)
            else:
                if active[rank] not in self._workers():
                    # The events name a process that has exited since; its PID may be another process's
                    # now (PIDs wrap around at 32768 here): signal only a worker of a node running now.
                    return None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(active[rank], signal.SIGKILL if kind == "sigkill" else signal.SIGSTOP)
            return Fault(kind, time.time(), f"rank {rank}", iteration)
        if kind == "node_kill":
            from elastic_ft.testing.local_cluster import descendants

            candidates = [tag for tag in self.nodes if tag not in self.down]
            if self.down or len(candidates) < len(NODES):
                return None  # one node down at a time: the spare covers it
            tag = self.rng.choice(candidates)
            node = self.nodes[tag]
            held = set(self._node_processes()[tag])
            at = time.time()
            for pid in [node.pid, *descendants(node.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            node.process.wait()
            self.down[tag] = time.monotonic() + self.args.node_downtime
            # The spare node holds only reserve ranks: losing it interrupts nothing.
            return Fault(kind, at, f"node {tag}", iteration, restarts=bool(held & set(active.values())))
        if kind == "etcd_member":
            index = self.rng.randrange(self.cluster.member_count)
            at = time.time()
            self._check_etcd_members()
            self.cluster.kill_member(index)
            time.sleep(self.args.etcd_downtime)
            self._check_etcd_members(killed=index)
            return Fault(kind, at, f"etcd member {index}", iteration, restarts=False)
        raise ValueError(kind)

    def _await_warm_up(self, limit: float = 30.0) -> None:
        """Until the newest iteration has taken more steps than the Wrapper's warm-up (a restart the job made
        itself, to admit a respawned worker, may have just begun one): a hang in a warm-up waits for the
        configured soft timeout by design (docs/inprocess.md), which is not what this benchmark measures."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            self._restart_nodes()
            self.job.refresh()
            newest = self.job.latest_iteration()
            counts: dict[int, int] = {}
            for event in self.job.steps():
                if event["iteration"] == newest:
                    counts[event["pid"]] = counts.get(event["pid"], 0) + 1
            if counts and min(counts.values()) > WARM_UP_STEPS:
                return
            time.sleep(0.05)

    def _restart_nodes(self) -> None:
        for tag, when in list(self.down.items()):
            if time.monotonic() >= when:
                del self.down[tag]
                self._start_node(tag)

    def _await_resume(self, fault: Fault) -> None:
        """Until the job trains in an iteration after the fault's (or, for faults that restart nothing, at all)."""
        deadline = time.monotonic() + RESUME_CAP
        while time.monotonic() < deadline:
            self._restart_nodes()
            resumed = self._trains(fault.at, fault.iteration if fault.restarts else None)
            if resumed is not None:
                fault.resumed = resumed
                return
            time.sleep(0.05)

    # ---- the run ----

    def run(self) -> dict[str, Any]:
        from elastic_ft.testing.etcd_cluster import EtcdCluster

        args = self.args
        with EtcdCluster(members=3) as cluster:
            self.cluster = cluster
            self.endpoint = ",".join(e.target for e in cluster.endpoints)
            try:
                for tag in NODES:
                    self._start_node(tag)
                deadline = time.monotonic() + 240
                while len(self.job.active_ranks()) < 6:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the job did not start training within 240 s ({self.workdir})")
                    self.job.refresh()
                    time.sleep(0.2)
                started = time.monotonic()
                next_sample = 0.0
                while time.monotonic() - started < args.minutes * 60:
                    gap_end = time.monotonic() + self.rng.uniform(args.min_gap, args.max_gap)
                    while time.monotonic() < gap_end:
                        self._restart_nodes()
                        if time.monotonic() >= next_sample:
                            self._sample()
                            next_sample = time.monotonic() + args.sample_every
                        time.sleep(0.05)
                    self._await_warm_up()
                    kind = self.rng.choices(KINDS, weights=args.weights)[0]
                    fault = self._inject(kind)
                    if fault is None:
                        continue
                    self.faults.append(fault)
                    self._await_resume(fault)
                    self._check_etcd_members()
                    print(
                        f"  {len(self.faults):4d}  {fault.kind:<18} {fault.target:<16} "
                        + ("unresolved" if fault.resumed is None else f"{fault.resumed - fault.at:6.2f} s"),
                        flush=True,
                    )
                while self.down:  # every node back, so the end is the job's
                    self._restart_nodes()
                    time.sleep(0.1)
                self._sample()
                self.job.refresh()
                stop_at = max(e["step"] for e in self.job.steps()) + 50
                self.stop_file.with_suffix(".tmp").write_text(str(stop_at))
                os.replace(self.stop_file.with_suffix(".tmp"), self.stop_file)
                deadline = time.monotonic() + 300
                while any(node.process.poll() is None for node in self.nodes.values()):
                    if time.monotonic() > deadline:
                        break
                    self._sample()
                    time.sleep(0.5)
                codes = {tag: node.process.poll() for tag, node in self.nodes.items()}
                time.sleep(2.0)
                left = sorted(pid for pid in self.seen_pids if _alive(pid))
                events = self._run_events()
            finally:
                for node in self.nodes.values():
                    node.terminate()
                for index in range(cluster.member_count):  # the cluster's directory goes with it
                    self._keep_etcd_log(index, crashed=False)
        return self._report(stop_at, codes, left, events)

    def _check_etcd_members(self, killed: int | None = None) -> None:
        """Restart the etcd members that exited, ``killed`` by an ``etcd_member`` fault or crashed, together.

        A member gone with no fault killing it crashed: its log is kept in the
        work directory and its panic line reported. Left alone, it would take the
        cluster's quorum with it.
        """
        exited = self.cluster.exited_members()
        for index in exited:
            if index != killed:
                self._keep_etcd_log(index, crashed=True)
        if exited:
            self.cluster.restart_members(exited)

    def _keep_etcd_log(self, index: int, crashed: bool) -> Path:
        kept = self.workdir / f"etcd-m{index}{f'-crash{len(self.etcd_exits)}' if crashed else ''}.log"
        shutil.copyfile(self.cluster.member_log(index), kept)
        if crashed:
            text = kept.read_text(errors="replace")
            panic = next((line for line in text.splitlines() if "panic" in line), text[-300:])
            self.etcd_exits.append({"member": index, "after_fault": len(self.faults), "panic": panic, "log": str(kept)})
            print(f"  etcd member {index} crashed ({panic[:300]}); its log: {kept}", flush=True)
        return kept

    def _run_events(self) -> list[Any]:
        from elastic_ft.etcd.client import EtcdClient
        from elastic_ft.etcd.event_log import EventLog
        from elastic_ft.keys import RunKeys

        client = EtcdClient(self.cluster.endpoints)
        try:
            return EventLog(client, RunKeys("/elastic_ft", self.run_id)).read_all().events
        finally:
            client.close()

    # ---- the checks ----

    def _steps_lost_or_repeated(self) -> tuple[int, int, int]:
        """(restarts checked, steps lost, steps done twice): each iteration must resume at the highest step any
        rank had completed before it began."""
        self.job.refresh()
        starts = sorted(
            (e for e in self.job.events if e["event"] == "start" and e["iteration"] > 0), key=lambda e: e["t"]
        )
        steps = sorted(self.job.steps(), key=lambda e: e["t"])
        # The processes that went on into each iteration: a step only the fault's victim completed (its
        # all-reduce ended just before it died, the others' did not) died with it; it is no lost state.
        went_on: dict[int, set[int]] = {}
        for start in starts:
            went_on.setdefault(start["iteration"], set()).add(start["pid"])
        checked = lost = twice = 0
        seen_iterations: set[tuple[int, int]] = set()
        for start in starts:
            key = (start["pid"], start["iteration"])
            if key in seen_iterations:
                continue
            seen_iterations.add(key)
            survivors = went_on[start["iteration"]]
            before = [
                e["step"]
                for e in steps
                if e["t"] < start["t"] and e["iteration"] < start["iteration"] and e["pid"] in survivors
            ]
            if not before:
                continue
            expected, resumed = max(before), start["resumed_at"]
            checked += 1
            lost += max(0, resumed - expected)
            twice += max(0, expected - resumed)
        return checked, lost, twice

    def _resource_report(self) -> dict[str, Any]:
        """Each worker's threads, fds and memory from its first step after its first iteration (when its
        process groups, data loader and healing connections exist: the goal's baseline) to its last sample,
        counting only the samples taken while it trained (:func:`_while_training`)."""
        report = {}
        for pid, samples in self.samples.items():
            rank = next((e["rank"] for e in self.job.events if e.get("pid") == pid), None)
            mine = sorted((e for e in self.job.steps() if e["pid"] == pid), key=lambda e: e["t"])
            first_iteration = min((e["iteration"] for e in mine), default=None)
            baseline = next((e["t"] for e in mine if e["iteration"] != first_iteration), None)
            after = [s for s in _while_training(samples, mine) if baseline is not None and s["t"] >= baseline]
            if len(after) < 2:
                continue  # it never trained past its first iteration, or not long enough to tell
            first, last = after[0], after[-1]
            report[str(pid)] = {
                "initial_rank": rank,
                "samples": len(after),
                "seconds": round(last["t"] - first["t"], 1),
                "first": first,
                "last": last,
                "max_threads": max(s["threads"] for s in after),
                "max_fds": max(s["fds"] for s in after),
            }
        return report

    def _report(self, stop_at: int, codes: dict[str, int | None], left: list[int], events: list[Any]) -> dict[str, Any]:
        done = [json.loads(path.read_text()) for path in sorted(self.workdir.glob("done-*.json"))]
        digests = {d["initial_rank"]: d.get("digest") for d in done}
        checked, lost, twice = self._steps_lost_or_repeated()
        escalations = [e for e in events if e.name == "escalated"]
        # Every round after the first restarted the workers of every node (an escalation, or a node that
        # followed one: a process-level restart either way).
        process_restarts = max(0, len({e.round for e in events if e.name == "round_closed"}) - 1)
        by_kind: dict[str, dict[str, Any]] = {}
        for kind in KINDS:
            mine = [f for f in self.faults if f.kind == kind]
            times = [f.resumed - f.at for f in mine if f.resumed is not None]
            by_kind[kind] = {
                "faults": len(mine),
                "unresolved": sum(f.resumed is None for f in mine),
                **(
                    {
                        "p50": statistics.median(times),
                        "p90": _percentile(times, 90),
                        "p99": _percentile(times, 99),
                        "max": max(times),
                    }
                    if times
                    else {}
                ),
            }
        every = [f.resumed - f.at for f in self.faults if f.resumed is not None]
        overall = (
            {
                "p50": statistics.median(every),
                "p90": _percentile(every, 90),
                "p99": _percentile(every, 99),
                "max": max(every),
            }
            if every
            else {}
        )
        resources = self._resource_report()
        growth = {
            pid: {name: r["last"][name] - r["first"][name] for name in ("threads", "fds", "rss_kib")}
            for pid, r in resources.items()
        }
        problems = []
        if escalations or process_restarts:
            problems.append(
                f"{len(escalations)} escalation(s), {process_restarts} process-level restart(s) of the workers"
            )
        if lost or twice:
            problems.append(f"{lost} step(s) lost and {twice} done twice over {checked} restarts")
        if len(set(digests.values())) != 1 or None in digests.values():
            problems.append(f"the ranks finished with different states: {digests}")
        if any(d["step"] != stop_at for d in done):
            problems.append(f"ranks finished at steps {sorted({d['step'] for d in done})}, not {stop_at}")
        if any(code != 0 for code in codes.values()):
            problems.append(f"launchers exited with {codes}")
        if left:
            problems.append(f"{len(left)} process(es) alive 2 s after the launchers exited: {left[:10]}")
        unresolved = [f"{f.kind} ({f.target})" for f in self.faults if f.resumed is None]
        if unresolved:
            problems.append(f"faults not absorbed within {RESUME_CAP:g} s: {unresolved}")
        if not resources:
            problems.append("no worker process was sampled past its first iteration: threads, fds and memory unchecked")
        grown = {pid: g for pid, g in growth.items() if g["threads"] > 8 or g["fds"] > 8}
        if grown:
            problems.append(f"workers whose threads or fds grew by more than 8: {grown}")
        found = goodput(events) if events else None
        if found is None:
            problems.append("the run recorded no events: no goodput")
        elif abs(sum(found.parts.values()) - found.wall) > 0.01 * found.wall:
            problems.append(f"the goodput's parts ({found.parts}) do not sum to its wall time ({found.wall:.1f} s)")
        return {
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "args": {**vars(self.args), "out": str(self.args.out)},
            "workdir": str(self.workdir),
            "faults": [f.__dict__ for f in self.faults],
            "by_kind": by_kind,
            "all": {"faults": len(self.faults), **overall},
            "escalations": len(escalations),
            "process_restarts": process_restarts,
            "restarts_checked": checked,
            "steps_lost": lost,
            "steps_twice": twice,
            "finished_ranks": sorted(digests),
            "stop_step": stop_at,
            "same_state": len(set(digests.values())) == 1 and None not in digests.values(),
            "resources": resources,
            "growth": growth,
            "processes_left": left,
            "launcher_codes": codes,
            "etcd_exits": self.etcd_exits,
            "goodput": None if found is None else found.to_document(),
            "goodput_report": [] if found is None else report_lines(found),
            "problems": problems,
        }


def print_report(report: dict[str, Any]) -> None:
    print("\n| fault | count | fault -> resume p50 | p90 | p99 | max | unresolved |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = [*report["by_kind"].items(), ("all kinds", report["all"])]
    for kind, row in rows:
        cells = [f"{row[q]:.2f} s" if q in row else "-" for q in ("p50", "p90", "p99", "max")]
        print(f"| {kind} | {row['faults']} | {' | '.join(cells)} | {row.get('unresolved', '-')} |")
    growth = report["growth"].values()
    worst = {name: max((g[name] for g in growth), default=0) for name in ("threads", "fds", "rss_kib")}
    print(
        f"\nescalations: {report['escalations']}, process-level restarts: {report['process_restarts']}; "
        f"restarts checked: {report['restarts_checked']}, steps lost: "
        f"{report['steps_lost']}, done twice: {report['steps_twice']}; ranks finished at step "
        f"{report['stop_step']}: {report['finished_ranks']}, same state bit for bit: {report['same_state']}"
    )
    print(
        f"worker processes sampled: {len(report['resources'])}; largest growth between samples taken "
        f"while training: threads +{worst['threads']}, fds +{worst['fds']}, RSS +{worst['rss_kib'] / 1024:.1f} MiB"
    )
    print(f"processes alive 2 s after the launchers exited: {len(report['processes_left'])}")
    for crash in report["etcd_exits"]:  # etcd's, not the job's: the job went on with the other members
        print(f"etcd member {crash['member']} crashed after fault {crash['after_fault']}: {crash['panic'][:200]}")
    if report["goodput_report"]:
        print("\nwhat the faults cost (elastic-ft report on the run's events):")
        print("\n".join(report["goodput_report"]))
    print("checks: " + ("pass" if not report["problems"] else "FAIL: " + "; ".join(report["problems"])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15.0, help="how long faults are injected")
    parser.add_argument("--min-gap", type=float, default=2.0, help="seconds of training between two faults, at least")
    parser.add_argument("--max-gap", type=float, default=5.0, help="... and at most")
    parser.add_argument(
        "--weights",
        type=lambda t: [float(w) for w in t.split(",")],
        default=[3, 3, 2, 2, 2, 1, 1],
        help=f"relative frequency of each fault kind, in the order {','.join(KINDS)}",
    )
    parser.add_argument("--node-downtime", type=float, default=3.0, help="seconds a killed node stays down")
    parser.add_argument("--etcd-downtime", type=float, default=2.0, help="seconds a killed etcd member stays down")
    parser.add_argument("--lease-ttl", type=int, default=None, help="the rendezvous lease_ttl (default: etcdft's)")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between two resource samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--step-wait",
        type=float,
        default=0.0,
        help="the script's --step-wait: seconds each step leaves the CPUs idle, as on GPUs",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where to write the JSON (default: {RESULTS})")
    args = parser.parse_args()
    if len(args.weights) != len(KINDS):
        parser.error(f"--weights takes {len(KINDS)} numbers ({','.join(KINDS)}), got {args.weights}")
    if not args.step_wait >= 0:  # NaN too
        parser.error(f"--step-wait must be a number of seconds >= 0, got {args.step_wait}")
    report = Soak(args).run()
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    sys.exit(1 if report["problems"] else 0)


if __name__ == "__main__":
    scratch.run_main(main)
