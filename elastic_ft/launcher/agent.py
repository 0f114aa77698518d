"""``ftrun``'s elastic agent: keeps healthy workers alive and hands faults to in-process restart.

torch's ``LocalElasticAgent`` stops every local worker as soon as one fails
(inside its process context's poll) and restarts the group. This subclass
starts workers exactly as torch does, but watches them itself, so a failed
worker never takes its healthy siblings down:

* a worker that fails inside ``elastic_ft.Wrapper`` is reported terminated in
  the round's store at once (:func:`elastic_ft.coordination.reports.report_process_gone`),
  and the Wrappers of every node restart in-process without it;
* a member node that dies (its rendezvous lease expires) has its ranks
  reported the same way, from the list of ranks it published;
* a worker that died inside the Wrapper is replaced by a new process for its
  local rank (within the job config's ``respawn`` budget), which joins the
  running world at its next restart: a hot spare grown in place;
* the new process is the node's warm standby when it keeps one
  (:mod:`elastic_ft.launcher.standby`): a process that imported torch and
  warmed up while the job trained, so a respawn costs the admission, not
  an interpreter's start;
* the round's hot spare nodes (``--spare-nodes``) are members whose ranks
  lie above the active world size handed to the workers
  (:class:`elastic_ft.handoff.WorkerHandoff`): their Wrappers keep them as
  reserve ranks until a fault activates them;
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
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    DEFAULT_ROLE,
    RunResult,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from elastic_ft.coordination.iteration import iteration_store
from elastic_ft.coordination.job import JobView, job_store, joiner_ready
from elastic_ft.coordination.reports import report_process_gone
from elastic_ft.etcd import accounting
from elastic_ft.etcd.client import EtcdRequestError, EtcdUnavailableError, key_missing, put_op
from elastic_ft.etcd.event_log import EventLog
from elastic_ft.etcd.node_relay import NodeRelay
from elastic_ft.etcd.store import EtcdStore
from elastic_ft.handoff import StoreHandoff, WorkerHandoff, job_config_from_env
from elastic_ft.job_config import JobConfig
from elastic_ft.keys import (
    FTRUN_EXIT_BARRIER,
    FTRUN_EXITS,
    FTRUN_NEXT_RANK,
    FTRUN_NODES,
    FTRUN_RESPAWNS,
    FTRUN_WORLD,
    count_suffix,
)
from elastic_ft.launcher.dead_members import DeadMembers
from elastic_ft.launcher.escalation import (
    Verdict,
    WorkerExit,
    classify_exit,
    decide,
    escalation,
    exit_barrier_done,
    restarts_left,
    retire_joiner,
)
from elastic_ft.launcher.fence_keeper import FenceKeeper
from elastic_ft.launcher.joiners import ADMISSION_BATCH_WAIT, admission_due, reserve_only, respawn_refusal
from elastic_ft.launcher.member_probes import MemberProbes
from elastic_ft.launcher.node_health import NodeHealthChecks, wait_until_healthy
from elastic_ft.launcher.records import EscalationRecord, ExitRecord, NodeRecord, WorldRecord
from elastic_ft.launcher.standby import (
    STANDBY_DELAY,
    HandedOverWorker,
    StandbyKeeper,
    StandbyPlan,
    standby_plan,
    stop_session,
)
from elastic_ft.observability.log_format import set_where
from elastic_ft.observability.metrics import JobMetrics, MetricsEndpoint
from elastic_ft.observability.sink import EventsHandoff, emit
from elastic_ft.rendezvous.handler import EtcdftRendezvousHandler
from elastic_ft.rendezvous.model import RoundResult
from elastic_ft.runtime.local_board import LocalBoard
from elastic_ft.runtime.reaper import describe_exit, ensure_reaper
from elastic_ft.runtime.torch_compat import (
    check_torch,
    exit_barrier_timeout,
    group_store,
    replace_worker_process,
    set_remaining_restarts,
    worker_processes,
)
from elastic_ft.runtime.waits import Backoff, pause
from elastic_ft.untrusted import decode

log = logging.getLogger(__name__)

_EXIT_BARRIER_POLL = 0.1
#: How long a retired joiner gets to exit on SIGTERM before SIGKILL.
_RETIRE_GRACE = 5.0


def _keep_old_log(path: str | None) -> str:
    """A worker's log file, for its respawned process: the dead process's log is kept beside it. Empty when
    the worker has none (torch's subprocess handler opens no file for an empty path, as for ``None``)."""
    if path and os.path.exists(path):
        os.replace(path, f"{path}.{int(time.time() * 1000)}")
    return path or ""


#: Where a failure the agent cannot leave to the Wrapper happened, as its warning says.
_FAILED_WHERE = {
    WorkerExit.UNWRAPPED: "outside elastic_ft.Wrapper",
    WorkerExit.FAILED_AFTER_COMPLETION: "after its elastic_ft.Wrapper completed the job",
}


def admission_request(job: JobView, live: list[int], world_size: int, waiting: list[int]) -> tuple[int, int, list[int]]:
    """Which iteration to ask to admit this node's ``waiting`` joiners, on which of its ranks' behalf, and
    which of them still wait once it is known (``live``: the node's initial ranks).

    The joiners are read again after the iteration: a restart admits its joiners before it names the next
    iteration and before any rank starts it. Read only before, a restart completing in between admits
    them, and the agent asks the next iteration to admit them again: one restart for nothing.
    """
    in_world = [r for r in live if r < world_size or job.admission(r) is not None]
    positions = [p for p in map(job.position, in_world) if p is not None]
    if positions:
        iteration = max(p["iteration"] for p in positions)
        rank = next(p["rank"] for p in positions if p["iteration"] == iteration)
    else:
        # No rank of this node is in the world (it rejoins, or joined late): ask the one the job is in.
        iteration, rank = job.latest_iteration(), 0  # recorded on the iteration's rank 0's behalf
    return iteration, rank, [r for r in waiting if job.admission(r) is None]


class FtAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` for the etcdft rendezvous that keeps healthy workers alive.

    Takes the same arguments as ``LocalElasticAgent``; the worker spec must
    use the etcdft rendezvous and a script or binary entrypoint (what
    ``ftrun`` launches).
    """

    #: Serve Prometheus metrics on this port while the agent runs (``ftrun --metrics-port``); None: no endpoint.
    metrics_port: int | None = None
    #: The checks the node passes before each rendezvous join (``ftrun``'s health flags); None: none.
    node_health: NodeHealthChecks | None = None
    #: Serve the node's ranks' requests to etcd through one relay (``ftrun --node-relay``).
    node_relay: bool = False
    #: Keep one warm standby process per node to take a dead worker's place (``ftrun --no-warm-standby``: off).
    warm_standby: bool = True
    #: Seconds the node's workers run undisturbed before its standby starts (``ftrun --warm-standby-delay``).
    standby_delay: float = STANDBY_DELAY

    def __init__(self, spec: WorkerSpec, *args: Any, **kwargs: Any) -> None:
        check_torch()
        accounting.set_role("agent")
        if not isinstance(spec.rdzv_handler, EtcdftRendezvousHandler):
            raise TypeError(
                f"FtAgent needs the etcdft rendezvous, got {type(spec.rdzv_handler).__name__} "
                f"(backend {spec.rdzv_handler.get_backend()!r})"
            )
        if not isinstance(spec.entrypoint, str):
            raise TypeError(f"FtAgent runs a script or binary entrypoint, got {spec.entrypoint!r}")
        super().__init__(spec, *args, **kwargs)
        self._handler: EtcdftRendezvousHandler = spec.rdzv_handler
        self._handler.accept_late_joins()
        self._exits: dict[int, tuple[WorkerExit, ProcessFailure | None]] = {}  # by local rank
        #: The member deaths the current workers have seen (a new one with each start).
        self._deaths = DeadMembers(self._handler)
        #: The initial rank each local rank's process holds now (a respawned one has a new one).
        self._initial_ranks: dict[int, int] = {}
        #: By local rank: new processes in a row not yet seen taking part in training.
        self._respawns: dict[int, int] = {}
        self._replaced: dict[int, ProcessFailure] = {}  # failures of respawned processes, by initial rank
        self._admission_asked: set[int] = set()  # iterations interrupted to admit this node's joiners
        self._joiners_accepted: bool | None = None  # whether the world can grow (None: not known yet)
        self._joiners_ready_since: float | None = None  # when the first of this node's joiners was ready
        self._active_world_size: int | None = None
        self._job_config: JobConfig = job_config_from_env(os.environ) or JobConfig()
        self._metrics: MetricsEndpoint | None = None
        #: What this node's workers and this agent tell each other (the fence, the stalls); made with the workers.
        self._board: LocalBoard | None = None
        #: Probes the other members when a local rank stays blocked (made with the first workers).
        self._probes: MemberProbes | None = None
        #: Keeps the node's fence on the board, from its own thread (started with the first workers).
        self._keeper: FenceKeeper | None = None
        #: Batches the node's ranks' barrier arrivals and shares their watches (started with the first workers).
        self._relay: NodeRelay | None = None
        #: The node's warm standby process, kept while the workers run (started once their command is known).
        self._standby = StandbyKeeper(
            self._standby_plan,
            delay=self.standby_delay,
            off=None if self.warm_standby else "ftrun --no-warm-standby",
        )
        set_where(f"node {self._handler.node}")

    # ---- metrics ----

    def _start_metrics(self) -> None:
        port = self.metrics_port
        if port is None:
            return
        settings, client = self._handler.settings, self._handler.client
        events = EventLog(client, settings.keys, settings.events_kept)
        metrics = JobMetrics(self._handler.node, lambda: (dict(client.requests_by_kind), dict(client.errors_by_kind)))
        self._metrics = MetricsEndpoint(metrics, port, lambda after: events.read(after).events).start()
        print(
            f"ftrun: Prometheus metrics of node {self._handler.node} at http://{socket.getfqdn()}:"
            f"{self._metrics.port}/metrics",
            file=sys.stderr,
            flush=True,
        )

    def _stop_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.stop()
            self._metrics = None

    # ---- the node relay ----

    def _start_relay(self, local_ranks: int) -> NodeRelay | None:
        """The node's relay, on a socket in a directory of its own (removed by the reaper if the agent dies);
        its path goes to the workers through the environment. None when its socket cannot be made: the workers
        then reach etcd themselves, as without a relay."""
        directory = tempfile.mkdtemp(prefix="eft-relay-")
        reaper = ensure_reaper()
        if reaper is not None:
            reaper.remove_on_exit(directory)
        settings = self._handler.settings
        relay = NodeRelay(
            self._handler.client,
            settings.keys.root,
            local_ranks,
            os.path.join(directory, "relay.sock"),
            timeout=settings.store_timeout,
            events=EventLog(self._handler.client, settings.keys, settings.events_kept),
        )
        try:
            relay.start()
        except OSError as error:
            log.warning(
                "the node relay could not listen at %s (%s): the workers reach etcd themselves", relay.path, error
            )
            os.rmdir(directory)
            return None
        os.environ.update(relay.env())
        log.info("node relay at %s: its %d workers reach etcd through it", relay.path, local_ranks)
        return relay

    def _stop_relay(self) -> None:
        if self._relay is not None:
            self._relay.close()
            os.rmdir(os.path.dirname(self._relay.path))
            self._relay = None

    # ---- job-wide escalation count ----

    def _escalated_rounds(self) -> set[int]:
        prefix = self._handler.settings.keys.escalations
        kvs, _ = self._handler.client.get_prefix(prefix)
        return {number for kv in kvs if (number := count_suffix(kv.key, prefix)) is not None}

    def _record_escalation(self, number: int, reason: str) -> None:
        """One key per escalated round; several nodes escalating the same round write it once."""
        key = self._handler.settings.keys.escalation(number)
        value = EscalationRecord(self._handler.node, reason, time.time()).to_json()
        if self._handler.client.txn([key_missing(key)], [put_op(key, value)]).succeeded:
            emit("escalated", source="agent", node=self._handler.node, round=number, reason=reason)

    # ---- starting workers ----

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        # Every node derives the count from etcd, so TORCHELASTIC_RESTART_COUNT agrees job-wide.
        left = restarts_left(worker_group.spec.max_restarts, self._escalated_rounds())
        set_remaining_restarts(self, max(left, 0))
        if self.node_health is not None:
            key = self._handler.settings.keys.health(self._handler.node)
            client = self._handler.client
            wait_until_healthy(
                self.node_health, lambda record: client.put(key, record.to_json()), node=self._handler.node
            )
        super()._rendezvous(worker_group)
        if self._metrics is not None and self._handler.last_round_seconds is not None:
            self._metrics.metrics.observe_round(self._handler.last_round_seconds)

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
        os.environ.update(self._events_handoff().to_env())
        if self._board is None:
            self._board = LocalBoard.create(worker_group.spec.local_world_size, self._handler.node)
            reaper = ensure_reaper()
            if reaper is not None:
                reaper.remove_on_exit(self._board.path)
        if self._probes is None:
            self._probes = MemberProbes(self._handler, self._board, lambda node: self._deaths.revoked(node))
        if self._keeper is None:
            self._keeper = FenceKeeper(self._handler, self._board, self._probes.probe_soon).start()
        for local_rank in range(self._board.ranks):
            self._board.clear_stalls(local_rank)
        os.environ.update(self._board.to_env())
        # One worker per host has nothing to batch with: a relay would only add a hop to each of its requests.
        if self._relay is None and self.node_relay and worker_group.spec.local_world_size > 1:
            self._relay = self._start_relay(worker_group.spec.local_world_size)
        self._active_world_size = self._round_active_world_size(worker_group, member_of)
        late = self._handler.late_place is not None
        os.environ.update(self._worker_handoff(worker_group, joining=late).to_env())
        if not late:
            world = WorldRecord(
                world_size=worker_group.workers[0].world_size,  # torch's WorkerSpec has at least one
                active_world_size=self._active_world_size,
                max_nodes=settings.max_nodes,
            )
            group_store(worker_group).set(FTRUN_WORLD, world.to_json())
        pids = super()._start_workers(worker_group)
        self._subprocesses()  # fails now, not later, if torch started something else
        self._exits = {}
        self._deaths = DeadMembers(self._handler)
        self._initial_ranks = {worker.local_rank: worker.global_rank for worker in worker_group.workers}
        self._respawns = {}
        self._replaced = {}
        self._admission_asked = set()
        self._joiners_accepted = None
        self._standby.hold()
        self._publish_node_record(worker_group)
        emit(
            "workers_started",
            source="agent",
            node=self._handler.node,
            round=member_of.round,
            ranks=[self._initial_ranks[w.local_rank] for w in worker_group.workers],
            pids=list(pids.values()),
            hot_spare=late,
        )
        return pids

    def _events_handoff(self) -> EventsHandoff:
        """How the workers record their events: into this run's log, as this node, to the same torch handler."""
        settings = self._handler.settings
        return EventsHandoff(
            etcd_prefix=settings.etcd_prefix,
            run_id=settings.run_id,
            node=self._handler.node,
            capacity=settings.events_kept,
            destination=self._worker_group.spec.event_log_handler,
            progress_interval=self._job_config.observability.progress_interval,
        )

    def _assign_worker_ranks(
        self, store: Any, group_rank: int, group_world_size: int, spec: WorkerSpec
    ) -> list[Worker]:
        """torch's assignment for members; a hot spare that joined the running round gets fresh initial ranks.

        Its workers join the running world as joiners (like respawned
        workers): initial ranks above the world's, from the round's counter,
        and the world size the members started with.
        """
        if self._handler.late_place is None:
            return super()._assign_worker_ranks(store, group_rank, group_world_size, spec)
        world_size = decode(FTRUN_WORLD, store.get(FTRUN_WORLD), WorldRecord.from_json).world_size
        count = spec.local_world_size
        base = world_size + store.add(FTRUN_NEXT_RANK, count) - count
        return [
            Worker(
                local_rank=i,
                global_rank=base + i,
                role_rank=base + i,
                world_size=world_size,
                role_world_size=world_size,
            )
            for i in range(count)
        ]

    def _round_active_world_size(self, worker_group: WorkerGroup, result: RoundResult) -> int | None:
        """How many ranks run the training function at most: those of ``max_nodes`` nodes, or with segments
        those of the round's whole segments (its first ``result.active`` members).

        The round's ranks above it (its hot spares') start as reserve ranks;
        below it, the world grows in-process as nodes join the running round
        (a node that comes back, or arrives below ``max_nodes``).
        """
        workers = worker_group.workers
        if not workers:
            return None
        world_size, members = workers[0].world_size, len(result.members)
        if world_size % members:
            log.warning("nodes run different numbers of workers: no reserve ranks, every rank is active")
            return None
        nodes = self._handler.settings.max_nodes if result.active is None else result.active
        return world_size // members * nodes

    def _worker_handoff(self, worker_group: WorkerGroup, joining: bool) -> WorkerHandoff:
        """The place of this node's workers: the active world size, and with segments their node's label."""
        settings = self._handler.settings
        label = self._handler.segment
        if settings.segment is None or label is None:
            return WorkerHandoff(self._active_world_size, joining=joining)
        ranks = settings.segment * worker_group.spec.local_world_size
        return WorkerHandoff(self._active_world_size, joining=joining, segment=label, segment_ranks=ranks)

    def _publish_node_record(self, worker_group: WorkerGroup) -> None:
        """Tell the other agents this node's initial ranks and pids (they report them if the node dies)."""
        member_of = self._handler.member_of
        if member_of is None:
            raise RuntimeError("FtAgent published its ranks outside any rendezvous round")
        handlers = self._subprocesses().subprocess_handlers
        record = NodeRecord(
            host=socket.getfqdn(),
            group_rank=worker_group.group_rank or 0,
            round=member_of.round,
            global_ranks=tuple(self._initial_ranks[worker.local_rank] for worker in worker_group.workers),
            pids=tuple(handlers[worker.local_rank].proc.pid for worker in worker_group.workers),
            world_size=worker_group.workers[0].world_size if worker_group.workers else 0,
        )
        group_store(worker_group).set(FTRUN_NODES + self._handler.node, record.to_json())

    def _subprocesses(self) -> SubprocessContext:
        return worker_processes(self)

    # ---- watching workers ----

    def _observe_workers(self, worker_group: WorkerGroup) -> dict[int, WorkerExit]:
        """Classify every local worker (by its current initial rank); report newly failed ones, respawn them."""
        pcontext = self._subprocesses()
        store = group_store(worker_group)
        job = job_store(store)
        self._note_rejoined(worker_group)
        kinds: dict[int, WorkerExit] = {}
        for worker in worker_group.workers:
            rank = self._initial_ranks[worker.local_rank]
            known = self._exits.get(worker.local_rank)
            if known is not None:
                kinds[rank] = known[0]
                continue
            process = pcontext.subprocess_handlers[worker.local_rank].proc
            exitcode = process.poll()
            if exitcode is None:
                kinds[rank] = WorkerExit.RUNNING
                self._note_useful_respawn(job, worker.local_rank, rank)
                joiner = rank >= worker.world_size
                if joiner and retire_joiner(
                    joiner, job.is_wrapped(rank), job.admission(rank) is not None, job.finished()
                ):
                    kinds[rank] = self._retire(store, worker.local_rank, rank)
                continue
            failure = None
            if exitcode == 0:
                kind = WorkerExit.SUCCEEDED
            else:
                joiner = rank >= worker.world_size
                left = job.left(rank)
                kind = classify_exit(exitcode, job.is_wrapped(rank), left, joiner)
                failure = ProcessFailure(
                    worker.local_rank, process.pid, exitcode, pcontext.error_files[worker.local_rank]
                )
                if kind in _FAILED_WHERE:
                    where = _FAILED_WHERE[kind]
                    log.warning("rank %d (pid %d) ended with %s %s", rank, process.pid, describe_exit(exitcode), where)
            if kind is WorkerExit.ABSORBED:
                # The Wrappers' restart report (one line, by one rank) is the warning users see for it.
                log.info(
                    "rank %d (pid %d) ended with %s inside elastic_ft.Wrapper; the other workers continue without it",
                    rank,
                    process.pid,
                    describe_exit(exitcode),
                )
                report_process_gone(
                    store, rank, worker.world_size, "terminated", f"pid {process.pid}: {describe_exit(exitcode)}"
                )
            if kind is not WorkerExit.SUCCEEDED:
                emit(
                    "fault_detected",
                    source="agent",
                    node=self._handler.node,
                    round=self._round(),
                    rank=rank,
                    kind="process_died",
                    message=f"pid {process.pid}: {describe_exit(exitcode)}",
                    exitcode=exitcode,
                    absorbed=kind is WorkerExit.ABSORBED,
                )
            record = ExitRecord(self._handler.node, process.pid, exitcode, kind.value)
            store.set(f"{FTRUN_EXITS}{rank}", record.to_json())
            self._exits[worker.local_rank] = (kind, failure)
            kinds[rank] = kind
            if kind is WorkerExit.ABSORBED and self._respawn(worker_group, worker.local_rank, worker.world_size):
                kinds[rank] = WorkerExit.ABSORBED  # the old process's fate; the new one is watched from now on
                kinds[self._initial_ranks[worker.local_rank]] = WorkerExit.RUNNING
        return kinds

    def _note_rejoined(self, worker_group: WorkerGroup) -> None:
        """A worker counted out while it lived took a new initial rank to join again (it says so on the node's
        board): watch, report and admit it under that one from now on."""
        board = self._board
        if board is None:
            return
        changed = False
        for local_rank, rank in list(self._initial_ranks.items()):
            taken = board.initial_rank(local_rank)
            if taken is not None and taken != rank and local_rank not in self._exits:
                log.info(
                    "local rank %d (initial rank %d) joins the running world again as initial rank %d",
                    local_rank,
                    rank,
                    taken,
                )
                self._initial_ranks[local_rank] = taken
                changed = True
        if changed:
            self._publish_node_record(worker_group)

    def _retire(self, store: EtcdStore, local_rank: int, initial_rank: int) -> WorkerExit:
        """Stop a respawned process the job completed without (:func:`retire_joiner`): SIGTERM, SIGKILL if it lingers."""
        handler = self._subprocesses().subprocess_handlers[local_rank]
        process = handler.proc
        log.info(
            "the job completed before respawned rank %d (pid %d) entered elastic_ft.Wrapper: stopping it",
            initial_rank,
            process.pid,
        )
        stop_session(process, _RETIRE_GRACE)
        exitcode = process.poll()
        record = ExitRecord(
            self._handler.node, process.pid, -signal.SIGKILL if exitcode is None else exitcode, WorkerExit.RETIRED.value
        )
        store.set(f"{FTRUN_EXITS}{initial_rank}", record.to_json())
        self._exits[local_rank] = (WorkerExit.RETIRED, None)
        return WorkerExit.RETIRED

    # ---- respawning workers ----

    def _note_useful_respawn(self, job: JobView, local_rank: int, initial_rank: int) -> None:
        """A respawned process that took part in training (admitted, active) ends its local rank's run of respawns.

        ``respawn.per_rank`` bounds a crash loop (new processes that die
        before they are of any use), not the replacements a long job needs.
        """
        if not self._respawns.get(local_rank):
            return
        position = job.position(initial_rank)
        if position is not None and position["active"]:
            self._respawns[local_rank] = 0

    def _respawn(self, worker_group: WorkerGroup, local_rank: int, world_size: int) -> bool:
        """Start a new process for ``local_rank``, to join the running world at its next restart.

        Within the job config's ``respawn`` budget (``per_rank``: new
        processes of this local rank in a row that died before they took
        part in training; ``per_job``: all of the job's), and only while
        the world can grow (its rank assignment admits new ranks) and has
        not finished. The process gets a new initial rank above the world's
        and waits, initialised, as a joiner
        (:class:`elastic_ft.handoff.WorkerHandoff` with ``joining``).
        """
        config, store = self._job_config, group_store(worker_group)
        used = self._respawns.get(local_rank, 0)
        job = job_store(store)
        refusal = respawn_refusal(local_rank, used, config.respawn.per_rank, job.finished(), job.accepts_joiners())
        if refusal is not None:
            log.info("%s", refusal)
            return False
        settings = self._handler.settings
        job_wide = EtcdStore(self._handler.client, settings.keys.ftrun_store, timedelta(seconds=settings.store_timeout))
        if job_wide.add(FTRUN_RESPAWNS, 1) > config.respawn.per_job:
            log.info("local rank %d is not respawned: respawn.per_job=%d used", local_rank, config.respawn.per_job)
            return False
        initial_rank = world_size + store.add(FTRUN_NEXT_RANK, 1) - 1
        pcontext = self._subprocesses()
        env = dict(pcontext.envs[local_rank])
        env["RANK"] = str(initial_rank)
        env.update(self._worker_handoff(worker_group, joining=True).to_env())
        stdout, stderr = (_keep_old_log(paths.get(local_rank)) for paths in (pcontext.stdouts, pcontext.stderrs))
        handler = self._hand_over_standby(local_rank, env, stdout, stderr)
        from_standby = handler is not None
        if handler is None:
            handler = get_subprocess_handler(
                entrypoint=str(pcontext.entrypoint),
                args=pcontext.args[local_rank],
                env=env,
                stdout=stdout,
                stderr=stderr,
                local_rank_id=local_rank,
                numa_options=getattr(pcontext, "_numa_options", None),
            )
        replace_worker_process(pcontext, local_rank, handler)
        if self._board is not None:
            self._board.clear_stalls(local_rank)
        self._respawns[local_rank] = used + 1
        _, failure = self._exits.pop(local_rank)
        if failure is not None:
            self._replaced[self._initial_ranks[local_rank]] = failure
        self._initial_ranks[local_rank] = initial_rank
        self._publish_node_record(worker_group)
        emit(
            "respawned",
            source="agent",
            node=self._handler.node,
            round=self._round(),
            rank=initial_rank,
            local_rank=local_rank,
            pid=handler.proc.pid,
            standby=from_standby,
        )
        log.warning(
            "local rank %d respawned as pid %d (initial rank %d%s); it joins the running world at its next restart",
            local_rank,
            handler.proc.pid,
            initial_rank,
            ", the node's warm standby" if from_standby else "",
        )
        return True

    # ---- the warm standby ----

    def _standby_plan(self) -> tuple[StandbyPlan | str, dict[str, str]]:
        """How a standby runs this node's workers' command, or why it cannot; and the environment torch gives
        them (a standby starts with that of the first local rank; each worker's own comes at the hand-over)."""
        pcontext = self._subprocesses()
        if not pcontext.envs:
            return "the node runs no worker", dict(os.environ)
        first = min(pcontext.envs)
        env = {**os.environ, **pcontext.envs[first]}
        if getattr(pcontext, "_numa_options", None) is not None:
            return "the workers are bound to NUMA nodes by local rank, which a standby cannot know in advance", env
        return standby_plan(str(pcontext.entrypoint), pcontext.args[first]), env

    def _hand_over_standby(self, local_rank: int, env: dict[str, str], stdout: str, stderr: str) -> Any:
        """The standby, now running ``local_rank``'s worker command with ``env``; None without one (or if it
        was gone). The next standby starts once the node has been quiet again."""
        standby = self._standby.take()
        if standby is None:
            return None
        process = standby.hand_over({**os.environ, **env}, stdout, stderr)
        if process is None:
            standby.stop()
            return None
        return HandedOverWorker(process, local_rank)

    def _ask_admission(self, worker_group: WorkerGroup) -> None:
        """``respawn.rejoin: at_once``: ask the running iteration to restart once a local joiner is ready.

        The restart that follows admits every registered joiner, so the
        world size comes back without waiting for the next fault, at the
        cost of one in-process restart, planned: it lands at a step
        boundary, not inside a collective. Asked at most once per iteration,
        and only while fewer ranks are active than the job runs at most.
        """
        if self._job_config.respawn.rejoin != "at_once":
            return
        store = group_store(worker_group)
        job = job_store(store)
        world_size = worker_group.workers[0].world_size if worker_group.workers else 0
        live = [r for local, r in self._initial_ranks.items() if local not in self._exits]
        joiners = [r for r in live if r >= world_size and job.admission(r) is None]
        registered = set(job.joiners()) if joiners else set()
        waiting = [r for r in joiners if r in registered and joiner_ready(job, r)]
        if not waiting or (self._board is not None and not self._board.may_join()):
            self._joiners_ready_since = None
            return
        now = time.monotonic()
        if self._joiners_ready_since is None:
            self._joiners_ready_since = now
        due, _ = admission_due(waiting, joiners, self._joiners_ready_since, now, ADMISSION_BATCH_WAIT)
        if not due:
            return
        iteration, rank, waiting = admission_request(job, live, world_size, waiting)
        if not waiting or iteration in self._admission_asked:
            return
        self._admission_asked.add(iteration)
        active = iteration_store(store, iteration).active_world_size()
        if reserve_only(active, self._active_world_size):
            log.info(
                "joiner(s) %s ready: they wait as reserve ranks (%d of %d ranks active)",
                waiting,
                active,
                self._active_world_size,
            )
            return
        log.info(
            "joiner(s) %s ready: asking iteration %d to restart and admit them (respawn.rejoin=at_once)",
            waiting,
            iteration,
        )
        iteration_store(store, iteration).request_restart(rank, "admit_joiners", f"initial rank(s) {waiting} ready")

    def _cannot_grow(self, worker_group: WorkerGroup) -> bool:
        """This node took a place in the running round, and the world's ranks said it cannot take joiners."""
        if self._handler.late_place is None:
            return False
        if self._joiners_accepted is None:
            self._joiners_accepted = job_store(group_store(worker_group)).joiners_accepted()
        return self._joiners_accepted is False

    def _round(self) -> int | None:
        member_of = self._handler.member_of
        return None if member_of is None else member_of.round

    def _failures(self) -> dict[int, ProcessFailure]:
        """Every failed process of this node, by initial rank (respawned ones' predecessors included)."""
        current = {
            self._initial_ranks[local]: failure for local, (_, failure) in self._exits.items() if failure is not None
        }
        return {**self._replaced, **current}

    # ---- the agent's loop ----

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        self._start_metrics()
        try:
            result = super().run(role)
        finally:
            self._stop_metrics()
            if self._keeper is not None:
                self._keeper.stop()
            self._stop_relay()
            self._standby.stop()
            if self._board is not None:
                self._board.close(remove=True)
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
        backoff = Backoff()
        while True:  # until the run ends: the loop returns its result
            pause(spec.monitor_interval)
            if self._probes is not None:
                self._probes.watch()
            try:
                workers = self._observe_workers(group)
                self._standby.tick()
                self._ask_admission(group)
                change = self._handler.membership_change()
                lost = self._deaths.absorb(group_store(group), change)
            except EtcdUnavailableError as error:
                # etcd away: the workers train on; the process's outage record says so once.
                log.debug("etcd unavailable while watching the workers; retrying: %s", error)
                backoff.pause()
                continue
            except EtcdRequestError as error:
                log.warning("etcd refused a request while watching the workers; retrying: %s", error)
                backoff.pause()
                continue
            backoff.reset()
            decision = decide(workers, change, lost, self._cannot_grow(group))
            if decision.verdict is Verdict.CONTINUE:
                group.state = WorkerState.HEALTHY
                continue
            if decision.verdict is Verdict.SUCCEEDED:
                return self._finish(group, None, decision.reason or None)
            if decision.verdict is Verdict.FOLLOW:
                log.info("[%s] %s: restarting the workers into the next round", spec.role, decision.reason)
                if self._handler.late_place is not None:
                    self._handler.accept_late_joins(False)  # its next round is a whole one
                self._restart_workers(group)
                continue
            member_of = self._handler.member_of
            if member_of is None:
                raise RuntimeError("FtAgent watched workers outside any rendezvous round")
            ending = escalation(decision, spec.max_restarts, self._escalated_rounds(), member_of.round)
            if ending.restart:
                log.warning("[%s] %s", spec.role, ending.message)
                self._record_escalation(member_of.round, decision.reason)
                group.state = WorkerState.FAILED
                self._restart_workers(group)
                continue
            log.error("[%s] %s", spec.role, ending.message)
            return self._finish(group, decision.reason)

    def _finish(self, group: WorkerGroup, failed_because: str | None, failed_after: str | None = None) -> RunResult:
        """The run's end: succeeded (``failed_because`` None: the rendezvous closes, so waiting spares exit
        instead of starting a new job) or failed (the workers stopped). ``failed_after``: the job completed, but
        some worker failed after its Wrapper returned; the run ends as a completed one, nothing restarted, and
        the node reports those workers' failures (torchrun's error summary, a non-zero exit)."""
        role = group.spec.role
        if failed_because is not None:
            failures = self._failures()
            self._stop_workers(group)
            group.state = WorkerState.FAILED
            emit(
                "job_finished",
                source="agent",
                node=self._handler.node,
                round=self._round(),
                state="FAILED",
                reason=failed_because,
            )
            return RunResult(state=WorkerState.FAILED, failures=failures)
        group.state = WorkerState.SUCCEEDED
        after = {
            self._initial_ranks[local]
            for local, (kind, _) in self._exits.items()
            if kind is WorkerExit.FAILED_AFTER_COMPLETION
        }
        failures = self._failures()
        absorbed = {rank: failure for rank, failure in failures.items() if rank not in after}
        if absorbed:
            log.warning(
                "[%s] worker group finished; failures absorbed by in-process restart: %s",
                role,
                {rank: f"pid {f.pid}, {describe_exit(f.exitcode)}" for rank, f in absorbed.items()},
            )
        self._exit_barrier()
        log.info("[%s] worker group finished; closing the rendezvous", role)
        emit("job_finished", source="agent", node=self._handler.node, round=self._round(), state="SUCCEEDED")
        self._handler.set_closed()
        if failed_after is not None:
            log.error("[%s] the job completed, but %s", role, failed_after)
            return RunResult(state=WorkerState.FAILED, failures={rank: failures[rank] for rank in after})
        return RunResult(state=WorkerState.SUCCEEDED, return_values={w.global_rank: None for w in group.workers})

    # ---- node loss at network speed ----

    def _exit_barrier(self) -> None:
        """Wait until every member of the round finished or died (bounded by the exit barrier timeout).

        torch's barrier waits for all members by count, which a node that
        died (and was absorbed in-process) never reaches.
        """
        store = group_store(self._worker_group)
        member_of = self._handler.member_of
        if store is None or member_of is None:
            return
        store.set(FTRUN_EXIT_BARRIER + self._handler.node, "")
        members = {member.node for member in member_of.members}
        arrived: set[str] = set()
        deadline = time.monotonic() + exit_barrier_timeout(self)
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
                    exit_barrier_timeout(self),
                )
                return
            pause(_EXIT_BARRIER_POLL)
