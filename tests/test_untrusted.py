"""The decoding layer: one error type that names the key, one skip policy, total helpers."""

from __future__ import annotations

import ast
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from elastic_ft.coordination.termination import TerminationResult
from elastic_ft.launcher.records import NodeRecord, WorldRecord
from elastic_ft.observability.events import JobEvent
from elastic_ft.rendezvous.model import Board
from elastic_ft.untrusted import (
    MalformedRecord,
    SkipLog,
    count_field,
    decode,
    epoch_seconds,
    flag_field,
    int_list_field,
    integer,
    is_count,
    json_document,
    json_object,
    json_value,
    optional_count_field,
    text_field,
    text_list_field,
    typed_field,
)


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


@pytest.mark.parametrize(
    ("check", "message"),
    [
        (lambda: json_document(b"{", "a board"), "a board is not JSON (JSONDecodeError)"),
        (lambda: json_document(b"[" * 100_000, "a board"), "a board is not JSON (RecursionError)"),
        (lambda: json_document(b"[1]", "a board"), "a board is not a JSON object: [1]"),
        (lambda: count_field({"n": True}, "n", "a record"), "a record has n=True; expected a whole number"),
        (lambda: count_field({}, "n", "a record"), "a record has n=None; expected a whole number"),
        (lambda: count_field({"n": 9}, "n", "a record", 1, 8), "a record has n=9; expected a whole number from 1 to 8"),
        (lambda: integer(2**63, "n", "a record"), "expected a whole number"),
        (lambda: typed_field({"s": 1}, "s", str, "a record"), "a record has s=1; expected str"),
        (lambda: typed_field({"t": True}, "t", (int, float), "a record"), "expected int or float"),
        (lambda: flag_field({"f": 1}, "f", "a record"), "a record has f=1; expected true or false"),
        (lambda: text_field({"t": ""}, "t", "a record"), "expected a non-empty text of at most 1024 characters"),
        (lambda: text_field({"t": "x" * 1025}, "t", "a record"), "expected a non-empty text"),
        (lambda: int_list_field({"l": [1, True]}, "l", "a record"), "expected a list of integers"),
        (lambda: text_list_field({"l": ["a", ""]}, "l", "a record", 4), "expected a list of at most 4 non-empty"),
        (lambda: text_list_field({"l": ["a"] * 5}, "l", "a record", 4), "expected a list of at most 4 non-empty"),
        (lambda: epoch_seconds(float("inf"), "time", "a record"), "a record has time=inf; expected a finite"),
        (lambda: epoch_seconds(10**400, "time", "a record"), "expected a finite number of seconds"),
        (lambda: epoch_seconds(-1, "time", "a record"), "expected a finite number of seconds"),
    ],
)
def test_the_toolkit_names_the_record_the_field_and_the_value_and_says_what_was_expected(
    check: Callable[[], object], message: str
) -> None:
    with pytest.raises(MalformedRecord) as caught:
        check()
    assert message in str(caught.value)


def test_the_toolkit_passes_what_is_well_formed() -> None:
    assert json_document(b'{"a": 1}', "r") == {"a": 1}
    assert count_field({"n": 3}, "n", "r", 1, 3) == 3 and optional_count_field({}, "n", "r") is None
    assert typed_field({"t": 1.5}, "t", (int, float), "r") == 1.5 and flag_field({}, "f", "r") is False
    assert text_list_field({}, "l", "r", 4) == () and int_list_field({"l": [1, -2]}, "l", "r") == (1, -2)
    assert epoch_seconds(1700000000, "time", "r") == 1700000000.0
    assert json_value(b"[1, 2]") == [1, 2] and json_value(b"{") is None and json_value(None) is None


#: The decoders of records read back from etcd, a store or a file: they check fields with the toolkit above,
#: not with a JSON parser and checks of their own.
DECODERS = (
    "launcher/records.py",
    "rendezvous/model.py",
    "observability/events.py",
    "observability/event_files.py",
    "coordination/termination.py",
    "coordination/fault_records.py",
    "coordination/job.py",
    "coordination/iteration.py",
    "etcd/event_log.py",
    "inprocess/healing/heal.py",
    "inprocess/healing/transfer.py",
    "inprocess/rank_assignment/replicas.py",
    "rendezvous/presence.py",
    "handoff.py",
    "job_config.py",
    "launcher/status.py",
)


@pytest.mark.parametrize("module", DECODERS)
def test_every_decoder_parses_json_through_the_toolkit(module: str) -> None:
    path = Path(__file__).resolve().parents[1] / "elastic_ft" / module
    calls = [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("json.loads", "json.load")
    ]
    assert calls == [], f"{module} parses JSON itself at lines {calls}: use elastic_ft.untrusted"
