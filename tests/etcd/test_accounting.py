"""Who asks etcd: requests counted by the source their caller names, or their thread's, against a real etcd."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from elastic_ft.etcd import accounting
from elastic_ft.etcd.accounting import ACCOUNTS_DIR_ENV, on_behalf_of
from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.etcd.session import Session


def test_a_request_counts_under_the_named_source_or_its_threads_name(etcd: EtcdServer, run_id: str) -> None:
    client = EtcdClient(etcd.endpoints)
    key = f"/elastic_ft/{run_id}/k"
    with on_behalf_of("heartbeat"):
        client.put(key, b"1")
        with on_behalf_of("ring check"):
            client.get(key)
        client.put(key, b"2")  # the outer source again
    worker = threading.Thread(target=client.get, args=(key,), name="a-named-thread")
    worker.start()
    worker.join()
    assert client.requests_by_source == {
        ("heartbeat", "put"): 2,
        ("ring check", "range"): 1,
        ("a-named-thread", "range"): 1,
    }
    assert sum(client.requests_by_source.values()) == client.requests == 4
    client.close()


def test_a_leases_renewals_count_as_stream_messages_of_its_session_thread(etcd: EtcdServer) -> None:
    client = EtcdClient(etcd.endpoints)
    session = Session(client, ttl=1)
    time.sleep(1.5)  # a renewal every third of the TTL
    renewals = client.requests_by_source[("etcd-session", "keep_alive_message")]
    assert renewals >= 2, client.requests_by_source
    assert client.requests_by_kind["keep_alive"] == 1  # one stream: the renewals are not requests
    session.close(revoke=True)
    client.close()


def test_with_a_directory_each_process_writes_its_running_totals(
    etcd: EtcdServer, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ACCOUNTS_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(accounting, "_role", "test role")
    client = EtcdClient(etcd.endpoints)
    with on_behalf_of("peer look"):
        for _ in range(3):
            client.get(f"/elastic_ft/{run_id}/k")
    deadline = time.monotonic() + 10
    records: list[dict] = []
    while time.monotonic() < deadline:
        files = list(tmp_path.glob("test_role-*.jsonl"))
        records = [json.loads(line) for path in files for line in path.read_text().splitlines()]
        if any(record["counts"].get("peer look/range", 0) >= 3 for record in records):
            break
        time.sleep(0.1)
    assert records and records[-1]["role"] == "test role", records
    assert records[-1]["counts"]["peer look/range"] == 3, records[-1]
    assert [record["t"] for record in records] == sorted(record["t"] for record in records)
    client.close()


def test_a_directory_that_cannot_be_written_is_named_in_one_warning(
    etcd: EtcdServer, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "no-such-directory"
    monkeypatch.setenv(ACCOUNTS_DIR_ENV, str(missing))
    client = EtcdClient(etcd.endpoints)
    client.get(f"/elastic_ft/{run_id}/k")  # the client works on
    deadline = time.monotonic() + 10
    while "cannot write" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"{ACCOUNTS_DIR_ENV}={missing}: cannot write" in caplog.text
    assert caplog.text.count("cannot write") == 1 and not missing.exists()
    client.close()
