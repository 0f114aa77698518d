"""etcd authentication (RBAC): a user limited to its run's prefix works, others are refused, no secret leaks."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from elastic_ft.etcd.server import EtcdServer
from elastic_ft.handoff import STORE_ENV, StoreHandoff
from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings
from elastic_ft.rendezvous.config import RendezvousConfigError
from elastic_ft.testing.etcd_auth import enable_auth

PASSWORD = "s3cret-Pa55word-do-not-leak"


@pytest.fixture(scope="module")
def auth_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EtcdServer, Path]]:
    """etcd with auth on: alice may use run 'alice-run' only; tokens expire after 2 idle seconds."""
    password_file = tmp_path_factory.mktemp("secrets") / "alice.password"
    password_file.write_text(PASSWORD + "\n")
    os.chmod(password_file, 0o600)
    with EtcdServer(auth_token_ttl=2) as server:
        enable_auth(server, "root-password", {"alice": (PASSWORD, ["/elastic_ft/alice-run/"])})
        yield server, password_file


def _handler(server: EtcdServer, run_id: str, password_file: Path, **conf: object) -> EtcdftRendezvousHandler:
    settings = make_settings(
        run_id=run_id,
        endpoint=server.endpoint,
        min_nodes=2,
        max_nodes=2,
        local_addr="127.0.0.1",
        user="alice",
        password_file=str(password_file),
        last_call_timeout=0.3,
        lease_ttl=2,
        connect_timeout=2,
        request_timeout=1,
        **conf,
    )
    return EtcdftRendezvousHandler(settings)


@pytest.mark.integration
def test_a_user_limited_to_its_run_completes_the_rendezvous_and_uses_the_store(
    auth_etcd: tuple[EtcdServer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    server, password_file = auth_etcd
    caplog.set_level(logging.DEBUG)
    handlers = [_handler(server, "alice-run", password_file) for _ in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            infos = [f.result(30) for f in [pool.submit(h.next_rendezvous) for h in handlers]]
        assert sorted(i.rank for i in infos) == [0, 1]
        infos[0].store.set("k", "v")
        assert infos[1].store.get("k") == b"v"
        assert infos[0].store.add("n", 2) == 2
        time.sleep(3)  # beyond --auth-token-ttl: the next requests must authenticate again, unseen
        assert infos[1].store.add("n", 1) == 3
        # The worker hand-off carries the password file's path, never the password.
        handoff = StoreHandoff(
            tuple(server.endpoints),
            handlers[0].round_store_prefix(0),
            handlers[0].settings.tls,
            2.0,
            1.0,
            10.0,
            handlers[0].settings.credentials,
        )
        environment = handoff.to_env()
        assert PASSWORD not in environment[STORE_ENV] and str(password_file) in environment[STORE_ENV]
        assert StoreHandoff.from_env(environment) == handoff
        status = subprocess.run(
            [
                sys.executable,
                "-m",
                "elastic_ft.launcher.cli",
                "status",
                "--json",
                f"--rdzv-endpoint={server.endpoint}",
                "--rdzv-id=alice-run",
                "--user=alice",
                f"--password-file={password_file}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["round"] == 0
        assert PASSWORD not in status.stdout + status.stderr
    finally:
        for handler in handlers:
            handler.shutdown()
    assert PASSWORD not in caplog.text and all(PASSWORD not in repr(h.settings) for h in handlers)


def test_a_run_outside_the_users_prefix_is_refused_clearly(auth_etcd: tuple[EtcdServer, Path]) -> None:
    server, password_file = auth_etcd
    with pytest.raises(RendezvousConnectionError, match="permission denied for user 'alice'") as raised:
        _handler(server, "bob-run", password_file)
    assert PASSWORD not in str(raised.value)


def test_a_wrong_password_is_refused_clearly(auth_etcd: tuple[EtcdServer, Path], tmp_path: Path) -> None:
    server, _ = auth_etcd
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")
    with pytest.raises(RendezvousConnectionError, match="etcd refused user 'alice'.*password_file") as raised:
        _handler(server, "alice-run", wrong)
    assert "not-the-password" not in str(raised.value)


def test_a_client_without_credentials_is_refused(auth_etcd: tuple[EtcdServer, Path]) -> None:
    server, _ = auth_etcd
    settings = make_settings(
        run_id="alice-run", endpoint=server.endpoint, min_nodes=1, max_nodes=1, connect_timeout=1, request_timeout=1
    )
    with pytest.raises(RendezvousConnectionError, match="user name is empty|permission denied for a client without"):
        EtcdftRendezvousHandler(settings)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"user": "alice"}, "user and password_file go together"),
        ({"user": "alice", "password_file": "/no/such/file"}, "password_file '/no/such/file' cannot be read"),
        ({"user": "a b", "password_file": __file__}, "etcd user 'a b' is invalid"),
    ],
)
def test_bad_credentials_settings_fail_before_any_request(conf: dict[str, str], message: str) -> None:
    with pytest.raises(RendezvousConfigError, match=message):
        make_settings(run_id="r", endpoint="192.0.2.1:1", min_nodes=1, max_nodes=1, **conf)


def test_an_expired_token_is_renewed_transparently(auth_etcd: tuple[EtcdServer, Path]) -> None:
    from elastic_ft.etcd.client import EtcdClient
    from elastic_ft.etcd.endpoints import EtcdCredentials

    server, password_file = auth_etcd
    client = EtcdClient(server.endpoints, credentials=EtcdCredentials("alice", str(password_file)))
    try:
        client.put("/elastic_ft/alice-run/token-test", b"1")
        time.sleep(3)  # the token is idle beyond --auth-token-ttl=2: etcd forgets it
        client.put("/elastic_ft/alice-run/token-test", b"2")
        assert client.requests_by_kind["put"] == 3  # the second put was refused once, then sent with a new token
        assert client.get("/elastic_ft/alice-run/token-test")[0].value == b"2"
    finally:
        client.close()
