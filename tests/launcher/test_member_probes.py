"""An agent's probes of the other members (``elastic_ft.launcher.member_probes``): real probe ports on
loopback; the rendezvous handler is a small stand-in that lists the members and records the revocations."""

from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from elastic_ft.launcher import member_probes
from elastic_ft.launcher.member_probes import MemberProbes
from elastic_ft.rendezvous.liveness import Answer
from elastic_ft.rendezvous.probe import ProbeServer
from elastic_ft.runtime.local_board import LocalBoard


@dataclasses.dataclass
class _Presence:
    members: dict[str, tuple[int, tuple[str, int] | None]]

    def alive_nodes(self) -> dict[str, tuple[int, tuple[str, int] | None]]:
        return dict(self.members)


@dataclasses.dataclass
class _Handler:
    """What :class:`MemberProbes` asks of ``EtcdftRendezvousHandler``."""

    node: str
    presence: _Presence
    held_until: float = 0.0
    revoked: list[tuple[str, int, str]] = dataclasses.field(default_factory=list)

    def hold_until(self) -> float:
        return self.held_until

    def revoke(self, node: str, lease: int, reason: str) -> None:
        self.revoked.append((node, lease, reason))


def _refused_port() -> tuple[str, int]:
    """A loopback port nothing listens on (bound, then closed): a probe of it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()


@pytest.fixture
def board() -> Iterator[LocalBoard]:
    board = LocalBoard.create(1, "probes-test")
    board.set_may_join(False)  # counted out: the agent probes at once, no local stall needed
    yield board
    board.close(remove=True)


@pytest.fixture
def alive_member() -> Iterator[tuple[str, int]]:
    server = ProbeServer("127.0.0.1").start()
    host, port = server.address.rsplit(":", 1)
    yield host, int(port)
    server.stop()


def _one_round(handler: _Handler, board: LocalBoard) -> list[str]:
    lost: list[str] = []
    probes = MemberProbes(handler, board, lost.append)  # type: ignore[arg-type]
    probes.watch()
    thread = probes._probing
    assert thread is not None, "a counted-out node probes at once"
    thread.join(timeout=30)
    assert not thread.is_alive()
    return lost


def test_a_member_whose_agent_is_gone_is_revoked_and_one_that_answers_is_not(
    board: LocalBoard, alive_member: tuple[str, int]
) -> None:
    handler = _Handler("a", _Presence({"a": (1, None), "b": (2, alive_member), "c": (3, _refused_port())}))
    assert _one_round(handler, board) == ["c"]
    assert [(node, lease) for node, lease, _ in handler.revoked] == [("c", 3)]
    assert "refuses connections" in handler.revoked[0][2]
    assert board.may_join() is False  # one member is unreachable: its joiners would stall the others


def test_a_node_reaching_every_member_again_lets_its_joiners_ask(
    board: LocalBoard, alive_member: tuple[str, int]
) -> None:
    handler = _Handler("a", _Presence({"a": (1, None), "b": (2, alive_member)}))
    assert _one_round(handler, board) == []
    assert handler.revoked == [] and board.may_join() is True


def test_while_the_node_holds_silence_counts_nobody_out_and_proof_still_does(
    board: LocalBoard, alive_member: tuple[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node just counted out for being cut off, whose cut is made one link at a time: for a moment one peer
    answers and another is silent. It is in the majority of what it sees, but its silence is no proof."""
    refused = _refused_port()
    real_probe_all = member_probes.probe_all

    def silent_c(addresses: dict[str, Any], detections: dict[str, Any]) -> dict[str, tuple[Answer, float]]:
        answers = real_probe_all(addresses, detections)
        return {**answers, "c": (Answer.SILENT, 1.0)}

    monkeypatch.setattr(member_probes, "probe_all", silent_c)
    members = {"a": (1, None), "b": (2, alive_member), "c": (3, refused), "d": (4, refused)}
    held = _Handler("a", _Presence(dict(members)), held_until=time.monotonic() + 60.0)
    assert _one_round(held, board) == ["d"]  # refused: proof whoever asks
    assert [node for node, _, _ in held.revoked] == ["d"]
    free = _Handler("a", _Presence(dict(members)))
    assert _one_round(free, board) == ["c", "d"]  # the same answers once the window is over
    assert "link to it is down" in free.revoked[0][2]
