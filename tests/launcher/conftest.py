"""Fixtures the launcher's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings


@pytest.fixture
def handler_pair(etcd: EtcdServer, run_id: str) -> Iterator[list[EtcdftRendezvousHandler]]:
    """Two nodes' rendezvous handlers of one job (``min_nodes=max_nodes=2``), not yet in a round.

    A long lease TTL: a revoked lease's proof still runs for seconds when its node holds its new one."""
    conf = {"last_call_timeout": 0.5, "lease_ttl": 10, "join_timeout": 30}
    made = [
        EtcdftRendezvousHandler(
            make_settings(
                run_id=run_id, endpoint=etcd.endpoint, min_nodes=2, max_nodes=2, local_addr="127.0.0.1", **conf
            )
        )
        for _ in range(2)
    ]
    yield made
    for handler in made:
        handler.shutdown()
