"""``elastic-ft config`` and ``elastic-ft status`` against a real etcd."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.inprocess.rank_assignment import LayerFlag, Tree
from elastic_ft.inprocess.rank_assignment.from_config import policy_from_config
from elastic_ft.job_config import JobConfigError, load_job_config, parse_job_config
from elastic_ft.rendezvous import EtcdftRendezvousHandler, make_settings
from elastic_ft.runtime.net import free_port

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
CLI = [sys.executable, "-m", "elastic_ft.launcher.cli"]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], check=False, capture_output=True, text=True, timeout=60)


@pytest.mark.integration
@pytest.mark.parametrize("name", ["job.yaml", "single-host.yaml"])
def test_example_configs_are_valid_and_round_trip(name: str) -> None:
    config = load_job_config((CONFIGS / name).read_text())
    assert parse_job_config(config.to_document()) == config
    done = cli("config", "validate", str(CONFIGS / name))
    assert done.returncode == 0 and "valid" in done.stdout


def test_config_builds_the_rank_assignment_policy() -> None:
    policy = policy_from_config(load_job_config((CONFIGS / "job.yaml").read_text()))
    assert isinstance(policy, Tree)
    assert [layer.flag for layer in policy.layers] == [LayerFlag.RESERVE, LayerFlag.RESERVE | LayerFlag.BACKFILL]
    assert [(layer.min_ranks, layer.max_ranks) for layer in policy.layers] == [(8, None), (1, 8)]
    assert policy.world_size_filter is not None and policy.world_size_filter(30) == 24


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nodes: [1, 2", "not valid YAML"),
        ("- just a list", r"\(top level\)=\['just a list'\] is invalid; expected a mapping"),
        ("nodez: {}", "unknown field.*'nodez'"),
        ("nodes: {min: 3, max: 2}", "nodes.min=3 exceeds nodes.max=2"),
        ("nodes: {min: 0}", r"nodes.min=0 is invalid; expected an integer from 1 to 1000000"),
        ("nodes: {max: 1000000000000000000000}", r"nodes.max=1000000000000000000000 is invalid"),
        ("nproc_per_node: 1000000000000000000000", r"nproc_per_node=1000000000000000000000 is invalid"),
        ("wrapper: {soft_timeout: 1.0e+300}", r"wrapper.soft_timeout=1e\+300 is invalid; expected .* <= 2592000"),
        ("rendezvous: {lease_ttl: 1.0e+300}", r"rendezvous.lease_ttl=1e\+300 is invalid"),
        # billion laughs: 487 bytes that expand to 10^9 strings
        (
            "a: &a [x,x,x,x,x,x,x,x,x,x]\n"
            + "".join(
                f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
                for p, c in zip("abcdefgh", "bcdefghi", strict=True)
            ),
            "expands to more than 10000 YAML nodes",
        ),
        ("x: " + "[" * 100 + "]" * 100, "nests deeper than 32 levels"),
        ("x: [" + "1," * 200_000 + "1]", "larger than 262144 bytes"),
        ("nproc_per_node: two", "nproc_per_node='two' is invalid"),
        ("rendezvous: {lease_ttl: 1.5}", "rendezvous.lease_ttl=1.5 is invalid; expected whole seconds"),
        ("rendezvous: {join_timeout: -1}", r"rendezvous.join_timeout=-1 is invalid; expected seconds > 0"),
        ("wrapper: {soft_timeout: 90, hard_timeout: 60}", "wrapper.soft_timeout=90 must be less than"),
        ("wrapper: {soft_timeout: 100}", r"less than wrapper.hard_timeout=90 \(the Wrapper's default\)"),
        ("wrapper: {soft_timout: 1}", "unknown field.*'soft_timout'"),
        ("rank_assignment: {tree: [{key: host}]}", r"tree\[0\].key='host' is invalid; expected 'job'"),
        ("rank_assignment: {tree: [{key: job, flags: [SPARE]}]}", r"tree\[0\].flags=\['SPARE'\] is invalid"),
        ("rank_assignment: {tree: [{key: job, min_ranks: 4, max_ranks: 2}]}", "min_ranks=4 exceeds"),
        ("rank_assignment: {active_world_size_divisible_by: 0}", "divisible_by=0 is invalid"),
        ("nodes: {spares: -1}", r"nodes.spares=-1 is invalid; expected an integer from 0"),
        ("respawn: {per_rank: -1}", r"respawn.per_rank=-1 is invalid; expected an integer from 0"),
        ("respawn: {per_job: many}", r"respawn.per_job='many' is invalid"),
        ("respawn: {per_node: 1}", "unknown field.*'per_node'"),
        ("respawn: {rejoin: later}", r"respawn.rejoin='later' is invalid; expected 'next_fault' or 'at_once'"),
    ],
)
def test_invalid_configs_name_the_field(text: str, message: str) -> None:
    with pytest.raises(JobConfigError, match=message):
        load_job_config(text)


def test_put_get_round_trip(etcd: EtcdServer, run_id: str) -> None:
    put = cli("config", "put", str(CONFIGS / "job.yaml"), f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}")
    assert put.returncode == 0, put.stderr
    got = cli("config", "get", "--json", f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout) == load_job_config((CONFIGS / "job.yaml").read_text()).to_document()
    as_yaml = cli("config", "get", f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}")
    assert load_job_config(as_yaml.stdout) == load_job_config((CONFIGS / "job.yaml").read_text())


def test_invalid_put_writes_nothing(etcd: EtcdServer, run_id: str, tmp_path: Path, etcd_client: EtcdClient) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: {min: 5, max: 2}\n")
    done = cli("config", "put", str(bad), f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}")
    assert done.returncode == 2 and "nodes.min=5 exceeds nodes.max=2" in done.stderr
    assert etcd_client.get_prefix(f"/elastic_ft/{run_id}/")[0] == []
    missing = cli("config", "get", f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}")
    assert missing.returncode == 1 and "no job config stored" in missing.stderr


@pytest.mark.integration
def test_unreachable_etcd_is_a_bounded_error(run_id: str) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    done = cli("status", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", "--connect-timeout=1")
    assert done.returncode == 3 and endpoint in done.stderr
    assert time.monotonic() - start < 20


def test_status_shows_round_members_and_waiting_nodes(etcd: EtcdServer, run_id: str) -> None:
    put = cli("config", "put", str(CONFIGS / "job.yaml"), f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}")
    assert put.returncode == 0, put.stderr
    handlers = [
        EtcdftRendezvousHandler(
            make_settings(run_id=run_id, endpoint=etcd.endpoint, min_nodes=2, max_nodes=2, local_addr="127.0.0.1")
        )
        for _ in range(3)
    ]
    with ThreadPoolExecutor(3) as pool:
        infos = [f.result(30) for f in [pool.submit(h.next_rendezvous) for h in handlers[:2]]]
        late = pool.submit(handlers[2].next_rendezvous)
        time.sleep(0.5)
        done = cli("status", "--json", f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}")
        assert done.returncode == 0, done.stderr
        status = json.loads(done.stdout)
        assert status["round"] == 0 and status["rounds_completed"] == 1
        by_node = {m["node"]: m for m in status["members"]}
        assert {by_node[h.node]["rank"] for h in handlers[:2]} == {i.rank for i in infos}
        assert all(m["state"] == "alive" and m["host"] for m in status["members"])
        assert [(j["node"], j["role"]) for j in status["joined_next_round"]] == [(handlers[2].node, "waiting")]
        assert status["config"]["nodes"]["max"] == 4
        handlers[1].shutdown()
        table = cli("status", f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}").stdout
        assert "round 0 (1 completed), 2 member(s)" in table
        assert "left" in table and "waiting" in table and "config: nodes 2..4 (+1 spare)" in table
        handlers[0].set_closed()
        with pytest.raises(Exception, match="closed"):
            late.result(10)
    for handler in handlers:
        handler.shutdown()


def test_status_shows_a_restart_in_progress(etcd: EtcdServer, etcd_client: EtcdClient, run_id: str) -> None:
    """Iteration 2 was interrupted by initial rank 3 (rank 2 there); ranks 0 and 1 arrived at its termination barrier."""
    from elastic_ft.coordination.barriers import NO_WAIT
    from elastic_ft.coordination.iteration import iteration_store
    from elastic_ft.etcd.store import EtcdStore
    from elastic_ft.keys import TERMINATION_BARRIER, RunKeys
    from elastic_ft.launcher.status import _restart_in_progress, render_status

    prefix = RunKeys("/elastic_ft", run_id).round_store(0)
    base = EtcdStore(etcd_client, prefix)  # kept: the C++ prefix view does not keep the Python store alive
    iteration = iteration_store(base, 2)
    for initial, rank in ((0, 0), (1, 1), (3, 2)):  # initial rank 2 left in an earlier iteration
        iteration.set_initial_rank(rank, initial)
    assert _restart_in_progress(etcd_client, prefix, 2) is None  # nothing interrupted yet
    iteration.record_interruption(2, "soft_timeout", "inactive for 1.6 s")
    iteration.store.append("interruptions", '{"rank": 1e400, "kind": 5}\nnot json\n')  # corrupt: skipped, not fatal
    iteration.arrive_and_wait(TERMINATION_BARRIER, [0, 1], 3, NO_WAIT)
    restart = _restart_in_progress(etcd_client, prefix, 2)
    assert restart is not None
    assert restart["waiting_for"] == [3]
    assert [(r["initial_rank"], r["kind"]) for r in restart["interruptions"]] == [(3, "soft_timeout")]
    assert abs(restart["interrupted_at"] - time.time()) < 60
    shown = render_status({**EMPTY_STATUS, "restart_in_progress": restart})
    assert "restart in progress: iteration 2 interrupted at" in shown
    assert "by rank 3 (soft_timeout): inactive for 1.6 s" in shown and "waiting for ranks: [3]" in shown
    iteration.arrive_and_wait(TERMINATION_BARRIER, [2], 3, NO_WAIT)  # the last arrival: the restart goes on
    assert _restart_in_progress(etcd_client, prefix, 2) is None


EMPTY_STATUS = {
    "run": "r",
    "closed": False,
    "round": None,
    "workers": [],
    "terminated_ranks": [],
    "in_process_restarts": None,
    "process_restarts": 0,
    "escalations": [],
    "joined_next_round": [],
    "next_round": 0,
    "config": None,
    "malformed": [],
    "spare_nodes": 0,
    "active_world_size": None,
    "respawns": 0,
    "joined": [],
    "activations": [],
}


def test_status_shows_hot_spares_reserve_ranks_respawns_and_activations() -> None:
    from elastic_ft.launcher.status import render_status

    workers = [
        {
            "rank": r,
            "node": "n",
            "pid": 10 + r,
            "state": "running",
            "iteration": 1,
            "rank_in_iteration": r,
            "mode": "active" if r < 2 else "reserve",
        }
        for r in range(3)
    ]
    shown = render_status(
        {
            **EMPTY_STATUS,
            "workers": workers,
            "spare_nodes": 1,
            "active_world_size": 2,
            "respawns": 1,
            "joined": [{"initial_rank": 3, "admitted": None}],
            "activations": [{"initial_rank": 2, "iteration": 1}],
        }
    )
    assert "hot spares: 1 node(s); active world size 2; reserve ranks: [2]; respawned workers: 1" in shown
    assert "respawned rank 3: admitted not yet" in shown and "rank 2 activated in iteration 1" in shown
    assert "   2  reserve " in shown


def test_status_skips_forged_spare_records(etcd_client: EtcdClient, run_id: str) -> None:
    """The world record, joiners, admissions and activations read back forged: listed as malformed, never fatal."""
    from elastic_ft.keys import ACTIVATIONS, ADMITTED, FTRUN_NEXT_RANK, FTRUN_WORLD, JOINERS, WRAPPER_JOB, RunKeys
    from elastic_ft.launcher.status import _world_status

    prefix = RunKeys("/elastic_ft", run_id).round_store(0)
    job = f"{prefix}{WRAPPER_JOB}/"
    etcd_client.put(prefix + FTRUN_WORLD, b'{"spare_nodes": true, "active_world_size": "4"}')
    etcd_client.put(prefix + FTRUN_NEXT_RANK, b"lots")
    etcd_client.put(job + JOINERS, b"4\nx\n-1\n4\n5\n")
    etcd_client.put(job + ADMITTED + "4", b"2" * 100)
    etcd_client.put(
        job + ACTIVATIONS, b'{"initial_rank": 4, "iteration": 2}\nnot json\n{"initial_rank": true, "iteration": 1}\n'
    )
    malformed: list[dict[str, str]] = []
    world = _world_status(etcd_client, prefix, 3, malformed)
    assert (world["spare_nodes"], world["active_world_size"], world["respawns"]) == (0, None, 0)
    assert world["joined"] == [{"initial_rank": 4, "admitted": "2" * 32}, {"initial_rank": 5, "admitted": None}]
    assert world["activations"] == [{"initial_rank": 4, "iteration": 2}]
    assert [entry["key"] for entry in malformed] == [prefix + FTRUN_WORLD, job + ACTIVATIONS, job + ACTIVATIONS]
    assert malformed[0]["reason"] == "world record has world_size=None; expected a whole number"


def test_status_events_and_timeline_name_an_unknown_run(etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    for command in (["status"], ["status", "--json"], ["events"], ["timeline", "-o", str(tmp_path / "t.png")]):
        done = cli(*command, f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}")
        assert done.returncode == 2, f"{command}\n{done.stdout}\n{done.stderr}"
        assert f"no run {run_id!r} at" in done.stderr and f"/elastic_ft/{run_id}/" in done.stderr, done.stderr
    assert not (tmp_path / "t.png").exists()


def test_events_and_timeline_from_etcd_and_files(
    etcd: EtcdServer, etcd_client: EtcdClient, run_id: str, tmp_path: Path
) -> None:
    from elastic_ft.etcd.event_log import EventLog
    from elastic_ft.keys import RunKeys
    from elastic_ft.observability.events import JobEvent

    connection = (f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={run_id}")
    etcd_client.put(RunKeys("/elastic_ft", run_id).config, b"{}")  # the run exists, with no event yet
    empty = cli("timeline", "-o", str(tmp_path / "none.png"), *connection)
    assert empty.returncode == 2 and "has recorded no events yet" in empty.stderr
    log = EventLog(etcd_client, RunKeys("/elastic_ft", run_id))
    log.append(
        JobEvent(
            "round_closed",
            1700000000.0,
            run_id,
            "rendezvous",
            node="a",
            round=0,
            data={"members": ["a"], "reason": "1 node(s) joined"},
        )
    )
    log.append(
        JobEvent(
            "fault_detected",
            1700000001.0,
            run_id,
            "worker",
            node="a",
            rank=1,
            iteration=0,
            data={"kind": "RuntimeError", "message": "boom", "step": 3},
        )
    )
    shown = cli("events", *connection)
    assert shown.returncode == 0 and "rank 1 iteration 0: fault_detected kind=RuntimeError message=boom" in shown.stdout
    saved = tmp_path / "events.jsonl"
    saved.write_text(cli("events", "--json", *connection).stdout)
    assert [json.loads(line)["name"] for line in saved.read_text().splitlines()] == ["round_closed", "fault_detected"]
    for source in (connection, ("--events", str(saved))):
        picture = tmp_path / f"{len(source)}.png"
        drawn = cli("timeline", "-o", str(picture), *source)
        assert drawn.returncode == 0 and "1 faults" in drawn.stdout and "1 rounds" in drawn.stdout, drawn.stderr
        assert picture.read_bytes()[:4] == b"\x89PNG"
    both = cli("timeline", "-o", str(tmp_path / "x.png"), "--events", str(saved), *connection)
    assert both.returncode == 2 and "not both" in both.stderr
    (tmp_path / "empty.jsonl").write_text("")
    empty_file = cli("timeline", "-o", str(tmp_path / "x.png"), "--events", str(tmp_path / "empty.jsonl"))
    assert empty_file.returncode == 2 and "empty.jsonl holds no events" in empty_file.stderr
    missing = cli("timeline", "-o", str(tmp_path / "x.png"), "--events", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "No such file" in missing.stderr
    neither = cli("timeline", "-o", str(tmp_path / "x.png"))
    assert neither.returncode == 2 and "give --events FILE, or --rdzv-endpoint" in neither.stderr
    assert not (tmp_path / "x.png").exists()
