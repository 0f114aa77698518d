"""ftrun: torchrun's flags, etcdft by default, an embedded etcd on one host."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_ft.etcd.client import EtcdClient
from elastic_ft.etcd.server import EtcdServer
from elastic_ft.handoff import job_config_from_env
from elastic_ft.job_config import load_job_config
from elastic_ft.launcher.ftrun import apply_job_config, apply_segments, build_parser, hand_progress_limits, parse_args
from elastic_ft.runtime.net import free_port

TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train.py"
FTRUN = [sys.executable, "-m", "elastic_ft.launcher.ftrun"]


def test_parser_takes_torchrun_flags_and_defaults_to_etcdft() -> None:
    args = build_parser().parse_args(["--nnodes=1:2", "--nproc-per-node=3", "--max-restarts=2", "train.py", "--x"])
    assert args.rdzv_backend == "etcdft"
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == ("1:2", "3", 2)
    assert args.training_script == "train.py" and args.training_script_args == ["--x"]
    assert build_parser().parse_args(["--rdzv-backend=c10d", "t.py"]).rdzv_backend == "c10d"


def test_help_lists_ftrun_and_torchrun_flags() -> None:
    text = build_parser().format_help()
    for flag in ("--etcd-binary", "--rdzv-endpoint", "--nproc-per-node", "--max-restarts"):
        assert flag in text
    flat = " ".join(text.split())
    assert "default etcdft (an etcd v3 rendezvous)" in flat
    assert "--standalone Single host: start an embedded etcd for the job" in flat
    assert "represented by a C10d TCP store" not in flat  # torchrun's text, wrong under ftrun


@pytest.mark.integration
def test_multi_node_without_endpoint_is_a_clear_error() -> None:
    command = [*FTRUN, "--nnodes=1:2", str(TRAIN), "--workdir", "/tmp/unused"]
    done = subprocess.run(command, check=False, capture_output=True, text=True)
    assert done.returncode == 2
    assert "--rdzv-endpoint is required for a multi-node job (--nnodes=1:2)" in done.stderr


@pytest.mark.slow
def test_single_host_job_runs_on_an_embedded_etcd(tmp_path: Path) -> None:
    work = tmp_path / "work"
    done = subprocess.run(
        [*FTRUN, "--nproc-per-node=2", "--monitor-interval=0.1", str(TRAIN), "--workdir", str(work), "--steps", "5"],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(work.glob("done-*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert {r["world_size"] for r in results} == {2}
    # The embedded etcd served the job and is gone with it.
    match = re.search(r"ftrun: embedded etcd at 127\.0\.0\.1:(\d+)", done.stderr)
    assert match, done.stderr[-2000:]
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", int(match.group(1)))) != 0


def test_job_config_fills_what_the_command_line_leaves_unset() -> None:
    config = load_job_config(
        "nodes: {min: 2, max: 3}\nnproc_per_node: 4\nmax_restarts: 5\nrendezvous: {lease_ttl: 3, last_call_timeout: 2}"
    )
    parser = build_parser()
    args, given = parse_args(parser, ["--nproc-per-node=2", "--rdzv-conf=lease_ttl=7", "train.py"])
    apply_job_config(args, given, config)
    assert args.nnodes == "2:3"  # from the config
    assert args.nproc_per_node == "2"  # the command line wins
    assert args.max_restarts == 5
    assert sorted(args.rdzv_conf.split(",")) == ["last_call_timeout=2", "lease_ttl=7"]


@pytest.mark.integration
def test_bad_job_config_file_fails_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "job.yaml"
    bad.write_text("nodes: {min: 1, max: 1}\nwrapper: {soft_timeout: 0}\n")
    done = subprocess.run([*FTRUN, f"--job-config={bad}", str(TRAIN)], check=False, capture_output=True, text=True)
    assert done.returncode == 2
    assert "wrapper.soft_timeout=0 is invalid; expected seconds > 0" in done.stderr
    assert "embedded etcd" not in done.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ("lease_ttl=abc", "ftrun: error: --rdzv-conf: rdzv conf lease_ttl='abc' is not a number; expected seconds > 0"),
        ("bogus=1", "ftrun: error: --rdzv-conf: unknown etcdft rdzv conf key(s) 'bogus'; expected some of"),
        ("join_timeout=-1", "ftrun: error: --rdzv-conf: rdzv conf join_timeout='-1' is out of range"),
    ],
)
def test_a_bad_rdzv_conf_is_one_line_and_exit_2_before_anything_starts(tmp_path: Path, conf: str, message: str) -> None:
    done = subprocess.run(
        [*FTRUN, "--nproc-per-node=1", f"--rdzv-conf={conf}", str(TRAIN)],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and done.stderr.startswith(message), done.stderr
    assert "embedded etcd" not in done.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        ("host:99999", "ftrun: error: --rdzv-endpoint: rdzv endpoint 'host:99999' has port '99999'; expected 1..65535"),
        ("http://[bad", "ftrun: error: --rdzv-endpoint: rdzv endpoint 'http://[bad' (in 'http://[bad') is malformed"),
    ],
)
def test_a_malformed_endpoint_is_blamed_on_rdzv_endpoint(tmp_path: Path, endpoint: str, message: str) -> None:
    done = subprocess.run(
        [*FTRUN, "--nnodes=2", "--nproc-per-node=1", f"--rdzv-endpoint={endpoint}", str(TRAIN)],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and done.stderr.startswith(message), done.stderr


@pytest.mark.integration
def test_an_unreachable_etcd_names_the_endpoint_and_what_ftrun_was_doing(tmp_path: Path) -> None:
    closed = free_port()
    command = [
        *FTRUN,
        "--nnodes=2",
        "--rdzv-id=job1",
        f"--rdzv-endpoint=127.0.0.1:{closed}",
        "--rdzv-conf=connect_timeout=1,request_timeout=1",
        str(TRAIN),
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(
        f"ftrun: error: cannot read the run's job config for run 'job1' at --rdzv-endpoint=127.0.0.1:{closed}: "
        f"no answer from etcd at http://127.0.0.1:{closed}"
    ), done.stderr
    assert "usage:" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.integration
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics-port=70000"], "'70000' is not a TCP port; expected a whole number from 0 to 65535"),
        (["--metrics-port=http"], "'http' is not a TCP port"),
        (
            ["--record=x", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:1"],
            "--record and --metrics-port need the etcdft rendezvous, not --rdzv-backend=c10d",
        ),
    ],
)
def test_bad_observability_flags_fail_before_anything_starts(tmp_path: Path, flags: list[str], message: str) -> None:
    done = subprocess.run([*FTRUN, *flags, str(TRAIN)], check=False, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "embedded etcd" not in done.stderr and not (tmp_path / "x").exists()


@pytest.mark.slow
@pytest.mark.parametrize("prefix", [None, "/custom/prefix"])
def test_stored_job_config_sets_the_worker_count(
    etcd: EtcdServer, run_id: str, tmp_path: Path, prefix: str | None
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("nodes: {min: 1, max: 1}\nnproc_per_node: 2\nrendezvous: {last_call_timeout: 0}\n")
    put = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_ft.launcher.cli",
            "config",
            "put",
            str(config),
            f"--rdzv-endpoint={etcd.endpoint}",
            f"--rdzv-id={run_id}",
            *([f"--etcd-prefix={prefix}"] if prefix else []),
        ],
        check=False,
        capture_output=True,
        text=True,
    )
    assert put.returncode == 0, put.stderr
    work = tmp_path / "work"
    # The stored config is read from the run's own prefix (etcd_prefix in --rdzv-conf).
    conf = [f"--rdzv-conf=etcd_prefix={prefix},request_timeout=3"] if prefix else []
    command = [
        *FTRUN,
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={run_id}",
        "--monitor-interval=0.1",
        *conf,
        str(TRAIN),
        "--workdir",
        str(work),
        "--steps",
        "3",
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(p.read_text()) for p in sorted(work.glob("done-*.json"))]
    assert {r["world_size"] for r in results} == {2} and len(results) == 2


def test_a_malformed_stored_job_config_is_a_clear_error(etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    EtcdClient(etcd.endpoints).put(f"/elastic_ft/{run_id}/config", b'{"nodes": {"min": 1e400}}')
    command = [
        *FTRUN,
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={run_id}",
        str(TRAIN),
        "--workdir",
        str(tmp_path),
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"the job config stored at /elastic_ft/{run_id}/config is not valid" in done.stderr


WRAPPER_DEFAULTS_SCRIPT = """
import json, os, sys, threading
from elastic_ft import CallWrapper, Wrapper

def fn(call_wrapper: CallWrapper | None = None):
    return call_wrapper.state.active_rank

wrapper = Wrapper()
result = wrapper(fn)()
threads = sorted(thread.name for thread in threading.enumerate())
record = {"soft_timeout": wrapper.soft_timeout.total_seconds(), "result": result, "threads": threads,
          "store": type(wrapper.store_factory()).__name__}
with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as file:
    json.dump(record, file)
"""


@pytest.mark.slow
def test_workers_get_wrapper_defaults_from_the_job_config(etcd: EtcdServer, run_id: str, tmp_path: Path) -> None:
    """The stored config's Wrapper timeouts and rank assignment reach the workers' Wrapper() defaults; the
    Wrapper leaves no thread of its own behind when it returns."""
    config = tmp_path / "job.yaml"
    config.write_text(
        "nodes: {min: 1, max: 1}\nnproc_per_node: 2\nrendezvous: {last_call_timeout: 0}\n"
        "wrapper: {soft_timeout: 45, hard_timeout: 50}\nrank_assignment: {max_active_world_size: 1}\n"
    )
    script = tmp_path / "worker.py"
    script.write_text(WRAPPER_DEFAULTS_SCRIPT)
    command = [
        *FTRUN,
        f"--job-config={config}",
        f"--rdzv-endpoint={etcd.endpoint}",
        f"--rdzv-id={run_id}",
        "--monitor-interval=0.1",
        str(script),
        str(tmp_path),
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert {r["soft_timeout"] for r in records} == {45.0}
    assert sorted(r["result"] for r in records if r["result"] is not None) == [0]  # one active rank, one spare
    assert sum(r["result"] is None for r in records) == 1
    assert {r["store"] for r in records} == {"EtcdStore"}
    # The Wrapper closed its store's etcd connection: no gRPC thread runs into the interpreter's exit.
    assert [r["threads"] for r in records] == [["MainThread"], ["MainThread"]]


NO_PROGRESS_SCRIPT = """
import os, sys
import torch.distributed as dist
from elastic_ft import CallWrapper, Wrapper

def fn(call_wrapper: CallWrapper | None = None):
    with open(os.path.join(sys.argv[1], f"calls-{os.environ['RANK']}"), "a") as file:
        file.write(f"{call_wrapper.iteration}\\n")
    for _ in range(3):  # three steps of progress in every iteration
        call_wrapper.ping()
    if call_wrapper.iteration < 4 and call_wrapper.state.rank == 1:
        raise RuntimeError(f"the same fault in iteration {call_wrapper.iteration}")
    return 0

Wrapper()(fn)()
"""


def test_the_progress_flags_reach_every_worker() -> None:
    parser = build_parser()
    args, _ = parse_args(parser, ["--ft-max-no-progress-cycles", "-1", "--ft-min_progress_iterations", "7", "x.py"])
    assert (args.max_restarts_without_progress, args.min_progress_steps) == (0, 7)
    environ = {"ELASTIC_FT_JOB_CONFIG": '{"wrapper": {"soft_timeout": 45, "min_progress_steps": 2}}'}
    hand_progress_limits(args, environ)
    wrapper = job_config_from_env(environ).wrapper
    assert (wrapper.soft_timeout, wrapper.max_restarts_without_progress, wrapper.min_progress_steps) == (45, 0, 7)
    untouched: dict[str, str] = {}
    hand_progress_limits(parse_args(parser, ["x.py"])[0], untouched)
    assert untouched == {}


@pytest.mark.integration
@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--max-restarts-without-progress=-2", "'-2' is not a number of restarts"),
        ("--ft-min-progress-iterations=0", "'0' is not a number of steps; expected a whole number >= 1"),
    ],
)
def test_bad_progress_flags_are_one_line_and_exit_2(flag: str, message: str) -> None:
    done = subprocess.run([*FTRUN, flag, "x.py"], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("min_steps", [None, 5])
def test_iterations_short_of_min_progress_steps_end_the_job_with_their_cause(
    tmp_path: Path, min_steps: int | None
) -> None:
    """ft_launcher's progress-based stop, as ftrun flags: each iteration steps three times and then fails on
    rank 1, four times in all. Three steps are progress by default (the job completes); with
    --ft-min-progress-iterations 5 they are not, and the second such iteration ends the job, naming its fault."""
    script = tmp_path / "worker.py"
    script.write_text(NO_PROGRESS_SCRIPT)
    flags = ["--ft-max-no-progress-cycles", "2"]
    if min_steps is not None:
        flags += ["--ft-min-progress-iterations", str(min_steps)]
    command = [*FTRUN, "--nproc-per-node=2", "--monitor-interval=0.1", *flags, str(script), str(tmp_path)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=180)
    calls = [(tmp_path / f"calls-{rank}").read_text().split() for rank in (0, 1)]
    if min_steps is None:
        assert done.returncode == 0, done.stderr[-3000:]
        assert calls == [["0", "1", "2", "3", "4"]] * 2
        return
    assert done.returncode != 0, done.stderr[-3000:]
    assert calls == [["0", "1"]] * 2, done.stderr[-3000:]
    assert "2 iterations in a row ended on a fault without progress (max_restarts_without_progress=2)" in done.stderr
    assert "the last iteration ended on: RuntimeError on rank 1" in done.stderr, done.stderr[-3000:]


def test_segment_flags_reach_the_rendezvous_and_a_label_is_checked_only_when_used() -> None:
    parser = build_parser()
    args, _ = parse_args(parser, ["--ft-segment", "2", "--node-segment", "nvl-3", "x.py"])
    environ: dict[str, str] = {}
    apply_segments(args, environ)
    assert "segment=2" in args.rdzv_conf and environ == {"ELASTIC_FT_NODE_SEGMENT": "nvl-3"}
    clash, _ = parse_args(parser, ["--segment-size=2", "--rdzv-conf=segment=4", "x.py"])
    with pytest.raises(ValueError, match="--segment-size=2 disagrees with --rdzv-conf segment=4"):
        apply_segments(clash, {})
    bad, _ = parse_args(parser, ["--segment-size=2", "x.py"])
    with pytest.raises(ValueError, match="is not a segment label"):
        apply_segments(bad, {"ELASTIC_FT_NODE_SEGMENT": "a b"})
    unused, _ = parse_args(parser, ["x.py"])
    apply_segments(unused, {"SLURM_TOPOLOGY_ADDR": "s[1].n 2"})  # no segments: nothing to check
