"""Decoding values read back from etcd or a store, which anyone with write access may have forged."""

from __future__ import annotations

import json
from typing import Any, TypeGuard


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
