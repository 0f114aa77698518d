"""A rank resending what the network lost is slow, not hung; one waiting for a hung peer is neither.

Real sockets in a network namespace of their own (the test bed's), with
real packet loss (``iptables``), read from another process as the monitor
process reads them.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic_ft.inprocess.hangs.verdicts import RankActivity
from elastic_ft.testing.netns import TestBed, unavailable

REASON = unavailable()
COST = Path(__file__).resolve().parents[2] / "benchmarks" / "monitor_cost.py"

#: Asks another process, as the monitor process asks: one ``ResendProbe`` kept across the questions (it reads
#: the TCP tables only for sockets new to it, then looks each connection up by address) and, beside it, the
#: tables alone (the probe's answer where the kernel has no ``sock_diag``). Each answer is a line: "probe tables".
WATCHER = textwrap.dedent(
    """
    import sys, time
    from elastic_ft.inprocess.hangs.resends import ResendProbe, open_sock_diag, resending_by_tables
    pid = int(sys.argv[1])
    probe = ResendProbe(pid)
    lookup = open_sock_diag()
    print(lookup is not None, flush=True)
    if lookup is not None:
        lookup.close()
    for _ in sys.stdin:
        print(probe.resending(time.monotonic()), resending_by_tables(pid), flush=True)
    """
)

SCENARIO = textwrap.dedent(
    """
    import os, socket, subprocess, sys, time
    watcher = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    print("sock_diag:", watcher.stdout.readline().strip())

    def seen_by_another_process():
        watcher.stdin.write("?\\n")
        watcher.stdin.flush()
        return watcher.stdout.readline().strip()

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    print("listening:", seen_by_another_process())
    sender = socket.create_connection(("127.0.0.1", port))
    receiver, _ = listener.accept()
    # A hung peer: it reads nothing, its kernel acknowledges everything (then the window fills).
    sender.sendall(b"x" * 1000)
    time.sleep(0.3)
    print("hung peer, some data:", seen_by_another_process())
    sender.setblocking(False)
    try:
        while True:
            sender.send(b"y" * 65536)
    except BlockingIOError:
        pass
    time.sleep(0.5)
    print("hung peer, full window:", seen_by_another_process())
    # A lossy link: every packet to the port is dropped for now; what is sent stays in flight. The probe meets
    # this connection for the first time here.
    lossy_sender = socket.create_connection(("127.0.0.1", port))
    lossy_receiver, _ = listener.accept()
    rule = ["-p", "tcp", "--dport", str(port), "-j", "DROP"]
    subprocess.run(["iptables-legacy", "-I", "INPUT", *rule], check=True)
    try:
        lossy_sender.sendall(b"z" * 1000)
        time.sleep(0.5)
        print("lossy link:", seen_by_another_process())
    finally:
        subprocess.run(["iptables-legacy", "-D", "INPUT", *rule], check=True)
    got = b""
    lossy_receiver.settimeout(10)
    while len(got) < 1000:
        got += lossy_receiver.recv(4096)
    time.sleep(0.3)
    print("delivered:", len(got), seen_by_another_process())
    lossy_sender.close()
    print("closed:", seen_by_another_process())
    watcher.stdin.close()
    watcher.wait(10)
    """
)


@pytest.mark.integration
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_only_data_the_network_lost_and_the_rank_resends_counts_as_activity() -> None:
    with TestBed(1) as bed:
        done = subprocess.run(
            bed.command(0, [sys.executable, "-c", SCENARIO, WATCHER]),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines == [
        "sock_diag: True",  # the probe answers by lookups here, not from the tables
        "listening: False False",
        "hung peer, some data: False False",
        "hung peer, full window: False False",
        "lossy link: True True",
        "delivered: 1000 False False",
        "closed: False False",
    ], done.stdout + done.stderr[-3000:]


def test_network_activity_counts_as_activity_of_the_rank() -> None:
    busy = RankActivity(progress_age=9.0, cpu_idle_for=9.0, stopped=False, threads_silent_for=0.0, network_idle_for=0.2)
    assert busy.inactive_for == 0.2
    idle = RankActivity(progress_age=9.0, cpu_idle_for=8.0, stopped=False, threads_silent_for=0.0)
    assert idle.inactive_for == 8.0


def test_resends_are_sampled_only_while_nothing_cheaper_shows_the_rank_active(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from elastic_ft.inprocess.hangs import monitor

    samples: list[float] = []
    meter = monitor._NetworkMeter(4242)
    monkeypatch.setattr(meter.probe, "resending", lambda now: samples.append(now) or True)
    meter.sample(10.0, otherwise_inactive_for=0.15)  # it made progress or used CPU within two samples' time
    assert samples == [] and meter.busy_at == -math.inf
    meter.sample(10.2, otherwise_inactive_for=0.2)  # quiet: sampled, and its resends seen
    assert samples == [10.2] and meter.busy_at == 10.2
    meter.sample(10.25, otherwise_inactive_for=0.25)  # still quiet, but within the period of the last sample
    assert samples == [10.2]
    meter.sample(10.31, otherwise_inactive_for=0.31)
    assert samples == [10.2, 10.31] and meter.busy_at == 10.31


@pytest.mark.integration
def test_the_probe_reads_the_tcp_tables_only_for_sockets_new_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading them costs the kernel a walk of its whole connection table (milliseconds); a lookup by address
    costs microseconds. Sockets the tables do not show (not TCP) are looked for again only now and then."""
    import os
    import socket

    from elastic_ft.inprocess.hangs import resends

    lookup = resends.open_sock_diag()
    if lookup is None:
        pytest.skip("this kernel answers no sock_diag lookup of TCP connections")
    lookup.close()
    reads: list[set[int]] = []
    connections = resends._connections
    monkeypatch.setattr(
        resends, "_connections", lambda pid, inodes: reads.append(set(inodes)) or connections(pid, inodes)
    )
    pair = socket.socketpair()
    with socket.create_server(("127.0.0.1", 0)) as listener, pair[0], pair[1]:
        probe = resends.ResendProbe(os.getpid())
        assert probe.resending(100.0) is False
        assert len(reads) == 1 and os.fstat(listener.fileno()).st_ino in reads[0]
        assert probe.resending(100.1) is False and probe.resending(101.0) is False
        assert len(reads) == 1  # nothing new: the unix sockets are looked for again only after a while
        with socket.create_connection(listener.getsockname()) as client:
            assert probe.resending(101.1) is False
            assert len(reads) == 2 and os.fstat(client.fileno()).st_ino in reads[1]
            assert os.fstat(pair[0].fileno()).st_ino in reads[1]  # the tables are read for every unmatched one
            assert probe.resending(102.0) is False and len(reads) == 2
            assert probe.resending(103.2) is False  # the unix sockets' turn
            unix = {os.fstat(end.fileno()).st_ino for end in pair}
            assert len(reads) == 3 and unix <= reads[2]
            assert not {os.fstat(known.fileno()).st_ino for known in (client, listener)} & reads[2]
        probe.close()


@pytest.mark.integration
def test_the_cost_benchmark_finds_the_lookups_cheaper_than_the_tables(tmp_path: Path) -> None:
    """benchmarks/monitor_cost.py runs (CPU time of the asking process, not wall time: load does not sway it)."""
    from elastic_ft.inprocess.hangs.resends import open_sock_diag

    lookup = open_sock_diag()
    if lookup is None:
        pytest.skip("this kernel answers no sock_diag lookup of TCP connections: the probe reads the tables")
    lookup.close()
    out = tmp_path / "monitor_cost.json"
    done = subprocess.run(
        [sys.executable, str(COST), "--connections", "8", "--questions", "20", "--repeats", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["runs"]
    assert row["connections"] == 8 and "| 8 (16) |" in done.stdout
    # Here the probe's answers are lookups (sock_diag), hundreds of times cheaper than the tables' walk.
    assert row["ms_per_question"]["probe"] < row["ms_per_question"]["tables"] / 5, row


@pytest.mark.integration
@pytest.mark.parametrize("bad", [["--connections", "two"], ["--connections", "0"], ["--repeats", "0"]])
def test_the_cost_benchmark_names_a_bad_argument_before_it_starts_anything(tmp_path: Path, bad: list[str]) -> None:
    out = tmp_path / "monitor_cost.json"
    done = subprocess.run(
        [sys.executable, str(COST), *bad, "--out", str(out)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2 and bad[0] in done.stderr and not out.exists(), done.stderr
