"""Failure detection: the pure decisions, and real probes of real sockets (loopback; a stopped process)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from elastic_ft.rendezvous.liveness import (
    Answer,
    Detection,
    bounds_for,
    in_majority,
    judge,
    peers_reachable,
    probe_targets,
    should_probe,
)
from elastic_ft.rendezvous.probe import GREETING, ProbeServer, parse_address, probe, probe_all

FAST = Detection(probe_bound=0.5, greeting_bound=0.5, retry_every=0.05)


@pytest.mark.parametrize("name", ["suspect_after", "probe_bound", "greeting_bound", "retry_every", "probe_every"])
@pytest.mark.parametrize("value", [0, -1, 3600, True, "1", float("nan")])
def test_detection_rejects_bad_seconds_by_name(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"Detection {name}="):
        Detection(**{name: value})  # type: ignore[arg-type]


def test_detection_rejects_a_retry_longer_than_the_bound() -> None:
    with pytest.raises(ValueError, match="retry_every=2 exceeds probe_bound=1"):
        Detection(probe_bound=1, retry_every=2)


def test_probes_start_only_after_a_long_enough_stall_and_not_more_often_than_probe_every() -> None:
    detection = Detection(suspect_after=0.3, probe_every=1.0)
    assert not should_probe(None, None, detection)
    assert not should_probe(0.29, None, detection)
    assert should_probe(0.3, None, detection)
    assert not should_probe(5.0, 0.5, detection)
    assert should_probe(5.0, 1.0, detection)


def test_bounds_grow_with_a_slow_link_and_never_shrink() -> None:
    detection = Detection(probe_bound=1.0, greeting_bound=2.0, rtt_factor=4.0)
    assert bounds_for([], detection) == detection
    assert bounds_for([0.01, 0.2], detection) == detection  # 0.8 s: within both bounds
    slow = bounds_for([0.1, 0.4], detection)
    assert (slow.probe_bound, slow.greeting_bound) == (pytest.approx(1.6), 2.0)
    slower = bounds_for([0.9], detection)
    assert (slower.probe_bound, slower.greeting_bound) == (pytest.approx(3.6), pytest.approx(3.6))
    assert slower.suspect_after == detection.suspect_after


def test_judge_counts_refused_silent_and_mute_as_lost_and_gives_each_its_reason() -> None:
    verdicts = judge(
        {
            "d": (Answer.UNKNOWN, 0.0),
            "a": (Answer.ANSWERED, 0.002),
            "b": (Answer.REFUSED, 0.001),
            "c": (Answer.SILENT, 1.0),
            "e": (Answer.MUTE, 2.0),
        },
        me="m",
    )
    assert [v.node for v in verdicts] == ["a", "b", "c", "d", "e"]
    assert [v.lost for v in verdicts] == [False, True, True, False, True]
    assert [v.state for v in verdicts] == ["alive", "lost", "lost", "alive", "lost"]  # "m" reaches most
    assert "only slow" in verdicts[0].reason
    assert "process is gone" in verdicts[1].reason
    assert "link to it is down" in verdicts[2].reason
    assert "left to its lease" in verdicts[3].reason
    assert "stopped or wedged" in verdicts[4].reason


def test_silence_counts_only_for_the_side_that_reaches_most_nodes() -> None:
    silent, answered = (Answer.SILENT, 1.0), (Answer.ANSWERED, 0.01)
    # Three hosts, one cut off: the two that reach each other count it lost; it counts nobody lost.
    assert in_majority({"b": answered, "c": silent}, "a")
    assert [v.state for v in judge({"b": answered, "c": silent}, "a")] == ["alive", "lost"]
    assert not in_majority({"a": silent, "b": silent}, "c")
    cut_off = judge({"a": silent, "b": silent}, "c")
    assert [v.state for v in cut_off] == ["unconfirmed", "unconfirmed"] and not any(v.lost for v in cut_off)
    assert "may be the one cut off" in cut_off[0].reason
    # An even split: the half holding the first node in node order, and only that half.
    assert in_majority({"b": silent}, "a") and not in_majority({"a": silent}, "b")
    assert in_majority({"b": answered, "c": silent, "d": silent}, "a")
    assert not in_majority({"a": silent, "b": silent, "d": answered}, "c")
    # A refusal or a mute host is proof whoever asks: a node alone may act on it.
    assert [v.state for v in judge({"a": (Answer.REFUSED, 0.0), "b": (Answer.MUTE, 2.0)}, "c")] == ["lost", "lost"]
    assert in_majority({}, "a")


def test_only_other_live_members_are_probed() -> None:
    assert probe_targets(["a", "b", "c", "d"], alive=["a", "b", "d", "x"], me="a") == ["b", "d"]


def test_a_node_reaches_its_peers_only_when_every_one_answers() -> None:
    assert peers_reachable({})
    assert peers_reachable({"a": (Answer.ANSWERED, 0.1), "b": (Answer.UNKNOWN, 0.0)})
    assert not peers_reachable({"a": (Answer.ANSWERED, 0.1), "b": (Answer.SILENT, 1.0)})


@pytest.mark.parametrize(
    "text, expected",
    [
        ("10.0.0.1:29500", ("10.0.0.1", 29500)),
        ("[::1]:8", ("::1", 8)),
        ("host.example:65535", ("host.example", 65535)),
        ("10.0.0.1", None),
        (":80", None),
        ("a:0", None),
        ("a:65536", None),
        ("a:-1", None),
        ("a:" + "9" * 400, None),
        (17, None),
        (None, None),
    ],
)
def test_probe_addresses_from_etcd_are_parsed_as_untrusted(text: object, expected: object) -> None:
    assert parse_address(text) == expected


def test_a_running_agent_answers_at_once() -> None:
    server = ProbeServer("127.0.0.1").start()
    try:
        host, port = parse_address(server.address)  # type: ignore[misc]
        with socket.create_connection((host, port), timeout=2) as raw:
            assert raw.recv(1) == GREETING
        answer, seconds = probe((host, port), FAST)
        assert answer is Answer.ANSWERED and seconds < 0.5
    finally:
        server.stop()


def test_a_port_nobody_listens_on_is_refused_at_once() -> None:
    server = ProbeServer("127.0.0.1").start()
    address = parse_address(server.address)
    server.stop()
    answer, seconds = probe(address, FAST)  # type: ignore[arg-type]
    assert answer is Answer.REFUSED and seconds < 0.5


def test_a_listener_that_never_greets_is_mute_after_the_greeting_bound() -> None:
    # The kernel completes handshakes from the backlog; nobody accepts: a host that is up, an agent that is not.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        started = time.monotonic()
        answer, seconds = probe(listener.getsockname(), FAST)
    assert answer is Answer.MUTE
    assert 0.45 <= seconds < 1.5 and time.monotonic() - started < 2.0


def wait_for_state(pid: int, *, stopped: bool) -> None:
    """Until the kernel has (or no longer has) stopped ``pid``: a signal is delivered asynchronously."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            if (stat.read().rpartition(")")[2].split()[0] == "T") == stopped:
                return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not become {'stopped' if stopped else 'running'}")


@pytest.mark.integration
def test_a_stopped_agent_process_is_mute_and_answers_again_once_continued() -> None:
    code = (
        "import sys, time\n"
        "from elastic_ft.rendezvous.probe import ProbeServer\n"
        "s = ProbeServer('127.0.0.1').start()\n"
        "print(s.address, flush=True)\n"
        "time.sleep(60)\n"
    )
    # A session of its own: a stopped member of pytest's process group would be sent SIGHUP if the group were
    # orphaned meanwhile (elastic_ft/testing/netns.py, TestBed.popen).
    agent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        address = parse_address(agent.stdout.readline().strip())  # type: ignore[union-attr]
        assert address is not None
        assert probe(address, FAST)[0] is Answer.ANSWERED
        os.kill(agent.pid, signal.SIGSTOP)
        wait_for_state(agent.pid, stopped=True)
        assert probe(address, FAST)[0] is Answer.MUTE
        os.kill(agent.pid, signal.SIGCONT)
        wait_for_state(agent.pid, stopped=False)
        assert probe(address, FAST)[0] is Answer.ANSWERED
        agent.kill()
        agent.wait()
        assert probe(address, FAST)[0] is Answer.REFUSED
    finally:
        agent.kill()
        agent.wait()


def test_probe_all_probes_every_node_with_its_own_bounds_in_parallel() -> None:
    server = ProbeServer("127.0.0.1").start()
    gone = ProbeServer("127.0.0.1").start()
    gone_address = parse_address(gone.address)
    gone.stop()
    try:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(64)
            started = time.monotonic()
            answers = probe_all(
                {
                    "alive": parse_address(server.address),
                    "gone": gone_address,
                    "mute": listener.getsockname(),
                    "old": None,
                },
                {"alive": FAST, "gone": FAST, "mute": FAST, "old": FAST},
            )
            elapsed = time.monotonic() - started
    finally:
        server.stop()
    assert {node: answer for node, (answer, _) in answers.items()} == {
        "alive": Answer.ANSWERED,
        "gone": Answer.REFUSED,
        "mute": Answer.MUTE,
        "old": Answer.UNKNOWN,
    }
    assert elapsed < 1.5  # in parallel: the slowest bound, not their sum


def test_while_a_node_counts_nobody_out_silence_is_no_proof_and_refusal_still_is() -> None:
    """Its quiet window after it announced itself again, or its promises: its own links are suspect."""
    answers = {"a": (Answer.ANSWERED, 0.01), "b": (Answer.SILENT, 1.0), "c": (Answer.REFUSED, 0.0)}
    held = judge(answers, "m", held_for=4.2)
    assert [v.state for v in held] == ["alive", "unconfirmed", "lost"]
    assert "counts nobody out for 4.2 s more" in held[1].reason
    assert [v.state for v in judge(answers, "m", held_for=0.0)] == ["alive", "lost", "lost"]
