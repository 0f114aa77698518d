"""The Wrapper's fault and heartbeat records: round trips, and total parsers for what etcd hands back."""

from __future__ import annotations

import pytest

from elastic_ft.fault_records import (
    MESSAGE_LIMIT,
    Interruption,
    encode_heartbeat,
    encode_interruption,
    parse_heartbeat,
    parse_interruption,
    parse_interruptions,
)


def test_an_interruption_round_trips_with_its_message_cut() -> None:
    line = encode_interruption(3, "RuntimeError", "x" * 2000, 1795450000.5)
    assert line.endswith("\n")
    assert parse_interruption(line) == Interruption(3, "RuntimeError", "x" * MESSAGE_LIMIT, 1795450000.5)


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1, 2]",
        '{"kind": "x"}',
        '{"rank": 1}',
        '{"rank": -1, "kind": "x"}',
        '{"rank": true, "kind": "x"}',
        '{"rank": 1.5, "kind": "x"}',
        '{"rank": 1e400, "kind": "x"}',
        '{"rank": 1, "kind": 5}',
        '{"rank": 1, "kind": "x", "message": ["m"]}',
        '{"rank": 1, "kind": "x", "time": "now"}',
        '{"rank": 1, "kind": "x", "time": NaN}',
        '{"rank": 1, "kind": "x", "time": 1e400}',
    ],
)
def test_a_malformed_interruption_is_none(line: str) -> None:
    assert parse_interruption(line) is None


def test_interruptions_keep_the_good_lines_and_name_the_bad() -> None:
    text = encode_interruption(0, "a", "", 1.0) + "garbage\n\n" + encode_interruption(2, "b", "m", 2.0)
    records, malformed = parse_interruptions(text)
    assert [(r.rank, r.kind) for r in records] == [(0, "a"), (2, "b")]
    assert malformed == ["garbage"]


def test_a_heartbeat_round_trips() -> None:
    assert parse_heartbeat(encode_heartbeat(10.0, 9.5)) == (10.0, 9.5)


@pytest.mark.parametrize(
    "text",
    ["", "{}", '{"t": 1}', '{"t": 1, "active": "1"}', '{"t": 1, "active": Infinity}', '{"t": NaN, "active": 1}',
     '{"t": true, "active": 1}', "[1, 2]"],
)  # fmt: skip
def test_a_malformed_or_forged_heartbeat_is_none(text: str) -> None:
    # An infinite "last active" would make every peer look busy forever and disable hang detection.
    assert parse_heartbeat(text) is None
