"""Decoding values read back from etcd or a store, which anyone with write access may have forged.

One error type for every decoder (:class:`MalformedRecord`, the key named
once known: :func:`decode`), one policy for a record a reader can skip
(:class:`SkipLog`: one warning per key and reason), the total helpers
(:func:`json_object`, :func:`json_value`, :func:`is_count`: None or False, never an error), and
the one toolkit every decoder of a record checks its fields with
(:func:`json_document`, :func:`integer`, :func:`count_field`,
:func:`text_field`, ...): each names the record (``what``), the field and
the value it got, and says what was expected, in one form::

    world record has max_nodes='2'; expected a whole number
"""

from __future__ import annotations

import json
import logging
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard, TypeVar

T = TypeVar("T")

#: The largest integer etcd (revisions, lease ids) and torch hold: int64.
MAX_INT = 2**63 - 1
#: The longest text a record holds in a field that names something (a node, an address, a segment).
MAX_TEXT = 1024


class MalformedRecord(ValueError):
    """A value read back from etcd or a store is not a record elastic-ft writes there.

    Raised by every decoder (the rendezvous model, ftrun's records, the
    event log, the coordination protocol); ``key``, once known, leads the
    message.
    """

    def __init__(self, reason: str, key: str | None = None) -> None:
        super().__init__(f"{key}: {reason}" if key else reason)
        self.reason = reason
        self.key = key

    def at(self, key: str) -> MalformedRecord:
        """The same error, naming ``key`` (unless it names one already)."""
        return self if self.key is not None else MalformedRecord(self.reason, key)


def decode(key: str, raw: bytes | str, decoder: Callable[[bytes | str], T]) -> T:
    """``decoder(raw)``, where ``raw`` was read at ``key``: its :class:`MalformedRecord` names the key."""
    try:
        return decoder(raw)
    except MalformedRecord as error:
        raise error.at(key) from None


class SkipLog:
    """What a reader does with a record it can skip: a warning the first time a key is malformed for a reason,
    debug after (a watch re-reads the same forged value at every change)."""

    def __init__(self, logger: logging.Logger, limit: int = 1024) -> None:
        self._log = logger
        self._limit = limit
        self._seen: set[tuple[str | None, str]] = set()
        self._lock = threading.Lock()

    def skip(self, error: MalformedRecord, what: str = "a malformed record") -> None:
        """Log that ``error``'s record is skipped (``what`` it is, for the message)."""
        with self._lock:
            first = (error.key, error.reason) not in self._seen
            if first and len(self._seen) < self._limit:
                self._seen.add((error.key, error.reason))
        (self._log.warning if first else self._log.debug)("skipping %s: %s", what, error)


def json_object(raw: bytes | str) -> dict[str, Any] | None:
    """``raw`` as a JSON object; None for anything else (bad JSON, a number beyond ``int()``, nesting beyond
    the parser's stack, another JSON type). Never raises."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def json_value(raw: bytes | str | None) -> object:
    """``raw`` as any JSON value; None for bad JSON (as for ``null``, and nothing given). Never raises."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def is_count(value: object) -> TypeGuard[int]:
    """A rank, step, size or iteration: a non-negative integer that is not a bool, below 2**63 (etcd's and
    torch's integers)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


# ---- the toolkit of the decoders: one check per kind of field, one form of message ----


def _wrong(what: str, name: str, value: object, expected: str) -> MalformedRecord:
    return MalformedRecord(f"{what} has {name}={value!r:.100}; expected {expected}")


def json_document(raw: bytes | str, what: str) -> dict[str, Any]:
    """``raw`` as a JSON object, or :class:`MalformedRecord` saying what it is instead (not JSON: a number beyond
    ``int()`` and nesting beyond the parser's stack included)."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError) as error:
        raise MalformedRecord(f"{what} is not JSON ({type(error).__name__})") from None
    if not isinstance(document, dict):
        raise MalformedRecord(f"{what} is not a JSON object: {document!r:.100}")
    return document


def integer(value: object, name: str, what: str, low: int = 0, high: int = MAX_INT) -> int:
    """``value`` (field ``name`` of ``what``) if it is an integer from ``low`` to ``high`` (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        bounds = "" if (low, high) == (0, MAX_INT) else f" from {low} to {high}"
        raise _wrong(what, name, value, f"a whole number{bounds}")
    return value


def count_field(document: Mapping[str, Any], name: str, what: str, low: int = 0, high: int = MAX_INT) -> int:
    """Field ``name`` of ``document`` as :func:`integer` checks it (a missing field is ``None``: wrong)."""
    return integer(document.get(name), name, what, low, high)


def optional_count_field(
    document: Mapping[str, Any], name: str, what: str, low: int = 0, high: int = MAX_INT
) -> int | None:
    """Field ``name``, None when it is missing or null, else as :func:`count_field` checks it."""
    value = document.get(name)
    return None if value is None else integer(value, name, what, low, high)


def typed_field(document: Mapping[str, Any], name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """Field ``name`` if it is of ``kind`` (a bool is never an ``int``)."""
    value = document.get(name)
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        expected = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise _wrong(what, name, value, expected)
    return value


def flag_field(document: Mapping[str, Any], name: str, what: str, default: bool = False) -> bool:
    """Field ``name`` as true or false (``default`` when missing)."""
    value = document.get(name, default)
    if not isinstance(value, bool):
        raise _wrong(what, name, value, "true or false")
    return value


def text_field(document: Mapping[str, Any], name: str, what: str, max_length: int = MAX_TEXT) -> str:
    """Field ``name`` as a non-empty text of at most ``max_length`` characters."""
    value = document.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= max_length:
        raise _wrong(what, name, value, f"a non-empty text of at most {max_length} characters")
    return value


def int_list_field(document: Mapping[str, Any], name: str, what: str) -> tuple[int, ...]:
    """Field ``name`` as a list of integers."""
    value = document.get(name)
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise _wrong(what, name, value, "a list of integers")
    return tuple(value)


def text_list_field(document: Mapping[str, Any], name: str, what: str, max_items: int) -> tuple[str, ...]:
    """Field ``name`` (an empty list when missing) as at most ``max_items`` non-empty texts of at most
    :data:`MAX_TEXT` characters."""
    value = document.get(name, [])
    if (
        not isinstance(value, list)
        or len(value) > max_items
        or not all(isinstance(item, str) and 0 < len(item) <= MAX_TEXT for item in value)
    ):
        raise _wrong(what, name, value, f"a list of at most {max_items} non-empty texts")
    return tuple(value)


def epoch_seconds(value: object, name: str, what: str) -> float:
    """``value`` as a finite, non-negative UNIX time (an integer beyond a float, or inf from 1e400, is not one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong(what, name, value, "a finite number of seconds since the epoch")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise _wrong(what, name, value, "a finite number of seconds since the epoch")
    return seconds
