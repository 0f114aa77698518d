"""The coordination store of the in-process restart Wrapper: which store, and who hosts it.

Ranks coordinate only through a ``torch.distributed.Store``; the protocol
(barriers, the iteration's and the job's records) is
:mod:`elastic_ft.coordination`, shared with ``ftrun``'s agent. The Wrapper
gets its store from ``store_factory(**store_kwargs)``; any ``Store`` with
TCPStore's semantics works (``set``, ``get``, ``add``, ``append``,
``compare_set``, ``check``), for example
:class:`elastic_ft.etcd.store.EtcdStore`, so that no single rank has to host
the job's coordination. The default outside ``ftrun``, :class:`TCPStore`,
is hosted by the process of initial rank 0, which therefore must outlive
the job; under ``ftrun`` it is the etcd store of the current rendezvous
round, described in the environment (:class:`elastic_ft.handoff.StoreHandoff`).

:class:`StoreMixin` (NVIDIA's name) puts the whole protocol on a store of
one's own, as :class:`TCPStore` and :class:`FileStore` have it.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any, cast

import torch.distributed as dist

from elastic_ft.coordination.errors import BarrierError, BarrierOverflow, BarrierTimeout
from elastic_ft.coordination.iteration import IterationRecords
from elastic_ft.coordination.job import JobRecords
from elastic_ft.handoff import StoreHandoff
from elastic_ft.inprocess.restart.logs import get_logger

log = get_logger("store")


class StoreMixin:
    """NVIDIA's name for a store that speaks the Wrapper's whole protocol: mix it into any
    ``torch.distributed.Store`` subclass.

    The protocol is composed, not inherited: the iteration's records
    (:class:`~elastic_ft.coordination.iteration.IterationRecords`, with no
    iteration: the store is used without views) and the job's
    (:class:`~elastic_ft.coordination.job.JobRecords`) each take this store,
    and a protocol method asked of it is theirs (``store.arrive_and_wait``,
    ``store.record_interruption``, ``store.liveness.send_heartbeat``). The
    Wrapper itself uses the two views of :mod:`elastic_ft.coordination`, on
    whatever store ``store_factory`` returns. ``critical_ranks`` lists the
    initial ranks whose process must stay alive until every rank has left
    the Wrapper (the ranks hosting the store).
    """

    @property
    def critical_ranks(self) -> tuple[int, ...]:
        return ()

    def __getattr__(self, name: str) -> Any:
        # Only names this class and the store lack come here. The records are made anew for each (they are two
        # small objects): kept on the store, they would name it back, a cycle that keeps its socket open until
        # a garbage collection.
        store = cast(dist.Store, self)
        if name in _ITERATION_NAMES:
            return getattr(IterationRecords(store, None), name)
        if name in _JOB_NAMES:
            return getattr(JobRecords(store), name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


#: The protocol's names a :class:`StoreMixin` answers: the records' methods, and their barriers and liveness parts.
_ITERATION_NAMES = frozenset(name for name in dir(IterationRecords) if not name.startswith("_")) | {"barriers"}
_JOB_NAMES = frozenset(name for name in dir(JobRecords) if not name.startswith("_")) | {"barriers", "liveness"}


class PrefixStore(dist.PrefixStore, StoreMixin):
    """A namespaced view of another store, with the whole protocol (the Wrapper itself uses the two views
    of :mod:`elastic_ft.coordination`: job-wide and per iteration)."""

    def __init__(self, prefix: str, store: dist.Store) -> None:
        super().__init__(prefix, store)
        #: torch's view keeps its prefix to itself; the barriers need it to count arrivals in the base store.
        self.key_prefix = prefix


#: The keywords of :class:`TCPStore` that say where it listens and who hosts it. Under ``ftrun`` the round's etcd
#: store takes the TCPStore's place, so they have nothing left to configure.
TCPSTORE_PLACEMENT = frozenset(
    {
        "host_name",
        "port",
        "world_size",
        "is_master",
        "host_rank",
        "wait_for_workers",
        "multi_tenant",
        "master_listen_fd",
        "use_libuv",
    }
)


def default_store(**kwargs: Any) -> dist.Store:
    """The Wrapper's default ``store_factory``.

    Under ``ftrun`` (a :class:`~elastic_ft.handoff.StoreHandoff` in the
    environment), the etcd store of the current rendezvous round, which no
    rank hosts: the job survives the loss of any process, and the agent
    reads the Wrapper's records there. Its barrier arrivals and waits go
    through the node's relay when the agent runs one
    (:mod:`elastic_ft.etcd.node_relay`), so a barrier costs etcd per node. ``timeout`` applies; the keywords that
    place a TCPStore (``port``, ``host_name``, ...: NVIDIA's examples pass
    ``store_kwargs={'port': MASTER_PORT + 1}``) are accepted and ignored, with
    one log line. Otherwise a :class:`TCPStore` hosted by initial rank 0, with
    ``kwargs``.
    """
    handoff = StoreHandoff.from_env(os.environ)
    if handoff is not None:
        unknown = set(kwargs) - TCPSTORE_PLACEMENT - {"timeout"}
        if unknown:
            raise TypeError(
                f"default_store() got unexpected keyword(s) {sorted(unknown)}; expected timeout or TCPStore's "
                f"{sorted(TCPSTORE_PLACEMENT)}"
            )
        ignored = sorted(set(kwargs) & TCPSTORE_PLACEMENT)
        if ignored:
            log.info(
                "store_kwargs %s place a TCPStore; under ftrun the Wrapper uses the round's etcd store instead (no "
                "rank hosts it, and the agent reads the Wrapper's records there)",
                {name: kwargs[name] for name in ignored},
            )
        from elastic_ft.etcd.client import client_for
        from elastic_ft.etcd.node_relay import relay_from_env
        from elastic_ft.etcd.store import EtcdStore

        client = client_for(handoff)
        timeout = kwargs.get("timeout") or datetime.timedelta(seconds=handoff.timeout)
        return EtcdStore(client, handoff.prefix, timeout, relay=relay_from_env(os.environ))
    return TCPStore(**kwargs)


def close_store(store: dist.Store) -> None:
    """Close what a store the Wrapper made holds open, once its call is over: an etcd store's etcd connection
    (gRPC's channel thread and a watch stream's reader) and its node relay connection.

    Left open, gRPC's threads run into the interpreter's exit, where they can crash the process as it exits
    (grpc/grpc#11804). Any other store (a TCPStore, a FileStore) is left to its destructor.
    """
    etcd_store = sys.modules.get("elastic_ft.etcd.store")  # not imported: no etcd store was made
    if etcd_store is not None and isinstance(store, etcd_store.EtcdStore):
        store.client.close()
        if store.relay is not None:
            store.relay.close()


_hosting_forbidden = False


def forbid_hosting() -> None:
    """Make :class:`TCPStore` connect as a client only: for processes that must not host it."""
    global _hosting_forbidden
    _hosting_forbidden = True


class TCPStore(dist.TCPStore, StoreMixin):
    """The default ``store_factory``: a TCPStore hosted by the process of initial rank ``host_rank``.

    Args:
        host_name: host of the store; default ``MASTER_ADDR``.
        port: port of the store; default ``MASTER_PORT + 1``, leaving
            ``MASTER_PORT`` to the wrapped function's own
            ``init_process_group``.
        world_size: the number of processes that connect, or ``None``
            (unknown: the host does not wait for them).
        timeout: timeout of the store's own blocking operations.
        wait_for_workers: with ``world_size``, the host waits in the
            constructor until every process connected.
        multi_tenant: share one server among the stores of a process on the
            same port.
        use_libuv: use TCPStore's libuv server.
        host_rank: the initial ``RANK`` whose process hosts the store.
    """

    #: The initial rank that hosts the store by default.
    TCP_STORE_HOST_RANK = 0

    def __init__(
        self,
        host_name: str | None = None,
        port: int | None = None,
        world_size: int | None = None,
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        use_libuv: bool = True,
        host_rank: int = TCP_STORE_HOST_RANK,
    ) -> None:
        self.host_rank = host_rank
        hosts = int(os.environ["RANK"]) == host_rank and not _hosting_forbidden
        super().__init__(
            host_name if host_name is not None else os.environ["MASTER_ADDR"],
            port if port is not None else int(os.environ["MASTER_PORT"]) + 1,
            world_size,
            hosts,
            timeout,
            wait_for_workers=wait_for_workers,
            multi_tenant=multi_tenant,
            use_libuv=use_libuv,
        )

    @property
    def critical_ranks(self) -> tuple[int, ...]:
        return (self.host_rank,)


class FileStore(dist.FileStore, StoreMixin):
    """A ``store_factory`` for ranks of one host, or hosts sharing a file system: a ``torch.distributed.FileStore``.

    Args:
        file_name: the store's file, the same path on every rank.
        world_size: the number of processes that use it; ``-1``: unknown.
    """

    def __init__(self, file_name: str, world_size: int = -1) -> None:
        super().__init__(file_name, world_size)


__all__ = [
    "BarrierError",
    "BarrierOverflow",
    "BarrierTimeout",
    "FileStore",
    "PrefixStore",
    "StoreMixin",
    "TCPStore",
    "default_store",
]
