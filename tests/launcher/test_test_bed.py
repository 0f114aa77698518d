"""The network-namespace test bed's faults do what the fault scenarios say: a host isolated from its peers
reaches etcd's address and no peer, and the others still reach each other (``elastic_ft.testing.netns``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elastic_ft.testing.netns import TestBed, unavailable

REASON = unavailable()

pytestmark = [pytest.mark.integration, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

#: Connects to each address given on port 9 (nothing listens there) and prints what happened: a reachable
#: host refuses at once, a dropped one lets the connect time out.
REACH = """
import socket, sys
for address in sys.argv[1:]:
    try:
        socket.create_connection((address, 9), timeout=0.5).close()
        print("open")
    except ConnectionRefusedError:
        print("reached")
    except OSError:
        print("cut")
"""


def _reach(bed: TestBed, host: int, *addresses: str) -> list[str]:
    done = subprocess.run(
        bed.command(host, [sys.executable, "-c", REACH, *addresses]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout.split()


def test_a_host_isolated_from_its_peers_reaches_etcd_only_and_is_whole_again_once_cleared() -> None:
    with TestBed(3) as bed:
        peers, etcd = [bed.address(0), bed.address(1)], bed.bridge_address
        assert _reach(bed, 2, *peers, etcd) == ["reached", "reached", "reached"]
        bed.isolate_from_peers(2)
        assert _reach(bed, 2, *peers, etcd) == ["cut", "cut", "reached"]
        assert _reach(bed, 0, bed.address(1), bed.address(2), etcd) == ["reached", "cut", "reached"]
        bed.clear(2)
        assert _reach(bed, 2, *peers, etcd) == ["reached", "reached", "reached"]
        bed.isolate_from_etcd(2)
        assert _reach(bed, 2, *peers, etcd) == ["reached", "reached", "cut"]


def test_a_hosts_process_leads_a_session_of_its_own() -> None:
    """The scenarios SIGSTOP a host's processes: in the test's process group, a stopped one would be woken by the
    kernel's SIGHUP and SIGCONT to an orphaned group with a stopped member (``TestBed.popen`` says when)."""
    with TestBed(1) as bed:
        process = bed.popen(0, ["sleep", "60"])
        try:
            assert os.getsid(process.pid) == process.pid and os.getpgid(process.pid) == process.pid
            assert os.getpgid(process.pid) != os.getpgrp()
        finally:
            process.kill()
            process.wait()
