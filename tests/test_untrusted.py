"""The decoding layer: one error type that names the key, one skip policy, total helpers."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from elastic_ft.coordination.iteration import TerminationResult
from elastic_ft.launcher.records import NodeRecord, WorldRecord
from elastic_ft.observability.events import JobEvent
from elastic_ft.rendezvous.model import Board
from elastic_ft.untrusted import MalformedRecord, SkipLog, decode, is_count, json_object


@pytest.mark.parametrize(
    "decoder",
    [
        Board.from_json,
        NodeRecord.from_json,
        WorldRecord.from_json,
        JobEvent.from_json,
        lambda raw: TerminationResult.from_json(raw, 4),
    ],
    ids=["rendezvous board", "ftrun node record", "ftrun world record", "event", "termination result"],
)
@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'{"unexpected": true}', b"[" * 100_000])
def test_every_decoder_raises_the_one_error_type_with_the_key_named(
    decoder: Callable[[bytes], object], raw: bytes
) -> None:
    with pytest.raises(MalformedRecord) as caught:
        decode("/elastic_ft/run/some/key", raw, decoder)
    assert str(caught.value).startswith("/elastic_ft/run/some/key: ")
    assert caught.value.key == "/elastic_ft/run/some/key" and caught.value.reason
    assert isinstance(caught.value, ValueError)  # callers that caught ValueError still do


def test_the_world_record_round_trips_and_counts_late_members_beyond_max_nodes_as_spares() -> None:
    world = WorldRecord(world_size=4, active_world_size=None, max_nodes=2)
    assert WorldRecord.from_json(world.to_json()) == world
    assert [world.spares_with(members) for members in (1, 2, 3, 4)] == [0, 0, 1, 2]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"world_size": 4, "max_nodes": "2"}', "max_nodes='2'; expected a whole number"),
        (b'{"world_size": true, "max_nodes": 2}', "world_size=True; expected a whole number"),
        (b'{"world_size": 4, "max_nodes": 2, "active_world_size": -1}', "active_world_size=-1; expected"),
        (b'{"world_size": 4, "max_nodes": 0}', "max_nodes=0; expected at least 1"),
        (b'{"world_size": 0, "max_nodes": 2}', "world_size=0; expected at least 1"),
    ],
)
def test_a_forged_world_record_names_the_bad_field(raw: bytes, reason: str) -> None:
    with pytest.raises(MalformedRecord, match=reason):
        decode("/elastic_ft/run/store/ftrun/world", raw, WorldRecord.from_json)


def test_an_error_naming_its_key_keeps_it() -> None:
    error = MalformedRecord("bad", "first")
    assert error.at("second") is error and str(error) == "first: bad"
    assert str(MalformedRecord("bad").at("k")) == "k: bad"


def test_a_skipped_record_warns_once_per_key_and_reason(caplog: pytest.LogCaptureFixture) -> None:
    skipped = SkipLog(logging.getLogger("test.untrusted"))
    with caplog.at_level(logging.DEBUG, logger="test.untrusted"):
        for _ in range(3):
            skipped.skip(MalformedRecord("not JSON", "a"), "a board")
        skipped.skip(MalformedRecord("too long", "a"), "a board")
        skipped.skip(MalformedRecord("not JSON", "b"), "a board")
    levels = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert levels == [
        ("WARNING", "skipping a board: a: not JSON"),
        ("DEBUG", "skipping a board: a: not JSON"),
        ("DEBUG", "skipping a board: a: not JSON"),
        ("WARNING", "skipping a board: a: too long"),
        ("WARNING", "skipping a board: b: not JSON"),
    ]


def test_the_total_helpers_never_raise() -> None:
    assert json_object(b'{"a": 1}') == {"a": 1}
    assert json_object(b"[" * 100_000) is None and json_object(b"1e999999") is None and json_object("[]") is None
    assert is_count(0) and is_count(2**63 - 1)
    assert not any(is_count(v) for v in (-1, 2**63, True, 1.0, "1", None))
