"""Node health checks before each rendezvous join (``ftrun --node-health-check`` and ft_launcher's flags)."""

from __future__ import annotations

import argparse
import http.server
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.keys import RunKeys
from elastic_ft.launcher.ftrun import build_parser, node_health_checks, parse_args
from elastic_ft.launcher.node_health import (
    HealthRecord,
    HealthSpec,
    NodeHealthChecks,
    NodeHealthSpecError,
    wait_until_healthy,
)
from elastic_ft.launcher.status import collect_status, render_status
from elastic_ft.testing.local_cluster import TorchrunNode
from elastic_ft.untrusted import MalformedRecord


def test_specs_are_parsed_or_refused_with_what_was_expected() -> None:
    assert HealthSpec.parse("exec:nvidia-smi -L").target == "nvidia-smi -L"
    assert HealthSpec.parse("python:my.checks:gpu_ok").kind == "python"
    assert HealthSpec.parse("https://node-health.local/ready").kind == "http"
    for bad in ("exec:", "python:nomodule", "python:mod:not-an-identifier", "/var/run/nvhcd.sock", ""):
        with pytest.raises(NodeHealthSpecError, match="expected exec:COMMAND, python:MODULE:FUNCTION or an http"):
            HealthSpec.parse(bad)


def test_a_python_check_reports_what_it_returns_or_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "site_checks.py").write_text(
        "def ok():\n    return None\n"
        "def two():\n    return ['fan 3 stopped', 'ECC errors']\n"
        "def one():\n    return 'disk full'\n"
        "def raises():\n    raise OSError('no such device')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = lambda name: HealthSpec.parse(f"python:site_checks:{name}").run(1.0)
    assert run("ok") == []
    assert run("two") == ["python:site_checks:two: fan 3 stopped", "python:site_checks:two: ECC errors"]
    assert run("one") == ["python:site_checks:one: disk full"]
    assert run("raises") == ["python:site_checks:raises: OSError: no such device"]
    assert run("missing")[0].startswith("python:site_checks:missing: AttributeError")


@pytest.fixture
def health_service() -> Iterator[tuple[str, dict[str, int]]]:
    """A node health service on loopback answering its ``answer["status"]``."""
    answer = {"status": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"ok" if answer["status"] == 200 else b"GPU 3 XID 79\nmore"
            self.send_response(answer["status"])
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health", answer
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_an_http_service_is_healthy_on_2xx_only(health_service: tuple[str, dict[str, int]]) -> None:
    url, answer = health_service
    spec = HealthSpec.parse(url)
    assert spec.run(5.0) == []
    answer["status"] = 503
    assert spec.run(5.0) == [f"{url}: HTTP 503: GPU 3 XID 79"]
    assert HealthSpec.parse("http://127.0.0.1:9/none").run(2.0)[0].startswith("http://127.0.0.1:9/none: unreachable")


@pytest.mark.integration
def test_a_command_is_healthy_on_exit_status_0(tmp_path: Path) -> None:
    assert HealthSpec.parse("exec:true").run(5.0) == []
    assert HealthSpec.parse("exec:echo checking; echo 'IB port down' >&2; exit 3").run(5.0) == [
        "exec:echo checking; echo 'IB port down' >&2; exit 3: exit status 3: IB port down"
    ]
    assert HealthSpec.parse("exec:sleep 5").run(0.2) == ["exec:sleep 5: no answer within 0.2 s"]


def test_the_node_waits_until_healthy_publishing_each_verdict(caplog: pytest.LogCaptureFixture) -> None:
    verdicts = iter([["NIC mlx5_0/1 is DOWN (was ACTIVE)"], ["NIC mlx5_0/1 is DOWN (was ACTIVE)"], []])

    class Scripted(NodeHealthChecks):
        def problems(self) -> list[str]:
            return next(verdicts)

    published: list[HealthRecord] = []
    slept: list[float] = []
    checks = Scripted(nic=False, period=7.0)
    with caplog.at_level(logging.WARNING, logger="elastic_ft.launcher.node_health"):
        record = wait_until_healthy(checks, published.append, sleep=slept.append, node="n1")
    assert record.healthy and slept == [7.0, 7.0]
    assert [r.healthy for r in published] == [False, False, True]
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "failed its health checks" in m]) == 1  # logged when it changes
    assert "does not join the rendezvous (again in 7 s): NIC mlx5_0/1 is DOWN (was ACTIVE)" in said[0]
    assert said[-1] == "node n1 is healthy again: joining the rendezvous"


def test_publishing_while_etcd_is_away_does_not_stop_the_checks() -> None:
    def away(_: HealthRecord) -> None:
        raise ConnectionError("etcd unreachable")

    assert wait_until_healthy(NodeHealthChecks(nic=False), away, sleep=lambda _: None).healthy


def test_storage_paths_and_bounds_are_checked(tmp_path: Path) -> None:
    checks = NodeHealthChecks(nic=False, storage_paths=[str(tmp_path), str(tmp_path / "gone")])
    assert checks.problems() == [f"storage {tmp_path / 'gone'}: not a directory"]
    with pytest.raises(ValueError, match="period must be > 0 seconds, got 0"):
        NodeHealthChecks(period=0)


def test_health_records_from_etcd_are_checked() -> None:
    record = HealthRecord(False, ("a", "b"), 12.5)
    assert HealthRecord.from_json(record.to_json()) == record
    for raw, reason in (
        (b"[]", "not a JSON object"),
        (b'{"healthy": "no", "problems": [], "checked_at": 1}', "healthy must be true or false"),
        (b'{"healthy": false, "problems": [1], "checked_at": 1}', "problems must be a list of strings"),
        (b'{"healthy": false, "problems": [], "checked_at": true}', "checked_at must be a number"),
    ):
        with pytest.raises(MalformedRecord, match=reason):
            HealthRecord.from_json(raw)


def _args(*argv: str) -> argparse.Namespace:
    args, _ = parse_args(build_parser(), [*argv, "train.py"])  # as ftrun parses its command line
    return args


def test_ftrun_flags_and_ft_launchers_names_build_the_same_checks() -> None:
    ours = node_health_checks(
        _args(
            "--node-health-check=exec:true",
            "--node-health-check=http://h/ready",
            "--no-nic-health-check",
            "--storage-health-check=/data",
            "--storage-health-check=/ckpt",
            "--health-check-period=5",
        )
    )
    nvidia = node_health_checks(
        _args(
            "--node-health-check=exec:true",
            "--ft-node-health-check-endpoint=http://h/ready",
            "--ft-enable-nic-healthcheck=false",
            "--ft-enable-dist-storage-healthcheck=true",
            "--ft-storage-health-check-path=/data,/ckpt",
            "--ft-node-health-check-interval=5",
        )
    )
    assert ours == nvidia
    assert ours.nic is False and ours.period == 5.0 and ours.storage_paths == ["/data", "/ckpt"]
    default = node_health_checks(_args())
    assert default.nic is True and default.specs == [] and default.storage_paths == []  # NIC on, as in ft_launcher
    _, given = parse_args(build_parser(), ["--storage-health-check=/a", "--storage-health-check=/b", "train.py"])
    assert "storage_health_check" in given and "node_health_check" not in given
    off = _args("--ft-enable-dist-storage-healthcheck=false", "--ft-storage-health-check-path=/data")
    assert node_health_checks(off).storage_paths == []
    with pytest.raises(NodeHealthSpecError, match="not NVIDIA's nvhcd gRPC socket"):
        node_health_checks(_args("--ft-node-health-check-endpoint=/var/run/nvhcd.sock"))


def test_bad_flag_values_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in (
        (["--health-check-period=0"], "expected a number of seconds > 0, got '0'"),
        (["--ft-enable-nic-healthcheck=maybe"], "expected true or false, got 'maybe'"),
    ):
        with pytest.raises(SystemExit):
            _args(*argv)
        assert said in capsys.readouterr().err


def test_status_lists_the_unhealthy_nodes(etcd: EtcdServer, run_id: str) -> None:
    keys = RunKeys("/elastic_ft", run_id)
    client = EtcdClient(etcd.endpoints)
    try:
        client.put(keys.health("node-b"), HealthRecord(False, ("NIC eth0 is down (was up)",), time.time()).to_json())
        client.put(keys.health("node-c"), HealthRecord(True, (), time.time()).to_json())
        client.put(keys.health("node-d"), b"forged")
        status = collect_status(client, keys)
    finally:
        client.close()
    assert [(v["node"], v["healthy"]) for v in status["node_health"]] == [("node-b", False), ("node-c", True)]
    assert {"key": keys.health("node-d"), "reason": "not a JSON object"} in status["malformed"]
    shown = render_status(status)
    assert "unhealthy, not joining: node-b" in shown and "NIC eth0 is down (was up)" in shown
    assert "node-c" not in shown.split("malformed")[0]


@pytest.mark.slow
def test_a_node_failing_its_check_does_not_join_until_it_passes(
    etcd: EtcdServer, run_id: str, tmp_path: Path, nodes: list[TorchrunNode]
) -> None:
    """Node B fails its check: node A trains alone; once B's check passes, B joins the running job."""
    from tests.launcher.test_agent import logs, read, start, status_of, wait_for

    healthy = tmp_path / "b-healthy"
    check = f"--node-health-check=exec:test -e {healthy} || {{ echo 'GPU 0 needs a reset'; exit 1; }}"
    # A's first iteration lasts until the restart that admits B's workers, however long B takes to turn
    # healthy, join and start them on a loaded machine; the next one is 5 s.
    scenario = {"steps": 100, "iteration_steps": {"0": 6000}, "step_seconds": 0.05}
    a = start(nodes, tmp_path, etcd, run_id, "A", scenario, nnodes="1:2", extra_args=("--health-check-period=0.5",))
    b = start(
        nodes, tmp_path, etcd, run_id, "B", scenario, nnodes="1:2", extra_args=(check, "--health-check-period=0.5")
    )
    wait_for(tmp_path, "step-*.json", 1, 90)
    deadline = time.monotonic() + 60
    while True:
        status = status_of(etcd, run_id)
        unhealthy = [v for v in status["node_health"] if not v["healthy"]]
        if unhealthy:
            break
        assert time.monotonic() < deadline, logs(nodes)
        time.sleep(0.2)
    (verdict,) = unhealthy
    assert verdict["problems"] == [
        f"exec:test -e {healthy} || {{ echo 'GPU 0 needs a reset'; exit 1; }}: exit status 1: GPU 0 needs a reset"
    ]
    assert len(status["members"]) == 1  # A alone
    assert list((tmp_path / "out").glob("start-B-*.json")) == []
    assert "does not join the rendezvous" in b.log()
    healthy.touch()
    wait_for(tmp_path, "start-B-*.json", 2, 90)  # B joined the running job once healthy
    assert a.wait(150) == 0, logs(nodes)
    assert b.wait(60) == 0, logs(nodes)
    assert "is healthy again: joining the rendezvous" in b.log()
    done = read(tmp_path, "done-*.json")
    assert sorted(r["initial_rank"] for r in done.values()) == [0, 1, 2, 3]
    assert {r["result"]["world_size"] for r in done.values()} == {4}, done  # B's workers trained with A's
