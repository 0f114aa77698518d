"""Decoding values read back from etcd or a store, which anyone with write access may have forged."""

from __future__ import annotations

import json
from typing import Any


def json_object(raw: bytes | str) -> dict[str, Any] | None:
    """``raw`` as a JSON object; None for anything else (bad JSON, a number beyond ``int()``, nesting beyond
    the parser's stack, another JSON type). Never raises."""
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return document if isinstance(document, dict) else None
