"""Malformed or forged values under a run's prefix are skipped and reported, never fatal.

Anyone with write access to etcd, or one corrupt write, must not be able to
stop a job: the rendezvous state parser, a running node's watch, a new
node's handler and ``elastic-ft status`` all read such values.
"""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.keys import FTRUN_EXITS, FTRUN_NODES, POSITION, WRAPPER_JOB, RunKeys
from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings
from elastic_ft.rendezvous.model import RawKey, parse_key, parse_state

HOSTILE = [
    b"not json",
    b"[]",
    b"null",
    b"[" * 100_000,  # nesting beyond the parser's stack
    b"9" * 5000,  # an integer beyond int()'s digit limit
    b'{"addr": "h", "port": 1e400}',
    b'{"addr": "h", "port": 99999}',
    b'{"addr": "h", "port": true}',
    b'{"addr": "", "port": 80}',
    b'{"port": 80}',
]
HOSTILE_RESULTS = [
    *HOSTILE,
    b'{"round": 1e400, "members": [{"node": "a", "lease": 1}], "master_addr": "h", "master_port": 1}',
    b'{"round": 3, "members": [{"node": "a", "lease": 1}], "master_addr": "h", "master_port": 1}',  # not round 0
    b'{"round": 0, "members": [], "master_addr": "h", "master_port": 1}',
    json.dumps({"round": 0, "members": [{"node": "a", "lease": 1}] * 2, "master_addr": "h", "master_port": 1}).encode(),
    b'{"round": 0, "members": [{"node": "a", "lease": -1}], "master_addr": "h", "master_port": 1}',
    b'{"round": 0, "members": ["a"], "master_addr": "h", "master_port": 1}',
]


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_a_malformed_join_is_left_out_and_named(value: bytes) -> None:
    state = parse_state({"round/0/join/n1": RawKey(value, 1, 5)})
    assert state.round(0).joins == {}
    assert list(state.malformed) == ["round/0/join/n1"]


@pytest.mark.parametrize("value", HOSTILE_RESULTS, ids=range(len(HOSTILE_RESULTS)))
def test_a_malformed_result_is_left_out_and_named(value: bytes) -> None:
    fact = parse_key("round/0/result", RawKey(value, 0, 5))
    assert fact is not None and fact.kind == "malformed" and fact.reason
    assert parse_state({"round/0/result": RawKey(value, 0, 5)}).last_closed is None


def _settings(etcd: EtcdServer, run_id: str) -> dict:
    return {
        "run_id": run_id,
        "endpoint": etcd.endpoint,
        "local_addr": "127.0.0.1",
        "min_nodes": 2,
        "max_nodes": 2,
        "last_call_timeout": 0.3,
        "lease_ttl": 2,
        "join_timeout": 30,
    }


def test_running_and_new_nodes_survive_malformed_keys(etcd: EtcdServer, etcd_client: EtcdClient, run_id: str) -> None:
    keys = RunKeys("/elastic_ft", run_id)
    for index, value in enumerate(HOSTILE):  # written before any node starts: the new nodes' first listing
        etcd_client.put(keys.join(0, f"forged{index}"), value)
    handlers = [EtcdftRendezvousHandler(make_settings(**_settings(etcd, run_id))) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = [f.result(30) for f in [pool.submit(h.next_rendezvous) for h in handlers]]
        assert sorted(i.rank for i in infos) == [0, 1]
        # Now while they run: garbage in the next round and a forged result; their watches must go on.
        etcd_client.put(keys.join(1, "forged"), b"[" * 100_000)
        etcd_client.put(keys.result(5), b'{"round": 1e400}')
        time.sleep(0.5)
        assert all(h._parts.whole.disconnected_for() == 0 for h in handlers)
        assert handlers[0].num_nodes_waiting() == 0
        handlers[0].set_closed()
        deadline = time.monotonic() + 5
        while not handlers[1].is_closed() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handlers[1].is_closed()  # a later valid change still reaches the other node
        state, _ = handlers[1]._parts.whole.snapshot()
        assert "round/1/join/forged" in state.malformed and "round/5/result" in state.malformed
    finally:
        for handler in handlers:
            handler.shutdown()


def test_status_lists_malformed_records_instead_of_failing(
    etcd: EtcdServer, etcd_client: EtcdClient, run_id: str
) -> None:
    keys = RunKeys("/elastic_ft", run_id)
    handlers = [EtcdftRendezvousHandler(make_settings(**_settings(etcd, run_id))) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            [f.result(30) for f in [pool.submit(h.next_rendezvous) for h in handlers]]
        store = keys.round_store(0)
        forged = {
            keys.config: b'{"nodes": {"min": 1e400}}',
            keys.alive("ghost"): b"[1, 2]",
            keys.join(1, "ghost"): b'{"addr": 7}',
            keys.escalation(3): b'{"node": "n", "reason": "r", "time": 1e400}',
            store + FTRUN_NODES + "n1": json.dumps(
                {"host": "h", "group_rank": 0, "round": 0, "global_ranks": [0, 1], "pids": [5], "world_size": 2}
            ).encode(),
            store + FTRUN_EXITS + "0": b"{",
            f"{store}{WRAPPER_JOB}/{POSITION}0": b'{"iteration": "x", "rank": 0}',
        }
        for key, value in forged.items():
            etcd_client.put(key, value)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "elastic_ft.launcher.cli",
                "status",
                "--json",
                f"--rdzv-endpoint={etcd.endpoint}",
                f"--rdzv-id={run_id}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr
        status = json.loads(done.stdout)
        assert {entry["key"] for entry in status["malformed"]} == set(forged)
        assert status["round"] == 0 and len(status["members"]) == 2 and status["config"] is None
        table = subprocess.run(
            [
                sys.executable,
                "-m",
                "elastic_ft.launcher.cli",
                "status",
                f"--rdzv-endpoint={etcd.endpoint}",
                f"--rdzv-id={run_id}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert table.returncode == 0 and "Traceback" not in table.stderr
        assert table.stdout.count("malformed, ignored:") == len(forged)
    finally:
        for handler in handlers:
            handler.shutdown()


def test_worker_side_readers_skip_malformed_records() -> None:
    """The Wrapper's position, left and termination records, and the rank-assignment table, read back forged."""
    import datetime

    import torch.distributed as dist

    from elastic_ft.coordination.job import job_store
    from elastic_ft.inprocess.rank_assignment.exchange import gather_keys
    from elastic_ft.inprocess.restart.call import _termination_result
    from elastic_ft.keys import LEFT, exchange_table

    store = dist.HashStore()
    job = job_store(store)
    job.store.set(f"{POSITION}0", '{"iteration": "x", "rank": 0, "world_size": 2}')
    job.store.set(f"{POSITION}1", "[" * 100_000)
    job.store.set(f"{LEFT}1", "not json")
    assert job.position(0) is None and job.position(1) is None
    assert job.left(1) == {"kind": "malformed"}  # it did leave; how is unknown

    def terminated(payload: str, world_size: int = 4) -> tuple[int, ...]:
        return _termination_result(payload, world_size).terminated

    assert terminated('{"world_size": 4, "terminated": [0, 1e400, "a"], "joined": []}') == ()
    assert terminated('{"world_size": 4, "terminated": [3, 1], "joined": []}') == (1, 3)
    assert terminated('{"world_size": 4, "terminated": [7], "joined": []}') == ()  # not a rank of this world
    assert terminated('{"world_size": 5, "terminated": [1], "joined": []}') == ()  # another world
    assert _termination_result('{"world_size": 4, "terminated": [], "joined": [9, 9]}', 4).joined == ()
    assert _termination_result('{"world_size": 4, "terminated": [], "joined": [true]}', 4).joined == ()
    job.store.set(f"{POSITION}2", '{"iteration": 1, "rank": 0, "world_size": 2, "active": "yes"}')
    assert job.position(2) is None
    one_index_5 = base64.b64encode(struct.pack("<2I", 0, 5)).decode()  # an index beyond the distinct keys
    forged = [
        zlib.compress(json.dumps({"distinct": [["a"]], "codes": [one_index_5]}).encode()),
        zlib.compress(json.dumps({"distinct": [["a"]], "codes": ["AAAA"]}).encode()),  # indices for 0.75 ranks
        zlib.compress(json.dumps({"distinct": [[1]], "codes": [base64.b64encode(bytes(8)).decode()]}).encode()),
        zlib.compress(json.dumps({"distinct": [["a"]], "codes": ["not base64!"]}).encode()),
        zlib.compress(b"[" * 100_000),
        zlib.compress(b"\0" * (300 * 2**20)),  # inflates past any real table
        b'{"distinct": [["a"]], "codes": [[0, 0]]}',  # not compressed
    ]
    for i, table in enumerate(forged):  # rank 0 of 2 reads each (one exchange each: rank 1 never comes)
        store.set(exchange_table(f"x{i}"), table)
        with pytest.raises(ValueError, match="is malformed"):
            gather_keys(store, f"x{i}", 0, [0, 1], ["k"], datetime.timedelta(seconds=1), "test")
    store.set(exchange_table("error"), zlib.compress(b'{"error": "one rank published 3 keys"}'))
    with pytest.raises(ValueError, match="test: one rank published 3 keys"):
        gather_keys(store, "error", 0, [0, 1], ["k"], datetime.timedelta(seconds=1), "test")
