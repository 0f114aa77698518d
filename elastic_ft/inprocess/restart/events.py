"""The worker side's event sink: a rank's (and its monitor process's) events into the run's log in etcd.

Under ``ftrun`` the agent hands its workers an ``ELASTIC_FT_EVENTS``
hand-off (:class:`~elastic_ft.observability.sink.EventsHandoff`). The events
travel over the store's own etcd connection: one the rank opened later
would be taken for the wrapped function's and cut at every restart
(:mod:`elastic_ft.inprocess.delivery.connections`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from elastic_ft.observability import sink as event_sink


def install_store_events(store: dist.Store) -> event_sink.EventSink | None:
    """Install this process's sink on ``store``'s etcd connection; None without a hand-off, an etcd store, or when
    a sink is installed already (the caller then closes nothing)."""
    from elastic_ft.etcd.store import EtcdStore

    handoff = event_sink.EventsHandoff.from_env(os.environ)
    if handoff is None or event_sink.installed() is not None or not isinstance(store, EtcdStore):
        return None
    from elastic_ft.etcd.event_log import EventLog
    from elastic_ft.etcd.kv import RelayUnavailable
    from elastic_ft.keys import RunKeys
    from elastic_ft.observability.events import JobEvent

    log = EventLog(store.client, RunKeys(handoff.etcd_prefix, handoff.run_id), handoff.capacity)
    relay = store.relay

    def append(event: JobEvent, event_id: str) -> int:
        """Through the node's relay (one transaction for the host's events of the moment), else to etcd."""
        if relay is not None:
            try:
                return relay.append_event(event, event_id)
            except RelayUnavailable:
                pass
        return log.append(event, event_id)

    sink = event_sink.EventSink(handoff.run_id, "worker", append, handoff.destination, handoff.node)
    event_sink.install(sink)
    return sink


def install_rank_events(
    store: dist.Store, progress: Callable[[], dict[str, Any] | None]
) -> event_sink.EventSink | None:
    """A rank's events into the run's log (:func:`install_store_events`), with its ``progress`` event sampled from
    ``progress()`` at the hand-off's interval; returns the sink installed (the caller closes it), or None."""
    sink = install_store_events(store)
    interval = progress_interval()
    if sink is not None and interval is not None:
        # Through a node relay, the host's samples of one instant are one transaction.
        sink.sample_progress(progress, interval, aligned=getattr(store, "relay", None) is not None)
    return sink


def progress_interval() -> float | None:
    """Seconds between two ``progress`` samples, from the hand-off; None without one."""
    handoff = event_sink.EventsHandoff.from_env(os.environ)
    return None if handoff is None else handoff.progress_interval


def close_events(sink: event_sink.EventSink | None, timeout: float = 5.0) -> None:
    """Send what ``sink`` still holds (within ``timeout``) and uninstall it."""
    if sink is None:
        return
    sink.close(timeout=timeout)
    if event_sink.installed() is sink:
        event_sink.install(None)
