"""A rank resending what the network lost is slow, not hung; one waiting for a hung peer is neither.

Real sockets in a network namespace of their own (the test bed's), with
real packet loss (``iptables``), read from another process as the monitor
process reads them.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest

from elastic_ft.inprocess.hangs.verdicts import RankActivity
from elastic_ft.testing.netns import TestBed, unavailable

REASON = unavailable()

SCENARIO = textwrap.dedent(
    """
    import os, socket, subprocess, sys, time
    from elastic_ft.inprocess.delivery.connections import resending_lost_data

    def seen_by_another_process():
        code = f"from elastic_ft.inprocess.delivery.connections import resending_lost_data as s; print(s({os.getpid()}))"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
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
    # A lossy link: every packet to the port is dropped for now; what is sent stays in flight.
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
    """
)


@pytest.mark.integration
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_only_data_the_network_lost_and_the_rank_resends_counts_as_activity() -> None:
    with TestBed(1) as bed:
        done = subprocess.run(
            bed.command(0, [sys.executable, "-c", SCENARIO]), capture_output=True, text=True, timeout=120, check=False
        )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines == [
        "hung peer, some data: False",
        "hung peer, full window: False",
        "lossy link: True",
        "delivered: 1000 False",
    ], done.stdout + done.stderr[-3000:]


def test_network_activity_counts_as_activity_of_the_rank() -> None:
    busy = RankActivity(progress_age=9.0, cpu_idle_for=9.0, stopped=False, threads_silent_for=0.0, network_idle_for=0.2)
    assert busy.inactive_for == 0.2
    idle = RankActivity(progress_age=9.0, cpu_idle_for=8.0, stopped=False, threads_silent_for=0.0)
    assert idle.inactive_for == 8.0


def test_the_tcp_tables_are_read_only_while_nothing_cheaper_shows_the_rank_active(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading them costs the kernel a walk of its whole connection table (a few ms per sample)."""
    from elastic_ft.inprocess.hangs import monitor

    reads: list[int] = []
    monkeypatch.setattr(monitor, "resending_lost_data", lambda pid: reads.append(pid) or True)
    meter = monitor._NetworkMeter(4242)
    meter.sample(10.0, otherwise_inactive_for=0.15)  # it made progress or used CPU within two samples' time
    assert reads == [] and meter.busy_at == -math.inf
    meter.sample(10.2, otherwise_inactive_for=0.2)  # quiet: read, and its resends seen
    assert reads == [4242] and meter.busy_at == 10.2
    meter.sample(10.25, otherwise_inactive_for=0.25)  # still quiet, but within the period of the last read
    assert reads == [4242]
    meter.sample(10.31, otherwise_inactive_for=0.31)
    assert reads == [4242, 4242] and meter.busy_at == 10.31
