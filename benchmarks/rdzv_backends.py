"""Make rendezvous handlers of each compared backend with equal settings.

Shared by ``rendezvous.py`` and the node it runs in a subprocess (the member
it kills), so both sides build handlers the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

BACKENDS = ("etcdft", "c10d", "etcd-v2")


@dataclass(frozen=True)
class Setting:
    """Equal settings for every backend.

    ``liveness`` bounds how long a dead node is still counted: etcdft's
    ``lease_ttl``; for torch's dynamic rendezvous (``c10d`` and ``etcd-v2``)
    ``keep_alive_interval=1, keep_alive_max_attempt=liveness``.  torch's
    backends cannot run with a bound of 1 s (with one attempt, live
    participants are dropped between heartbeats), so 2 s is the smallest
    setting compared across all three.  ``None`` keeps each backend's default
    (etcdft: 10 s lease; torch: 5 s x 3 heartbeats), which is what the join
    benchmark uses: 1 s heartbeats from 64 nodes in one process starve torch's
    backends.
    """

    min_nodes: int
    max_nodes: int
    last_call_timeout: float
    join_timeout: float
    liveness: int | None


def make_handler(backend: str, endpoint: str, run_id: str, setting: Setting) -> RendezvousHandler:
    common: dict[str, object] = {
        "last_call_timeout": setting.last_call_timeout,
        "join_timeout": setting.join_timeout,
    }
    if backend == "etcdft":
        if setting.liveness is not None:
            common["lease_ttl"] = setting.liveness
        from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings

        return EtcdftRendezvousHandler(
            make_settings(
                run_id=run_id,
                endpoint=endpoint,
                min_nodes=setting.min_nodes,
                max_nodes=setting.max_nodes,
                local_addr="127.0.0.1",
                **common,
            )
        )
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    if setting.liveness is not None:
        common.update(keep_alive_interval=1, keep_alive_max_attempt=setting.liveness)
    params = RendezvousParameters(
        backend,
        endpoint,
        run_id,
        setting.min_nodes,
        setting.max_nodes,
        local_addr="127.0.0.1",
        is_host=False,
        **common,
    )
    if backend == "c10d":
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

        store_backend, store = c10d_rendezvous_backend.create_backend(params)
    elif backend == "etcd-v2":
        from torch.distributed.elastic.rendezvous import etcd_rendezvous_backend

        store_backend, store = etcd_rendezvous_backend.create_backend(params)
    else:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    return dynamic_rendezvous.create_handler(store, store_backend, params)
