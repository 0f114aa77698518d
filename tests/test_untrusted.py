"""The decoding layer: one error type that names the key, one skip policy, total helpers."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from elastic_ft.coordination.iteration import TerminationResult
from elastic_ft.launcher.records import NodeRecord
from elastic_ft.observability.events import JobEvent
from elastic_ft.rendezvous.model import Board
from elastic_ft.untrusted import MalformedRecord, SkipLog, decode, is_count, json_object


@pytest.mark.parametrize(
    "decoder",
    [
        Board.from_json,
        NodeRecord.from_json,
        JobEvent.from_json,
        lambda raw: TerminationResult.from_json(raw, 4),
    ],
    ids=["rendezvous board", "ftrun node record", "event", "termination result"],
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
