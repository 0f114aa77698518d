"""The agent's optional Prometheus endpoint (``ftrun --metrics-port``), and torch's ``put_metric`` for the same.

:class:`JobMetrics` turns the run's events into metrics: counts are of
events recorded on this agent's node (its own, its rendezvous's and its
workers'), so summing a metric over every agent of a job counts each fault
once; the world-size gauges are the job's, alike on every agent. etcd
requests and errors are this agent's own client's, read at scrape time.
Every count also goes to torch's ``torch.distributed.elastic.metrics.put_metric``
(group ``elastic_ft``), where torch's agent reports its own.

The endpoint serves ``/metrics`` from its own registry, so nothing else a
process registers leaks into it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from elastic_ft.observability.events import JobEvent

log = logging.getLogger(__name__)

#: The most events kept for the goodput gauges (a long job's oldest go first).
_EVENTS_KEPT = 50_000
#: Buckets (seconds) of the fault-to-resume and rendezvous histograms: from the in-process
#: floor (tens of ms) to a process-level restart and beyond.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _put_metric(name: str, value: int) -> None:
    from torch.distributed.elastic.metrics import put_metric

    try:
        put_metric(name, value, metric_group="elastic_ft")
    except Exception as error:  # noqa: BLE001 - a user's metrics handler must not stop the agent
        log.debug("torch put_metric(%s) failed: %r", name, error)


class JobMetrics:
    """Metrics of one agent's node, fed with the run's events (:meth:`observe`) in log order.

    The log order of events from different processes need not be the order
    they happened in (each process sends its own); nothing here relies on it.
    """

    def __init__(self, node: str, etcd_counts: Callable[[], tuple[dict[str, int], dict[tuple[str, str], int]]]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.node = node
        self.registry = CollectorRegistry()
        self.restarts = Counter(
            "elastic_ft_restarts",
            "in-process restarts reported on this node, by the kind of their first fault",
            ["kind"],
            registry=self.registry,
        )
        self.faults = Counter(
            "elastic_ft_faults",
            "faults detected on this node (a rank's exception, a worker's death, a member node's death), by kind",
            ["kind"],
            registry=self.registry,
        )
        self.escalations = Counter(
            "elastic_ft_escalations", "process-level restarts this node recorded", registry=self.registry
        )
        self.respawns = Counter("elastic_ft_respawns", "dead workers this node replaced", registry=self.registry)
        self.activations = Counter(
            "elastic_ft_spare_activations", "reserve ranks of this node that became active", registry=self.registry
        )
        self.resume = Histogram(
            "elastic_ft_fault_to_resume_seconds",
            "from a restart's first fault to this node's first rank starting the next iteration",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.round_seconds = Histogram(
            "elastic_ft_rendezvous_round_seconds",
            "how long this node's rendezvous took, from its join to the round's result",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.active_world_size = Gauge(
            "elastic_ft_active_world_size", "active ranks of the current iteration", registry=self.registry
        )
        self.reserve_ranks = Gauge(
            "elastic_ft_reserve_ranks", "reserve (spare) ranks of the current iteration", registry=self.registry
        )
        self.terminated_ranks = Gauge(
            "elastic_ft_terminated_ranks", "ranks that left the job so far", registry=self.registry
        )
        self.iteration = Gauge(
            "elastic_ft_iteration", "the latest in-process iteration started", registry=self.registry
        )
        self.registry.register(_EtcdCollector(etcd_counts))
        self.registry.register(_OutageCollector())
        #: The run's events so far (the event log keeps a bounded number too): the goodput, at scrape time.
        self._events: deque[JobEvent] = deque(maxlen=_EVENTS_KEPT)
        self.registry.register(_GoodputCollector(self._events_so_far))
        self._fault_time: dict[int, float] = {}  # by iteration: its restart's first fault
        self._first_start: dict[int, float] = {}  # by iteration: when this node's first rank started it
        self._resumed: set[int] = set()  # iterations this node resumed in (latency observed)
        self._terminated: set[int] = set()
        self._lock = threading.Lock()

    def observe(self, event: JobEvent) -> None:
        with self._lock:
            self._events.append(event)
            self._observe(event)

    def _events_so_far(self) -> list[JobEvent]:
        with self._lock:
            return list(self._events)

    def _observe(self, event: JobEvent) -> None:
        data, here = event.data, event.node == self.node
        if event.name == "restart_decided":
            if event.iteration is not None and isinstance(data.get("fault_time"), (int, float)):
                self._fault_time[event.iteration] = float(data["fault_time"])
                self._resumed_here(event.iteration + 1)  # a rank of this node may have logged its start first
            if here:
                self._count(self.restarts.labels(kind=str(data.get("kind", "unknown"))), "restarts")
        elif event.name == "fault_detected" and here:
            self._count(self.faults.labels(kind=str(data.get("kind", "unknown"))), "faults")
        elif event.name == "node_died":
            self._terminated.update(r for r in data.get("ranks", []) if isinstance(r, int))
            if event.data.get("reporter") == self.node:
                self._count(self.faults.labels(kind="node_died"), "faults")
        elif event.name == "gave_up" and event.rank is not None:
            self._terminated.add(event.rank)
        elif event.name == "escalated" and here:
            self._count(self.escalations, "escalations")
        elif event.name == "respawned" and here:
            self._count(self.respawns, "respawns")
        elif event.name == "spare_activated" and here:
            self._count(self.activations, "spare_activations")
        elif event.name == "iteration_started":
            self._iteration_started(event, here)
        if event.name == "fault_detected" and event.source == "agent" and event.rank is not None:
            self._terminated.add(event.rank)
        self.terminated_ranks.set(len(self._terminated))

    def _iteration_started(self, event: JobEvent, here: bool) -> None:
        iteration, data = event.iteration or 0, event.data
        world, active = data.get("world_size"), data.get("active_world_size")
        if isinstance(world, int) and isinstance(active, int):
            self.active_world_size.set(active)
            self.reserve_ranks.set(max(0, world - active))
        self.iteration.set(iteration)
        if here:
            self._first_start[iteration] = min(event.time, self._first_start.get(iteration, event.time))
            self._resumed_here(iteration)

    def _resumed_here(self, iteration: int) -> None:
        """Observe the fault-to-resume latency of the restart into ``iteration``, once both ends are known.

        Events of different processes reach the log in any order, so this
        runs when either end arrives.
        """
        fault, start = self._fault_time.get(iteration - 1), self._first_start.get(iteration)
        if fault is not None and start is not None and iteration not in self._resumed:
            self._resumed.add(iteration)
            self.resume.observe(max(0.0, start - fault))

    def observe_round(self, seconds: float) -> None:
        self.round_seconds.observe(seconds)

    @staticmethod
    def _count(counter: Any, name: str) -> None:
        counter.inc()
        _put_metric(name, 1)


class _EtcdCollector:
    """``elastic_ft_etcd_requests_total`` and ``elastic_ft_etcd_errors_total``, read from the client at scrape time."""

    def __init__(self, counts: Callable[[], tuple[dict[str, int], dict[tuple[str, str], int]]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        requests, errors = self._counts()
        sent = CounterMetricFamily(
            "elastic_ft_etcd_requests", "etcd requests this agent sent, by kind", labels=["kind"]
        )
        for kind, count in sorted(requests.items()):
            sent.add_metric([kind], count)
        failed = CounterMetricFamily(
            "elastic_ft_etcd_errors",
            "etcd requests that failed (retried ones too), by kind and gRPC code",
            labels=["kind", "code"],
        )
        for (kind, code), count in sorted(errors.items()):
            failed.add_metric([kind, code], count)
        yield sent
        yield failed


class MetricsEndpoint:
    """Serves a :class:`JobMetrics` over HTTP, fed by following the run's event log in a thread.

    Args:
        metrics: what to serve.
        port: where (0: a free port; :attr:`port` tells which).
        read_events: ``read_events(after)`` returns the events numbered above ``after`` (``EventLog.read``).
        interval: seconds between two reads of the event log.
    """

    def __init__(
        self,
        metrics: JobMetrics,
        port: int,
        read_events: Callable[[int | None], list[JobEvent]],
        interval: float = 1.0,
        addr: str = "0.0.0.0",
    ) -> None:
        self.metrics = metrics
        self._requested_port = port
        self._addr = addr
        self._read_events = read_events
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="elastic_ft-metrics", daemon=True)
        self._server: Any = None
        self.port: int | None = None
        self._last: int | None = None

    def start(self) -> MetricsEndpoint:
        from prometheus_client import start_http_server

        try:
            self._server, _ = start_http_server(self._requested_port, self._addr, registry=self.metrics.registry)
        except OSError as error:
            raise OSError(f"cannot serve metrics on {self._addr}:{self._requested_port}: {error.strerror}") from None
        self.port = self._server.server_address[1]
        self._thread.start()
        log.info("serving Prometheus metrics on http://%s:%d/metrics", self._addr, self.port)
        return self

    def _follow(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self._interval)

    def poll(self) -> None:
        """Feed the events logged since the last poll (errors are logged: the next poll tries again)."""
        try:
            events = self._read_events(self._last)
        except Exception as error:  # noqa: BLE001 - etcd unreachable: metrics go stale, the agent goes on
            log.debug("metrics: reading the event log failed: %r", error)
            return
        for event in events:
            self.metrics.observe(event)
            self._last = event.seq if event.seq is not None else self._last

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self.poll()  # the last events, for a final scrape
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _GoodputCollector:
    """The job's goodput so far (:mod:`elastic_ft.observability.goodput`), computed at scrape time from the
    events: ``elastic_ft_goodput_ratio`` (the ETTR) and ``elastic_ft_wall_seconds`` by part (they sum to the
    wall time)."""

    def __init__(self, events: Callable[[], list[JobEvent]]) -> None:
        self._events = events

    def collect(self) -> Iterator[Any]:
        import time

        from prometheus_client.core import GaugeMetricFamily

        from elastic_ft.observability.goodput import goodput

        events = self._events()
        if not events:
            return
        found = goodput(events, now=time.time())
        yield GaugeMetricFamily(
            "elastic_ft_goodput_ratio", "training not redone, over the job's wall time so far (ETTR)", value=found.ettr
        )
        parts = GaugeMetricFamily(
            "elastic_ft_wall_seconds", "the job's wall time so far, by part (they sum to it)", labels=["part"]
        )
        for part, seconds in found.parts.items():
            parts.add_metric([part], seconds)
        yield parts


class _OutageCollector:
    """This agent's view of etcd's outages, read at scrape time (:data:`elastic_ft.etcd.outage.OUTAGES`):
    ``elastic_ft_etcd_reachable`` (0 while etcd does not answer it), ``elastic_ft_etcd_outages_total`` and
    ``elastic_ft_etcd_unreachable_seconds_total`` (the current outage's seconds so far included)."""

    def collect(self) -> Iterator[Any]:
        import time

        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from elastic_ft.etcd.outage import OUTAGES

        since = OUTAGES.down_since()
        current = 0.0 if since is None else time.monotonic() - since
        yield GaugeMetricFamily(
            "elastic_ft_etcd_reachable",
            "1 while etcd answers this agent, 0 during an outage",
            value=0 if since is not None else 1,
        )
        yield CounterMetricFamily("elastic_ft_etcd_outages", "etcd outages this agent has seen", value=OUTAGES.count)
        yield CounterMetricFamily(
            "elastic_ft_etcd_unreachable_seconds",
            "seconds etcd did not answer this agent",
            value=OUTAGES.seconds + current,
        )
