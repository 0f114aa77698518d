"""``ftrun``'s elastic agent: keeps healthy workers alive and hands faults to in-process restart.

torch's ``LocalElasticAgent`` stops every local worker as soon as one fails
(inside its process context's poll) and restarts the group. This subclass
starts workers exactly as torch does, but watches them itself, so a failed
worker never takes its healthy siblings down:

* a worker that fails inside ``elastic_ft.Wrapper`` is reported terminated in
  the round's store at once (:func:`elastic_ft.inprocess.store.report_process_gone`),
  and the Wrappers of every node restart in-process without it;
* a member node that dies (its rendezvous lease expires) has its ranks
  reported the same way, from the list of ranks it published;
* everything else follows the rules of :mod:`elastic_ft.launcher.escalation`:
  escalate to torchrun's stop, re-rendezvous and start, or follow another
  node's escalation.

The workers' Wrapper finds the round's etcd store through the hand-off in
their environment (:class:`elastic_ft.handoff.StoreHandoff`), so no worker
hosts the job's coordination. The agent's records
(:mod:`elastic_ft.launcher.records`) live in the round's store, and the
escalations in job-wide keys.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from elastic_ft.etcd.client import EtcdRequestError, EtcdUnavailableError, key_missing, put_op
from elastic_ft.handoff import StoreHandoff
from elastic_ft.inprocess.store import job_store, report_process_gone
from elastic_ft.keys import FTRUN_EXIT_BARRIER, FTRUN_EXITS, FTRUN_NODES, count_suffix
from elastic_ft.launcher.escalation import Verdict, WorkerExit, classify_exit, decide, exit_barrier_done, restarts_left
from elastic_ft.launcher.records import EscalationRecord, ExitRecord, NodeRecord, RecordError
from elastic_ft.rendezvous.handler import EtcdftRendezvousHandler

log = logging.getLogger(__name__)

_EXIT_BARRIER_POLL = 0.1


def _describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


class FtAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` for the etcdft rendezvous that keeps healthy workers alive.

    Takes the same arguments as ``LocalElasticAgent``; the worker spec must
    use the etcdft rendezvous and a script or binary entrypoint (what
    ``ftrun`` launches).
    """

    def __init__(self, spec: WorkerSpec, *args: Any, **kwargs: Any) -> None:
        if not isinstance(spec.rdzv_handler, EtcdftRendezvousHandler):
            raise TypeError(
                f"FtAgent needs the etcdft rendezvous, got {type(spec.rdzv_handler).__name__} "
                f"(backend {spec.rdzv_handler.get_backend()!r})"
            )
        if not isinstance(spec.entrypoint, str):
            raise TypeError(f"FtAgent runs a script or binary entrypoint, got {spec.entrypoint!r}")
        super().__init__(spec, *args, **kwargs)
        self._handler: EtcdftRendezvousHandler = spec.rdzv_handler
        self._exits: dict[int, tuple[WorkerExit, ProcessFailure | None]] = {}  # by local rank
        self._dead_handled: set[str] = set()
        self._dead_lost: set[str] = set()

    # ---- job-wide escalation count ----

    def _escalated_rounds(self) -> set[int]:
        prefix = self._handler.settings.keys.escalations
        kvs, _ = self._handler.client.get_prefix(prefix)
        return {number for kv in kvs if (number := count_suffix(kv.key, prefix)) is not None}

    def _record_escalation(self, number: int, reason: str) -> None:
        """One key per escalated round; several nodes escalating the same round write it once."""
        key = self._handler.settings.keys.escalation(number)
        value = EscalationRecord(self._handler.node, reason, time.time()).to_json()
        self._handler.client.txn([key_missing(key)], [put_op(key, value)])

    # ---- starting workers ----

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        # Every node derives the count from etcd, so TORCHELASTIC_RESTART_COUNT agrees job-wide.
        left = restarts_left(worker_group.spec.max_restarts, self._escalated_rounds())
        self._remaining_restarts = max(left, 0)
        super()._rendezvous(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        member_of = self._handler.member_of
        if member_of is None:
            raise RuntimeError("FtAgent started workers before the rendezvous completed")
        settings = self._handler.settings
        # Workers inherit the agent's environment; this is how their Wrapper finds the round's store.
        handoff = StoreHandoff(
            endpoints=settings.endpoints,
            prefix=self._handler.round_store_prefix(member_of.round),
            tls=settings.tls,
            connect_timeout=settings.connect_timeout,
            request_timeout=settings.request_timeout,
            timeout=settings.store_timeout,
            credentials=settings.credentials,
        )
        os.environ.update(handoff.to_env())
        pids = super()._start_workers(worker_group)
        self._subprocesses()  # fails now, not later, if torch started something else
        self._exits = {}
        self._dead_handled = set()
        self._dead_lost = set()
        record = NodeRecord(
            host=socket.getfqdn(),
            group_rank=worker_group.group_rank or 0,
            round=member_of.round,
            global_ranks=tuple(worker.global_rank for worker in worker_group.workers),
            pids=tuple(pids[worker.local_rank] for worker in worker_group.workers),
            world_size=worker_group.workers[0].world_size if worker_group.workers else 0,
        )
        worker_group.store.set(FTRUN_NODES + self._handler.node, record.to_json())
        return pids

    def _subprocesses(self) -> SubprocessContext:
        if not isinstance(self._pcontext, SubprocessContext):
            raise TypeError(f"FtAgent expected worker subprocesses, got {type(self._pcontext).__name__}")
        return self._pcontext

    # ---- watching workers ----

    def _observe_workers(self, worker_group: WorkerGroup) -> dict[int, WorkerExit]:
        """Classify every local worker (by global rank); report newly failed ones to the Wrapper."""
        pcontext = self._subprocesses()
        store = worker_group.store
        job = job_store(store)
        kinds: dict[int, WorkerExit] = {}
        for worker in worker_group.workers:
            known = self._exits.get(worker.local_rank)
            if known is not None:
                kinds[worker.global_rank] = known[0]
                continue
            process = pcontext.subprocess_handlers[worker.local_rank].proc
            exitcode = process.poll()
            if exitcode is None:
                kinds[worker.global_rank] = WorkerExit.RUNNING
                continue
            failure = None
            if exitcode == 0:
                kind = WorkerExit.SUCCEEDED
            else:
                kind = classify_exit(exitcode, job.is_wrapped(worker.global_rank), job.left(worker.global_rank))
                failure = ProcessFailure(
                    worker.local_rank, process.pid, exitcode, pcontext.error_files[worker.local_rank]
                )
            if kind is WorkerExit.ABSORBED:
                log.warning(
                    "rank %d (pid %d) ended with %s inside elastic_ft.Wrapper; the other workers continue without it",
                    worker.global_rank,
                    process.pid,
                    _describe_exit(exitcode),
                )
                report_process_gone(
                    store,
                    worker.global_rank,
                    worker.world_size,
                    "terminated",
                    f"pid {process.pid}: {_describe_exit(exitcode)}",
                )
            record = ExitRecord(self._handler.node, process.pid, exitcode, kind.value)
            store.set(f"{FTRUN_EXITS}{worker.global_rank}", record.to_json())
            self._exits[worker.local_rank] = (kind, failure)
            kinds[worker.global_rank] = kind
        return kinds

    def _absorb_dead_members(self, worker_group: WorkerGroup, dead: tuple[str, ...]) -> tuple[str, ...]:
        """Report the ranks of member nodes that died, so in-process restart goes on without them.

        Returns the dead nodes it could not absorb: their ranks are unknown, or
        some of them never entered the Wrapper, so the others would wait for
        them at its initial barrier.
        """
        store = worker_group.store
        for node in dead:
            if node in self._dead_handled or node == self._handler.node:
                continue
            self._dead_handled.add(node)
            key = FTRUN_NODES + node
            if not store.check([key]):
                log.warning("node %s died before publishing its ranks", node)
                self._dead_lost.add(node)
                continue
            try:
                record = NodeRecord.from_json(store.get(key))
            except RecordError as error:
                log.warning("node %s died and its record %s is unreadable: %s", node, key, error)
                self._dead_lost.add(node)
                continue
            job = job_store(store)
            if not all(job.is_wrapped(rank) for rank in record.global_ranks):
                log.warning("node %s died before all its workers entered elastic_ft.Wrapper", node)
                self._dead_lost.add(node)
                continue
            reported = [
                rank
                for rank in record.global_ranks
                if report_process_gone(store, rank, record.world_size, "node_died", f"node {node} died")
            ]
            log.warning("node %s died; reported its rank(s) %s terminated", node, reported)
        return tuple(sorted(self._dead_lost))

    def _failures(self) -> dict[int, ProcessFailure]:
        by_local = {worker.local_rank: worker.global_rank for worker in self._worker_group.workers}
        return {by_local[local]: failure for local, (_, failure) in self._exits.items() if failure is not None}

    # ---- the agent's loop ----

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        result = super().run(role)
        if result is None:
            # torch's run() returns None after a graceful rendezvous exit (a spare the
            # job finished without), which its launcher cannot handle: report success.
            log.info("the job finished without this node; exiting")
            return RunResult(state=WorkerState.SUCCEEDED, return_values={})
        return result

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        group = self._worker_group
        spec = group.spec
        log.info("[%s] starting workers for entrypoint: %s", spec.role, spec.get_entrypoint_name())
        self._initialize_workers(group)
        while True:
            time.sleep(spec.monitor_interval)
            try:
                workers = self._observe_workers(group)
                change = self._handler.membership_change()
                lost = self._absorb_dead_members(group, change.dead)
            except (EtcdUnavailableError, EtcdRequestError) as error:
                log.warning("etcd unavailable while watching the workers; retrying: %s", error)
                continue
            decision = decide(workers, change, lost)
            if decision.verdict is Verdict.CONTINUE:
                group.state = WorkerState.HEALTHY
                continue
            if decision.verdict is Verdict.SUCCEEDED:
                group.state = WorkerState.SUCCEEDED
                absorbed = self._failures()
                if absorbed:
                    log.warning(
                        "[%s] worker group finished; failures absorbed by in-process restart: %s",
                        spec.role,
                        {rank: f"pid {f.pid}, {_describe_exit(f.exitcode)}" for rank, f in absorbed.items()},
                    )
                self._exit_barrier()
                # The job is done: spares still waiting exit instead of starting a new one.
                log.info("[%s] worker group finished; closing the rendezvous", spec.role)
                self._handler.set_closed()
                return RunResult(
                    state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in group.workers}
                )
            if decision.verdict is Verdict.FOLLOW:
                log.info("[%s] %s: restarting the workers into the next round", spec.role, decision.reason)
                self._restart_workers(group)
                continue
            member_of = self._handler.member_of
            if member_of is None:
                raise RuntimeError("FtAgent watched workers outside any rendezvous round")
            left = restarts_left(spec.max_restarts, self._escalated_rounds(), member_of.round)
            if left > 0:
                log.warning(
                    "[%s] %s: escalating to a process-level restart (%d of %d left)",
                    spec.role,
                    decision.reason,
                    left,
                    spec.max_restarts,
                )
                self._record_escalation(member_of.round, decision.reason)
                group.state = WorkerState.FAILED
                self._restart_workers(group)
                continue
            log.error(
                "[%s] %s, and no restarts are left (--max-restarts=%d)", spec.role, decision.reason, spec.max_restarts
            )
            failures = self._failures()
            self._stop_workers(group)
            group.state = WorkerState.FAILED
            return RunResult(state=WorkerState.FAILED, failures=failures)

    def _exit_barrier(self) -> None:
        """Wait until every member of the round finished or died (bounded by the exit barrier timeout).

        torch's barrier waits for all members by count, which a node that
        died (and was absorbed in-process) never reaches.
        """
        store = self._worker_group.store
        member_of = self._handler.member_of
        if store is None or member_of is None:
            return
        store.set(FTRUN_EXIT_BARRIER + self._handler.node, "")
        members = {member.node for member in member_of.members}
        arrived: set[str] = set()
        deadline = time.monotonic() + self._exit_barrier_timeout
        while True:
            arrived |= {node for node in members - arrived if store.check([FTRUN_EXIT_BARRIER + node])}
            change = self._handler.membership_change()
            gone = set(change.dead) | set(change.left)  # a member that left will never arrive
            if exit_barrier_done(members, arrived, gone):
                return
            if time.monotonic() >= deadline:
                log.warning(
                    "exit barrier: %s still running after %g s; exiting anyway",
                    sorted(members - arrived - gone),
                    self._exit_barrier_timeout,
                )
                return
            time.sleep(_EXIT_BARRIER_POLL)
