"""Decoding values read back from etcd or a store, which anyone with write access may have forged.

One error type for every decoder (:class:`MalformedRecord`, the key named
once known: :func:`decode`), one policy for a record a reader can skip
(:class:`SkipLog`: one warning per key and reason), and the total helpers
the decoders share (:func:`json_object`, :func:`is_count`).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeGuard, TypeVar

T = TypeVar("T")


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


def is_count(value: object) -> TypeGuard[int]:
    """A rank, step, size or iteration: a non-negative integer that is not a bool, below 2**63 (etcd's and
    torch's integers)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
